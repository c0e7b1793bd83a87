//! Four servers, one key, 100 requests allowed, 400 sent.
//!
//! Each "server" is a `Limiter` with its own store connection behind a
//! round-robin balancer. Per-process limiting admits about 4 × 100; the
//! shared limiters admit 100.
//!
//! Runs on the embedded `MemoryStore` unless `REDIS_URL` is set:
//!
//! ```text
//! cargo run --release -p slicelimit-examples --example four_servers
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --release -p slicelimit-examples --example four_servers
//! ```

use std::time::{Duration, Instant};

use slicelimit::{
    nonzero, Algorithm, HybridConfig, Limiter, MemoryStore, Quota, RedisStore, Store,
};

const SERVERS: usize = 4;
const LIMIT: u32 = 100;
const REQUESTS: usize = 400;

struct Row {
    name: &'static str,
    admitted: u64,
    denied: u64,
    p50: Duration,
    p99: Duration,
    round_trips: u64,
}

enum Mode {
    Local,
    Exact,
    Hybrid(HybridConfig),
}

async fn connect(redis_url: Option<&str>, memory: &MemoryStore) -> Store {
    match redis_url {
        Some(url) => RedisStore::connect(url)
            .await
            .unwrap_or_else(|e| panic!("cannot reach REDIS_URL={url}: {e}"))
            .into(),
        None => memory.clone().into(),
    }
}

async fn run(name: &'static str, mode: Mode, algorithm: Algorithm, redis_url: Option<&str>) -> Row {
    let memory = MemoryStore::new();
    let quota = Quota::per_minute(nonzero!(LIMIT));
    let namespace = format!("four-servers-{}", std::process::id());
    let mut servers = Vec::new();
    for _ in 0..SERVERS {
        let builder = Limiter::builder(quota)
            .store(connect(redis_url, &memory).await)
            .algorithm(algorithm)
            .namespace(&namespace);
        let builder = match &mode {
            Mode::Local => builder.local(),
            Mode::Exact => builder.exact(),
            Mode::Hybrid(config) => builder.hybrid(config.clone()),
        };
        servers.push(builder.build().expect("valid configuration"));
    }
    let key = format!("key-77-{name}");
    // Stay clear of a window boundary, as the store's clock places it.
    let peek = servers[0].check(&key, 0).await;
    if algorithm == Algorithm::FixedWindow && peek.reset_after() < Duration::from_secs(2) {
        tokio::time::sleep(peek.reset_after() + Duration::from_millis(50)).await;
    }
    let before: u64 = servers.iter().map(|s| s.stats().round_trips).sum();
    let mut latencies = Vec::with_capacity(REQUESTS);
    let (mut admitted, mut denied) = (0, 0);
    for i in 0..REQUESTS {
        let server = &servers[i % SERVERS];
        let started = Instant::now();
        let decision = server.check(&key, 1).await;
        latencies.push(started.elapsed());
        if decision.is_allowed() {
            admitted += 1;
        } else {
            denied += 1;
        }
    }
    let after: u64 = servers.iter().map(|s| s.stats().round_trips).sum();
    for server in &servers {
        server.shutdown().await;
    }
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p) as usize];
    Row {
        name,
        admitted,
        denied,
        p50: pct(0.50),
        p99: pct(0.99),
        round_trips: after - before,
    }
}

fn micros(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

#[tokio::main]
async fn main() {
    let redis_url = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty());
    match &redis_url {
        Some(url) => println!("store: Redis at {url}"),
        None => {
            println!("store: embedded MemoryStore (set REDIS_URL=redis://host:port to use Redis)")
        }
    }
    println!(
        "{SERVERS} servers behind a round-robin balancer, one key allowed {LIMIT} requests per minute, {REQUESTS} requests sent\n"
    );
    let url = redis_url.as_deref();
    let rows = vec![
        run(
            "per-process local",
            Mode::Local,
            Algorithm::FixedWindow,
            url,
        )
        .await,
        run(
            "exact fixed window",
            Mode::Exact,
            Algorithm::FixedWindow,
            url,
        )
        .await,
        run(
            "exact token bucket",
            Mode::Exact,
            Algorithm::TokenBucket,
            url,
        )
        .await,
        run("exact GCRA", Mode::Exact, Algorithm::Gcra, url).await,
        run(
            "hybrid strict",
            Mode::Hybrid(HybridConfig::strict()),
            Algorithm::FixedWindow,
            url,
        )
        .await,
        run(
            "hybrid optimistic (debt 5)",
            Mode::Hybrid(HybridConfig::optimistic(5)),
            Algorithm::FixedWindow,
            url,
        )
        .await,
    ];
    println!(
        "{:<28} {:>8} {:>7} {:>10} {:>11} {:>11} {:>12}",
        "limiter", "admitted", "denied", "overshoot", "p50", "p99", "round trips"
    );
    for r in &rows {
        println!(
            "{:<28} {:>8} {:>7} {:>10} {:>11} {:>11} {:>12}",
            r.name,
            r.admitted,
            r.denied,
            r.admitted.saturating_sub(u64::from(LIMIT)),
            micros(r.p50),
            micros(r.p99),
            r.round_trips
        );
    }
}
