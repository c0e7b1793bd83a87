//! The sliding-window counter against real, private Redis servers: the
//! strict bound (at every admission, the load of what was admitted stays
//! within the limit) for exact and hybrid fleets, how far that load is
//! from a true sliding log of the same admissions, and a hybrid key that
//! runs out and comes back as the previous window fades.
//!
//! The load of window W at time t is count(W) + ceil(count(W-1) ×
//! ((W+1)·period − t) / period), the weight clamped to [0, period] (see
//! `lua/carry_sliding_window.lua`); it is recomputed here from the
//! admissions alone, in integers.

use slicelimit_sim as support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use slicelimit::{Algorithm, HybridConfig, Limiter, Quota, Source};
use support::load::{key_name, wall_us, ZipfKeys};
use support::{store, RedisServer};

/// Limiters sharing one Redis.
const FLEET: usize = 4;
/// Held by the test driving a fleet.
static ONE_FLEET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// Request streams driving each limiter, so a burst is not one queue.
const STREAMS: usize = 4;
const KEYS: usize = 20;
const LIMIT: u64 = 40;
const PERIOD_US: u64 = 500_000;
/// Total demand per period = DEMAND × LIMIT × KEYS, split by Zipf(1):
/// the first ten keys or so are over their limit, the hottest ~11×.
const DEMAND: f64 = 2.0;
/// Ten windows from a boundary on; the first (first leases) and the last
/// (the load stops) are left out of the utilization.
const RUN_US: u64 = 5_000_000;

/// When requests arrive within each window.
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// A Poisson process at the mean rate.
    Steady,
    /// The same demand in the first and last tenth of each window only
    /// (five times the mean rate there): the counter's assumption that
    /// the previous window's requests were spread evenly is most wrong.
    Boundaries,
}

impl Shape {
    /// The arrival rate at `phase` (in [0, 1) of a window), relative to
    /// the mean.
    fn intensity(self, phase: f64) -> f64 {
        match self {
            Shape::Steady => 1.0,
            Shape::Boundaries if !(0.1..0.9).contains(&phase) => 5.0,
            Shape::Boundaries => 0.0,
        }
    }

    fn peak(self) -> f64 {
        match self {
            Shape::Steady => 1.0,
            Shape::Boundaries => 5.0,
        }
    }
}

/// One admitted request, stamped by the wall clock (Redis' `TIME` reads
/// the same clock on this machine) just before `check` was called and
/// just after it returned: the decision fell somewhere in between.
#[derive(Debug, Clone, Copy)]
struct Admission {
    key: usize,
    sent_us: u64,
    at_us: u64,
}

/// What a run admitted, and what arrived per (key, window).
#[derive(Debug, Default)]
struct Run {
    admitted: Vec<Admission>,
    demand: HashMap<(usize, i64), u64>,
    /// Arrivals sent more than 5 ms after their scheduled time (the
    /// machine could not keep up): how sharp the offered shape really was.
    late: u64,
    /// Calls that took 40 ms or more (a strict hybrid waits up to 50 ms
    /// for a refill before it denies).
    slow: u64,
    arrivals: u64,
    first_window: i64,
    last_window: i64,
}

/// xorshift64: deterministic arrivals.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

