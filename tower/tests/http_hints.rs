//! What a 429 tells the client is true, through real axum servers on a
//! private Redis in real time: a key of 20 per minute is spent in a
//! burst; every 429's `Retry-After` (and `RateLimit`'s `t`) is within 1 s
//! of what remains of the window (read from Redis' clock) and of what the
//! exact limiter says in the same state, and a client that sleeps for it
//! is admitted on its next try. The same with two quotas (`and`) and after
//! `set_quota`. The three cases run at once: each waits out up to a
//! minute.

use slicelimit_sim as support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use slicelimit::{nonzero, HybridConfig, Limiter, Quota};
use slicelimit_tower::{KeyExtractor, RateLimitLayer};
use support::http::sf_items;
use support::RedisServer;

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

async fn serve(limiter: Limiter) -> SocketAddr {
    let layer = RateLimitLayer::new(limiter).key(KeyExtractor::header("x-api-key"));
    let router = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// A response's status, `Retry-After` and the longest `t` of its
/// `RateLimit` items (seconds).
struct Answer {
    status: StatusCode,
    retry_after: Option<u64>,
    t: Option<i64>,
}

async fn get_key(client: &HttpClient, addr: SocketAddr, key: &str) -> Answer {
    let request = http::Request::get(format!("http://{addr}/"))
        .header("x-api-key", key)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = client.request(request).await.expect("the server answers");
    let headers = response.headers();
    let retry_after = headers
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let items = sf_items(
        "RateLimit",
        headers
            .get_all("ratelimit")
            .iter()
            .map(|v| v.to_str().unwrap()),
    );
    // One item per quota, each with its own reset: the binding quota's
    // is the longest.
    let t = items
        .iter()
        .filter_map(|item| {
            item.1
                .iter()
                .find(|(name, _)| name == "t")
                .map(|(_, value)| *value)
        })
        .max();
    Answer {
        status: response.status(),
        retry_after,
        t,
    }
}

/// Seconds (fractional) left in Redis' current window of `period`.
fn window_left(redis: &RedisServer, period: Duration) -> f64 {
    let (secs, micros): (u64, u64) = redis.cmd(&["TIME"]);
    let now = secs as f64 + micros as f64 / 1e6;
    let period = period.as_secs_f64();
    period - now % period
}

/// Sends `burst` requests for `key` to `addr`; returns the 429s' hints
/// with the window's remaining time read right after each.
async fn burst(
    client: &HttpClient,
    redis: &RedisServer,
    addr: SocketAddr,
    key: &str,
    burst: usize,
    binding: Duration,
) -> (usize, Vec<(u64, i64, f64)>) {
    let mut admitted = 0;
    let mut hints = Vec::new();
    for _ in 0..burst {
        let a = get_key(client, addr, key).await;
        if a.status == StatusCode::OK {
            admitted += 1;
            continue;
        }
        assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
        let retry = a.retry_after.expect("a 429 says when to retry");
        let t = a.t.expect("a 429's RateLimit has t");
        hints.push((retry, t, window_left(redis, binding)));
    }
    (admitted, hints)
}

/// One case: a hybrid and an exact server, each with `limiter` of its own
/// mode; `key` spent on both in a burst; the hints checked; then the
/// hybrid client sleeps for its last hint and tries again.
async fn case(
    redis: &RedisServer,
    what: &str,
    build: impl Fn(bool) -> Limiter,
    limit: usize,
    binding: Duration,
) {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let hybrid = serve(build(true)).await;
    let exact = serve(build(false)).await;
    // A window with at least 5 s left, so both bursts fall in one.
    while window_left(redis, binding) < 5.0 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (h_admitted, h_hints) = burst(&client, redis, hybrid, "h", 3 * limit, binding).await;
    let (e_admitted, e_hints) = burst(&client, redis, exact, "e", 3 * limit, binding).await;
    assert_eq!((h_admitted, e_admitted), (limit, limit), "{what}: admitted");
    assert_eq!(h_hints.len(), 2 * limit);
    for (i, &(retry, t, left)) in h_hints.iter().enumerate() {
        // Retry-After is the ceiling of the wait: within 1 s above the
        // window's remaining time, never below it. (Both ways 50 ms of
        // slack: the wait carries the limiter's clock margin, 3 ms, and
        // `left` is read after the answer; a window 44.002 s from its end
        // is rightly told 45.)
        assert!(
            retry as f64 >= left - 0.05 && retry as f64 <= left + 1.05,
            "{what}: 429 #{i} said Retry-After {retry} with {left:.3} s of the window left"
        );
        assert_eq!(
            t as u64, retry,
            "{what}: 429 #{i}: RateLimit t {t}, Retry-After {retry}"
        );
    }
    let (e_retry, _, _) = e_hints[0];
    let (h_retry, _, _) = h_hints[0];
    assert!(
        h_retry.abs_diff(e_retry) <= 1,
        "{what}: hybrid said {h_retry} s, exact {e_retry} s"
    );
    // The client obeys the last hint: admitted on the next try.
    let &(retry, _, _) = h_hints.last().unwrap();
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let again = get_key(&client, hybrid, "h").await;
    assert_eq!(
        again.status,
        StatusCode::OK,
        "{what}: slept the {retry} s it was told and was denied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_tells_the_wait_that_admits() {
    let redis = RedisServer::start();
    let store = support::store(&redis).await;
    let minute = Duration::from_secs(60);
    let limiter = |ns: &'static str, quotas: Vec<Quota>, set: Option<Quota>| {
        let store = store.clone();
        move |hybrid: bool| {
            let mut builder = Limiter::builder(quotas[0]);
            for q in &quotas[1..] {
                builder = builder.and(*q);
            }
            let builder = builder
                .store(store.clone())
                .namespace(&format!("{ns}-{hybrid}"));
            let builder = if hybrid {
                builder.hybrid(HybridConfig::strict())
            } else {
                builder.exact()
            };
            let limiter = builder.build().unwrap();
            if let Some(q) = set {
                limiter.set_quota(q).unwrap();
            }
            limiter
        }
    };
    let started = Instant::now();
    tokio::join!(
        case(
            &redis,
            "20/min",
            limiter("one", vec![Quota::per_minute(nonzero!(20))], None),
            20,
            minute
        ),
        case(
            &redis,
            "100/s and 20/min",
            limiter(
                "two",
                vec![
                    Quota::per_second(nonzero!(100)),
                    Quota::per_minute(nonzero!(20))
                ],
                None
            ),
            20,
            minute
        ),
        case(
            &redis,
            "100/min set to 20/min",
            limiter(
                "set",
                vec![Quota::per_minute(nonzero!(100))],
                Some(Quota::per_minute(nonzero!(20)))
            ),
            20,
            minute
        ),
    );
    eprintln!("three cases in {:?}", started.elapsed());
}
