//! The in-flight layer on real axum servers: four servers, each with its
//! own concurrency limiter on one private Redis, behind a round-robin
//! client; handlers counted where they run. What an outage answers is
//! tested on an embedded store behind a fault-injecting wrapper.

use slicelimit_sim as support;

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use slicelimit::{ConcurrencyLimiter, MemoryStore};
use slicelimit_tower::{InFlightLayer, KeyExtractor};
use support::RedisServer;

const MAX: u32 = 20;

#[derive(Default)]
struct Running {
    now: AtomicU64,
    most: AtomicU64,
}

async fn server(redis: &RedisServer, running: Arc<Running>, wait: Duration) -> SocketAddr {
    let limiter = ConcurrencyLimiter::builder(NonZeroU32::new(MAX).unwrap())
        .store(support::store(redis).await)
        .namespace("http-inflight")
        .hybrid()
        .build()
        .expect("builds");
    let layer = InFlightLayer::new(limiter, KeyExtractor::header("x-api-key")).wait_up_to(wait);
    let router = Router::new()
        .route(
            "/work",
            get(move || {
                let running = running.clone();
                async move {
                    let now = running.now.fetch_add(1, Ordering::SeqCst) + 1;
                    running.most.fetch_max(now, Ordering::SeqCst);
                    let jitter = Instant::now().elapsed().subsec_nanos() as u64 % 46;
                    tokio::time::sleep(Duration::from_millis(5 + jitter)).await;
                    running.now.fetch_sub(1, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Sends requests from `clients` tasks, each to the next server in turn,
/// for `span`; returns (passed, refused, refusals with `Retry-After`).
async fn drive(servers: &[SocketAddr], clients: usize, span: Duration) -> (u64, u64, u64) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let next = Arc::new(AtomicU64::new(0));
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let until = Instant::now() + span;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (client, next, counts) = (client.clone(), next.clone(), counts.clone());
            let servers = servers.to_vec();
            tokio::spawn(async move {
                while Instant::now() < until {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize % servers.len();
                    let request = http::Request::get(format!("http://{}/work", servers[i]))
                        .header("x-api-key", "tenant-7")
                        .body(Empty::new())
                        .unwrap();
                    let response = client.request(request).await.expect("an answer");
                    let status = response.status();
                    let retry = response.headers().contains_key(http::header::RETRY_AFTER);
                    let _ = response.into_body().collect().await;
                    match status {
                        StatusCode::OK => counts[0].fetch_add(1, Ordering::Relaxed),
                        StatusCode::TOO_MANY_REQUESTS => {
                            if retry {
                                counts[2].fetch_add(1, Ordering::Relaxed);
                            }
                            counts[1].fetch_add(1, Ordering::Relaxed)
                        }
                        other => panic!("unexpected {other}"),
                    };
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    (
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
        counts[2].load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_servers_behind_round_robin_run_at_most_20_handlers_at_once() {
    let redis = RedisServer::start();
    let running = Arc::new(Running::default());
    let mut servers = Vec::new();
    for _ in 0..4 {
        servers.push(server(&redis, running.clone(), Duration::ZERO).await);
    }
    let (passed, refused, with_retry) = drive(&servers, 80, Duration::from_secs(5)).await;
    let most = running.most.load(Ordering::SeqCst);
    eprintln!("{passed} passed, {refused} answered 429, at most {most} handlers at once");
    assert!(most <= u64::from(MAX), "{most} handlers at once");
    assert!(passed > 1_000 && refused > 0, "{passed} / {refused}");
    assert_eq!(with_retry, refused, "every 429 carries Retry-After");
    assert_eq!(redis.immortal_keys(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_slot_turns_refusals_into_waits() {
    let redis = RedisServer::start();
    let running = Arc::new(Running::default());
    let mut servers = Vec::new();
    for _ in 0..2 {
        servers.push(server(&redis, running.clone(), Duration::from_secs(2)).await);
    }
    // 30 clients for 20 slots, each request some 30 ms: a wait of 2 s
    // always ends in a slot.
    let (passed, refused, _) = drive(&servers, 30, Duration::from_secs(3)).await;
    let most = running.most.load(Ordering::SeqCst);
    eprintln!("{passed} passed, {refused} answered 429, at most {most} handlers at once");
    assert!(most <= u64::from(MAX), "{most} handlers at once");
    assert_eq!(refused, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_is_held_until_the_response_body_is_sent() {
    let limiter = ConcurrencyLimiter::builder(NonZeroU32::new(1).unwrap())
        .store(MemoryStore::new())
        .build()
        .expect("builds");
    let layer = InFlightLayer::new(limiter.clone(), KeyExtractor::header("x-api-key"));
    // The handler returns at once; its body takes 600 ms to stream.
    let router = Router::new()
        .route(
            "/slow",
            get(|| async {
                let chunks = futures_util::stream::unfold(0u8, |n| async move {
                    if n == 3 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Some((Ok::<_, std::io::Error>(Bytes::from_static(b"chunk")), n + 1))
                });
                axum::body::Body::from_stream(chunks)
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let get = || {
        let request = http::Request::get(format!("http://{addr}/slow"))
            .header("x-api-key", "k")
            .body(Empty::new())
            .unwrap();
        client.request(request)
    };
    let first = get().await.expect("an answer");
    assert_eq!(first.status(), StatusCode::OK);
    // Its headers are in, its body is not: the slot is still taken.
    let second = get().await.expect("an answer");
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limiter.in_flight("k"), 1);
    let body = first
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    assert_eq!(body.len(), 15);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(limiter.in_flight("k"), 0);
    assert_eq!(get().await.expect("an answer").status(), StatusCode::OK);
}

/// The in-flight layer inside the rate limit layer, both on one Redis: a
/// request refused for its rate never takes a slot, and one refused for a
/// slot is answered as such (each 429 says which limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_and_in_flight_limits_stack() {
    use slicelimit::{nonzero, Limiter, Quota};
    use slicelimit_tower::{RateLimitLayer, PROBLEM_TYPE, PROBLEM_TYPE_IN_FLIGHT};
    let redis = RedisServer::start();
    let rate = Limiter::builder(Quota::per_minute(nonzero!(6)))
        .store(support::store(&redis).await)
        .namespace("stack-rate")
        .exact()
        .build()
        .expect("builds");
    let slots = ConcurrencyLimiter::builder(NonZeroU32::new(2).unwrap())
        .store(support::store(&redis).await)
        .namespace("stack-slots")
        .build()
        .expect("builds");
    let router = Router::new()
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        )
        .layer(InFlightLayer::new(
            slots.clone(),
            KeyExtractor::header("x-api-key"),
        ))
        .layer(RateLimitLayer::new(rate).key(KeyExtractor::header("x-api-key")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let get = || {
        let request = http::Request::get(format!("http://{addr}/slow"))
            .header("x-api-key", "k")
            .body(Empty::new())
            .unwrap();
        let client = client.clone();
        async move {
            let response = client.request(request).await.expect("an answer");
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    // Four at once: two run, two find no slot (the rate allows all four).
    let first: Vec<_> = futures_util::future::join_all((0..4).map(|_| get())).await;
    let ok = first.iter().filter(|(s, _)| *s == StatusCode::OK).count();
    let busy: Vec<_> = first.iter().filter(|(s, _)| *s != StatusCode::OK).collect();
    assert_eq!(ok, 2, "{first:?}");
    // Each 429 names its own problem type: a client can tell "busy, come
    // back when one ends" from "your quota is spent".
    let in_flight_type = format!("\"type\":\"{PROBLEM_TYPE_IN_FLIGHT}\"");
    assert!(busy.iter().all(|(s, b)| *s == StatusCode::TOO_MANY_REQUESTS
        && b.contains("in flight")
        && b.contains(&in_flight_type)
        && !b.contains(PROBLEM_TYPE)));
    // The rate is spent after six (the refused two counted for it too):
    // the rest are refused for their rate and take no slot.
    let _ = futures_util::future::join_all((0..2).map(|_| get())).await;
    let (status, body) = get().await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(body.contains("quota"), "{body}");
    assert!(
        body.contains(&format!("\"type\":\"{PROBLEM_TYPE}\"")),
        "{body}"
    );
    assert_eq!(slots.in_flight("k"), 0);
}

/// Redis down under fail-closed: the in-flight layer answers 503 with the
/// `temporary-reduced-capacity` problem type, never a 429 saying the key
/// is busy (nothing is in flight).
#[tokio::test]
async fn an_outage_under_fail_closed_is_a_503() {
    use slicelimit::{clock::FakeClock, FailurePolicy};
    use slicelimit_sim::{Faults, FaultyStore};
    use slicelimit_tower::PROBLEM_TYPE_UNAVAILABLE;
    use tower::ServiceExt;
    let clock = FakeClock::new(Duration::from_secs(1_000));
    let down = Faults {
        lost_before: 1.0,
        ..Faults::default()
    };
    let store = FaultyStore::new(
        MemoryStore::with_clock(clock.clone()),
        down,
        1,
        clock.clone(),
    );
    for hybrid in [false, true] {
        let builder = ConcurrencyLimiter::builder(NonZeroU32::new(2).unwrap())
            .store(store.clone())
            .clock(clock.clone())
            .on_store_error(FailurePolicy::FailClosed);
        let limiter = if hybrid {
            builder.hybrid()
        } else {
            builder.exact()
        }
        .build()
        .expect("builds");
        let router = Router::new()
            .route("/work", get(|| async { "done" }))
            .layer(InFlightLayer::new(
                limiter,
                KeyExtractor::header("x-api-key"),
            ));
        for _ in 0..3 {
            let request = http::Request::get("/work")
                .header("x-api-key", "k")
                .body(axum::body::Body::empty())
                .unwrap();
            let response = router.clone().oneshot(request).await.unwrap();
            let status = response.status();
            assert!(response.headers().contains_key(http::header::RETRY_AFTER));
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let body = String::from_utf8_lossy(&body);
            assert_eq!(
                status,
                StatusCode::SERVICE_UNAVAILABLE,
                "hybrid {hybrid}: {body}"
            );
            assert!(
                body.contains(&format!("\"type\":\"{PROBLEM_TYPE_UNAVAILABLE}\"")),
                "{body}"
            );
        }
    }
}
