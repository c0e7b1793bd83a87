//! Post-hoc rules (`slicelimit: { post_hoc: true }`): costs of work
//! already done, counted whatever is left, asked of the service on a
//! private Redis in the exact and the hybrid-strict mode.

mod rls;
use slicelimit_sim as support;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use rls::{descriptor, in_one_hour, is_ok, modes, request};
use slicelimit_server::service::RateLimiter;
use slicelimit_server::table::Mode;
use support::RedisServer;

const CONFIG: &str = "domain: llm
descriptors:
  - key: tenant
    rate_limit: { unit: hour, requests_per_unit: 1000 }
    slicelimit: { post_hoc: true }
  - key: route
    rate_limit: { unit: hour, requests_per_unit: 100 }
  - key: q
    quota_mode: true
    rate_limit: { unit: hour, requests_per_unit: 100 }
";

async fn service(redis: &RedisServer, mode: Mode) -> RateLimiter {
    rls::service_on(redis, mode, CONFIG).await
}

/// `tenant` charged `hits` (0: only asked), alone.
async fn tenant(service: &RateLimiter, who: &str, hits: u64) -> RateLimitResponse {
    let mut d = descriptor(&[("tenant", who)]);
    d.hits_addend = Some(UInt64Value { value: hits });
    service.decide(request("llm", vec![d])).await.unwrap()
}

/// A charge that does not fit is counted past the limit: the next ask is
/// over, and so is every request until the window ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_past_the_limit_is_counted_and_later_asks_are_over() {
    let redis = RedisServer::start();
    in_one_hour().await;
    for mode in modes() {
        let service = service(&redis, mode).await;
        let who = format!("{mode:?}");
        assert!(is_ok(&tenant(&service, &who, 0).await), "{mode:?}");
        let spent = tenant(&service, &who, 900).await;
        assert!(is_ok(&spent), "{mode:?}: {spent:?}");
        // 100 left: the ask passes, the work then costs 500.
        assert!(is_ok(&tenant(&service, &who, 0).await), "{mode:?}");
        let charged = tenant(&service, &who, 500).await;
        assert_eq!(charged.overall_code, Code::OverLimit as i32, "{mode:?}");
        assert_eq!(charged.statuses[0].limit_remaining, 0, "{mode:?}");
        for _ in 0..3 {
            let asked = tenant(&service, &who, 0).await;
            assert_eq!(asked.overall_code, Code::OverLimit as i32, "{mode:?}");
        }
        // Exact: Redis holds every token charged (hybrid leases some too).
        if mode == Mode::Exact {
            let counted: i64 = redis
                .keys()
                .iter()
                .filter(|k| k.contains("tenant") && k.contains(&who))
                .filter(|k| redis.cmd::<String>(&["TYPE", k]) == "hash")
                .map(|k| {
                    let values: Vec<i64> = redis.cmd(&["HVALS", k]);
                    values.iter().sum::<i64>()
                })
                .sum();
            assert_eq!(counted, 1_400, "{:?}", redis.keys());
        }
    }
    assert_eq!(redis.immortal_keys(), Vec::<String>::new());
}

/// A post-hoc rule over its limit makes the request over, and what the
/// request's other descriptors took goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_post_hoc_rule_denies_and_the_others_keep_their_budget() {
    let redis = RedisServer::start();
    in_one_hour().await;
    for mode in modes() {
        let service = service(&redis, mode).await;
        let who = format!("full-{mode:?}");
        let over = tenant(&service, &who, 1_200).await;
        assert_eq!(over.overall_code, Code::OverLimit as i32, "{mode:?}");
        let mut ask = descriptor(&[("tenant", &who)]);
        ask.hits_addend = Some(UInt64Value { value: 0 });
        let route = descriptor(&[("route", &who)]);
        for _ in 0..5 {
            let both = service
                .decide(request("llm", vec![route.clone(), ask.clone()]))
                .await
                .unwrap();
            assert_eq!(both.overall_code, Code::OverLimit as i32, "{mode:?}");
            assert_eq!(both.statuses[1].code, Code::OverLimit as i32, "{mode:?}");
        }
        // The route's own budget is whole: 100 requests of it alone pass.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let mut passed = 0;
        for _ in 0..120 {
            let alone = service
                .decide(request("llm", vec![route.clone()]))
                .await
                .unwrap();
            passed += usize::from(is_ok(&alone));
        }
        assert_eq!(passed, 100, "{mode:?}");
    }
}

