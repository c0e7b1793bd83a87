//! envoyproxy/ratelimit's service tests (its
//! `test/service/ratelimit_test.go`), asked of slicelimit-server on a
//! private Redis, in the exact and the hybrid-strict mode. The reference
//! mocks its configuration and its cache; here each mocked limit is a
//! rule of a configuration, and each mocked count is reached by asking.
//! Where the answer differs by design it is asserted as it is here,
//! naming the row of `docs/migrating.md` that says so.

#[path = "reference/harness.rs"]
mod harness;
mod rls;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use harness::{
    check_all, fresh, mode_flag, now, seen, status, with_domain, Seen, Service, MODES, OK, OVER,
};
use rls::{descriptor, request, scratch, write_config, RlsServer};
use slicelimit::FailurePolicy;
use slicelimit_server::service::HeaderNames;
use slicelimit_server::table::Mode;
use slicelimit_sim::RedisServer;

/// The limits the reference's service tests mock, as rules.
const RULES: &str = "
domain: different-domain
descriptors:
  - key: foo
    value: bar
    rate_limit: { name: key_name, unit: minute, requests_per_unit: 10 }
  - key: plain
    rate_limit: { unit: minute, requests_per_unit: 10 }
  - key: plain2
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: shadow
    shadow_mode: true
    rate_limit: { unit: minute, requests_per_unit: 10 }
  - key: regular
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: quota
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: quota1
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: quota2
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: baz
    value: qux
    rate_limit: { unlimited: true }
";

const NONE: Seen = (OK, None, 0);

/// A service answering from [`RULES`] under a domain of its own.
async fn rules(redis: &RedisServer, mode: Mode) -> (Service, String) {
    rules_with(redis, mode, FailurePolicy::FailClosed).await
}

async fn rules_with(redis: &RedisServer, mode: Mode, policy: FailurePolicy) -> (Service, String) {
    let domain = fresh("different-domain");
    let mut settings = harness::settings(redis, mode).await;
    settings.on_store_error = policy;
    let text = with_domain(RULES, &domain);
    let config = slicelimit_server::config::Config::parse("rules.yaml", &text).unwrap();
    (harness::service_of(settings, vec![config]), domain)
}

/// One request of `domain` with one descriptor per `(key, value)`.
fn ask(domain: &str, pairs: &[(&str, &str)]) -> RateLimitRequest {
    request(domain, pairs.iter().map(|p| descriptor(&[*p])).collect())
}

/// Asks `n` times, each answered `code`.
async fn spend(c: &Service, r: &RateLimitRequest, n: usize, code: i32, what: &str) {
    for i in 0..n {
        let got = c.decide(r.clone()).await.unwrap();
        assert_eq!(
            got.overall_code, code,
            "{what}: spending, request {i}: {got:?}"
        );
    }
}

