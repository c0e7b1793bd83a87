//! Token budgets side by side: an LLM API's tenants, each with a budget of
//! tokens per period, served by several processes on one Redis, limited
//! by slicelimit's hybrid reservations (reserved from a leased slice,
//! settled locally) and by the per-request reserve/commit the peers use
//! (an exact check of the estimate, then a second store call settling
//! the actual cost).
//!
//! ```text
//! cargo run --release -p slicelimit-sim --example tokens
//! cargo run --release -p slicelimit-sim --example tokens -- --rtt-ms 2 --period-s 10
//! ```
//!
//! Each request: a tenant drawn with Zipf(1) frequencies, a prompt of
//! 50–2,000 tokens (uniform), `max_tokens`, and an output drawn from a
//! Pareto tail up to `max_tokens`; it reserves prompt + `max_tokens` and
//! settles to prompt + output. Open loop at `--rate` requests per second
//! over all processes, from a full window of warm-up (a running gateway's
//! processes know their tenants). Reported per mode, over the measured
//! windows: store calls per 1,000 requests (made within them); tokens charged beyond a tenant's
//! limit in a window (the bound: the overruns settled there, 0 here since
//! no output exceeds `max_tokens`); budget used by tenants whose demand
//! exceeded it; the reservation's decision time.
//!
//! Flags: `--processes N` (4), `--tasks N` per process (4), `--tenants N`
//! (200), `--limit N` tokens per tenant per period (1000000), `--period-s N`
//! (60), `--windows N` measured (1), `--rate N` (1000), `--max-tokens N`
//! (1000), `--alpha X` (1.5), `--rtt-ms X` (0: Redis direct; else behind
//! a delaying proxy), `--modes hybrid,reserve-commit`. Redis: a private
//! `redis-server`, or `REDIS_URL`.

use slicelimit_sim as support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use slicelimit::{HybridConfig, Limiter, Quota, RedisStore};
use support::load::{number, wall_us, Pacer, ZipfKeys};
use support::Rng;

#[derive(Clone, Debug)]
struct Args {
    processes: usize,
    tasks: usize,
    tenants: usize,
    limit: u64,
    period: Duration,
    windows: u64,
    rate: f64,
    max_tokens: u64,
    alpha: f64,
    rtt: Duration,
    modes: Vec<String>,
}

fn parse_args() -> Args {
    let mut args = Args {
        processes: 4,
        tasks: 4,
        tenants: 200,
        limit: 1_000_000,
        period: Duration::from_secs(60),
        windows: 1,
        rate: 1_000.0,
        max_tokens: 1_000,
        alpha: 1.5,
        rtt: Duration::ZERO,
        modes: vec!["hybrid".into(), "reserve-commit".into()],
    };
    for (flag, value) in support::load::flag_pairs() {
        match flag.as_str() {
            "--processes" => args.processes = number(&flag, &value) as usize,
            "--tasks" => args.tasks = number(&flag, &value) as usize,
            "--tenants" => args.tenants = number(&flag, &value) as usize,
            "--limit" => args.limit = number(&flag, &value),
            "--period-s" => args.period = Duration::from_secs(number(&flag, &value)),
            "--windows" => args.windows = number(&flag, &value).max(1),
            "--rate" => args.rate = number(&flag, &value) as f64,
            "--max-tokens" => args.max_tokens = number(&flag, &value),
            "--alpha" => args.alpha = value.parse().expect("--alpha: a number"),
            "--rtt-ms" => {
                args.rtt =
                    Duration::from_micros((value.parse::<f64>().expect("--rtt-ms") * 1e3) as u64)
            }
            "--modes" => args.modes = value.split(',').map(str::to_owned).collect(),
            other => panic!("unknown flag {other} (see the file's header)"),
        }
    }
    args
}

/// One admitted request, as the oracle counts it.
struct Served {
    tenant: usize,
    window: u64,
    estimate: u64,
    actual: u64,
}

/// What one mode's run saw.
struct Outcome {
    mode: String,
    requests: u64,
    admitted: u64,
    store_calls: u64,
    /// Most tokens one tenant was charged beyond its limit in a window,
    /// and the sum over tenants and windows.
    worst_over: u64,
    total_over: u64,
    /// The bound: overruns (actual − estimate) settled, summed.
    overruns: u64,
    /// Budget used by tenants whose demand exceeded it: mean and lowest.
    used_mean: f64,
    used_min: f64,
    over_demand: usize,
    decision: Histogram<u64>,
}

