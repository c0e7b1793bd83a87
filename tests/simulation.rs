//! The seeded simulation: every published bound, searched for violations.
//!
//! Each seed draws a scenario — an algorithm, strict or optimistic, 2–6
//! processes (real hybrid `Limiter`s), a quota, 1–6 keys, a fault schedule
//! (delayed, lost-after-applied, lost-before, duplicated replies; an outage
//! that opens the breakers; the store restarted empty), a coarse clock
//! lagging by up to its guard, `max_keys` pressure, `reconfigure` mid-run,
//! futures dropped at random await points, costs from 0 to `u64::MAX` —
//! and runs it on a virtual clock (Tokio's paused time) over the embedded
//! store behind a fault-injecting wrapper. The oracle then checks:
//!
//! - fixed window: admitted per window ≤ limit (strict), ≤ limit + N·max_debt
//!   (optimistic); the store's count of each window ≥ what was admitted in
//!   it (strict: every admitted permit was counted, none given back twice);
//! - token bucket / GCRA: over every interval T, admitted ≤ burst +
//!   rate·(T + h) (optimistic: + N·max_debt + the overshoot metric);
//! - the overshoot metric never under-reports the actual excess and never
//!   exceeds what was admitted on credit; strict never admits on credit;
//! - no store entry lives without a TTL, none longer than its quota needs;
//! - no completed decision took longer than `max_wait` plus the store's
//!   timeouts; `shutdown` returns.
//!
//! Windows and intervals touched by a restart of the store are exempt: a
//! store that forgot its counts grants a second budget (README, bounds).
//!
//! `SIM_SEEDS=N` runs N seeds (default 60) and the seeds that once failed
//! (`FOUND`), `SIM_SEED=S` one seed, and
//! `SIM_REDIS_SEEDS=N` replays N of them against a real `redis-server` in
//! real time (default 2). A failing seed prints the command that replays it.

mod support;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use slicelimit::{
    Algorithm, Clock, Decision, FailurePolicy, Faults, FaultyStore, HybridConfig, Limiter,
    MemoryStore, Quota, Source, Store,
};
use support::VirtualClock;

/// xorshift64*: small, seedable, good enough to draw scenarios.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x9E37_79B9_7F4A_7C15 | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
}

/// A clock that advances only in steps of `tick`: it lags the virtual
/// clock by up to a tick, as the kernel's coarse clock does.
#[derive(Clone)]
struct SteppedClock {
    inner: Arc<dyn Clock>,
    tick_us: u64,
}

impl Clock for SteppedClock {
    fn now(&self) -> Duration {
        let us = self.inner.now().as_micros() as u64;
        Duration::from_micros(us - us % self.tick_us)
    }
}

#[derive(Debug, Clone)]
struct Scenario {
    algorithm: Algorithm,
    max_debt: Option<u64>,
    processes: usize,
    keys: usize,
    limit: u64,
    period: Duration,
    burst: u64,
    horizon: Duration,
    max_wait: Duration,
    max_keys: usize,
    faults: Faults,
    outage: Option<(Duration, Duration)>,
    restart_at: Option<Duration>,
    reconfigure_at: Option<Duration>,
    lag_tick: Option<Duration>,
    drop_chance: f64,
    rate_per_process: f64,
    duration: Duration,
    /// How far a recorded decision time may be from the admission (real
    /// time only: a thread descheduled after its decision).
    attribution_slack: Duration,
    /// A second quota on every key (`Builder::and`), window algorithms:
    /// (limit, period).
    second: Option<(u64, Duration)>,
    /// How often an admission is refunded later (one quota only, so each
    /// refund's permits have one window to land in).
    refund_chance: f64,
    /// Odd keys get twice the quota (`Builder::quota_for`).
    tiers: bool,
    /// Some decisions wait up to this long (`Limiter::acquire`).
    acquire_wait: Option<Duration>,
    /// Every process doubles its quota then (`Limiter::set_quota`).
    raise_at: Option<Duration>,
}