/// `TestService`: a domain not configured is OK with no limit; a request
/// with one descriptor over its limit is over, whatever the order of its
/// descriptors; a reload (the same rules, then a smaller limit) keeps
/// the counts (`docs/migrating.md`: "a reload that changes a rule's
/// limit", the same counter). The failed reload is in
/// `tests/reference.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_service_scenario_answers_as_it_does() {
    use Code::{Ok as OK_, OverLimit as OVER_};
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let what = format!("{mode:?}");
        harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(15)).await;

        let r = c
            .decide(ask(&fresh("test-domain"), &[("hello", "world")]))
            .await
            .unwrap();
        check_all(mode, &r, OK, &[NONE], &what);

        let both = ask(&domain, &[("foo", "bar"), ("hello", "world")]);
        for i in 0..10u32 {
            let r = c.decide(both.clone()).await.unwrap();
            let ten = status(OK_, 10, Unit::Minute, 9 - i);
            check_all(mode, &r, OK, &[ten, NONE], &format!("{what} request {i}"));
        }
        let r = c.decide(both.clone()).await.unwrap();
        check_all(
            mode,
            &r,
            OVER,
            &[status(OVER_, 10, Unit::Minute, 0), NONE],
            &what,
        );
        assert_eq!(
            r.statuses[0].current_limit.as_ref().unwrap().name,
            "key_name"
        );
        // A reload of the same rules: still over.
        c.reload(&[("rules.yaml", &with_domain(RULES, &domain))]);
        let reversed = ask(&domain, &[("hello", "world"), ("foo", "bar")]);
        let r = c.decide(reversed).await.unwrap();
        check_all(
            mode,
            &r,
            OVER,
            &[NONE, status(OVER_, 10, Unit::Minute, 0)],
            &what,
        );

        // 4 of 10 used, then the limit is 5: one left.
        let value = fresh("p");
        let plain = ask(&domain, &[("plain", &value)]);
        spend(&c, &plain, 4, OK, &what).await;
        let smaller = RULES.replace(
            "key: plain\n    rate_limit: { unit: minute, requests_per_unit: 10 }",
            "key: plain\n    rate_limit: { unit: minute, requests_per_unit: 5 }",
        );
        assert_ne!(smaller, RULES);
        c.reload(&[("rules.yaml", &with_domain(&smaller, &domain))]);
        let r = c.decide(plain.clone()).await.unwrap();
        check_all(mode, &r, OK, &[status(OK_, 5, Unit::Minute, 0)], &what);
        let r = c.decide(plain.clone()).await.unwrap();
        check_all(mode, &r, OVER, &[status(OVER_, 5, Unit::Minute, 0)], &what);
        // Another unit is another window's count ("a reload that changes
        // a rule's unit": a new counter, as there).
        let hourly = smaller.replace(
            "key: plain\n    rate_limit: { unit: minute, requests_per_unit: 5 }",
            "key: plain\n    rate_limit: { unit: hour, requests_per_unit: 5 }",
        );
        c.reload(&[("rules.yaml", &with_domain(&hourly, &domain))]);
        let r = c.decide(plain).await.unwrap();
        check_all(mode, &r, OK, &[status(OK_, 5, Unit::Hour, 4)], &what);
    }
}

/// `TestRuleShadowMode` and `TestMixedRuleShadowMode`: a shadow rule over
/// its limit answers OK (none left); the request is over only if an
/// enforced rule is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_rule_shadow_mode_scenarios_answer_as_it_does() {
    use Code::{Ok as OK_, OverLimit as OVER_};
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let what = format!("{mode:?}");
        harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(15)).await;
        let spent = status(OK_, 10, Unit::Minute, 0);

        let (a, b) = (fresh("a"), fresh("b"));
        let shadows = ask(&domain, &[("shadow", &a), ("shadow", &b)]);
        spend(&c, &shadows, 10, OK, &what).await;
        let r = c.decide(shadows).await.unwrap();
        check_all(
            mode,
            &r,
            OK,
            &[spent, spent],
            &format!("{what}, both shadow"),
        );

        let v = fresh("v");
        let mixed = ask(&domain, &[("shadow", &v), ("plain", &v)]);
        spend(&c, &mixed, 10, OK, &what).await;
        let r = c.decide(mixed).await.unwrap();
        let over = status(OVER_, 10, Unit::Minute, 0);
        check_all(mode, &r, OVER, &[spent, over], &format!("{what}, mixed"));
    }
}