async fn run(url: &str, args: &Args, mode: &str) -> Outcome {
    let quota = Quota::new(args.limit, args.period).expect("a quota");
    let namespace = format!("tokens-{mode}-{}", wall_us());
    let mut limiters = Vec::new();
    for _ in 0..args.processes {
        let store = RedisStore::connect(url).await.expect("Redis");
        let builder = Limiter::builder(quota).store(store).namespace(&namespace);
        let limiter = match mode {
            "hybrid" => builder.hybrid(HybridConfig::strict()),
            "reserve-commit" => builder.exact(),
            other => panic!("unknown mode {other}"),
        }
        .build()
        .expect("a limiter");
        limiters.push(limiter);
    }
    let period_us = args.period.as_micros() as u64;
    // From the start of the window after next, `windows` full windows
    // (the next one warms up).
    let start = (wall_us() / period_us + 2) * period_us;
    let end = start + args.windows * period_us;
    // Warm: the run begins a window before the first measured one, so
    // every process has a window of its tenants' demand behind it (what a
    // running gateway has; a lease is sized by what its process spent).
    let begin = start.saturating_sub(period_us);
    tokio::time::sleep(Duration::from_micros(begin.saturating_sub(wall_us()))).await;
    let served = Arc::new(Mutex::new(Vec::<Served>::new()));
    let demand = Arc::new(Mutex::new(HashMap::<(usize, u64), u64>::new()));
    let decision = Arc::new(Mutex::new(Histogram::<u64>::new(3).unwrap()));
    let requests = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let workers = args.processes * args.tasks;
    let mut handles = Vec::new();
    for (p, limiter) in limiters.iter().enumerate() {
        for t in 0..args.tasks {
            let (limiter, args) = (limiter.clone(), args.clone());
            let (served, demand, decision, requests) = (
                served.clone(),
                demand.clone(),
                decision.clone(),
                requests.clone(),
            );
            let seed = (p * 64 + t) as u64 + 1;
            handles.push(tokio::spawn(async move {
                let mut rng = Rng::new(seed);
                let mut tenants = ZipfKeys::new(args.tenants, 1.0, seed);
                let mut pacer =
                    Pacer::new(Duration::from_millis(1), args.rate / workers as f64 / 1e3);
                let mut local = Histogram::<u64>::new(3).unwrap();
                while wall_us() < end {
                    for _ in 0..pacer.next_batch().await {
                        let tenant = tenants.next_key();
                        let prompt = rng.between(50, 2_000);
                        let estimate = prompt + args.max_tokens;
                        let u = 1.0 - rng.unit();
                        let output =
                            ((50.0 / u.powf(1.0 / args.alpha)) as u64).min(args.max_tokens);
                        let actual = prompt + output;
                        let key = format!("tenant-{tenant}");
                        let began = Instant::now();
                        let reservation = limiter.reserve(&key, estimate).await;
                        let took = began.elapsed().as_nanos() as u64;
                        // The window it was decided in (the store's clock is
                        // this machine's).
                        let window = wall_us() / period_us;
                        if (start..end).contains(&wall_us()) {
                            local.record(took.max(1)).ok();
                            requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            *demand.lock().unwrap().entry((tenant, window)).or_default() += actual;
                        }
                        if reservation.is_allowed() {
                            reservation.settle(actual).await;
                            served.lock().unwrap().push(Served {
                                tenant,
                                window,
                                estimate,
                                actual,
                            });
                        }
                    }
                }
                decision.lock().unwrap().add(&local).ok();
            }));
        }
    }
    // Store calls are counted over the measured windows only: the warm-up
    // leases the window before them. (Each window's leases go out a little
    // before it starts, so the count still holds one round of them per
    // window: the next window's, made before `end`.)
    let calls = || limiters.iter().map(|l| l.stats().store_calls).sum::<u64>();
    tokio::time::sleep(Duration::from_micros(start.saturating_sub(wall_us()))).await;
    let calls_before = calls();
    for handle in handles {
        handle.await.expect("a worker");
    }
    let store_calls = calls() - calls_before;
    if std::env::var_os("TOKENS_DEBUG").is_some() {
        println!("{mode}: {:?}", limiters[0].stats());
    }
    for limiter in &limiters {
        limiter.shutdown().await;
    }
    let served = served.lock().unwrap();
    let first = start / period_us;
    let last = end / period_us;
    let mut charged: HashMap<(usize, u64), u64> = HashMap::new();
    let mut overruns = 0;
    let mut admitted = 0;
    for s in served.iter().filter(|s| (first..last).contains(&s.window)) {
        *charged.entry((s.tenant, s.window)).or_default() += s.actual;
        overruns += s.actual.saturating_sub(s.estimate);
        admitted += 1;
    }
    let worst_over = charged
        .values()
        .map(|&c| c.saturating_sub(args.limit))
        .max()
        .unwrap_or(0);
    let total_over = charged
        .values()
        .map(|&c| c.saturating_sub(args.limit))
        .sum();
    let decision = decision.lock().unwrap().clone();
    let demand = demand.lock().unwrap();
    let used: Vec<f64> = demand
        .iter()
        .filter(|(&(_, w), &d)| (first..last).contains(&w) && d > args.limit)
        .map(|(key, _)| charged.get(key).copied().unwrap_or(0) as f64 / args.limit as f64)
        .collect();
    Outcome {
        mode: mode.to_owned(),
        requests: requests.load(std::sync::atomic::Ordering::Relaxed),
        admitted,
        store_calls,
        worst_over,
        total_over,
        overruns,
        used_mean: used.iter().sum::<f64>() / used.len().max(1) as f64,
        used_min: used.iter().copied().fold(f64::INFINITY, f64::min),
        over_demand: used.len(),
        decision,
    }
}

