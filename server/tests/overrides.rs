//! Requests' own `limit`s and the reference's descriptor fields under
//! attack: overrides on every algorithm, across reloads, under eviction
//! and at random; quota, shadow and blocked descriptors in every
//! combination; detailed series across reloads; two replicas rotating
//! overrides. Each of these once found a way past a limit, a permit
//! stranded or a bound that reset (see CHANGELOG).

mod rls;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use rls::{descriptor, is_ok, request};
use slicelimit::{FailurePolicy, MemoryStore};
use slicelimit_server::config::Config;
use slicelimit_server::service::RateLimiter;
use slicelimit_server::table::{Mode, Settings, Table};

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;
const MINUTE: i32 = Unit::Minute as i32;
const HOUR: i32 = Unit::Hour as i32;

struct Svc {
    service: RateLimiter,
    table: Arc<ArcSwap<Table>>,
    settings: Settings,
}

fn settings(mode: Mode) -> Settings {
    Settings {
        store: MemoryStore::new().into(),
        mode,
        on_store_error: FailurePolicy::FailOpen,
        merge_domains: false,
    }
}

fn svc(rules: &str, mode: Mode) -> Svc {
    let settings = settings(mode);
    let config = Config::parse("rules.yaml", rules).expect("parses");
    let (table, _) = Table::build(vec![config], &settings, None).expect("builds");
    let table = Arc::new(ArcSwap::from_pointee(table));
    let service = RateLimiter::new(table.clone(), settings.clone());
    Svc {
        service,
        table,
        settings,
    }
}

impl Svc {
    fn reload(&self, rules: &str) {
        let config = Config::parse("rules.yaml", rules).expect("parses");
        let old = self.table.load_full();
        let (table, _) = Table::build(vec![config], &self.settings, Some(&old)).expect("builds");
        self.table.store(Arc::new(table));
    }
    async fn ask(&self, r: RateLimitRequest) -> RateLimitResponse {
        self.service.decide(r).await.expect("no error")
    }
}

fn with_limit(entries: &[(&str, &str)], requests_per_unit: u32, unit: i32) -> RateLimitDescriptor {
    let mut d = descriptor(entries);
    d.limit = Some(RateLimitOverride {
        requests_per_unit,
        unit,
    });
    d
}

fn codes(r: &RateLimitResponse) -> Vec<i32> {
    r.statuses.iter().map(|s| s.code).collect()
}

// ---------------------------------------------------------------------
// 1. A reload that changes the rule's unit: the override of the rule's
//    (new) period should share the rule's count. Does it?
#[tokio::test]
async fn unit_reload_override_shares_rule_count() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let s = svc(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n",
            mode,
        );
        // Touch the rule and an override before the reload.
        s.ask(request(
            "d",
            vec![with_limit(&[("user", "warm")], 3, MINUTE)],
        ))
        .await;
        s.reload(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 3 }\n",
        );
        let mut admitted = 0;
        for _ in 0..3 {
            admitted += usize::from(is_ok(
                &s.ask(request("d", vec![descriptor(&[("user", "u")])]))
                    .await,
            ));
        }
        for _ in 0..3 {
            admitted += usize::from(is_ok(
                &s.ask(request("d", vec![with_limit(&[("user", "u")], 3, HOUR)]))
                    .await,
            ));
        }
        eprintln!(
            "{mode:?}: unit reload: admitted {admitted} (3/hour rule + 3/hour override, one count)"
        );
        assert_eq!(admitted, 3, "{mode:?}: one count of 3 an hour");
    }
}

