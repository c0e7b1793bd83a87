//! envoyproxy/ratelimit's configuration tests (its
//! `test/config/config_test.go`), asked of slicelimit-server's service
//! rather than of a configuration object: which rule a descriptor
//! reaches is the limit its status tells, and a rule's stats key is the
//! `rule` label of the server's series (the reference's
//! `domain.key1_value1.subkey1` is `key1=value1/subkey1` here: the
//! `docs/migrating.md` Stats table). On the reference's fixtures
//! (`tests/reference/`) and its inline configurations, on a private
//! Redis, in the exact and the hybrid-strict mode. The refusals of its
//! broken fixtures are tested in `src/config/tests.rs`.

#[path = "reference/harness.rs"]
mod harness;
mod rls;

use std::path::PathBuf;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use harness::{
    check, counted, fresh, limit_of, stat, status, with_domain, Service, MODES, OK, OVER,
};
use rls::{descriptor, request};
use slicelimit_server::table::Mode;
use slicelimit_sim::RedisServer;

const BASIC_CONFIG: &str = include_str!("reference/basic_config.yaml");
const SHADOW_MODE: &str = include_str!("reference/shadowmode_config.yaml");
const WILDCARD: &str = include_str!("reference/wildcard.yaml");
const SHARE_THRESHOLD: &str = include_str!("reference/share_threshold.yaml");
const METADATA: &str = include_str!("reference/metadata.yaml");
const MERGE_KEY1: &str = include_str!("reference/merge_domain_key1.yaml");
const MERGE_KEY2: &str = include_str!("reference/merge_domain_key2.yaml");

/// What a status tells of its limit: (requests, unit, name), or none.
type Told = Option<(u32, i32, String)>;

/// A descriptor's entries.
type Entries<'a> = &'a [(&'a str, &'a str)];

/// A service answering from `text` renamed to a domain of its own.
async fn one_file(redis: &RedisServer, mode: Mode, text: &str) -> (Service, String) {
    let domain = fresh("test-domain");
    let text = with_domain(text, &domain);
    (
        harness::service(redis, mode, &[("file.yaml", &text)]).await,
        domain,
    )
}

/// The limit `entries` reach in `domain`: (requests, unit, name).
async fn limit(c: &Service, domain: &str, entries: &[(&str, &str)]) -> Told {
    let r = c
        .decide(request(domain, vec![descriptor(entries)]))
        .await
        .unwrap();
    limit_of(&r.statuses[0])
}

fn rule(requests: u32, unit: Unit) -> Told {
    Some((requests, unit as i32, String::new()))
}

fn labels(pairs: &[(&str, u64)]) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = pairs.iter().map(|(l, n)| ((*l).to_owned(), *n)).collect();
    out.sort();
    out
}