fn ns(v: u64) -> String {
    if v < 10_000 {
        format!("{v} ns")
    } else if v < 10_000_000 {
        format!("{:.1} µs", v as f64 / 1e3)
    } else {
        format!("{:.1} ms", v as f64 / 1e6)
    }
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let server;
    let url = match std::env::var("REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            server = support::RedisServer::start();
            server.url()
        }
    };
    let url = if args.rtt.is_zero() {
        url
    } else {
        let port: u16 = url
            .trim_end_matches('/')
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("a port in the Redis URL");
        let each_way = support::proxy::Delay::jittered(args.rtt / 2, Duration::ZERO);
        let proxy = support::proxy::Proxy::start_with(port, each_way, each_way).await;
        let url = proxy.url();
        std::mem::forget(proxy);
        url
    };
    println!(
        "{} processes × {} tasks, {} tenants (Zipf 1), {} tokens per tenant per {:?}, {} requests/s, \
         prompts 50–2000, outputs Pareto({}) up to {}; Redis round trip {:?}; {} full window(s)",
        args.processes,
        args.tasks,
        args.tenants,
        args.limit,
        args.period,
        args.rate,
        args.alpha,
        args.max_tokens,
        args.rtt,
        args.windows
    );
    println!(
        "{:<16} {:>9} {:>9} {:>14} {:>10} {:>10} {:>9} {:>16} {:>9} {:>9}",
        "mode",
        "requests",
        "admitted",
        "calls/1000 req",
        "worst over",
        "total over",
        "bound",
        "budget used",
        "p50",
        "p99"
    );
    for mode in &args.modes {
        let o = run(&url, &args, mode).await;
        println!(
            "{:<16} {:>9} {:>9} {:>14.1} {:>10} {:>10} {:>9} {:>7.1} % (≥{:.1} %, {} tenant-windows) {:>9} {:>9}",
            o.mode,
            o.requests,
            o.admitted,
            o.store_calls as f64 * 1000.0 / o.requests.max(1) as f64,
            o.worst_over,
            o.total_over,
            o.overruns,
            o.used_mean * 100.0,
            if o.used_min.is_finite() { o.used_min * 100.0 } else { 0.0 },
            o.over_demand,
            ns(o.decision.value_at_quantile(0.5)),
            ns(o.decision.value_at_quantile(0.99)),
        );
    }
}
