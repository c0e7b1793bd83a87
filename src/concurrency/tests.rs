//! The concurrency limiter on an embedded store, with a fake clock shared
//! by the store and the limiters and Tokio's paused time for the
//! background task: leases expire and renew without sleeping.

use std::num::NonZeroU32;
use std::time::Duration;

use std::collections::HashMap;

use super::slots::SlotLease;
use super::{AcquireError, ConcurrencyLimiter};
use crate::clock::Clock;
use crate::clock::FakeClock;
use crate::store::MemoryStore;

fn max(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("not zero")
}

struct Fleet {
    clock: FakeClock,
    store: MemoryStore,
}

impl Fleet {
    fn new() -> Fleet {
        let clock = FakeClock::new(Duration::from_secs(1_000));
        let store = MemoryStore::with_clock(clock.clone());
        Fleet { clock, store }
    }

    /// A process's limiter of at most `n` per key, leases of 3 s renewed
    /// every second.
    fn process(&self, n: u32, hybrid: bool) -> ConcurrencyLimiter {
        let builder = ConcurrencyLimiter::builder(max(n))
            .store(self.store.clone())
            .clock(self.clock.clone())
            .lease(Duration::from_secs(3))
            .renew_every(Duration::from_secs(1));
        let builder = if hybrid {
            builder.hybrid()
        } else {
            builder.exact()
        };
        builder.build().expect("builds")
    }

    /// Moves both clocks by `by`, in steps the background tasks see.
    async fn advance(&self, by: Duration) {
        let step = Duration::from_millis(100);
        let mut left = by;
        while !left.is_zero() {
            let d = step.min(left);
            self.clock.advance(d);
            tokio::time::advance(d).await;
            tokio::task::yield_now().await;
            left -= d;
        }
    }

    /// Slots held in the store for `key` by live leases.
    fn held(&self, key: &str, limiter: &ConcurrencyLimiter) -> u64 {
        let store_key = limiter.inner.store_key(key);
        let now_ms = self.clock.now().as_millis() as u64;
        self.slots_held(&store_key, |lease| lease.expires_ms > now_ms)
    }

    /// Slots the leases of `store_key` that pass `count` hold.
    fn slots_held(&self, store_key: &str, count: impl Fn(&SlotLease) -> bool) -> u64 {
        self.store
            .inspect::<HashMap<String, SlotLease>, _>(store_key, |leases| {
                leases.map_or(0, |l| l.values().filter(|l| count(l)).map(|l| l.held).sum())
            })
    }
}

/// Stops a limiter's background task, as a killed process's would.
fn kill(limiter: &ConcurrencyLimiter) {
    let task = limiter.inner.task.lock().expect("not poisoned").take();
    task.expect("a task").abort();
}

#[tokio::test(start_paused = true)]
async fn exact_permits_take_and_release_one_slot_each() {
    let fleet = Fleet::new();
    let limiter = fleet.process(3, false);
    let permits: Vec<_> = [
        limiter.try_acquire("k").await,
        limiter.try_acquire("k").await,
        limiter.try_acquire("k").await,
    ]
    .into_iter()
    .map(|p| p.expect("a slot"))
    .collect();
    assert!(matches!(
        limiter.try_acquire("k").await,
        Err(AcquireError::Full { .. })
    ));
    assert_eq!(fleet.held("k", &limiter), 3);
    drop(permits);
    fleet.advance(Duration::from_millis(100)).await;
    assert_eq!(fleet.held("k", &limiter), 0);
    assert_eq!(limiter.in_flight("k"), 0);
    let _again = limiter.try_acquire("k").await.expect("free again");
}

