//! A coupon-redemption API rate-limited per `x-api-key` or per client IP.
//!
//! ```text
//! cargo run --release -p slicelimit-tower --features axum --example axum_server -- --port 3000 --metrics-port 9000 --mode hybrid
//! curl -i -H 'x-api-key: alice' localhost:3000/coupons/redeem
//! curl -s localhost:9000/metrics | grep slicelimit_
//! ```
//!
//! Keyed by IP behind a trusted proxy on 127.0.0.1 (a forged
//! `X-Forwarded-For` from any other peer is ignored; the rightmost address
//! the proxy did not vouch for is the client; IPv6 clients count per /64):
//!
//! ```text
//! cargo run --release -p slicelimit-tower --features axum --example axum_server -- --key-by ip --trusted-proxies 127.0.0.1/32,::1/128
//! curl -i -H 'x-forwarded-for: 1.2.3.4, 203.0.113.9' localhost:3000/coupons/redeem
//! ```
//!
//! Four copies on four ports sharing one Redis (`--redis` or `REDIS_URL`)
//! are the "four servers" of slicelimit's README; without Redis it runs on the
//! embedded store.
//!
//! Flags: `--port`, `--metrics-port`, `--mode exact|hybrid|hybrid-optimistic|local`,
//! `--algorithm fixed-window|sliding-window|token-bucket|gcra`, `--limit`, `--period-secs`,
//! `--redis URL`, `--on-store-error open|closed|fallback`, `--max-debt N`,
//! `--shadow`, `--key-by api-key|ip` (default api-key),
//! `--trusted-proxies CIDR[,CIDR...]` (default none: the peer address is
//! the client).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use slicelimit::{
    Algorithm, FailurePolicy, HybridConfig, Limiter, MemoryStore, Quota, RedisStore, Store,
};
use slicelimit_tower::{Cidr, ClientIp, KeyExtractor, MissingKey, RateLimitLayer};

struct Args {
    port: u16,
    metrics_port: u16,
    mode: String,
    algorithm: Algorithm,
    limit: u64,
    period_secs: u64,
    redis: Option<String>,
    on_store_error: String,
    max_debt: u64,
    shadow: bool,
    key_by: String,
    trusted_proxies: Vec<Cidr>,
}

fn usage(problem: &str) -> ! {
    eprintln!("{problem}\nusage: axum_server [--port N] [--metrics-port N] [--mode exact|hybrid|hybrid-optimistic|local] [--algorithm fixed-window|sliding-window|token-bucket|gcra] [--limit N] [--period-secs N] [--redis URL] [--on-store-error open|closed|fallback] [--max-debt N] [--shadow] [--key-by api-key|ip] [--trusted-proxies CIDR[,CIDR...]]");
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut args = Args {
        port: 3000,
        metrics_port: 9000,
        mode: "hybrid".into(),
        algorithm: Algorithm::FixedWindow,
        limit: 100,
        period_secs: 60,
        redis: std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()),
        on_store_error: "open".into(),
        max_debt: 5,
        shadow: false,
        key_by: "api-key".into(),
        trusted_proxies: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--shadow" {
            args.shadow = true;
            continue;
        }
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        let number = |v: &str| {
            v.parse::<u64>()
                .unwrap_or_else(|_| usage(&format!("{flag}: not a number: {v}")))
        };
        match flag.as_str() {
            "--port" => args.port = number(&value) as u16,
            "--metrics-port" => args.metrics_port = number(&value) as u16,
            "--mode" => args.mode = value,
            "--algorithm" => {
                args.algorithm = value.parse().unwrap_or_else(|e| usage(&format!("{e}")))
            }
            "--limit" => args.limit = number(&value),
            "--period-secs" => args.period_secs = number(&value),
            "--redis" => args.redis = Some(value),
            "--on-store-error" => args.on_store_error = value,
            "--max-debt" => args.max_debt = number(&value),
            "--key-by" => args.key_by = value,
            "--trusted-proxies" => {
                args.trusted_proxies = Cidr::parse_list(&value)
                    .unwrap_or_else(|e| usage(&format!("--trusted-proxies: {e}")))
            }
            other => usage(&format!("unknown flag {other}")),
        }
    }
    args
}

/// Issues a coupon: the work the rate limit protects.
async fn redeem() -> ([(http::HeaderName, &'static str); 1], String) {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        format!("{{\"coupon\":\"C-{n:06}\",\"redeemed\":true}}"),
    )
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let metrics_addr = SocketAddr::from(([127, 0, 0, 1], args.metrics_port));
    slicelimit::metrics::install_prometheus(metrics_addr).unwrap_or_else(|e| usage(&e.to_string()));

    let quota = Quota::new(args.limit, Duration::from_secs(args.period_secs))
        .unwrap_or_else(|e| usage(&e.to_string()));
    let store: Store = match &args.redis {
        Some(url) => RedisStore::connect(url)
            .await
            .unwrap_or_else(|e| usage(&format!("cannot reach Redis at {url}: {e}")))
            .into(),
        None => MemoryStore::new().into(),
    };
    let policy = match args.on_store_error.as_str() {
        "open" => FailurePolicy::FailOpen,
        "closed" => FailurePolicy::FailClosed,
        // A quarter of the limit per process: four servers share the budget.
        "fallback" => FailurePolicy::LocalFallback(
            Quota::new((args.limit / 4).max(1), quota.period())
                .unwrap_or_else(|e| usage(&e.to_string())),
        ),
        other => usage(&format!("unknown failure policy {other}")),
    };
    let builder = Limiter::builder(quota)
        .store(store)
        .algorithm(args.algorithm)
        .namespace("coupons")
        .name("coupons")
        .on_store_error(policy);
    let builder = match args.mode.as_str() {
        "exact" => builder.exact(),
        "hybrid" => builder.hybrid(HybridConfig::strict()),
        "hybrid-optimistic" => builder.hybrid(HybridConfig::optimistic(args.max_debt)),
        "local" => builder.local(),
        other => usage(&format!("unknown mode {other}")),
    };
    let limiter = builder.build().unwrap_or_else(|e| usage(&e.to_string()));
    let key = match args.key_by.as_str() {
        "api-key" => KeyExtractor::header("x-api-key"),
        "ip" => KeyExtractor::ip(ClientIp::behind(args.trusted_proxies.iter().copied())),
        other => usage(&format!("unknown --key-by {other}")),
    };
    let layer = RateLimitLayer::new(limiter.clone())
        .policy_name("coupons")
        .key(key)
        .on_missing_key(MissingKey::Reject(http::StatusCode::UNAUTHORIZED))
        .shadow(args.shadow);
    let app = Router::new()
        .route("/coupons/redeem", get(redeem))
        .layer(layer)
        .route("/healthz", get(|| async { "ok" }));

    let addr = SocketAddr::from(([127, 0, 0, 1], args.port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| usage(&format!("cannot listen on {addr}: {e}")));
    let proxies: Vec<String> = args.trusted_proxies.iter().map(Cidr::to_string).collect();
    println!(
        "coupons on http://{addr}/coupons/redeem ({} {}, {} per {} s, store: {}, key: {}, trusted proxies: {}), metrics on http://{metrics_addr}/metrics",
        args.mode,
        args.algorithm.as_str(),
        args.limit,
        args.period_secs,
        args.redis.as_deref().unwrap_or("embedded"),
        args.key_by,
        if proxies.is_empty() { "none".to_owned() } else { proxies.join(",") },
    );
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    // The peer address, for `--key-by ip`.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
    .expect("server");
    limiter.shutdown().await;
}
