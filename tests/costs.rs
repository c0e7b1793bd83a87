//! Costs known only after the work: charges counted past the limit and
//! reservations settled to the actual cost, in every mode and algorithm,
//! on the embedded store under virtual time, through lost and duplicated
//! replies, and on a real `redis-server`.

use slicelimit_sim as support;

use std::time::Duration;

use slicelimit::limiter::Reserve;
use slicelimit::{nonzero, Algorithm, HybridConfig, Limiter, MemoryStore, Quota};
use support::load::wall_us;
use support::{store, Faults, FaultyStore, RedisServer, VirtualClock};

/// A Unix time 17.3 s into a minute (windows of a minute have 42 s left).
const ORIGIN: Duration = Duration::from_millis(1_700_000_017_300);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Exact,
    Strict,
    Optimistic,
    Local,
}

const MODES: [Mode; 4] = [Mode::Exact, Mode::Strict, Mode::Optimistic, Mode::Local];

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
];

fn build(
    namespace: &str,
    quotas: &[Quota],
    algorithm: Algorithm,
    mode: Mode,
    clock: &VirtualClock,
    store: impl Into<slicelimit::Store>,
) -> Limiter {
    let mut builder = Limiter::builder(quotas[0]).namespace(namespace);
    for q in &quotas[1..] {
        builder = builder.and(*q);
    }
    let builder = builder
        .store(store)
        .clock(clock.clone())
        .algorithm(algorithm);
    match mode {
        Mode::Exact => builder.exact(),
        Mode::Strict => builder.hybrid(HybridConfig::strict()),
        Mode::Optimistic => builder.hybrid(HybridConfig::optimistic(2)),
        Mode::Local => builder.local(),
    }
    .build()
    .unwrap()
}

/// Admissions of cost 1 for `key` until the first denial (at most `bound`).
async fn drain(limiter: &Limiter, key: &str, bound: u64) -> u64 {
    let mut n = 0;
    while n < bound && limiter.check(key, 1).await.is_allowed() {
        n += 1;
    }
    n
}

/// What an optimistic limiter may admit on credit past a limit, per key
/// (its `max_debt`, below); 0 in the other modes.
fn credit(mode: Mode) -> u64 {
    if mode == Mode::Optimistic {
        2
    } else {
        0
    }
}

/// Lets a hybrid limiter's background task send what it was handed.
async fn settle_down() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// A charge past the limit is counted whatever was left, in every mode
/// and algorithm: the next request is denied, and its `retry_after` is
/// true (waited exactly, it is admitted).
#[tokio::test(start_paused = true)]
async fn a_charge_past_the_limit_is_a_debt_the_next_request_waits_out() {
    for algorithm in ALGORITHMS {
        for mode in MODES {
            let clock = VirtualClock::new(ORIGIN);
            let store = MemoryStore::with_clock(clock.clone());
            let what = format!("{algorithm:?} {mode:?}");
            let limiter = build(
                "debt",
                &[Quota::per_minute(nonzero!(100))],
                algorithm,
                mode,
                &clock,
                store,
            );
            assert!(limiter.check("k", 1).await.is_allowed(), "{what}");
            let charge = limiter.charge("k", 500).await;
            if mode == Mode::Exact || mode == Mode::Local {
                assert_eq!(charge.fit(), Some(false), "{what}: {charge:?}");
                assert!(charge.exhausted(), "{what}");
            }
            settle_down().await;
            // Admitted past a debt: at most an optimistic limiter's credit.
            let credit_taken = drain(&limiter, "k", credit(mode) + 1).await;
            assert!(credit_taken <= credit(mode), "{what}: admitted past a debt");
            let denied = limiter.check("k", 1).await;
            assert!(!denied.is_allowed(), "{what}: admitted past a debt");
            let wait = denied.retry_after().expect("a cost of 1 fits some day");
            assert!(wait > Duration::ZERO, "{what}");
            tokio::time::sleep(wait).await;
            let later = limiter.check("k", 1).await;
            assert!(
                later.is_allowed(),
                "{what}: told {wait:?}, then denied: {later:?}"
            );
            assert!(limiter.stats().charged >= 500, "{what}");
            limiter.shutdown().await;
        }
    }
}

