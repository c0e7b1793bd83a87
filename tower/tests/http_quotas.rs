//! The HTTP layer with several quotas, tiers and refunds: one header item
//! per quota, each key's own quota in its items, refunds of failed
//! requests, and policies that are all-or-nothing (also when a request is
//! dropped mid-decision, and on a real Redis); waits within their budget.

use slicelimit_sim as support;

use std::time::Duration;

use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use slicelimit::{clock::FakeClock, nonzero, HybridConfig, Limiter, MemoryStore, Quota};
use slicelimit_sim::FaultyStore;
use slicelimit_tower::RateLimitLayer;
use tower::ServiceExt;

use support::http::{sf_items, Item, ORIGIN};
use support::load::RedisClock;
use support::{RedisServer, VirtualClock};

fn clock() -> FakeClock {
    FakeClock::new(ORIGIN + Duration::from_secs(5))
}

fn router(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route(
            "/fail",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
        )
        .layer(layer)
}

async fn call(router: &Router, path: &str, key: &str) -> http::Response<axum::body::Body> {
    let request = Request::get(path)
        .header("x-api-key", key)
        .body(axum::body::Body::empty())
        .unwrap();
    router.clone().oneshot(request).await.unwrap()
}

fn items(response: &http::Response<axum::body::Body>, name: &str) -> Vec<Item> {
    sf_items(
        name,
        response
            .headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap()),
    )
}

fn param(item: &Item, name: &str) -> i64 {
    item.1
        .iter()
        .find(|(k, _)| k == name)
        .unwrap_or_else(|| panic!("{item:?} has no {name}"))
        .1
}

#[tokio::test]
async fn several_quotas_send_one_item_each() {
    let clock = clock();
    let limiter = Limiter::builder(Quota::per_second(nonzero!(3)))
        .and(Quota::per_minute(nonzero!(5)))
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .build()
        .unwrap();
    let app = router(RateLimitLayer::new(limiter).policy_name("api"));
    let r = call(&app, "/ok", "k").await;
    assert_eq!(r.status(), StatusCode::OK);
    let policy = items(&r, "ratelimit-policy");
    assert_eq!(policy.len(), 2, "{policy:?}");
    assert_eq!(policy[0].0, "api");
    assert_eq!((param(&policy[0], "q"), param(&policy[0], "w")), (3, 1));
    assert_eq!(policy[1].0, "api.1");
    assert_eq!((param(&policy[1], "q"), param(&policy[1], "w")), (5, 60));
    let limits = items(&r, "ratelimit");
    assert_eq!(param(&limits[0], "r"), 2);
    assert_eq!(param(&limits[1], "r"), 4);
    // The per-second quota binds first, then the per-minute one.
    for _ in 0..2 {
        assert_eq!(call(&app, "/ok", "k").await.status(), StatusCode::OK);
    }
    let denied = call(&app, "/ok", "k").await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.headers()["retry-after"], "1");
    clock.advance(Duration::from_secs(1));
    for _ in 0..2 {
        assert_eq!(call(&app, "/ok", "k").await.status(), StatusCode::OK);
    }
    let denied = call(&app, "/ok", "k").await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = denied.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry > 1, "the minute binds now: {retry}");
}

#[tokio::test]
async fn a_tier_is_stated_in_its_keys_headers() {
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(10)))
        .store(MemoryStore::new())
        .quota_for(|k| (k == "gold").then(|| Quota::per_minute(nonzero!(1000))))
        .build()
        .unwrap();
    let app = router(RateLimitLayer::new(limiter));
    let gold = items(&call(&app, "/ok", "gold").await, "ratelimit-policy");
    let plain = items(&call(&app, "/ok", "plain").await, "ratelimit-policy");
    assert_eq!(param(&gold[0], "q"), 1000);
    assert_eq!(param(&plain[0], "q"), 10);
}

