//! Several quotas per key, tiers, live quota changes, refunds and
//! `check_all`, on the embedded store with an injected clock: every window
//! boundary is placed by the test, nothing sleeps.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::time::Duration;

use slicelimit::{
    check_all, clock::FakeClock, limiter::refund_all, nonzero, Algorithm, HybridConfig, Limiter,
    MemoryStore, Quota, Source,
};

const START: Duration = Duration::from_secs(1_000_000);

fn clock() -> FakeClock {
    FakeClock::new(START)
}

fn per_minute_50() -> Quota {
    Quota::new(50, Duration::from_secs(60)).unwrap()
}

/// `builder` on an embedded store and `clock`, exact or strict hybrid.
fn on_clock(builder: slicelimit::Builder, clock: &FakeClock, hybrid: bool) -> Limiter {
    let builder = builder
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone());
    if hybrid {
        builder.hybrid(HybridConfig::strict()).build().unwrap()
    } else {
        builder.build().unwrap()
    }
}

fn window(clock_us: u64, period: Duration) -> i64 {
    (clock_us / period.as_micros() as u64) as i64
}

fn now_us(clock: &FakeClock) -> u64 {
    use slicelimit::clock::Clock;
    clock.now().as_micros() as u64
}

/// 10/s and 50/min on one key at 30 requests a second for three minutes:
/// neither quota is exceeded in any window, and each quota's count in the
/// store equals what was admitted in that window (a denial took nothing).
#[tokio::test]
async fn two_quotas_admit_only_together_and_a_denial_takes_from_neither() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let clock = clock();
        let store = MemoryStore::with_clock(clock.clone());
        let limiter = Limiter::builder(Quota::per_second(nonzero!(10)))
            .and(per_minute_50())
            .algorithm(algorithm)
            .store(store.clone())
            .namespace("two")
            .clock(clock.clone())
            .build()
            .unwrap();
        let mut per_second: HashMap<i64, u64> = HashMap::new();
        let mut per_minute: HashMap<i64, u64> = HashMap::new();
        let mut denied_by = [0u64; 2];
        for _ in 0..(180 * 30) {
            let d = limiter.check("k", 1).await;
            let at = now_us(&clock);
            // A denial reports the quotas checked up to the one that denied.
            assert!(!d.quotas().is_empty() && d.quotas().len() <= 2);
            let (ws, wm) = (
                window(at, Duration::from_secs(1)),
                window(at, Duration::from_secs(60)),
            );
            if d.is_allowed() {
                assert_eq!(d.quotas().len(), 2);
                *per_second.entry(ws).or_default() += 1;
                *per_minute.entry(wm).or_default() += 1;
            } else {
                for (i, part) in d.quotas().iter().enumerate() {
                    if !part.is_allowed() {
                        denied_by[i] += 1;
                    }
                }
                assert!(d.retry_after().is_some(), "a denial says when to retry");
            }
            // After every decision, each quota's count in the store is what
            // was admitted in its window: a denial took from neither.
            let counted = |index, w| {
                store
                    .quota_window_count("two", "k", algorithm, index, w)
                    .unwrap_or(0) as u64
            };
            assert_eq!(counted(0, ws), per_second.get(&ws).copied().unwrap_or(0));
            assert_eq!(counted(1, wm), per_minute.get(&wm).copied().unwrap_or(0));
            clock.advance(Duration::from_micros(33_333));
        }
        assert!(per_second.values().all(|&n| n <= 10), "{per_second:?}");
        if algorithm == Algorithm::FixedWindow {
            assert!(per_minute.values().all(|&n| n <= 50), "{per_minute:?}");
        }
        let admitted: u64 = per_minute.values().sum();
        // The per-minute quota binds: 50 a minute, over the (partial)
        // minute windows three minutes touch.
        let minutes = per_minute.len() as u64;
        assert!(
            admitted <= 50 * minutes && admitted >= 140,
            "{algorithm}: {admitted}"
        );
        assert!(denied_by[0] > 0 && denied_by[1] > 0, "{denied_by:?}");
    }
}

