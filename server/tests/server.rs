//! slicelimit-server: `ShouldRateLimit` semantics on the rule table (in
//! process), and the server process itself (two replicas on one private
//! Redis, hot reload, shadow rules, bad input, Redis failures, SIGTERM).

mod rls;
use slicelimit_sim as support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use rls::{descriptor, is_ok, request, scratch, write_config, RlsServer};
use slicelimit::{FailurePolicy, MemoryStore};
use slicelimit_server::config::Config;
use slicelimit_server::service::RateLimiter;
use slicelimit_server::table::{Mode, Settings, Table};
use support::RedisServer;

const RULES: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: org
    rate_limit: { unit: minute, requests_per_unit: 5 }
    descriptors:
      - key: path
        value: /upload
        rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: watched
    shadow_mode: true
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: free
    unlimited: true
  - key: banned
    rate_limit: { unit: hour, requests_per_unit: 0 }
"#;

fn in_process(mode: Mode) -> RateLimiter {
    in_process_with(RULES, mode)
}

fn in_process_with(rules: &str, mode: Mode) -> RateLimiter {
    let settings = Settings {
        store: MemoryStore::new().into(),
        mode,
        on_store_error: FailurePolicy::FailOpen,
        merge_domains: false,
    };
    let config = Config::parse("rules.yaml", rules).expect("parses");
    let (table, _) = Table::build(vec![config], &settings, None).expect("builds");
    RateLimiter::new(Arc::new(ArcSwap::from_pointee(table)), settings)
}

/// Waits until `done` holds (polled every 20 ms), or fails after 20 s
/// saying `what` did not happen.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn codes(response: &RateLimitResponse) -> Vec<i32> {
    response.statuses.iter().map(|s| s.code).collect()
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

#[tokio::test]
async fn a_denied_request_counts_against_none_of_its_descriptors() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let service = in_process(mode);
        let ask = |user: &str| {
            request(
                "api",
                vec![
                    descriptor(&[("user", user)]),
                    descriptor(&[("org", "acme")]),
                ],
            )
        };
        for _ in 0..3 {
            let r = service.decide(ask("ann")).await.unwrap();
            assert!(is_ok(&r), "{mode:?}");
        }
        // Ann is over her limit: the request is denied by her descriptor,
        // and the organisation's count stays at 3.
        let denied = service.decide(ask("ann")).await.unwrap();
        assert!(!is_ok(&denied));
        assert_eq!(codes(&denied), [OVER, OK], "{mode:?}");
        assert_eq!(denied.statuses[0].limit_remaining, 0);
        assert_eq!(denied.statuses[1].limit_remaining, 2, "{mode:?}");
        let limit = denied.statuses[1].current_limit.as_ref().unwrap();
        assert_eq!(limit.requests_per_unit, 5);
        // So Bob still has the organisation's last two, once the permit
        // the denied request's second descriptor took (it is asked too,
        // for its own status and wait) is back: a refund in a task of its
        // own, a brief undershoot.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(is_ok(&service.decide(ask("bob")).await.unwrap()));
        let last = service.decide(ask("bob")).await.unwrap();
        assert!(is_ok(&last));
        assert_eq!(last.statuses[1].limit_remaining, 0, "{mode:?}");
        let over = service.decide(ask("bob")).await.unwrap();
        assert_eq!(codes(&over), [OK, OVER], "{mode:?}");
        // Bob's own count was given back: 2 used of 3.
        assert_eq!(over.statuses[0].limit_remaining, 1, "{mode:?}");
        // Ann and the organisation both over: each says so, as
        // envoyproxy/ratelimit tells every descriptor over its limit.
        let both = service.decide(ask("ann")).await.unwrap();
        assert_eq!(codes(&both), [OVER, OVER], "{mode:?}");
    }
}