/// `TestServiceWithCustomRatelimitHeaders` and
/// `TestServiceWithDefaultRatelimitHeaders`: the headers tell the
/// descriptor over its limit: its limit, 0 left, and the seconds to the
/// end of its window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_response_header_scenarios_answer_as_it_does() {
    let custom = HeaderNames {
        limit: "A-Ratelimit-Limit".into(),
        remaining: "A-Ratelimit-Remaining".into(),
        reset: "A-Ratelimit-Reset".into(),
    };
    for mode in MODES {
        for names in [custom.clone(), HeaderNames::default()] {
            let redis = RedisServer::start();
            let (c, domain) = rules(&redis, mode).await;
            let c = c.limiter.clone().response_headers(Some(names.clone()));
            harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(15)).await;
            let both = ask(&domain, &[("plain", &fresh("h")), ("hello", "world")]);
            for _ in 0..10 {
                assert_eq!(c.decide(both.clone()).await.unwrap().overall_code, OK);
            }
            let before = now().as_secs();
            let r = c.decide(both).await.unwrap();
            let after = now().as_secs();
            assert_eq!(r.overall_code, OVER, "{mode:?}");
            let told: Vec<(String, String)> = r
                .response_headers_to_add
                .iter()
                .map(|h| (h.key.clone(), h.value.clone()))
                .collect();
            assert_eq!(told.len(), 3, "{mode:?}: {told:?}");
            assert_eq!(told[0], (names.limit.clone(), "10".into()), "{mode:?}");
            assert_eq!(told[1], (names.remaining.clone(), "0".into()), "{mode:?}");
            assert_eq!(told[2].0, names.reset, "{mode:?}");
            // The reference's `CalculateReset`: 60 - now % 60, in whole
            // seconds, at some moment of the call.
            let reset: u64 = told[2].1.parse().unwrap();
            assert!(
                (60 - after % 60..=60 - before % 60).contains(&reset),
                "{mode:?}: reset {reset} at {before}..{after}"
            );
        }
    }
}

/// `TestEmptyDomain` and `TestEmptyDescriptors`: refused with an error,
/// counted as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_empty_domain_and_descriptors_are_errors() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let errors = || calls("error");
        let before = errors();
        let e = c.decide(ask("", &[("hello", "world")])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{mode:?}: {e}");
        assert!(e.message().contains("domain"), "{e}");
        let e = c.decide(request(&domain, vec![])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{mode:?}: {e}");
        assert!(e.message().contains("descriptor"), "{e}");
        assert!(errors() >= before + 2, "{mode:?}");
    }
}

/// `slicelimit_server_calls_total{result}` (the reference's
/// `call.should_rate_limit.*` stats).
fn calls(result: &str) -> u64 {
    let prefix = format!("slicelimit_server_calls_total{{result=\"{result}\"}} ");
    harness::stats()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// `TestCacheError`: Redis fails. The reference answers an error (which
/// Envoy's default failure mode admits); here the failure policy
/// answers (`docs/migrating.md`, "Redis down": `--on-store-error open`,
/// the default, admits; closed denies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_cache_error_scenario_is_decided_by_the_failure_policy() {
    for mode in MODES {
        for (policy, code) in [
            (FailurePolicy::FailOpen, OK),
            (FailurePolicy::FailClosed, OVER),
        ] {
            let mut redis = RedisServer::start();
            let (c, domain) = rules_with(&redis, mode, policy).await;
            redis.kill();
            let r = c.decide(ask(&domain, &[("foo", "bar")])).await;
            let r = r.unwrap_or_else(|e| panic!("{mode:?} {policy:?}: an error: {e}"));
            assert_eq!(r.overall_code, code, "{mode:?} {policy:?}: {r:?}");
        }
    }
}

/// `TestUnlimited`: a limited descriptor is counted, one without a rule
/// is OK with nothing, an unlimited one OK with every permit left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_unlimited_scenario_answers_as_it_does() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let pairs = [("plain", "bar"), ("hello", "world"), ("baz", "qux")];
        let r = c.decide(ask(&domain, &pairs)).await.unwrap();
        let ten = status(Code::Ok, 10, Unit::Minute, 9);
        check_all(
            mode,
            &r,
            OK,
            &[ten, NONE, (OK, None, u32::MAX)],
            &format!("{mode:?}"),
        );
    }
}

