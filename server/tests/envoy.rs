//! slicelimit-server behind real Envoys: two Envoys, each with both
//! servers in its rate limit cluster, two servers on one private Redis,
//! and HTTP driven through the Envoys.

use slicelimit_sim::envoy;
mod rls;
use slicelimit_sim as support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use envoy::{Envoy, Reply};
use rls::{scratch, write_config, RlsServer};
use support::RedisServer;

const RULE: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 100 }\n";

/// `n` requests for `user`, spread over `envoys` by 8 clients at once.
fn drive(envoys: &[Envoy], user: &str, n: usize) -> Vec<Reply> {
    let next = Arc::new(AtomicUsize::new(0));
    let replies = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|scope| {
        for _ in 0..8 {
            let next = next.clone();
            let replies = replies.clone();
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let reply = envoys[i % envoys.len()].get(user);
                replies.lock().unwrap().push(reply);
            });
        }
    });
    Arc::try_unwrap(replies).unwrap().into_inner().unwrap()
}

fn number(reply: &Reply, header: &str) -> u64 {
    reply
        .header(header)
        .unwrap_or_else(|| panic!("no {header}: {reply:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{header} is not a number: {reply:?}"))
}

#[test]
fn through_two_envoys_exactly_100_of_400_pass_and_the_headers_agree() {
    let redis = RedisServer::start();
    let dir = scratch("envoy-exact");
    let config = dir.join("api.yaml");
    write_config(&config, RULE);
    for mode in ["hybrid-strict", "exact"] {
        let flags = ["--redis-url", &redis.url(), "--mode", mode];
        let servers = [
            RlsServer::start(&config, &flags),
            RlsServer::start(&config, &flags),
        ];
        let ports: Vec<u16> = servers.iter().map(|s| s.grpc_port).collect();
        let envoys = [Envoy::start(&ports, false), Envoy::start(&ports, false)];

        let replies = drive(&envoys, &format!("alice-{mode}"), 400);
        let passed: Vec<&Reply> = replies.iter().filter(|r| r.status == 200).collect();
        let denied: Vec<&Reply> = replies.iter().filter(|r| r.status != 200).collect();
        assert_eq!(passed.len(), 100, "{mode}");
        for reply in &denied {
            assert_eq!(reply.status, 429, "{mode}: {reply:?}");
            assert_eq!(reply.header("x-envoy-ratelimited"), Some("true"), "{mode}");
            assert_eq!(number(reply, "x-ratelimit-remaining"), 0, "{mode}");
        }
        for reply in replies.iter() {
            let limit = reply
                .header("x-ratelimit-limit")
                .expect("x-ratelimit-limit");
            assert_eq!(limit, "100, 100;w=60", "{mode}");
            let reset = number(reply, "x-ratelimit-reset");
            assert!((1..=60).contains(&reset), "{mode}: reset {reset}");
        }
        let mut remaining: Vec<u64> = passed
            .iter()
            .map(|r| number(r, "x-ratelimit-remaining"))
            .collect();
        remaining.sort_unstable();
        if mode == "exact" {
            // Each admission was the store's own count: 99 down to 0, once each.
            assert_eq!(remaining, (0..100).collect::<Vec<u64>>(), "{mode}");
        } else {
            // A leased decision tells what its replica holds plus what the
            // store last said was unleased (Decision::remaining): after
            // admitting, never the whole limit.
            assert!(remaining.iter().all(|&r| r < 100), "{mode}: {remaining:?}");
        }
        let over: f64 = servers
            .iter()
            .map(|s| {
                s.metric(
                    "slicelimit_server_over_limit_total",
                    "{domain=\"api\",rule=\"user\"}",
                )
            })
            .sum();
        assert_eq!(over, 300.0, "{mode}");
    }
}

#[test]
fn with_the_servers_gone_envoys_failure_mode_deny_decides() {
    let dir = scratch("envoy-failure");
    let config = dir.join("api.yaml");
    write_config(&config, RULE);
    let mut server = RlsServer::start(&config, &[]);
    let lenient = Envoy::start(&[server.grpc_port], false);
    let strict = Envoy::start(&[server.grpc_port], true);
    assert_eq!(lenient.get("bob").status, 200);
    assert_eq!(strict.get("bob").status, 200);

    server.kill();
    for i in 0..5 {
        assert_eq!(
            lenient.get("bob").status,
            200,
            "failure_mode_deny: false, {i}"
        );
        let reply = strict.get("bob");
        assert_eq!(reply.status, 500, "failure_mode_deny: true, {i}: {reply:?}");
        assert_eq!(reply.header("x-envoy-ratelimited"), None);
    }
}