impl Scenario {
    fn draw(seed: u64) -> Scenario {
        let mut r = Rng::new(seed);
        let algorithm = match r.below(3) {
            // Half the window seeds run the sliding window, drawn apart so
            // every other seed keeps the scenario it always had.
            0 if Rng::new(seed ^ 0x51_1D_E5).chance(0.5) => Algorithm::SlidingWindow,
            0 => Algorithm::FixedWindow,
            1 => Algorithm::TokenBucket,
            _ => Algorithm::Gcra,
        };
        let limit = [1, 3, 10, 25, 100][r.below(5) as usize];
        let period = Duration::from_millis([100, 250, 1000, 2000][r.below(4) as usize]);
        let burst = if windowed(algorithm) {
            limit
        } else {
            (limit / 2 + r.below(limit * 2)).max(1)
        };
        let processes = 2 + r.below(5) as usize;
        let keys = 1 + r.below(6) as usize;
        let faulty = r.chance(0.7);
        let faults = Faults {
            max_delay: Duration::from_micros(r.below(if faulty { 40_000 } else { 3_000 })),
            timeout: Duration::from_millis(25),
            lost_after: if faulty { r.unit() * 0.1 } else { 0.0 },
            lost_before: if faulty { r.unit() * 0.05 } else { 0.0 },
            duplicated: if faulty { r.unit() * 0.1 } else { 0.0 },
        };
        let duration = Duration::from_millis(2_000 + r.below(4_000));
        let at = |r: &mut Rng| Duration::from_micros(r.below(duration.as_micros() as u64));
        let outage = r.chance(0.25).then(|| {
            let start = at(&mut r);
            (start, Duration::from_millis(50 + r.below(500)))
        });
        let restart_at = r.chance(0.15).then(|| at(&mut r));
        let reconfigure_at = r.chance(0.3).then(|| at(&mut r));
        // Demand: from well under the limit to several times over it.
        let fleet_rate = limit as f64 / period.as_secs_f64() * (0.3 + r.unit() * 3.0);
        // Drawn apart, so every seed keeps the scenario it had before.
        let mut extra = Rng::new(seed ^ 0x005E_C04D);
        let second = (windowed(algorithm) && extra.chance(0.3)).then(|| {
            (
                limit * (1 + extra.below(3)),
                period * (2 + extra.below(3) as u32),
            )
        });
        let refund_chance = if second.is_none() && windowed(algorithm) && extra.chance(0.4) {
            extra.unit() * 0.3
        } else {
            0.0
        };
        let tiers = extra.chance(0.3);
        let acquire_wait = extra
            .chance(0.3)
            .then(|| Duration::from_millis([5, 20, 60][extra.below(3) as usize]));
        let raise_at = (extra.chance(0.25) && !tiers && second.is_none()).then(|| at(&mut extra));
        let mut s = Scenario {
            algorithm,
            max_debt: r.chance(0.35).then(|| 1 + r.below((burst / 2).clamp(1, 5))),
            processes,
            keys,
            limit,
            period,
            burst,
            horizon: Duration::from_millis([100, 300, 1000][r.below(3) as usize]),
            max_wait: Duration::from_millis([0, 5, 20, 50][r.below(4) as usize]),
            max_keys: if r.chance(0.25) {
                1 + r.below(keys as u64) as usize
            } else {
                1_000
            },
            faults,
            outage,
            restart_at,
            reconfigure_at,
            lag_tick: r
                .chance(0.5)
                .then(|| Duration::from_millis(1 + r.below(20))),
            drop_chance: if r.chance(0.5) { r.unit() * 0.2 } else { 0.0 },
            rate_per_process: (fleet_rate / processes as f64).min(400.0),
            duration,
            attribution_slack: Duration::ZERO,
            second,
            refund_chance,
            tiers,
            acquire_wait,
            raise_at,
        };
        // A decision `acquire` returns counts when its last check was
        // made, which the driver cannot see: it counts at the return. That
        // is right for leased permits and credit, decided at once, not for
        // one store call's (a key with no room in the map), so waits run
        // only where every key has room.
        if s.max_keys < s.keys {
            s.acquire_wait = None;
        }
        s
    }

    /// Key `key`'s limit and burst: twice the quota's for odd keys when
    /// tiers are drawn.
    fn limit_of(&self, key: usize) -> u64 {
        self.limit * self.tier_factor(key)
    }

    fn burst_of(&self, key: usize) -> u64 {
        self.burst * self.tier_factor(key)
    }

    fn tier_factor(&self, key: usize) -> u64 {
        if self.tiers && key % 2 == 1 {
            2
        } else {
            1
        }
    }

    /// The quota `set_quota` raises every process to.
    fn raised_quota(&self) -> Quota {
        self.tier_quota()
    }

    /// The quota of the odd keys when tiers are drawn.
    fn tier_quota(&self) -> Quota {
        let q = Quota::new(self.limit * 2, self.period).expect("a valid quota");
        if windowed(self.algorithm) {
            q
        } else {
            q.with_burst(NonZeroU32::new(self.burst as u32 * 2).expect("a burst of at least 1"))
        }
    }

    fn quota(&self) -> Quota {
        let q = Quota::new(self.limit, self.period).expect("a valid quota");
        if windowed(self.algorithm) {
            q
        } else {
            q.with_burst(NonZeroU32::new(self.burst as u32).expect("a burst of at least 1"))
        }
    }