/// A charge that fits is counted like admissions of that cost: what is
/// left after it is exactly the limit minus everything charged.
#[tokio::test(start_paused = true)]
async fn a_charge_within_the_budget_takes_exactly_its_cost() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        for mode in MODES {
            let clock = VirtualClock::new(ORIGIN);
            let store = MemoryStore::with_clock(clock.clone());
            let what = format!("{algorithm:?} {mode:?}");
            let limiter = build(
                "fit",
                &[Quota::per_minute(nonzero!(100))],
                algorithm,
                mode,
                &clock,
                store,
            );
            assert_eq!(drain(&limiter, "k", 10).await, 10, "{what}");
            let charge = limiter.charge("k", 30).await;
            assert_ne!(charge.fit(), Some(false), "{what}: {charge:?}");
            settle_down().await;
            let left = drain(&limiter, "k", 1_000).await;
            assert!((60..=60 + credit(mode)).contains(&left), "{what}: {left}");
            limiter.shutdown().await;
        }
    }
}

/// Several quotas are each charged the whole cost.
#[tokio::test(start_paused = true)]
async fn a_charge_counts_against_every_quota() {
    for mode in MODES {
        let clock = VirtualClock::new(ORIGIN);
        let store = MemoryStore::with_clock(clock.clone());
        let limiter = build(
            "several",
            &[
                Quota::per_minute(nonzero!(100)),
                Quota::per_hour(nonzero!(150)),
            ],
            Algorithm::FixedWindow,
            mode,
            &clock,
            store.clone(),
        );
        limiter.charge("k", 120).await;
        settle_down().await;
        let credit_taken = drain(&limiter, "k", 1_000).await;
        assert!(credit_taken <= credit(mode), "{mode:?}: {credit_taken}");
        // The next minute has room, the hour 30 (less what went on credit).
        tokio::time::sleep(Duration::from_secs(43)).await;
        let left = drain(&limiter, "k", 1_000).await + credit_taken;
        assert!((30..=30 + credit(mode)).contains(&left), "{mode:?}: {left}");
        limiter.shutdown().await;
    }
}

/// Reservations settle to the actual cost: the difference goes back, or
/// is charged; dropped, one settles at its estimate.
#[tokio::test(start_paused = true)]
async fn a_reservation_settles_to_the_actual_cost() {
    for mode in MODES {
        for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
            let what = format!("{algorithm:?} {mode:?}");
            let cases: [(&str, Option<u64>, u64); 4] = [
                ("less", Some(40), 1_000 - 40),
                ("more", Some(250), 1_000 - 250),
                ("same", Some(100), 1_000 - 100),
                ("dropped", None, 1_000 - 100),
            ];
            for (name, actual, left) in cases {
                let clock = VirtualClock::new(ORIGIN);
                let store = MemoryStore::with_clock(clock.clone());
                let limiter = build(
                    name,
                    &[Quota::per_minute(nonzero!(1_000))],
                    algorithm,
                    mode,
                    &clock,
                    store,
                );
                let reservation = limiter.reserve("k", 100).await;
                assert!(reservation.is_allowed(), "{what} {name}");
                match actual {
                    Some(actual) => {
                        let settled = reservation.settle(actual).await;
                        assert_eq!(settled.charged, actual.saturating_sub(100), "{what} {name}");
                        if actual < 100 {
                            assert_eq!(settled.given_back, 100 - actual, "{what} {name}");
                        }
                    }
                    None => drop(reservation),
                }
                settle_down().await;
                let got = drain(&limiter, "k", 2_000).await;
                assert!(
                    (left..=left + credit(mode)).contains(&got),
                    "{what} {name}: {got} left, not {left}"
                );
                limiter.shutdown().await;
            }
        }
    }
}

/// A denied reservation took nothing and settles to nothing; its hint is
/// true.
#[tokio::test(start_paused = true)]
async fn a_denied_reservation_takes_nothing() {
    for mode in MODES {
        let clock = VirtualClock::new(ORIGIN);
        let store = MemoryStore::with_clock(clock.clone());
        let limiter = build(
            "denied",
            &[Quota::per_minute(nonzero!(100))],
            Algorithm::FixedWindow,
            mode,
            &clock,
            store,
        );
        assert_eq!(drain(&limiter, "k", 95).await, 95);
        let reservation = limiter.reserve("k", 10).await;
        assert!(!reservation.is_allowed(), "{mode:?}");
        let wait = reservation.decision().retry_after().unwrap();
        let settled = reservation.settle(500).await;
        assert_eq!((settled.charged, settled.given_back), (0, 0), "{mode:?}");
        let left = drain(&limiter, "k", 100).await;
        assert!((5..=5 + credit(mode)).contains(&left), "{mode:?}: {left}");
        tokio::time::sleep(wait).await;
        assert!(limiter.reserve("k", 10).await.is_allowed(), "{mode:?}");
        limiter.shutdown().await;
    }
}