#[tokio::test(start_paused = true)]
async fn an_exact_slot_dropped_here_is_free_here_at_once() {
    let fleet = Fleet::new();
    let limiter = fleet.process(3, false);
    let other = fleet.process(3, false);
    let first: Vec<_> = [
        limiter.try_acquire("k").await,
        limiter.try_acquire("k").await,
        limiter.try_acquire("k").await,
    ]
    .into_iter()
    .map(|p| p.expect("a slot"))
    .collect();
    drop(first);
    // No time passes and the background task has not run: every release
    // is still on its way, yet the next takes here find the slots free.
    let mut again = Vec::new();
    for _ in 0..3 {
        again.push(limiter.try_acquire("k").await.expect("free at once"));
    }
    assert_eq!(fleet.held("k", &limiter), 3);
    assert!(matches!(
        other.try_acquire("k").await,
        Err(AcquireError::Full { .. })
    ));
    // The releases the background task sends now arrive a second time:
    // they change nothing, and the new permits keep their slots.
    fleet.advance(Duration::from_millis(100)).await;
    assert_eq!(fleet.held("k", &limiter), 3);
    assert!(other.try_acquire("k").await.is_err());
    drop(again);
    fleet.advance(Duration::from_millis(100)).await;
    assert_eq!(fleet.held("k", &limiter), 0);
    // Every release has been applied and forgotten: the key goes idle.
    fleet.advance(Duration::from_secs(2)).await;
    assert!(
        limiter.inner.slots.get("k").is_none(),
        "the key was forgotten"
    );
    let _theirs = other.try_acquire("k").await.expect("a slot");
}

#[tokio::test(start_paused = true)]
async fn two_hybrid_processes_never_hold_more_than_the_maximum() {
    let fleet = Fleet::new();
    let a = fleet.process(20, true);
    let b = fleet.process(20, true);
    let mut held = Vec::new();
    for i in 0..40 {
        let process = if i % 2 == 0 { &a } else { &b };
        if let Ok(permit) = process.try_acquire("k").await {
            held.push(permit);
        }
        assert!(fleet.held("k", &a) <= 20);
    }
    assert_eq!(held.len(), 20);
    assert_eq!(a.in_flight("k") + b.in_flight("k"), 20);
    drop(held);
    fleet.advance(Duration::from_secs(2)).await;
    assert_eq!(fleet.held("k", &a), 0, "idle slots go back");
}

#[tokio::test(start_paused = true)]
async fn a_panicking_request_releases_its_slot() {
    let fleet = Fleet::new();
    let limiter = fleet.process(1, true);
    let inside = limiter.clone();
    let task = tokio::spawn(async move {
        let _permit = inside.try_acquire("k").await.expect("a slot");
        panic!("the request failed");
    });
    assert!(task.await.is_err());
    assert_eq!(limiter.in_flight("k"), 0);
    let _next = limiter
        .try_acquire("k")
        .await
        .expect("released by the panic");
}