    fn config(&self, variant: u64) -> HybridConfig {
        let base = match self.max_debt {
            Some(d) => HybridConfig::optimistic(d),
            None => HybridConfig::strict(),
        };
        // Big fixed leases with no share cap are the adversary's favourite:
        // most of the budget out in one process, given back later.
        let big = (self.burst.max(self.limit) * 9 / 10).max(1);
        let (min, max, share) = match variant % 4 {
            0 => (1, 10_000, 0.5),
            1 => (1, 3, 1.0),
            2 => (big, big, 1.0),
            _ => (2, 50, 0.25),
        };
        base.lease_ttl(self.horizon)
            .refill_horizon(Duration::from_millis(250))
            .max_wait(self.max_wait)
            .max_keys(self.max_keys)
            .idle_ttl(Duration::from_millis(300))
            .lease_bounds(min, max.max(min))
            .share_cap(share)
            .prelease_lead(Duration::from_millis(if variant.is_multiple_of(2) {
                50
            } else {
                0
            }))
    }

    /// The longest a completed decision may take: waiting for a refill,
    /// then at most a store call or two, each bounded by the timeout.
    fn decision_bound(&self) -> Duration {
        let one = self.max_wait + self.faults.timeout * 3 + Duration::from_millis(2);
        // Several quotas: two rounds of takes, each as slow as one quota.
        if self.second.is_some() {
            one * 2
        } else {
            one
        }
    }
}

/// One decision the oracle judges.
#[derive(Debug, Clone)]
struct Observed {
    key: usize,
    cost: u64,
    /// When it counts: the return (leases, credit) or the store call's
    /// midpoint (decisions by one store call).
    at_us: u64,
    allowed: bool,
    source: Source,
    took: Duration,
    /// What `acquire` was allowed to wait (zero for `check`).
    waited: Duration,
}

/// A refund of the admission at `at_us` (which places its window): at
/// most `back` permits, landed no earlier than `issued_us`. A refund that
/// answered 0 may still have landed (its reply lost), so it counts with
/// its whole cost: the oracle subtracts what may have come back.
#[derive(Debug, Clone)]
struct Refunded {
    key: usize,
    at_us: u64,
    back: u64,
    issued_us: u64,
}

#[derive(Default)]
struct Log {
    decisions: Vec<Observed>,
    refunds: Vec<Refunded>,
    /// (key, window) → the store's count, sampled after the window ended.
    counts: HashMap<(usize, i64), i64>,
    restarts_us: Vec<u64>,
    /// When every process doubled its quota.
    raised_us: Option<u64>,
}

const NS: &str = "sim";

fn key_name(k: usize) -> String {
    format!("user-{k}")
}

fn draw_cost(r: &mut Rng, s: &Scenario) -> u64 {
    let max = if windowed(s.algorithm) {
        s.limit
    } else {
        s.burst
    };
    match r.below(100) {
        0..=79 => 1,
        80..=86 => 0,
        87..=93 => 1 + r.below(max),
        94..=97 => max + 1 + r.below(1_000),
        _ => u64::MAX - r.below(2),
    }
}

struct Fleet {
    limiters: Vec<Limiter>,
    stores: Vec<FaultyStore>,
}

async fn build_fleet(
    s: &Scenario,
    seed: u64,
    backing: Store,
    clock: Option<VirtualClock>,
) -> Fleet {
    let mut limiters = Vec::new();
    let mut stores = Vec::new();
    for p in 0..s.processes {
        let breaker_clock: Arc<dyn Clock> = match &clock {
            Some(c) => Arc::new(c.clone()),
            None => Arc::new(slicelimit::SystemClock::new()),
        };
        let faulty = FaultyStore::new(
            backing.clone(),
            s.faults,
            seed ^ (p as u64) << 32,
            ArcClock(breaker_clock),
        );
        let mut b = Limiter::builder(s.quota());
        if let Some((limit, period)) = s.second {
            b = b.and(Quota::new(limit, period).expect("a valid second quota"));
        }
        if s.tiers {
            let tier = s.tier_quota();
            b = b.quota_for(move |key| {
                let n: usize = key.strip_prefix("user-")?.parse().ok()?;
                (n % 2 == 1).then_some(tier)
            });
        }
        let mut b = b
            .store(faulty.clone())
            .algorithm(s.algorithm)
            .namespace(NS)
            .on_store_error(FailurePolicy::FailClosed)
            .hybrid(s.config(p as u64));
        if let Some(c) = &clock {
            b = b.clock(c.clone());
            if let Some(tick) = s.lag_tick {
                b = b.lagging_clock(
                    SteppedClock {
                        inner: Arc::new(c.clone()),
                        tick_us: tick.as_micros() as u64,
                    },
                    tick,
                );
            }
        }
        limiters.push(b.build().expect("the scenario's limiter builds"));
        stores.push(faulty);
    }
    Fleet { limiters, stores }
}

#[derive(Clone)]
struct ArcClock(Arc<dyn Clock>);

impl Clock for ArcClock {
    fn now(&self) -> Duration {
        self.0.now()
    }
}