/// A stream charged as it goes: free within the estimate, charged past
/// it, and told to stop once the budget is gone.
#[tokio::test(start_paused = true)]
async fn a_stream_charged_per_frame_is_told_to_stop_when_the_budget_is_gone() {
    for mode in MODES {
        let clock = VirtualClock::new(ORIGIN);
        let store = MemoryStore::with_clock(clock.clone());
        let limiter = build(
            "stream",
            &[Quota::per_minute(nonzero!(300))],
            Algorithm::FixedWindow,
            mode,
            &clock,
            store,
        );
        let mut reservation = limiter.reserve("k", 100).await;
        let mut frames = 0u64;
        loop {
            frames += 1;
            assert!(frames <= 200, "{mode:?}: never told to stop");
            let charge = reservation.consume(10).await;
            if frames * 10 <= 100 {
                assert!(!charge.exhausted(), "{mode:?}: within the estimate");
            }
            if charge.exhausted() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let consumed = reservation.consumed();
        // Told to stop within a frame or two of the budget (a hybrid
        // limiter learns it from the store a round trip later).
        assert!(
            (300..=330).contains(&consumed),
            "{mode:?}: stopped at {consumed}"
        );
        drop(reservation);
        settle_down().await;
        assert!(!limiter.check("k", 1).await.is_allowed(), "{mode:?}");
        limiter.shutdown().await;
    }
}

/// Tokens per minute and per day, and requests per minute: one
/// reservation, all or nothing; only the token quotas settle.
#[tokio::test(start_paused = true)]
async fn a_reservation_across_token_and_request_limiters() {
    for mode in MODES {
        let clock = VirtualClock::new(ORIGIN);
        let store = MemoryStore::with_clock(clock.clone());
        let day = Quota::new(2_500, Duration::from_secs(86_400)).unwrap();
        let tokens = build(
            "tokens",
            &[Quota::per_minute(nonzero!(1_000)), day],
            Algorithm::FixedWindow,
            mode,
            &clock,
            store.clone(),
        );
        let requests = build(
            "requests",
            &[Quota::per_minute(nonzero!(3))],
            Algorithm::FixedWindow,
            mode,
            &clock,
            store.clone(),
        );
        let reserve = || {
            Reserve::new()
                .cost(&tokens, "acme")
                .request(&requests, "acme")
        };
        for _ in 0..3 {
            let r = reserve().reserve(200).await;
            assert!(r.is_allowed(), "{mode:?}");
            r.settle(300).await;
        }
        // The fourth request is over the request limit: denied, nothing taken.
        let r = reserve().reserve(10).await;
        assert!(!r.is_allowed(), "{mode:?}");
        drop(r);
        settle_down().await;
        // 900 tokens used this minute, 100 left.
        let left = drain(&tokens, "acme", 1_000).await;
        assert!(
            (100..=100 + credit(mode)).contains(&left),
            "{mode:?}: {left}"
        );
        tokens.shutdown().await;
        requests.shutdown().await;
    }
}

/// Charges through a store that loses replies after applying them and
/// applies calls twice: each charge is counted exactly once (exact mode
/// resends under the charge's identity).
#[tokio::test(start_paused = true)]
async fn a_charge_delivered_twice_or_resent_counts_once() {
    let clock = VirtualClock::new(ORIGIN);
    let memory = MemoryStore::with_clock(clock.clone());
    let faulty = FaultyStore::new(
        memory.clone(),
        Faults {
            lost_after: 0.4,
            duplicated: 0.4,
            ..Faults::default()
        },
        7,
        clock.clone(),
    );
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000)))
        .namespace("twice")
        .store(faulty.clone())
        .clock(clock.clone())
        .exact()
        .build()
        .unwrap();
    let mut charged = 0;
    for i in 0..40u64 {
        let cost = 1 + i % 7;
        limiter.charge("k", cost).await;
        charged += cost;
    }
    faulty.set_faults(Faults::default());
    // A peek sends whatever is still waiting first.
    limiter.check("k", 0).await;
    let window = (ORIGIN.as_micros() as i64 + 1) / 60_000_000;
    let counted = memory.window_count("twice", "k", Algorithm::FixedWindow, window);
    assert_eq!(counted, Some(charged as i64), "{:?}", faulty.counts());
    assert!(faulty.counts().duplicated > 0 && faulty.counts().lost_after > 0);
}

