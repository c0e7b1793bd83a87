//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` (RLQS): the
//! Envoys hold the quota themselves.
//!
//! Each Envoy streams usage reports per bucket and enforces the token
//! bucket it is assigned, with no call per request. For every bucket the
//! replicas divide the bucket's rate among themselves through the store
//! (`lua/rate_share.lua`: each holds a share under an expiry, never more
//! than the limit together), and each divides what it holds among the
//! Envoys connected to it, max-min fair by their reported demand.
//!
//! **The bound.** A bucket of `limit` per `period` admits at most `limit`
//! in any interval of one `period` across the fleet, once its Envoys have
//! assignments, given that
//! 1. each Envoy's assignment is a token bucket of [`RESERVE`] tokens
//!    filling at `rate` per `period`, and a replica holds at least the sum
//!    of its Envoys' `rate + RESERVE` — a bucket never holds more than
//!    `RESERVE` tokens, so an Envoy admits at most `rate + RESERVE` in a
//!    period (a replacement bucket starts no fuller than the one it
//!    replaces, in Envoy 1.40);
//! 2. a replica lowers what it holds only [`DELIVERY`] after it sent the
//!    lower assignments (a stream message arrives within that);
//! 3. an assignment expires before the hold behind it: assignments live
//!    [`ASSIGNMENT_TTL`], holds [`HOLD_TTL`], renewed every [`RENEW`]
//!    (the replica's and the store's clocks run at the same rate);
//! 4. Envoy's `expired_assignment_behavior` does not admit more than the
//!    expired assignment (DENY_ALL, or the same token bucket), and its
//!    `expired_assignment_behavior_timeout` is set (unset, it is zero and
//!    `no_assignment_behavior` takes over at once).
//!
//! Before a bucket's first assignment Envoy's `no_assignment_behavior`
//! decides, outside this bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tokio::sync::{mpsc, Notify};
use tonic::Status;

use crate::failure::FailurePolicy;
use crate::quota::Quota;
use crate::server::config::NoMatch;
use crate::server::table::Table;
use crate::share::{fair, ShareCall};
use crate::store::Store;

mod actions;
mod stream;

use actions::{blanket, send, token_bucket};

/// How often every bucket's hold is renewed and its assignments sent.
pub const RENEW: Duration = Duration::from_millis(500);
/// How long a replica's hold on a bucket's rate lasts without renewal.
pub const HOLD_TTL: Duration = Duration::from_secs(4);
/// How long an assignment lasts in Envoy without renewal (whole seconds:
/// Envoy reads only the seconds).
pub const ASSIGNMENT_TTL: Duration = Duration::from_secs(2);
/// The tokens an Envoy's bucket may hold, set aside from its share: what
/// it may admit at once beyond its rate. One token wastes the time it
/// sits full (an Envoy assigned its own demand of 30 a second admitted
/// about 20); two absorb most of that.
pub const RESERVE: u64 = 2;
/// How long an assignment sent takes to be in force in its Envoy, at
/// most (a gRPC stream message): until then the rate before it counts as
/// in use.
pub const DELIVERY: Duration = Duration::from_secs(1);
/// How long an Envoy may go without reporting on a bucket before it loses
/// its seat (Envoy 1.40 reported about every 5 s).
pub const SILENT: Duration = Duration::from_secs(20);
/// How long a bucket no Envoy reports on is kept before it is abandoned.
pub const IDLE: Duration = Duration::from_secs(60);

/// The RLQS service of one replica.
#[derive(Clone)]
pub struct Rlqs {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Rlqs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rlqs")
            .field("holder", &self.inner.holder)
            .finish_non_exhaustive()
    }
}

struct Inner {
    table: Arc<ArcSwap<Table>>,
    store: Store,
    policy: FailurePolicy,
    /// This replica's name in the store's holds.
    holder: String,
    state: Mutex<State>,
    next_envoy: AtomicU64,
    wake: Notify,
}

#[derive(Default)]
struct State {
    envoys: HashMap<u64, mpsc::Sender<Result<RateLimitQuotaResponse, Status>>>,
    buckets: HashMap<(String, String), Bucket>,
}

/// One bucket id of one domain, as this replica serves it.
struct Bucket {
    id: BucketId,
    /// The rule's quota, or what an unmatched bucket gets.
    rule: Rule,
    store_key: String,
    envoys: HashMap<u64, Seat>,
    /// What this replica holds in the store, and until when (its clock).
    held: u64,
    hold_until: Option<Instant>,
    last_report: Instant,
    /// What Envoys that left (stream gone, or silent) may still admit
    /// under their last assignment, and until when: held until then.
    departed: Vec<(u64, Instant)>,
}

