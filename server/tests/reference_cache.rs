//! envoyproxy/ratelimit's Redis cache tests (its
//! `test/redis/fixed_cache_impl_test.go`), asked of slicelimit-server's
//! service on a private Redis, in the exact and the hybrid-strict mode:
//! the answers and the per-rule stats (`total_hits`, `over_limit`,
//! `near_limit`, `within_limit`, `shadow_mode`) of a fixed window. The
//! reference mocks Redis' count; here each count is reached by asking.
//! Its mocked clock makes one-second windows safe to test in; here the
//! same limits are per hour, in a window the test starts clear of its
//! end. Where the answer differs by design it is asserted as it is here,
//! naming the row of `docs/migrating.md` that says so.

#[path = "reference/harness.rs"]
mod harness;
mod rls;

use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use harness::{
    check, check_all, fresh, now, stats_of, status, with_domain, Service, MODES, OK, OVER,
};
use rls::{descriptor, request};
use slicelimit_server::table::Mode;
use slicelimit_sim::RedisServer;

/// The limits the reference's cache tests mock, as rules.
const RULES: &str = "
domain: domain
descriptors:
  - key: key
    value: value
    rate_limit: { unit: second, requests_per_unit: 10 }
  - key: key2
    value: value2
    descriptors:
      - key: subkey2
        value: subvalue2
        rate_limit: { unit: minute, requests_per_unit: 10 }
  - key: key3
    value: value3
    rate_limit: { unit: hour, requests_per_unit: 10 }
    descriptors:
      - key: subkey3
        value: subvalue3
        rate_limit: { unit: day, requests_per_unit: 10 }
  - key: key4
    rate_limit: { unit: hour, requests_per_unit: 15 }
  - key: key5
    rate_limit: { unit: hour, requests_per_unit: 14 }
  - key: twenty
    rate_limit: { unit: hour, requests_per_unit: 20 }
  - key: eight
    rate_limit: { unit: hour, requests_per_unit: 8 }
  - key: ten
    rate_limit: { unit: hour, requests_per_unit: 10 }
  - key: shadow
    shadow_mode: true
    rate_limit: { unit: hour, requests_per_unit: 15 }
  - key: roll
    rate_limit: { unit: second, requests_per_unit: 3 }
";

/// A service answering from [`RULES`] under a domain of its own (its own
/// series too), started clear of the end of an hour (and of a day).
async fn rules(redis: &RedisServer, mode: Mode) -> (Service, String) {
    let domain = fresh("domain");
    let c = harness::service(redis, mode, &[("rules.yaml", &with_domain(RULES, &domain))]).await;
    harness::clear_of_rollover(Duration::from_secs(3_600), Duration::from_secs(20)).await;
    (c, domain)
}

/// A descriptor of `(key, value)` pairs with its own `hits_addend`.
fn costing(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    let mut d = descriptor(entries);
    d.hits_addend = Some(UInt64Value { value: hits });
    d
}

/// One descriptor `key=value`, the request's `hits_addend` `hits`.
fn hits(domain: &str, key: &str, value: &str, hits: u32) -> RateLimitRequest {
    let mut r = request(domain, vec![descriptor(&[(key, value)])]);
    r.hits_addend = hits;
    r
}

/// `[total, over, near, within, shadow]` minus `before`.
fn since(after: [u64; 5], before: [u64; 5]) -> [u64; 5] {
    std::array::from_fn(|i| after[i] - before[i])
}

/// `r` is over, by its last status: the limit told, and `left` left (in
/// the hybrid modes an estimate, at most `left`).
fn over_with(mode: Mode, r: &RateLimitResponse, limit: u32, unit: Unit, left: u32, what: &str) {
    assert_eq!(r.overall_code, OVER, "{what}: {r:?}");
    let (code, told, remaining) = harness::seen(r.statuses.last().unwrap());
    assert_eq!((code, told), (OVER, Some((limit, unit as i32))), "{what}");
    if mode == Mode::Exact {
        assert_eq!(remaining, left, "{what}");
    } else {
        assert!(remaining <= left, "{what}: {remaining}");
    }
}