/// `TestServiceGlobalQuotaMode`: with every rule in quota mode, a request
/// whose descriptors are all over is over, each told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_global_quota_mode_scenario_answers_as_it_does() {
    use Code::OverLimit as OVER_;
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let c = c.limiter.clone().quota_everything(true);
        let what = format!("{mode:?}");
        harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(15)).await;
        let v = fresh("q");
        for (key, n) in [("plain", 10), ("plain2", 5)] {
            for i in 0..n {
                let r = c.decide(ask(&domain, &[(key, &v)])).await.unwrap();
                assert_eq!(r.overall_code, OK, "{what} {key} {i}");
            }
        }
        let r = c
            .decide(ask(&domain, &[("plain", &v), ("plain2", &v)]))
            .await
            .unwrap();
        let over = [
            status(OVER_, 10, Unit::Minute, 0),
            status(OVER_, 5, Unit::Minute, 0),
        ];
        check_all(mode, &r, OVER, &over, &what);
    }
}

/// The per-descriptor quota mode scenarios (`TestServicePerDescriptorQuotaMode`,
/// `TestServiceMixedPerDescriptorModes`,
/// `TestServiceMixedPerDescriptorModesUnderLimit`,
/// `TestServiceQuotaModeOnlyAllOverTheLimit`,
/// `TestServiceQuotaModeOnlySomeOverTheLimit`): over if a rule not in
/// quota mode is, or every quota-mode one is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_quota_mode_scenarios_answer_as_it_does() {
    use Code::{Ok as OK_, OverLimit as OVER_};
    let five = |left| status(OK_, 5, Unit::Minute, left);
    let three = |left| status(OK_, 3, Unit::Minute, left);
    let five_over = status(OVER_, 5, Unit::Minute, 0);
    let three_over = status(OVER_, 3, Unit::Minute, 0);
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let what = |test: &str| format!("{mode:?} {test}");
        harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(15)).await;
        let pair = |a: &str, b: &str, v: &str| ask(&domain, &[(a, v), (b, v)]);

        // The regular rule over, the quota one not: over. The quota
        // descriptor is not counted (`docs/migrating.md`, "a request
        // denied by one descriptor": none counts it; the reference counts
        // it unless STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT): 3 left.
        let v = fresh("a");
        spend(&c, &ask(&domain, &[("regular", &v)]), 5, OK, "regular").await;
        let r = c.decide(pair("regular", "quota", &v)).await.unwrap();
        let test = "TestServicePerDescriptorQuotaMode";
        check_all(mode, &r, OVER, &[five_over, three(3)], &what(test));

        // The quota rule over, the regular not: every quota descriptor is
        // over, so the request is. The regular rule is told 4 left, as
        // the reference counts it; its permit goes back here ("a request
        // denied by one descriptor": none counts it), so it has 5.
        let v = fresh("b");
        spend(&c, &ask(&domain, &[("quota", &v)]), 3, OK, "quota").await;
        let r = c.decide(pair("regular", "quota", &v)).await.unwrap();
        let test = "TestServiceMixedPerDescriptorModes";
        check_all(mode, &r, OVER, &[five(4), three_over], &what(test));
        let r = c.decide(ask(&domain, &[("regular", &v)])).await.unwrap();
        check_all(mode, &r, OK, &[five(4)], &what("given back"));

        let v = fresh("c");
        let r = c.decide(pair("regular", "quota", &v)).await.unwrap();
        let test = "TestServiceMixedPerDescriptorModesUnderLimit";
        check_all(mode, &r, OK, &[five(4), three(2)], &what(test));

        let v = fresh("d");
        spend(&c, &ask(&domain, &[("quota1", &v)]), 5, OK, "quota1").await;
        spend(&c, &ask(&domain, &[("quota2", &v)]), 3, OK, "quota2").await;
        let r = c.decide(pair("quota1", "quota2", &v)).await.unwrap();
        let test = "TestServiceQuotaModeOnlyAllOverTheLimit";
        check_all(mode, &r, OVER, &[five_over, three_over], &what(test));

        let v = fresh("e");
        spend(&c, &ask(&domain, &[("quota1", &v)]), 5, OK, "quota1").await;
        let r = c.decide(pair("quota1", "quota2", &v)).await.unwrap();
        let test = "TestServiceQuotaModeOnlySomeOverTheLimit";
        check_all(mode, &r, OK, &[five_over, three(2)], &what(test));
    }
}