// 2. A reload changing the rule's algorithm: a live override limiter of
//    the old algorithm is still handed out.
#[tokio::test]
async fn algorithm_reload_override_shares_rule_count() {
    for warm in [false, true] {
        for mode in [Mode::Exact, Mode::HybridStrict] {
            let s = svc(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n",
            mode,
        );
            if warm {
                s.ask(request(
                    "d",
                    vec![with_limit(&[("user", "warm")], 3, MINUTE)],
                ))
                .await;
            }
            s.reload(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n    slicelimit: { algorithm: sliding_window }\n",
        );
            let mut admitted = 0;
            for _ in 0..3 {
                admitted += usize::from(is_ok(
                    &s.ask(request("d", vec![descriptor(&[("user", "u")])]))
                        .await,
                ));
            }
            for _ in 0..3 {
                admitted += usize::from(is_ok(
                    &s.ask(request("d", vec![with_limit(&[("user", "u")], 3, MINUTE)]))
                        .await,
                ));
            }
            eprintln!("{mode:?} warm {warm}: algorithm reload: admitted {admitted}");
            assert!(
                admitted <= 3,
                "{mode:?} warm {warm}: {admitted} under one count of 3"
            );
            if mode == Mode::Exact {
                assert_eq!(admitted, 3, "warm {warm}");
            }
        }
    }
}

// 3. Fuzz what a descriptor can carry: no error, no panic.
#[tokio::test]
async fn override_fuzz_never_errors() {
    let rules = "domain: d\ndescriptors:\n  - key: fw\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n  - key: sw\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n    slicelimit: { algorithm: sliding_window }\n  - key: tb\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n    slicelimit: { algorithm: token_bucket }\n  - key: gc\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n    slicelimit: { algorithm: gcra }\n  - key: yr\n    rate_limit: { unit: year, requests_per_unit: 3 }\n    slicelimit: { algorithm: gcra }\n  - key: wk\n    rate_limit: { unit: week, requests_per_unit: 3 }\n  - key: un\n    rate_limit: { unlimited: true }\n  - key: bl\n    rate_limit: { unit: minute, requests_per_unit: 0 }\n  - key: sh\n    shadow_mode: true\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n  - key: qm\n    quota_mode: true\n    rate_limit: { unit: second, requests_per_unit: 3 }\n";
    for mode in [Mode::Exact, Mode::HybridStrict, Mode::HybridOptimistic] {
        let s = svc(rules, mode);
        let keys = [
            "fw", "sw", "tb", "gc", "yr", "wk", "un", "bl", "sh", "qm", "", "none",
        ];
        let units = [
            -5i32,
            -1,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            100,
            i32::MAX,
            i32::MIN,
        ];
        let rpus = [0u32, 1, 2, 3, 1000, 1 << 31, u32::MAX - 1, u32::MAX];
        let costs: [Option<u64>; 5] = [
            None,
            Some(0),
            Some(1),
            Some(u64::from(u32::MAX) + 1),
            Some(u64::MAX),
        ];
        let mut n = 0;
        for key in keys {
            for unit in units {
                for rpu in rpus {
                    for cost in costs {
                        for value in ["", "v", "*"] {
                            let mut d = with_limit(&[(key, value)], rpu, unit);
                            d.hits_addend = cost.map(|c| UInt64Value { value: c });
                            // twice, and alongside a plain one and a duplicate
                            let r = s
                                .service
                                .decide(request(
                                    "d",
                                    vec![d.clone(), d.clone(), descriptor(&[(key, value)])],
                                ))
                                .await;
                            assert!(
                                r.is_ok(),
                                "{mode:?} key {key:?} unit {unit} rpu {rpu} cost {cost:?}: {r:?}"
                            );
                            n += 1;
                        }
                    }
                }
            }
        }
        // Empty-entry descriptor with an override; huge hits on request.
        let d = RateLimitDescriptor {
            limit: Some(RateLimitOverride {
                requests_per_unit: 1,
                unit: MINUTE,
            }),
            ..Default::default()
        };
        let mut r = request("d", vec![d.clone(), d]);
        r.hits_addend = u32::MAX;
        assert!(s.service.decide(r).await.is_ok());
        eprintln!(
            "{mode:?}: {n} fuzz requests, none refused; live {}",
            s.service.overrides_live("d")
        );
    }
}

