//! A seeded simulation of the RLQS bound: replicas sharing one embedded
//! store on the harness's virtual clock, and model Envoys that enforce what they are sent
//! the way Envoy 1.40 does (probed by `tests/rlqs_envoy_buckets.rs`),
//! with demand that changes, reports at random intervals, messages that
//! take up to [`DELIVERY`] to arrive, streams that break while the Envoy
//! keeps enforcing, replicas that die and are replaced, a store that
//! loses every hold (a Redis restarted empty), and reloads that move the
//! bucket's rule in the file. Limits run from 1 to 100 a second. The
//! oracle: admissions across the fleet in every window of one period are
//! at most the limit.
//!
//! `SIM_SEEDS=N` runs N seeds (default 40); `SIM_SEED=seed SIM_TRACE=1`
//! replays one seed and prints its rounds, deliveries and admissions.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tokio::sync::mpsc;
use tonic::Status;

use super::{Rlqs, DELIVERY, RENEW};
use crate::config::Config;
use crate::table::{Mode, Settings, Table};
use slicelimit::FailurePolicy;
use slicelimit::MemoryStore;
use slicelimit_sim::VirtualClock;

type Inbox = mpsc::Receiver<Result<RateLimitQuotaResponse, Status>>;

const TICK: Duration = Duration::from_millis(10);
const TICKS: u64 = 3_000;

/// `SIM_TRACE=1` (with `SIM_SEED=seed`) prints what happens.
fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SIM_TRACE").is_ok())
}

/// splitmix64: enough randomness for a simulation, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1_000) < per_mille
    }
}

/// What an Envoy enforces on the bucket.
#[derive(Debug, Clone, PartialEq)]
enum Enforced {
    /// No assignment yet, or an expired one: modelled as DENY_ALL (the
    /// recommended `expired_assignment_behavior`; a `no_assignment_behavior`
    /// of ALLOW_ALL is outside the bound).
    Nothing,
    Blanket(bool),
    Bucket {
        per_fill: u32,
        max: u32,
        fill_nanos: i32,
        per_tick: f64,
        level: f64,
    },
}

struct Envoy {
    /// Its stream now: the replica and its id there, with its inbox.
    stream: Option<(usize, u64, Inbox)>,
    /// Messages read off the stream, and the tick each takes effect.
    arriving: VecDeque<(u64, Action)>,
    enforced: Enforced,
    expires: u64,
    /// Requests a tick, in thousandths.
    demand_milli: u64,
    owed_milli: u64,
    allowed: u64,
    denied: u64,
    next_report: u64,
}

impl Envoy {
    /// Applies `action` at `tick` as Envoy 1.40 does: a token bucket equal
    /// to the one in force (tokens per fill, size, the nanoseconds of the
    /// fill interval) only renews it; another replaces it, filled in
    /// proportion to how full the one before was (a first is full).
    fn apply(&mut self, action: Action, tick: u64) {
        let Action::QuotaAssignmentAction(assignment) = action else {
            // Abandoned: forgotten until the next request reports it.
            self.enforced = Enforced::Nothing;
            self.expires = u64::MAX;
            self.next_report = tick + 1;
            return;
        };
        let ttl = assignment.assignment_time_to_live.map_or(u64::MAX, |d| {
            d.seconds as u64 * 1_000 / TICK.as_millis() as u64
        });
        self.expires = tick.saturating_add(ttl);
        match assignment.rate_limit_strategy.and_then(|s| s.strategy) {
            Some(Strategy::BlanketRule(rule)) => {
                self.enforced = Enforced::Blanket(rule == BlanketRule::AllowAll as i32);
            }
            Some(Strategy::TokenBucket(bucket)) => {
                let per_fill = bucket.tokens_per_fill.map_or(1, |t| t.value);
                let fill = bucket.fill_interval.unwrap_or_default();
                let per_tick = f64::from(per_fill) * TICK.as_secs_f64() / fill.seconds as f64;
                let max = bucket.max_tokens;
                let level = match &self.enforced {
                    Enforced::Bucket {
                        per_fill: p,
                        max: m,
                        fill_nanos: n,
                        ..
                    } if (*p, *m, *n) == (per_fill, max, fill.nanos) => return,
                    Enforced::Bucket { max: m, level, .. } => {
                        level / f64::from(*m) * f64::from(max)
                    }
                    _ => f64::from(max),
                };
                self.enforced = Enforced::Bucket {
                    per_fill,
                    max,
                    fill_nanos: fill.nanos,
                    per_tick,
                    level,
                };
            }
            other => panic!("an assignment Envoy 1.40 does not enforce: {other:?}"),
        }
    }

