//! Side-by-side comparison: per-process, exact (each algorithm) and hybrid
//! (strict, optimistic; strict on the sliding window) limiters on the same
//! load against one Redis.
//!
//! ```text
//! cargo run --release --example compare -- --json out.json --plot out.svg
//! cargo run --release --example compare -- --ramp      # where exact saturates Redis
//! ```
//!
//! N simulated servers (each a `Limiter` with its own store connection,
//! driven by its own tasks) receive M keys' requests with Zipf demand at a
//! multiple of the limit, open loop, for a duration per mode. Redis is a
//! private `redis-server` started here unless `REDIS_URL` (or `--cluster`)
//! names one; with no `redis-server` on PATH the embedded store is used,
//! and the output says so.
//!
//! Flags: `--servers N` (4), `--tasks N` per server (4), `--keys N` (20),
//! `--limit N` per key per period (1000), `--period-ms N` (1000),
//! `--demand X` × the limit (2.0), `--duration-s N` (4), `--json PATH`,
//! `--plot PATH`, `--ramp`, `--cluster URL,URL,…`, `--modes NAME,…` (only
//! these rows; the ratios, JSON and plot need every mode; one mode outside
//! the default table, `hybrid-strict-sliding-window-no-prelease`, runs only
//! when named), `--rtt-ms X` and `--jitter-ms J` (Redis behind a
//! delaying proxy started here: X/2 ms each way plus up to J ms of jitter,
//! bytes kept in order). `COMPARE_DEBUG=1` also prints per-mode script counts,
//! limiter counters and the busiest windows.
//!
//! `worst over` is the most any key was admitted beyond the limit: per
//! window for the fixed window and the buckets; for the sliding window, the
//! most its load (this window's count plus the previous window's, weighted
//! by overlap) exceeded the limit at an admission. `log over` is the most
//! any key was admitted in a trailing period (a true sliding log), over the
//! limit, in percent: what each algorithm lets through by that measure.
//!
//! The long tail: `--demand-per-key R` (requests per second per key) picks
//! keys uniformly, keeps every key far under its limit, touches every key
//! once on every server first (the warm-up), then measures inside one
//! window (use a period longer than warm-up plus duration, e.g.
//! `--keys 10000 --demand-per-key 1 --limit 1000 --period-ms 60000
//! --duration-s 15`): script calls per 1,000 decisions, the share of
//! decisions that waited on the store, latency and Redis CPU per mode.
//! With a period shorter than the run, `--warm-s N` runs the same load
//! for N seconds before measuring, so that every key's rate is known
//! (e.g. per-second windows: `--keys 1000 --demand-per-key 4 --limit 100
//! --period-ms 1000 --warm-s 5 --duration-s 20`).

use slicelimit_sim as support;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use slicelimit::{
    store::RedisOptions, Algorithm, HybridConfig, Limiter, MemoryStore, Quota, RedisStore, Store,
};
use support::load::{key_name, wall_us, Pacer, ZipfKeys};

#[derive(Clone, Debug)]
struct Args {
    servers: usize,
    tasks: usize,
    keys: usize,
    limit: u64,
    period: Duration,
    demand: f64,
    duration: Duration,
    json: Option<String>,
    plot: Option<String>,
    ramp: bool,
    cluster: Option<Vec<String>>,
    /// Long tail: requests per second per key, keys picked uniformly.
    demand_per_key: Option<f64>,
    /// Run only these modes (by name); all when empty.
    modes: Vec<String>,
    /// A network round trip to stand in for (a delaying proxy in front
    /// of Redis), and its jitter each way.
    rtt: Duration,
    jitter: Duration,
    /// Long tail: the same load, unmeasured, before the measured phase.
    warm: Duration,
}

fn parse_args() -> Args {
    let mut a = Args {
        servers: 4,
        tasks: 4,
        keys: 20,
        limit: 1000,
        period: Duration::from_millis(1000),
        demand: 2.0,
        duration: Duration::from_secs(4),
        json: None,
        plot: None,
        ramp: false,
        cluster: None,
        demand_per_key: None,
        modes: Vec::new(),
        rtt: Duration::ZERO,
        jitter: Duration::ZERO,
        warm: Duration::ZERO,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--ramp" {
            a.ramp = true;
            continue;
        }
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let v = it
            .next()
            .unwrap_or_else(|| usage_error(&format!("{flag} needs a value")));
        let n = || {
            v.parse::<u64>()
                .unwrap_or_else(|_| usage_error(&format!("{flag}: not a number: {v}")))
        };
        match flag.as_str() {
            "--servers" => a.servers = n() as usize,
            "--tasks" => a.tasks = n() as usize,
            "--keys" => a.keys = n() as usize,
            "--limit" => a.limit = n(),
            "--period-ms" => a.period = Duration::from_millis(n()),
            "--demand" => {
                a.demand = v
                    .parse()
                    .unwrap_or_else(|_| usage_error(&format!("--demand: not a number: {v}")))
            }
            "--duration-s" => a.duration = Duration::from_secs(n()),
            "--warm-s" => a.warm = Duration::from_secs(n()),
            "--json" => a.json = Some(v),
            "--plot" => a.plot = Some(v),
            "--cluster" => a.cluster = Some(v.split(',').map(str::to_owned).collect()),
            "--modes" => a.modes = v.split(',').map(str::to_owned).collect(),
            "--rtt-ms" | "--jitter-ms" => {
                let ms: f64 = v
                    .parse()
                    .ok()
                    .filter(|ms: &f64| ms.is_finite() && *ms >= 0.0 && *ms < 10_000.0)
                    .unwrap_or_else(|| usage_error(&format!("{flag}: not a duration in ms: {v}")));
                let d = Duration::from_secs_f64(ms / 1_000.0);
                if flag == "--rtt-ms" {
                    a.rtt = d;
                } else {
                    a.jitter = d;
                }
            }
            "--demand-per-key" => {
                a.demand_per_key = Some(v.parse().unwrap_or_else(|_| {
                    usage_error(&format!("--demand-per-key: not a number: {v}"))
                }))
            }
            other => usage_error(&format!("unknown flag {other}")),
        }
    }
    a
}