async fn drive_one(limiter: Limiter, shape: Shape, seed: u64, start_us: u64, stop_us: u64) -> Run {
    let names: Arc<Vec<String>> = Arc::new((0..KEYS).map(key_name).collect());
    let mut zipf = ZipfKeys::new(KEYS, 1.0, seed);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    // Requests per µs for this stream at the shape's peak; arrivals of a
    // Poisson process at that rate, kept with probability intensity/peak
    // (thinning), are a Poisson process of the shape's rate.
    let mean = DEMAND * (LIMIT * KEYS as u64) as f64 / PERIOD_US as f64 / (FLEET * STREAMS) as f64;
    let peak = mean * shape.peak();
    let mut run = Run::default();
    // Open loop: each request is spawned on its own, so one that waits
    // for a refill does not hold back the arrivals behind it.
    let mut requests = Vec::new();
    let mut next = start_us as f64;
    loop {
        next += -rng.unit().ln() / peak;
        let due = next as u64;
        if due >= stop_us {
            break;
        }
        let phase = (due % PERIOD_US) as f64 / PERIOD_US as f64;
        if rng.unit() * shape.peak() >= shape.intensity(phase) {
            continue;
        }
        let now = wall_us();
        if now < due {
            tokio::time::sleep(Duration::from_micros(due - now)).await;
        }
        let key = zipf.next_key();
        let (limiter, names) = (limiter.clone(), names.clone());
        requests.push(tokio::spawn(async move {
            let sent_us = wall_us();
            let allowed = limiter.check(&names[key], 1).await.is_allowed();
            (key, due, sent_us, allowed, wall_us())
        }));
    }
    for request in requests {
        let (key, due, sent_us, allowed, at_us) = request.await.unwrap();
        run.arrivals += 1;
        run.late += u64::from(sent_us > due + 5_000);
        run.slow += u64::from(at_us >= sent_us + 40_000);
        *run.demand
            .entry((key, (sent_us / PERIOD_US) as i64))
            .or_default() += 1;
        if allowed {
            run.admitted.push(Admission {
                key,
                sent_us,
                at_us,
            });
        }
    }
    run
}

/// Drives the fleet for `RUN_US` from the next window boundary on.
async fn drive(limiters: &[Limiter], shape: Shape) -> Run {
    let start_us = (wall_us() / PERIOD_US + 1) * PERIOD_US;
    let stop_us = start_us + RUN_US;
    let mut streams = Vec::new();
    for (i, limiter) in limiters.iter().enumerate() {
        for t in 0..STREAMS {
            let seed = 0x51_1D_E5 + (i * STREAMS + t) as u64 * 0x1000_0001;
            streams.push(tokio::spawn(drive_one(
                limiter.clone(),
                shape,
                seed,
                start_us,
                stop_us,
            )));
        }
    }
    let mut all = Run {
        first_window: (start_us / PERIOD_US) as i64,
        last_window: ((stop_us - 1) / PERIOD_US) as i64,
        ..Run::default()
    };
    for stream in streams {
        let run = stream.await.unwrap();
        all.admitted.extend(run.admitted);
        for (cell, n) in run.demand {
            *all.demand.entry(cell).or_default() += n;
        }
        all.late += run.late;
        all.slow += run.slow;
        all.arrivals += run.arrivals;
    }
    for limiter in limiters {
        assert_eq!(
            limiter.stats().policy_decisions,
            0,
            "the store did not answer in time: the failure policy decided, so the bound is not under test"
        );
    }
    all
}

/// A fleet of exact limiters (`None`) or hybrid ones with `config`.
async fn fleet(server: &RedisServer, ns: &str, config: Option<HybridConfig>) -> Vec<Limiter> {
    let quota = Quota::new(LIMIT, Duration::from_micros(PERIOD_US)).unwrap();
    let mut limiters = Vec::new();
    for _ in 0..FLEET {
        let builder = Limiter::builder(quota)
            .store(store(server).await)
            .algorithm(Algorithm::SlidingWindow)
            .namespace(ns);
        let builder = match &config {
            Some(config) => builder.hybrid(config.clone()),
            None => builder.exact(),
        };
        limiters.push(builder.build().unwrap());
    }
    limiters
}

/// µs of window `w` still ahead of `t`, clamped to [0, period]: the
/// previous window's weight, times the period.
fn left_of(w: i64, t: u64, period_us: u64) -> u64 {
    ((w as u64 + 1) * period_us)
        .saturating_sub(t)
        .min(period_us)
}

/// One admission as the two measures see it.
#[derive(Debug, Clone, Copy)]
struct Measured {
    admission: Admission,
    /// A lower bound on the sliding-window counter's load when the call
    /// returned, from the admissions recorded by then (see [`measure`]).
    load: u64,
    /// Admissions of the key in the trailing period (t − period, t]: a
    /// true sliding log.
    trailing: u64,
}