#[tokio::test]
async fn the_most_specific_rule_decides_and_unmatched_or_unlimited_count_nothing() {
    let service = in_process(Mode::Exact);
    let upload = || {
        request(
            "api",
            vec![descriptor(&[("org", "acme"), ("path", "/upload")])],
        )
    };
    let first = service.decide(upload()).await.unwrap();
    assert!(is_ok(&first));
    let limit = first.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (1, 3)); // 1 per HOUR
    assert!(!is_ok(&service.decide(upload()).await.unwrap()));
    for entries in [
        vec![("nobody", "x")],
        vec![("org", "acme"), ("path", "/elsewhere")],
        vec![],
    ] {
        for _ in 0..10 {
            let r = service
                .decide(request("api", vec![descriptor(&entries)]))
                .await
                .unwrap();
            assert!(is_ok(&r), "{entries:?}");
            assert_eq!(r.statuses[0].current_limit, None);
            assert_eq!(r.statuses[0].limit_remaining, 0);
        }
    }
    for _ in 0..10 {
        let free = service
            .decide(request("api", vec![descriptor(&[("free", "x")])]))
            .await
            .unwrap();
        assert!(is_ok(&free));
        // `requests_per_unit: 0` blocks: over the limit, every time.
        let banned = service
            .decide(request("api", vec![descriptor(&[("banned", "x")])]))
            .await
            .unwrap();
        assert_eq!(codes(&banned), [OVER]);
        let limit = banned.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (0, Unit::Hour as i32)
        );
        // Every permit left, as envoyproxy/ratelimit says of an unlimited
        // rule; a descriptor that reaches no rule says 0.
        assert_eq!(free.statuses[0].limit_remaining, u32::MAX);
        let unknown = service
            .decide(request("elsewhere", vec![descriptor(&[("user", "x")])]))
            .await
            .unwrap();
        assert!(is_ok(&unknown));
    }
}

#[tokio::test]
async fn costs_come_from_the_descriptor_else_the_request_and_overrides_get_their_own_limit() {
    let service = in_process(Mode::Exact);
    let mut two = request("api", vec![descriptor(&[("user", "cat")])]);
    two.hits_addend = 2;
    let r = service.decide(two.clone()).await.unwrap();
    assert_eq!(r.statuses[0].limit_remaining, 1);
    // Its own hits_addend wins over the request's.
    two.descriptors[0].hits_addend = Some(UInt64Value { value: 1 });
    let r = service.decide(two.clone()).await.unwrap();
    assert!(is_ok(&r));
    assert_eq!(r.statuses[0].limit_remaining, 0);
    // hits_addend 0 on the request means 1.
    let mut zero = request("api", vec![descriptor(&[("user", "dan")])]);
    zero.hits_addend = 0;
    assert_eq!(
        service.decide(zero).await.unwrap().statuses[0].limit_remaining,
        2
    );

    let mut custom = descriptor(&[("user", "eve")]);
    custom.limit = Some(RateLimitOverride {
        requests_per_unit: 10,
        unit: 1, // SECOND
    });
    let r = service
        .decide(request("api", vec![custom.clone()]))
        .await
        .unwrap();
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (10, 1));
    assert_eq!(r.statuses[0].limit_remaining, 9);
    // A month is 30 days, as envoyproxy/ratelimit counts it.
    custom.limit = Some(RateLimitOverride {
        requests_per_unit: 10,
        unit: 5, // MONTH
    });
    let r = service
        .decide(request("api", vec![custom.clone()]))
        .await
        .unwrap();
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (10, Unit::Month as i32)
    );
    // A limit the server cannot read (UNKNOWN, none at all) is not
    // refused, which Envoy's default failure mode would admit: the
    // rule's own limit applies.
    for unit in [0, 99] {
        custom.limit = Some(RateLimitOverride {
            requests_per_unit: 10,
            unit,
        });
        let r = service
            .decide(request("api", vec![custom.clone()]))
            .await
            .unwrap();
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (3, Unit::Minute as i32),
            "unit {unit}"
        );
    }
    // `requests_per_unit: 0` blocks, as a rule of 0 does.
    custom.limit = Some(RateLimitOverride {
        requests_per_unit: 0,
        unit: 2, // MINUTE
    });
    let r = service.decide(request("api", vec![custom])).await.unwrap();
    assert_eq!(codes(&r), [OVER]);
}

fn with_limit(entries: &[(&str, &str)], requests_per_unit: u32, unit: i32) -> RateLimitDescriptor {
    let mut d = descriptor(entries);
    d.limit = Some(RateLimitOverride {
        requests_per_unit,
        unit,
    });
    d
}

const MINUTE: i32 = Unit::Minute as i32;