/// Drives one process: checks at random intervals, some dropped mid-flight.
async fn drive(
    s: Scenario,
    seed: u64,
    process: usize,
    limiter: Limiter,
    clock: Arc<dyn Clock>,
    log: Arc<Mutex<Log>>,
) {
    let mut r = Rng::new(seed ^ 0xD1CE ^ (process as u64) << 40);
    let started = tokio::time::Instant::now();
    let mean_gap_us = 1e6 / s.rate_per_process.max(1.0);
    let mut held: Vec<(usize, u64, u64, Decision)> = Vec::new();
    while started.elapsed() < s.duration {
        if !held.is_empty() && r.chance(0.5) {
            let (key, at_us, cost, d) = held.swap_remove(r.below(held.len() as u64) as usize);
            let issued_us = clock.now().as_micros() as u64;
            let back = limiter.refund(&key_name(key), &d).await;
            log.lock().unwrap().refunds.push(Refunded {
                key,
                at_us,
                back: if back > 0 { back } else { cost },
                issued_us,
            });
        }
        let gap = (-(1.0 - r.unit()).ln() * mean_gap_us) as u64;
        tokio::time::sleep(Duration::from_micros(gap.max(1))).await;
        // Skewed toward the first keys.
        let key = (r.unit() * r.unit() * s.keys as f64) as usize;
        let name = key_name(key);
        let cost = draw_cost(&mut r, &s);
        let begin_us = clock.now().as_micros() as u64;
        let t0 = tokio::time::Instant::now();
        let waited = match s.acquire_wait {
            Some(wait) if r.chance(0.3) => wait,
            _ => Duration::ZERO,
        };
        let decision: Option<Decision> = if !waited.is_zero() {
            Some(limiter.acquire(&name, cost, waited).await)
        } else if r.chance(s.drop_chance) {
            let limit = Duration::from_micros(r.below(4_000));
            tokio::time::timeout(limit, limiter.check(&name, cost))
                .await
                .ok()
        } else {
            Some(limiter.check(&name, cost).await)
        };
        let Some(d) = decision else { continue };
        let end_us = clock.now().as_micros() as u64;
        // Several quotas: a part the store decided early in a long decision
        // stands only if its window outlasts the decision, and leased parts
        // are taken at its end: it counts at its end.
        // A decision by one store call counts when the store made it: at
        // the call's midpoint. The call ends the decision and lasts at most
        // the store's timeout, so a longer decision (a hybrid one that
        // waited for a refill, then asked the store: its lane shut down by
        // `set_quota`, say) counts at the midpoint of its last stretch.
        let at_us = if d.source() == Source::Store && s.second.is_none() && waited.is_zero() {
            let call_us = s.faults.timeout.as_micros() as u64;
            let guess = ((begin_us + end_us) / 2).max(end_us.saturating_sub(call_us / 2));
            within_counted_window(&s, &d, cost, (begin_us, end_us), guess)
        } else {
            end_us
        };
        let allowed = d.is_allowed();
        log.lock().unwrap().decisions.push(Observed {
            key,
            cost,
            at_us,
            allowed,
            source: d.source(),
            took: t0.elapsed(),
            waited,
        });
        if allowed && cost > 0 && r.chance(s.refund_chance) {
            held.push((key, at_us, cost, d));
        }
    }
}

/// A windowed admission by one store call, placed in the window the store
/// counted it in: the store's reply says when its window's count resets,
/// and the one period boundary that fits the call's span names the window.
/// The call's midpoint guesses wrong when the call straddles a boundary (a
/// long call, or one made late in a decision that waited).
fn within_counted_window(
    s: &Scenario,
    d: &Decision,
    cost: u64,
    (begin_us, end_us): (u64, u64),
    guess: u64,
) -> u64 {
    if !windowed(s.algorithm) || !d.is_allowed() || cost == 0 {
        return guess;
    }
    let period_us = s.period.as_micros() as u64;
    let reset_us = d.reset_after().as_micros() as u64;
    let (lo, hi) = (begin_us + reset_us, end_us + reset_us);
    let boundary = lo.div_ceil(period_us) * period_us;
    if boundary > hi || boundary + period_us <= hi {
        return guess;
    }
    // A fixed window's count resets when it ends; a sliding window's once
    // the next one has ended too.
    let ends = match s.algorithm {
        Algorithm::SlidingWindow => boundary - period_us,
        _ => boundary,
    };
    guess.clamp(ends - period_us, ends - 1)
}