/// Every admission with its counter load and its sliding-log count.
///
/// Real time on a loaded 2-core machine: each decision was made somewhere
/// between `sent_us` and `at_us`, and a thread may be descheduled on
/// either side of it (calls of 50 ms are seen in bursts). The limiter
/// keeps the load within the limit at every instant, not only at its
/// decisions: between two of them the previous window's weight only falls
/// (a lease counts its permits when granted, before they are spent). So
/// at each `at_us` this computes the load of the window `at_us` falls in,
/// at that instant, from what is certainly no more than what was decided
/// by then, without any tolerance in µs:
/// - only admissions recorded by then count (a subset of those decided);
/// - window W's own count holds only calls sent and returned inside W;
/// - the previous window's count holds every call sent in W − 1 that
///   returned by the end of W. A call that straddled the boundary was
///   decided in W − 1 or in W; in W it would count whole, so counting k
///   such calls at the weight of W − 1 understates: k + ceil(w × (c − k))
///   ≥ ceil(w × c) for a weight w ≤ 1.
///
/// Calls sent in W − 2 and returned in W − 1 count in neither (their
/// share of W's load is 0 or weighted). The sliding log uses `at_us` for
/// every admission.
fn measure(admitted: &[Admission], period_us: u64) -> Vec<Measured> {
    let mut by_key: HashMap<usize, Vec<Admission>> = HashMap::new();
    for a in admitted {
        by_key.entry(a.key).or_default().push(*a);
    }
    let mut out = Vec::with_capacity(admitted.len());
    for (_, mut list) in by_key {
        list.sort_by_key(|a| (a.at_us, a.sent_us));
        let times: Vec<u64> = list.iter().map(|a| a.at_us).collect();
        // Window → calls sent and returned in it; calls sent in it
        // and returned by the end of the next one.
        let mut own: HashMap<i64, u64> = HashMap::new();
        let mut sent: HashMap<i64, u64> = HashMap::new();
        for a in &list {
            let (from, w) = ((a.sent_us / period_us) as i64, (a.at_us / period_us) as i64);
            if from == w {
                *own.entry(w).or_default() += 1;
            }
            if w - from <= 1 {
                *sent.entry(from).or_default() += 1;
            }
            let before = sent.get(&(w - 1)).copied().unwrap_or(0);
            let load = own.get(&w).copied().unwrap_or(0)
                + (before * left_of(w, a.at_us, period_us)).div_ceil(period_us);
            let upto = times.partition_point(|&t| t <= a.at_us);
            let from = times.partition_point(|&t| t + period_us <= a.at_us);
            out.push(Measured {
                admission: *a,
                load,
                trailing: (upto - from) as u64,
            });
        }
    }
    out
}

/// The strict bound: no admission's load above the limit. Returns the
/// worst load and how many calls straddled a window boundary.
fn assert_strict(label: &str, measured: &[Measured]) -> (u64, usize) {
    let worst = measured
        .iter()
        .max_by_key(|m| m.load)
        .expect("something was admitted");
    assert!(
        worst.load <= LIMIT,
        "{label}: load {} > {LIMIT} at {:?}",
        worst.load,
        worst.admission
    );
    let straddled = measured
        .iter()
        .filter(|m| m.admission.sent_us / PERIOD_US != m.admission.at_us / PERIOD_US)
        .count();
    (worst.load, straddled)
}

/// Σ admitted ÷ Σ limit over whole windows of keys whose demand in the
/// window was over the limit: how much of what the limit allowed the
/// fleet used. (A saturated sliding window admits about limit − 1: its
/// last permit waits for the previous window's weight to reach 0.)
fn utilization(run: &Run) -> (f64, usize) {
    let mut admitted: HashMap<(usize, i64), u64> = HashMap::new();
    for a in &run.admitted {
        *admitted
            .entry((a.key, (a.at_us / PERIOD_US) as i64))
            .or_default() += 1;
    }
    let (mut used, mut cells) = (0u64, 0usize);
    for (&(key, w), &d) in &run.demand {
        if w > run.first_window && w < run.last_window && d > LIMIT {
            used += admitted.get(&(key, w)).copied().unwrap_or(0).min(LIMIT);
            cells += 1;
        }
    }
    (used as f64 / (cells as u64 * LIMIT).max(1) as f64, cells)
}