/// The per-second quota's count equals the admissions of its window at
/// every step, not only at the end: no request is taken by the first
/// quota while the second denies it.
#[tokio::test]
async fn a_denial_by_the_second_quota_leaves_the_first_untouched() {
    let clock = clock();
    let store = MemoryStore::with_clock(clock.clone());
    let limiter = Limiter::builder(Quota::per_second(nonzero!(10)))
        .and(Quota::per_minute(nonzero!(3)))
        .store(store.clone())
        .namespace("n")
        .clock(clock.clone())
        .build()
        .unwrap();
    let w = window(now_us(&clock), Duration::from_secs(1));
    for i in 0..8 {
        let d = limiter.check("k", 1).await;
        assert_eq!(d.is_allowed(), i < 3, "request {i}");
        let first = store
            .quota_window_count("n", "k", Algorithm::FixedWindow, 0, w)
            .unwrap_or(0);
        assert_eq!(first, (i + 1).min(3) as i64, "after request {i}");
    }
    let d = limiter.check("k", 1).await;
    assert!(!d.is_allowed());
    // The first quota admitted, then gave its permit back: not an admission.
    assert!(!d.quotas()[0].is_allowed() && !d.quotas()[1].is_allowed());
    assert_eq!(d.quotas()[0].source(), Source::GivenBack);
    assert_eq!(d.quotas()[1].source(), Source::Store);
    let by = d.denied_by().expect("a denial names its quota");
    assert_eq!((by.index, by.name), (1, None));
    assert_eq!(by.decision.limit(), 3);
    assert_eq!(d.limit(), 3, "the binding quota's figures");
    assert!(d.retry_after().unwrap() > Duration::from_secs(1));
}

#[tokio::test]
async fn a_refund_gives_back_to_its_own_window_and_a_late_one_is_ignored() {
    let clock = clock();
    let limiter = Limiter::builder(Quota::per_second(nonzero!(5)))
        .and(Quota::per_minute(nonzero!(100)))
        .namespace("r")
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .build()
        .unwrap();
    let mut admitted = Vec::new();
    for _ in 0..5 {
        let d = limiter.check("k", 1).await;
        assert!(d.is_allowed() && d.is_refundable());
        admitted.push(d);
    }
    assert!(!limiter.check("k", 1).await.is_allowed());
    // Two quotas, one permit each.
    assert_eq!(limiter.refund("k", &admitted[0]).await, 2);
    assert!(
        limiter.check("k", 1).await.is_allowed(),
        "the refund made room"
    );
    assert!(!limiter.check("k", 1).await.is_allowed());
    assert_eq!(limiter.stats().refunded, 2);

    // After the second ends, the per-second refund is ignored (it would
    // inflate a window it did not come from); the minute still takes it.
    clock.advance(Duration::from_secs(1));
    assert_eq!(limiter.refund("k", &admitted[1]).await, 1);
    assert_eq!(limiter.stats().refunds_ignored, 1);
    let mut fresh = 0;
    while limiter.check("k", 1).await.is_allowed() {
        fresh += 1;
    }
    assert_eq!(fresh, 5, "the new window got nothing extra");

    // A denial is not refundable.
    let denied = limiter.check("k", 1).await;
    assert!(!denied.is_refundable());
    assert_eq!(limiter.refund("k", &denied).await, 0);
}

/// A window never ends with more admitted than its limit after refunds,
/// however refunds and requests interleave.
#[tokio::test]
async fn refunds_never_let_a_window_admit_past_its_limit() {
    let clock = clock();
    let limiter = Limiter::builder(Quota::per_second(nonzero!(20)))
        .namespace("rr")
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .build()
        .unwrap();
    let mut net: HashMap<i64, i64> = HashMap::new();
    let mut held: Vec<(i64, slicelimit::Decision)> = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20_000 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let w = window(now_us(&clock), Duration::from_secs(1));
        if rng.is_multiple_of(3) && !held.is_empty() {
            let (from, d) = held.swap_remove((rng as usize / 3) % held.len());
            let back = limiter.refund("k", &d).await as i64;
            if back > 0 {
                assert_eq!(from, w, "only a refund of the current window lands");
                *net.entry(from).or_default() -= back;
            }
        } else {
            let cost = 1 + rng % 2;
            let d = limiter.check("k", cost).await;
            if d.is_allowed() {
                *net.entry(w).or_default() += cost as i64;
                held.push((w, d));
            }
        }
        assert!(net.values().all(|&n| n <= 20), "{net:?}");
        clock.advance(Duration::from_micros(rng % 20_000));
    }
    let stats = limiter.stats();
    assert!(stats.refunded > 0 && stats.refunds_ignored > 0, "{stats:?}");
}