/// Starts `slicelimit-server` with `args` and `env` expecting it to
/// refuse to start: returns its exit status's success and what it said.
fn refused_at_start(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let log = std::env::temp_dir().join(format!("slicelimit-refused-{}.log", fresh("x")));
    let mut child = Command::new(env!("CARGO_BIN_EXE_slicelimit-server"))
        .args(args)
        .args([
            "--grpc-addr",
            &format!("127.0.0.1:{}", slicelimit_sim::free_port()),
        ])
        .args([
            "--metrics-addr",
            &format!("127.0.0.1:{}", slicelimit_sim::free_port()),
        ])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start slicelimit-server");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "slicelimit-server started: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    (status.success(), said)
}

/// `TestInitialLoadError` (and the first check of
/// `TestServiceHealthStatusAtLeastOneConfigLoaded`): the reference
/// serves without a configuration, answering errors and unhealthy;
/// here a configuration that fails to load stops the start
/// (`docs/migrating.md`, `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`).
#[test]
fn the_references_initial_load_error_stops_the_start() {
    let redis = RedisServer::start();
    let dir = scratch("reference-initial-load-error");
    let config = dir.join("broken.yaml");
    write_config(&config, "domain: [\n");
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--redis-url",
        &redis.url(),
    ];
    let (ok, said) = refused_at_start(&args, &[]);
    assert!(!ok, "{said}");
    assert!(said.contains("broken.yaml"), "{said}");
}

/// `TestMetadataReturnedForPassedDescriptors`,
/// `TestMetadataReturnedForAllPassedDescriptors`,
/// `TestOverlappingMetadataReturnsTheFirstValue`: dynamic metadata is
/// not sent, and asking for it stops the start, named
/// (`docs/migrating.md`, `RESPONSE_DYNAMIC_METADATA=true`).
#[test]
fn the_references_dynamic_metadata_setting_is_refused_at_start() {
    let redis = RedisServer::start();
    let dir = scratch("reference-metadata");
    let config = dir.join("metadata.yaml");
    write_config(&config, include_str!("reference/metadata.yaml"));
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--redis-url",
        &redis.url(),
    ];
    let (ok, said) = refused_at_start(
        &args,
        &[
            ("RESPONSE_DYNAMIC_METADATA", "true"),
            ("QUOTA_MODE", "true"),
        ],
    );
    assert!(!ok, "{said}");
    assert!(said.contains("RESPONSE_DYNAMIC_METADATA"), "{said}");
}

/// `TestServiceHealthStatus`: the gRPC health service answers SERVING for
/// the reference's service name, `ratelimit`. And
/// `TestServiceHealthStatusAtLeastOneConfigLoaded`'s reload to no
/// domains: the reference turns NOT_SERVING; here a directory left
/// without files fails to load and the last good configuration keeps
/// serving (`docs/migrating.md`, `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_health_scenarios_answer_as_documented() {
    for mode in MODES {
        let redis = RedisServer::start();
        let dir = scratch("reference-health");
        let domain = fresh("health");
        write_config(&dir.join("rules.yaml"), &with_domain(RULES, &domain));
        let server = RlsServer::start(
            &dir,
            &["--redis-url", &redis.url(), "--mode", mode_flag(mode)],
        );
        let channel = tonic::transport::Channel::from_shared(server.grpc_url())
            .unwrap()
            .connect()
            .await
            .expect("connect to gRPC health");
        let health = tonic_health::pb::health_client::HealthClient::new(channel);
        let serving = |mut health: tonic_health::pb::health_client::HealthClient<_>| async move {
            health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: "ratelimit".into(),
                })
                .await
                .expect("health of ratelimit")
                .into_inner()
                .status
        };
        assert_eq!(serving(health.clone()).await, 1, "{mode:?}: SERVING");

        let errors = || server.metric("slicelimit_server_config_loads_total", "{result=\"error\"}");
        let before = errors();
        std::fs::remove_file(dir.join("rules.yaml")).unwrap();
        harness::eventually("the empty directory is refused", || errors() > before).await;
        assert_eq!(serving(health.clone()).await, 1, "{mode:?}: still SERVING");
        let mut client = server.client().await;
        let r = client
            .should_rate_limit(ask(&domain, &[("foo", "bar")]))
            .await
            .unwrap();
        let limit = seen(&r.get_ref().statuses[0]).1;
        assert_eq!(limit, Some((10, Unit::Minute as i32)), "{mode:?}");
    }
}