/// `TestRedis`: a first hit leaves limit − 1; a descriptor with no rule
/// and a `hits_addend` of 0 beside one over its limit is OK with
/// nothing; a `hits_addend` of 0 counts nothing and only looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_redis_scenario_answers_as_it_does() {
    use Code::{Ok as OK_, OverLimit as OVER_};
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let what = format!("{mode:?}");

        let r = c
            .decide(request(&domain, vec![descriptor(&[("key", "value")])]))
            .await
            .unwrap();
        check_all(mode, &r, OK, &[status(OK_, 10, Unit::Second, 9)], &what);
        assert_eq!(stats_of(&domain, "key=value"), [1, 0, 0, 1, 0], "{what}");

        // 10 a minute, spent; then over, beside a descriptor of no rule.
        harness::clear_of_rollover(Duration::from_secs(60), Duration::from_secs(15)).await;
        let sub = [("key2", "value2"), ("subkey2", "subvalue2")];
        let pair = || {
            request(
                &domain,
                vec![costing(&[("key2", "value2")], 0), costing(&sub, 1)],
            )
        };
        for _ in 0..10 {
            assert_eq!(c.decide(pair()).await.unwrap().overall_code, OK, "{what}");
        }
        let r = c.decide(pair()).await.unwrap();
        let over = status(OVER_, 10, Unit::Minute, 0);
        check_all(mode, &r, OVER, &[(OK, None, 0), over], &what);
        let rule = "key2=value2/subkey2=subvalue2";
        // The 9th and 10th hits were past 80 % (8) of the limit.
        assert_eq!(stats_of(&domain, rule), [11, 1, 2, 10, 0], "{what}");

        // 10 an hour and 10 a day, spent; one more denied. Then the hourly
        // one only looked at (`hits_addend` 0) beside the daily one: the
        // reference counted the denied request, so its count is 11, over
        // 10, and the look is over; here it was not counted
        // (`docs/migrating.md`, "a request denied by one descriptor":
        // none counts it), the count is 10, and the look is OK, none left.
        let key3 = [("key3", "value3")];
        let sub3 = [("key3", "value3"), ("subkey3", "subvalue3")];
        let ask = |d: RateLimitDescriptor| request(&domain, vec![d]);
        for _ in 0..10 {
            assert_eq!(
                c.decide(ask(descriptor(&key3))).await.unwrap().overall_code,
                OK
            );
            assert_eq!(
                c.decide(ask(descriptor(&sub3))).await.unwrap().overall_code,
                OK
            );
        }
        assert_eq!(
            c.decide(ask(descriptor(&key3))).await.unwrap().overall_code,
            OVER
        );
        let before = stats_of(&domain, "key3=value3");
        let r = c
            .decide(request(&domain, vec![costing(&key3, 0), costing(&sub3, 1)]))
            .await
            .unwrap();
        let hour = status(OK_, 10, Unit::Hour, 0);
        let day = status(OVER_, 10, Unit::Day, 0);
        check_all(mode, &r, OVER, &[hour, day], &what);
        // A look is no hit.
        assert_eq!(
            since(stats_of(&domain, "key3=value3"), before),
            [0; 5],
            "{what}"
        );
    }
}

/// `TestNearLimit`, one hit at a time: hits past 80 % of the limit are
/// near it, the one past the limit is over and not near.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_near_limit_scenario_answers_as_it_does() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let ask = || request(&domain, vec![descriptor(&[("key4", "value4")])]);
        for i in 1..=16u64 {
            let r = c.decide(ask()).await.unwrap();
            let what = format!("{mode:?} hit {i}");
            let left = 15u32.saturating_sub(i as u32);
            let want = if i > 15 {
                status(Code::OverLimit, 15, Unit::Hour, 0)
            } else {
                status(Code::Ok, 15, Unit::Hour, left)
            };
            check(mode, &r.statuses[0], want, &what);
            // floor(15 × 0.8) = 12: the 13th to the 15th are near.
            let near = i.clamp(12, 15) - 12;
            let want = [i, i.saturating_sub(15), near, i.min(15), 0];
            assert_eq!(stats_of(&domain, "key4"), want, "{what}");
        }
    }
}

