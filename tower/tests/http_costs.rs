//! Costs known only after the work, through a real axum server: each
//! request reserves its `max-tokens` header's estimate, its streamed
//! response is charged per frame (one token per byte) and settled when
//! the body ends or is dropped; a response that states its cost settles
//! to it.

use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use slicelimit::{nonzero, HybridConfig, Limiter, MemoryStore, Quota};
use slicelimit_tower::{ActualCost, CostLayer, KeyExtractor, RequestView};

/// The estimate: the request's `max-tokens` header, else 10.
fn max_tokens(request: &RequestView<'_>) -> u64 {
    request
        .headers
        .get("max-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

/// `/stream?frames=N&ms=M`: N frames of 10 bytes, M ms apart. `/priced`:
/// a short answer that says it cost 70.
fn app(layer: CostLayer) -> Router {
    Router::new()
        .route(
            "/stream",
            get(
                |query: axum::extract::Query<std::collections::HashMap<String, u64>>| async move {
                    let frames = query.get("frames").copied().unwrap_or(10);
                    let ms = query.get("ms").copied().unwrap_or(0);
                    let chunks = futures_util::stream::unfold(0u64, move |n| async move {
                        if n == frames {
                            return None;
                        }
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        Some((
                            Ok::<_, std::io::Error>(Bytes::from_static(b"token-x10\n")),
                            n + 1,
                        ))
                    });
                    axum::body::Body::from_stream(chunks)
                },
            ),
        )
        .route(
            "/priced",
            get(|| async {
                let mut response = axum::response::IntoResponse::into_response("priced");
                response.extensions_mut().insert(ActualCost(70));
                response
            }),
        )
        .layer(layer)
}

async fn serve(layer: CostLayer) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(layer)).await.unwrap() });
    addr
}

fn limiters() -> Vec<(&'static str, Limiter)> {
    let quota = Quota::per_hour(nonzero!(300));
    vec![
        (
            "exact",
            Limiter::builder(quota)
                .store(MemoryStore::new())
                .namespace("tokens")
                .build()
                .unwrap(),
        ),
        (
            "hybrid-strict",
            Limiter::builder(quota)
                .store(MemoryStore::new())
                .namespace("tokens")
                .hybrid(HybridConfig::strict())
                .build()
                .unwrap(),
        ),
    ]
}

fn layer(limiter: &Limiter) -> CostLayer {
    CostLayer::new(
        limiter.clone(),
        KeyExtractor::header("x-tenant"),
        max_tokens,
    )
    .per_frame(|frame| frame.len() as u64)
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

async fn get_(
    client: &Http,
    addr: SocketAddr,
    path: &str,
    tenant: &str,
    estimate: u64,
) -> http::Response<hyper::body::Incoming> {
    let request = http::Request::get(format!("http://{addr}{path}"))
        .header("x-tenant", tenant)
        .header("max-tokens", estimate.to_string())
        .body(Empty::new())
        .unwrap();
    client.request(request).await.expect("an answer")
}

/// Waits until `key` has `left` of its budget (the settlement runs in a
/// task of its own), or fails after 10 s telling what it has.
async fn left_becomes(limiter: &Limiter, key: &str, left: impl Fn(u64) -> bool, what: &str) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now_left = limiter.check(key, 0).await.remaining();
        if left(now_left) {
            return now_left;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {now_left} left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Streams of 100 tokens under estimates of 30: each is charged what it
/// sent, so the fourth request finds the 300-token budget gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_responses_charged_per_frame_use_the_budget_up() {
    for (mode, limiter) in limiters() {
        let addr = serve(layer(&limiter)).await;
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        for i in 0..3 {
            let response = get_(&client, addr, "/stream?frames=10", "acme", 30).await;
            assert_eq!(response.status(), StatusCode::OK, "{mode} {i}");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body.len(), 100, "{mode} {i}");
            // Settled before the next asks (in a task of its own).
            left_becomes(&limiter, "acme", |l| l <= 300 - 100 * (i + 1), mode).await;
        }
        let denied = get_(&client, addr, "/stream?frames=10", "acme", 30).await;
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS, "{mode}");
        assert!(denied.headers().contains_key("retry-after"), "{mode}");
        // Another tenant is untouched.
        let other = get_(&client, addr, "/stream?frames=1", "other", 30).await;
        assert_eq!(other.status(), StatusCode::OK, "{mode}");
        limiter.shutdown().await;
    }
}