const USAGE: &str = "\
compare: per-process, exact and hybrid limiters side by side on one load

  --servers N          limiters, each its own connection (4)
  --tasks N            driver tasks per server (4)
  --keys N             keys (20)
  --limit N            permits per key per period (1000)
  --period-ms N        the period (1000)
  --demand X           Zipf demand, a multiple of the limit (2.0)
  --demand-per-key R   the long tail instead: R requests/s per key, uniform
  --duration-s N       seconds per mode (4)
  --warm-s N           long tail: run its load N s unmeasured first (0)
  --modes A,B,...      only these rows
  --rtt-ms X           talk to Redis through a proxy that delays each way
                       by X/2 ms (a network round trip of X ms; 0: none)
  --jitter-ms J        and by up to J ms more each way, at random, in order
  --json PATH, --plot PATH, --ramp, --cluster URL,URL,...

REDIS_URL names a Redis; else a private redis-server is started, or the
embedded store is used when there is none. COMPARE_DEBUG=1 adds detail.";

fn usage_error(message: &str) -> ! {
    eprintln!("compare: {message}\n\n{USAGE}");
    std::process::exit(2)
}

/// Where the shared budgets live for this run.
enum Backend {
    Redis {
        urls: Vec<String>,
        cluster: bool,
        _server: Option<support::RedisServer>,
        /// Where the limiters connect: a delaying proxy in front of
        /// `urls[0]` (`--rtt-ms`), or `urls[0]` itself.
        via: Option<String>,
    },
    Embedded(MemoryStore),
}

impl Backend {
    fn describe(&self) -> String {
        match self {
            Backend::Redis { urls, cluster: true, .. } => format!("Redis Cluster ({} nodes)", urls.len()),
            Backend::Redis { urls, via: Some(via), .. } => format!("Redis at {} through a delaying proxy at {via}", urls[0]),
            Backend::Redis { urls, .. } => format!("Redis at {}", urls[0]),
            Backend::Embedded(_) => "the embedded MemoryStore (no redis-server on PATH and no REDIS_URL): round trips are in-process calls, not network".into(),
        }
    }

    async fn store(&self) -> Store {
        let options = RedisOptions::default()
            .response_timeout(Duration::from_millis(500))
            .connect_timeout(Duration::from_secs(2));
        match self {
            Backend::Redis {
                urls,
                cluster: true,
                ..
            } => {
                let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
                RedisStore::connect_cluster_with(&urls, options)
                    .await
                    .expect("cluster")
                    .into()
            }
            Backend::Redis { urls, via, .. } => {
                RedisStore::connect_with(via.as_ref().unwrap_or(&urls[0]), options)
                    .await
                    .expect("redis")
                    .into()
            }
            Backend::Embedded(store) => store.clone().into(),
        }
    }

    /// EVALSHA calls and the µs Redis spent in them (summed over nodes).
    fn script_stats(&self) -> (u64, u64) {
        self.command_stats()
            .get("evalsha")
            .copied()
            .unwrap_or_default()
    }

    /// Command → (calls, µs in Redis), summed over nodes.
    fn command_stats(&self) -> HashMap<String, (u64, u64)> {
        let mut total = HashMap::new();
        let Backend::Redis { urls, .. } = self else {
            return total;
        };
        for url in urls {
            let Ok(mut conn) = redis::Client::open(url.as_str()).and_then(|c| c.get_connection())
            else {
                continue;
            };
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query(&mut conn)
                .unwrap_or_default();
            for line in info.lines().filter_map(|l| l.strip_prefix("cmdstat_")) {
                let Some((name, fields)) = line.split_once(':') else {
                    continue;
                };
                let entry: &mut (u64, u64) = total.entry(name.to_owned()).or_default();
                for part in fields.split(',') {
                    match part.split_once('=') {
                        Some(("calls", v)) => entry.0 += v.parse::<u64>().unwrap_or(0),
                        Some(("usec", v)) => entry.1 += v.parse::<u64>().unwrap_or(0),
                        _ => {}
                    }
                }
            }
        }
        total
    }

    /// CPU seconds Redis has used (user + sys, summed over nodes).
    fn cpu_seconds(&self) -> f64 {
        match self {
            Backend::Redis { urls, .. } => redis_cpu_seconds(urls),
            Backend::Embedded(_) => 0.0,
        }
    }

    /// The same reading, taken when the returned future is polled.
    fn cpu_probe(&self) -> impl std::future::Future<Output = f64> + Send + 'static {
        let urls = match self {
            Backend::Redis { urls, .. } => urls.clone(),
            Backend::Embedded(_) => Vec::new(),
        };
        async move {
            tokio::task::spawn_blocking(move || redis_cpu_seconds(&urls))
                .await
                .unwrap_or_default()
        }
    }
}

fn redis_cpu_seconds(urls: &[String]) -> f64 {
    urls.iter()
        .map(|url| {
            let mut conn = redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection())
                .expect("an INFO connection");
            let info: String = redis::cmd("INFO")
                .arg("cpu")
                .query(&mut conn)
                .unwrap_or_default();
            info.lines()
                .filter(|l| l.starts_with("used_cpu_sys:") || l.starts_with("used_cpu_user:"))
                .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
                .sum::<f64>()
        })
        .sum()
}

fn redis_server_available() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Local,
    Exact(Algorithm),
    HybridStrict,
    HybridOptimistic,
    /// Strict hybrid on the sliding window; `false`: no pre-leases.
    HybridStrictSliding {
        prelease: bool,
    },
}

impl Mode {
    fn name(self) -> String {
        match self {
            Mode::Local => "local".into(),
            Mode::Exact(a) => format!("exact-{}", a.as_str()),
            Mode::HybridStrict => "hybrid-strict".into(),
            Mode::HybridOptimistic => "hybrid-optimistic".into(),
            Mode::HybridStrictSliding { prelease: true } => "hybrid-strict-sliding-window".into(),
            Mode::HybridStrictSliding { prelease: false } => {
                "hybrid-strict-sliding-window-no-prelease".into()
            }
        }
    }

