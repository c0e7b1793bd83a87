//! Refunds, undo and dropped decisions under adversarial use: a decision
//! refunded again and again, on the wrong limiter, through lost replies;
//! tiers of different periods; futures dropped while they give back.

use slicelimit_sim as support;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slicelimit::{check_all, clock::FakeClock, nonzero, HybridConfig, Limiter, MemoryStore, Quota};
use support::load::wall_us;
use support::{store, RedisServer, VirtualClock};
use support::{Faults, FaultyStore};

fn virtual_clock() -> VirtualClock {
    VirtualClock {
        origin: Duration::from_secs(6_000),
        start: tokio::time::Instant::now(),
    }
}

async fn drain(limiter: &Limiter, key: &str) -> u64 {
    let mut n = 0;
    while limiter.check(key, 1).await.is_allowed() {
        n += 1;
        assert!(n < 10_000, "no limit");
    }
    n
}

/// A decision refunded a hundred times gives back once, in every mode,
/// with one quota or two: the refund carries the admission's identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_refunded_again_gives_back_once() {
    let server = RedisServer::start();
    while wall_us() % 60_000_000 > 40_000_000 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (hybrid, several) in [(false, false), (true, false), (false, true), (true, true)] {
        let ns = format!("twice-{hybrid}-{several}");
        let mut b = Limiter::builder(Quota::per_minute(nonzero!(5)))
            .namespace(&ns)
            .store(store(&server).await);
        if several {
            b = b.and(Quota::per_hour(nonzero!(8)));
        }
        let limiter = if hybrid {
            b.hybrid(HybridConfig::strict()).build().unwrap()
        } else {
            b.build().unwrap()
        };
        let first = limiter.check("k", 1).await;
        assert!(first.is_allowed());
        assert_eq!(drain(&limiter, "k").await, 4);
        let mut back = 0;
        for _ in 0..100 {
            back += limiter.refund("k", &first).await;
        }
        let quotas = 1 + u64::from(several);
        assert_eq!(back, quotas, "hybrid {hybrid} several {several}");
        assert_eq!(
            drain(&limiter, "k").await,
            1,
            "hybrid {hybrid} several {several}"
        );
        limiter.shutdown().await;
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// A decision of one limiter gives nothing back to another.
#[tokio::test]
async fn another_limiters_decision_is_refused() {
    let a = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .store(MemoryStore::new())
        .namespace("a")
        .build()
        .unwrap();
    let b = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .store(MemoryStore::new())
        .namespace("b")
        .build()
        .unwrap();
    let from_a = a.check("k", 1).await;
    assert_eq!(drain(&b, "k").await, 5);
    assert_eq!(b.refund("k", &from_a).await, 0);
    assert_eq!(b.stats().refunds_ignored, 1);
    assert_eq!(drain(&b, "k").await, 0);
    assert_eq!(a.refund("k", &from_a).await, 1, "its own limiter takes it");
}

/// A refund whose reply is lost is sent again under its identity: it
/// lands once and is counted as refunded.
#[tokio::test(start_paused = true)]
async fn a_refund_whose_reply_is_lost_lands_once_and_is_counted() {
    let clock = virtual_clock();
    let faulty = FaultyStore::new(
        MemoryStore::with_clock(clock.clone()),
        Faults::default(),
        3,
        clock.clone(),
    )
    .with_latency(Duration::from_millis(10));
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .store(faulty.clone())
        .clock(clock.clone())
        .namespace("lost")
        .build()
        .unwrap();
    let mut admitted = Vec::new();
    for _ in 0..5 {
        admitted.push(limiter.check("k", 1).await);
    }
    // The first send's reply is lost (its fate is drawn when it is sent);
    // the store heals while it is in flight, so the second send answers.
    faulty.set_faults(Faults {
        lost_after: 1.0,
        ..Faults::default()
    });
    let refund = limiter.refund("k", &admitted[0]);
    tokio::pin!(refund);
    // Let the first send go out and lose its reply, then heal the store.
    let first = tokio::time::timeout(Duration::from_millis(1), &mut refund).await;
    faulty.set_faults(Faults::default());
    let back = match first {
        Ok(back) => back,
        Err(_) => refund.await,
    };
    assert_eq!(back, 1);
    let stats = limiter.stats();
    assert_eq!((stats.refunded, stats.refunds_ignored), (1, 0));
    faulty.set_faults(Faults {
        duplicated: 1.0,
        ..Faults::default()
    });
    assert_eq!(limiter.refund("k", &admitted[1]).await, 1);
    faulty.set_faults(Faults::default());
    assert_eq!(drain(&limiter, "k").await, 2, "two refunds, two permits");
}

/// Tiers of different periods count in keys of their own: a key that
/// moves from 10 a day to 10 an hour and back keeps its day's count.
#[tokio::test]
async fn a_tier_of_another_period_keeps_each_periods_count() {
    for hybrid in [false, true] {
        let clock = FakeClock::new(Duration::from_secs(86_400 * 1000 + 10));
        let tier = Arc::new(AtomicU8::new(0));
        let t = tier.clone();
        let b = Limiter::builder(Quota::new(10, Duration::from_secs(86_400)).unwrap())
            .quota_for(move |_| match t.load(Ordering::SeqCst) {
                1 => Some(Quota::new(10, Duration::from_secs(3600)).unwrap()),
                2 => Some(Quota::new(1000, Duration::from_secs(1)).unwrap()),
                _ => None,
            })
            .store(MemoryStore::with_clock(clock.clone()))
            .namespace("periods")
            .clock(clock.clone());
        let limiter = if hybrid {
            b.hybrid(HybridConfig::strict()).build().unwrap()
        } else {
            b.build().unwrap()
        };
        let mut day = drain(&limiter, "k").await;
        assert_eq!(day, 10, "hybrid {hybrid}");
        tier.store(1, Ordering::SeqCst);
        assert_eq!(drain(&limiter, "k").await, 10, "an hour's own count");
        tier.store(2, Ordering::SeqCst);
        for _ in 0..5 {
            assert!(limiter.check("k", 1).await.is_allowed());
        }
        clock.advance(Duration::from_secs(2));
        assert!(limiter.check("k", 1).await.is_allowed());
        tier.store(0, Ordering::SeqCst);
        day += drain(&limiter, "k").await;
        assert_eq!(day, 10, "hybrid {hybrid}: back to the day, its count held");
        limiter.shutdown().await;
    }
}

fn slow_store(clock: &VirtualClock) -> FaultyStore {
    FaultyStore::slow(clock, Duration::from_millis(100))
}

fn exact(store: &FaultyStore, clock: &VirtualClock, ns: &str, limit: u32) -> Limiter {
    Limiter::builder(Quota::per_minute(std::num::NonZeroU32::new(limit).unwrap()))
        .store(store.clone())
        .clock(clock.clone())
        .namespace(ns)
        .build()
        .unwrap()
}

/// `check_all` whose second pair denies gives the first pair's permit back
/// (in the background, not holding up the denial), and so does one
/// dropped while the second pair decides.
#[tokio::test(start_paused = true)]
async fn check_all_gives_back_on_a_denial_and_when_dropped() {
    let clock = virtual_clock();
    let store = slow_store(&clock);
    let user = exact(&store, &clock, "user", 5);
    let org = exact(&store, &clock, "org", 1);
    assert!(org.check("acme", 1).await.is_allowed());
    let began = tokio::time::Instant::now();
    let denied = check_all(&[(&user, "alice"), (&org, "acme")], 1).await;
    assert!(!denied.is_allowed());
    assert!(
        began.elapsed() < Duration::from_millis(250),
        "two checks, no refund waited for"
    );
    // 100 ms for the user's check, then dropped during the org's.
    let dropped = tokio::time::timeout(
        Duration::from_millis(150),
        check_all(&[(&user, "bob"), (&org, "acme")], 1),
    )
    .await;
    assert!(dropped.is_err());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(drain(&user, "alice").await, 5);
    assert_eq!(drain(&user, "bob").await, 5);
}

/// A refund after the key moved to a tier of another period has no
/// window to go to: it is ignored, and the new tier gains nothing.
#[tokio::test]
async fn a_refund_after_a_move_to_another_period_is_ignored() {
    let clock = FakeClock::new(Duration::from_secs(3_600 * 1_000 + 10));
    let moved = Arc::new(AtomicU8::new(0));
    let m = moved.clone();
    let limiter = Limiter::builder(Quota::new(3, Duration::from_secs(3_600)).unwrap())
        .quota_for(move |_| {
            (m.load(Ordering::SeqCst) == 1)
                .then(|| Quota::new(3, Duration::from_micros(3_600_000_001)).unwrap())
        })
        .store(MemoryStore::with_clock(clock.clone()))
        .namespace("moved")
        .clock(clock.clone())
        .build()
        .unwrap();
    let d = limiter.check("k", 1).await;
    assert!(d.is_allowed());
    moved.store(1, Ordering::SeqCst);
    assert_eq!(drain(&limiter, "k").await, 3);
    assert_eq!(limiter.refund("k", &d).await, 0);
    assert_eq!(drain(&limiter, "k").await, 0, "the new tier gained nothing");
}
