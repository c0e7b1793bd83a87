//! Schedules that once broke a published property,
//! kept as regressions: a dropped `shutdown`, a report resent after its
//! identity expired, a fallback counting windows on a skewed clock, a peek
//! under fail-closed. All on a virtual clock over the embedded store.

use slicelimit_sim as support;

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use slicelimit::{
    clock::Clock, Algorithm, FailurePolicy, HybridConfig, Limiter, MemoryStore, Quota, Source,
};
use support::VirtualClock;
use support::{Faults, FaultyStore};

fn vclock(offset: Duration) -> VirtualClock {
    VirtualClock {
        origin: Duration::from_secs(1_700_000_000) + offset,
        start: tokio::time::Instant::now(),
    }
}

fn window(clock: &VirtualClock, period: Duration) -> i64 {
    (clock.now().as_micros() / period.as_micros()) as i64
}

const NS: &str = "adversarial";

/// Dropping `shutdown()` while its final round waits on the store must not
/// lose the debt reports it carries: a second `shutdown()` sends them.
#[tokio::test(start_paused = true)]
async fn a_dropped_shutdown_keeps_its_debt_reports() {
    let period = Duration::from_secs(3600);
    let clock = vclock(Duration::from_millis(10));
    let memory = MemoryStore::with_clock(clock.clone());
    let store = FaultyStore::new(memory.clone(), Faults::default(), 7, clock.clone());
    let quota = Quota::new(2, period).unwrap();
    let exact = Limiter::builder(quota)
        .store(memory.clone())
        .clock(clock.clone())
        .namespace(NS)
        .exact()
        .build()
        .unwrap();
    let a = Limiter::builder(quota)
        .store(store.clone())
        .clock(clock.clone())
        .namespace(NS)
        .on_store_error(FailurePolicy::FailClosed)
        .hybrid(HybridConfig::optimistic(2).lease_bounds(1, 3))
        .build()
        .unwrap();
    // Another process fills the window.
    assert!(exact.check("k", 1).await.is_allowed());
    assert!(exact.check("k", 1).await.is_allowed());
    // A learns the store's clock from some other key.
    assert!(a.check("warm", 1).await.is_allowed());
    tokio::time::sleep(Duration::from_millis(5)).await;
    // Lease calls take a while from now on.
    store.set_faults(Faults {
        max_delay: Duration::from_millis(10),
        ..Faults::default()
    });
    let mut admitted = 0;
    let d1 = a.check("k", 1).await; // credit; debt goes out with the lease
    admitted += u64::from(d1.is_allowed());
    tokio::task::yield_now().await;
    let d2 = a.check("k", 1).await; // credit while that lease is in flight
    admitted += u64::from(d2.is_allowed());
    tokio::time::sleep(Duration::from_millis(50)).await; // the lease returns

    // Shutdown, dropped once its last round waits on the store.
    {
        let g0 = a.stats().given_back;
        let mut fut = Box::pin(a.shutdown());
        let mut dropped = false;
        for _ in 0..2000 {
            let polled = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
            assert!(polled.is_pending(), "shutdown finished before the drop");
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            if a.local_keys() == 0 && a.stats().given_back >= g0 {
                // Slots retired, debt queued; the final round now waits
                // on the store.
                dropped = true;
                break;
            }
            tokio::time::advance(Duration::from_micros(100)).await;
        }
        assert!(dropped, "never reached the report round");
    }
    a.shutdown().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let st = a.stats();
    let w = window(&clock, period);
    let counted = memory
        .window_count(NS, "k", Algorithm::FixedWindow, w)
        .unwrap_or(0);
    let total = 2 + admitted;
    assert_eq!(counted as u64, total, "the store counted every admission");
    assert!(
        st.overshoot >= total - 2,
        "excess {} not in the overshoot metric ({})",
        total - 2,
        st.overshoot
    );
}