/// `TestServiceGlobalShadowMode`, `TestServiceQuotaModeWithShadowMode`
/// and `TestServiceMixedModeWithShadowMode`: with `SHADOW_MODE` every
/// descriptor still tells its own answer (OVER_LIMIT when over), and only
/// the request's is OK, counted as let through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_global_shadow_mode_scenarios_answer_as_it_does() {
    use Code::OverLimit as OVER_;
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let c = c.limiter.clone().shadow_everything(true);
        let what = format!("{mode:?}");
        harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(15)).await;

        let v = fresh("g");
        let plain = ask(&domain, &[("plain", &v), ("hello", "world")]);
        for _ in 0..10 {
            assert_eq!(c.decide(plain.clone()).await.unwrap().overall_code, OK);
        }
        let r = c.decide(plain).await.unwrap();
        check_all(
            mode,
            &r,
            OK,
            &[status(OVER_, 10, Unit::Minute, 0), NONE],
            &format!("{what}, plain"),
        );

        let q = fresh("q");
        let quotas = ask(&domain, &[("quota1", &q), ("quota2", &q)]);
        for _ in 0..5 {
            c.decide(quotas.clone()).await.unwrap();
        }
        let r = c.decide(quotas).await.unwrap();
        check_all(
            mode,
            &r,
            OK,
            &[
                status(OVER_, 5, Unit::Minute, 0),
                status(OVER_, 3, Unit::Minute, 0),
            ],
            &format!("{what}, quota"),
        );

        let m = fresh("m");
        let mixed = ask(&domain, &[("regular", &m), ("quota", &m)]);
        for _ in 0..5 {
            c.decide(mixed.clone()).await.unwrap();
        }
        let r = c.decide(mixed).await.unwrap();
        assert_eq!(r.overall_code, OK, "{what}, mixed");
        assert_eq!(r.statuses[0].code, OVER_ as i32, "{what}, mixed");
        assert_eq!(r.statuses[1].code, OVER_ as i32, "{what}, mixed");
        // A request let through counts against every descriptor, over
        // or not (plain2 allows 5, plain 10: eight requests leave plain 2).
        let w = fresh("w");
        let pair = ask(&domain, &[("plain2", &w), ("plain", &w)]);
        for _ in 0..8 {
            assert_eq!(
                c.decide(pair.clone()).await.unwrap().overall_code,
                OK,
                "{what}"
            );
        }
        let r = c.decide(ask(&domain, &[("plain", &w)])).await.unwrap();
        check_all(
            mode,
            &r,
            OK,
            &[status(Code::Ok, 10, Unit::Minute, 1)],
            &format!("{what}, counted while let through"),
        );
        let prefix = format!("slicelimit_server_global_shadow_mode_total{{domain=\"{domain}\"}} ");
        let let_through: u64 = harness::stats()
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .map_or(0, |v| v.trim().parse().unwrap());
        assert!(let_through >= 3, "{what}: {let_through} let through");
    }
}