    /// Decides this tick's requests; returns how many passed.
    fn serve(&mut self, tick: u64) -> u64 {
        if tick >= self.expires {
            self.enforced = Enforced::Nothing;
        }
        if let Enforced::Bucket {
            per_tick,
            level,
            max,
            ..
        } = &mut self.enforced
        {
            *level = (*level + *per_tick).min(f64::from(*max));
        }
        self.owed_milli += self.demand_milli;
        let mut passed = 0;
        while self.owed_milli >= 1_000 {
            self.owed_milli -= 1_000;
            let ok = match &mut self.enforced {
                Enforced::Nothing => false,
                Enforced::Blanket(allow) => *allow,
                Enforced::Bucket { level, .. } if *level >= 1.0 => {
                    *level -= 1.0;
                    true
                }
                Enforced::Bucket { .. } => false,
            };
            if ok {
                passed += 1;
                self.allowed += 1;
            } else {
                self.denied += 1;
            }
        }
        passed
    }
}

fn bucket() -> BucketId {
    BucketId {
        bucket: [("name".to_owned(), "api".to_owned())].into(),
    }
}

/// The table: the bucket's rule, behind another rule (`moved`) or not.
fn table(limit: u64, moved: bool, settings: &Settings) -> Table {
    let other = if moved {
        "    - match: { name: other }\n      rate_limit: { unit: second, requests_per_unit: 5 }\n"
    } else {
        ""
    };
    let yaml = format!(
        "domain: api\nrlqs:\n  buckets:\n{other}    - match: {{ name: api }}\n      \
         rate_limit: {{ unit: second, requests_per_unit: {limit} }}\n"
    );
    let config = Config::parse("sim.yaml", &yaml).expect("parses");
    Table::build(vec![config], settings, None)
        .expect("builds")
        .0
}

struct Fleet {
    limit: u64,
    moved: bool,
    rng: Rng,
    store: MemoryStore,
    /// The store's clock; the replicas' `Instant`s are read from the same
    /// (Tokio's paused) time, so both move together a tick at a time.
    start: Instant,
    tick: u64,
    settings: Settings,
    table: std::sync::Arc<arc_swap::ArcSwap<Table>>,
    replicas: Vec<Rlqs>,
    envoys: Vec<Envoy>,
    /// Admissions per tick, fleet-wide.
    admitted: Vec<u64>,
    /// Ticks at which the store lost every hold.
    losses: Vec<u64>,
}

