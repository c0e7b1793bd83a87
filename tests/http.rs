//! The tower layer served by axum on an ephemeral port, exercised with a
//! real HTTP client: statuses, `Retry-After`, and the IETF `RateLimit`
//! headers parsed as Structured Fields.

use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sfv::{BareItem, ListEntry, Parser};
use slicelimit::http::{KeyExtractor, MissingKey, RateLimitLayer};
use slicelimit::{FakeClock, HybridConfig, Limiter, MemoryStore, Quota};

/// A whole minute, so per-minute windows start here.
const ORIGIN: Duration = Duration::from_secs(1_700_000_040);

async fn serve(layer: RateLimitLayer) -> SocketAddr {
    let app = Router::new()
        .route("/coupons/redeem", get(|| async { "redeemed" }))
        .route("/admin/report", get(|| async { "report" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut request = http::Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = client
        .request(request.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

async fn get_key(addr: SocketAddr, key: &str) -> Reply {
    get_with(addr, "/coupons/redeem", &[("x-api-key", key)]).await
}

/// An exact limiter on the embedded store, its clock 300 ms before the end
/// of a minute window.
fn limiter_near_window_end(limit: u32) -> Limiter {
    let clock = FakeClock::new(ORIGIN + Duration::from_millis(59_700));
    Limiter::builder(Quota::per_minute(limit))
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock)
        .name("coupons")
        .build()
        .unwrap()
}

/// Parses a one-item Structured-Field list: (name, params).
fn parse(headers: &HeaderMap, name: &str) -> (String, Vec<(String, i64)>) {
    let raw = headers
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"));
    let list = Parser::parse_list(raw.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(list.len(), 1);
    let ListEntry::Item(item) = &list[0] else {
        panic!("{name}: an inner list")
    };
    let BareItem::String(policy) = &item.bare_item else {
        panic!(
            "{name}: the item must be an sf-string, got {:?}",
            item.bare_item
        )
    };
    let params = item
        .params
        .iter()
        .map(|(k, v)| match v {
            BareItem::Integer(n) => (k.clone(), *n),
            other => panic!("{name}: {k} is not an integer: {other:?}"),
        })
        .collect();
    (policy.clone(), params)
}

fn param(params: &[(String, i64)], key: &str) -> i64 {
    params
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key}"))
        .1
}

#[tokio::test]
async fn admitted_then_429_with_retry_after_rounded_up_and_ratelimit_fields() {
    let layer = RateLimitLayer::new(limiter_near_window_end(3)).policy_name("coupons");
    let addr = serve(layer).await;
    for remaining in [2, 1, 0] {
        let reply = get_key(addr, "alice").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.body, "redeemed");
        let (policy, params) = parse(&reply.headers, "ratelimit");
        assert_eq!(policy, "coupons");
        assert_eq!(param(&params, "r"), remaining);
        assert_eq!(param(&params, "t"), 1, "300 ms to the reset: 1 s");
        assert!(reply.headers.get("retry-after").is_none());
    }
    let reply = get_key(addr, "alice").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        reply.headers["retry-after"], "1",
        "a 300 ms wait rounds up to 1"
    );
    assert_eq!(reply.headers["content-type"], "application/problem+json");
    let (policy, params) = parse(&reply.headers, "ratelimit-policy");
    assert_eq!(policy, "coupons");
    assert_eq!((param(&params, "q"), param(&params, "w")), (3, 60));
    let (_, params) = parse(&reply.headers, "ratelimit");
    assert_eq!(param(&params, "r"), 0);
    assert!(reply.body.contains("#quota-exceeded"), "{}", reply.body);
    assert!(
        reply.body.contains("\"violated-policies\":[\"coupons\"]"),
        "{}",
        reply.body
    );
    // Another key has its own budget.
    assert_eq!(get_key(addr, "bob").await.status, StatusCode::OK);
}

#[tokio::test]
async fn retry_after_is_whole_seconds_and_at_least_one() {
    let clock = FakeClock::new(ORIGIN + Duration::from_millis(1_000));
    let limiter = Limiter::builder(Quota::per_minute(1))
        .store(MemoryStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let addr = serve(RateLimitLayer::new(limiter)).await;
    assert_eq!(get_key(addr, "k").await.status, StatusCode::OK);
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.headers["retry-after"], "59");
}

#[tokio::test]
async fn shadow_mode_passes_everything_and_still_records_denials() {
    let limiter = limiter_near_window_end(2);
    let layer = RateLimitLayer::new(limiter.clone()).shadow(true);
    let addr = serve(layer).await;
    for _ in 0..6 {
        let reply = get_key(addr, "k").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(
            reply.headers.get("ratelimit").is_none(),
            "shadow mode changes nothing"
        );
    }
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.denied), (2, 4));
}

