//! Cancel safety: every future the crate returns is dropped at its first,
//! second, … poll, and the limiter is used again. Nothing may be left
//! half-changed: the breaker answers, permits are neither lost for good nor
//! spent twice, the bound holds, shutdown returns.

use slicelimit_sim as support;

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use slicelimit::{
    nonzero, Algorithm, FailurePolicy, HybridConfig, Limiter, MemoryStore, Quota, Source,
};
use support::VirtualClock;
use support::{Faults, FaultyStore};

/// Polls `fut` `polls` times, a millisecond of virtual time apart, then
/// drops it. Returns its output if it finished first.
async fn poll_then_drop<F: Future>(fut: F, polls: usize) -> Option<F::Output> {
    let mut fut = Box::pin(fut);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
        if let Poll::Ready(out) = polled {
            return Some(out);
        }
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    None
}

fn modes() -> Vec<(&'static str, Option<HybridConfig>)> {
    vec![
        ("exact", None),
        ("strict", Some(HybridConfig::strict().lease_bounds(1, 3))),
        (
            "optimistic",
            Some(HybridConfig::optimistic(2).lease_bounds(1, 3)),
        ),
    ]
}

#[tokio::test(start_paused = true)]
async fn every_future_dropped_at_every_poll_leaves_nothing_half_done() {
    let clock = VirtualClock {
        // Mid-window, so a run does not straddle a boundary.
        origin: Duration::from_secs(1_700_000_000) + Duration::from_millis(10),
        start: tokio::time::Instant::now(),
    };
    for algorithm in [Algorithm::FixedWindow, Algorithm::TokenBucket] {
        for (name, mode) in modes() {
            for polls in 1..=6 {
                let memory = MemoryStore::with_clock(clock.clone());
                let faults = Faults {
                    max_delay: Duration::from_millis(6),
                    ..Faults::default()
                };
                let store = FaultyStore::new(memory, faults, polls as u64, clock.clone());
                let quota = Quota::new(20, Duration::from_secs(3600)).unwrap();
                let b = Limiter::builder(quota)
                    .algorithm(algorithm)
                    .store(store.clone())
                    .clock(clock.clone())
                    .on_store_error(FailurePolicy::FailClosed);
                let limiter = match &mode {
                    Some(config) => b.hybrid(config.clone()).build().unwrap(),
                    None => b.exact().build().unwrap(),
                };
                let what = format!("{algorithm:?} {name} dropped at poll {polls}");
                // Checks dropped mid-flight, interleaved with whole ones.
                let mut admitted = 0u64;
                let mut finished_early = 0u64;
                for i in 0..30 {
                    if i % 2 == 0 {
                        if let Some(d) = poll_then_drop(limiter.check("k", 1), polls).await {
                            // It finished before the drop.
                            finished_early += u64::from(d.is_allowed());
                        }
                    } else {
                        let d = limiter.check("k", 1).await;
                        assert_ne!(d.source(), Source::FailClosed, "{what}: the store answers");
                        admitted += u64::from(d.is_allowed());
                    }
                }
                let cap = if name == "optimistic" { 22 } else { 20 };
                assert!(
                    admitted + finished_early <= cap,
                    "{what}: {admitted} + {finished_early} admitted"
                );
                assert_eq!(
                    store.counts().refused,
                    0,
                    "{what}: the breaker never opened"
                );
                // Shutdown dropped mid-way, then run to the end.
                poll_then_drop(limiter.shutdown(), polls).await;
                tokio::time::timeout(Duration::from_secs(5), limiter.shutdown())
                    .await
                    .unwrap_or_else(|_| panic!("{what}: shutdown returned"));
                // After shutdown, decisions go to the store one by one.
                let d = limiter.check("k", 0).await;
                assert!(d.is_allowed(), "{what}: {d:?}");
            }
        }
    }
}

/// A hybrid limiter on the embedded store, for the quota-change tests.
fn on_memory(store: &MemoryStore, quota: Quota) -> Limiter {
    Limiter::builder(quota)
        .namespace("changed")
        .store(store.clone())
        .hybrid(HybridConfig::default())
        .build()
        .unwrap()
}

/// `set_quota` from a runtime that is dropped right after: the replaced
/// lane's sync task (on the limiter's runtime) still stops, and the new
/// lane's, spawned on the dropped runtime before it ever ran, is
/// restarted where the limiter is used, with the old lane's permits back
/// in the store for it.
#[test]
fn a_quota_changed_from_a_dropped_runtime_stops_the_old_lane_and_runs_the_new() {
    let limiter_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let limiter = limiter_rt.block_on(async {
        let limiter = on_memory(&store, Quota::per_hour(nonzero!(100)));
        for _ in 0..3 {
            assert!(limiter.check("k", 1).await.is_allowed());
        }
        limiter
    });
    std::thread::sleep(Duration::from_millis(200));
    let tasks_before = limiter_rt.metrics().num_alive_tasks();
    {
        let passing = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        passing.block_on(async { limiter.set_quota(Quota::per_hour(nonzero!(100))).unwrap() });
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        limiter_rt.metrics().num_alive_tasks() < tasks_before,
        "the replaced lane's sync task still runs"
    );
    let admitted = limiter_rt.block_on(async {
        let mut admitted = 0;
        while limiter.check("k", 1).await.is_allowed() {
            admitted += 1;
            assert!(admitted <= 100, "more than the limit");
        }
        admitted
    });
    assert_eq!(admitted, 97, "the rest of the hour's 100, after 3");
    assert!(limiter.stats().sync_restarts >= 1);
}