impl Fleet {
    fn new(seed: u64) -> Fleet {
        let mut rng = Rng(seed);
        let clock = VirtualClock::new(Duration::from_secs(1_000));
        let store = MemoryStore::with_clock(clock.clone());
        let settings = Settings {
            store: store.clone().into(),
            mode: Mode::Exact,
            on_store_error: FailurePolicy::FailClosed,
            merge_domains: false,
        };
        let limit = [1, 2, 3, 5, 10, 20, 100, 100][rng.below(8) as usize];
        let table = table(limit, false, &settings);
        let table = std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(table));
        let replicas = (0..2 + rng.below(2))
            .map(|_| {
                Rlqs::new(
                    table.clone(),
                    settings.store.clone(),
                    FailurePolicy::FailClosed,
                )
            })
            .collect();
        let envoys = (0..2 + rng.below(6))
            .map(|_| Envoy {
                stream: None,
                arriving: VecDeque::new(),
                enforced: Enforced::Nothing,
                expires: u64::MAX,
                demand_milli: rng.below(3 * limit) * 1_000 / 100,
                owed_milli: 0,
                allowed: 0,
                denied: 0,
                next_report: 0,
            })
            .collect();
        Fleet {
            limit,
            moved: false,
            rng,
            store,
            start: clock.start.into_std(),
            tick: 0,
            settings,
            table,
            replicas,
            envoys,
            admitted: Vec::new(),
            losses: Vec::new(),
        }
    }

    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn connect(&mut self, e: usize) {
        let r = self.rng.below(self.replicas.len() as u64) as usize;
        let inner = &self.replicas[r].inner;
        let id = inner
            .next_envoy
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(256);
        inner.lock().envoys.insert(id, tx);
        self.envoys[e].stream = Some((r, id, rx));
        if tracing() {
            eprintln!("{}: envoy {e} connects to {r} as {id}", self.tick);
        }
        self.report(e);
    }

    fn report(&mut self, e: usize) {
        let now = self.now();
        let envoy = &mut self.envoys[e];
        let Some((r, id, _)) = &envoy.stream else {
            return;
        };
        let message = RateLimitQuotaUsageReports {
            domain: "api".into(),
            bucket_quota_usages: vec![BucketQuotaUsage {
                bucket_id: Some(bucket()),
                time_elapsed: None,
                num_requests_allowed: std::mem::take(&mut envoy.allowed),
                num_requests_denied: std::mem::take(&mut envoy.denied),
            }],
        };
        self.replicas[*r].inner.report(*id, "api", &message, now);
    }

    fn disconnect(&mut self, e: usize) {
        let now = self.now();
        if tracing() {
            eprintln!("{}: envoy {e} disconnects", self.tick);
        }
        if let Some((r, id, _)) = self.envoys[e].stream.take() {
            self.replicas[r].inner.leave(id, now);
        }
    }

    /// A replica dies: its Envoys' streams break (they keep what they
    /// enforce), and a new replica takes its place.
    fn replace_replica(&mut self, r: usize) {
        if tracing() {
            eprintln!("{}: replica {r} replaced", self.tick);
        }
        for envoy in &mut self.envoys {
            if matches!(envoy.stream, Some((at, _, _)) if at == r) {
                envoy.stream = None;
            }
        }
        let store = self.settings.store.clone();
        self.replicas[r] = Rlqs::new(self.table.clone(), store, FailurePolicy::FailClosed);
    }

    async fn step(&mut self) {
        let tick = self.tick;
        // Faults and changes.
        for e in 0..self.envoys.len() {
            if self.rng.chance(2) {
                self.envoys[e].demand_milli = self.rng.below(3 * self.limit) * 1_000 / 100;
            }
            match &self.envoys[e].stream {
                None if self.rng.chance(20) => self.connect(e),
                Some(_) if self.rng.chance(1) => self.disconnect(e),
                _ => {}
            }
            if tick >= self.envoys[e].next_report {
                self.report(e);
                self.envoys[e].next_report = tick + 50 + self.rng.below(450);
            }
        }
        if self.rng.chance(1) {
            let r = self.rng.below(self.replicas.len() as u64) as usize;
            self.replace_replica(r);
        }
        if self.rng.below(2_000) == 0 {
            if tracing() {
                eprintln!("{tick}: the store forgets every hold");
            }
            self.store.flush();
            self.losses.push(tick);
        }
        if self.rng.below(1_000) == 0 {
            self.moved = !self.moved;
            if tracing() {
                eprintln!("{tick}: reload, the rule moved {}", self.moved);
            }
            let moved = table(self.limit, self.moved, &self.settings);
            self.table.store(std::sync::Arc::new(moved));
        }
        for replica in &self.replicas {
            *replica.inner.fixed.lock().expect("lock") = Some(self.now());
        }
        // Rounds, each replica every RENEW at its own phase.
        let every = RENEW.as_millis() as u64 / TICK.as_millis() as u64;
        let now = self.now();
        for (r, replica) in self.replicas.iter().enumerate() {
            if (tick + r as u64 * 17).is_multiple_of(every) {
                replica.inner.round(now).await;
                if tracing() {
                    let state = replica.inner.lock();
                    for b in state.buckets.values() {
                        let seats: Vec<_> = b
                            .envoys
                            .iter()
                            .map(|(id, s)| {
                                (
                                    *id,
                                    s.demand,
                                    s.given.map(|g| g.reach()),
                                    s.in_use(now, Duration::from_secs(1)),
                                )
                            })
                            .collect();
                        eprintln!(
                            "{tick}: replica {r} held {} in_use {} departed {:?} seats {:?}",
                            b.held,
                            b.in_use(now),
                            b.departed
                                .iter()
                                .map(|(n, u)| (*n, u.duration_since(self.start).as_millis() / 10))
                                .collect::<Vec<_>>(),
                            seats
                        );
                    }
                }
            }
        }
        // Delivery: each message takes effect within DELIVERY, in order.
        let most = DELIVERY.as_millis() as u64 / TICK.as_millis() as u64;
        let mut passed = 0;
        for (index, envoy) in self.envoys.iter_mut().enumerate() {
            if let Some((_, _, inbox)) = &mut envoy.stream {
                while let Ok(message) = inbox.try_recv() {
                    let Ok(message) = message else { continue };
                    let after = envoy.arriving.back().map_or(tick, |(at, _)| *at);
                    let at = after.max(tick + self.rng.below(most));
                    for action in message.bucket_action {
                        envoy.arriving.extend(action.bucket_action.map(|a| (at, a)));
                    }
                }
            }
            while envoy.arriving.front().is_some_and(|(at, _)| *at <= tick) {
                let (_, action) = envoy.arriving.pop_front().expect("one");
                envoy.apply(action, tick);
                if tracing() {
                    eprintln!("{tick}: envoy {index} now {:?}", envoy.enforced);
                }
            }
            let p = envoy.serve(tick);
            if tracing() && p > 0 {
                eprintln!("{tick}: envoy {index} passed {p}");
            }
            passed += p;
        }
        self.admitted.push(passed);
        self.tick += 1;
        tokio::time::advance(TICK).await;
        let _ = &self.store;
    }
}