/// Restarts, outages, reconfiguration and, for the fixed window, sampling
/// of the store's counts once each window has ended.
async fn control(
    s: Scenario,
    fleet: Arc<Fleet>,
    memory: Option<MemoryStore>,
    clock: Arc<dyn Clock>,
    log: Arc<Mutex<Log>>,
) {
    let started = tokio::time::Instant::now();
    let period_us = s.period.as_micros() as u64;
    let mut events: Vec<(Duration, u8)> = Vec::new();
    if let Some((at, len)) = s.outage {
        events.push((at, 0));
        events.push((at + len, 1));
    }
    if let Some(at) = s.restart_at {
        events.push((at, 2));
    }
    if let Some(at) = s.reconfigure_at {
        events.push((at, 3));
    }
    if let Some(at) = s.raise_at {
        events.push((at, 4));
    }
    events.sort();
    let mut next_sample_us = {
        let now = clock.now().as_micros() as u64;
        (now / period_us + 1) * period_us + period_us / 2
    };
    let end = s.duration + s.period * 2;
    loop {
        let elapsed = started.elapsed();
        if elapsed >= end {
            break;
        }
        while let Some(&(at, what)) = events.first() {
            if at > elapsed {
                break;
            }
            events.remove(0);
            match what {
                0 => {
                    for st in &fleet.stores {
                        st.set_faults(Faults {
                            lost_before: 1.0,
                            ..s.faults
                        });
                    }
                }
                1 => {
                    for st in &fleet.stores {
                        st.set_faults(s.faults);
                    }
                }
                2 => {
                    if let Some(m) = &fleet.stores.first() {
                        m.restart_empty();
                    }
                    log.lock()
                        .unwrap()
                        .restarts_us
                        .push(clock.now().as_micros() as u64);
                }
                3 => {
                    for (i, l) in fleet.limiters.iter().enumerate() {
                        l.reconfigure(s.config(i as u64 + 1))
                            .expect("a valid configuration");
                    }
                }
                _ => {
                    // Before the first raise lands, so a decision after it
                    // is judged by the new quota only if every process has it.
                    let at = clock.now().as_micros() as u64;
                    for l in &fleet.limiters {
                        l.set_quota(s.raised_quota()).expect("a valid quota");
                    }
                    log.lock().unwrap().raised_us = Some(at);
                }
            }
        }
        let now = clock.now().as_micros() as u64;
        if let Some(m) = &memory {
            if now >= next_sample_us {
                // Window `w - 1` has ended; the store keeps it until `w + 1`.
                let w = (now / period_us) as i64 - 1;
                let mut log = log.lock().unwrap();
                let forgotten = log.restarts_us.iter().any(|&r| r >= w as u64 * period_us);
                for k in (0..s.keys).filter(|_| !forgotten) {
                    let n = m
                        .window_count(NS, &key_name(k), s.algorithm, w)
                        .unwrap_or(0);
                    log.counts.insert((k, w), n);
                }
                next_sample_us += period_us;
            }
        }
        tokio::time::sleep(Duration::from_millis(5).min(s.period / 4)).await;
    }
}

/// Runs a scenario; returns the log and the fleet's summed stats.
async fn run(
    s: &Scenario,
    seed: u64,
    backing: Store,
    memory: Option<MemoryStore>,
    clock: Option<VirtualClock>,
) -> (Log, Vec<slicelimit::Stats>) {
    let fleet = Arc::new(build_fleet(s, seed, backing, clock.clone()).await);
    let time: Arc<dyn Clock> = match &clock {
        Some(c) => Arc::new(c.clone()),
        None => Arc::new(slicelimit::SystemClock::new()),
    };
    let log = Arc::new(Mutex::new(Log::default()));
    let mut tasks = Vec::new();
    for (p, l) in fleet.limiters.iter().enumerate() {
        tasks.push(tokio::spawn(drive(
            s.clone(),
            seed,
            p,
            l.clone(),
            time.clone(),
            log.clone(),
        )));
    }
    let controller = tokio::spawn(control(
        s.clone(),
        fleet.clone(),
        if windowed(s.algorithm) {
            memory.clone()
        } else {
            None
        },
        time.clone(),
        log.clone(),
    ));
    for t in tasks {
        t.await.expect("a driver panicked");
    }
    controller.await.expect("the controller panicked");
    for st in &fleet.stores {
        st.set_faults(Faults {
            max_delay: Duration::ZERO,
            lost_after: 0.0,
            lost_before: 0.0,
            duplicated: 0.0,
            ..s.faults
        });
    }
    for l in &fleet.limiters {
        tokio::time::timeout(Duration::from_secs(5), l.shutdown())
            .await
            .expect("shutdown returns within 5 s");
    }
    let stats = fleet.limiters.iter().map(Limiter::stats).collect();
    let log = Arc::try_unwrap(log)
        .ok()
        .expect("no task holds the log")
        .into_inner()
        .unwrap();
    (log, stats)
}

