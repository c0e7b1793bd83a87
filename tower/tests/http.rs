//! The tower layer served by axum (with `ConnectInfo`) on ephemeral ports,
//! exercised with real hyper clients bound to chosen loopback addresses:
//! statuses, keys a client cannot forge, and the IETF `RateLimit` headers
//! of every kind of answer parsed as Structured Fields by `sfv`.

use slicelimit_sim as support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use slicelimit::{
    clock::FakeClock, nonzero, Algorithm, FailurePolicy, HybridConfig, Limiter, MemoryStore, Quota,
};
use slicelimit_tower::{
    Cidr, ClientIp, KeyExtractor, MissingKey, PolicyHeaders, ProxyHeader, RateLimitLayer,
    RejectionKind,
};
use tower::{Layer, Service, ServiceExt};

use support::http::{per_minute, sf_items, unavailable, Item, ORIGIN};

/// 300 ms before the end of a minute window.
const NEAR_END: Duration = Duration::from_millis(59_700);

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/coupons/redeem",
            get(|| async { "redeemed" }).post(|| async { "posted" }),
        )
        .route("/admin/report", get(|| async { "report" }))
        .route("/administrator", get(|| async { "administrator" }))
        .route("/login", get(|| async { "login" }))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/upstream",
            get(|| async {
                // A handler that reports a limit of its own.
                ([("ratelimit", "\"upstream\";r=5;t=10")], "upstream")
            }),
        )
        .layer(layer)
}

/// Serves `router` on `bind` with the peer address in `ConnectInfo`.
async fn serve_router(bind: &str, router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap()
    });
    addr
}

async fn serve(layer: RateLimitLayer) -> SocketAddr {
    serve_router("127.0.0.1:0", app(layer)).await
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

/// One request from the loopback address `from` (any if `None`).
async fn send(
    addr: SocketAddr,
    from: Option<&str>,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let mut connector = HttpConnector::new();
    connector.set_local_address(from.map(|ip| ip.parse::<IpAddr>().unwrap()));
    let client = Client::builder(TokioExecutor::new()).build::<_, Empty<Bytes>>(connector);
    let host = if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    };
    let mut request = http::Request::builder()
        .method(method)
        .uri(format!("http://{host}{path}"));
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

async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    send(addr, None, Method::GET, path, headers).await
}

async fn get_key(addr: SocketAddr, key: &str) -> Reply {
    get_with(addr, "/coupons/redeem", &[("x-api-key", key)]).await
}

async fn get_from(addr: SocketAddr, from: &str, headers: &[(&str, &str)]) -> Reply {
    send(addr, Some(from), Method::GET, "/coupons/redeem", headers).await
}

/// An exact limiter on the embedded store, its clock 300 ms before the end
/// of a minute window.
fn limiter_near_window_end(limit: u32) -> Limiter {
    per_minute(limit, NEAR_END, None)
}

/// Every line of a Structured-Field list header, parsed as one list.
fn items(headers: &HeaderMap, name: &str) -> Vec<Item> {
    sf_items(
        name,
        headers.get_all(name).iter().map(|v| v.to_str().unwrap()),
    )
}

/// The one item of a list header.
fn parse(headers: &HeaderMap, name: &str) -> Item {
    let mut all = items(headers, name);
    assert_eq!(all.len(), 1, "{name}: {all:?}");
    all.remove(0)
}

fn param(params: &[(String, i64)], key: &str) -> i64 {
    params
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key}"))
        .1
}

fn names(items: &[Item]) -> Vec<&str> {
    items.iter().map(|(n, _)| n.as_str()).collect()
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
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1)))
        .store(MemoryStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let addr = serve(RateLimitLayer::new(limiter)).await;
    assert_eq!(get_key(addr, "k").await.status, StatusCode::OK);
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.headers["retry-after"], "59");
}

// 1. Routes cannot silently share counters.

#[tokio::test]
async fn routes_with_default_namespaces_never_share_counters() {
    // One store, two limiters built without a namespace.
    let clock = FakeClock::new(ORIGIN + NEAR_END);
    let store = MemoryStore::with_clock(clock.clone());
    let build = |quota| {
        Limiter::builder(quota)
            .store(store.clone())
            .clock(clock.clone())
            .build()
            .unwrap()
    };
    let default = build(Quota::per_minute(nonzero!(100)));
    let login = build(Quota::per_minute(nonzero!(5)));
    assert_ne!(default.namespace(), login.namespace());
    let layer = RateLimitLayer::new(default).route("/login", "login", login);
    let addr = serve(layer).await;
    for _ in 0..5 {
        assert_eq!(get_key(addr, "alice").await.status, StatusCode::OK);
    }
    let reply = get_with(addr, "/login", &[("x-api-key", "alice")]).await;
    assert_eq!(reply.status, StatusCode::OK, "/login has its own counter");
    assert_eq!(param(&parse(&reply.headers, "ratelimit").1, "r"), 4);
    let reply = get_key(addr, "alice").await;
    assert_eq!(param(&parse(&reply.headers, "ratelimit").1, "r"), 94);
}