// 4. An unknown unit on a limited rule falls back: never unlimited.
#[tokio::test]
async fn unknown_unit_never_unlimited() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let s = svc(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 3 }\n  - key: tb\n    rate_limit: { unit: second, requests_per_unit: 3 }\n    slicelimit: { algorithm: token_bucket }\n",
            mode,
        );
        for (key, unit, rpu) in [
            ("user", 0, 100),
            ("user", 42, 100),
            ("user", -1, 100),
            ("user", 7, 100),
            ("tb", 6, 1),
            ("tb", 6, u32::MAX),
            ("tb", 5, 1),
        ] {
            let value = format!("k{unit}{rpu}");
            let mut admitted = 0;
            for _ in 0..10 {
                admitted += usize::from(is_ok(
                    &s.ask(request("d", vec![with_limit(&[(key, &value)], rpu, unit)]))
                        .await,
                ));
            }
            eprintln!("{mode:?}: {key} unit {unit} rpu {rpu}: {admitted}/10");
            assert!(
                admitted <= 3,
                "{mode:?}: {key} unit {unit}: {admitted} past the rule's 3"
            );
        }
    }
}

// 5. Rotating overrides (more than MAX_OVERRIDES), concurrently, on one
//    count: never past the largest limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rotating_overrides_concurrent_bound() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let s = Arc::new(svc(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 5 }\n",
            mode,
        ));
        let admitted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for t in 0..16u32 {
            let s = s.clone();
            let admitted = admitted.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..200u32 {
                    // limits 1..=300 per hour, scrambled: 300 > 256 limiters
                    let limit = 1 + ((t * 200 + i) * 7919) % 300;
                    for key in ["user", "other"] {
                        let d = with_limit(&[(key, "shared")], limit, HOUR);
                        if is_ok(&s.ask(request("d", vec![d])).await) {
                            admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let n = admitted.load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "{mode:?}: rotating: admitted {n} of 6400 (2 keys, largest limit 300 each => <= 600)"
        );
        assert!(n <= 600, "{mode:?}: admitted {n}");
        assert!(s.service.overrides_live("d") <= 256);
    }
}

// 6. Denied requests give back what their override took, even while
//    limiters are being evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn denied_requests_give_back_under_eviction() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let s = Arc::new(svc(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 5 }\n  - key: wall\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n",
            mode,
        ));
        // Spend the wall.
        assert!(is_ok(
            &s.ask(request("d", vec![descriptor(&[("wall", "w")])]))
                .await
        ));
        let mut tasks = Vec::new();
        for t in 0..8u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let mut oks = 0;
                for i in 0..300u32 {
                    let limit = 100 + ((t * 300 + i) * 7919) % 400;
                    let d = with_limit(&[("user", "victim")], limit, HOUR);
                    let r = s
                        .ask(request("d", vec![d, descriptor(&[("wall", "w")])]))
                        .await;
                    oks += usize::from(is_ok(&r));
                }
                oks
            }));
        }
        let mut oks = 0;
        for t in tasks {
            oks += t.await.unwrap();
        }
        assert_eq!(oks, 0);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // Nothing kept: an override of 100/hour admits 100.
        let mut admitted = 0;
        for _ in 0..120 {
            admitted += usize::from(is_ok(
                &s.ask(request(
                    "d",
                    vec![with_limit(&[("user", "victim")], 100, HOUR)],
                ))
                .await,
            ));
        }
        eprintln!("{mode:?}: after 2400 denied requests, a 100/hour override admits {admitted}");
        if mode == Mode::Exact {
            assert_eq!(admitted, 100, "{mode:?}");
        } else {
            assert!((90..=100).contains(&admitted), "{mode:?}: {admitted}");
        }
    }
}

// 7. quota_mode / shadow / blocked / override combinations.
#[derive(Clone, Copy, Debug, PartialEq)]
enum K {
    E,
    Ex,
    Q,
    Qx,
    S,
    Sx,
    Sq,
    Eb,
    Qb,
    O,
    Ox,
    O0,
}

const MATRIX: &str = "domain: m\ndescriptors:\n  - key: e\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n  - key: q\n    quota_mode: true\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n  - key: s\n    shadow_mode: true\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n  - key: sq\n    shadow_mode: true\n    quota_mode: true\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n  - key: eb\n    rate_limit: { unit: hour, requests_per_unit: 0 }\n  - key: qb\n    quota_mode: true\n    rate_limit: { unit: hour, requests_per_unit: 0 }\n";

#[tokio::test]
async fn quota_shadow_matrix() {
    matrix(false).await
}
#[tokio::test]
async fn quota_shadow_matrix_global_quota() {
    matrix(true).await
}