/// A debt report applied by the store whose reply was lost is not resent
/// after its identity may have expired (60 s): it would count twice.
#[tokio::test(start_paused = true)]
async fn a_report_is_not_resent_after_its_identity_may_have_expired() {
    let period = Duration::from_secs(3600);
    let clock = vclock(Duration::from_millis(10));
    let memory = MemoryStore::with_clock(clock.clone());
    let store = FaultyStore::new(memory.clone(), Faults::default(), 7, clock.clone());
    let quota = Quota::new(1, period).unwrap();
    let exact = Limiter::builder(quota)
        .store(memory.clone())
        .clock(clock.clone())
        .namespace(NS)
        .exact()
        .build()
        .unwrap();
    let a = Limiter::builder(quota)
        .store(store.clone())
        .clock(clock.clone())
        .namespace(NS)
        .on_store_error(FailurePolicy::FailClosed)
        .hybrid(HybridConfig::optimistic(1).lease_bounds(1, 3))
        .build()
        .unwrap();
    assert!(exact.check("k", 1).await.is_allowed());
    assert!(a.check("warm", 1).await.is_allowed());
    tokio::time::sleep(Duration::from_millis(5)).await;
    // The next call is applied, its reply lost.
    store.set_faults(Faults {
        lost_after: 1.0,
        ..Faults::default()
    });
    let d = a.check("k", 1).await;
    assert_eq!(d.source(), Source::Credit);
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Then the store is unreachable for 61 s.
    store.set_faults(Faults {
        lost_before: 1.0,
        ..Faults::default()
    });
    tokio::time::sleep(Duration::from_secs(61)).await;
    store.set_faults(Faults::default());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let st = a.stats();
    let w = window(&clock, period);
    let counted = memory
        .window_count(NS, "k", Algorithm::FixedWindow, w)
        .unwrap_or(0);
    assert_eq!(counted, 2, "the debt was recorded {} times", counted - 1);
    assert!(st.overshoot <= st.credit_admitted);
}

/// The local fallback counts windows on the store's clock as last seen,
/// not the application's: with that clock half a period off, one store
/// window still admits at most limit + N·f.
#[tokio::test(start_paused = true)]
async fn fallback_windows_follow_the_store_clock() {
    let period = Duration::from_secs(1);
    // Store at a whole second + 50 ms; the process clock 500 ms ahead.
    let store_clock = vclock(Duration::from_millis(50));
    let app_clock = vclock(Duration::from_millis(550));
    let memory = MemoryStore::with_clock(store_clock.clone());
    let store = FaultyStore::new(memory.clone(), Faults::default(), 7, store_clock.clone());
    let f = 2;
    let mut worst = 0;
    for hybrid in [false, true] {
        let b = Limiter::builder(Quota::new(10, period).unwrap())
            .store(store.clone())
            .clock(app_clock.clone())
            .namespace(if hybrid { "h" } else { "e" })
            .on_store_error(FailurePolicy::LocalFallback(Quota::new(f, period).unwrap()));
        let l = if hybrid {
            b.hybrid(HybridConfig::strict()).build().unwrap()
        } else {
            b.exact().build().unwrap()
        };
        let into = store_clock.now().as_millis() as u64 % 1000;
        tokio::time::sleep(Duration::from_millis(1050 - into)).await;
        let w = window(&store_clock, period);
        let mut admitted = 0;
        for _ in 0..10 {
            let d = l.check("k", 1).await;
            admitted += u64::from(d.is_allowed());
        }
        store.set_faults(Faults {
            lost_before: 1.0,
            ..Faults::default()
        });
        // In the same store window: before and after the app's boundary.
        for at in [200u64, 700] {
            let now = store_clock.now().as_millis() as u64 % 1000;
            tokio::time::sleep(Duration::from_millis(at - now)).await;
            for _ in 0..5 {
                let d = l.check("k", 1).await;
                admitted += u64::from(d.is_allowed());
            }
        }
        assert_eq!(window(&store_clock, period), w, "still one store window");
        store.set_faults(Faults::default());
        tokio::time::sleep(Duration::from_secs(3)).await;
        worst = worst.max(admitted);
    }
    assert!(worst <= 10 + f, "{worst} > {}", 10 + f);
}

/// A peek (cost 0) is answered even when the store is away and the policy
/// is fail-closed.
#[tokio::test(start_paused = true)]
async fn a_peek_is_answered_under_fail_closed() {
    let clock = vclock(Duration::from_millis(10));
    let memory = MemoryStore::with_clock(clock.clone());
    let store = FaultyStore::new(
        memory,
        Faults {
            lost_before: 1.0,
            ..Faults::default()
        },
        7,
        clock.clone(),
    );
    let l = Limiter::builder(Quota::new(10, Duration::from_secs(1)).unwrap())
        .store(store)
        .clock(clock)
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let d = l.check("k", 0).await;
    assert!(d.is_allowed(), "a peek was denied: {d:?}");
}