/// `TestBasicConfig`: each descriptor reaches its rule (its limit, unit
/// and name), or none; an unlimited rule counts nothing; a
/// `detailed_metric` rule's series carries the requested value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_basic_config_gives_each_descriptor_its_rule() {
    use Unit::{Day, Hour, Minute, Second};
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = one_file(&redis, mode, BASIC_CONFIG).await;
        let none = None;
        let cases: [(Entries<'_>, Told); 15] = [
            (&[], none.clone()),
            (&[("key1", "something")], none.clone()),
            (&[("key1", "value1")], none.clone()),
            (&[("key2", "value2"), ("subkey", "subvalue")], none.clone()),
            (&[("key5", "value5"), ("subkey5", "subvalue")], none.clone()),
            (
                &[("key1", "value1"), ("subkey1", "something")],
                rule(5, Second),
            ),
            (
                &[("key1", "value1"), ("subkey1", "subvalue1")],
                rule(10, Second),
            ),
            (&[("key2", "something")], rule(20, Minute)),
            (&[("key2", "value2")], rule(30, Minute)),
            // A value with no limit of its own: not limited.
            (&[("key2", "value3")], none.clone()),
            (&[("key3", "foo")], rule(1, Hour)),
            (
                &[("key4", "foo")],
                Some((1, Day as i32, "key4_rate_limit".into())),
            ),
            (&[("key7", "unspecified_value")], rule(70, Minute)),
            (&[("key7", "another_value")], rule(70, Minute)),
            (
                &[("key5", "value5"), ("subkey5", "subvalue5")],
                rule(25, Day),
            ),
        ];
        for (entries, want) in cases {
            assert_eq!(
                limit(&c, &domain, entries).await,
                want,
                "{mode:?} {entries:?}"
            );
        }
        // No such domain: nothing.
        assert_eq!(
            limit(&c, &fresh("foo_domain"), &[("key1", "v")]).await,
            None
        );
        // Unlimited: OK, no limit, every permit left.
        let r = c
            .decide(request(&domain, vec![descriptor(&[("key6", "foo")])]))
            .await
            .unwrap();
        check(
            mode,
            &r.statuses[0],
            (OK, None, u32::MAX),
            &format!("{mode:?}"),
        );

        assert_eq!(
            counted(&domain),
            labels(&[
                ("key1=value1/subkey1", 1),
                ("key1=value1/subkey1=subvalue1", 1),
                ("key2", 1),
                ("key2=value2", 1),
                ("key3", 1),
                ("key4", 1),
                ("key5=value5/subkey5=subvalue5", 1),
                ("key7=another_value", 1),
                ("key7=unspecified_value", 1),
            ]),
            "{mode:?}"
        );
    }
}

/// `TestDomainMerge` and `TestDuplicateKeyDomainMerge`: with
/// `MERGE_DOMAIN_CONFIG`, two files of one domain are one; a top-level
/// descriptor in both is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_domain_merge_joins_files_and_refuses_a_key_in_both() {
    use slicelimit_server::files::configs;
    for mode in MODES {
        let redis = RedisServer::start();
        let domain = fresh("test-domain");
        let file = |name: &str, text: &str| (PathBuf::from(name), with_domain(text, &domain));
        let merged = configs(
            &vec![
                file("merge_domain_key1.yaml", MERGE_KEY1),
                file("merge_domain_key2.yaml", MERGE_KEY2),
            ],
            true,
        )
        .expect("merged");
        let mut settings = harness::settings(&redis, mode).await;
        settings.merge_domains = true;
        let c = harness::service_of(settings, merged);
        assert_eq!(limit(&c, &domain, &[]).await, None);
        assert_eq!(limit(&c, &fresh("foo_domain"), &[("k", "v")]).await, None);
        let ten = rule(10, Unit::Minute);
        assert_eq!(limit(&c, &domain, &[("key1", "value1")]).await, ten);
        let twenty = rule(20, Unit::Minute);
        assert_eq!(limit(&c, &domain, &[("key2", "value2")]).await, twenty);

        let twice = vec![
            file("merge_domain_key1.yaml", MERGE_KEY1),
            file("merge_domain_key1.yaml", MERGE_KEY1),
        ];
        let err = configs(&twice, true).expect_err("a key in both files");
        let message = err.to_string();
        assert!(message.contains("merge_domain_key1.yaml"), "{message}");
        assert!(message.contains("key1=value1"), "{message}");
    }
}

fn with_limit(
    entries: &[(&str, &str)],
    requests_per_unit: u32,
    unit: RateLimitUnit,
) -> RateLimitDescriptor {
    let mut d = descriptor(entries);
    d.limit = Some(RateLimitOverride {
        requests_per_unit,
        unit: unit as i32,
    });
    d
}