async fn matrix(global: bool) {
    use K::*;
    let kinds = [E, Ex, Q, Qx, S, Sx, Sq, Eb, Qb, O, Ox, O0];
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let mut s = svc(MATRIX, mode);
        s.service = s.service.clone().quota_everything(global);
        let mut combos: Vec<Vec<K>> = Vec::new();
        for a in kinds {
            combos.push(vec![a]);
            for b in kinds {
                combos.push(vec![a, b]);
                for c in kinds {
                    combos.push(vec![a, b, c]);
                }
            }
        }
        let mut failures = Vec::new();
        let mut checks: Vec<(String, String, bool, String)> = Vec::new();
        for (ci, combo) in combos.iter().enumerate() {
            let mut ds = Vec::new();
            let mut quota_total = 0;
            let mut quota_over = 0;
            let mut enforced_over = false;
            for (i, k) in combo.iter().enumerate() {
                let v = format!("c{ci}d{i}");
                let (key, exhaust, over, class) = match k {
                    E => ("e", false, false, 'e'),
                    Ex => ("e", true, true, 'e'),
                    Q => ("q", false, false, 'q'),
                    Qx => ("q", true, true, 'q'),
                    S => ("s", false, false, 's'),
                    Sx => ("s", true, true, 's'),
                    Sq => ("sq", true, true, 's'),
                    Eb => ("eb", false, true, 'e'),
                    Qb => ("qb", false, true, 'q'),
                    O => ("e", false, false, 'e'),
                    Ox => ("e", true, true, 'e'),
                    O0 => ("q", false, true, 'e'),
                };
                if exhaust {
                    s.ask(request("m", vec![descriptor(&[(key, &v)])])).await;
                }
                let d = match k {
                    O | Ox => with_limit(&[(key, &v)], 1, HOUR),
                    O0 => with_limit(&[(key, &v)], 0, HOUR),
                    _ => descriptor(&[(key, &v)]),
                };
                ds.push(d);
                let class = if global && class == 'e' { 'q' } else { class };
                match class {
                    'e' => enforced_over |= over,
                    'q' => {
                        quota_total += 1;
                        quota_over += usize::from(over);
                    }
                    _ => {}
                }
            }
            let expect_over = enforced_over || (quota_total > 0 && quota_over == quota_total);
            let r = s.ask(request("m", ds)).await;
            if is_ok(&r) == expect_over {
                failures.push(format!(
                    "{combo:?}: got {:?} codes {:?}",
                    r.overall_code,
                    codes(&r)
                ));
            }
            // what should have been consumed
            for (i, k) in combo.iter().enumerate() {
                let v = format!("c{ci}d{i}");
                let key = match k {
                    E | O => "e",
                    Q => "q",
                    _ => continue,
                };
                checks.push((key.to_owned(), v, !expect_over, format!("{combo:?}")));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        for (key, v, consumed, combo) in checks {
            let r = s.ask(request("m", vec![descriptor(&[(&key, &v)])])).await;
            let was_consumed = r.statuses[0].code == OVER;
            if was_consumed != consumed {
                failures.push(format!(
                    "{mode:?} {combo}: {key}={v} consumed {was_consumed}, expected {consumed}"
                ));
            }
        }
        eprintln!(
            "global {global} {mode:?}: {} combos, {} failures",
            combos.len(),
            failures.len()
        );
        let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
        for f in &failures {
            *kinds
                .entry(
                    f.split(": ")
                        .nth(1)
                        .unwrap_or("")
                        .split('=')
                        .next()
                        .unwrap_or("")
                        .to_owned()
                        + " | "
                        + f.split(']').next().unwrap_or(""),
                )
                .or_default() += 1;
        }
        for f in failures.iter().take(200) {
            eprintln!("  {f}");
        }
        assert!(
            failures.is_empty(),
            "global {global} {mode:?}: {} failures",
            failures.len()
        );
    }
}

// 8. Hybrid: one count fragmented across override limiters' leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hybrid_override_leases_starve() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let s = svc(
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 100 }\n",
            mode,
        );
        // One plain request, then a 100/hour override: 99 should pass.
        s.ask(request("d", vec![descriptor(&[("user", "a")])]))
            .await;
        let mut n = 0;
        for _ in 0..120 {
            n += usize::from(is_ok(
                &s.ask(request("d", vec![with_limit(&[("user", "a")], 100, HOUR)]))
                    .await,
            ));
        }
        eprintln!("{mode:?}: rule used once, then 100/hour override admits {n} (99 expected)");
        assert!((90..=99).contains(&n), "{mode:?}: {n}");
        // 20 requests under 20 distinct limits 200..219 (20 used), then 300/hour: 280 expected.
        for i in 0..20u32 {
            s.ask(request(
                "d",
                vec![with_limit(&[("user", "b")], 200 + i, HOUR)],
            ))
            .await;
        }
        let mut n = 0;
        for _ in 0..300 {
            n += usize::from(is_ok(
                &s.ask(request("d", vec![with_limit(&[("user", "b")], 300, HOUR)]))
                    .await,
            ));
        }
        eprintln!("{mode:?}: 20 used under 20 limits, then 300/hour admits {n} (280 expected)");
        assert!((270..=280).contains(&n), "{mode:?}: {n}");
        for wait in [1u64, 5, 10] {
            tokio::time::sleep(Duration::from_secs(wait)).await;
            let r = s
                .ask(request("d", vec![with_limit(&[("user", "b")], 300, HOUR)]))
                .await;
            eprintln!(
                "{mode:?}: after +{wait}s: {:?} remaining {}",
                codes(&r),
                r.statuses[0].limit_remaining
            );
        }
    }
}