/// `TestNearLimit` with a `hits_addend` past 1, where every hit falls on
/// one side of 80 % and of the limit: all under near, all near, all over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_hits_addend_scenarios_answer_as_it_does() {
    use Code::{Ok as OK_, OverLimit as OVER_};
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        // (rule, limit, hits before, hits asked, status, [total, over,
        // near, within] of the request)
        let cases = [
            (
                "twenty",
                20,
                2,
                3,
                status(OK_, 20, Unit::Hour, 15),
                [3, 0, 0, 3],
            ),
            (
                "twenty",
                20,
                16,
                3,
                status(OK_, 20, Unit::Hour, 1),
                [3, 0, 3, 3],
            ),
            (
                "ten",
                10,
                10,
                3,
                status(OVER_, 10, Unit::Hour, 0),
                [3, 3, 0, 0],
            ),
        ];
        for (key, _limit, before, asked, want, counted) in cases {
            let value = fresh(key);
            let what = format!("{mode:?} {key}: {before} then {asked}");
            for _ in 0..before {
                let r = c.decide(hits(&domain, key, &value, 1)).await.unwrap();
                assert_eq!(r.overall_code, OK, "{what}");
            }
            let stats = stats_of(&domain, key);
            let r = c.decide(hits(&domain, key, &value, asked)).await.unwrap();
            check(mode, &r.statuses[0], want, &what);
            let got = since(stats_of(&domain, key), stats);
            assert_eq!(got[..4], counted, "{what}");
        }
    }
}

/// `TestNearLimit`'s `hits_addend` that crosses 80 %: only the hits past
/// it are near (limit 8: floor(6.4) = 6; 5 hits, then 2: the 7th is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_near_limit_counts_only_the_hits_past_80_percent() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let value = fresh("eight");
        for _ in 0..5 {
            let r = c.decide(hits(&domain, "eight", &value, 1)).await.unwrap();
            assert_eq!(r.overall_code, OK, "{mode:?}");
        }
        let stats = stats_of(&domain, "eight");
        let r = c.decide(hits(&domain, "eight", &value, 2)).await.unwrap();
        assert_eq!(r.overall_code, OK, "{mode:?}");
        let got = since(stats_of(&domain, "eight"), stats);
        assert_eq!(got[..4], [2, 0, 1, 2], "{mode:?}");
    }
}

/// `TestNearLimit`'s `hits_addend` that is partly past the limit. The
/// reference admits the hits that fit and counts the request over, its
/// stats split (over: what is past the limit, near: the rest past 80 %);
/// here a cost larger than what is left is denied and takes nothing
/// (`docs/migrating.md`, "a cost (`hits_addend`) larger than what is
/// left"): every hit over, and what was left is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_hits_addend_past_the_limit_is_denied_whole() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        // (hits before, hits asked): the reference's "some of it over
        // limit, all of it over near limit" and "some of it in all three
        // places", on a limit of 20.
        for (before, asked) in [(19u32, 3u32), (15, 7)] {
            let value = fresh("twenty");
            let what = format!("{mode:?}: {before} then {asked}");
            for _ in 0..before {
                let r = c.decide(hits(&domain, "twenty", &value, 1)).await.unwrap();
                assert_eq!(r.overall_code, OK, "{what}");
            }
            let stats = stats_of(&domain, "twenty");
            let r = c
                .decide(hits(&domain, "twenty", &value, asked))
                .await
                .unwrap();
            // Over, and told what is left (the reference: 0, its count
            // past the limit).
            let left = 20 - before;
            over_with(mode, &r, 20, Unit::Hour, left, &what);
            let got = since(stats_of(&domain, "twenty"), stats);
            assert_eq!(
                got[..4],
                [u64::from(asked), u64::from(asked), 0, 0],
                "{what}"
            );
            // What was left is left.
            let r = c
                .decide(hits(&domain, "twenty", &value, left))
                .await
                .unwrap();
            let spent = status(Code::Ok, 20, Unit::Hour, 0);
            check(mode, &r.statuses[0], spent, &what);
        }
    }
}

/// `TestOverLimitWithLocalCacheShadowRule`, without the local cache: a
/// shadow rule answers OK past its limit, none left, and counts the hit
/// it would have denied as `over_limit` and `shadow_mode`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_shadow_rule_scenario_answers_as_it_does() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let ask = || request(&domain, vec![descriptor(&[("shadow", "value4")])]);
        for i in 1..=16u32 {
            let r = c.decide(ask()).await.unwrap();
            let left = 15u32.saturating_sub(i);
            let what = format!("{mode:?} hit {i}");
            check_all(
                mode,
                &r,
                OK,
                &[status(Code::Ok, 15, Unit::Hour, left)],
                &what,
            );
        }
        // The hit past the limit is over and let through: in both series.
        assert_eq!(stats_of(&domain, "shadow"), [16, 1, 3, 15, 1], "{mode:?}");
    }
}