/// `TestConfigLimitOverride`: a descriptor's own `limit` is the limit
/// told back; its count is the descriptor's (another value, another
/// count) in the limit's window; a domain not configured limits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_limit_override_is_the_limit_of_its_descriptor() {
    use Code::Ok as OK_;
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = one_file(&redis, mode, BASIC_CONFIG).await;
        let ask = |domain: &str, d| request(domain, vec![d]);
        let something = [("key1", "value1"), ("subkey1", "something")];
        let what = format!("{mode:?}");

        let r = c
            .decide(ask(
                &fresh("foo_domain"),
                with_limit(&something, 10, RateLimitUnit::Day),
            ))
            .await
            .unwrap();
        check(mode, &r.statuses[0], (OK, None, 0), &what);

        let r = c
            .decide(ask(&domain, with_limit(&something, 10, RateLimitUnit::Day)))
            .await
            .unwrap();
        check(mode, &r.statuses[0], status(OK_, 10, Unit::Day, 9), &what);
        assert_eq!(
            limit_of(&r.statuses[0]).unwrap().2,
            "",
            "an override has no name"
        );
        // Another limit, of another unit: its own window's count.
        let r = c
            .decide(ask(
                &domain,
                with_limit(&something, 42, RateLimitUnit::Hour),
            ))
            .await
            .unwrap();
        check(mode, &r.statuses[0], status(OK_, 42, Unit::Hour, 41), &what);
        // Another value: another count.
        let other = [("key1", "value1"), ("subkey1", "something_else")];
        let r = c
            .decide(ask(&domain, with_limit(&other, 42, RateLimitUnit::Hour)))
            .await
            .unwrap();
        check(mode, &r.statuses[0], status(OK_, 42, Unit::Hour, 41), &what);
        let r = c
            .decide(ask(
                &domain,
                with_limit(&something, 42, RateLimitUnit::Hour),
            ))
            .await
            .unwrap();
        check(mode, &r.statuses[0], status(OK_, 42, Unit::Hour, 40), &what);
    }
}

/// `TestShadowModeConfig`: the rules marked `shadow_mode` answer OK past
/// their limit and count what they would deny; the others deny.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_shadow_mode_config_marks_only_its_shadow_rules() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = one_file(&redis, mode, SHADOW_MODE).await;
        let ask = |entries: &[(&str, &str)]| request(&domain, vec![descriptor(entries)]);
        let what = format!("{mode:?}");
        harness::clear_of_rollover(
            std::time::Duration::from_secs(60),
            std::time::Duration::from_secs(15),
        )
        .await;

        // key2 (20 a minute, shadow): 25 requests, all OK.
        for i in 0..25u32 {
            let r = c.decide(ask(&[("key2", "something")])).await.unwrap();
            assert_eq!(r.overall_code, OK, "{what} request {i}");
            let left = 20u32.saturating_sub(i + 1);
            check(
                mode,
                &r.statuses[0],
                status(Code::Ok, 20, Unit::Minute, left),
                &what,
            );
        }
        let [total, _, near, within, shadow] = harness::stats_of(&domain, "key2");
        assert_eq!((total, near, within, shadow), (25, 4, 20, 5), "{what}");

        // key2=value2 (30 a minute, not shadow): the 31st is over.
        for i in 0..31u32 {
            let r = c.decide(ask(&[("key2", "value2")])).await.unwrap();
            let code = if i < 30 { OK } else { OVER };
            assert_eq!(r.overall_code, code, "{what} request {i}");
        }
        assert_eq!(stat("shadow_mode", &domain, "key2=value2"), 0, "{what}");

        // subkey1=subvalue1 (10 a second, shadow): never over.
        for i in 0..15 {
            let r = c
                .decide(ask(&[("key1", "value1"), ("subkey1", "subvalue1")]))
                .await
                .unwrap();
            assert_eq!(r.overall_code, OK, "{what} request {i}");
        }
        // subkey1 (5 a second, not shadow): over within a second's burst.
        let mut denied = false;
        for _ in 0..200 {
            let r = c
                .decide(ask(&[("key1", "value1"), ("subkey1", "other")]))
                .await
                .unwrap();
            if r.overall_code == OVER {
                denied = true;
                break;
            }
        }
        assert!(denied, "{what}: 5 a second never denied");
    }
}