#[tokio::test]
async fn routes_on_redis_with_different_periods_keep_their_own_windows() {
    let server = support::RedisServer::start();
    let store = support::store(&server).await;
    let build = |quota| {
        Limiter::builder(quota)
            .store(store.clone())
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap()
    };
    let layer = RateLimitLayer::new(build(Quota::per_hour(nonzero!(100)))).route(
        "/login",
        "login",
        build(Quota::per_minute(nonzero!(3))),
    );
    let addr = serve(layer).await;
    let mut login = Vec::new();
    for _ in 0..4 {
        // Interleaved: each route's script must leave the other's window.
        assert_eq!(get_key(addr, "alice").await.status, StatusCode::OK);
        login.push(
            get_with(addr, "/login", &[("x-api-key", "alice")])
                .await
                .status,
        );
    }
    assert_eq!(
        login,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let reply = get_key(addr, "alice").await;
    assert_eq!(param(&parse(&reply.headers, "ratelimit").1, "r"), 95);
}

#[test]
#[should_panic(expected = "share the namespace")]
fn a_layer_refuses_two_limiters_that_would_count_in_the_same_keys() {
    let a = Limiter::builder(Quota::per_minute(nonzero!(100)))
        .namespace("api")
        .local()
        .build()
        .unwrap();
    let b = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .namespace("api")
        .local()
        .build()
        .unwrap();
    let _ = RateLimitLayer::new(a).route("/login", "login", b);
}

#[test]
fn clones_of_one_limiter_may_share_a_budget_on_purpose() {
    let a = Limiter::builder(Quota::per_minute(nonzero!(100)))
        .local()
        .build()
        .unwrap();
    let _ = RateLimitLayer::new(a.clone()).route("/login", "login", a);
}

// 2. Client-chosen IP keys; 3. IPv6 prefixes.

/// A limit of 2 per minute keyed by `ip`: the third request of one key
/// is refused, so statuses tell which requests shared a key.
async fn serve_ip(ip: ClientIp) -> SocketAddr {
    let layer = RateLimitLayer::new(limiter_near_window_end(2)).key(KeyExtractor::ip(ip));
    serve_router("[::]:0", app(layer)).await
}

#[tokio::test]
async fn forged_forwarding_headers_from_an_untrusted_peer_are_ignored() {
    let trusted = Cidr::parse_list("127.0.0.1/32").unwrap();
    let addr = serve_ip(ClientIp::behind(trusted)).await;
    // 127.0.0.2 is no proxy: whatever it writes, it is one client.
    for (i, forged) in ["203.0.113.1", "203.0.113.2", "203.0.113.3"]
        .iter()
        .enumerate()
    {
        let reply = get_from(addr, "127.0.0.2", &[("x-forwarded-for", forged)]).await;
        let expected = if i < 2 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(reply.status, expected, "request {i} from 127.0.0.2");
    }
    // Through the trusted proxy, the rightmost untrusted hop is the
    // client; what the client prepended is ignored.
    for (i, forged) in ["1.1.1.1", "2.2.2.2", "3.3.3.3"].iter().enumerate() {
        let chain = format!("{forged}, 198.51.100.7");
        let reply = get_from(addr, "127.0.0.1", &[("x-forwarded-for", &chain)]).await;
        let expected = if i < 2 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(reply.status, expected, "request {i} as 198.51.100.7");
    }
    // Trusted hops are skipped from the right.
    let reply = get_from(
        addr,
        "127.0.0.1",
        &[("x-forwarded-for", "9.9.9.9, 198.51.100.8, 127.0.0.1")],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    // A trusted proxy that names no address: no key (401), never a
    // client-written one.
    let reply = get_from(
        addr,
        "127.0.0.1",
        &[("x-forwarded-for", "9.9.9.9, unknown")],
    )
    .await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn rfc7239_forwarded_is_read_when_the_proxies_write_it() {
    let trusted = Cidr::parse_list("127.0.0.1").unwrap();
    let addr = serve_ip(ClientIp::behind(trusted).header(ProxyHeader::Forwarded)).await;
    let statuses = async |from: &str, forwarded: &str, xff: &str| {
        get_from(
            addr,
            from,
            &[("forwarded", forwarded), ("x-forwarded-for", xff)],
        )
        .await
        .status
    };
    // The client's own Forwarded entries and any X-Forwarded-For are
    // ignored: the proxy's entry decides.
    assert_eq!(
        statuses(
            "127.0.0.1",
            "for=1.1.1.1, for=\"[2001:db8::9]:443\";proto=https",
            "4.4.4.4"
        )
        .await,
        StatusCode::OK
    );
    assert_eq!(
        statuses(
            "127.0.0.1",
            "for=2.2.2.2;by=x, For=\"[2001:db8::9]\"",
            "5.5.5.5"
        )
        .await,
        StatusCode::OK
    );
    assert_eq!(
        statuses(
            "127.0.0.1",
            "for=3.3.3.3, for=\"[2001:db8::9]:80\"",
            "6.6.6.6"
        )
        .await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // From an untrusted peer the header counts for nothing.
    assert_eq!(
        statuses("127.0.0.3", "for=7.7.7.7", "").await,
        StatusCode::OK
    );
    assert_eq!(
        statuses("127.0.0.3", "for=8.8.8.8", "").await,
        StatusCode::OK
    );
    assert_eq!(
        statuses("127.0.0.3", "for=9.9.9.9", "").await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A proxy may append its hop to the line the client sent. Whatever the
/// client wrote to the left (an unterminated quote) must not change how
/// the proxy's hop is read: the limit stays on the real client.
#[tokio::test]
async fn a_client_written_prefix_cannot_swallow_the_proxys_hop() {
    // Three requests, each with a forged prefix of its own; the third must
    // be over the real client's limit of 2.
    let three = async |addr: SocketAddr, header: &str, value: &dyn Fn(u32) -> String| {
        let mut statuses = Vec::new();
        for i in 1..=3 {
            let v = value(i);
            statuses.push(get_from(addr, "127.0.0.1", &[(header, &v)]).await.status);
        }
        statuses
    };
    let limited = [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ];
    let trusted = Cidr::parse_list("127.0.0.1").unwrap();
    let addr = serve_ip(ClientIp::behind(trusted.clone()).header(ProxyHeader::Forwarded)).await;
    // The client wrote `for=203.0.113.i;x="`; the proxy appended
    // `, for=198.51.100.8` (the client's real address).
    let forged = |i| format!("for=203.0.113.{i};x=\", for=198.51.100.8");
    assert_eq!(
        three(addr, "forwarded", &forged).await,
        limited,
        "each forged prefix must still count against 198.51.100.8"
    );
    // X-Forwarded-For has no quoting: a quote the client wrote spoils
    // nothing to its right.
    let addr = serve_ip(ClientIp::behind(trusted)).await;
    let forged = |i| format!("\"10.9.9.{i}, 198.51.100.9");
    assert_eq!(three(addr, "x-forwarded-for", &forged).await, limited);
}

#[tokio::test]
async fn forwarded_for_zero_ignores_the_header_and_short_chains_key_by_the_peer() {
    let addr = serve_ip(ClientIp::hops(0)).await;
    let mut statuses = Vec::new();
    for forged in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        statuses.push(
            get_from(addr, "127.0.0.4", &[("x-forwarded-for", forged)])
                .await
                .status,
        );
    }
    assert_eq!(statuses[2], StatusCode::TOO_MANY_REQUESTS, "{statuses:?}");

    // Two proxies are said to be in front, yet the header has one entry:
    // it did not come through them, so the peer is the client.
    let layer = RateLimitLayer::new(limiter_near_window_end(2)).key(KeyExtractor::forwarded_for(2));
    let addr = serve(layer).await;
    let mut statuses = Vec::new();
    for forged in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        statuses.push(
            get_from(addr, "127.0.0.5", &[("x-forwarded-for", forged)])
                .await
                .status,
        );
    }
    assert_eq!(statuses[2], StatusCode::TOO_MANY_REQUESTS, "{statuses:?}");
}

#[tokio::test]
async fn ipv6_clients_across_one_64_share_a_key() {
    let trusted = Cidr::parse_list("127.0.0.1/32").unwrap();
    let addr = serve_ip(ClientIp::behind(trusted.clone())).await;
    let client = |ip: &'static str| async move {
        get_from(addr, "127.0.0.1", &[("x-forwarded-for", ip)])
            .await
            .status
    };
    assert_eq!(client("2001:db8:1:2::a").await, StatusCode::OK);
    assert_eq!(client("2001:db8:1:2:ffff::b").await, StatusCode::OK);
    assert_eq!(
        client("2001:db8:1:2:1234:5678:9abc:def0").await,
        StatusCode::TOO_MANY_REQUESTS,
        "one /64, one key"
    );
    assert_eq!(
        client("2001:db8:1:3::a").await,
        StatusCode::OK,
        "the next /64"
    );
    // IPv4-mapped addresses are IPv4: the dual-stack listener sees the
    // proxy as ::ffff:127.0.0.1 and still trusts it (the keys above were
    // forwarded ones), and a mapped client is keyed as its IPv4 address.
    assert_eq!(client("::ffff:192.0.2.1").await, StatusCode::OK);
    assert_eq!(client("192.0.2.1").await, StatusCode::OK);
    assert_eq!(client("192.0.2.1").await, StatusCode::TOO_MANY_REQUESTS);

    // A configurable prefix: /128 keys each address.
    let addr = serve_ip(ClientIp::behind(trusted).ipv6_prefix(128)).await;
    for host in ["2001:db8::1", "2001:db8::2", "2001:db8::3"] {
        let reply = get_from(addr, "127.0.0.1", &[("x-forwarded-for", host)]).await;
        assert_eq!(reply.status, StatusCode::OK, "{host}");
    }
}

// 4. Key bytes.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_sized_keys_are_distinct_budgets_of_bounded_size() {
    let limiter = Limiter::builder(Quota::per_hour(nonzero!(1)))
        .store(MemoryStore::new())
        .hybrid(HybridConfig::strict())
        .build()
        .unwrap();
    let addr = serve(RateLimitLayer::new(limiter.clone())).await;
    let long = "k".repeat(16 << 10);
    let other = format!("{long}x");
    assert_eq!(get_key(addr, &long).await.status, StatusCode::OK);
    assert_eq!(get_key(addr, &other).await.status, StatusCode::OK);
    assert_eq!(
        get_key(addr, &long).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(limiter.local_keys(), 2);
}

// 5. Cost 0.

fn cost_from_header(r: &slicelimit_tower::RequestView<'_>) -> u64 {
    r.headers
        .get("x-cost")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1)
}

#[tokio::test]
async fn a_client_chosen_cost_of_zero_is_not_a_free_pass() {
    let layer = RateLimitLayer::new(limiter_near_window_end(2)).cost(cost_from_header);
    let addr = serve(layer).await;
    let free = [("x-api-key", "k"), ("x-cost", "0")];
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(get_with(addr, "/coupons/redeem", &free).await.status);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );

    // Asked for explicitly, 0 is a peek.
    let layer = RateLimitLayer::new(limiter_near_window_end(2))
        .cost(cost_from_header)
        .allow_zero_cost(true);
    let addr = serve(layer).await;
    for _ in 0..3 {
        let reply = get_with(addr, "/coupons/redeem", &free).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(param(&parse(&reply.headers, "ratelimit").1, "r"), 2);
    }
}

// 6. Shadow mode.

#[tokio::test]
async fn shadow_mode_never_changes_a_response() {
    let limiter = limiter_near_window_end(2);
    let layer = RateLimitLayer::new(limiter.clone()).shadow(true);
    let addr = serve(layer).await;
    for _ in 0..6 {
        let reply = get_key(addr, "k").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(reply.headers.get("ratelimit").is_none());
        assert!(reply.headers.get("ratelimit-policy").is_none());
    }
    let stats = limiter.stats();
    assert_eq!((stats.allowed, stats.denied), (2, 4));
    assert_eq!(
        stats.shadow_denials, 4,
        "each denial let through is counted"
    );
    // Without a key too: the request passes as if there were no layer.
    let reply = get_with(addr, "/coupons/redeem", &[]).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, "redeemed");
    assert!(reply.headers.get("www-authenticate").is_none());
    assert_eq!(limiter.stats().shadow_denials, 5);
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
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(get_with(addr, "/coupons/redeem", &[]).await.status);
    }
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