/// `TestOverLimitWithStopCacheKeyIncrementWhenOverlimitConfig`, without
/// the local cache: two descriptors counted together; once one would go
/// over, the request is over and the other is not counted (as the
/// reference with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT; here always:
/// `docs/migrating.md`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_stop_increment_when_over_limit_scenario_answers_as_it_does() {
    use Code::Ok as OK_;
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let what = format!("{mode:?}");
        let v = fresh("v");
        let (k4, k5) = ([("key4", v.as_str())], [("key5", v.as_str())]);
        let both = |n: u64| request(&domain, vec![costing(&k4, n), costing(&k5, n)]);
        for _ in 0..10 {
            assert_eq!(c.decide(both(1)).await.unwrap().overall_code, OK, "{what}");
        }
        let fifteen = |left| status(OK_, 15, Unit::Hour, left);
        let fourteen = |left| status(OK_, 14, Unit::Hour, left);
        let r = c.decide(both(1)).await.unwrap();
        check_all(mode, &r, OK, &[fifteen(4), fourteen(3)], &what);
        let r = c.decide(both(2)).await.unwrap();
        check_all(mode, &r, OK, &[fifteen(2), fourteen(1)], &what);
        // key5 would go to 15 of 14: over; key4 stays at 13 of 15. The
        // reference counts key5 to 15 and tells 0 left; here the cost
        // that does not fit is denied whole, 1 left (`docs/migrating.md`,
        // "a cost (`hits_addend`) larger than what is left").
        let r = c.decide(both(2)).await.unwrap();
        check(mode, &r.statuses[0], fifteen(2), &what);
        over_with(mode, &r, 14, Unit::Hour, 1, &what);
        // What key4 took goes back a moment after the answer (the same
        // row): a look (`hits_addend` 0) sees it back, then it is spent.
        harness::given_back(&c, &domain, &k4, 2).await;
        let r = c
            .decide(request(&domain, vec![costing(&k4, 2)]))
            .await
            .unwrap();
        check_all(mode, &r, OK, &[fifteen(0)], &what);
    }
}

/// The reference keys a count by its window's start (its cache key ends
/// with `now / unit * unit`, `testRedis`' `domain_key_value_1234`): a
/// new window counts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_new_window_counts_afresh() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let ask = || request(&domain, vec![descriptor(&[("roll", "r")])]);
        // Over within some second (a second boundary in between only
        // starts the count again).
        let mut over = None;
        for _ in 0..1_000 {
            let r = c.decide(ask()).await.unwrap();
            if r.overall_code == OVER {
                over = Some(r);
                break;
            }
        }
        let over = over.unwrap_or_else(|| panic!("{mode:?}: 3 a second never over"));
        let reset = harness::reset_secs(&over, 0);
        assert_eq!(reset, 1, "{mode:?}: a second's window ends within it");
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let r = c.decide(ask()).await.unwrap();
        let what = format!("{mode:?}: the next window");
        check_all(mode, &r, OK, &[status(Code::Ok, 3, Unit::Second, 2)], &what);
    }
}

/// Every status's `duration_until_reset` is the reference's
/// `CalculateReset`: whole seconds to the end of the window,
/// `unit − now % unit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_duration_until_reset_is_whole_seconds_to_the_window_end() {
    for mode in MODES {
        let redis = RedisServer::start();
        let (c, domain) = rules(&redis, mode).await;
        let cases = [
            (&[("key", "value")][..], 1u64),
            (&[("key2", "value2"), ("subkey2", "subvalue2")][..], 60),
            (&[("key3", "value3")][..], 3_600),
            (&[("key3", "value3"), ("subkey3", "subvalue3")][..], 86_400),
        ];
        for (entries, period) in cases {
            let before = now().as_secs();
            let r = c
                .decide(request(&domain, vec![descriptor(entries)]))
                .await
                .unwrap();
            let after = now().as_secs();
            let reset = r.statuses[0].duration_until_reset.expect("a reset");
            assert_eq!(reset.nanos, 0, "{mode:?} {entries:?}");
            let reset = reset.seconds as u64;
            assert!(
                (before..=after).any(|t| reset == period - t % period),
                "{mode:?} {entries:?}: {reset} at {before}..{after}"
            );
        }
    }
}