/// A rule whose hits are costs of work already done.
const POST_HOC: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 1000 }\n    slicelimit: { post_hoc: true }\n";

/// Waits (up to 30 s) until the server has counted `hits` for the rule:
/// Envoy sends a stream's end charge after it has answered the client.
fn await_hits(server: &RlsServer, hits: f64, what: &str) {
    let labels = "{domain=\"api\",rule=\"user\"}";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let seen = server.metric("slicelimit_server_total_hits_total", labels);
        if seen >= hits {
            assert_eq!(seen, hits, "{what}: more hits than sent");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: {seen} hits counted, {hits} sent:\n{}",
            server.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

const RESERVING: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 1000 }\n";

/// Reserved when the request comes, settled when its stream is done,
/// through a real Envoy 1.40 (Envoy's request id names the reservation):
/// what the work did not use comes back, what it used beyond the
/// estimate is charged past the limit, in both modes. (One replica: with
/// two, a hybrid replica may hold part of what came back, and a second
/// reservation landing on the other waits for it; `tests/reservations.rs`
/// settles on another replica.)
#[test]
fn a_reservation_made_at_the_request_settles_when_the_stream_is_done() {
    let redis = RedisServer::start();
    let dir = scratch("envoy-reserving");
    let config = dir.join("api.yaml");
    write_config(&config, RESERVING);
    for mode in ["hybrid-strict", "exact"] {
        while support::load::wall_us() % 60_000_000 > 45_000_000 {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let server = RlsServer::start(&config, &["--redis-url", &redis.url(), "--mode", mode]);
        let envoy = Envoy::start_reserving(&[server.grpc_port]);
        let user = format!("tenant-{mode}");
        let settled = |outcome: &str, n: f64| {
            let labels = format!("{{outcome=\"{outcome}\"}}");
            let count = || server.metric("slicelimit_server_settlements_total", &labels);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while count() < n {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{mode}: {outcome} settlements did not come:\n{}",
                    server.log()
                );
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            assert_eq!(count(), n, "{mode}: {outcome}");
        };
        // 800 reserved, 100 used: 700 come back when the stream is done.
        assert_eq!(envoy.get_reserving(&user, 800, 100).status, 200, "{mode}");
        settled("refunded", 1.0);
        // 800 more fit only because they came back; 950 used.
        assert_eq!(envoy.get_reserving(&user, 800, 950).status, 200, "{mode}");
        settled("charged", 1.0);
        // 1,050 of 1,000: over, and a denied request settles nothing.
        for i in 0..3 {
            assert_eq!(envoy.get_reserving(&user, 1, 1).status, 429, "{mode} {i}");
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        settled("unreserved", 0.0);
        let other = format!("other-{mode}");
        assert_eq!(envoy.get_reserving(&other, 800, 1).status, 200, "{mode}");
    }
    assert_eq!(redis.immortal_keys(), Vec::<String>::new());
}

/// Tokens charged when a stream is done (Envoy 1.40's
/// `apply_on_stream_done`, the cost from dynamic metadata) are counted
/// even past the limit, in both modes: the key's next request is denied
/// for the debt. (Without `post_hoc`, a charge that does not fit took
/// nothing: every request of the minute passed.)
#[test]
fn tokens_charged_when_the_stream_is_done_count_past_the_limit() {
    let redis = RedisServer::start();
    let dir = scratch("envoy-post-hoc");
    let config = dir.join("api.yaml");
    write_config(&config, POST_HOC);
    for mode in ["hybrid-strict", "exact"] {
        // Every request of a mode in one minute (the check costs under 5 s).
        while support::load::wall_us() % 60_000_000 > 45_000_000 {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let server = RlsServer::start(&config, &["--redis-url", &redis.url(), "--mode", mode]);
        let envoy = Envoy::start_post_hoc(&[server.grpc_port]);
        let user = format!("tenant-{mode}");
        // 900 of 1,000 tokens used.
        assert_eq!(envoy.get_costing(&user, 900).status, 200, "{mode}");
        await_hits(&server, 900.0, mode);
        // 100 left: admitted; the stream then costs 500, 400 past the limit.
        assert_eq!(envoy.get_costing(&user, 500).status, 200, "{mode}");
        await_hits(&server, 1_400.0, mode);
        for i in 0..3 {
            let reply = envoy.get_costing(&user, 10);
            assert_eq!(reply.status, 429, "{mode} {i}: the debt let it pass");
        }
        // Denied requests did no work: nothing more was charged.
        std::thread::sleep(std::time::Duration::from_millis(500));
        await_hits(&server, 1_400.0, mode);
        // Another tenant is untouched.
        assert_eq!(envoy.get_costing("other", 1).status, 200, "{mode}");
    }
}