/// Checks every bound; `Err` says which and where.
fn judge(
    s: &Scenario,
    log: &Log,
    stats: &[slicelimit::Stats],
    memory: Option<&MemoryStore>,
) -> Result<String, String> {
    let period_us = s.period.as_micros() as u64;
    let n = s.processes as u64;
    let debt = s.max_debt.unwrap_or(0);
    let credit: u64 = stats.iter().map(|st| st.credit_admitted).sum();
    let overshoot: u64 = stats.iter().map(|st| st.overshoot).sum();
    if s.max_debt.is_none() && (credit > 0 || overshoot > 0) {
        return Err(format!(
            "strict admitted {credit} on credit, overshoot {overshoot}"
        ));
    }
    if overshoot > credit {
        return Err(format!(
            "overshoot metric {overshoot} exceeds credit admitted {credit}"
        ));
    }
    let bound = s.decision_bound();
    // `acquire` may wait its budget, then make one more decision.
    if let Some(slow) = log.decisions.iter().find(|d| d.took > bound + d.waited) {
        return Err(format!(
            "a decision took {:?} (bound {bound:?}): {slow:?}",
            slow.took
        ));
    }
    let admitted: Vec<&Observed> = log
        .decisions
        .iter()
        .filter(|d| d.allowed && d.cost > 0)
        .collect();
    // Twice the quota from the raise on (the new limit applies to what was
    // counted before it).
    let raised = |t: u64| {
        if log.raised_us.is_some_and(|r| r < t) {
            2
        } else {
            1
        }
    };
    if let Some(bad) = admitted
        .iter()
        .find(|d| d.cost > s.burst_of(d.key).max(s.limit_of(d.key)) * raised(d.at_us))
    {
        return Err(format!("admitted a cost the quota can never hold: {bad:?}"));
    }
    if let Some(peek) = log.decisions.iter().find(|d| d.cost == 0 && !d.allowed) {
        return Err(format!("a peek was denied: {peek:?}"));
    }
    // A store restarted empty grants a second budget: a fixed window is
    // exempt if the restart fell in it or in the window before (whose
    // pre-leases it holds); a bucket interval is exempt if it overlaps the
    // restart or the lease horizon after it (leases granted before the
    // restart are still spent then).
    let h_us = s.horizon.as_micros() as u64;
    // A sliding window's load counts the window before too: exempt if
    // the restart fell in that one or the one before it.
    let restarted = |from_us: u64, to_us: u64| {
        log.restarts_us.iter().any(|&r| match s.algorithm {
            Algorithm::FixedWindow => r + period_us >= from_us && r < to_us,
            Algorithm::SlidingWindow => r + 2 * period_us >= from_us && r < to_us,
            _ => from_us < r + h_us && to_us >= r,
        })
    };
    let mut summary = String::new();
    // What may have been refunded to (key, window) by time `t`.
    let refunded_by = |key: usize, w: i64, t: u64| -> u64 {
        log.refunds
            .iter()
            .filter(|f| f.key == key && (f.at_us / period_us) as i64 == w && f.issued_us <= t)
            .map(|f| f.back)
            .sum()
    };
    if let Some((limit2, period2)) = s.second {
        // The second quota, as fixed windows of its period: a sliding
        // window's trailing load bounds every such window too.
        let p2 = period2.as_micros() as u64;
        let cap = limit2 + n * debt;
        let mut per: HashMap<(usize, i64), u64> = HashMap::new();
        for d in &admitted {
            *per.entry((d.key, (d.at_us / p2) as i64)).or_default() += d.cost;
        }
        for (&(key, w), &count) in &per {
            let start = w as u64 * p2;
            let restarted = log
                .restarts_us
                .iter()
                .any(|&r| r + 2 * p2 >= start && r < start + p2);
            if !restarted && count > cap {
                return Err(format!(
                    "second quota: key {key} window {w}: admitted {count} > {cap}"
                ));
            }
        }
    }
    if windowed(s.algorithm) && s.max_debt.is_none() {
        // What the store counted in a window covers what was admitted in
        // it, less what may have been refunded.
        let mut per: HashMap<(usize, i64), u64> = HashMap::new();
        for d in &admitted {
            *per.entry((d.key, (d.at_us / period_us) as i64))
                .or_default() += d.cost;
        }
        for (&(key, w), count) in per.iter_mut() {
            *count = count.saturating_sub(refunded_by(key, w, u64::MAX));
        }
        for (&(key, w), &count) in &per {
            let start = w as u64 * period_us;
            if restarted(start, start + period_us) {
                continue;
            }
            if let Some(&stored) = log.counts.get(&(key, w)) {
                if (stored as u64) < count {
                    return Err(format!(
                        "key {key} window {w}: admitted {count} but the store counted {stored}"
                    ));
                }
            }
        }
    }
    match s.algorithm {
        Algorithm::SlidingWindow => {
            // At every admission, the window's admissions so far plus the
            // previous window's, weighted by what the trailing period still
            // covers of it, stay within the limit (strict), or within the
            // limit plus two windows' unreported credit (optimistic).
            let cap = |key: usize, t: u64| s.limit_of(key) * raised(t) + 2 * n * debt;
            let mut per: HashMap<(usize, i64), u64> = HashMap::new();
            for d in &admitted {
                *per.entry((d.key, (d.at_us / period_us) as i64))
                    .or_default() += d.cost;
            }
            let mut ordered = admitted.clone();
            ordered.sort_by_key(|d| d.at_us);
            let mut so_far: HashMap<(usize, i64), u64> = HashMap::new();
            let mut worst = 0;
            let slack = s.attribution_slack.as_micros() as u64;
            for d in ordered {
                let w = (d.at_us / period_us) as i64;
                let count = so_far.entry((d.key, w)).or_default();
                *count += d.cost;
                let start = w as u64 * period_us;
                if restarted(start, start + period_us) {
                    continue;
                }
                let refunded = refunded_by(d.key, w, d.at_us);
                let count = &mut count.saturating_sub(refunded);
                let before = per
                    .get(&(d.key, w - 1))
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(refunded_by(d.key, w - 1, d.at_us));
                // Real time: the store may have seen the admission a little
                // later than it was recorded, when the weight was lower.
                let left = (start + period_us).saturating_sub(d.at_us + slack);
                let weighted = (before as f64 * left as f64 / period_us as f64).ceil() as u64;
                let load = *count + weighted;
                worst = worst.max(load);
                if load > cap(d.key, d.at_us) {
                    return Err(format!(
                        "key {key} at {at} µs: load {load} ({count} + {weighted} of {before}) > {cap}",
                        cap = cap(d.key, d.at_us),
                        key = d.key,
                        at = d.at_us,
                        count = *count,
                    ));
                }
            }
            summary += &format!("worst load {worst}/{}", s.limit);
        }
        Algorithm::FixedWindow => {
            // At every admission, the window's admissions so far less what
            // may have been refunded to it by then stay within the cap.
            let cap = |key: usize, t: u64| s.limit_of(key) * raised(t) + n * debt;
            let mut ordered = admitted.clone();
            ordered.sort_by_key(|d| d.at_us);
            let mut so_far: HashMap<(usize, i64), u64> = HashMap::new();
            let mut net: HashMap<(usize, i64), u64> = HashMap::new();
            let mut worst = 0;
            for d in ordered {
                let w = (d.at_us / period_us) as i64;
                let count = so_far.entry((d.key, w)).or_default();
                *count += d.cost;
                let start = w as u64 * period_us;
                if restarted(start, start + period_us) {
                    continue;
                }
                let load = count.saturating_sub(refunded_by(d.key, w, d.at_us));
                net.insert((d.key, w), load);
                worst = worst.max(load);
                if load > cap(d.key, d.at_us) {
                    return Err(format!(
                        "key {key} window {w}: admitted {load} (after refunds) > {cap}",
                        key = d.key,
                        cap = cap(d.key, d.at_us),
                    ));
                }
            }
            let excess: u64 = net
                .iter()
                .map(|(&(key, w), c)| {
                    let end = (w as u64 + 1) * period_us;
                    c.saturating_sub(s.limit_of(key) * raised(end))
                })
                .sum();
            if log.restarts_us.is_empty() && excess > overshoot {
                return Err(format!(
                    "actual excess {excess} > overshoot metric {overshoot}"
                ));
            }
            summary += &format!("worst window {worst}/{}", s.limit);
        }
        _ => {
            let rate_of = |key: usize, t: u64| {
                (s.limit_of(key) * raised(t)) as f64 / s.period.as_micros() as f64
            };
            let rate = rate_of(1, u64::MAX);
            let h = s.horizon.as_micros() as f64;
            // Optimistic buckets: credit outstanding (N·max_debt) plus the
            // debt the store could not cover, which the overshoot metric
            // counts (a bucket has no window to cap credit per window).
            let slack = 1.0
                + (n * debt) as f64
                + overshoot as f64
                + rate * 2.0 * s.attribution_slack.as_micros() as f64;
            let mut by_key: HashMap<usize, Vec<(u64, u64)>> = HashMap::new();
            for d in &admitted {
                by_key.entry(d.key).or_default().push((d.at_us, d.cost));
            }
            let mut tightest = f64::MAX;
            for (key, mut events) in by_key {
                events.sort();
                for i in 0..events.len() {
                    let mut sum = 0u64;
                    for j in i..events.len() {
                        let (a, b) = (events[i].0, events[j].0);
                        sum += events[j].1;
                        if restarted(a, b) {
                            continue;
                        }
                        let allowed = (s.burst_of(key) * raised(b)) as f64
                            + rate_of(key, b) * ((b - a) as f64 + h)
                            + slack;
                        tightest = tightest.min(allowed - sum as f64);
                        if sum as f64 > allowed {
                            return Err(format!(
                                "key {key}: {sum} admitted in [{a}, {b}] µs, bound {allowed:.1}"
                            ));
                        }
                    }
                }
            }
            summary += &format!("tightest interval {tightest:.1} under the bound");
        }
    }
    if let Some(m) = memory {
        let longest = m.longest_ttl().ok_or("a store entry has no TTL")?;
        let fill = Duration::from_micros(s.burst * s.period.as_micros() as u64 / s.limit);
        let allowed = Duration::from_secs(61) + s.period * 3 + fill;
        if longest > allowed {
            return Err(format!(
                "a store entry lives {longest:?} (bound {allowed:?})"
            ));
        }
    }
    Ok(summary)
}