/// How far the counter is from a sliding log of the same admissions.
#[derive(Debug)]
struct Accuracy {
    /// max over admissions of trailing / limit − 1.
    worst: f64,
    /// mean over admissions of max(0, trailing / limit − 1).
    mean_excess: f64,
    /// Share of admissions whose trailing count was above the limit.
    over: f64,
    /// mean over admissions of |trailing − load| / limit.
    mean_abs: f64,
    /// The largest gap between a call's two stamps (µs).
    max_straddle: u64,
}

fn accuracy(measured: &[Measured]) -> Accuracy {
    let n = measured.len() as f64;
    let l = LIMIT as f64;
    let rel = |m: &Measured| m.trailing as f64 / l - 1.0;
    Accuracy {
        worst: measured.iter().map(rel).fold(f64::MIN, f64::max),
        mean_excess: measured.iter().map(|m| rel(m).max(0.0)).sum::<f64>() / n,
        over: measured.iter().filter(|m| m.trailing > LIMIT).count() as f64 / n,
        mean_abs: measured
            .iter()
            .map(|m| m.trailing.abs_diff(m.load) as f64 / l)
            .sum::<f64>()
            / n,
        max_straddle: measured
            .iter()
            .map(|m| m.admission.at_us - m.admission.sent_us)
            .max()
            .unwrap_or(0),
    }
}

/// What a fleet did, besides its admissions.
struct Costs {
    decisions: u64,
    round_trips: u64,
    stranded: u64,
}

async fn shut(limiters: &[Limiter]) -> Costs {
    let mut costs = Costs {
        decisions: 0,
        round_trips: 0,
        stranded: 0,
    };
    for limiter in limiters {
        limiter.shutdown().await;
        let stats = limiter.stats();
        costs.decisions += stats.allowed + stats.denied;
        costs.round_trips += stats.round_trips;
        costs.stranded += stats.stranded;
    }
    costs
}

/// One fleet on one load, end to end: the strict bound, the sliding-log
/// bound that follows from the algorithm, no key left without a TTL.
/// Returns the accuracy and the utilization for the caller's bounds (see
/// [`Utilization::at_least`]).
async fn run_fleet(
    label: &str,
    config: Option<HybridConfig>,
    shape: Shape,
) -> (Accuracy, Utilization) {
    // One fleet at a time: the test harness runs tests in parallel, and
    // two load generators on two cores would make each other late.
    let _alone = ONE_FLEET.lock().await;
    let server = RedisServer::start();
    let limiters = fleet(&server, label, config).await;
    let run = drive(&limiters, shape).await;
    let costs = shut(&limiters).await;
    let measured = measure(&run.admitted, PERIOD_US);
    let (worst_load, straddled) = assert_strict(label, &measured);
    let (util, cells) = utilization(&run);
    let acc = accuracy(&measured);
    println!(
        "{label}: {} admitted of {} arrivals ({} sent > 5 ms late); worst load {worst_load}/{LIMIT} \
         ({straddled} calls across a boundary); \
         utilization {util:.3} over {cells} saturated cells; sliding log: worst {:+.3}, mean excess {:.4}, \
         {:.2}% of admissions over the limit; mean |log − load| / limit {:.4}; longest call {} µs; \
         {} calls took 40 ms or more; {:.0} round trips per 1000 decisions, {} permits stranded",
        run.admitted.len(),
        run.arrivals,
        run.late,
        acc.worst,
        acc.mean_excess,
        acc.over * 100.0,
        acc.mean_abs,
        acc.max_straddle,
        run.slow,
        costs.round_trips as f64 * 1000.0 / costs.decisions.max(1) as f64,
        costs.stranded,
    );
    assert!(
        cells >= 40,
        "{label}: only {cells} saturated (key, window) cells"
    );
    // What follows from the algorithm: a trailing period touches two
    // windows, and no window's count exceeds the limit, so the log holds
    // at most 2 × limit. Stamped on return, the log's period may take in
    // decisions up to `max_straddle` older: at the start of a window those
    // still weigh about whole, which allows limit × straddle / period more.
    let bound = 2 * LIMIT + (LIMIT * acc.max_straddle).div_ceil(PERIOD_US);
    let worst = measured.iter().map(|m| m.trailing).max().unwrap_or(0);
    assert!(
        worst <= bound,
        "{label}: {worst} in a trailing period > {bound}"
    );
    assert_eq!(server.immortal_keys(), Vec::<String>::new(), "{label}");
    let late = run.late as f64 / run.arrivals.max(1) as f64;
    (acc, Utilization { value: util, late })
}