// 7. client_ip under axum's ConnectInfo (tonic: tests/http_grpc.rs).

#[tokio::test]
async fn client_ip_reads_axum_connect_info() {
    let layer = RateLimitLayer::new(limiter_near_window_end(1)).key(KeyExtractor::client_ip());
    let addr = serve(layer).await;
    assert_eq!(
        get_from(addr, "127.0.0.6", &[]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get_from(addr, "127.0.0.6", &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        get_from(addr, "127.0.0.7", &[]).await.status,
        StatusCode::OK
    );
    // An IPv6 peer, keyed by its /64.
    let layer = RateLimitLayer::new(limiter_near_window_end(1)).key(KeyExtractor::client_ip());
    let addr = serve_router("[::1]:0", app(layer)).await;
    let from_v6 = async || send(addr, Some("::1"), Method::GET, "/coupons/redeem", &[]).await;
    assert_eq!(from_v6().await.status, StatusCode::OK);
    assert_eq!(from_v6().await.status, StatusCode::TOO_MANY_REQUESTS);
}

// 9. Headers that tell the truth.

#[tokio::test]
async fn a_bucket_denial_has_t_and_retry_after_agree() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let clock = FakeClock::new(ORIGIN);
        let limiter = Limiter::builder(Quota::per_minute(nonzero!(2)))
            .store(MemoryStore::with_clock(clock.clone()))
            .clock(clock)
            .algorithm(algorithm)
            .build()
            .unwrap();
        let addr = serve(RateLimitLayer::new(limiter)).await;
        assert_eq!(get_key(addr, "k").await.status, StatusCode::OK);
        assert_eq!(get_key(addr, "k").await.status, StatusCode::OK);
        let reply = get_key(addr, "k").await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "{algorithm:?}");
        let retry: i64 = reply.headers["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let t = param(&parse(&reply.headers, "ratelimit").1, "t");
        assert_eq!(t, retry, "{algorithm:?}: one permit back in 30 s");
        assert_eq!(retry, 30, "{algorithm:?}");
    }
}