/// Two replicas, asks on one and charges on the other (Envoy's round
/// robin can split them so): the asking replica sees the other's charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_only_asks_sees_what_another_charged() {
    let redis = RedisServer::start();
    in_one_hour().await;
    for mode in modes() {
        let a = service(&redis, mode).await;
        let b = service(&redis, mode).await;
        let who = format!("split-{mode:?}");
        let mut passed = 0;
        for _ in 0..10 {
            if is_ok(&tenant(&a, &who, 0).await) {
                passed += 1;
                tenant(&b, &who, 600).await;
            }
        }
        assert_eq!(passed, 2, "{mode:?}");
    }
}

/// A charge that uses the budget up exactly fits (OK); the next goes
/// past it. Stats split as the reference's: within, near (past 80 %),
/// over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_uses_the_budget_up_exactly_fits() {
    let redis = RedisServer::start();
    in_one_hour().await;
    for mode in modes() {
        let service = service(&redis, mode).await;
        let who = format!("exactly-{mode:?}");
        let codes: Vec<i32> = [
            tenant(&service, &who, 400).await,
            tenant(&service, &who, 600).await,
            tenant(&service, &who, 100).await,
        ]
        .iter()
        .map(|r| r.overall_code)
        .collect();
        let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
        assert_eq!(codes, [ok, ok, over], "{mode:?}");
    }
}

/// Quota-mode descriptors are not charged by a request a post-hoc rule
/// makes over; a request's own `limit` keeps the rule post-hoc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_post_hoc_rule_charges_no_quota_descriptor_and_overrides_stay_post_hoc() {
    let redis = RedisServer::start();
    in_one_hour().await;
    for mode in modes() {
        let service = service(&redis, mode).await;
        let who = format!("quota-{mode:?}");
        tenant(&service, &who, 1_200).await;
        let mut ask = descriptor(&[("tenant", &who)]);
        ask.hits_addend = Some(UInt64Value { value: 0 });
        let q = descriptor(&[("q", &who)]);
        for _ in 0..20 {
            let r = service
                .decide(request("llm", vec![ask.clone(), q.clone()]))
                .await
                .unwrap();
            assert_eq!(r.overall_code, Code::OverLimit as i32, "{mode:?}");
        }
        let mut passed = 0;
        for _ in 0..120 {
            let alone = service
                .decide(request("llm", vec![q.clone()]))
                .await
                .unwrap();
            passed += usize::from(is_ok(&alone));
        }
        assert_eq!(passed, 100, "{mode:?}: the quota descriptor was charged");

        // With its own limit (1,000 an hour), the rule still counts every hit.
        let with_limit = |hits: u64| {
            let mut d = descriptor(&[("tenant", &format!("own-{who}"))]);
            d.hits_addend = Some(UInt64Value { value: hits });
            d.limit = Some(
                envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
                    requests_per_unit: 1_000,
                    unit: envoy_types::pb::envoy::r#type::v3::RateLimitUnit::Hour as i32,
                },
            );
            request("llm", vec![d])
        };
        let charged = service.decide(with_limit(1_500)).await.unwrap();
        assert_eq!(charged.overall_code, Code::OverLimit as i32, "{mode:?}");
        let asked = service.decide(with_limit(0)).await.unwrap();
        assert_eq!(
            asked.overall_code,
            Code::OverLimit as i32,
            "{mode:?}: the charge was lost"
        );
    }
}