fn replay_hint(seed: u64) -> String {
    format!("replay: SIM_SEED={seed} cargo test --release --test simulation -- --nocapture")
}

fn simulate(seed: u64) -> Result<String, String> {
    let s = Scenario::draw(seed);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let clock = VirtualClock {
            origin: Duration::from_secs(1_700_000_000),
            start: tokio::time::Instant::now(),
        };
        let memory = MemoryStore::with_clock(clock.clone());
        let (log, stats) = run(
            &s,
            seed,
            memory.clone().into(),
            Some(memory.clone()),
            Some(clock),
        )
        .await;
        let mut sources: HashMap<String, usize> = HashMap::new();
        for d in &log.decisions {
            *sources
                .entry(format!(
                    "{}:{}",
                    d.source.as_str(),
                    if d.allowed { "ok" } else { "no" }
                ))
                .or_default() += 1;
        }
        let mut sources: Vec<_> = sources.into_iter().collect();
        sources.sort();
        judge(&s, &log, &stats, Some(&memory))
            .map(|ok| format!("{} decisions {sources:?}, {ok}", log.decisions.len()))
            .map_err(|e| {
                format!(
                    "seed {seed}: {e}\n  scenario: {s:?}\n  {}",
                    replay_hint(seed)
                )
            })
    })
}