#[derive(Clone)]
enum Rule {
    Quota { quota: Quota, label: String },
    Blanket(NoMatch),
}

/// One Envoy's place in a bucket.
#[derive(Default)]
struct Seat {
    /// Requests per period it reported (allowed and denied).
    demand: u64,
    /// The rate it was last sent.
    rate: Option<u64>,
    /// The rate it was sent before the current one, and until when it
    /// may still be in use (its replacement is on its way).
    replaced: Option<(u64, Instant)>,
    /// When its assignment was last sent.
    sent: Option<Instant>,
    /// When it last reported.
    reported: Option<Instant>,
}

impl Seat {
    /// What its assignments may admit in a period (rate and tokens, the
    /// one before too while its replacement is on its way), at `now`.
    fn in_use(&self, now: Instant) -> u64 {
        let before = self
            .replaced
            .filter(|(_, until)| *until > now)
            .map(|(r, _)| r);
        self.rate.max(before).map_or(0, |r| r + RESERVE)
    }

    /// Its last assignment's reach, for an Envoy leaving: until it lapses.
    fn departing(&self, now: Instant) -> Option<(u64, Instant)> {
        let sent = self.sent?;
        Some((self.in_use(now), sent + ASSIGNMENT_TTL)).filter(|(n, _)| *n > 0)
    }
}

impl Rlqs {
    /// The service on `table`'s `rlqs` sections, sharing each bucket's
    /// rate through `store` with the other replicas.
    pub fn new(table: Arc<ArcSwap<Table>>, store: Store, policy: FailurePolicy) -> Rlqs {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let holder = format!(
            "{}-{}-{nanos:x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Rlqs {
            inner: Arc::new(Inner {
                table,
                store,
                policy,
                holder,
                state: Mutex::default(),
                next_envoy: AtomicU64::new(1),
                wake: Notify::new(),
            }),
        }
    }

    /// Renews holds and sends assignments every [`RENEW`] (or sooner, when
    /// a bucket appears) until dropped.
    pub async fn run(self) {
        loop {
            let woken = self.inner.wake.notified();
            self.inner.round().await;
            let _ = tokio::time::timeout(RENEW, woken).await;
        }
    }

    /// Ends every Envoy's stream (at shutdown). The holds are left to
    /// expire: the assignments sent under them may be in use until then.
    pub fn close(&self) {
        self.inner.lock().envoys.clear();
    }
}

/// The rule `table` gives bucket `id` of `domain`.
fn resolve(table: &Table, domain: &str, id: &BucketId) -> Rule {
    let Some(config) = table.domain(domain).and_then(|d| d.config.rlqs()) else {
        return Rule::Blanket(NoMatch::Allow);
    };
    let entries: Vec<(&str, &str)> = id
        .bucket
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    match config.rule(&entries) {
        Some(rule) => Rule::Quota {
            quota: rule.quota,
            label: rule.label(),
        },
        None => Rule::Blanket(config.no_match),
    }
}

