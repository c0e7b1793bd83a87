//! envoyproxy/ratelimit's integration scenarios (its
//! `test/integration/integration_test.go`: `testBasicBaseConfig`,
//! `testShareThreshold`, `testConfigReload`), on its own configuration
//! files (`tests/reference/integration/`), asked of slicelimit-server on
//! a private Redis, in the exact and the hybrid-strict mode. Where the
//! answer differs by design it is asserted as it is here, naming the row
//! of `docs/migrating.md` that says so.

#[path = "reference/harness.rs"]
mod harness;
mod rls;

use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use harness::{check, check_all, eventually, fresh, mode_flag, reset_secs, seen, status, MODES};
use rls::{descriptor, request, scratch, write_config, RlsServer};
use slicelimit_server::table::Mode;
use slicelimit_sim::RedisServer;

const BASIC: &str = include_str!("reference/integration/basic.yaml");
const ANOTHER: &str = include_str!("reference/integration/another.yaml");
const SHARE_THRESHOLD: &str = include_str!("reference/integration/share_threshold.yaml");
const RELOAD: &str = include_str!("reference/integration/reload.yaml");

/// The reference's integration configuration directory.
const FILES: [(&str, &str); 3] = [
    ("basic.yaml", BASIC),
    ("another.yaml", ANOTHER),
    ("share_threshold.yaml", SHARE_THRESHOLD),
];

