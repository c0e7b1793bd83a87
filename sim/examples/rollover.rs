//! Many keys across window boundaries: one hybrid strict limiter (100 per
//! minute) on a private Redis, new keys arriving at a steady pace, each
//! asked a few times and then never again; then an idle spell.
//!
//! ```text
//! cargo run --release --example rollover -- --keys 1000000 --seconds 120 --idle-s 90
//! ```
//!
//! Prints a line per second: new keys that second, their first requests
//! denied, store calls, keys held, RSS and the CPU the process used; then
//! the totals around each minute boundary. `REDIS_URL` names a Redis to
//! use instead of a private one (never flushed). Flags: `--keys N`
//! (1,000,000), `--seconds N` (120: the keys are spread over it),
//! `--repeat N` (2: requests per key, 1 s apart), `--idle-s N` (90),
//! `--max-wait-ms N` (strict's default), `--idle-ttl-s N` (the default).

use slicelimit_sim as support;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use slicelimit::{store::RedisOptions, HybridConfig, Limiter, Quota, RedisStore};

fn flag(name: &str) -> Option<u64> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number"))
        })
}

/// Resident set size (MB) and CPU seconds used, from /proc.
fn rss_and_cpu() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss_kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13
    // after the command's closing parenthesis.
    let ticks: f64 = fields
        .get(11)
        .and_then(|u| u.parse::<f64>().ok())
        .unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
    (rss_kb / 1024.0, ticks / 100.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let keys = flag("--keys").unwrap_or(1_000_000);
    let seconds = flag("--seconds").unwrap_or(120);
    let repeat = flag("--repeat").unwrap_or(2);
    let idle_s = flag("--idle-s").unwrap_or(90);
    let _server;
    let url = match std::env::var("REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            _server = support::RedisServer::start();
            _server.url()
        }
    };
    let options = RedisOptions::default();
    let store = RedisStore::connect_with(&url, options)
        .await
        .expect("connect to Redis");
    let mut config = HybridConfig::strict();
    if let Some(ms) = flag("--max-wait-ms") {
        config = config.max_wait(Duration::from_millis(ms));
    }
    if let Some(s) = flag("--idle-ttl-s") {
        config = config.idle_ttl(Duration::from_secs(s));
    }
    let limiter = Limiter::builder(Quota::per_minute(slicelimit::nonzero!(100)))
        .store(store)
        .hybrid(config)
        .namespace(&format!("rollover-{}", std::process::id()))
        .build()
        .expect("builds");
    let per_second = keys.div_ceil(seconds);
    let started = Instant::now();
    let wall_start = support::load::wall_us();
    println!(
        "{keys} keys over {seconds} s ({per_second}/s), each asked {repeat}× 1 s apart; 100/min, hybrid strict"
    );
    println!(
        "{:>5} {:>6} {:>8} {:>10} {:>9} {:>8} {:>7} {:>6}",
        "s", "new", "denied", "store", "held", "RSS MB", "CPU s", "wall"
    );
    // Keys asked again later: (due second, first key, count).
    let mut again: VecDeque<(u64, u64, u64)> = VecDeque::new();
    let mut next_key = 0u64;
    let mut per_boundary: Vec<(u64, u64, u64)> = Vec::new(); // (second, denied, store calls)
    let mut last_calls = 0;
    let mut totals = (0u64, 0u64);
    let (_, cpu0) = rss_and_cpu();
    let mut last_cpu = cpu0;
    for second in 0..seconds + repeat {
        let tick = started + Duration::from_secs(second);
        tokio::time::sleep_until(tick.into()).await;
        let new = per_second.min(keys - next_key);
        let first = next_key;
        next_key += new;
        for r in 1..repeat {
            again.push_back((second + r, first, new));
        }
        let due: Vec<(u64, u64)> = std::iter::from_fn(|| {
            if again.front().is_some_and(|&(s, ..)| s <= second) {
                again.pop_front().map(|(_, f, n)| (f, n))
            } else {
                None
            }
        })
        .collect();
        // Paced over the second, in 100 slices, each slice's requests at
        // once (concurrently), as many clients would send them.
        let mut denied = 0u64;
        for slice in 0..100u64 {
            let at = tick + Duration::from_millis(slice * 10);
            tokio::time::sleep_until(at.into()).await;
            let lo = first + new * slice / 100;
            let hi = first + new * (slice + 1) / 100;
            let firsts = futures_like_join(&limiter, lo..hi).await;
            denied += firsts;
            for &(f, n) in &due {
                let lo = f + n * slice / 100;
                let hi = f + n * (slice + 1) / 100;
                futures_like_join(&limiter, lo..hi).await;
            }
        }
        let stats = limiter.stats();
        let calls = stats.store_calls - last_calls;
        last_calls = stats.store_calls;
        let (rss, cpu) = rss_and_cpu();
        let wall_s = (wall_start / 1_000_000 + second) % 60;
        println!(
            "{second:>5} {new:>6} {denied:>8} {calls:>10} {:>9} {rss:>8.0} {:>7.2} {wall_s:>5}s",
            limiter.local_keys(),
            cpu - last_cpu
        );
        last_cpu = cpu;
        totals.0 += new;
        totals.1 += denied;
        per_boundary.push((wall_s, denied, calls));
    }
    println!(
        "first requests denied: {} of {} ({:.3} %)",
        totals.1,
        totals.0,
        100.0 * totals.1 as f64 / totals.0.max(1) as f64
    );
    // Around a boundary: from 5 s before to 15 s after (wall second 55..=59, 0..=14).
    let near: Vec<_> = per_boundary
        .iter()
        .filter(|(s, ..)| *s >= 55 || *s < 15)
        .collect();
    let far: Vec<_> = per_boundary
        .iter()
        .filter(|(s, ..)| *s >= 15 && *s < 55)
        .collect();
    let mean =
        |v: &[&(u64, u64, u64)]| v.iter().map(|x| x.2).sum::<u64>() as f64 / v.len().max(1) as f64;
    println!(
        "store calls per second: {:.0} near a boundary (55 s to 15 s), {:.0} elsewhere",
        mean(&near),
        mean(&far)
    );
    println!("idle for {idle_s} s:");
    for s in 0..idle_s {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (rss, cpu) = rss_and_cpu();
        if s % 10 == 9 {
            println!(
                "  +{:>3} s: {} keys held, RSS {rss:.0} MB, CPU {:.2} cores over the last 10 s",
                s + 1,
                limiter.local_keys(),
                (cpu - last_cpu) / 10.0
            );
            last_cpu = cpu;
        }
    }
    limiter.shutdown().await;
}

/// The first requests of keys `range`, all at once; how many were denied.
async fn futures_like_join(limiter: &Limiter, range: std::ops::Range<u64>) -> u64 {
    let mut set = tokio::task::JoinSet::new();
    for k in range {
        let limiter = limiter.clone();
        set.spawn(async move { !limiter.check(&format!("k{k}"), 1).await.is_allowed() });
    }
    let mut denied = 0;
    while let Some(d) = set.join_next().await {
        denied += u64::from(d.unwrap_or(false));
    }
    denied
}