#[tokio::test]
async fn a_request_without_a_key_gets_the_configured_answer() {
    let reject = RateLimitLayer::new(limiter_near_window_end(5))
        .on_missing_key(MissingKey::Reject(StatusCode::BAD_REQUEST));
    let addr = serve(reject).await;
    let reply = get_with(addr, "/coupons/redeem", &[]).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.body.contains("no rate-limit key"));
    let reply = get_with(addr, "/coupons/redeem", &[("x-api-key", "   ")]).await;
    assert_eq!(
        reply.status,
        StatusCode::BAD_REQUEST,
        "a blank key is no key"
    );

    let shared = RateLimitLayer::new(limiter_near_window_end(2))
        .on_missing_key(MissingKey::Shared("anonymous".into()));
    let addr = serve(shared).await;
    let statuses: Vec<StatusCode> = futures_statuses(addr, 3).await;
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(
        get_key(addr, "alice").await.status,
        StatusCode::OK,
        "keyed clients are separate"
    );
}

async fn futures_statuses(addr: SocketAddr, n: usize) -> Vec<StatusCode> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(get_with(addr, "/coupons/redeem", &[]).await.status);
    }
    out
}

#[tokio::test]
async fn legacy_headers_routes_costs_and_other_extractors() {
    let admin = limiter_near_window_end(1);
    let layer = RateLimitLayer::new(limiter_near_window_end(10))
        .legacy_headers(true)
        .route("/admin", "admin", admin)
        .key(KeyExtractor::forwarded_for(1))
        .cost(|r| {
            r.headers
                .get("x-cost")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        });
    let addr = serve(layer).await;
    let client = [("x-forwarded-for", "203.0.113.9, 198.51.100.1")];
    let reply = get_with(addr, "/coupons/redeem", &client).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["x-ratelimit-limit"], "10");
    assert_eq!(reply.headers["x-ratelimit-remaining"], "9");
    assert_eq!(reply.headers["x-ratelimit-reset"], "1");
    // A costly request takes several permits at once.
    let reply = get_with(addr, "/coupons/redeem", &[client[0], ("x-cost", "9")]).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["x-ratelimit-remaining"], "0");
    // The admin route has its own policy and budget.
    let reply = get_with(addr, "/admin/report", &client).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(parse(&reply.headers, "ratelimit-policy").0, "admin");
    assert_eq!(
        get_with(addr, "/admin/report", &client).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A cost above the limit can never pass: 429 without Retry-After.
    let reply = get_with(
        addr,
        "/coupons/redeem",
        &[("x-forwarded-for", "192.0.2.7"), ("x-cost", "11")],
    )
    .await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(reply.headers.get("retry-after").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_limiter_behind_the_layer() {
    let limiter = Limiter::builder(Quota::per_hour(5))
        .store(MemoryStore::new())
        .hybrid(HybridConfig::strict())
        .build()
        .unwrap();
    let addr = serve(RateLimitLayer::new(limiter)).await;
    let mut ok = 0;
    let mut limited = 0;
    for _ in 0..8 {
        match get_key(addr, "hybrid").await.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            other => panic!("{other}"),
        }
    }
    assert_eq!((ok, limited), (5, 3));
}