/// A client that goes away mid-stream is charged for what was sent: more
/// than its estimate, far less than the whole stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_is_charged_for_what_was_sent() {
    for (mode, limiter) in limiters() {
        let addr = serve(layer(&limiter)).await;
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        // 1,000 tokens would take 2 s; the client reads 5 frames and leaves.
        let response = get_(&client, addr, "/stream?frames=100&ms=20", "gone", 10).await;
        assert_eq!(response.status(), StatusCode::OK, "{mode}");
        let mut body = response.into_body();
        let mut read = 0;
        while read < 50 {
            let frame = body.frame().await.expect("a frame").expect("no error");
            read += frame.data_ref().map_or(0, |d| d.len() as u64);
        }
        drop(body);
        drop(client);
        // The server notices at its next write; then the body is dropped
        // and the reservation settles to what was sent.
        let left = left_becomes(&limiter, "gone", |l| l < 300 - 10, mode).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let charged = 300 - limiter.check("gone", 0).await.remaining();
        println!("{mode}: the client read {read} tokens of 1,000 and left; charged {charged}");
        assert!(
            (read..=read + 200).contains(&charged),
            "{mode}: read {read}, charged {charged} ({left} left at first)"
        );
        limiter.shutdown().await;
    }
}

/// A response that states its cost settles to it: the estimate's excess
/// goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_states_its_cost_settles_to_it() {
    for (mode, limiter) in limiters() {
        let addr = serve(layer(&limiter)).await;
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let response = get_(&client, addr, "/priced", "priced", 200).await;
        assert_eq!(response.status(), StatusCode::OK, "{mode}");
        assert!(response.headers().contains_key("ratelimit"), "{mode}");
        response.into_body().collect().await.unwrap();
        left_becomes(&limiter, "priced", |l| l == 230, mode).await;
        limiter.shutdown().await;
    }
}

/// A metered response's base cost (its prompt's tokens) is charged with
/// its frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_base_cost_is_charged_with_the_frames() {
    for (mode, limiter) in limiters() {
        let layer = layer(&limiter).base_cost(|request| {
            request
                .headers
                .get("prompt-tokens")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        });
        let addr = serve(layer).await;
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let request = http::Request::get(format!("http://{addr}/stream?frames=3"))
            .header("x-tenant", "based")
            .header("max-tokens", "100")
            .header("prompt-tokens", "40")
            .body(Empty::new())
            .unwrap();
        let response = client.request(request).await.unwrap();
        response.into_body().collect().await.unwrap();
        left_becomes(&limiter, "based", |l| l == 300 - 40 - 30, mode).await;
        limiter.shutdown().await;
    }
}

/// A body never sent (a HEAD answer) settles at its estimate: HEAD is
/// not free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_never_sent_is_charged_its_estimate() {
    for (mode, limiter) in limiters() {
        let addr = serve(layer(&limiter)).await;
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        for _ in 0..3 {
            let request = http::Request::head(format!("http://{addr}/stream?frames=10"))
                .header("x-tenant", "head")
                .header("max-tokens", "50")
                .body(Empty::new())
                .unwrap();
            let response = client.request(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{mode}");
        }
        left_becomes(&limiter, "head", |l| l == 300 - 150, mode).await;
        limiter.shutdown().await;
    }
}

/// `stop_when_exhausted` ends a body whose frames are all ready at once
/// where the budget ends, not thousands of frames later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_ready_at_once_stops_where_the_budget_ends() {
    for (mode, limiter) in limiters() {
        let layer = layer(&limiter).stop_when_exhausted(true);
        let app = Router::new()
            .route(
                "/fast",
                get(|| async {
                    axum::body::Body::from_stream(futures_util::stream::iter(
                        (0..20_000)
                            .map(|_| Ok::<_, std::io::Error>(Bytes::from_static(b"token-x10\n"))),
                    ))
                }),
            )
            .layer(layer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let response = get_(&client, addr, "/fast", "fast", 10).await;
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(
            body.len() <= 300,
            "{mode}: {} bytes sent of a 300 budget",
            body.len()
        );
        limiter.shutdown().await;
    }
}