#[tokio::test]
async fn fail_closed_answers_503_with_the_reduced_capacity_problem() {
    let layer = RateLimitLayer::new(unavailable(FailurePolicy::FailClosed)).policy_name("api");
    let addr = serve(layer).await;
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.headers["content-type"], "application/problem+json");
    assert!(
        reply.body.contains("#temporary-reduced-capacity"),
        "{}",
        reply.body
    );
    assert!(
        reply.body.contains("\"violated-policies\":[\"api\"]"),
        "{}",
        reply.body
    );
    let retry: i64 = reply.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let (name, params) = parse(&reply.headers, "ratelimit-policy");
    assert_eq!((name.as_str(), param(&params, "q")), ("api", 10));
    let (_, params) = parse(&reply.headers, "ratelimit");
    assert_eq!((param(&params, "r"), param(&params, "t")), (0, retry));
}

#[tokio::test]
async fn fail_open_does_not_advertise_a_made_up_remaining() {
    let layer = RateLimitLayer::new(unavailable(FailurePolicy::FailOpen)).legacy_headers(true);
    let addr = serve(layer).await;
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(parse(&reply.headers, "ratelimit-policy").0, "default");
    assert!(
        items(&reply.headers, "ratelimit").is_empty(),
        "nothing is known"
    );
    assert!(reply.headers.get("x-ratelimit-remaining").is_none());
}