/// Whether the algorithm counts per window (fixed or sliding).
fn windowed(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindow)
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Seeds that once broke a bound, replayed on every run. A run is not
/// wholly determined by its seed (nonces and hash seeds are random), so
/// each is replayed several times.
const FOUND: &[u64] = &[
    // A hybrid call that fell back to the store across a window boundary,
    // after `set_quota` shut its lane down: its admission was placed in
    // the window before the one the store counted it in.
    16914,
];
const FOUND_REPLAYS: usize = 25;

#[test]
fn every_bound_holds_over_seeded_adversarial_schedules() {
    let seeds: Vec<u64> = match std::env::var("SIM_SEED").ok().and_then(|v| v.parse().ok()) {
        Some(seed) => vec![seed],
        None => (0..env_u64("SIM_SEEDS", 60))
            .chain(
                FOUND
                    .iter()
                    .flat_map(|&seed| std::iter::repeat_n(seed, FOUND_REPLAYS)),
            )
            .collect(),
    };
    let verbose = seeds.len() == 1;
    let failures = Arc::new(Mutex::new(Vec::new()));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seeds = Arc::new(seeds);
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (failures, next, seeds) = (failures.clone(), next.clone(), seeds.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&seed) = seeds.get(i) else { return };
                match std::panic::catch_unwind(|| simulate(seed)) {
                    Ok(Ok(summary)) if verbose => {
                        println!("seed {seed}: {summary}\n  {:?}", Scenario::draw(seed))
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => failures.lock().unwrap().push(e),
                    Err(_) => failures
                        .lock()
                        .unwrap()
                        .push(format!("seed {seed} panicked\n  {}", replay_hint(seed))),
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker");
    }
    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} seeds broke a bound:\n{}",
        failures.len(),
        seeds.len(),
        failures.join("\n")
    );
    println!("{} seeds, every bound held", seeds.len());
}

/// The same schedules against a real `redis-server`, in real time: the Lua
/// scripts are held to the same oracle as the embedded store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lua_scripts_meet_the_same_oracle_on_redis() {
    let server = support::RedisServer::start();
    let count = env_u64("SIM_REDIS_SEEDS", 2);
    for seed in 0..count {
        let mut s = Scenario::draw(1_000_000 + seed);
        // Real time: shorter runs, no restart (the store is shared), and a
        // wall-clock attribution that tolerates scheduling noise.
        s.duration = Duration::from_millis(1_500);
        s.restart_at = None;
        s.lag_tick = None;
        s.attribution_slack = Duration::from_millis(20);
        let _: () = redis::cmd("FLUSHALL").query(&mut server.conn()).unwrap();
        let backing: Store = support::store(&server).await.into();
        let (mut log, stats) = run(&s, seed, backing, None, None).await;
        // Wall-clock attribution: a decision returned late by the scheduler
        // may land in the next window; 20 ms of slack either side.
        let period_us = s.period.as_micros() as u64;
        log.decisions.retain(|d| {
            let into = d.at_us % period_us;
            into > 20_000 && into + 20_000 < period_us || !windowed(s.algorithm)
        });
        let immortal = server.immortal_keys();
        assert!(
            immortal.is_empty(),
            "seed {seed}: keys without a TTL: {immortal:?}"
        );
        let mut s_judged = s.clone();
        // Scheduling noise on a loaded machine: widen the decision bound.
        s_judged.max_wait += Duration::from_millis(250);
        judge(&s_judged, &log, &stats, None)
            .unwrap_or_else(|e| panic!("Redis, seed {seed}: {e}\n  scenario: {s:?}"));
    }
}