    fn algorithm(self) -> Algorithm {
        match self {
            Mode::Exact(a) => a,
            Mode::HybridStrictSliding { .. } => Algorithm::SlidingWindow,
            _ => Algorithm::FixedWindow,
        }
    }
}

const MAX_DEBT: u64 = 5;

struct Outcome {
    name: String,
    algorithm: Algorithm,
    decisions: u64,
    seconds: f64,
    latency: Histogram<u64>,
    round_trips: u64,
    /// (key, window) → admitted
    admitted: HashMap<(usize, i64), u64>,
    /// (key, window) → arrived
    demand: HashMap<(usize, i64), u64>,
    /// Every admission: (key, wall µs before the call, wall µs after it).
    admissions: Vec<(usize, u64, u64)>,
    period_us: u64,
    redis_cpu: f64,
    /// Steady state: Redis CPU from the start of the second window to the
    /// end of the load (no first leases, no shutdown), and the decisions
    /// made in that span.
    steady: (f64, u64),
}

impl Outcome {
    fn full_windows(&self) -> Vec<i64> {
        let mut w: Vec<i64> = self.demand.keys().map(|(_, w)| *w).collect();
        w.sort_unstable();
        w.dedup();
        if w.len() <= 2 {
            Vec::new()
        } else {
            w[1..w.len() - 1].to_vec()
        }
    }

    fn utilization(&self, limit: u64) -> f64 {
        let full = self.full_windows();
        let (mut used, mut cells) = (0u64, 0u64);
        for (cell, d) in &self.demand {
            if full.contains(&cell.1) && *d > limit {
                used += self.admitted.get(cell).copied().unwrap_or(0).min(limit);
                cells += 1;
            }
        }
        if cells == 0 {
            0.0
        } else {
            used as f64 / (cells * limit) as f64
        }
    }

    /// The most any key was admitted beyond the limit in one window, as
    /// this harness sees it (decisions stamped by the wall clock on return,
    /// so a decision at a window's very end may count in the next one).
    /// For token bucket and GCRA a window is not the algorithm's unit: a
    /// full bucket (burst) plus a period's refill may pass in one window,
    /// so only what exceeds `burst + limit` counts there.
    /// For the sliding window, the most its load (see [`sliding_loads`])
    /// exceeded the limit at any admission.
    fn worst_overshoot(&self, limit: u64) -> u64 {
        if self.algorithm == Algorithm::SlidingWindow {
            return sliding_loads(&self.admissions, self.period_us)
                .into_iter()
                .map(|(load, _)| load.saturating_sub(limit))
                .max()
                .unwrap_or(0);
        }
        let allowed = if self.name.contains("bucket") || self.name.contains("gcra") {
            2 * limit
        } else {
            limit
        };
        self.admitted
            .values()
            .map(|a| a.saturating_sub(allowed))
            .max()
            .unwrap_or(0)
    }

    /// The most admitted for one key in any trailing period, ÷ the limit,
    /// − 1 (a true sliding log of the admissions, stamped on return).
    fn log_over(&self, limit: u64) -> f64 {
        let worst = sliding_loads(&self.admissions, self.period_us)
            .into_iter()
            .map(|(_, trailing)| trailing)
            .max()
            .unwrap_or(0);
        worst as f64 / limit as f64 - 1.0
    }

    fn per_second(&self) -> f64 {
        self.decisions as f64 / self.seconds
    }

    fn round_trips_per_1000(&self) -> f64 {
        self.round_trips as f64 * 1000.0 / self.decisions.max(1) as f64
    }
}

/// For every admission (key, µs before the call, µs after it): the
/// sliding-window counter's load when it returned, count(W) +
/// ceil(count(W − 1) × ((W + 1)·period − t) / period), and the true count
/// of the key's admissions in the trailing period (t − period, t].
///
/// The load is a lower bound, so scheduling noise cannot make one up: it
/// counts only admissions recorded by then, W's own count only calls
/// sent and returned inside W, and a call sent in W − 1 that returned
/// in W (decided in either) at the previous window's weight, which
/// understates it in both cases.
fn sliding_loads(admissions: &[(usize, u64, u64)], period_us: u64) -> Vec<(u64, u64)> {
    let mut by_key: HashMap<usize, Vec<(u64, u64)>> = HashMap::new();
    for &(key, sent, at) in admissions {
        by_key.entry(key).or_default().push((at, sent));
    }
    let mut out = Vec::with_capacity(admissions.len());
    for (_, mut list) in by_key {
        list.sort_unstable();
        let times: Vec<u64> = list.iter().map(|&(at, _)| at).collect();
        // Window → calls sent and returned in it; calls sent in it and
        // returned by the end of the next one.
        let mut own: HashMap<u64, u64> = HashMap::new();
        let mut started: HashMap<u64, u64> = HashMap::new();
        for &(at, sent) in &list {
            let (from, w) = (sent / period_us, at / period_us);
            if from == w {
                *own.entry(w).or_default() += 1;
            }
            if w - from <= 1 {
                *started.entry(from).or_default() += 1;
            }
            let before = match w.checked_sub(1) {
                Some(prev) => started.get(&prev).copied().unwrap_or(0),
                None => 0,
            };
            let left = ((w + 1) * period_us).saturating_sub(at).min(period_us);
            let load = own.get(&w).copied().unwrap_or(0) + (before * left).div_ceil(period_us);
            let upto = times.partition_point(|&t| t <= at);
            let from = times.partition_point(|&t| t + period_us <= at);
            out.push((load, (upto - from) as u64));
        }
    }
    out
}

async fn build(backend: &Backend, args: &Args, mode: Mode, ns: &str) -> Vec<Limiter> {
    let quota = Quota::new(args.limit, args.period).expect("quota");
    let mut limiters = Vec::new();
    for _ in 0..args.servers {
        let b = Limiter::builder(quota)
            .namespace(ns)
            .store(backend.store().await);
        let b = match mode {
            Mode::Local => b.local(),
            Mode::Exact(a) => b.algorithm(a).exact(),
            Mode::HybridStrict => b.hybrid(HybridConfig::strict()),
            Mode::HybridOptimistic => b.hybrid(HybridConfig::optimistic(MAX_DEBT)),
            Mode::HybridStrictSliding { prelease } => {
                let config = HybridConfig::strict();
                let config = if prelease {
                    config
                } else {
                    config.prelease_lead(Duration::ZERO)
                };
                b.algorithm(Algorithm::SlidingWindow).hybrid(config)
            }
        };
        limiters.push(b.build().expect("limiter"));
    }
    limiters
}