#[tokio::test]
async fn several_policies_make_one_list_and_a_complete_violated_policies() {
    let burst = per_minute(1, NEAR_END, Some("burst"));
    let minute = limiter_near_window_end(2);
    let layer = RateLimitLayer::new(minute.clone())
        .policy_name("minute")
        .also("burst", burst);
    let addr = serve(layer).await;
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        names(&items(&reply.headers, "ratelimit-policy")),
        ["minute", "burst"]
    );
    let remaining: Vec<i64> = items(&reply.headers, "ratelimit")
        .iter()
        .map(|(_, p)| param(p, "r"))
        .collect();
    assert_eq!(remaining, [1, 0]);
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        reply.body.contains("\"violated-policies\":[\"burst\"]"),
        "{}",
        reply.body
    );
    // All-or-nothing: the denial took nothing from "minute" (its permit
    // is refunded in the background).
    for _ in 0..200 {
        if minute.stats().refunded >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(minute.stats().refunded, 1);
    let reply = get_key(addr, "k").await;
    assert!(
        reply.body.contains("\"violated-policies\":[\"burst\"]"),
        "{}",
        reply.body
    );
    assert_eq!(
        names(&items(&reply.headers, "ratelimit")),
        ["minute", "burst"]
    );
}

#[tokio::test]
async fn stacked_layers_append_items_and_keep_the_handlers() {
    let inner = RateLimitLayer::new(limiter_near_window_end(1)).policy_name("inner");
    let outer_limiter = per_minute(10, NEAR_END, Some("outer"));
    let outer = RateLimitLayer::new(outer_limiter).policy_name("outer");
    let addr = serve_router("127.0.0.1:0", app(inner).layer(outer)).await;
    let reply = get_with(addr, "/upstream", &[("x-api-key", "k")]).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        names(&items(&reply.headers, "ratelimit")),
        ["upstream", "inner", "outer"]
    );
    assert_eq!(
        names(&items(&reply.headers, "ratelimit-policy")),
        ["inner", "outer"]
    );
    // The inner layer's 429 keeps its items; the outer one adds its own.
    let reply = get_with(addr, "/upstream", &[("x-api-key", "k")]).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        names(&items(&reply.headers, "ratelimit")),
        ["inner", "outer"]
    );
    assert!(reply.headers.get("retry-after").is_some());
}

// 10. Response control.

#[tokio::test]
async fn a_401_carries_a_www_authenticate_challenge() {
    let addr = serve(RateLimitLayer::new(limiter_near_window_end(1))).await;
    let reply = get_with(addr, "/coupons/redeem", &[]).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        reply.headers["www-authenticate"],
        "ApiKey header=\"x-api-key\""
    );
    let layer = RateLimitLayer::new(limiter_near_window_end(1))
        .challenge(HeaderValue::from_static("Bearer realm=\"api\""));
    let reply = get_with(serve(layer).await, "/coupons/redeem", &[]).await;
    assert_eq!(reply.headers["www-authenticate"], "Bearer realm=\"api\"");
}