/// The share of a saturated key's budget a fleet admitted, and the share
/// of requests the load generator sent more than 5 ms late.
#[derive(Debug, Clone, Copy)]
struct Utilization {
    value: f64,
    late: f64,
}

impl Utilization {
    /// Asserts `floor` when the load generator kept up. On a machine too
    /// loaded to send on time (a debug build beside another build: most
    /// requests late, calls of 100 ms and more) the demand a window saw
    /// is not the one offered, and only a floor any working limiter meets
    /// there is asserted (measured in such runs: 0.66 to 0.84).
    fn at_least(self, floor: f64) {
        let floor = if self.late > 0.05 {
            floor.min(0.5)
        } else {
            floor
        };
        assert!(self.value >= floor, "utilization {self:?}, floor {floor}");
    }
}

/// The check itself, on admissions made up to break the bound: a window
/// spent at its end and spent again at the next one's start is caught, a
/// call across the boundary counts at the previous window's weight, and
/// the sliding log counts what it should.
#[test]
fn the_load_check_catches_a_double_spend_across_a_boundary() {
    const P: u64 = 1_000_000;
    let w = 7 * P;
    let at = |key, t: u64| Admission {
        key,
        sent_us: t,
        at_us: t,
    };
    let mut admissions: Vec<Admission> = (0..40).map(|i| at(0, w + 900_000 + i)).collect();
    // 50 ms into the next window, 38 of the 40 still weigh: room for 2.
    admissions.extend((0..3).map(|i| at(0, w + P + 50_000 + i)));
    // Another key: a call sent before the boundary, returned after it.
    admissions.extend((0..39).map(|i| at(1, w + 100_000 + i)));
    admissions.push(Admission {
        key: 1,
        sent_us: w + P - 1_000,
        at_us: w + P + 1_000,
    });
    admissions.push(at(1, w + P + 500_000));
    let measured = measure(&admissions, P);
    let loads = |key| {
        let mut v: Vec<(u64, u64, u64)> = measured
            .iter()
            .filter(|m| m.admission.key == key)
            .map(|m| (m.admission.at_us, m.load, m.trailing))
            .collect();
        v.sort_unstable();
        v
    };
    let first = loads(0);
    assert_eq!(first[39], (w + 900_039, 40, 40));
    assert_eq!(
        first[40..].iter().map(|l| (l.1, l.2)).collect::<Vec<_>>(),
        [(39, 41), (40, 42), (41, 43)]
    );
    let second = loads(1);
    // The straddling call counts with the previous window's 39, at the
    // weight 999/1000 of the instant it returned: ceil(40 × 0.999) = 40.
    assert_eq!(second[39].1, 40);
    // Halfway through, half of those 40 weigh, and the call itself is
    // not counted twice: 1 + 20; the log holds the call and this one.
    assert_eq!(second[40], (w + P + 500_000, 21, 2));
}

// Bounds below: measured over five runs of this binary on a loaded
// 2-core machine (the arrivals are seeded, so each load is the same every
// run; what moves is the machine's timing), with room for noise.

/// The strict hybrid fleet on the steady Zipf load: overshoot 0 against
/// the sliding-window load, and its distance from a sliding log.
///
/// The sliding window never leases its next window ahead: a permit
/// granted for the next window would count whole against the one still
/// running, so a saturated key would admit nothing more for the rest of
/// it (measured before that rule: utilization 0.65..0.75, and 2 800 to
/// 5 200 calls of 15 900 waiting out `max_wait`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_hybrid_fleet_keeps_every_load_within_the_limit() {
    let (acc, util) = run_fleet("hybrid-steady", Some(HybridConfig::strict()), Shape::Steady).await;
    // Measured: utilization 0.938..0.944; worst +0.150..+0.225, mean
    // excess 0.0011..0.0015, mean |log − load| 0.0404..0.0419.
    util.at_least(0.85);
    assert!(acc.worst <= 0.45, "{acc:?}");
    assert!(acc.mean_excess <= 0.005, "{acc:?}");
    assert!(acc.mean_abs <= 0.07, "{acc:?}");
}