/// `refund_on(5xx)`: failed requests do not cost the quota; successful
/// ones still do.
#[tokio::test]
async fn server_errors_are_refunded_when_asked() {
    let clock = clock();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(3)))
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .build()
        .unwrap();
    let app =
        router(RateLimitLayer::new(limiter.clone()).refund_on(|status| status.is_server_error()));
    for i in 0..10 {
        let r = call(&app, "/fail", "k").await;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR, "request {i}");
        // The refund is sent after the response, in the background.
        let want = i + 1;
        for _ in 0..100 {
            if limiter.stats().refunded >= want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(limiter.stats().refunded, want);
    }
    for _ in 0..3 {
        assert_eq!(call(&app, "/ok", "k").await.status(), StatusCode::OK);
    }
    assert_eq!(
        call(&app, "/ok", "k").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(limiter.stats().refunded, 10, "successes are not refunded");

    // Without the option, failures cost the quota.
    let plain = Limiter::builder(Quota::per_minute(nonzero!(3)))
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let app = router(RateLimitLayer::new(plain));
    for _ in 0..3 {
        call(&app, "/fail", "k").await;
    }
    assert_eq!(
        call(&app, "/ok", "k").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A request one policy denies takes nothing from the others.
#[tokio::test]
async fn policies_are_all_or_nothing() {
    let clock = clock();
    let store = MemoryStore::with_clock(clock.clone());
    let route = Limiter::builder(Quota::per_minute(nonzero!(100)))
        .namespace("route")
        .store(store.clone())
        .clock(clock.clone())
        .build()
        .unwrap();
    let global = Limiter::builder(Quota::per_minute(nonzero!(2)))
        .namespace("global")
        .store(store.clone())
        .clock(clock.clone())
        .build()
        .unwrap();
    let app = router(RateLimitLayer::new(route.clone()).also("global", global));
    for _ in 0..2 {
        assert_eq!(call(&app, "/ok", "k").await.status(), StatusCode::OK);
    }
    for _ in 0..5 {
        assert_eq!(
            call(&app, "/ok", "k").await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    for _ in 0..100 {
        if route.stats().refunded >= 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let w = ((ORIGIN + Duration::from_secs(5)).as_micros() / 60_000_000) as i64;
    let counted = store
        .window_count("route", "k", slicelimit::Algorithm::FixedWindow, w)
        .unwrap();
    assert_eq!(counted, 2, "the route counts only the admitted requests");
}

// ---------------------------------------------------------------------
// All-or-nothing under a slow store, and waits within their budget.
// ---------------------------------------------------------------------

fn virtual_clock() -> VirtualClock {
    VirtualClock {
        origin: Duration::from_secs(6_000),
        start: tokio::time::Instant::now(),
    }
}

async fn drain(limiter: &Limiter, key: &str) -> u64 {
    let mut n = 0;
    while limiter.check(key, 1).await.is_allowed() {
        n += 1;
        assert!(n < 10_000, "no limit");
    }
    n
}

fn slow_store(clock: &VirtualClock) -> FaultyStore {
    FaultyStore::slow(clock, Duration::from_millis(100))
}

fn exact(store: &FaultyStore, clock: &VirtualClock, ns: &str, limit: u32) -> Limiter {
    Limiter::builder(Quota::per_minute(std::num::NonZeroU32::new(limit).unwrap()))
        .store(store.clone())
        .clock(clock.clone())
        .namespace(ns)
        .build()
        .unwrap()
}

/// An HTTP request dropped while its second policy decides: the first
/// policy's permit comes back (the layer's policies are all-or-nothing).
#[tokio::test(start_paused = true)]
async fn a_request_dropped_mid_decision_takes_nothing() {
    let clock = virtual_clock();
    let store = slow_store(&clock);
    let user = exact(&store, &clock, "user", 5);
    let org = exact(&store, &clock, "org", 5);
    let router = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(user.clone()).also("org", org.clone()));
    let request = http::Request::get("/ok")
        .header("x-api-key", "k")
        .body(axum::body::Body::empty())
        .unwrap();
    let dropped = tokio::time::timeout(Duration::from_millis(120), router.oneshot(request)).await;
    assert!(dropped.is_err());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(drain(&user, "k").await, 5);
}

/// `wait_up_to` with three denying policies answers within its budget
/// and one decision.
#[tokio::test(start_paused = true)]
async fn wait_up_to_answers_within_its_budget_and_one_decision() {
    let clock = virtual_clock();
    let store = slow_store(&clock);
    let policies: Vec<Limiter> = ["a", "b", "c"]
        .iter()
        .map(|ns| {
            Limiter::builder(Quota::new(1, Duration::from_secs(1)).unwrap())
                .store(store.clone())
                .clock(clock.clone())
                .namespace(ns)
                .build()
                .unwrap()
        })
        .collect();
    for limiter in &policies {
        assert!(limiter.check("k", 1).await.is_allowed());
    }
    let layer = RateLimitLayer::new(policies[0].clone())
        .also("b", policies[1].clone())
        .also("c", policies[2].clone())
        .wait_up_to(Duration::from_millis(1_500));
    let router = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .layer(layer);
    let request = http::Request::get("/ok")
        .header("x-api-key", "k")
        .body(axum::body::Body::empty())
        .unwrap();
    let began = tokio::time::Instant::now();
    let _ = router.oneshot(request).await.unwrap();
    let took = began.elapsed();
    // The first round of checks (3 × 100 ms) counts toward the budget.
    assert!(
        took <= Duration::from_millis(1_500 + 100 + 5),
        "answered after {took:?}"
    );
}

// ---------------------------------------------------------------------
// A denial gives nothing back, on a real Redis.
// ---------------------------------------------------------------------

/// Quota 0: 5 per 5 s, beside 2 per second, which alone would admit
/// twice quota 0's limit in one of its windows.
const REFUND_PERIOD: Duration = Duration::from_secs(5);
const REFUND_LIMIT: u64 = 5;

fn ticker(every: Duration) -> tokio::time::Interval {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker
}

fn ms(m: u64) -> Duration {
    Duration::from_millis(m)
}

async fn refund_limiter(server: &RedisServer, ns: &str) -> Limiter {
    Limiter::builder(Quota::new(REFUND_LIMIT, REFUND_PERIOD).unwrap())
        .and(Quota::new(2, Duration::from_secs(1)).unwrap())
        .store(support::store(server).await)
        .hybrid(HybridConfig::strict())
        .namespace(ns)
        .build()
        .unwrap()
}

/// A hybrid limiter with two quotas behind the layer, no refund
/// configured, asked every 20 ms for one window of quota 0: at most quota
/// 0's limit of responses 200 in that window.
///
/// A regression: the layer gives every refundable decision of a denied
/// request back (its policies are all-or-nothing), and a denial's was
/// refundable, so what quota 0 took before the 2-a-second quota denied
/// went back twice (the library's `tests/promises.rs` checks the same
/// through `Limiter::refund`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_layer_admits_no_more_than_the_limit_with_two_quotas() {
    let server = RedisServer::start();
    let clock = RedisClock::of(&server);
    let ns = "refund-layer";
    let limiter = refund_limiter(&server, ns).await;
    let app = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(limiter.clone()));
    let start = clock.enter_window(REFUND_PERIOD, ms(50)).await;
    let stop = start + REFUND_PERIOD.as_micros() as u64 - 150_000;
    let (mut ok, mut too_many, mut other) = (0u64, 0u64, 0u64);
    let mut tick = ticker(ms(20));
    while clock.now_us() < stop {
        tick.tick().await;
        let request = http::Request::get("/ok")
            .header("x-api-key", "k")
            .body(axum::body::Body::empty())
            .unwrap();
        match app.clone().oneshot(request).await.unwrap().status() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => too_many += 1,
            _ => other += 1,
        }
    }
    let stats = limiter.stats();
    limiter.shutdown().await;
    println!(
        "layer: {ok} responses 200, {too_many} 429, {other} other in one window of quota 0 \
         (limit {REFUND_LIMIT}); stats refunded {}",
        stats.refunded
    );
    assert_eq!(other, 0);
    assert!(
        ok <= REFUND_LIMIT,
        "{ok} responses 200 > {REFUND_LIMIT} in one window of quota 0 (stats refunded {})",
        stats.refunded
    );
    assert!(ok >= 3, "the quota was used: {ok}");
}