async fn run_mode(backend: &Backend, args: &Args, mode: Mode) -> Outcome {
    let ns = format!("compare-{}-{}", mode.name(), std::process::id());
    let limiters = build(backend, args, mode, &ns).await;
    let period_us = args.period.as_micros() as u64;
    let per_period = args.demand * args.limit as f64 * args.keys as f64;
    let workers = args.servers * args.tasks;
    let tick = Duration::from_millis(5);
    let per_tick = per_period * tick.as_secs_f64() / args.period.as_secs_f64() / workers as f64;
    let names: Arc<Vec<String>> = Arc::new((0..args.keys).map(key_name).collect());
    let cpu_before = backend.cpu_seconds();
    let scripts_before = backend.script_stats();
    let commands_before = backend.command_stats();
    let started = Instant::now();
    let stop_at = wall_us() + args.duration.as_micros() as u64;
    // The second window's start, when every key has had its first lease.
    let steady_window = (wall_us() / period_us) as i64 + 1;
    let steady_from = {
        let wait = (steady_window as u64 * period_us).saturating_sub(wall_us());
        let backend_cpu = backend.cpu_probe();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_micros(wait)).await;
            backend_cpu.await
        })
    };
    let shared = Arc::new(Mutex::new((
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap(),
        HashMap::<(usize, i64), u64>::new(),
        HashMap::<(usize, i64), u64>::new(),
        0u64,
        Vec::<(usize, u64, u64)>::new(),
    )));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let limiter = limiters[w % args.servers].clone();
        let (names, shared) = (names.clone(), shared.clone());
        let keys = args.keys;
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
            let mut admitted: HashMap<(usize, i64), u64> = HashMap::new();
            let mut demand: HashMap<(usize, i64), u64> = HashMap::new();
            let mut admissions: Vec<(usize, u64, u64)> = Vec::new();
            let mut zipf = ZipfKeys::new(
                keys,
                1.0,
                0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407),
            );
            let mut count = 0u64;
            let mut pacer = Pacer::new(tick, per_tick);
            while wall_us() < stop_at {
                for _ in 0..pacer.next_batch().await {
                    let key = zipf.next_key();
                    let sent = wall_us();
                    *demand.entry((key, (sent / period_us) as i64)).or_default() += 1;
                    let began = Instant::now();
                    let d = limiter.check(&names[key], 1).await;
                    let _ = hist.record(began.elapsed().as_nanos().max(1) as u64);
                    count += 1;
                    if d.is_allowed() {
                        let at = wall_us();
                        *admitted.entry((key, (at / period_us) as i64)).or_default() += 1;
                        admissions.push((key, sent, at));
                    }
                }
            }
            let mut s = shared.lock().unwrap();
            s.0.add(&hist).unwrap();
            for (k, v) in admitted {
                *s.1.entry(k).or_default() += v;
            }
            for (k, v) in demand {
                *s.2.entry(k).or_default() += v;
            }
            s.3 += count;
            s.4.extend(admissions);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    let load_end_cpu = backend.cpu_seconds();
    let steady_start_cpu = steady_from.await.unwrap();
    let steady_cpu = load_end_cpu - steady_start_cpu;
    let round_trips = limiters.iter().map(|l| l.stats().round_trips).sum();
    let limiters_stats: Vec<_> = limiters.iter().map(|l| l.stats()).collect();
    let policy: u64 = limiters.iter().map(|l| l.stats().policy_decisions).sum();
    if policy > 0 {
        println!(
            "  ({}: {policy} decisions by the failure policy: the store did not answer in time)",
            mode.name()
        );
    }
    for l in &limiters {
        l.shutdown().await;
    }
    let redis_cpu = backend.cpu_seconds() - cpu_before;
    if std::env::var("COMPARE_DEBUG").is_ok() {
        println!(
            "  {}: Redis CPU first window {:.4}s, steady {:.4}s, shutdown {:.4}s",
            mode.name(),
            steady_start_cpu - cpu_before,
            steady_cpu,
            redis_cpu - (load_end_cpu - cpu_before)
        );
    }
    let (latency, admitted, demand, decisions, admissions) =
        Arc::try_unwrap(shared).ok().unwrap().into_inner().unwrap();
    let steady_decisions = demand
        .iter()
        .filter(|((_, w), _)| *w >= steady_window)
        .map(|(_, n)| n)
        .sum();
    if std::env::var("COMPARE_DEBUG").is_ok() {
        let after = backend.script_stats();
        let calls = after.0 - scripts_before.0;
        let mut commands: Vec<_> = backend
            .command_stats()
            .into_iter()
            .map(|(name, (n, us))| {
                let (n0, us0) = commands_before.get(&name).copied().unwrap_or_default();
                (name, n - n0, us - us0)
            })
            .filter(|c| c.1 > 0)
            .collect();
        commands.sort_by_key(|c| std::cmp::Reverse(c.2));
        println!(
            "  {}: commands (name, calls, µs): {commands:?}",
            mode.name()
        );
        println!(
            "  {}: {calls} scripts, {:.1} µs each in Redis; {:?}",
            mode.name(),
            (after.1 - scripts_before.1) as f64 / calls.max(1) as f64,
            limiters_stats
        );
        let mut cells: Vec<_> = admitted.iter().collect();
        cells.sort_by_key(|(_, a)| std::cmp::Reverse(**a));
        println!(
            "  {} top cells: {:?}",
            mode.name(),
            &cells[..cells.len().min(5)]
        );
    }
    Outcome {
        name: mode.name(),
        algorithm: mode.algorithm(),
        decisions,
        seconds,
        latency,
        round_trips,
        admitted,
        demand,
        admissions,
        period_us,
        redis_cpu,
        steady: (steady_cpu, steady_decisions),
    }
}