/// A pre-lease lead configured (as for a fixed window) changes nothing:
/// no window end freezes, the budget used is the exact counter's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prelease_lead_does_not_freeze_a_sliding_window() {
    let config = HybridConfig::strict().prelease_lead(Duration::from_millis(200));
    let (acc, util) = run_fleet("hybrid-steady-lead", Some(config), Shape::Steady).await;
    util.at_least(0.85);
    assert!(acc.worst <= 0.45, "{acc:?}");
}

/// Bursts at the window boundaries: the strict bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_hybrid_fleet_keeps_every_load_within_the_limit_under_boundary_bursts() {
    let (acc, util) = run_fleet(
        "hybrid-bursts",
        Some(HybridConfig::strict()),
        Shape::Boundaries,
    )
    .await;
    // Measured: utilization 0.874; worst +0.750, mean excess 0.017, 10.3 %
    // of admissions over the limit, mean |log − load| 0.189: what the
    // exact counter does on this load (below), since nothing freezes; a
    // debug build on CI measured 0.79. (Pre-leases froze it at 0.52.)
    util.at_least(0.7);
    assert!(acc.worst <= 0.9, "{acc:?}");
    assert!(acc.mean_excess <= 0.04, "{acc:?}");
    assert!(acc.mean_abs <= 0.25, "{acc:?}");
}

/// The exact counter on the steady load: the previous window's requests
/// really were spread about evenly, so its load is close to the log's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_counter_against_a_sliding_log_under_steady_load() {
    let (acc, util) = run_fleet("exact-steady", None, Shape::Steady).await;
    // Measured: utilization 0.965..0.966; worst +0.325 (53 in a trailing
    // period of a limit of 40) in every run, mean excess 0.0027..0.0030,
    // 5.9..6.3 % of admissions over the limit, mean |log − load| 0.040.
    util.at_least(0.9);
    assert!(acc.worst <= 0.5, "{acc:?}");
    assert!(acc.mean_excess <= 0.01, "{acc:?}");
    assert!(acc.mean_abs <= 0.07, "{acc:?}");
}

/// The exact counter with the demand in the first and last tenth of each
/// window: the previous window's permits sit at its end, not spread, and
/// the log runs well over the limit. (Its worst case, all of one window's
/// permits in its last instant and the next window's taken at once, is
/// twice the limit; here each window's end burst leaves the trailing
/// period as the next one's enters it, which caps it lower.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_counter_against_a_sliding_log_under_boundary_bursts() {
    let (acc, util) = run_fleet("exact-bursts", None, Shape::Boundaries).await;
    // Measured: utilization 0.905..0.914; worst +0.375..+0.600 (+0.725
    // once, with another build running), mean excess 0.012..0.017 (0.024),
    // 10.5..11.7 % of admissions over the limit, mean |log − load|
    // 0.185..0.190 (0.21).
    util.at_least(0.85);
    assert!(acc.worst <= 0.9, "{acc:?}");
    assert!(acc.mean_excess <= 0.04, "{acc:?}");
    assert!(acc.mean_abs <= 0.25, "{acc:?}");
}

/// What one limiter did through a key's exhaustion and the fade after it.
struct Fade {
    /// Admitted in the spent window, the next, and the first half of the
    /// one after.
    per_window: [u64; 3],
    recovery_trips: u64,
    local_denials: u64,
    store_denials: u64,
}