/// `TestWildcardConfig`: a value with `*` (at the end, in the middle,
/// several) matches values around it, a value without does not; the
/// rule's stats key is the pattern (`TestWildcardStatsBehavior`, no
/// flags), and each value is counted on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_wildcards_match_as_there() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = one_file(&redis, mode, WILDCARD).await;
        let what = format!("{mode:?}");
        let twenty = rule(20, Unit::Minute);
        let ten = rule(10, Unit::Minute);
        let cases: [(Entries<'_>, &Told); 16] = [
            (&[("noVal", "foo1")], &twenty),
            (&[("noVal", "foo2")], &twenty),
            (&[("wild", "foo1")], &twenty),
            (&[("wild", "foo2")], &twenty),
            (&[("nestedWild", "val1"), ("wild", "goo2")], &twenty),
            (&[("wild", "bar")], &None),
            (&[("noWild", "foo1")], &None),
            (&[("midWild", "barab")], &twenty),
            (&[("midWild", "bar123b")], &twenty),
            (&[("midWild", "barb")], &twenty),
            (&[("midWild", "bara")], &None),
            (&[("midWild", "xbarb")], &None),
            (&[("multiWild", "foo123bar456baz")], &ten),
            (&[("multiWild", "foobarbaz")], &ten),
            (&[("multiWild", "foo123baz")], &None),
            (&[("multiWild", "bar456baz")], &None),
        ];
        for (entries, want) in cases {
            let r = c
                .decide(request(&domain, vec![descriptor(entries)]))
                .await
                .unwrap();
            assert_eq!(&limit_of(&r.statuses[0]), want, "{what} {entries:?}");
            if let Some((n, _, _)) = want {
                // Each value its own count: one used of n.
                let code = Code::Ok;
                check(
                    mode,
                    &r.statuses[0],
                    status(code, *n, Unit::Minute, n - 1),
                    &what,
                );
            }
        }
        assert_eq!(
            counted(&domain),
            labels(&[
                ("midWild=bar*b", 3),
                ("multiWild=foo*bar*baz", 2),
                ("nestedWild=val1/wild=goo*", 1),
                ("noVal", 2),
                ("wild=foo*", 2),
            ]),
            "{what}"
        );
    }
}

