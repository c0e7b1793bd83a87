//! The HTTP layer with several quotas, tiers and refunds: one header item
//! per quota, each key's own quota in its items, refunds of failed
//! requests, and policies that are all-or-nothing.

use slicelimit_sim as support;

use std::time::Duration;

use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use slicelimit::http::RateLimitLayer;
use slicelimit::{clock::FakeClock, nonzero, Limiter, MemoryStore, Quota};
use tower::ServiceExt;

use support::http::{sf_items, Item, ORIGIN};

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