/// Spends a key's window 20 ms into it, checks that the denials that
/// follow stay local, then asks every 2 ms until halfway through the
/// window after next.
async fn exhaust_and_fade(server: &RedisServer, ns: &str, config: HybridConfig) -> Fade {
    const LIMIT: u64 = 20;
    const PERIOD_US: u64 = 1_000_000;
    let limiter = Limiter::builder(Quota::new(LIMIT, Duration::from_micros(PERIOD_US)).unwrap())
        .store(store(server).await)
        .algorithm(Algorithm::SlidingWindow)
        .namespace(ns)
        .hybrid(config)
        .build()
        .unwrap();
    let now = wall_us();
    let w = now / PERIOD_US + 1;
    tokio::time::sleep(Duration::from_micros(w * PERIOD_US + 20_000 - now)).await;
    let mut admitted = Vec::new();
    let stamp = |admitted: &mut Vec<Admission>, sent_us: u64, allowed: bool| {
        if allowed {
            admitted.push(Admission {
                key: 0,
                sent_us,
                at_us: wall_us(),
            });
        }
    };
    for _ in 0..2 * LIMIT {
        let sent = wall_us();
        stamp(
            &mut admitted,
            sent,
            limiter.check("k", 1).await.is_allowed(),
        );
    }
    assert_eq!(admitted.len() as u64, LIMIT, "{ns}");

    let trips = limiter.stats().round_trips;
    for _ in 0..10_000 {
        let d = limiter.check("k", 1).await;
        assert!(!d.is_allowed());
        assert_eq!(d.source(), Source::DeniedCache, "{ns}");
        assert!(d.retry_after().unwrap() > Duration::ZERO);
    }
    assert_eq!(limiter.stats().round_trips, trips, "{ns}");

    let until = (w + 2) * PERIOD_US + PERIOD_US / 2;
    let (mut local_denials, mut store_denials) = (0u64, 0u64);
    let mut ticker = tokio::time::interval(Duration::from_millis(2));
    while wall_us() < until {
        ticker.tick().await;
        let sent = wall_us();
        let d = limiter.check("k", 1).await;
        if !d.is_allowed() {
            match d.source() {
                Source::DeniedCache => local_denials += 1,
                _ => store_denials += 1,
            }
        }
        stamp(&mut admitted, sent, d.is_allowed());
    }
    let recovery_trips = limiter.stats().round_trips - trips;
    limiter.shutdown().await;

    for m in measure(&admitted, PERIOD_US) {
        assert!(
            m.load <= LIMIT,
            "{ns}: load {} at {:?}",
            m.load,
            m.admission
        );
    }
    let in_window = |v: u64| admitted.iter().filter(|a| a.at_us / PERIOD_US == v).count() as u64;
    Fade {
        per_window: [in_window(w), in_window(w + 1), in_window(w + 2)],
        recovery_trips,
        local_denials,
        store_denials,
    }
}

/// A hybrid key that spent its window is denied from the local cache, with
/// no round trip, and comes back permit by permit as the previous
/// window's weight falls: never above the load the limit allows, and
/// about one lease call per permit that reopens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_hybrid_key_is_denied_locally_and_recovers_as_its_window_fades() {
    let _alone = ONE_FLEET.lock().await;
    let server = RedisServer::start();
    let (plain, direct) = tokio::join!(
        exhaust_and_fade(&server, "fade", HybridConfig::strict()),
        exhaust_and_fade(
            &server,
            "fade-no-lead",
            HybridConfig::strict().prelease_lead(Duration::ZERO)
        ),
    );
    for (name, f) in [("default", &plain), ("no pre-lease lead", &direct)] {
        println!(
            "fade, {name}: windows {:?} admitted; {} round trips; denials {} local, {} from the store",
            f.per_window, f.recovery_trips, f.local_denials, f.store_denials
        );
        let [first, second, third] = f.per_window;
        assert_eq!(first, 20, "{name}: nothing more in the spent window");
        // The spent window weighs a permit less every period / limit
        // (50 ms); halfway through the third window, about half the
        // second's count still weighs.
        assert!(
            third >= 5,
            "{name}: {third} in the third window's first half"
        );
        // The cache knows when the next permit fits: each store call
        // reopens about one permit, denials between them stay local.
        assert!(
            f.recovery_trips <= 3 * (second + third) + 10,
            "{name}: {} round trips for {} permits",
            f.recovery_trips,
            second + third
        );
        assert!(
            f.local_denials >= 10 * f.store_denials,
            "{name}: {} local denials, {} from the store",
            f.local_denials,
            f.store_denials
        );
    }
    // Polled every 2 ms, each reopened permit is taken: the second window
    // ends at limit − 1 (measured 19), with a pre-lease lead configured or
    // not (the sliding window never leases ahead: measured 14..16 when it
    // did).
    for f in [&plain, &direct] {
        assert!(f.per_window[1] >= 17, "{:?}", f.per_window);
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}