/// On a real Redis, in exact and hybrid modes: a charge past the limit
/// is counted there, the next request (of any process) is denied, and
/// every key the charge wrote expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_on_redis_is_seen_by_every_process() {
    let server = RedisServer::start();
    // Away from an hour's end: every check below is in one window.
    while wall_us() % 3_600_000_000 > 3_590_000_000 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for algorithm in ALGORITHMS {
        for hybrid in [false, true] {
            let ns = format!("redis-{algorithm:?}-{hybrid}");
            let build = |store| {
                let b = Limiter::builder(Quota::per_hour(nonzero!(100)))
                    .namespace(&ns)
                    .algorithm(algorithm)
                    .store(store);
                if hybrid {
                    b.hybrid(HybridConfig::strict())
                } else {
                    b.exact()
                }
                .build()
                .unwrap()
            };
            let a = build(store(&server).await);
            let b = build(store(&server).await);
            assert!(a.check("k", 1).await.is_allowed());
            assert!(b.check("k", 1).await.is_allowed());
            a.charge("k", 400).await;
            // A hybrid limiter's debt goes with its next round, at the
            // latest when it shuts down.
            a.shutdown().await;
            let what = format!("{algorithm:?} hybrid {hybrid}");
            // What `b` leased before the charge it may still spend (it was
            // granted within the limit); a process that asks now is denied.
            let c = build(store(&server).await);
            assert_eq!(drain(&c, "k", 200).await, 0, "{what}");
            let spent_by_b = drain(&b, "k", 200).await;
            assert!(spent_by_b < 100, "{what}: {spent_by_b}");
            b.shutdown().await;
            c.shutdown().await;
        }
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// A charge of several quotas whose future is dropped while the store
/// has not answered: every quota still counts it (each one's report was
/// made before any was sent, and waits to be resent).
#[tokio::test(start_paused = true)]
async fn a_charge_of_several_quotas_cut_off_midway_counts_in_each() {
    for mode in [Mode::Exact, Mode::Strict] {
        let clock = VirtualClock::new(ORIGIN);
        let slow = FaultyStore::slow(&clock, Duration::from_millis(10));
        let limiter = build(
            "cut",
            &[
                Quota::per_minute(nonzero!(1_000)),
                Quota::per_hour(nonzero!(100)),
            ],
            Algorithm::FixedWindow,
            mode,
            &clock,
            slow,
        );
        let cut = tokio::time::timeout(Duration::from_millis(3), limiter.charge("k", 80)).await;
        assert!(cut.is_err(), "{mode:?}: the charge was not cut off");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(drain(&limiter, "k", 1_000).await, 20, "{mode:?}");
        limiter.shutdown().await;
    }
}

/// An exact limiter's charge that the store did not take is resent on
/// its own (not only before the limiter's next decision) and at shutdown:
/// another process sees it.
#[tokio::test(start_paused = true)]
async fn an_exact_charge_the_store_missed_reaches_it_without_another_decision() {
    for shut_down in [false, true] {
        let clock = VirtualClock::new(ORIGIN);
        let memory = MemoryStore::with_clock(clock.clone());
        let faulty = FaultyStore::new(memory.clone(), Faults::default(), 3, clock.clone());
        let quota = [Quota::per_hour(nonzero!(100))];
        let a = build(
            "missed",
            &quota,
            Algorithm::FixedWindow,
            Mode::Exact,
            &clock,
            faulty.clone(),
        );
        let b = build(
            "missed",
            &quota,
            Algorithm::FixedWindow,
            Mode::Exact,
            &clock,
            memory.clone(),
        );
        faulty.set_faults(Faults {
            lost_before: 1.0,
            ..Faults::default()
        });
        let charge = a.charge("k", 500).await;
        assert_eq!(charge.fit(), None, "the store missed it");
        faulty.set_faults(Faults::default());
        if shut_down {
            a.shutdown().await;
            drop(a);
        } else {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        assert_eq!(drain(&b, "k", 200).await, 0, "shut down {shut_down}");
    }
}

/// A reservation of 0 is asked as 1: a key in debt denies it.
#[tokio::test(start_paused = true)]
async fn a_reservation_of_nothing_is_not_waved_through_a_debt() {
    for mode in MODES {
        let clock = VirtualClock::new(ORIGIN);
        let store = MemoryStore::with_clock(clock.clone());
        let limiter = build(
            "zero",
            &[Quota::per_hour(nonzero!(100))],
            Algorithm::FixedWindow,
            mode,
            &clock,
            store,
        );
        limiter.charge("k", 500).await;
        settle_down().await;
        let mut admitted = 0;
        for _ in 0..10 {
            let r = limiter.reserve("k", 0).await;
            admitted += u64::from(r.is_allowed());
            r.settle(100).await;
        }
        assert!(admitted <= credit(mode), "{mode:?}: {admitted} of 10");
        limiter.shutdown().await;
    }
}

/// A stream charged one unit a frame is told the budget is gone at the
/// frame that spends it, in every mode.
#[tokio::test(start_paused = true)]
async fn the_frame_that_spends_the_budget_is_told_so() {
    for mode in [Mode::Exact, Mode::Strict, Mode::Local] {
        let clock = VirtualClock::new(ORIGIN);
        let store = MemoryStore::with_clock(clock.clone());
        let limiter = build(
            "frames",
            &[Quota::per_hour(nonzero!(100))],
            Algorithm::FixedWindow,
            mode,
            &clock,
            store,
        );
        let mut r = limiter.reserve("k", 1).await;
        let mut told_at = None;
        for frame in 1..=120u64 {
            if r.consume(1).await.exhausted() {
                told_at = Some(frame);
                break;
            }
        }
        assert_eq!(told_at, Some(100), "{mode:?}");
        limiter.shutdown().await;
    }
}

/// A reservation settled into its lease, then its decision refunded: the
/// admission goes back once, whichever comes first.
#[tokio::test(start_paused = true)]
async fn a_settled_reservation_is_not_refunded_again() {
    for mode in MODES {
        for settle_first in [true, false] {
            let clock = VirtualClock::new(ORIGIN);
            let store = MemoryStore::with_clock(clock.clone());
            let limiter = build(
                "once",
                &[Quota::per_hour(nonzero!(100))],
                Algorithm::FixedWindow,
                mode,
                &clock,
                store,
            );
            let r = limiter.reserve("k", 60).await;
            let decision = r.decision().clone();
            let (settled, refunded) = if settle_first {
                let settled = r.settle(0).await.given_back;
                (settled, limiter.refund("k", &decision).await)
            } else {
                let refunded = limiter.refund("k", &decision).await;
                (r.settle(0).await.given_back, refunded)
            };
            assert_eq!(
                settled + refunded,
                60,
                "{mode:?} settle first {settle_first}"
            );
            settle_down().await;
            let left = drain(&limiter, "k", 1_000).await;
            assert!(
                (100..=100 + credit(mode)).contains(&left),
                "{mode:?} settle first {settle_first}: {left} admitted"
            );
            limiter.shutdown().await;
        }
    }
}

/// A receipt written by one process is refunded by another, through the
/// store, in every algorithm and in exact and hybrid mode: what it gives
/// back is what the next process can take, never more than was taken; a
/// receipt of another quota, or of a window that has ended, gives nothing.
#[tokio::test(start_paused = true)]
async fn a_receipt_is_refunded_by_another_process() {
    for algorithm in ALGORITHMS {
        for mode in [Mode::Exact, Mode::Strict] {
            let what = format!("{algorithm:?} {mode:?}");
            let clock = VirtualClock::new(ORIGIN);
            let store = MemoryStore::with_clock(clock.clone());
            let ns = format!("receipt-{algorithm:?}-{mode:?}");
            let quota = Quota::per_minute(nonzero!(1_000));
            let here = build(&ns, &[quota], algorithm, mode, &clock, store.clone());
            // The settling process decides by the store alone.
            let there = build(&ns, &[quota], algorithm, Mode::Exact, &clock, store.clone());
            let decision = here.reserve("k", 800).await;
            assert!(decision.is_allowed(), "{what}");
            let Some(receipt) = decision.decision().receipt() else {
                // A bucket lease is spent locally: no receipt to give.
                assert!(
                    mode == Mode::Strict
                        && matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra),
                    "{what}: no receipt"
                );
                continue;
            };
            let receipt: slicelimit::Receipt = receipt.to_string().parse().unwrap();
            assert_eq!(receipt.cost(), 800, "{what}");
            // Another quota's limiter gives nothing back.
            let other = build(
                &ns,
                &[Quota::per_minute(nonzero!(999))],
                algorithm,
                Mode::Exact,
                &clock,
                store.clone(),
            );
            assert_eq!(other.refund_receipt("k", &receipt, 500).await, 0, "{what}");
            // Never more than was taken.
            assert_eq!(
                there.refund_receipt("k", &receipt, 5_000).await,
                800,
                "{what}"
            );
            drop(decision);
            here.shutdown().await;
            // Everything is back: a new process takes the whole limit.
            let next = build(&ns, &[quota], algorithm, Mode::Exact, &clock, store.clone());
            assert!(next.check("k", 1_000).await.is_allowed(), "{what}");
            // A receipt of a window that has ended gives nothing back.
            if matches!(algorithm, Algorithm::FixedWindow) {
                tokio::time::sleep(Duration::from_secs(60)).await;
                assert_eq!(there.refund_receipt("k", &receipt, 100).await, 0, "{what}");
            }
        }
    }
}

/// Receipts between processes on a real Redis: an exact admission made by
/// one process, written down, and refunded by another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_crosses_processes_on_redis() {
    let server = RedisServer::start();
    while wall_us() % 3_600_000_000 > 3_590_000_000 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let build = |store| {
        Limiter::builder(Quota::per_hour(nonzero!(1_000)))
            .namespace("receipts")
            .store(store)
            .build()
            .unwrap()
    };
    let a = build(store(&server).await);
    let b = build(store(&server).await);
    let decision = a.check("k", 900).await;
    let text = decision.receipt().expect("an exact admission").to_string();
    assert_eq!(
        b.refund_receipt("k", &text.parse().unwrap(), 600).await,
        600
    );
    assert_eq!(b.check("k", 0).await.remaining(), 700);
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// Two hybrid processes; one reserves 800 of 1,000 (its lease takes the
/// whole budget) and 700 go back to the store through a receipt. Then
/// both keep asking for 800 once a second: one is admitted well within
/// the window, minutes before its end, whatever the period. (A request
/// denied counted as use once, and the 200 the first process still held
/// were never trimmed while it kept asking: nothing was admitted for the
/// rest of the window.)
#[tokio::test(start_paused = true)]
async fn what_a_settlement_gives_back_is_not_stranded_by_a_process_still_asking() {
    for period in [Duration::from_secs(60), Duration::from_secs(3_600)] {
        // A second into an hour (and a minute).
        let clock = VirtualClock::new(Duration::from_secs(1_699_999_201));
        let store = MemoryStore::with_clock(clock.clone());
        let quota = Quota::new(1_000, period).unwrap();
        let ns = format!("stranded-{}", period.as_secs());
        let build = |mode| {
            build(
                &ns,
                &[quota],
                Algorithm::FixedWindow,
                mode,
                &clock,
                store.clone(),
            )
        };
        let (a, b, e) = (build(Mode::Strict), build(Mode::Strict), build(Mode::Exact));
        let taken = a.check("k", 800).await;
        assert!(taken.is_allowed());
        settle_down().await;
        let receipt = taken.receipt().expect("a window lease's receipt");
        assert_eq!(e.refund_receipt("k", &receipt, 700).await, 700);
        let mut waited = Duration::ZERO;
        loop {
            if b.check("k", 800).await.is_allowed() || a.check("k", 800).await.is_allowed() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            waited += Duration::from_secs(1);
            assert!(
                waited < Duration::from_secs(45),
                "{period:?}: 800 of the 900 left not admitted after {waited:?}"
            );
        }
    }
}