async fn service(redis: &RedisServer, mode: Mode) -> harness::Service {
    harness::service(redis, mode, &FILES).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_basic_scenarios_answer_as_it_does() {
    use Code::{Ok as OK, OverLimit as OVER};
    for mode in MODES {
        let redis = RedisServer::start();
        let c = service(&redis, mode).await;

        // A domain with no configuration: OK, no limit, nothing left.
        let r = c
            .decide(request("foo", vec![descriptor(&[("hello", "world")])]))
            .await
            .unwrap();
        assert_eq!(r.overall_code, OK as i32);
        assert_eq!(seen(&r.statuses[0]), (OK as i32, None, 0), "{mode:?}");

        // 50 a second: one used.
        let r = c
            .decide(request("basic", vec![descriptor(&[("key1", "foo")])]))
            .await
            .unwrap();
        check(
            mode,
            &r.statuses[0],
            status(OK, 50, Unit::Second, 49),
            &format!("{mode:?}"),
        );

        // 20 a minute, 25 asked: the last 5 over, none left. (Both
        // sequences on the minute's limit count in one minute's window.)
        harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(20)).await;
        let value = fresh("k2");
        for i in 0..25u32 {
            let r = c
                .decide(request("another", vec![descriptor(&[("key2", &value)])]))
                .await
                .unwrap();
            let (code, left) = if i >= 20 {
                (OVER, 0)
            } else {
                (OK, 20 - (i + 1))
            };
            assert_eq!(r.overall_code, code as i32, "{mode:?} request {i}");
            let what = format!("{mode:?} request {i}");
            check(
                mode,
                &r.statuses[0],
                status(code, 20, Unit::Minute, left),
                &what,
            );
        }

        // Two keys in one request: 20 a minute and 10 an hour. Once the
        // hourly one is over, the request is denied and counts against
        // neither, so the minute's count stays at 10: the reference
        // answers so with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT (without
        // it, it goes on counting the minute: 9, 8, … left).
        let value = fresh("k23");
        for i in 0..15u32 {
            let r = c
                .decide(request(
                    "another",
                    vec![
                        descriptor(&[("key2", &value)]),
                        descriptor(&[("key3", &value)]),
                    ],
                ))
                .await
                .unwrap();
            let (code, left1, left2) = if i >= 10 {
                (OVER, 10, 0)
            } else {
                (OK, 20 - (i + 1), 10 - (i + 1))
            };
            assert_eq!(r.overall_code, code as i32, "{mode:?} request {i}");
            let what = format!("{mode:?} request {i}");
            check(
                mode,
                &r.statuses[0],
                status(OK, 20, Unit::Minute, left1),
                &what,
            );
            check(
                mode,
                &r.statuses[1],
                status(code, 10, Unit::Hour, left2),
                &what,
            );
            if code == OVER {
                // What the minute took goes back a moment after the
                // answer (docs/envoy.md): the next request comes once a
                // look (`hits_addend` 0) sees it back.
                harness::given_back(&c, "another", &[("key2", &value)], 10).await;
            }
        }

        // The time to the reset ticks down (within one day's window).
        harness::clear_of_rollover(Duration::from_secs(3_600), Duration::from_secs(10)).await;
        let value = fresh("durTest");
        let ask = || request("another", vec![descriptor(&[("key4", &value)])]);
        let first = c.decide(ask()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let second = c.decide(ask()).await.unwrap();
        assert!(
            reset_secs(&second, 0) < reset_secs(&first, 0),
            "{mode:?}: {} then {}",
            reset_secs(&first, 0),
            reset_secs(&second, 0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_share_threshold_scenario_answers_as_it_does() {
    use Code::{Ok as OK, OverLimit as OVER};
    for mode in MODES {
        let redis = RedisServer::start();
        let c = service(&redis, mode).await;
        let ask = |key: &str, value: &str| {
            request("share-threshold-test", vec![descriptor(&[(key, value)])])
        };
        // files/*: every file draws on one 10 an hour.
        for i in 0..10 {
            let r = c
                .decide(ask("files", &format!("files/f{i}.pdf")))
                .await
                .unwrap();
            assert_eq!(r.overall_code, OK as i32, "{mode:?} file {i}");
        }
        let r = c.decide(ask("files", "files/another.csv")).await.unwrap();
        assert_eq!(r.overall_code, OVER as i32, "{mode:?}");
        // files_no_share/*: each file its own 10.
        for i in 0..12 {
            let r = c
                .decide(ask("files_no_share", &format!("files_no_share/f{i}")))
                .await
                .unwrap();
            assert_eq!(r.overall_code, OK as i32, "{mode:?} file {i}");
        }
    }
}

/// `testConfigReload`: a file added to the configuration directory
/// brings its domain in, and its removal is a reload too (here: the
/// domain goes). With `TestService`'s load error: a configuration that
/// fails to load leaves the one in use answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_config_reload_scenario_answers_as_it_does() {
    use Code::{Ok as OK, OverLimit as OVER};
    const LOADS: &str = "slicelimit_server_config_loads_total";
    for mode in MODES {
        let redis = RedisServer::start();
        let dir = scratch("reference-reload");
        for (name, text) in FILES {
            write_config(&dir.join(name), text);
        }
        let server = RlsServer::start(
            &dir,
            &["--redis-url", &redis.url(), "--mode", mode_flag(mode)],
        );
        let mut client = server.client().await;
        let ask = |key: &str| request("reload", vec![descriptor(&[(key, "foo")])]);
        let what = format!("{mode:?}");

        // Not configured yet: OK, no limit.
        let r = client.should_rate_limit(ask("block")).await.unwrap();
        check_all(mode, r.get_ref(), OK as i32, &[(OK as i32, None, 0)], &what);

        let loaded = |result: &str| server.metric(LOADS, &format!("{{result=\"{result}\"}}"));
        let before = loaded("ok");
        write_config(&dir.join("reload.yaml"), RELOAD);
        eventually("the added file is loaded", || loaded("ok") > before).await;
        let r = client.should_rate_limit(ask("key1")).await.unwrap();
        let fifty = status(OK, 50, Unit::Second, 49);
        check_all(mode, r.get_ref(), OK as i32, &[fifty], &what);
        // Its 0 a second: every request over the limit.
        let r = client.should_rate_limit(ask("block")).await.unwrap();
        let blocked = status(OVER, 0, Unit::Second, 0);
        check_all(mode, r.get_ref(), OVER as i32, &[blocked], &what);

        // A file that fails to load: the configuration in use stays.
        let errors = loaded("error");
        write_config(&dir.join("broken.yaml"), "domain: [\n");
        eventually("the broken file is refused", || loaded("error") > errors).await;
        let r = client.should_rate_limit(ask("key1")).await.unwrap();
        assert_eq!(r.get_ref().overall_code, OK as i32, "{what}");
        assert_eq!(
            seen(&r.get_ref().statuses[0]).1,
            Some((50, Unit::Second as i32)),
            "{what}: still the reload domain's limit"
        );

        // Removing files reloads: the domain is gone. (The broken file
        // last: until then every load fails.)
        let before = loaded("ok");
        std::fs::remove_file(dir.join("reload.yaml")).unwrap();
        std::fs::remove_file(dir.join("broken.yaml")).unwrap();
        eventually("the removal is loaded", || loaded("ok") > before).await;
        let r = client.should_rate_limit(ask("key1")).await.unwrap();
        check_all(mode, r.get_ref(), OK as i32, &[(OK as i32, None, 0)], &what);
        // The other files' domains answer throughout.
        let r = client
            .should_rate_limit(request("basic", vec![descriptor(&[("key1", &fresh("k"))])]))
            .await
            .unwrap();
        assert_eq!(
            seen(&r.get_ref().statuses[0]).1,
            Some((50, Unit::Second as i32)),
            "{what}"
        );
    }
}