#[tokio::test(start_paused = true)]
async fn a_dropped_wait_takes_no_slot() {
    let fleet = Fleet::new();
    let limiter = fleet.process(1, false);
    let held = limiter.try_acquire("k").await.expect("a slot");
    let waiting = limiter.acquire("k", Duration::from_secs(10));
    // Dropped while waiting.
    assert!(tokio::time::timeout(Duration::from_millis(50), waiting)
        .await
        .is_err());
    drop(held);
    fleet.advance(Duration::from_millis(100)).await;
    assert_eq!(fleet.held("k", &limiter), 0);
    let _next = limiter.try_acquire("k").await.expect("nothing leaked");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_gets_the_slot_released_in_its_process() {
    let fleet = Fleet::new();
    let limiter = fleet.process(1, true);
    let held = limiter.try_acquire("k").await.expect("a slot");
    let waiter = {
        let limiter = limiter.clone();
        tokio::spawn(async move { limiter.acquire("k", Duration::from_secs(5)).await })
    };
    tokio::task::yield_now().await;
    drop(held);
    let permit = waiter.await.expect("joins").expect("handed on");
    assert_eq!(permit.key(), "k");
}

#[tokio::test(start_paused = true)]
async fn a_dead_processs_slots_are_free_after_its_lease_and_not_before() {
    for hybrid in [false, true] {
        let fleet = Fleet::new();
        let dead = fleet.process(20, hybrid);
        let alive = fleet.process(20, hybrid);
        let mut gone = Vec::new();
        for _ in 0..10 {
            gone.push(dead.try_acquire("k").await.expect("a slot"));
        }
        // Killed: its permits never drop, its task never runs again.
        std::mem::forget(gone);
        kill(&dead);
        std::mem::forget(dead);
        let mut mine = Vec::new();
        while let Ok(p) = alive.try_acquire("k").await {
            mine.push(p);
        }
        assert!(mine.len() <= 10, "hybrid {hybrid}: {}", mine.len());
        // Just before the lease runs out (3 s from its last renewal at 0):
        fleet.advance(Duration::from_millis(2_900)).await;
        assert!(alive.try_acquire("k").await.is_err(), "hybrid {hybrid}");
        fleet.advance(Duration::from_millis(200)).await;
        while let Ok(p) = alive.try_acquire("k").await {
            mine.push(p);
        }
        assert_eq!(mine.len(), 20, "hybrid {hybrid}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_that_outlives_its_lease_keeps_its_slot() {
    for hybrid in [false, true] {
        let fleet = Fleet::new();
        let long = fleet.process(1, hybrid);
        let other = fleet.process(1, hybrid);
        let permit = long.try_acquire("k").await.expect("a slot");
        // Five leases long, renewed every second by its process.
        for _ in 0..15 {
            fleet.advance(Duration::from_secs(1)).await;
            assert!(other.try_acquire("k").await.is_err(), "hybrid {hybrid}");
        }
        drop(permit);
        fleet.advance(Duration::from_millis(1_100)).await;
        let _now = other.try_acquire("k").await.expect("released at last");
    }
}

#[test]
fn bad_leases_are_refused() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let _guard = runtime.enter();
    for (lease, renew) in [
        (Duration::from_millis(10), None),
        (Duration::from_secs(3_600), None),
        (Duration::from_secs(3), Some(Duration::from_secs(2))),
        (Duration::from_secs(3), Some(Duration::ZERO)),
    ] {
        let mut builder = ConcurrencyLimiter::builder(max(1))
            .store(MemoryStore::new())
            .lease(lease);
        if let Some(renew) = renew {
            builder = builder.renew_every(renew);
        }
        assert!(builder.build().is_err(), "{lease:?} {renew:?}");
    }
}

#[test]
fn a_limiter_without_a_store_is_refused_and_says_how_to_choose_one() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let _guard = runtime.enter();
    for hybrid in [false, true] {
        let builder = ConcurrencyLimiter::builder(max(1));
        let builder = if hybrid {
            builder.hybrid()
        } else {
            builder.exact()
        };
        let error = builder.build().expect_err("no store");
        assert!(error.is_invalid_input(), "hybrid {hybrid}: {error}");
        assert!(
            error.to_string().contains(".store("),
            "hybrid {hybrid}: {error}"
        );
    }
    // Chosen on purpose, one process's embedded store is fine.
    let _one = ConcurrencyLimiter::builder(max(1))
        .store(MemoryStore::new())
        .build()
        .expect("builds");
}

#[tokio::test(start_paused = true)]
async fn a_busy_hybrid_process_makes_room_for_a_late_one() {
    let fleet = Fleet::new();
    let first = fleet.process(20, true);
    let late = fleet.process(20, true);
    let mut held: Vec<_> = Vec::new();
    for _ in 0..20 {
        held.push(first.try_acquire("k").await.expect("a slot"));
    }
    // Ten requests of the late process wait; their demand counts.
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let asking: Vec<_> = (0..10)
        .map(|_| {
            let (late, got) = (late.clone(), got.clone());
            tokio::spawn(async move {
                if let Ok(permit) = late.acquire("k", Duration::from_secs(5)).await {
                    got.lock().expect("lock").push(permit);
                }
            })
        })
        .collect();
    // The first stays busy: each finished request is followed by another.
    // It learns its fair share (10) at its next renewal; from then on its
    // finished requests' slots go back instead of to its next.
    for _ in 0..100 {
        drop(held.remove(0));
        fleet.advance(Duration::from_millis(30)).await;
        if let Ok(permit) = first.try_acquire("k").await {
            held.push(permit);
        }
    }
    for task in asking {
        task.abort();
    }
    // Max-min by demand is 10 each: within 3 s the late one has 9 or 10.
    let mine = got.lock().expect("lock").len();
    assert!(mine >= 9, "the late process got {mine}");
    assert!(held.len() + mine <= 20);
}

#[tokio::test(start_paused = true)]
async fn permits_that_outlive_their_limiter_are_released() {
    for hybrid in [false, true] {
        let fleet = Fleet::new();
        let limiter = fleet.process(5, hybrid);
        let store_key = limiter.inner.store_key("k");
        let mut held = Vec::new();
        for _ in 0..5 {
            held.push(limiter.try_acquire("k").await.expect("a slot"));
        }
        limiter.shutdown().await;
        drop(limiter);
        drop(held);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        fleet.advance(Duration::from_millis(200)).await;
        assert_eq!(fleet.slots_held(&store_key, |_| true), 0, "hybrid {hybrid}");
    }
}