#[tokio::test]
async fn overrides_of_one_period_share_one_count_whatever_their_limit() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let service = in_process(mode);
        // 10, 9, … 5 per minute, five requests each: one count, so at
        // most 10 in the minute (each override got a fresh budget before:
        // 45 admitted). Exactly: 5 under 10, then 4 under 9.
        let mut admitted = 0;
        for limit in (5..=10).rev() {
            for _ in 0..5 {
                let d = with_limit(&[("user", "stepper")], limit, MINUTE);
                if is_ok(&service.decide(request("api", vec![d])).await.unwrap()) {
                    admitted += 1;
                }
            }
        }
        match mode {
            Mode::Exact => assert_eq!(admitted, 9),
            _ => assert!((1..=9).contains(&admitted), "{mode:?}: {admitted}"),
        }
        // The rule's own requests (3 per minute) draw on the same count.
        let own = service
            .decide(request("api", vec![descriptor(&[("user", "stepper")])]))
            .await
            .unwrap();
        assert_eq!(codes(&own), [OVER], "{mode:?}");
    }
}

#[tokio::test]
async fn distinct_override_values_are_all_answered_and_never_admit_past_their_own_limit() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let service = in_process(mode);
        // 300 distinct values (more than the live limiters kept) in a
        // scrambled order: each answered, never refused; a request is
        // admitted only while the one count is under its own limit.
        let mut count = 0u32;
        for i in 0..300u32 {
            let limit = 1 + (i * 7919) % 300;
            let d = with_limit(&[("user", "many")], limit, MINUTE);
            let r = service.decide(request("api", vec![d])).await.unwrap();
            if is_ok(&r) {
                assert!(
                    count < limit,
                    "{mode:?}: admitted at {count} under a limit of {limit}"
                );
                count += 1;
            } else if mode == Mode::Exact {
                assert!(
                    count >= limit,
                    "{mode:?}: denied at {count} under a limit of {limit}"
                );
            }
        }
        assert!(count > 0, "{mode:?}");
        let live = service.overrides_live("api");
        assert!(
            live <= slicelimit_server::table::MAX_OVERRIDES,
            "{mode:?}: {live} override limiters live"
        );
    }
}

#[tokio::test]
async fn an_override_applies_where_no_rule_matches_while_the_domain_exists() {
    let service = in_process(Mode::Exact);
    for i in 0..3 {
        let d = with_limit(&[("tenant", "t1"), ("plan", "pro")], 2, MINUTE);
        let r = service.decide(request("api", vec![d])).await.unwrap();
        assert_eq!(codes(&r), [if i < 2 { OK } else { OVER }], "request {i}");
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (2, MINUTE));
    }
    // Another value of the entries is another count; an unknown domain
    // still counts nothing.
    let other = with_limit(&[("tenant", "t2"), ("plan", "pro")], 2, MINUTE);
    assert!(is_ok(
        &service.decide(request("api", vec![other])).await.unwrap()
    ));
    for _ in 0..3 {
        let elsewhere = with_limit(&[("tenant", "t1")], 1, MINUTE);
        assert!(is_ok(
            &service
                .decide(request("nowhere", vec![elsewhere]))
                .await
                .unwrap()
        ));
    }
}

#[tokio::test]
async fn a_shadow_rule_admits_everything_and_counts_what_it_would_deny() {
    let service = in_process(Mode::HybridStrict);
    for i in 0..5 {
        let r = service
            .decide(request("api", vec![descriptor(&[("watched", "w")])]))
            .await
            .unwrap();
        assert!(is_ok(&r), "request {i}");
        assert_eq!(r.statuses[0].limit_remaining, 2_u32.saturating_sub(i + 1));
    }
}

#[tokio::test]
async fn global_shadow_mode_lets_every_request_through_and_still_counts() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let service = in_process(mode).shadow_everything(true);
        for i in 0..6 {
            let r = service
                .decide(request(
                    "api",
                    vec![descriptor(&[("user", "u")]), descriptor(&[("banned", "b")])],
                ))
                .await
                .unwrap();
            // Let through, each descriptor telling its own answer (as
            // envoyproxy/ratelimit's SHADOW_MODE): the banned one is over.
            assert!(is_ok(&r), "{mode:?} request {i}");
            let user = if i < 3 { OK } else { OVER };
            assert_eq!(codes(&r), [user, OVER], "{mode:?} request {i}");
            // Counted all the same: the user's 3 a minute run out.
            assert_eq!(
                r.statuses[0].limit_remaining,
                3_u32.saturating_sub(i + 1),
                "{mode:?} request {i}"
            );
        }
    }
}

fn config_file(dir: &Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("api.yaml");
    write_config(&path, text);
    path
}

fn per_minute(limit: u32) -> String {
    format!(
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: minute, requests_per_unit: {limit} }}\n"
    )
}