/// The first window of one second that admits more than the bound:
/// the limit, or twice it in a window that overlaps the time after the
/// store lost the holds (a replica that held nothing before cannot tell,
/// and may be granted what the others' Envoys still admit under): as
/// (admissions, its last tick, its bound).
fn violation(admitted: &[u64], limit: u64, losses: &[u64]) -> Option<(u64, usize, u64)> {
    let span = (Duration::from_secs(1).as_millis() / TICK.as_millis()) as usize;
    let after_loss =
        (super::tokens_ttl(Duration::from_secs(1)).as_millis() / TICK.as_millis()) as usize + span;
    let mut sum = 0;
    for end in 0..admitted.len() {
        sum += admitted[end];
        if end >= span {
            sum -= admitted[end - span];
        }
        let start = end.saturating_sub(span);
        let lost = losses
            .iter()
            .any(|&at| (at as usize) <= end && start <= at as usize + after_loss);
        let bound = if lost { 2 * limit } else { limit };
        if sum > bound {
            return Some((sum, end + 1, bound));
        }
    }
    None
}

fn run(seed: u64) -> (Option<(u64, usize, u64)>, u64, u64) {
    slicelimit_sim::seeds::paused_runtime().block_on(async {
        let mut fleet = Fleet::new(seed);
        for _ in 0..TICKS {
            fleet.step().await;
        }
        let broken = violation(&fleet.admitted, fleet.limit, &fleet.losses);
        (broken, fleet.admitted.iter().sum(), fleet.limit)
    })
}

#[test]
fn fleet_admissions_stay_within_the_limit_in_every_window() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let seeds = slicelimit_sim::seeds::seeds(40, &[], 0);
    let total = AtomicU64::new(0);
    let capacity = AtomicU64::new(0);
    slicelimit_sim::seeds::run(
        &seeds,
        "cargo test -p slicelimit-server --lib rlqs::sim -- --nocapture",
        |seed| {
            let (broken, admitted, limit) = run(seed);
            if let Some((admitted, tick, bound)) = broken {
                return Err(format!(
                    "{admitted} admitted in the second to tick {tick}, bound {bound}"
                ));
            }
            total.fetch_add(admitted, Ordering::Relaxed);
            capacity.fetch_add(limit * TICKS / 100, Ordering::Relaxed);
            Ok(format!("{admitted} admitted, limit {limit}"))
        },
    );
    let (total, capacity) = (total.into_inner(), capacity.into_inner());
    if std::env::var("SIM_SEED").is_ok() {
        return;
    }
    // The fleet is not simply denying everything.
    eprintln!("{total} admitted of {capacity} the limits allowed");
    assert!(total * 4 > capacity, "{total} admitted of {capacity}");
}