#[tokio::test]
async fn a_hook_shapes_denials_and_missing_key_answers() {
    let layer = RateLimitLayer::new(limiter_near_window_end(1)).on_reject(|rejection, response| {
        let (mut parts, _) = response.into_parts();
        let text = match rejection.kind {
            RejectionKind::QuotaExceeded => format!("slow down: {:?}", rejection.violated_policies),
            RejectionKind::MissingKey(_) => "who are you?".to_owned(),
            _ => "other".to_owned(),
        };
        parts
            .headers
            .insert("content-type", HeaderValue::from_static("text/plain"));
        http::Response::from_parts(parts, Bytes::from(text))
    });
    let addr = serve(layer).await;
    assert_eq!(get_key(addr, "k").await.status, StatusCode::OK);
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.body, "slow down: [\"default\"]");
    assert_eq!(reply.headers["content-type"], "text/plain");
    assert_eq!(parse(&reply.headers, "ratelimit").0, "default");
    let reply = get_with(addr, "/coupons/redeem", &[]).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.body, "who are you?");
}

#[tokio::test]
async fn routes_match_whole_path_segments() {
    let admin = limiter_near_window_end(1);
    let layer = RateLimitLayer::new(limiter_near_window_end(10)).route("/admin/", "admin", admin);
    let addr = serve(layer).await;
    let policy = async |path: &str| {
        parse(
            &get_with(addr, path, &[("x-api-key", "k")]).await.headers,
            "ratelimit-policy",
        )
        .0
    };
    assert_eq!(policy("/admin/report").await, "admin");
    assert_eq!(
        policy("/administrator").await,
        "default",
        "not below /admin"
    );
}

#[tokio::test]
async fn methods_filters_and_exemptions() {
    let post = per_minute(1, NEAR_END, Some("post"));
    let layer = RateLimitLayer::new(limiter_near_window_end(10))
        .route_methods(&[Method::POST], "/coupons", "redeem-post", post)
        .exempt(|r| r.uri.path() == "/healthz");
    let addr = serve(layer).await;
    let key = [("x-api-key", "k")];
    let reply = send(addr, None, Method::POST, "/coupons/redeem", &key).await;
    assert_eq!(parse(&reply.headers, "ratelimit-policy").0, "redeem-post");
    let reply = send(addr, None, Method::POST, "/coupons/redeem", &key).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    let reply = get_with(addr, "/coupons/redeem", &key).await;
    assert_eq!(parse(&reply.headers, "ratelimit-policy").0, "default");
    let reply = get_with(addr, "/healthz", &[]).await;
    assert_eq!((reply.status, reply.body.as_str()), (StatusCode::OK, "ok"));
    assert!(reply.headers.get("ratelimit-policy").is_none());

    // Only some methods limited at all.
    let layer = RateLimitLayer::new(limiter_near_window_end(1)).methods(&[Method::POST]);
    let addr = serve(layer).await;
    for _ in 0..3 {
        let reply = get_with(addr, "/coupons/redeem", &[]).await;
        assert_eq!(reply.status, StatusCode::OK, "GET is not limited");
        assert!(reply.headers.get("ratelimit").is_none());
    }
    let reply = send(addr, None, Method::POST, "/coupons/redeem", &[]).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
}

/// Servers answer HEAD with the GET handler: a filter on GET covers HEAD,
/// or a client would reach that handler unlimited by asking with HEAD.
#[tokio::test]
async fn a_get_filter_also_limits_head() {
    let key = [("x-api-key", "k")];
    let layer = RateLimitLayer::new(limiter_near_window_end(1)).methods(&[Method::GET]);
    let addr = serve(layer).await;
    assert_eq!(
        send(addr, None, Method::GET, "/coupons/redeem", &key)
            .await
            .status,
        StatusCode::OK
    );
    for _ in 0..2 {
        let reply = send(addr, None, Method::HEAD, "/coupons/redeem", &key).await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    }
    let get_only = per_minute(1, NEAR_END, Some("get-only"));
    let layer = RateLimitLayer::new(limiter_near_window_end(100)).route_methods(
        &[Method::GET],
        "/coupons",
        "get-only",
        get_only,
    );
    let addr = serve(layer).await;
    let reply = send(addr, None, Method::HEAD, "/coupons/redeem", &key).await;
    assert_eq!(parse(&reply.headers, "ratelimit-policy").0, "get-only");
}

#[tokio::test]
async fn any_inner_body_type_and_the_wrapped_service_are_reachable() {
    // An inner body that cannot be built from a String.
    let inner = tower::service_fn(|_: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Empty::<Bytes>::new()))
    });
    let mut service = RateLimitLayer::new(limiter_near_window_end(1)).layer(inner);
    let _: &_ = service.get_ref();
    let _: &mut _ = service.get_mut();
    let request = || {
        http::Request::builder()
            .header("x-api-key", "k")
            .body(())
            .unwrap()
    };
    let ok = service
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let denied = service
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = denied.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("quota-exceeded"));
    let _inner = service.into_inner();
}

