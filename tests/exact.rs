//! The exact limiters against real, private Redis servers.

use slicelimit_sim as support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slicelimit::{
    clock::FakeClock, nonzero, Algorithm, FailurePolicy, Limiter, MemoryStore, Quota, Source,
};
use support::{store, RedisServer};

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
];

/// 100 per day: refill during a test run is far below one permit, and a
/// run crossing a window boundary is detected and retried.
fn daily(limit: u64) -> Quota {
    Quota::new(limit, Duration::from_secs(86_400)).unwrap()
}

async fn exact(server: &RedisServer, quota: Quota, algorithm: Algorithm, ns: &str) -> Limiter {
    Limiter::builder(quota)
        .store(store(server).await)
        .algorithm(algorithm)
        .namespace(ns)
        .exact()
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_8_limiters_64_tasks_admit_exactly_the_limit() {
    let server = RedisServer::start();
    for algorithm in ALGORITHMS {
        let quota = daily(100).with_burst(nonzero!(100));
        let mut limiters = Vec::new();
        for _ in 0..8 {
            limiters.push(exact(&server, quota, algorithm, "race").await);
        }
        for round in 0..20 {
            let key = format!("{}-{round}", algorithm.as_str());
            let admitted = Arc::new(AtomicU64::new(0));
            let mut tasks = Vec::new();
            for t in 0..64 {
                let limiter = limiters[t % 8].clone();
                let key = key.clone();
                let admitted = admitted.clone();
                tasks.push(tokio::spawn(async move {
                    for _ in 0..3 {
                        let d = limiter.try_check(&key, 1).await.expect("store answers");
                        if d.is_allowed() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            assert_eq!(
                admitted.load(Ordering::Relaxed),
                100,
                "{algorithm:?} round {round}"
            );
        }
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

#[tokio::test]
async fn every_key_written_has_a_ttl() {
    let server = RedisServer::start();
    for algorithm in ALGORITHMS {
        for quota in [
            Quota::per_second(nonzero!(5)),
            Quota::per_minute(nonzero!(100)).with_burst(nonzero!(10)),
            daily(3),
        ] {
            let limiter = exact(&server, quota, algorithm, "ttl").await;
            for i in 0..20 {
                limiter
                    .try_check(&format!("k{}", i % 4), 1 + i % 3)
                    .await
                    .unwrap();
            }
            limiter.try_check("", 1).await.unwrap();
            limiter.try_check(&"big".repeat(10_000), 1).await.unwrap();
        }
    }
    let keys = server.keys();
    assert_eq!(keys.len(), ALGORITHMS.len() * 6, "{keys:?}");
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

#[tokio::test]
async fn windows_follow_the_redis_clock_not_the_local_one() {
    let server = RedisServer::start();
    let quota = Quota::new(10, Duration::from_secs(60)).unwrap();
    let make = |clock: FakeClock| {
        let server_url = server.url();
        async move {
            Limiter::builder(quota)
                .store(
                    slicelimit::RedisStore::connect_with(&server_url, support::test_options())
                        .await
                        .unwrap(),
                )
                .clock(clock)
                .build()
                .unwrap()
        }
    };
    let a = make(FakeClock::new(Duration::from_secs(1_000_000))).await;
    let b = make(FakeClock::new(Duration::from_secs(1_000_030))).await;
    // Stay clear of a window boundary (decided by Redis' clock).
    let peek = a.try_check("k", 0).await.unwrap();
    if peek.reset_after() < Duration::from_secs(5) {
        tokio::time::sleep(peek.reset_after() + Duration::from_millis(100)).await;
    }
    let mut admitted = 0;
    for i in 0..30 {
        let limiter = if i % 2 == 0 { &a } else { &b };
        if limiter.try_check("k", 1).await.unwrap().is_allowed() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10);
    let ra = a.try_check("k", 0).await.unwrap().reset_after();
    let rb = b.try_check("k", 0).await.unwrap().reset_after();
    let gap = ra.abs_diff(rb);
    assert!(
        gap < Duration::from_secs(1),
        "window ends disagree by {gap:?}"
    );
}

#[tokio::test]
async fn scripts_are_reloaded_after_script_flush() {
    let server = RedisServer::start();
    for algorithm in ALGORITHMS {
        let limiter = exact(&server, daily(10), algorithm, "flush").await;
        assert!(limiter.try_check("k", 1).await.unwrap().is_allowed());
        let _: String = server.cmd(&["SCRIPT", "FLUSH"]);
        let before = limiter.stats();
        let d = limiter
            .try_check("k", 1)
            .await
            .expect("reloaded transparently");
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 8);
        // NOSCRIPT, SCRIPT LOAD, the call again: three round trips for
        // one script call.
        let after = limiter.stats();
        assert_eq!(after.round_trips - before.round_trips, 3);
        assert_eq!(after.store_calls - before.store_calls, 1);
    }
}

#[tokio::test]
async fn a_key_of_the_wrong_type_is_a_classified_error_and_a_policy_decision() {
    let server = RedisServer::start();
    for algorithm in ALGORITHMS {
        let ns = format!("wt-{}", algorithm.as_str());
        let limiter = exact(&server, daily(10), algorithm, &ns).await;
        limiter.try_check("victim", 1).await.unwrap();
        let key = server
            .keys()
            .into_iter()
            .find(|k| k.contains(&ns))
            .expect("the limiter wrote a key");
        let _: i64 = server.cmd(&["DEL", &key]);
        // Every algorithm keeps a hash: a string is the wrong type.
        let _: String = server.cmd(&["SET", &key, "not a hash"]);
        let err = limiter.try_check("victim", 1).await.unwrap_err();
        assert!(err.is_wrong_type(), "{algorithm:?}: {err}");

        let closed = limiter.check("victim", 1).await;
        assert!(!closed.is_allowed());
        assert_eq!(closed.source(), Source::FailClosed);
        assert!(closed.retry_after().is_some());

        let open = Limiter::builder(daily(10))
            .store(store(&server).await)
            .algorithm(algorithm)
            .namespace(&ns)
            .on_store_error(FailurePolicy::FailOpen)
            .build()
            .unwrap();
        let d = open.check("victim", 1).await;
        assert!(d.is_allowed());
        assert_eq!(d.source(), Source::FailOpen);
        assert_eq!(open.stats().store_errors, 1);
    }
}

#[tokio::test]
async fn odd_inputs_get_defined_decisions() {
    let server = RedisServer::start();
    for algorithm in ALGORITHMS {
        let limiter = exact(
            &server,
            daily(10).with_burst(nonzero!(10)),
            algorithm,
            "odd",
        )
        .await;
        // cost 0 peeks without consuming
        let d = limiter.try_check("k", 0).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 10);
        assert_eq!(limiter.try_check("k", 0).await.unwrap().remaining(), 10);
        // cost above the limit: denied, never admissible, nothing consumed
        let d = limiter.try_check("k", 11).await.unwrap();
        assert!(!d.is_allowed());
        assert_eq!(d.retry_after(), None);
        assert_eq!(limiter.try_check("k", 10).await.unwrap().remaining(), 0);
        // cost at the limit but nothing left: denied with a finite wait
        let d = limiter.try_check("k", 10).await.unwrap();
        assert!(!d.is_allowed());
        assert!(d.retry_after().is_some());
        // the empty key is a key of its own
        assert!(limiter.try_check("", 4).await.unwrap().is_allowed());
        assert_eq!(limiter.try_check("", 0).await.unwrap().remaining(), 6);
        // a 1 MB key works and is stored under a short hashed name
        let huge = "k".repeat(1 << 20);
        assert!(limiter.try_check(&huge, 1).await.unwrap().is_allowed());
        assert_eq!(limiter.try_check(&huge, 0).await.unwrap().remaining(), 9);
    }
    assert!(server.keys().iter().all(|k| k.len() < 120));
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

#[test]
fn invalid_quotas_are_rejected_at_build() {
    // A zero limit or burst does not compile (`nonzero!(0)`); the checked
    // constructor rejects what is out of range.
    assert!(Quota::new(0, Duration::from_secs(1)).is_err());
    assert!(Quota::new(5, Duration::ZERO).is_err());
    assert!(Quota::new(5, Duration::from_micros(10)).is_err());
    let year = Duration::from_secs(366 * 24 * 3600);
    let slow = Quota::new(1, year).unwrap().with_burst(nonzero!(1_000_000));
    let err = Limiter::builder(slow)
        .store(MemoryStore::new())
        .algorithm(Algorithm::Gcra)
        .build()
        .unwrap_err();
    assert!(err.is_invalid_input(), "{err}");
    let err = Limiter::builder(Quota::per_second(nonzero!(5)))
        .store(MemoryStore::new())
        .algorithm(Algorithm::TokenBucket)
        .on_store_error(FailurePolicy::LocalFallback(slow))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("LocalFallback"), "{err}");
    let err = Limiter::builder(Quota::per_second(nonzero!(5)))
        .store(MemoryStore::new())
        .namespace(&"n".repeat(1000))
        .build()
        .unwrap_err();
    assert!(err.is_invalid_input());
}

/// Random sequences of (key, cost) give the same decisions on the embedded
/// store and on Redis. Both run within one window of a one-day quota, where
/// refill is far below a permit, so their clocks cannot make them differ.
#[tokio::test]
async fn memory_store_and_redis_decide_alike() {
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    let server = RedisServer::start();
    let mut runner = TestRunner::deterministic();
    let ops = prop::collection::vec((0usize..4, 0u64..7), 60..120);
    for case in 0..12 {
        let seq = ops.new_tree(&mut runner).unwrap().current();
        for algorithm in ALGORITHMS {
            let quota = daily(12).with_burst(nonzero!(9));
            let ns = format!("diff{case}");
            let redis = exact(&server, quota, algorithm, &ns).await;
            let memory = Limiter::builder(quota)
                .store(MemoryStore::new())
                .algorithm(algorithm)
                .namespace(&ns)
                .build()
                .unwrap();
            for (i, (key, cost)) in seq.iter().enumerate() {
                let key = format!("key{key}");
                let r = redis.try_check(&key, *cost).await.unwrap();
                let m = memory.try_check(&key, *cost).await.unwrap();
                let step = format!("{algorithm:?} case {case} step {i} ({key}, {cost})");
                assert_eq!(r.is_allowed(), m.is_allowed(), "{step}");
                assert_eq!(r.remaining(), m.remaining(), "{step}");
                assert_eq!(
                    r.retry_after().is_some(),
                    m.retry_after().is_some(),
                    "{step}"
                );
                if algorithm != Algorithm::FixedWindow && algorithm != Algorithm::SlidingWindow {
                    // Both clocks run in real time; allow for the gap between calls.
                    let gap = r.reset_after().abs_diff(m.reset_after());
                    assert!(gap < Duration::from_secs(2), "{step}: {gap:?}");
                }
            }
        }
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// Random sequences of (key, cost, time step) across many short windows:
/// the window algorithms decide the same on the embedded store (system
/// clock) and on Redis (its TIME), decision by decision. Both read this
/// machine's wall clock; steps that would land within 10 ms of a window
/// boundary wait past it, so the two calls, microseconds apart, see the
/// same window.
#[tokio::test]
async fn fixed_window_decides_alike_on_both_stores_across_time_steps() {
    decides_alike_across_time_steps(Algorithm::FixedWindow).await;
}

/// As above, for the sliding window, which also weighs the previous
/// window by the microsecond: the two calls, microseconds apart, may
/// round its weight differently, so their remainders may differ by one,
/// and their decisions only where one of them had at most one permit left.
#[tokio::test]
async fn sliding_window_decides_alike_on_both_stores_across_time_steps() {
    decides_alike_across_time_steps(Algorithm::SlidingWindow).await;
}

/// The wall clock, read at every call, as Redis reads it for `TIME`. The
/// embedded store's own clock is monotonic from a wall-clock anchor, so a
/// step of the machine's clock (NTP) would put the two stores' windows
/// apart by the step; this test compares window arithmetic, not clocks.
struct WallClock;

impl slicelimit::clock::Clock for WallClock {
    fn now(&self) -> Duration {
        Duration::from_micros(support::load::wall_us())
    }
}

async fn decides_alike_across_time_steps(algorithm: Algorithm) {
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    let server = RedisServer::start();
    let period = Duration::from_millis(100);
    let quota = Quota::new(8, period).unwrap();
    let ns = format!("steps-{}", std::process::id());
    let redis = exact(&server, quota, algorithm, &ns).await;
    let memory = Limiter::builder(quota)
        .store(MemoryStore::with_clock(WallClock))
        .algorithm(algorithm)
        .namespace(&ns)
        .build()
        .unwrap();
    let mut runner = TestRunner::deterministic();
    let ops = prop::collection::vec((0usize..3, 0u64..4, 0u64..40), 150..200)
        .new_tree(&mut runner)
        .unwrap()
        .current();
    let period_us = period.as_micros() as u64;
    let mut windows = std::collections::HashSet::new();
    let (mut resync_from, mut compared, mut skipped) = (0u64, 0u32, 0u32);
    for (i, (key, cost, step_ms)) in ops.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(*step_ms)).await;
        let offset = support::load::wall_us() % period_us;
        // Move to 12 ms into a window when within 10 ms of a boundary.
        let wait = if offset < 10_000 {
            12_000 - offset
        } else if offset > period_us - 10_000 {
            period_us - offset + 12_000
        } else {
            0
        };
        tokio::time::sleep(Duration::from_micros(wait)).await;
        let before = support::load::wall_us() / period_us;
        windows.insert(before);
        let key = format!("k{key}");
        let r = redis.try_check(&key, *cost).await.unwrap();
        let m = memory.try_check(&key, *cost).await.unwrap();
        let after = support::load::wall_us() / period_us;
        if before != after {
            // A stall carried the pair across a boundary: the stores may
            // have counted it in different windows. Compare again from
            // the next window on, where both start afresh.
            resync_from = after + 1 + u64::from(algorithm == Algorithm::SlidingWindow);
        }
        if before < resync_from {
            skipped += 1;
            continue;
        }
        compared += 1;
        let step = format!("{algorithm:?} step {i} ({key}, cost {cost}, after {step_ms} ms)");
        if algorithm == Algorithm::SlidingWindow {
            // What each saw before deciding (a denial takes nothing): the
            // stores read the clock a round trip apart, so the previous
            // window's weight may round to a permit apart, and one may
            // then admit what the other denies.
            let seen =
                |d: &slicelimit::Decision| d.remaining() + if d.is_allowed() { *cost } else { 0 };
            assert!(seen(&r).abs_diff(seen(&m)) <= 1, "{step}: {r:?} {m:?}");
            assert!(
                r.is_allowed() == m.is_allowed() || r.remaining().min(m.remaining()) <= 1,
                "{step}: {r:?} {m:?}"
            );
            if r.is_allowed() != m.is_allowed() {
                // The pair now differs by a permit: start again afresh.
                resync_from = after + 2;
            }
            continue;
        }
        assert_eq!(r.is_allowed(), m.is_allowed(), "{step}");
        assert_eq!(r.remaining(), m.remaining(), "{step}");
        // The two clocks are read microseconds apart, unless the machine
        // stalls; the window arithmetic must agree to well within that.
        let gap = r.reset_after().abs_diff(m.reset_after());
        assert!(
            gap < Duration::from_millis(25),
            "{step}: reset differs by {gap:?}"
        );
    }
    assert!(
        compared >= 100 && skipped < 20,
        "compared {compared}, skipped {skipped}"
    );
    assert!(
        windows.len() >= 30,
        "the sequence spanned {} windows",
        windows.len()
    );
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// Several quotas on one key: `lua/check_all.lua` on Redis and the
/// embedded store's mirror decide alike, quota by quota, on random
/// sequences; a denial by either quota takes from neither on both stores.
#[tokio::test]
async fn several_quotas_decide_alike_on_both_stores() {
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    let server = RedisServer::start();
    let mut runner = TestRunner::deterministic();
    let ops = prop::collection::vec((0usize..3, 0u64..6), 60..100);
    for case in 0..8 {
        let seq = ops.new_tree(&mut runner).unwrap().current();
        for algorithm in ALGORITHMS {
            let first = daily(12).with_burst(nonzero!(9));
            let second = Quota::new(20, Duration::from_secs(2 * 86_400))
                .unwrap()
                .with_burst(nonzero!(7));
            let ns = format!("several{case}");
            let build = |store: slicelimit::Store| {
                Limiter::builder(first)
                    .and(second)
                    .store(store)
                    .algorithm(algorithm)
                    .namespace(&ns)
                    .build()
                    .unwrap()
            };
            let redis = build(support::store(&server).await.into());
            let memory = build(MemoryStore::new().into());
            for (i, (key, cost)) in seq.iter().enumerate() {
                let key = format!("key{key}");
                let r = redis.try_check(&key, *cost).await.unwrap();
                let m = memory.try_check(&key, *cost).await.unwrap();
                let step = format!("{algorithm:?} case {case} step {i} ({key}, {cost})");
                assert_eq!(r.is_allowed(), m.is_allowed(), "{step}");
                assert_eq!(r.quotas().len(), 2, "{step}: every quota decided");
                for (q, (rq, mq)) in r.quotas().iter().zip(m.quotas()).enumerate() {
                    assert_eq!(rq.is_allowed(), mq.is_allowed(), "{step} quota {q}");
                    assert_eq!(rq.remaining(), mq.remaining(), "{step} quota {q}");
                }
            }
        }
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// Exact and hybrid limiters need a store named: without one, `build`
/// refuses, saying how to choose, instead of limiting each process alone.
#[tokio::test]
async fn a_limiter_without_a_store_is_refused_at_build() {
    for builder in [
        Limiter::builder(Quota::per_second(nonzero!(5))),
        Limiter::builder(Quota::per_second(nonzero!(5))).exact(),
        Limiter::builder(Quota::per_second(nonzero!(5))).hybrid(slicelimit::HybridConfig::strict()),
    ] {
        let err = builder.build().unwrap_err();
        assert!(err.is_invalid_input(), "{err}");
        assert!(err.to_string().contains("no store chosen"), "{err}");
        assert!(err.to_string().contains("RedisStore"), "{err}");
    }
    // Per-process counting on purpose needs no store.
    let local = Limiter::builder(Quota::per_second(nonzero!(5)))
        .local()
        .build()
        .unwrap();
    assert!(local.check("k", 1).await.is_allowed());
    // Naming the embedded store is a choice made, and builds.
    let one_process = Limiter::builder(Quota::per_second(nonzero!(5)))
        .store(MemoryStore::new())
        .build()
        .unwrap();
    assert!(one_process.check("k", 1).await.is_allowed());
}