/// `TestShareThreshold` (its configuration fixture): values a sharing
/// wildcard matches draw on one count and one series named by the
/// pattern, at any level and with middle or several `*`; an exact value
/// beside it has its own; a sharing wildcard's pattern wins over
/// `value_to_metric` and `detailed_metric` in the series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_share_threshold_config_shares_counts_and_series() {
    use Unit::Minute;
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = one_file(&redis, mode, SHARE_THRESHOLD).await;
        let what = format!("{mode:?}");
        // (entries, limit, remaining after this request); None: no rule.
        type Case<'a> = (&'a [(&'a str, &'a str)], Option<(u32, u32)>);
        let cases: [Case<'_>; 22] = [
            (&[("files", "files/a.pdf")], Some((100, 99))),
            (&[("files", "files/b.csv")], Some((100, 98))),
            (&[("files", "files/c.txt")], Some((100, 97))),
            (&[("route", "api/v1"), ("method", "GET")], Some((60, 59))),
            (
                &[("service", "svc/user"), ("endpoint", "get")],
                Some((80, 79)),
            ),
            (
                &[("nested", "parent"), ("files", "nested/file1.txt")],
                Some((200, 199)),
            ),
            (
                &[("files", "top/file1.txt"), ("files", "nested/file1.txt")],
                Some((300, 299)),
            ),
            (
                &[("path", "path/foo"), ("file", "file/doc1"), ("type", "pdf")],
                Some((120, 119)),
            ),
            (
                &[
                    ("user", "user/alice"),
                    ("resource", "res/file1"),
                    ("action", "read"),
                ],
                Some((150, 149)),
            ),
            (&[("file", "test1")], Some((50, 49))),
            (&[("file", "test2")], Some((100, 99))),
            (&[("file", "test23")], Some((100, 98))),
            (&[("file", "test123")], Some((100, 97))),
            (&[("midpath", "/api/v1")], Some((100, 99))),
            (&[("midpath", "/api-beta-v1")], Some((100, 98))),
            (&[("midpath", "/apiXYZv1")], Some((100, 97))),
            (&[("midpath", "/api/v2")], None),
            (&[("multiroute", "svcAepBrpc")], Some((50, 49))),
            (&[("multiroute", "svcXXXepYYYrpc")], Some((50, 48))),
            (&[("multiroute", "svceprpc")], Some((50, 47))),
            (&[("multiroute", "svcABCrpc")], None),
            (&[("midroute", "/api/v2")], Some((80, 79))),
        ];
        let more: [Case<'_>; 3] = [
            (&[("midroute", "/api-beta-v2")], Some((80, 78))),
            (
                &[("tenant", "t1prod"), ("resource", "resAv2")],
                Some((60, 59)),
            ),
            (
                &[("tenant", "t99prod"), ("resource", "resBBBv2")],
                Some((60, 58)),
            ),
        ];
        for (entries, want) in cases.iter().chain(&more) {
            let r = c
                .decide(request(&domain, vec![descriptor(entries)]))
                .await
                .unwrap();
            match want {
                Some((n, left)) => check(
                    mode,
                    &r.statuses[0],
                    status(Code::Ok, *n, Minute, *left),
                    &format!("{what} {entries:?}"),
                ),
                None => assert_eq!(limit_of(&r.statuses[0]), None, "{what} {entries:?}"),
            }
        }
        assert_eq!(
            counted(&domain),
            labels(&[
                ("file=test*", 3),
                ("file=test1", 1),
                ("files=files%2F*", 3),
                ("files=top%2F*/files=nested%2F*", 1),
                ("midpath=%2Fapi*v1", 3),
                ("midroute=%2Fapi*v2", 2),
                ("multiroute=svc*ep*rpc", 3),
                ("nested=parent/files=nested%2F*", 1),
                ("path=path%2F*/file=file%2F*/type", 1),
                ("route=api%2F*/method", 1),
                ("service=svc%2F*/endpoint=get", 1),
                ("tenant=t*prod/resource=res*v2", 2),
                ("user=user%2F*/resource=res%2F*/action", 1),
            ]),
            "{what}"
        );
    }
}

/// `TestMetadata`: a file with `metadata` loads and limits as without it
/// (the metadata is not sent: `docs/migrating.md`, `metadata` row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_metadata_fixture_loads_and_limits() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = one_file(&redis, mode, METADATA).await;
        assert_eq!(limit(&c, &domain, &[]).await, None);
        let cases: [(Entries<'_>, Told); 3] = [
            (
                &[("key1", "value1"), ("subkey1", "something")],
                rule(5, Unit::Second),
            ),
            (
                &[("key1", "value1"), ("subkey1", "subvalue1")],
                rule(10, Unit::Second),
            ),
            (&[("key2", "something")], rule(20, Unit::Minute)),
        ];
        for (entries, want) in cases {
            let r = c
                .decide(request(&domain, vec![descriptor(entries)]))
                .await
                .unwrap();
            assert_eq!(limit_of(&r.statuses[0]), want, "{mode:?} {entries:?}");
            assert_eq!(r.dynamic_metadata, None, "{mode:?}");
        }
        assert_eq!(
            counted(&domain),
            labels(&[
                ("key1=value1/subkey1", 1),
                ("key1=value1/subkey1=subvalue1", 1),
                ("key2", 1),
            ])
        );
    }
}