/// What one mode did on the long-tail load, warm phase only.
struct LongTail {
    name: String,
    decisions: u64,
    seconds: f64,
    latency: Histogram<u64>,
    /// Decisions that could not be made locally (the store was asked).
    waited: u64,
    /// Scripts Redis ran in the measured phase.
    scripts: u64,
    /// Round trips the limiters made in the measured phase.
    round_trips: u64,
    redis_cpu: f64,
    admitted: u64,
}

/// Waits until `lead` after the next window boundary (wall clock, which is
/// Redis' on this machine), so a run stays inside one window.
async fn align_to_window(period: Duration, lead: Duration) {
    let period_us = period.as_micros() as u64;
    let now = wall_us();
    let next = (now / period_us + 1) * period_us + lead.as_micros() as u64;
    tokio::time::sleep(Duration::from_micros(next - now)).await;
}

async fn run_long_tail(backend: &Backend, args: &Args, mode: Mode, rate_per_key: f64) -> LongTail {
    let ns = format!("tail-{}-{}", mode.name(), std::process::id());
    let limiters = build(backend, args, mode, &ns).await;
    let names: Arc<Vec<String>> = Arc::new((0..args.keys).map(key_name).collect());
    align_to_window(args.period, Duration::from_millis(200)).await;
    // Warm-up: every key once on every server, many at a time.
    let mut warm = Vec::new();
    for limiter in &limiters {
        for chunk in 0..64usize {
            let (limiter, names) = (limiter.clone(), names.clone());
            warm.push(tokio::spawn(async move {
                for k in (chunk..names.len()).step_by(64) {
                    let _ = limiter.check(&names[k], 1).await;
                }
            }));
        }
    }
    for t in warm {
        t.await.unwrap();
    }
    // Optimistic first touches return on credit before their lease lands:
    // wait until the refills have settled, so the warm phase is measured.
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let trips: u64 = limiters.iter().map(|l| l.stats().round_trips).sum();
        if trips == last {
            break;
        }
        last = trips;
    }
    let workers = args.servers * args.tasks;
    let tick = Duration::from_millis(5);
    let total_rate = rate_per_key * args.keys as f64;
    let per_tick = total_rate * tick.as_secs_f64() / workers as f64;
    let measure_from = wall_us() + args.warm.as_micros() as u64;
    let stop_at = measure_from + args.duration.as_micros() as u64;
    let shared = Arc::new(Mutex::new((
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap(),
        0u64,
        0u64,
        0u64,
        [0u64; 20],
        [(0u64, 0u64, 0u64); 40],
    )));
    let debug = std::env::var("COMPARE_DEBUG").is_ok();
    let period_us = args.period.as_micros() as u64;
    let mut tasks = Vec::new();
    for w in 0..workers {
        let limiter = limiters[w % args.servers].clone();
        let (names, shared) = (names.clone(), shared.clone());
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
            let (mut count, mut waited, mut admitted) = (0u64, 0u64, 0u64);
            let mut state =
                0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407);
            let mut pacer = Pacer::new(tick, per_tick);
            let mut by_phase = [0u64; 20];
            let mut near_boundary = [(0u64, 0u64, 0u64); 40];
            while wall_us() < stop_at {
                let measured = wall_us() >= measure_from;
                for _ in 0..pacer.next_batch().await {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let key = &names[(state % names.len() as u64) as usize];
                    let began = Instant::now();
                    let d = match limiter.check_now(key, 1) {
                        Some(d) => d,
                        None => {
                            waited += u64::from(measured);
                            let phase = wall_us() % period_us;
                            let d = limiter.check(key, 1).await;
                            if measured && debug {
                                let at = phase * 20 / period_us;
                                by_phase[at as usize] += 1;
                                // Near a boundary: by 5 ms from 100 ms before it.
                                let near = (phase + 100_000) % period_us;
                                if near < 200_000 {
                                    let b = (near / 5_000) as usize;
                                    near_boundary[b].0 += 1;
                                    near_boundary[b].1 += u64::from(!d.is_allowed());
                                    near_boundary[b].2 += began.elapsed().as_micros() as u64;
                                }
                            }
                            d
                        }
                    };
                    if !measured {
                        continue;
                    }
                    let _ = hist.record(began.elapsed().as_nanos().max(1) as u64);
                    count += 1;
                    admitted += u64::from(d.is_allowed());
                }
            }
            let mut s = shared.lock().unwrap();
            s.0.add(&hist).unwrap();
            s.1 += count;
            s.2 += waited;
            s.3 += admitted;
            for (all, one) in s.4.iter_mut().zip(by_phase) {
                *all += one;
            }
            for (all, one) in s.5.iter_mut().zip(near_boundary) {
                all.0 += one.0;
                all.1 += one.1;
                all.2 += one.2;
            }
        }));
    }
    tokio::time::sleep(Duration::from_micros(
        measure_from.saturating_sub(wall_us()),
    ))
    .await;
    let cpu_before = backend.cpu_seconds();
    let scripts_before = backend.script_stats().0;
    let trips_before: u64 = limiters.iter().map(|l| l.stats().round_trips).sum();
    let started = Instant::now();
    for t in tasks {
        t.await.unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    let scripts = backend.script_stats().0 - scripts_before;
    let redis_cpu = backend.cpu_seconds() - cpu_before;
    let round_trips = limiters.iter().map(|l| l.stats().round_trips).sum::<u64>() - trips_before;
    if wall_us() / args.period.as_micros() as u64 != measure_from / args.period.as_micros() as u64
        && args.warm.is_zero()
    {
        println!(
            "  ({}: a window boundary fell inside the measured phase; lengthen --period-ms)",
            mode.name()
        );
    }
    for l in &limiters {
        l.shutdown().await;
    }
    let (latency, decisions, waited, admitted, by_phase, near_boundary) =
        Arc::try_unwrap(shared).ok().unwrap().into_inner().unwrap();
    if debug {
        println!("  {}: {:?}", mode.name(), limiters[0].stats());
        println!(
            "  {}: waits by twentieth of the window: {by_phase:?}",
            mode.name()
        );
        println!("  waits near a boundary (ms from it: waits, denied, mean wait):");
        for (b, (n, denied, us)) in near_boundary.iter().enumerate() {
            if *n > 0 {
                let from = b as i64 * 5 - 100;
                println!(
                    "    {from:>4} ms: {n:>6} {denied:>5} {:>8.1} ms",
                    *us as f64 / *n as f64 / 1e3
                );
            }
        }
    }
    LongTail {
        name: mode.name(),
        decisions,
        seconds,
        latency,
        waited,
        scripts,
        round_trips,
        redis_cpu,
        admitted,
    }
}