#[tokio::test]
async fn tiers_hold_each_key_to_its_own_quota_and_change_at_run_time() {
    for hybrid in [false, true] {
        let clock = clock();
        let builder = Limiter::builder(Quota::per_second(nonzero!(5))).quota_for(|key| {
            key.starts_with("paid")
                .then(|| Quota::per_second(nonzero!(50)))
        });
        let limiter = on_clock(builder.namespace("t"), &clock, hybrid);
        let admit_all = |key: &'static str| {
            let limiter = limiter.clone();
            async move {
                let mut n = 0;
                for _ in 0..200 {
                    if limiter.check(key, 1).await.is_allowed() {
                        n += 1;
                    }
                }
                n
            }
        };
        assert_eq!(admit_all("free-1").await, 5, "hybrid {hybrid}");
        assert_eq!(admit_all("paid-1").await, 50, "hybrid {hybrid}");
        assert_eq!(limiter.quota_of("paid-1").limit(), 50);
        // free-1 is promoted mid-window: its 5 count against the new 50.
        limiter.set_quota_for(|key| {
            (key.starts_with("paid") || key == "free-1").then(|| Quota::per_second(nonzero!(50)))
        });
        assert_eq!(admit_all("free-1").await, 45, "hybrid {hybrid}");
        // Past the boundary and the hybrid's clock margin around it.
        clock.advance(Duration::from_millis(1_100));
        assert_eq!(admit_all("free-2").await, 5);
        assert_eq!(admit_all("free-1").await, 50);
        limiter.shutdown().await;
    }
}

/// Tiers on a later quota (`and_for`): 100 a second for everyone and a
/// per-minute quota by plan; the binding quota is the key's own, and a
/// paid key's minute is not a free key's.
#[tokio::test]
async fn a_later_quota_has_tiers_of_its_own() {
    for hybrid in [false, true] {
        let clock = clock();
        let builder = Limiter::builder(Quota::per_second(nonzero!(100))).and_for(
            Quota::per_minute(nonzero!(3)),
            |key| {
                key.starts_with("paid")
                    .then(|| Quota::per_minute(nonzero!(30)))
            },
        );
        let limiter = on_clock(builder.namespace("t2"), &clock, hybrid);
        let mut admitted = HashMap::new();
        for key in ["free-1", "paid-1"] {
            let mut n = 0;
            for _ in 0..60 {
                let d = limiter.check(key, 1).await;
                if d.is_allowed() {
                    n += 1;
                    assert_eq!(d.quotas().len(), 2);
                } else {
                    let by = d.denied_by().expect("a denial names its quota");
                    assert_eq!(by.index, 1, "hybrid {hybrid}: {d:?}");
                }
            }
            admitted.insert(key, n);
        }
        assert_eq!(admitted["free-1"], 3, "hybrid {hybrid}");
        assert_eq!(admitted["paid-1"], 30, "hybrid {hybrid}");
        limiter.shutdown().await;
    }
}