#[tokio::test]
async fn decision_headers_for_callers_of_check() {
    let limiter = limiter_near_window_end(2);
    let headers = PolicyHeaders::new("search", &limiter.quota()).legacy(true);
    let mut map = HeaderMap::new();
    for _ in 0..3 {
        map.clear();
        let decision = limiter.check("k", 1).await;
        headers.append_to(&mut map, &decision);
    }
    let (name, params) = parse(&map, "ratelimit");
    assert_eq!((name.as_str(), param(&params, "r")), ("search", 0));
    assert_eq!(parse(&map, "ratelimit-policy").0, "search");
    assert_eq!(map["retry-after"], "1");
    assert_eq!(map["x-ratelimit-remaining"], "0");
}

#[tokio::test]
async fn legacy_headers_and_costs() {
    let layer = RateLimitLayer::new(limiter_near_window_end(10))
        .legacy_headers(true)
        .cost(cost_from_header);
    let addr = serve(layer).await;
    let reply = get_key(addr, "k").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["x-ratelimit-limit"], "10");
    assert_eq!(reply.headers["x-ratelimit-remaining"], "9");
    assert_eq!(reply.headers["x-ratelimit-reset"], "1");
    // A costly request takes several permits at once.
    let reply = get_with(
        addr,
        "/coupons/redeem",
        &[("x-api-key", "k"), ("x-cost", "9")],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["x-ratelimit-remaining"], "0");
    // A cost above the limit can never pass: 429 without Retry-After.
    let reply = get_with(
        addr,
        "/coupons/redeem",
        &[("x-api-key", "j"), ("x-cost", "11")],
    )
    .await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(reply.headers.get("retry-after").is_none());
}

// 11. A bounded wait before a 429.

/// Real time, on the embedded store: one request a second. Without a
/// wait the second request of a window is a 429; with `wait_up_to(2 s)`
/// it is held until the next window and admitted. Both layers share the
/// limiter, so they count the same requests.
#[tokio::test]
async fn wait_up_to_admits_a_request_the_wait_covers() {
    let per_second = Limiter::builder(Quota::per_second(nonzero!(1)))
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let hourly = Limiter::builder(Quota::per_hour(nonzero!(100)))
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let plain = serve(RateLimitLayer::new(per_second.clone())).await;
    let waiting = serve(
        RateLimitLayer::new(per_second.clone())
            .policy_name("second")
            .also("hour", hourly)
            .wait_up_to(Duration::from_secs(2)),
    )
    .await;
    // From just after a window boundary (the embedded store's windows
    // are aligned to the epoch), so the first two requests share a window.
    let into = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    tokio::time::sleep(
        Duration::from_nanos(u64::from(1_000_000_000 - into)) + Duration::from_millis(20),
    )
    .await;
    assert_eq!(get_key(plain, "alice").await.status, StatusCode::OK);
    let denied = get_key(plain, "alice").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.headers["retry-after"], "1");
    let began = std::time::Instant::now();
    let reply = get_key(waiting, "alice").await;
    let took = began.elapsed();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body, "redeemed");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_eq!(
        names(&items(&reply.headers, "ratelimit")),
        ["second", "hour"],
        "the headers of the decisions that admitted it"
    );
    let stats = per_second.stats();
    assert!(stats.acquire_waits >= 1, "it waited: {stats:?}");
    assert_eq!(stats.acquire_timeouts, 0);
}

/// A request whose retry lies beyond the wait is answered at once, as
/// without the wait: 1 per 10 s on a stopped clock, so the retry is 10 s
/// against a wait of 2 s.
#[tokio::test]
async fn wait_up_to_answers_at_once_when_the_retry_lies_beyond_it() {
    let clock = FakeClock::new(ORIGIN);
    let limiter = Limiter::builder(Quota::new(1, Duration::from_secs(10)).unwrap())
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock)
        .build()
        .unwrap();
    let addr = serve(RateLimitLayer::new(limiter.clone()).wait_up_to(Duration::from_secs(2))).await;
    assert_eq!(get_key(addr, "alice").await.status, StatusCode::OK);
    let began = std::time::Instant::now();
    let reply = get_key(addr, "alice").await;
    let took = began.elapsed();
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.headers["retry-after"], "10");
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    let stats = limiter.stats();
    assert_eq!((stats.acquire_waits, stats.acquire_timeouts), (0, 0));
}