async fn long_tail(backend: &Backend, args: &Args, rate_per_key: f64) {
    println!(
        "long tail: {} servers × {} tasks, {} keys picked uniformly at {rate_per_key}/s each ({:.0}/s in all), {} per key per {:?} (far above demand), measured for {:?} after {:?} of the same load\n",
        args.servers,
        args.tasks,
        args.keys,
        rate_per_key * args.keys as f64,
        args.limit,
        args.period,
        args.duration,
        args.warm,
    );
    println!(
        "{:<20} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9} {:>14} {:>11} {:>12} {:>10}",
        "mode",
        "decisions/s",
        "p50",
        "p99",
        "p99.9",
        "max",
        "waited",
        "scripts/1000",
        "RT/1000",
        "Redis CPU",
        "admitted"
    );
    let mut rows = Vec::new();
    for mode in [
        Mode::Local,
        Mode::Exact(Algorithm::FixedWindow),
        Mode::HybridStrict,
        Mode::HybridOptimistic,
    ]
    .into_iter()
    .filter(|m| args.modes.is_empty() || args.modes.contains(&m.name()))
    {
        let o = run_long_tail(backend, args, mode, rate_per_key).await;
        let per_1000 = |n: u64| n as f64 * 1000.0 / o.decisions.max(1) as f64;
        println!(
            "{:<20} {:>12.0} {:>10} {:>10} {:>10} {:>10} {:>8.2}% {:>14.2} {:>11.2} {:>11.3}s {:>9.1}%",
            o.name,
            o.decisions as f64 / o.seconds,
            ns(o.latency.value_at_quantile(0.5)),
            ns(o.latency.value_at_quantile(0.99)),
            ns(o.latency.value_at_quantile(0.999)),
            ns(o.latency.max()),
            o.waited as f64 * 100.0 / o.decisions.max(1) as f64,
            per_1000(o.scripts),
            per_1000(o.round_trips),
            o.redis_cpu,
            o.admitted as f64 * 100.0 / o.decisions.max(1) as f64,
        );
        rows.push(o);
    }
    let cpu_per = |name: &str| {
        let o = rows.iter().find(|o| o.name == name)?;
        Some(o.redis_cpu / o.decisions.max(1) as f64)
    };
    if let (Backend::Redis { .. }, Some(exact), Some(hybrid)) = (
        backend,
        cpu_per("exact-fixed-window"),
        cpu_per("hybrid-strict"),
    ) {
        println!(
            "\nRedis CPU per decision, exact ÷ hybrid-strict: {:.0}×",
            exact / hybrid.max(1e-12)
        );
    }
}

/// Closed-loop ramp: more and more concurrent callers until p99 passes
/// 1 ms; returns rows (concurrency, decisions/s, p99 ns, Redis CPU share).
async fn ramp(backend: &Backend, args: &Args, mode: Mode) -> Vec<(usize, f64, u64, f64)> {
    let mut rows = Vec::new();
    for concurrency in [1usize, 2, 4, 8, 16, 32, 64, 128] {
        let limiters = build(
            backend,
            &Args {
                servers: args.servers,
                ..args.clone()
            },
            mode,
            &format!("ramp-{}-{concurrency}", mode.name()),
        )
        .await;
        let stop = Instant::now() + Duration::from_millis(1500);
        let cpu_before = backend.cpu_seconds();
        let started = Instant::now();
        let mut tasks = Vec::new();
        for c in 0..concurrency {
            let limiter = limiters[c % limiters.len()].clone();
            // A quota no load reaches: this measures cost, not denials.
            tasks.push(tokio::spawn(async move {
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
                let mut i = c * 7919;
                while Instant::now() < stop {
                    i = i.wrapping_add(1);
                    let key = format!("ramp-{}", i % 1000);
                    let began = Instant::now();
                    limiter.check(&key, 1).await;
                    let _ = hist.record(began.elapsed().as_nanos().max(1) as u64);
                }
                hist
            }));
        }
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
        for t in tasks {
            hist.add(t.await.unwrap()).unwrap();
        }
        let secs = started.elapsed().as_secs_f64();
        let cpu = (backend.cpu_seconds() - cpu_before) / secs;
        for l in &limiters {
            l.shutdown().await;
        }
        let p99 = hist.value_at_quantile(0.99);
        rows.push((concurrency, hist.len() as f64 / secs, p99, cpu));
        if p99 > 1_000_000 {
            break;
        }
    }
    rows
}

fn ns(v: u64) -> String {
    if v >= 1_000_000 {
        format!("{:.2} ms", v as f64 / 1e6)
    } else if v >= 1_000 {
        format!("{:.1} µs", v as f64 / 1e3)
    } else {
        format!("{v} ns")
    }
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    format!("{cpu}, {cores} cores, {}", std::env::consts::OS)
}