/// A key longer than the limiter keeps (it keeps its digest) is still
/// given to the resolver whole: a long API key gets its tier, at the
/// first quota and at a later one, in refunds and `quota_of` too.
#[tokio::test]
async fn a_long_key_gets_its_own_tier() {
    let paid = |key: &str| key.starts_with("paid:");
    let long = format!("paid:{}", "x".repeat(100));
    for hybrid in [false, true] {
        let clock = clock();
        let builder = Limiter::builder(Quota::per_hour(nonzero!(2)))
            .quota_for(move |key| paid(key).then(|| Quota::per_hour(nonzero!(50))))
            .and_for(Quota::per_hour(nonzero!(3)), move |key| {
                paid(key).then(|| Quota::per_hour(nonzero!(40)))
            });
        let limiter = on_clock(builder.namespace("long"), &clock, hybrid);
        assert_eq!(limiter.quota_of(&long).limit(), 50);
        let mut admitted = 0;
        let mut last = None;
        for _ in 0..10 {
            let d = limiter.check(&long, 1).await;
            if d.is_allowed() {
                admitted += 1;
                last = Some(d);
            }
        }
        assert_eq!(admitted, 10, "hybrid {hybrid}");
        let last = last.expect("admitted");
        assert_eq!(last.quotas()[1].limit(), 40, "hybrid {hybrid}");
        // One permit back to each quota.
        assert_eq!(limiter.refund(&long, &last).await, 2, "hybrid {hybrid}");
        limiter.shutdown().await;
    }
}

#[tokio::test]
async fn raising_the_quota_mid_window_admits_the_difference_at_once() {
    let clock = clock();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(10)))
        .namespace("s")
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .build()
        .unwrap();
    let mut n = 0;
    while limiter.check("k", 1).await.is_allowed() {
        n += 1;
    }
    assert_eq!(n, 10);
    limiter.set_quota(Quota::per_minute(nonzero!(15))).unwrap();
    assert_eq!(limiter.quota().limit(), 15);
    let mut more = 0;
    while limiter.check("k", 1).await.is_allowed() {
        more += 1;
    }
    assert_eq!(more, 5, "the new limit applies to what was counted");
    limiter.set_quota(Quota::per_minute(nonzero!(8))).unwrap();
    assert!(!limiter.check("k", 1).await.is_allowed());
    let bad = Quota::new(10, Duration::from_secs(1)).unwrap();
    let bucket = Limiter::builder(bad)
        .store(MemoryStore::new())
        .algorithm(Algorithm::TokenBucket)
        .build()
        .unwrap();
    // A bucket that would take longer than MAX_PERIOD to fill is refused.
    assert!(bucket
        .set_quota(
            Quota::new(1, slicelimit::Quota::MAX_PERIOD)
                .unwrap()
                .with_burst(nonzero!(1_000_000))
        )
        .is_err());
}

#[tokio::test]
async fn check_all_is_all_or_nothing_across_limiters() {
    let clock = clock();
    let store = MemoryStore::with_clock(clock.clone());
    let users = Limiter::builder(Quota::per_second(nonzero!(5)))
        .namespace("user")
        .store(store.clone())
        .clock(clock.clone())
        .build()
        .unwrap();
    let orgs = Limiter::builder(Quota::per_second(nonzero!(8)))
        .namespace("org")
        .store(store.clone())
        .clock(clock.clone())
        .build()
        .unwrap();
    let w = window(now_us(&clock), Duration::from_secs(1));
    let mut admitted = HashMap::new();
    for user in [
        "alice", "bob", "alice", "bob", "alice", "bob", "alice", "bob", "alice", "bob",
    ] {
        let d = check_all(&[(&users, user), (&orgs, "acme")], 1).await;
        if d.is_allowed() {
            *admitted.entry(user).or_insert(0i64) += 1;
        }
    }
    let total: i64 = admitted.values().sum();
    assert_eq!(total, 8, "the organisation binds");
    // A denial's refunds run in a task of their own.
    tokio::time::sleep(Duration::from_millis(20)).await;
    for user in ["alice", "bob"] {
        let counted = store
            .window_count("user", user, Algorithm::FixedWindow, w)
            .unwrap_or(0);
        assert_eq!(
            counted, admitted[user],
            "{user}: a denial by the org took nothing"
        );
    }
    // Refund one admission across both.
    let d = check_all(&[(&users, "carol"), (&orgs, "acme")], 1).await;
    assert!(!d.is_allowed());
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        store
            .window_count("user", "carol", Algorithm::FixedWindow, w)
            .unwrap_or(0),
        0
    );
    clock.advance(Duration::from_secs(1));
    let pairs = [(&users, "carol"), (&orgs, "acme")];
    let d = check_all(&pairs, 1).await;
    assert!(d.is_allowed());
    assert_eq!(refund_all(&pairs, &d).await, 2);
}

