//! What many keys at once cost the hybrid limiter: a cold storm (N keys
//! never seen, all asking at the same moment) and a window rollover with
//! N active keys, on a private `redis-server` (or `REDIS_URL`), directly
//! or through a proxy that adds a round trip.
//!
//! ```text
//! cargo run --release --example storm -- --keys 100000
//! cargo run --release --example storm -- --keys 100000 --rtt-ms 1
//! ```
//!
//! Flags: `--keys N` (100,000), `--rtt-ms N` added round trip (0),
//! `--rate N` decisions per second during the rollover (50,000).
//! Fixed window, strict, default tunables (`max_wait` 50 ms). Reports,
//! per phase: time until every decision was made, the share denied (a
//! cold key's request waits for its lease up to `max_wait`, then is
//! denied with source `Lease`), the share that waited on the store,
//! latency percentiles, and store round trips and leases.

use slicelimit_sim as support;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use slicelimit::{HybridConfig, Limiter, Quota, RedisStore, Stats};
use support::load::{key_name, wall_us, Pacer};

struct Args {
    keys: usize,
    rtt: Duration,
    rate: f64,
}

fn parse_args() -> Args {
    let mut a = Args {
        keys: 100_000,
        rtt: Duration::ZERO,
        rate: 50_000.0,
    };
    for (flag, v) in support::load::flag_pairs() {
        let n = || support::load::number(&flag, &v);
        match flag.as_str() {
            "--keys" => a.keys = n() as usize,
            "--rtt-ms" => a.rtt = Duration::from_millis(n()),
            "--rate" => a.rate = n() as f64,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// Decisions of one phase.
struct Phase {
    hist: Histogram<u64>,
    decisions: u64,
    denied: u64,
    waited: u64,
    /// From the first request to the last decision.
    drained: Duration,
}

impl Phase {
    fn new() -> Phase {
        Phase {
            hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram"),
            decisions: 0,
            denied: 0,
            waited: 0,
            drained: Duration::ZERO,
        }
    }

    fn merge(&mut self, other: &Phase) {
        self.hist.add(&other.hist).expect("same bounds");
        self.decisions += other.decisions;
        self.denied += other.denied;
        self.waited += other.waited;
        self.drained = self.drained.max(other.drained);
    }

    fn print(&self, what: &str, before: &Stats, after: &Stats) {
        let pct = |n: u64| n as f64 * 100.0 / self.decisions.max(1) as f64;
        let ms = |q: f64| self.hist.value_at_quantile(q) as f64 / 1e6;
        println!(
            "{what}: {} decisions in {:.0} ms; denied {:.1} %, waited {:.1} %; \
             p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms; {} round trips, {} leases; \
             {} store errors, {} decided by the failure policy; \
             {} polled past {BOUND:?} and still undecided",
            self.decisions,
            self.drained.as_secs_f64() * 1e3,
            pct(self.denied),
            pct(self.waited),
            ms(0.5),
            ms(0.99),
            self.hist.max() as f64 / 1e6,
            after.round_trips - before.round_trips,
            after.leases - before.leases,
            after.store_errors - before.store_errors,
            after.policy_decisions - before.policy_decisions,
            LATE_BY_LIMITER.swap(0, Ordering::Relaxed),
        );
    }
}

/// One decision, timed: (latency ns, denied, waited, done since `began`).
type Sample = (u64, bool, bool, Duration);

/// The longest a decision may take once it runs: `max_wait` (50 ms) plus
/// the store's response timeout (25 ms), and 5 ms for the timer wheel.
const BOUND: Duration = Duration::from_millis(80);

/// Decisions that were polled after `BOUND` and still not made: the
/// limiter's own lateness, as opposed to the runtime's (a decision made
/// late because its task was not polled in time).
static LATE_BY_LIMITER: AtomicU64 = AtomicU64::new(0);

/// Runs a decision, checking at every poll whether it is overdue.
async fn watched<F: Future>(decision: F) -> F::Output {
    let mut decision = std::pin::pin!(decision);
    let mut first: Option<Instant> = None;
    let mut late = false;
    std::future::poll_fn(move |cx| {
        let now = Instant::now();
        let first = *first.get_or_insert(now);
        let poll = decision.as_mut().poll(cx);
        if poll.is_pending() && !late && now.duration_since(first) > BOUND {
            late = true;
            LATE_BY_LIMITER.fetch_add(1, Ordering::Relaxed);
        }
        poll
    })
    .await
}

/// One decision; `waited` if the limiter could not answer locally.
async fn decide(limiter: &Limiter, key: &str, began: Instant) -> Sample {
    let at = Instant::now();
    let (d, waited) = match limiter.check_now(key, 1) {
        Some(d) => (d, false),
        None => (watched(limiter.check(key, 1)).await, true),
    };
    (
        at.elapsed().as_nanos().max(1) as u64,
        !d.is_allowed(),
        waited,
        began.elapsed(),
    )
}

impl Phase {
    fn record(&mut self, (latency, denied, waited, done): Sample) {
        let _ = self.hist.record(latency);
        self.decisions += 1;
        self.denied += u64::from(denied);
        self.waited += u64::from(waited);
        self.drained = self.drained.max(done);
    }
}

/// Every key at once: one task per key, all started together.
async fn cold_storm(limiter: &Limiter, keys: usize) -> Phase {
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..keys {
        let limiter = limiter.clone();
        tasks.spawn(async move { decide(&limiter, &key_name(k), began).await });
    }
    let mut phase = Phase::new();
    while let Some(sample) = tasks.join_next().await {
        phase.record(sample.expect("task"));
    }
    phase
}

/// A paced uniform load over every key from `from` until `until` (wall
/// µs); decisions from `measure_from` on are counted.
async fn paced(limiter: &Limiter, keys: usize, rate: f64, until: u64, measure_from: u64) -> Phase {
    let workers = 16;
    let tick = Duration::from_millis(2);
    let per_tick = rate * tick.as_secs_f64() / workers as f64;
    let total = Arc::new(Mutex::new(Phase::new()));
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..workers {
        let (limiter, total) = (limiter.clone(), total.clone());
        tasks.spawn(async move {
            let mut phase = Phase::new();
            let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1);
            let mut pacer = Pacer::new(tick, per_tick);
            // Open loop: a decision that must wait runs on its own task,
            // so waits do not slow the load down.
            let mut waiting = tokio::task::JoinSet::new();
            while wall_us() < until {
                for _ in 0..pacer.next_batch().await {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let key = key_name((state % keys as u64) as usize);
                    let measured = wall_us() >= measure_from;
                    let at = Instant::now();
                    match limiter.check_now(&key, 1) {
                        Some(d) if measured => phase.record((
                            at.elapsed().as_nanos().max(1) as u64,
                            !d.is_allowed(),
                            false,
                            began.elapsed(),
                        )),
                        Some(_) => {}
                        None => {
                            let limiter = limiter.clone();
                            waiting.spawn(async move {
                                let d = watched(limiter.check(&key, 1)).await;
                                (
                                    at.elapsed().as_nanos().max(1) as u64,
                                    !d.is_allowed(),
                                    true,
                                    began.elapsed(),
                                    measured,
                                )
                            });
                        }
                    }
                }
                while let Some(Ok((ns, denied, waited, done, measured))) = waiting.try_join_next() {
                    if measured {
                        phase.record((ns, denied, waited, done));
                    }
                }
            }
            while let Some(Ok((ns, denied, waited, done, measured))) = waiting.join_next().await {
                if measured {
                    phase.record((ns, denied, waited, done));
                }
            }
            total.lock().unwrap().merge(&phase);
        });
    }
    while tasks.join_next().await.is_some() {}
    Arc::try_unwrap(total).ok().unwrap().into_inner().unwrap()
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let (url, _server) = match std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => (url, None),
        None => {
            let server = support::RedisServer::start();
            (server.url(), Some(server))
        }
    };
    let port: u16 = url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a redis://host:port URL");
    let url = if args.rtt.is_zero() {
        url
    } else {
        // The proxy gets a thread and a runtime of its own: on the load's
        // runtime, 100,000 waiting tasks would delay it far past its round
        // trip, which a real network does not do.
        let (tx, rx) = std::sync::mpsc::channel();
        let one_way = args.rtt / 2;
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            runtime.block_on(async move {
                let proxy = support::proxy::Proxy::start_delayed(port, one_way).await;
                tx.send(proxy.url()).expect("main thread waits");
                std::future::pending::<()>().await;
            });
        });
        rx.recv().expect("proxy started")
    };
    println!(
        "{} keys, added round trip {:?}, fixed window, strict, default tunables",
        args.keys, args.rtt
    );
    let build = |limit: u64, period: Duration, ns: &str| {
        let url = url.clone();
        let ns = format!("{ns}-{}", std::process::id());
        async move {
            let store = RedisStore::connect(&url).await.expect("redis");
            Limiter::builder(Quota::new(limit, period).expect("quota"))
                .namespace(&ns)
                .store(store)
                .hybrid(HybridConfig::strict())
                .build()
                .expect("limiter")
        }
    };

    // Cold storm: every key new, all at once.
    let limiter = build(100, Duration::from_secs(60), "storm").await;
    let before = limiter.stats();
    let storm = cold_storm(&limiter, args.keys).await;
    storm.print("cold storm", &before, &limiter.stats());
    limiter.shutdown().await;

    // Rollover: every key active in the window, then a paced load across
    // the boundary; decisions in the first 500 ms of the new window count.
    let period = Duration::from_secs(10);
    let limiter = build(1_000, period, "rollover").await;
    let period_us = period.as_micros() as u64;
    // Start just after a boundary so warm-up stays inside one window.
    let next = (wall_us() / period_us + 1) * period_us;
    tokio::time::sleep(Duration::from_micros(next - wall_us() + 50_000)).await;
    // Warm-up: every key admitted once in this window, 2,000 at a time.
    let began = Instant::now();
    let mut cold: Vec<usize> = (0..args.keys).collect();
    for _ in 0..20 {
        let mut tasks = tokio::task::JoinSet::new();
        for chunk in cold.chunks(2_000) {
            for &k in chunk {
                let limiter = limiter.clone();
                tasks.spawn(async move { (k, limiter.check(&key_name(k), 1).await.is_allowed()) });
            }
            while tasks.len() > 2_000 {
                tasks.join_next().await;
            }
        }
        let mut again = Vec::new();
        while let Some(done) = tasks.join_next().await {
            let (k, allowed) = done.expect("task");
            if !allowed {
                again.push(k);
            }
        }
        cold = again;
        if cold.is_empty() {
            break;
        }
    }
    let boundary = (wall_us() / period_us + 1) * period_us;
    println!(
        "rollover: {} keys warmed in {:.0} ms ({} never admitted); boundary in {:.0} ms",
        args.keys,
        began.elapsed().as_secs_f64() * 1e3,
        cold.len(),
        (boundary as f64 - wall_us() as f64) / 1e3,
    );
    let before = limiter.stats();
    let phase = paced(&limiter, args.keys, args.rate, boundary + 500_000, boundary).await;
    phase.print(
        &format!("rollover at {}/s", args.rate),
        &before,
        &limiter.stats(),
    );
    limiter.shutdown().await;
}