fn json_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn write_json(path: &str, backend: &str, args: &Args, outcomes: &[Outcome]) {
    let mut out = String::new();
    let _ = write!(
        out,
        "{{\n  \"machine\": \"{}\",\n  \"store\": \"{}\",\n  \"load\": {{\"servers\": {}, \"keys\": {}, \"limit\": {}, \"period_ms\": {}, \"demand_factor\": {}, \"duration_s\": {}}},\n  \"modes\": [\n",
        json_escape(&machine()),
        json_escape(backend),
        args.servers,
        args.keys,
        args.limit,
        args.period.as_millis(),
        args.demand,
        args.duration.as_secs()
    );
    for (i, o) in outcomes.iter().enumerate() {
        let _ = writeln!(
            out,
            "    {{\"name\": \"{}\", \"decisions_per_s\": {:.1}, \"p50_ns\": {}, \"p99_ns\": {}, \"p999_ns\": {}, \"round_trips_per_1000\": {:.3}, \"utilization\": {:.4}, \"worst_overshoot\": {}, \"log_over\": {:.4}, \"redis_cpu_s\": {:.3}}}{}",
            o.name,
            o.per_second(),
            o.latency.value_at_quantile(0.5),
            o.latency.value_at_quantile(0.99),
            o.latency.value_at_quantile(0.999),
            o.round_trips_per_1000(),
            o.utilization(args.limit),
            o.worst_overshoot(args.limit),
            o.log_over(args.limit),
            o.redis_cpu,
            if i + 1 < outcomes.len() { "," } else { "" }
        );
    }
    out.push_str("  ]\n}\n");
    std::fs::write(path, out).expect("write the JSON");
}

fn plot(path: &str, args: &Args, outcomes: &[Outcome]) {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let (left, right) = root.split_horizontally(520);
    let colors = [BLACK, RED, BLUE, MAGENTA, GREEN, CYAN];
    // Enough for every mode, the sliding-window rows too.
    let more = [
        RGBColor(230, 140, 0),
        RGBColor(120, 60, 170),
        RGBColor(120, 120, 120),
    ];

    // Latency CDF, log-scaled x.
    let max_ns = outcomes
        .iter()
        .map(|o| o.latency.max())
        .max()
        .unwrap_or(1)
        .max(10) as f64;
    let mut chart = ChartBuilder::on(&left)
        .caption("decision latency CDF", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(44)
        .build_cartesian_2d((10f64..max_ns * 1.2).log_scale(), 0f64..1f64)
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("ns per decision (log)")
        .y_desc("fraction")
        .x_labels(6)
        .x_label_formatter(&|v| ns(*v as u64))
        .draw()
        .unwrap();
    for (o, color) in outcomes.iter().zip(colors.into_iter().chain(more)) {
        let points: Vec<(f64, f64)> = (0..=200)
            .map(|i| {
                let q = i as f64 / 200.0;
                (o.latency.value_at_quantile(q).max(10) as f64, q)
            })
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .unwrap()
            .label(o.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .unwrap();

    // Admitted per window for the hottest key, against the limit.
    let windows: Vec<i64> = outcomes.iter().flat_map(|o| o.full_windows()).collect();
    let max_admitted = outcomes
        .iter()
        .flat_map(|o| {
            o.admitted
                .iter()
                .filter(|((k, _), _)| *k == 0)
                .map(|(_, a)| *a)
        })
        .max()
        .unwrap_or(args.limit)
        .max(args.limit) as f64;
    let n_windows = windows.len().max(1) / outcomes.len().max(1);
    let mut chart = ChartBuilder::on(&right)
        .caption("hottest key: admitted per window", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(44)
        .build_cartesian_2d(
            0f64..(n_windows.max(1) as f64 - 0.5).max(1.0),
            0f64..max_admitted * 1.15,
        )
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("full window #")
        .y_desc("admitted")
        .draw()
        .unwrap();
    chart
        .draw_series(LineSeries::new(
            vec![
                (0.0, args.limit as f64),
                (n_windows as f64, args.limit as f64),
            ],
            BLACK.mix(0.4).stroke_width(1),
        ))
        .unwrap()
        .label("limit")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.mix(0.4)));
    for (o, color) in outcomes.iter().zip(colors.into_iter().chain(more)) {
        let points: Vec<(f64, f64)> = o
            .full_windows()
            .iter()
            .enumerate()
            .map(|(i, w)| {
                (
                    i as f64,
                    o.admitted.get(&(0, *w)).copied().unwrap_or(0) as f64,
                )
            })
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .unwrap();
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .unwrap();
    root.present().expect("write the SVG");
}

/// With `--rtt-ms`, the URL of a delaying proxy in front of the Redis at
/// `url` (on this host), run on a thread of its own so its timers do not
/// queue behind the load.
fn delayed(url: &str, args: &Args) -> Option<String> {
    if args.rtt.is_zero() && args.jitter.is_zero() {
        return None;
    }
    let port: u16 = url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| usage_error(&format!("--rtt-ms: no port in {url}")));
    let each_way = support::proxy::Delay::jittered(args.rtt / 2, args.jitter);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the proxy's runtime");
        runtime.block_on(async move {
            let proxy = support::proxy::Proxy::start_with(port, each_way, each_way).await;
            let _ = tx.send(proxy.url());
            std::future::pending::<()>().await;
        });
    });
    Some(rx.recv().expect("the delaying proxy starts"))
}