/// Sends `n` one-hit requests for `user`, alternating over `clients`,
/// `concurrency` at a time; returns how many were admitted.
async fn admitted(servers: &[&RlsServer], user: &str, n: usize, concurrency: usize) -> usize {
    let mut clients = Vec::new();
    for server in servers {
        clients.push(server.client().await);
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let mut client = clients[worker % clients.len()].clone();
        let next = next.clone();
        let user = user.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let r = client
                    .should_rate_limit(request("api", vec![descriptor(&[("user", &user)])]))
                    .await
                    .expect("an answer")
                    .into_inner();
                ok += usize::from(is_ok(&r));
            }
            ok
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_redis_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let dir = scratch("exactly");
    let config = config_file(&dir, &per_minute(100));
    for mode in ["hybrid-strict", "exact"] {
        let flags = ["--redis-url", &redis.url(), "--mode", mode];
        let a = RlsServer::start(&config, &flags);
        let b = RlsServer::start(&config, &flags);
        let user = format!("user-{mode}");
        let ok = admitted(&[&a, &b], &user, 400, 8).await;
        assert_eq!(ok, 100, "{mode}");
        let over = a.metric(
            "slicelimit_server_over_limit_total",
            "{domain=\"api\",rule=\"user\"}",
        ) + b.metric(
            "slicelimit_server_over_limit_total",
            "{domain=\"api\",rule=\"user\"}",
        );
        assert_eq!(over, 300.0, "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_file_applies_within_a_second_and_a_broken_one_changes_nothing() {
    let redis = RedisServer::start();
    let dir = scratch("reload");
    let config = config_file(&dir, &per_minute(2));
    let server = RlsServer::start(&config, &["--redis-url", &redis.url()]);
    assert_eq!(admitted(&[&server], "u", 5, 1).await, 2);
    let loads = |result: &str| {
        server.metric(
            "slicelimit_server_config_loads_total",
            &format!("{{result=\"{result}\"}}"),
        )
    };

    // Raised to 5: the two already counted stay counted. (Applied within
    // a second, `files::POLL` apart; waited for longer, so a loaded
    // machine does not fail the test.)
    write_config(&config, &per_minute(5));
    eventually("the raise applied", || loads("ok") == 2.0).await;
    assert_eq!(admitted(&[&server], "u", 5, 1).await, 3);

    // A broken file: the last good configuration stays, and it is counted.
    write_config(&config, "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n");
    eventually("the broken file seen", || loads("error") == 1.0).await;
    assert_eq!(loads("error"), 1.0);
    assert_eq!(server.metric("slicelimit_server_config_failing", ""), 1.0);
    let mut client = server.client().await;
    let r = client
        .should_rate_limit(request("api", vec![descriptor(&[("user", "v")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        5
    );
    assert!(server.log().contains("fortnight"), "{}", server.log());
    write_config(&config, &per_minute(6));
    eventually("the fixed file applied", || loads("ok") == 3.0).await;
    assert_eq!(server.metric("slicelimit_server_config_failing", ""), 0.0);
    assert_eq!(loads("ok"), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_symlink_swap_is_seen() {
    let dir = scratch("configmap");
    // The layout Kubernetes gives a mounted ConfigMap: the files are
    // symlinks through `..data`, which is swapped to a new directory.
    let v1 = dir.join("..v1");
    let v2 = dir.join("..v2");
    std::fs::create_dir_all(&v1).unwrap();
    std::fs::create_dir_all(&v2).unwrap();
    std::fs::write(v1.join("api.yaml"), per_minute(2)).unwrap();
    std::fs::write(v2.join("api.yaml"), per_minute(7)).unwrap();
    std::os::unix::fs::symlink("..v1", dir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/api.yaml", dir.join("api.yaml")).unwrap();
    let server = RlsServer::start(&dir, &[]);
    let mut client = server.client().await;
    let limit = |r: RateLimitResponse| {
        r.statuses[0]
            .current_limit
            .clone()
            .unwrap()
            .requests_per_unit
    };
    let ask = || request("api", vec![descriptor(&[("user", "u")])]);
    assert_eq!(
        limit(client.should_rate_limit(ask()).await.unwrap().into_inner()),
        2
    );
    std::os::unix::fs::symlink("..v2", dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    eventually("the swap applied", || {
        server.metric("slicelimit_server_config_loads_total", "{result=\"ok\"}") == 2.0
    })
    .await;
    let r = client.should_rate_limit(ask()).await.unwrap().into_inner();
    assert_eq!(limit(r.clone()), 7);
    assert_eq!(r.statuses[0].limit_remaining, 5, "the count of 2 was kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_denials_are_exported_and_unmatched_descriptors_are_ok() {
    let redis = RedisServer::start();
    let dir = scratch("shadow");
    let config = config_file(&dir, RULES);
    let server = RlsServer::start(&config, &["--redis-url", &redis.url()]);
    let mut client = server.client().await;
    for _ in 0..5 {
        let r = client
            .should_rate_limit(request(
                "api",
                vec![
                    descriptor(&[("watched", "w")]),
                    descriptor(&[("nobody", "x")]),
                ],
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(is_ok(&r));
    }
    let labels = "{domain=\"api\",rule=\"watched\"}";
    assert_eq!(
        server.metric("slicelimit_server_shadow_mode_total", labels),
        3.0
    );
    assert_eq!(
        server.metric("slicelimit_server_total_hits_total", labels),
        5.0
    );
    // Over and let through: counted in both, as the reference counts.
    assert_eq!(
        server.metric("slicelimit_server_over_limit_total", labels),
        3.0
    );
}

async fn code_of(
    client: &mut envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<tonic::transport::Channel>,
    request: RateLimitRequest,
) -> Result<i32, tonic::Code> {
    client
        .should_rate_limit(request)
        .await
        .map(|r| r.into_inner().overall_code)
        .map_err(|s| s.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_defined_answers_and_no_key_lacks_a_ttl() {
    let mut redis = RedisServer::start();
    let dir = scratch("malformed");
    let config = config_file(&dir, RULES);
    let server = RlsServer::start(&config, &["--redis-url", &redis.url()]);
    let mut client = server.client().await;
    let invalid = Err(tonic::Code::InvalidArgument);

    assert_eq!(
        code_of(&mut client, request("", vec![descriptor(&[("user", "a")])])).await,
        invalid
    );
    assert_eq!(code_of(&mut client, request("api", vec![])).await, invalid);
    assert_eq!(
        code_of(&mut client, request("api", vec![descriptor(&[])])).await,
        Ok(OK)
    );
    let mut huge = request("api", vec![descriptor(&[("user", "a")])]);
    huge.hits_addend = u32::MAX;
    assert_eq!(code_of(&mut client, huge).await, Ok(OVER));
    let mut huge = request("api", vec![descriptor(&[("user", "a")])]);
    huge.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX });
    assert_eq!(code_of(&mut client, huge).await, Ok(OVER));
    let many = request("api", vec![descriptor(&[("user", "a")]); 10_000]);
    assert_eq!(code_of(&mut client, many).await, invalid);
    let deep = request("api", vec![descriptor(&vec![("user", "a"); 1_000])]);
    assert_eq!(code_of(&mut client, deep).await, invalid);
    let mib = "k".repeat(1 << 20);
    assert_eq!(
        code_of(
            &mut client,
            request("api", vec![descriptor(&[("user", &mib)])])
        )
        .await,
        Ok(OK)
    );
    assert_eq!(
        code_of(
            &mut client,
            request("api", vec![descriptor(&[(&mib, "v")])])
        )
        .await,
        Ok(OK)
    );
    // Distinct overrides past the live limiters kept are all answered.
    for limit in 1..=(slicelimit_server::table::MAX_OVERRIDES as u32 + 20) {
        let mut d = descriptor(&[("user", "o")]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: limit,
            unit: 1, // SECOND: none of them is the rule's own quota
        });
        assert!(
            code_of(&mut client, request("api", vec![d])).await.is_ok(),
            "override {limit}"
        );
    }
    assert_eq!(server.get("/healthz").unwrap().0, 200);
    // gRPC health, by envoyproxy/ratelimit's service name, the service's
    // own and the server's (""); an unknown name is NOT_FOUND.
    let channel =
        tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", server.grpc_port))
            .expect("a URL")
            .connect()
            .await
            .expect("connect to gRPC health");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for name in [
        slicelimit_server::run::REFERENCE_HEALTH_NAME,
        "envoy.service.ratelimit.v3.RateLimitService",
        "",
    ] {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: name.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("health of {name:?}: {e}"))
            .into_inner()
            .status;
        assert_eq!(status, 1, "{name:?} is not SERVING");
    }
    let unknown = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "nope".into(),
        })
        .await;
    assert_eq!(unknown.unwrap_err().code(), tonic::Code::NotFound);

    let mut conn = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert!(!keys.is_empty());
    for key in keys {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
        assert!(ttl > 0, "{key} has no TTL ({ttl})");
    }
    redis.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_open_admits_closed_denies_and_both_return_to_it() {
    let mut redis = RedisServer::start();
    let dir = scratch("failure");
    let config = config_file(&dir, &per_minute(3));
    let url = redis.url();
    let open = RlsServer::start(&config, &["--redis-url", &url, "--on-store-error", "open"]);
    let closed = RlsServer::start(
        &config,
        &["--redis-url", &url, "--on-store-error", "closed"],
    );
    let mut to_open = open.client().await;
    let mut to_closed = closed.client().await;
    let ask = |user: &str| request("api", vec![descriptor(&[("user", user)])]);
    assert_eq!(code_of(&mut to_open, ask("warm")).await, Ok(OK));

    redis.kill();
    for i in 0..5 {
        // New keys: nothing leased, the store must be asked.
        let user = format!("down-{i}");
        assert_eq!(code_of(&mut to_open, ask(&user)).await, Ok(OK), "open, {i}");
        assert_eq!(
            code_of(&mut to_closed, ask(&user)).await,
            Ok(OVER),
            "closed, {i}"
        );
    }

    redis.restart();
    let mut back = false;
    for _ in 0..100 {
        // Once Redis answers again, a limit of 3 is a limit of 3 for both.
        let probe = format!("probe-{}", rand_suffix());
        let open_ok = admitted(&[&open], &probe, 5, 1).await;
        let closed_ok = admitted(&[&closed], &format!("{probe}-c"), 5, 1).await;
        if open_ok == 3 && closed_ok == 3 {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(back, "the servers never returned to Redis");
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// What a SIGTERM gives back is what Redis has left: an exact replica
/// (one script per request, nothing leased) admits all of it and no more.
/// Both replicas' requests must fall in one Redis window (a new window
/// has the whole limit again); when the window rolls between them, the
/// round runs again on a fresh key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_gives_leased_permits_back_within_the_documented_time() {
    let redis = RedisServer::start();
    let dir = scratch("sigterm");
    let config = config_file(&dir, &per_minute(100));
    let url = redis.url();
    let minute = || redis.cmd::<Vec<u64>>(&["TIME"])[0] / 60;
    for round in 0..3 {
        let user = format!("u{round}");
        let started_in = minute();
        let mut a = RlsServer::start(&config, &["--redis-url", &url]);
        // A strict replica denies while its first lease is on its way
        // (longer than `max_wait` on a loaded machine): ask until one
        // request is admitted, from the lease.
        let mut spent = 0;
        for _ in 0..100 {
            spent = admitted(&[&a], &user, 1, 1).await;
            if spent == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(spent, 1, "the replica never admitted a request");
        let took = a.terminate();
        assert!(
            took < 2 * slicelimit_server::run::SHUTDOWN_STEP + Duration::from_secs(2),
            "{took:?}"
        );
        assert!(a.log().contains("stopped"), "{}", a.log());
        // What A leased and did not use went back: B gets all of the rest.
        let b = RlsServer::start(&config, &["--redis-url", &url, "--mode", "exact"]);
        let rest = admitted(&[&b], &user, 150, 4).await;
        if minute() != started_in {
            continue;
        }
        assert_eq!(rest, 99);
        return;
    }
    panic!("Redis' window rolled during each of three rounds");
}

/// In the hybrid modes the token goes back to the replica's lease. (In
/// `exact` mode it goes back to the store, which counts bucket levels in
/// whole tokens rounded up: on a bucket refilling slowly it can keep the
/// token; docs/envoy.md says so.)
#[tokio::test]
async fn a_token_bucket_keeps_its_tokens_when_another_descriptor_denies() {
    let text = "domain: api\ndescriptors:\n  - key: u\n    rate_limit: { unit: hour, requests_per_unit: 2 }\n    slicelimit: { algorithm: token_bucket }\n  - key: o\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n";
    // (Optimistic would admit a third on credit, as documented.)
    for mode in [Mode::HybridStrict] {
        let settings = Settings {
            store: MemoryStore::new().into(),
            mode,
            on_store_error: FailurePolicy::FailOpen,
            merge_domains: false,
        };
        let config = Config::parse("tb.yaml", text).unwrap();
        let (table, _) = Table::build(vec![config], &settings, None).unwrap();
        let service = RateLimiter::new(Arc::new(ArcSwap::from_pointee(table)), settings);
        let both = || {
            request(
                "api",
                vec![descriptor(&[("u", "x")]), descriptor(&[("o", "y")])],
            )
        };
        assert!(is_ok(&service.decide(both()).await.unwrap()), "{mode:?}");
        for _ in 0..3 {
            // What u took goes back in a task of its own: a moment later.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let r = service.decide(both()).await.unwrap();
            assert_eq!(codes(&r), [OK, OVER], "{mode:?}");
            assert_eq!(r.statuses[0].limit_remaining, 1, "{mode:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let alone = || request("api", vec![descriptor(&[("u", "x")])]);
        assert!(
            is_ok(&service.decide(alone()).await.unwrap()),
            "{mode:?}: the second token"
        );
        assert!(!is_ok(&service.decide(alone()).await.unwrap()), "{mode:?}");
    }
}

/// The dashboard (`docs/grafana/slicelimit.json`) charts the server's
/// own series beside the library's.
#[test]
fn the_grafana_dashboard_charts_the_server() {
    let exprs = slicelimit_sim::dashboard_queries();
    use slicelimit_server::stats::{
        CALLS, CONFIG_FAILING, NEAR_LIMIT, OVER_LIMIT, SHADOW_MODE, WITHIN_LIMIT,
    };
    for metric in [
        WITHIN_LIMIT,
        OVER_LIMIT,
        NEAR_LIMIT,
        SHADOW_MODE,
        CALLS,
        CONFIG_FAILING,
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(metric)),
            "{metric} is charted"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_starts_while_redis_is_down_and_counts_once_it_answers() {
    let mut redis = RedisServer::start();
    redis.kill();
    let dir = scratch("redis-later");
    let config = config_file(&dir, &per_minute(2));
    let server = RlsServer::start(
        &config,
        &["--redis-url", &redis.url(), "--on-store-error", "closed"],
    );
    // Up and healthy, deciding by the failure policy: closed denies.
    eventually("the outage logged", || {
        server.log().contains("Redis does not answer")
    })
    .await;
    assert!(
        server.log().contains("--on-store-error closed"),
        "{}",
        server.log()
    );
    assert_eq!(admitted(&[&server], "u", 3, 1).await, 0);
    assert_eq!(server.get("/healthz").unwrap().0, 200);

    redis.restart();
    eventually("Redis seen answering", || {
        server.log().contains("Redis answers again")
    })
    .await;
    // Counted in Redis now: the rule's 2 a minute, then denied. (Retried
    // while the hybrid lease of the outage's denials lapses.)
    let mut counted = 0;
    for _ in 0..100 {
        counted = admitted(&[&server], "fresh", 3, 1).await;
        if counted > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(counted, 2, "{}", server.log());
    assert!(
        !redis.keys().is_empty(),
        "the count lives in Redis: {:?}",
        redis.keys()
    );
    // One line for the outage, one for the recovery: not one a request.
    let lines = server.log().lines().filter(|l| l.contains("Redis")).count();
    assert!(lines <= 4, "{}", server.log());
    println!("{}", server.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_url_counts_in_the_primary_the_sentinels_name() {
    use support::sentinel::{SentinelSetup, SERVICE};
    let setup = SentinelSetup::start();
    let hosts: Vec<String> = setup
        .sentinel_urls()
        .iter()
        .map(|u| {
            u.trim_start_matches("redis://")
                .trim_end_matches('/')
                .to_owned()
        })
        .collect();
    let url = format!("redis+sentinel://{}/{SERVICE}", hosts.join(","));
    let dir = scratch("sentinel");
    let config = config_file(&dir, &per_minute(2));
    let server = RlsServer::start(&config, &["--redis-url", &url]);
    assert_eq!(admitted(&[&server], "s", 4, 1).await, 2, "{}", server.log());
    assert!(
        setup.primary.keys().iter().any(|k| k.contains("api")),
        "counted in the primary: {:?}",
        setup.primary.keys()
    );
}

/// The reference's `replaces`, `quota_mode` and `share_threshold`.
const REFERENCE_FIELDS: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: { name: per_user, unit: minute, requests_per_unit: 2 }
  - key: vip
    rate_limit:
      unit: minute
      requests_per_unit: 5
      replaces: [{ name: per_user }]
  - key: soft
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: soft2
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: hard
    rate_limit: { unit: minute, requests_per_unit: 10 }
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: { unit: minute, requests_per_unit: 2 }
"#;

#[tokio::test]
async fn a_rule_that_replaces_another_leaves_it_unchecked() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let service = in_process_with(REFERENCE_FIELDS, mode);
        let both = || {
            request(
                "api",
                vec![
                    descriptor(&[("user", "ann")]),
                    descriptor(&[("vip", "ann")]),
                ],
            )
        };
        // per_user (2 a minute) is replaced: the vip rule's 5 apply.
        for i in 0..5 {
            let r = service.decide(both()).await.unwrap();
            assert!(is_ok(&r), "{mode:?} request {i}");
            assert_eq!(r.statuses[0].current_limit, None, "replaced: no limit told");
        }
        assert_eq!(codes(&service.decide(both()).await.unwrap()), [OK, OVER]);
        // Alone, per_user counted nothing meanwhile.
        let alone = request("api", vec![descriptor(&[("user", "ann")])]);
        assert!(is_ok(&service.decide(alone).await.unwrap()), "{mode:?}");
    }
}

#[tokio::test]
async fn a_quota_mode_descriptor_over_its_limit_denies_only_when_every_one_is() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let service = in_process_with(REFERENCE_FIELDS, mode);
        let ask = |soft: &str| {
            request(
                "api",
                vec![
                    descriptor(&[("soft", soft)]),
                    descriptor(&[("soft2", "s")]),
                    descriptor(&[("hard", "h")]),
                ],
            )
        };
        // soft2 is spent by the first request; then one quota descriptor
        // is over and the other is not: OK, with the over one told so.
        assert!(is_ok(&service.decide(ask("a")).await.unwrap()), "{mode:?}");
        let r = service.decide(ask("b")).await.unwrap();
        assert!(is_ok(&r), "{mode:?}");
        assert_eq!(codes(&r), [OK, OVER, OK], "{mode:?}");
        // Both over: the request is, and the hard limit's permit goes back.
        let r = service.decide(ask("a")).await.unwrap();
        assert_eq!(r.overall_code, OVER, "{mode:?}");
        let mut more = 0;
        for _ in 0..20 {
            let hard = request("api", vec![descriptor(&[("hard", "h")])]);
            more += usize::from(is_ok(&service.decide(hard).await.unwrap()));
        }
        assert_eq!(
            more, 8,
            "{mode:?}: the two admitted requests counted, not this one"
        );
    }
}

#[tokio::test]
async fn global_quota_mode_makes_every_descriptor_a_quota() {
    let service = in_process_with(REFERENCE_FIELDS, Mode::Exact).quota_everything(true);
    let ask = || {
        request(
            "api",
            vec![descriptor(&[("user", "q")]), descriptor(&[("hard", "q")])],
        )
    };
    for _ in 0..2 {
        assert!(is_ok(&service.decide(ask()).await.unwrap()));
    }
    // per_user is over, hard is not: not every descriptor is over.
    let r = service.decide(ask()).await.unwrap();
    assert!(is_ok(&r));
    assert_eq!(codes(&r), [OVER, OK]);
}

#[tokio::test]
async fn values_a_sharing_wildcard_matches_draw_on_one_count() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let service = in_process_with(REFERENCE_FIELDS, mode);
        let file = |name: &str| request("api", vec![descriptor(&[("files", name)])]);
        assert!(is_ok(&service.decide(file("files/a.pdf")).await.unwrap()));
        assert!(is_ok(&service.decide(file("files/b.csv")).await.unwrap()));
        let r = service.decide(file("files/c.txt")).await.unwrap();
        assert_eq!(codes(&r), [OVER], "{mode:?}: one count of 2 for every file");
    }
}

#[tokio::test]
async fn response_headers_tell_the_descriptor_nearest_its_limit() {
    use slicelimit_server::service::HeaderNames;
    let service = in_process(Mode::Exact).response_headers(Some(HeaderNames::default()));
    let ask = || {
        request(
            "api",
            vec![descriptor(&[("org", "o")]), descriptor(&[("user", "h")])],
        )
    };
    let headers = |r: &RateLimitResponse| -> Vec<(String, String)> {
        r.response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect()
    };
    // user (3 a minute) is nearer its limit than org (5 a minute).
    let r = service.decide(ask()).await.unwrap();
    let told = headers(&r);
    assert_eq!(told[0], ("RateLimit-Limit".into(), "3".into()));
    assert_eq!(told[1], ("RateLimit-Remaining".into(), "2".into()));
    assert_eq!(told[2].0, "RateLimit-Reset");
    let reset: u64 = told[2].1.parse().unwrap();
    assert!((1..=60).contains(&reset), "{reset}");
    // Without the setting, none.
    let plain = in_process(Mode::Exact).decide(ask()).await.unwrap();
    assert!(plain.response_headers_to_add.is_empty());
}