// R1: a blocked descriptor (rule of 0, or override of 0) denies the
// request, but quota-mode descriptors keep what they took.
#[tokio::test]
async fn repro_quota_counted_when_blocked_denies() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let s = svc(MATRIX, mode);
        let r = s
            .ask(request(
                "m",
                vec![
                    descriptor(&[("q", "a")]),
                    with_limit(&[("x", "y")], 0, HOUR),
                ],
            ))
            .await;
        assert_eq!(r.overall_code, OVER);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let alone = s.ask(request("m", vec![descriptor(&[("q", "a")])])).await;
        eprintln!("R1 {mode:?}: denied [q, override 0]; then q alone: {:?} (expected OK: nothing counted)", codes(&alone));
        let r = s
            .ask(request(
                "m",
                vec![descriptor(&[("q", "b")]), descriptor(&[("eb", "x")])],
            ))
            .await;
        assert_eq!(r.overall_code, OVER);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let alone = s.ask(request("m", vec![descriptor(&[("q", "b")])])).await;
        eprintln!(
            "R1 {mode:?}: denied [q, eb(rule of 0)]; then q alone: {:?}",
            codes(&alone)
        );
    }
}

// R2: hybrid: a denied request's override permit goes back to the
// override limiter's lease, and the rule's own requests stay denied.
#[tokio::test]
async fn repro_override_refund_stranded() {
    for mode in [Mode::Exact, Mode::HybridStrict] {
        let s = svc(MATRIX, mode);
        s.ask(request("m", vec![descriptor(&[("e", "spent")])]))
            .await;
        let r = s
            .ask(request(
                "m",
                vec![
                    descriptor(&[("e", "spent")]),
                    with_limit(&[("e", "v")], 1, HOUR),
                ],
            ))
            .await;
        assert_eq!(r.overall_code, OVER);
        for wait in [300u64, 2000, 10000, 30000] {
            tokio::time::sleep(Duration::from_millis(wait)).await;
            let alone = s.ask(request("m", vec![descriptor(&[("e", "v")])])).await;
            eprintln!(
                "R2 {mode:?}: +{wait}ms: e=v alone (rule 1/hour, never admitted): {:?}",
                codes(&alone)
            );
            if alone.overall_code == OK {
                break;
            }
        }
    }
}