/// What one round trip through the proxy takes, idle: its delays plus
/// the timer's rounding (about a millisecond each way).
fn ping_round_trip(url: &str) -> (Duration, Duration) {
    let mut conn = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .expect("connect through the proxy");
    let mut samples: Vec<Duration> = (0..100)
        .map(|_| {
            let began = Instant::now();
            let _: String = redis::cmd("PING").query(&mut conn).expect("PING");
            began.elapsed()
        })
        .collect();
    samples.sort();
    (samples[50], samples[98])
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = parse_args();
    let backend = if let Some(urls) = &args.cluster {
        Backend::Redis {
            urls: urls.clone(),
            cluster: true,
            _server: None,
            via: None,
        }
    } else if let Some(url) = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        Backend::Redis {
            via: delayed(&url, &args),
            urls: vec![url],
            cluster: false,
            _server: None,
        }
    } else if redis_server_available() {
        let server = support::RedisServer::start();
        Backend::Redis {
            via: delayed(&server.url(), &args),
            urls: vec![server.url()],
            cluster: false,
            _server: Some(server),
        }
    } else {
        Backend::Embedded(MemoryStore::new())
    };
    let store = backend.describe();
    println!("machine: {}\nstore: {store}", machine());
    if let Backend::Redis { via: Some(via), .. } = &backend {
        let (p50, p99) = ping_round_trip(via);
        println!("round trip through the proxy (100 PINGs, idle): p50 {p50:.2?}, p99 {p99:.2?}");
    }
    if let Some(rate) = args.demand_per_key {
        long_tail(&backend, &args, rate).await;
        return;
    }
    println!(
        "load: {} servers × {} tasks, {} keys, {} per key per {:?}, Zipf demand at {}× the limit, {:?} per mode\n",
        args.servers, args.tasks, args.keys, args.limit, args.period, args.demand, args.duration
    );
    let default_modes = [
        Mode::Local,
        Mode::Exact(Algorithm::FixedWindow),
        Mode::Exact(Algorithm::TokenBucket),
        Mode::Exact(Algorithm::Gcra),
        Mode::HybridStrict,
        Mode::HybridOptimistic,
        Mode::Exact(Algorithm::SlidingWindow),
        Mode::HybridStrictSliding { prelease: true },
    ];
    // Named with --modes only.
    let extra_modes = [Mode::HybridStrictSliding { prelease: false }];
    let modes: Vec<Mode> = if args.modes.is_empty() {
        default_modes.to_vec()
    } else {
        default_modes
            .into_iter()
            .chain(extra_modes)
            .filter(|m| args.modes.iter().any(|n| *n == m.name()))
            .collect()
    };
    let width = modes
        .iter()
        .map(|m| m.name().len())
        .max()
        .unwrap_or(4)
        .max(20);
    let mut outcomes = Vec::new();
    println!(
        "{:<width$} {:>12} {:>10} {:>10} {:>10} {:>12} {:>11} {:>10} {:>9} {:>10}",
        "mode",
        "decisions/s",
        "p50",
        "p99",
        "p99.9",
        "RT per 1000",
        "utilization",
        "worst over",
        "log over",
        "Redis CPU"
    );
    for mode in modes {
        let o = run_mode(&backend, &args, mode).await;
        println!(
            "{:<width$} {:>12.0} {:>10} {:>10} {:>10} {:>12.2} {:>10.1}% {:>10} {:>8.1}% {:>9.2}s",
            o.name,
            o.per_second(),
            ns(o.latency.value_at_quantile(0.5)),
            ns(o.latency.value_at_quantile(0.99)),
            ns(o.latency.value_at_quantile(0.999)),
            o.round_trips_per_1000(),
            o.utilization(args.limit) * 100.0,
            o.worst_overshoot(args.limit),
            o.log_over(args.limit) * 100.0,
            o.redis_cpu
        );
        outcomes.push(o);
    }
    let by = |name: &str| outcomes.iter().find(|o| o.name == name);
    if let (Some(exact), Some(hybrid)) = (
        by("exact-sliding-window"),
        by("hybrid-strict-sliding-window"),
    ) {
        println!(
            "\nsliding window: worst load over the limit exact {} / hybrid-strict {} (bound 0); \
             round trips per 1000 decisions hybrid {:.2} vs exact {:.0}; \
             most in a trailing period over the limit exact {:+.1}%, hybrid {:+.1}%",
            exact.worst_overshoot(args.limit),
            hybrid.worst_overshoot(args.limit),
            hybrid.round_trips_per_1000(),
            exact.round_trips_per_1000(),
            exact.log_over(args.limit) * 100.0,
            hybrid.log_over(args.limit) * 100.0,
        );
    }
    let (Some(exact), Some(hybrid), Some(optimistic)) = (
        by("exact-fixed-window"),
        by("hybrid-strict"),
        by("hybrid-optimistic"),
    ) else {
        return;
    };
    let per_core = |o: &Outcome| o.decisions as f64 / o.redis_cpu.max(1e-9);
    println!(
        "\nexact ÷ hybrid p50 latency: {:.0}×; round trips per 1000 decisions: hybrid {:.2} vs exact {:.0}",
        exact.latency.value_at_quantile(0.5) as f64 / hybrid.latency.value_at_quantile(0.5).max(1) as f64,
        hybrid.round_trips_per_1000(),
        exact.round_trips_per_1000()
    );
    if matches!(backend, Backend::Redis { .. }) {
        println!(
            "decisions per Redis CPU-second: exact {:.0}, hybrid {:.0} ({:.0}× more per Redis core)",
            per_core(exact),
            per_core(hybrid),
            per_core(hybrid) / per_core(exact)
        );
        let steady = |o: &Outcome| o.steady.1 as f64 / o.steady.0.max(1e-9);
        println!(
            "  steady state (from the second window to the end of the load: no first leases, no shutdown): exact {:.0}, hybrid {:.0} ({:.0}×)",
            steady(exact),
            steady(hybrid),
            steady(hybrid) / steady(exact)
        );
        println!(
            "bounds: strict worst overshoot {} (bound 0); optimistic worst {} (bound {} × {MAX_DEBT} = {})",
            hybrid.worst_overshoot(args.limit),
            optimistic.worst_overshoot(args.limit),
            args.servers,
            args.servers as u64 * MAX_DEBT
        );
    }
    if args.ramp && matches!(backend, Backend::Redis { .. }) {
        for mode in [Mode::Exact(Algorithm::FixedWindow), Mode::HybridStrict] {
            println!(
                "\nRedis-load ramp, {} (closed loop, a quota no load reaches):",
                mode.name()
            );
            println!(
                "{:>12} {:>14} {:>10} {:>18} {:>22}",
                "callers", "decisions/s", "p99", "Redis CPU (cores)", "decisions per core-s"
            );
            for (c, rate, p99, cpu) in ramp(&backend, &args, mode).await {
                println!(
                    "{c:>12} {rate:>14.0} {:>10} {cpu:>18.2} {:>22.0}",
                    ns(p99),
                    rate / cpu.max(1e-9)
                );
            }
        }
    }
    if let Some(path) = &args.json {
        write_json(path, &store, &args, &outcomes);
        println!("\nwrote {path}");
    }
    if let Some(path) = &args.plot {
        plot(path, &args, &outcomes);
        println!("wrote {path}");
    }
}