/// `check_all` names the limiter that denied, and the pairs that had
/// admitted read as given back, not as admissions.
#[tokio::test]
async fn check_all_names_the_limiter_that_denied() {
    let store = MemoryStore::new();
    let users = Limiter::builder(Quota::per_minute(nonzero!(10)))
        .store(store.clone())
        .namespace("user")
        .build()
        .unwrap();
    let orgs = Limiter::builder(Quota::per_minute(nonzero!(2)))
        .store(store.clone())
        .namespace("org")
        .name("organisation")
        .build()
        .unwrap();
    for user in ["a", "b"] {
        let d = check_all(&[(&users, user), (&orgs, "acme")], 1).await;
        assert!(d.is_allowed() && d.denied_by().is_none());
    }
    let d = check_all(&[(&users, "c"), (&orgs, "acme")], 1).await;
    assert!(!d.is_allowed());
    let by = d.denied_by().expect("denied");
    assert_eq!((by.index, by.name), (1, Some("organisation")));
    assert_eq!(by.decision.limit(), 2);
    assert_eq!(d.quotas()[0].source(), Source::GivenBack);
    assert!(!d.quotas()[0].is_allowed());
    assert_eq!(d.quotas()[0].remaining(), 10, "c's permit went back");
    assert!(!d.is_refundable());

    // A denial by the first pair names it (its namespace: no name given);
    // the second is asked too (for its wait), and what it took goes back.
    let strict = Limiter::builder(Quota::per_minute(nonzero!(1)))
        .store(store)
        .namespace("strict-user")
        .build()
        .unwrap();
    assert!(check_all(&[(&strict, "z"), (&orgs, "other")], 1)
        .await
        .is_allowed());
    let d = check_all(&[(&strict, "z"), (&orgs, "other")], 1).await;
    let by = d.denied_by().expect("denied");
    assert_eq!((by.index, by.name), (0, Some("strict-user")));
    assert_eq!(d.quotas().len(), 2);
    assert!(!d.is_refundable());
    tokio::task::yield_now().await;
    assert!(
        orgs.check("other", 1).await.is_allowed(),
        "the second pair's permit went back"
    );
    assert!(!orgs.check("other", 1).await.is_allowed());

    // Pairs of limiters with several quotas: a given-back pair reads its
    // parts' remaining, and an admission made only of such pairs is
    // refundable.
    let store = MemoryStore::new();
    let two = |ns: &str, minute: u32| {
        Limiter::builder(Quota::per_minute(NonZeroU32::new(minute).unwrap()))
            .and(Quota::per_hour(nonzero!(100)))
            .store(store.clone())
            .namespace(ns)
            .build()
            .unwrap()
    };
    let (user, org) = (two("u2", 50), two("o2", 1));
    let d = check_all(&[(&user, "a"), (&org, "acme")], 1).await;
    assert!(d.is_allowed());
    assert!(d.is_refundable(), "{d:?}");
    assert_eq!(refund_all(&[(&user, "a"), (&org, "acme")], &d).await, 4);
    assert!(check_all(&[(&user, "a"), (&org, "acme")], 1)
        .await
        .is_allowed());
    let d = check_all(&[(&user, "a"), (&org, "acme")], 1).await;
    assert!(!d.is_allowed());
    let pair = &d.quotas()[0];
    assert_eq!(pair.source(), Source::GivenBack);
    let least = pair.quotas().iter().map(|p| p.remaining()).min().unwrap();
    assert_eq!(pair.remaining(), least, "{pair:?}");
    assert_eq!(
        least, 49,
        "a's one permit of the minute counted, this one back"
    );
}