// P1: two replicas, one Redis: rotating overrides never admit past the
// largest; junk overrides never refused; the log stays short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_two_replicas_rotating_overrides() {
    use slicelimit_sim::RedisServer;
    let redis = RedisServer::start();
    let dir = rls::scratch("attack");
    let path = dir.join("d.yaml");
    rls::write_config(&path, "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 5 }\n  - key: wall\n    rate_limit: { unit: hour, requests_per_unit: 0 }\n");
    for mode in ["hybrid-strict", "exact"] {
        let flags = [
            "--redis-url",
            &redis.url(),
            "--mode",
            mode,
            "--response-headers",
            "true",
        ];
        let a = rls::RlsServer::start(&path, &flags);
        let b = rls::RlsServer::start(&path, &flags);
        let clients = [a.client().await, b.client().await];
        let admitted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let errors = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for w in 0..8u32 {
            let mut c = clients[(w % 2) as usize].clone();
            let admitted = admitted.clone();
            let errors = errors.clone();
            let user = format!("x-{mode}");
            tasks.push(tokio::spawn(async move {
                for i in 0..250u32 {
                    let limit = 1 + ((w * 250 + i) * 7919) % 300;
                    let d = with_limit(&[("user", &user)], limit, HOUR);
                    match c.should_rate_limit(request("d", vec![d])).await {
                        Ok(r) => {
                            if is_ok(&r.into_inner()) {
                                admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        Err(_) => {
                            errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                    // junk: bad units, zero, huge cost, empty entries, distinct values
                    let mut junk = with_limit(
                        &[("user", &format!("j{w}-{i}")), ("", "")],
                        u32::MAX - i,
                        (i as i32 % 12) - 3,
                    );
                    junk.hits_addend = Some(UInt64Value {
                        value: u64::MAX - u64::from(i),
                    });
                    let empty = RateLimitDescriptor {
                        limit: Some(RateLimitOverride {
                            requests_per_unit: i,
                            unit: 1 + (i as i32 % 6),
                        }),
                        ..Default::default()
                    };
                    match c
                        .should_rate_limit(request(
                            "d",
                            vec![junk, empty, with_limit(&[("zz", &i.to_string())], i % 3, 2)],
                        ))
                        .await
                    {
                        Ok(_) => {}
                        Err(_) => {
                            errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let n = admitted.load(std::sync::atomic::Ordering::Relaxed);
        let e = errors.load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "P1 {mode}: admitted {n} of 2000 under limits 1..=300/hour on one count; {e} errors"
        );
        eprintln!(
            "P1 {mode}: log a {} lines, b {} lines:\n{}",
            a.log().lines().count(),
            b.log().lines().count(),
            a.log()
        );
        eprintln!(
            "P1 {mode}: overrides live a: {}",
            a.metric("slicelimit_server_overrides_live", "{domain=\"d\"}")
        );
        assert!(n <= 300);
        assert_eq!(e, 0);
    }
}

// P2: detailed_metric series bound across reloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_detailed_series_across_reloads() {
    let dir = rls::scratch("attack-detailed");
    let path = dir.join("d.yaml");
    let text = |n: usize| {
        format!("# version {n}\ndomain: d\ndescriptors:\n  - key: user\n    detailed_metric: true\n    rate_limit: {{ unit: hour, requests_per_unit: 5 }}\n")
    };
    rls::write_config(&path, &text(0));
    let a = rls::RlsServer::start(&path, &["--mode", "exact"]);
    let mut c = a.client().await;
    for round in 0..4usize {
        for i in 0..150 {
            c.should_rate_limit(request(
                "d",
                vec![descriptor(&[("user", &format!("r{round}-{i}"))])],
            ))
            .await
            .unwrap();
        }
        rls::write_config(&path, &text(round + 1));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (_, body) = a.get("/metrics").unwrap();
        let series = body
            .lines()
            .filter(|l| l.starts_with("slicelimit_server_total_hits_total{"))
            .count();
        eprintln!("P2: after round {round} (+ reload): {series} total_hits series (bound: 100 + 1 per rule)");
        assert!(series <= 110, "round {round}: {series} series");
    }
}

// A1: a big override on a bucket/gcra/sliding rule: does the rule's own
// limit still hold for plain requests on the same key?
#[tokio::test]
async fn big_override_then_plain_requests() {
    for algo in ["fixed_window", "sliding_window", "token_bucket", "gcra"] {
        for mode in [Mode::Exact, Mode::HybridStrict] {
            let s = svc(
                &format!("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: minute, requests_per_unit: 10 }}\n    slicelimit: {{ algorithm: {algo} }}\n"),
                mode,
            );
            let mut o = 0;
            for _ in 0..3 {
                o += usize::from(is_ok(
                    &s.ask(request(
                        "d",
                        vec![with_limit(&[("user", "u")], 1_000_000, MINUTE)],
                    ))
                    .await,
                ));
            }
            let mut plain = 0;
            for _ in 0..100 {
                plain += usize::from(is_ok(
                    &s.ask(request("d", vec![descriptor(&[("user", "u")])]))
                        .await,
                ));
            }
            // and the other way: small override after plain use
            let mut small = 0;
            for _ in 0..10 {
                small += usize::from(is_ok(
                    &s.ask(request("d", vec![with_limit(&[("user", "v")], 3, MINUTE)]))
                        .await,
                ));
            }
            eprintln!("A1 {algo} {mode:?}: {o} under 1e6/min override, then plain (10/min) admitted {plain} (<= 7 expected); 3/min override admits {small}");
            assert!(plain <= 10, "{algo} {mode:?}: {plain} past the rule's 10");
        }
    }
}

// A2: interleave one big override request with plain requests on a
// token-bucket rule: do plain requests pass the rule's 10/minute?
#[tokio::test]
async fn interleaved_big_override_refills_bucket() {
    for algo in ["fixed_window", "token_bucket", "gcra", "sliding_window"] {
        for mode in [Mode::Exact, Mode::HybridStrict] {
            let s = svc(
                &format!("domain: d\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: minute, requests_per_unit: 10 }}\n    slicelimit: {{ algorithm: {algo} }}\n"),
                mode,
            );
            let start = std::time::Instant::now();
            let mut plain = 0;
            let mut big = 0;
            for _ in 0..100 {
                tokio::time::sleep(Duration::from_millis(10)).await;
                big += usize::from(is_ok(
                    &s.ask(request(
                        "d",
                        vec![with_limit(&[("user", "u")], 1_000_000, MINUTE)],
                    ))
                    .await,
                ));
                for _ in 0..10 {
                    plain += usize::from(is_ok(
                        &s.ask(request("d", vec![descriptor(&[("user", "u")])]))
                            .await,
                    ));
                }
            }
            eprintln!("A2 {algo} {mode:?}: in {:?}: {big} big-override requests, plain (rule 10/min) admitted {plain}", start.elapsed());
            assert!(plain <= 10, "{algo} {mode:?}: {plain} past the rule's 10");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hybrid_starvation_recovery() {
    let s = Arc::new(svc(
        "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 5 }\n",
        Mode::HybridStrict,
    ));
    // 300 requests, each under its own limit 100..399 per hour: 300 used at most.
    let mut used = 0;
    for i in 0..300u32 {
        used += usize::from(is_ok(
            &s.ask(request(
                "d",
                vec![with_limit(&[("user", "v")], 100 + i, HOUR)],
            ))
            .await,
        ));
    }
    for wait in [0u64, 2, 10, 30] {
        tokio::time::sleep(Duration::from_secs(wait)).await;
        let mut n = 0;
        for _ in 0..50 {
            n += usize::from(is_ok(
                &s.ask(request("d", vec![with_limit(&[("user", "v")], 1000, HOUR)]))
                    .await,
            ));
        }
        eprintln!("starve: {used} admitted under 100..399; +{wait}s: a 1000/hour override admits {n} of 50 (room: {})", 1000 - used);
        assert_eq!(n, 50usize.min(1000 - used), "room left: {}", 1000 - used);
    }
}

#[tokio::test]
async fn repro_token_bucket_override_refills_rule() {
    let s = svc(
        "domain: d\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 10 }\n    slicelimit: { algorithm: token_bucket }\n",
        Mode::Exact,
    );
    let mut plain = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        s.ask(request(
            "d",
            vec![with_limit(&[("user", "u")], 1_000_000, MINUTE)],
        ))
        .await;
        for _ in 0..10 {
            plain += usize::from(is_ok(
                &s.ask(request("d", vec![descriptor(&[("user", "u")])]))
                    .await,
            ));
        }
    }
    assert!(
        plain <= 11,
        "plain requests under a 10/minute rule: {plain} admitted in ~1 s"
    );
}