/// Two policies deny, one for 1 s and one for 2 s, with 2.5 s of wait:
/// the request waits for the longer, then finds the shorter passed too.
/// Virtual time (Tokio's paused clock drives the limiters' clocks), the
/// service called directly.
#[tokio::test(start_paused = true)]
async fn wait_up_to_waits_out_every_denying_policy_within_one_budget() {
    let clock = support::VirtualClock {
        origin: ORIGIN,
        start: tokio::time::Instant::now(),
    };
    let limiter = |period: u64| {
        Limiter::builder(Quota::new(1, Duration::from_secs(period)).unwrap())
            .store(MemoryStore::with_clock(clock.clone()))
            .clock(clock.clone())
            .build()
            .unwrap()
    };
    let (second, two) = (limiter(1), limiter(2));
    let inner = tower::service_fn(|_: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Empty::<Bytes>::new()))
    });
    let mut service = RateLimitLayer::new(second.clone())
        .also("two", two.clone())
        .wait_up_to(Duration::from_millis(2_500))
        .layer(inner);
    let mut send = async || {
        let request = http::Request::builder()
            .header("x-api-key", "k")
            .body(())
            .unwrap();
        let began = tokio::time::Instant::now();
        let status = service
            .ready()
            .await
            .unwrap()
            .call(request)
            .await
            .unwrap()
            .status();
        (status, began.elapsed())
    };
    assert_eq!(send().await, (StatusCode::OK, Duration::ZERO));
    let (status, took) = send().await;
    assert_eq!(status, StatusCode::OK, "after {took:?}");
    // The 2 s window's reset, plus at most 20 ms of jitter and the
    // timer's tick.
    assert!(
        took >= Duration::from_secs(2) && took <= Duration::from_millis(2_021),
        "admitted after {took:?}"
    );
    assert_eq!(two.stats().acquire_waits, 1);
    assert_eq!(second.stats().acquire_waits, 0, "its retry had passed");
    assert_eq!((second.stats().allowed, two.stats().allowed), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_limiter_behind_the_layer() {
    let limiter = Limiter::builder(Quota::per_hour(nonzero!(5)))
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

/// A user policy keyed by the API key beside an organisation policy keyed
/// by a header whose name comes from configuration, through a real axum
/// server: each counts its own key, a denial names its policy, and a
/// request without the organisation's key is rejected as missing.
#[tokio::test]
async fn each_policy_can_have_its_own_key() {
    let org_header = String::from("X-Org-Id"); // as read from a config file
    let users = per_minute(2, Duration::ZERO, Some("user"));
    let orgs = per_minute(3, Duration::ZERO, Some("org"));
    let layer = RateLimitLayer::new(users).policy_name("user").also_keyed(
        "org",
        orgs.clone(),
        KeyExtractor::header(&org_header),
    );
    let addr = serve(layer).await;
    let call = |user: &'static str, org: Option<&'static str>| {
        let mut headers = vec![("x-api-key", user)];
        if let Some(org) = org {
            headers.push(("x-org-id", org));
        }
        async move { get_with(addr, "/coupons/redeem", &headers).await }
    };
    assert_eq!(call("alice", Some("acme")).await.status, StatusCode::OK);
    assert_eq!(call("alice", Some("acme")).await.status, StatusCode::OK);
    // Alice's own limit: the organisation's permit goes back.
    let reply = call("alice", Some("acme")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        reply.body.contains("\"violated-policies\":[\"user\"]"),
        "{}",
        reply.body
    );
    // The organisation's permit goes back: its header says 1 of 3 left,
    // not the 0 its admission read.
    let remaining: Vec<(String, i64)> = items(&reply.headers, "ratelimit")
        .iter()
        .map(|(n, p)| (n.clone(), param(p, "r")))
        .collect();
    assert_eq!(
        remaining,
        [("user".to_owned(), 0), ("org".to_owned(), 1)],
        "{remaining:?}"
    );
    for _ in 0..200 {
        if orgs.stats().refunded >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(orgs.stats().refunded, 1);
    // Acme has used 2 of 3: Bob gets the last one, Carol is held by Acme.
    assert_eq!(call("bob", Some("acme")).await.status, StatusCode::OK);
    let reply = call("carol", Some("acme")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        reply.body.contains("\"violated-policies\":[\"org\"]"),
        "{}",
        reply.body
    );
    assert_eq!(call("carol", Some("globex")).await.status, StatusCode::OK);
    // No organisation header: a missing key (401 by default), whose
    // challenge names the header that is missing.
    let reply = call("dave", None).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        reply.headers.get("www-authenticate").unwrap(),
        "ApiKey header=\"x-org-id\""
    );
}

#[test]
fn a_header_name_from_configuration_is_checked() {
    assert!(KeyExtractor::try_header("x-tenant").is_ok());
    let err = KeyExtractor::try_header("bad header\n").unwrap_err();
    assert!(err.is_invalid_input(), "{err}");
}