fn canonical(id: &BucketId) -> String {
    let mut entries: Vec<(&String, &String)> = id.bucket.iter().collect();
    entries.sort();
    let mut out = String::new();
    for (k, v) in entries {
        out.push_str(&format!("{}:{k}={}:{v};", k.len(), v.len()));
    }
    out
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Folds one message of Envoy `envoy` in.
    fn report(&self, envoy: u64, domain: &str, reports: &RateLimitQuotaUsageReports) {
        let table = self.table.load();
        let mut state = self.lock();
        let mut fresh = false;
        for usage in &reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id.clone() else {
                continue;
            };
            let key = canonical(&id);
            let bucket = state
                .buckets
                .entry((domain.to_owned(), key.clone()))
                .or_insert_with(|| {
                    fresh = true;
                    Bucket {
                        rule: resolve(&table, domain, &id),
                        id,
                        store_key: format!("rlqs:{domain}:{key}"),
                        envoys: HashMap::new(),
                        held: 0,
                        hold_until: None,
                        departed: Vec::new(),
                        last_report: Instant::now(),
                    }
                });
            bucket.last_report = Instant::now();
            let period = match &bucket.rule {
                Rule::Quota { quota, label } => {
                    crate::server::stats::rlqs_reported(domain, label, usage);
                    quota.period()
                }
                Rule::Blanket(_) => Duration::from_secs(1),
            };
            let seen = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            let limit = match &bucket.rule {
                Rule::Quota { quota, .. } => quota.limit(),
                Rule::Blanket(_) => 1,
            };
            let now = Instant::now();
            let seat = bucket.envoys.entry(envoy).or_insert_with(|| {
                fresh = true;
                Seat::default()
            });
            seat.demand = match seat.reported {
                // The first report comes with the bucket's first request
                // and says nothing of its rate: until the next one, the
                // Envoy may want all of it (the shares split evenly).
                None => limit,
                // Measured here, between reports: Envoy's own
                // `time_elapsed` was seen to run short of the time its
                // counts covered.
                Some(last) => {
                    let elapsed = now.duration_since(last).max(Duration::from_millis(100));
                    let per_period = seen as f64 * period.as_secs_f64() / elapsed.as_secs_f64();
                    (per_period.ceil() as u64).clamp(1, limit.max(1))
                }
            };
            seat.reported = Some(now);
        }
        drop(state);
        if fresh {
            self.wake.notify_one();
        }
    }

    /// The call that ends this replica's hold on a bucket.
    fn letting_go(&self) -> ShareCall {
        ShareCall {
            holder: self.holder.clone(),
            demand: 0,
            limit: 0,
            ttl_ms: 0,
            in_use: 0,
        }
    }

    fn leave(&self, envoy: u64) {
        let mut state = self.lock();
        state.envoys.remove(&envoy);
        let now = Instant::now();
        for bucket in state.buckets.values_mut() {
            // Its stream is gone, not its assignment: that stays counted
            // until it lapses.
            if let Some(reach) = bucket.envoys.remove(&envoy).and_then(|s| s.departing(now)) {
                bucket.departed.push(reach);
            }
        }
        drop(state);
        self.wake.notify_one();
    }

    /// Renews every bucket's hold and sends what changed.
    async fn round(&self) {
        let now = Instant::now();
        let table = self.table.load_full();
        let mut gone = Vec::new();
        let keys: Vec<(String, String)> = {
            let mut state = self.lock();
            let State { envoys, buckets } = &mut *state;
            buckets.retain(|(domain, _), bucket| {
                // An Envoy that stopped reporting (connected, but no longer
                // sending this bucket's requests) gives its seat up: its
                // assignment is not renewed and expires.
                let mut silent = Vec::new();
                bucket.envoys.retain(|_, seat| {
                    let keep = seat
                        .reported
                        .is_none_or(|at| now.duration_since(at) < SILENT);
                    if !keep {
                        silent.extend(seat.departing(now));
                    }
                    keep
                });
                bucket.departed.extend(silent);
                bucket.departed.retain(|(_, until)| *until > now);
                // Nobody reports on it any more, or the configuration
                // changed its rule: the Envoys forget it (a bucket they
                // still use comes back with its first request).
                let idle =
                    bucket.envoys.is_empty() && now.duration_since(bucket.last_report) >= IDLE;
                let rule = resolve(&table, domain, &bucket.id);
                let changed = !bucket.rule.same(&rule);
                if changed {
                    for envoy in bucket.envoys.keys() {
                        send(
                            envoys,
                            *envoy,
                            &bucket.id,
                            Action::AbandonAction(AbandonAction {}),
                        );
                    }
                }
                // An idle bucket's hold is let go; a changed one's expires,
                // as its Envoys may use their assignments until the
                // abandon reaches them.
                if idle && bucket.held > 0 {
                    gone.push(bucket.store_key.clone());
                }
                !(idle || changed)
            });
            buckets.keys().cloned().collect()
        };
        for store_key in gone {
            let _ = self.store.share(&store_key, &self.letting_go()).await;
        }
        let mut sums: HashMap<(String, String), (u64, u64)> = HashMap::new();
        for key in keys {
            let call = {
                let state = self.lock();
                let Some(bucket) = state.buckets.get(&key) else {
                    continue;
                };
                let Rule::Quota { quota, .. } = &bucket.rule else {
                    drop(state);
                    self.send_blanket(&key);
                    continue;
                };
                let demand: u64 = bucket.envoys.values().map(|s| s.demand + RESERVE).sum();
                let in_use: u64 = bucket.envoys.values().map(|s| s.in_use(now)).sum::<u64>()
                    + bucket.departed.iter().map(|(n, _)| n).sum::<u64>();
                let holding = !bucket.envoys.is_empty() || !bucket.departed.is_empty();
                (
                    bucket.store_key.clone(),
                    ShareCall {
                        holder: self.holder.clone(),
                        demand: if bucket.envoys.is_empty() { 0 } else { demand },
                        limit: quota.limit(),
                        ttl_ms: if holding {
                            HOLD_TTL.as_millis() as u64
                        } else {
                            0
                        },
                        in_use: in_use.min(bucket.held),
                    },
                )
            };
            let asked = Instant::now();
            let reply = self.store.share(&call.0, &call.1).await;
            if let Some((label, assigned, held)) =
                self.assign(&key, reply.map(|r| (r.grant, r.held)).ok(), asked)
            {
                let sum = sums.entry((key.0.clone(), label)).or_default();
                sum.0 += assigned;
                sum.1 += held;
            }
        }
        for ((domain, label), (assigned, held)) in sums {
            crate::server::stats::rlqs_assigned(&domain, &label, assigned, held);
        }
    }

    /// Divides what the hold `got` among the bucket's Envoys and sends
    /// each its new rate; returns the rule's label, the rate assigned and
    /// the rate held.
    fn assign(
        &self,
        key: &(String, String),
        got: Option<(u64, u64)>,
        asked: Instant,
    ) -> Option<(String, u64, u64)> {
        let mut state = self.lock();
        let State { envoys, buckets } = &mut *state;
        let bucket = buckets.get_mut(key)?;
        let Rule::Quota { quota, label } = bucket.rule.clone() else {
            return None;
        };
        let grant = match got {
            Some((grant, held)) => {
                bucket.held = held;
                bucket.hold_until = Some(asked + HOLD_TTL);
                Some(grant)
            }
            // The store did not answer: the hold stands until it expires;
            // after that, the failure policy.
            None => match bucket.hold_until {
                Some(until) if Instant::now() + ASSIGNMENT_TTL < until => None,
                _ => {
                    let strategy = match self.policy {
                        FailurePolicy::FailClosed => BlanketRule::DenyAll,
                        _ => BlanketRule::AllowAll,
                    };
                    for envoy in bucket.envoys.keys() {
                        send(
                            envoys,
                            *envoy,
                            &bucket.id,
                            blanket(strategy, Some(ASSIGNMENT_TTL)),
                        );
                    }
                    return Some((label, 0, bucket.held));
                }
            },
        };
        let seats: Vec<u64> = bucket.envoys.keys().copied().collect();
        let demands: Vec<u64> = seats.iter().map(|e| bucket.envoys[e].demand).collect();
        let give = grant.unwrap_or_else(|| {
            bucket
                .envoys
                .values()
                .map(|s| s.rate.map_or(0, |r| r + RESERVE))
                .sum()
        });
        let usable = give.saturating_sub(RESERVE * seats.len() as u64);
        let rates = fair(usable, &demands);
        let mut assigned = 0;
        for (envoy, rate) in seats.iter().zip(rates) {
            let seat = bucket.envoys.get_mut(envoy).expect("a seat");
            assigned += rate;
            let due = seat
                .sent
                .is_none_or(|at| at.elapsed() >= ASSIGNMENT_TTL / 2);
            if seat.rate == Some(rate) && !due {
                continue;
            }
            if seat.rate != Some(rate) {
                seat.replaced = seat.rate.map(|r| (r, Instant::now() + DELIVERY));
                seat.rate = Some(rate);
            }
            seat.sent = Some(Instant::now());
            let action = if rate == 0 {
                blanket(BlanketRule::DenyAll, Some(ASSIGNMENT_TTL))
            } else {
                token_bucket(rate, quota.period())
            };
            send(envoys, *envoy, &bucket.id, action);
        }
        Some((label, assigned, bucket.held))
    }

    fn send_blanket(&self, key: &(String, String)) {
        let mut state = self.lock();
        let State { envoys, buckets } = &mut *state;
        let Some(bucket) = buckets.get_mut(key) else {
            return;
        };
        let Rule::Blanket(no_match) = bucket.rule else {
            return;
        };
        let rule = match no_match {
            NoMatch::Allow => BlanketRule::AllowAll,
            NoMatch::Deny => BlanketRule::DenyAll,
        };
        for (envoy, seat) in bucket.envoys.iter_mut() {
            if seat.rate.is_none() {
                seat.rate = Some(0);
                send(envoys, *envoy, &bucket.id, blanket(rule, None));
            }
        }
    }
}

impl Rule {
    fn same(&self, other: &Rule) -> bool {
        match (self, other) {
            (Rule::Quota { quota: a, label: x }, Rule::Quota { quota: b, label: y }) => {
                a == b && x == y
            }
            (Rule::Blanket(a), Rule::Blanket(b)) => a == b,
            _ => false,
        }
    }
}
