//! `Limiter::acquire`: waiting out a denial instead of returning it.
//!
//! On the embedded store under Tokio's paused clock (exact virtual time):
//! an immediate admission, a cost that can never pass, a retry beyond the
//! wait, a wait that runs out, and futures dropped mid-wait or inside
//! the store call they make. Against a real, private Redis in real time:
//! four hybrid limiters of fifty waiters each on one key of 100 per
//! second, for ten seconds.

use slicelimit_sim as support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use slicelimit::{nonzero, HybridConfig, Limiter, MemoryStore, Quota, Source};
use support::load::wall_us;
use support::{store, RedisServer, VirtualClock};
use support::{Faults, FaultyStore};

/// A whole ten seconds since the epoch, so windows of 1 s and 10 s start
/// at the origin.
const ORIGIN: Duration = Duration::from_secs(1_700_000_000);

fn virtual_clock() -> VirtualClock {
    VirtualClock {
        origin: ORIGIN,
        start: tokio::time::Instant::now(),
    }
}

/// An exact limiter on the default store (an embedded one on the
/// limiter's clock).
fn exact(quota: Quota, clock: &VirtualClock) -> Limiter {
    Limiter::builder(quota)
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_permit_left_is_admitted_at_once() {
    let clock = virtual_clock();
    let limiter = exact(Quota::per_second(nonzero!(2)), &clock);
    let began = tokio::time::Instant::now();
    let d = limiter.acquire("k", 1, Duration::from_secs(5)).await;
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.remaining(), 1);
    assert_eq!(began.elapsed(), Duration::ZERO);
    let stats = limiter.stats();
    assert_eq!((stats.acquire_waits, stats.acquire_timeouts), (0, 0));
    assert_eq!((stats.allowed, stats.denied), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_cost_above_the_limit_is_denied_at_once() {
    let clock = virtual_clock();
    let limiter = exact(Quota::per_second(nonzero!(2)), &clock);
    let began = tokio::time::Instant::now();
    let d = limiter.acquire("k", 3, Duration::from_secs(3600)).await;
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), None, "it can never pass");
    assert_eq!(began.elapsed(), Duration::ZERO, "no sleep for nothing");
    let stats = limiter.stats();
    assert_eq!((stats.acquire_waits, stats.acquire_timeouts), (0, 0));
    // The budget is whole.
    assert!(limiter.check("k", 2).await.is_allowed());
}

#[tokio::test(start_paused = true)]
async fn a_retry_beyond_the_wait_is_denied_at_once() {
    let clock = virtual_clock();
    let limiter = exact(Quota::new(1, Duration::from_secs(10)).unwrap(), &clock);
    assert!(limiter.check("k", 1).await.is_allowed());
    let began = tokio::time::Instant::now();
    let d = limiter.acquire("k", 1, Duration::from_secs(3)).await;
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), Some(Duration::from_secs(10)));
    assert_eq!(began.elapsed(), Duration::ZERO, "no sleep for nothing");
    let stats = limiter.stats();
    assert_eq!((stats.acquire_waits, stats.acquire_timeouts), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_fits_is_admitted_just_after_the_retry_time() {
    let clock = virtual_clock();
    let limiter = exact(Quota::per_second(nonzero!(1)), &clock);
    assert!(limiter.check("k", 1).await.is_allowed());
    let began = tokio::time::Instant::now();
    let d = limiter.acquire("k", 1, Duration::from_secs(2)).await;
    let took = began.elapsed();
    assert!(d.is_allowed(), "{d:?}");
    // The window resets at 1 s; the wake-up is at most 20 ms of jitter
    // (and the timer's 1 ms tick) later.
    assert!(
        took >= Duration::from_secs(1) && took <= Duration::from_millis(1_021),
        "admitted after {took:?}"
    );
    let stats = limiter.stats();
    assert_eq!((stats.acquire_waits, stats.acquire_timeouts), (1, 0));
    // One denial, then the admission: every attempt is a decision.
    assert_eq!((stats.allowed, stats.denied), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_runs_out_returns_the_last_denial_within_max_wait() {
    let clock = virtual_clock();
    let limiter = exact(Quota::per_second(nonzero!(1)), &clock);
    assert!(limiter.check("k", 1).await.is_allowed());
    // Two waiters for the one permit of the next window: one gets it, the
    // other finds it gone with 1.5 s of waiting budgeted and ~0.5 s left.
    let max_wait = Duration::from_millis(1_500);
    let waiter = |limiter: Limiter| {
        tokio::spawn(async move {
            let began = tokio::time::Instant::now();
            let d = limiter.acquire("k", 1, max_wait).await;
            (d, began.elapsed())
        })
    };
    let (a, b) = (waiter(limiter.clone()), waiter(limiter.clone()));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let (won, lost) = if a.0.is_allowed() { (a, b) } else { (b, a) };
    assert!(won.0.is_allowed(), "{won:?}");
    assert!(!lost.0.is_allowed(), "{lost:?}");
    assert!(lost.1 <= max_wait, "the loser returned after {:?}", lost.1);
    assert!(lost.1 >= Duration::from_secs(1), "it waited: {:?}", lost.1);
    let retry = lost.0.retry_after().expect("a denial that says when");
    assert!(retry + lost.1 > max_wait, "{retry:?} would have fitted");
    let stats = limiter.stats();
    assert_eq!((stats.acquire_waits, stats.acquire_timeouts), (2, 1));
}

/// A limiter of 3 per 10 s whose first window is spent at virtual time
/// 0, so an acquire waits for the second (from 10 s on).
async fn spent(hybrid: bool, store: Option<FaultyStore>, clock: &VirtualClock) -> Limiter {
    let builder =
        Limiter::builder(Quota::new(3, Duration::from_secs(10)).unwrap()).clock(clock.clone());
    let builder = match store {
        Some(store) => builder.store(store),
        None => builder.store(MemoryStore::with_clock(clock.clone())),
    };
    let limiter = if hybrid {
        builder
            .hybrid(HybridConfig::strict().lease_bounds(1, 3))
            .build()
            .unwrap()
    } else {
        builder.exact().build().unwrap()
    };
    for _ in 0..3 {
        assert!(limiter.check("k", 1).await.is_allowed());
    }
    limiter
}

/// Runs an acquire until virtual time `drop_at` and drops it if it has
/// not finished; then spends the second window. Returns (permits the
/// acquire was admitted, permits admitted after it).
async fn drop_then_spend(limiter: &Limiter, clock: &VirtualClock, drop_at: Duration) -> (u64, u64) {
    let acquire = limiter.acquire("k", 1, Duration::from_secs(30));
    let taken = match tokio::time::timeout_at(clock.start + drop_at, acquire).await {
        Ok(d) => u64::from(d.is_allowed()),
        Err(_) => 0,
    };
    let second = clock.start + Duration::from_millis(10_100);
    tokio::time::sleep_until(second.max(tokio::time::Instant::now())).await;
    let mut admitted = 0;
    for _ in 0..=3 {
        admitted += u64::from(limiter.check("k", 1).await.is_allowed());
    }
    (taken, admitted)
}

/// Drops an acquire future at many points of its wait (before, during and
/// around the end of its sleep), on the default embedded store, whose
/// calls take no virtual time: the only permits gone are those of the
/// decisions returned.
#[tokio::test(start_paused = true)]
async fn an_acquire_dropped_mid_wait_leaves_the_budget_intact() {
    let mut drops = vec![
        Duration::ZERO,
        Duration::from_millis(1),
        Duration::from_secs(5),
        Duration::from_millis(9_999),
    ];
    // Through the wake-up (10 s plus up to 20 ms of jitter).
    drops.extend((0..=24).map(|ms| Duration::from_millis(10_000 + ms)));
    for hybrid in [false, true] {
        for &drop_at in &drops {
            let clock = virtual_clock();
            let limiter = spent(hybrid, None, &clock).await;
            let (taken, admitted) = drop_then_spend(&limiter, &clock, drop_at).await;
            assert_eq!(
                admitted + taken,
                3,
                "hybrid {hybrid}, dropped at {drop_at:?}: {admitted} admitted after the \
                 drop, {taken} by the acquire"
            );
            limiter.shutdown().await;
        }
    }
}

/// Dropped inside the `check` it makes, an acquire is as cancel-safe as
/// that check: every store call here takes 4 ms of virtual time. Nothing
/// is ever spent twice. A hybrid limiter keeps a refill the dropped check
/// asked for (the sync task installs it), so nothing is lost either; an
/// exact call dropped after the store ran its script has spent its
/// permit, as a dropped `check` would: at most that one.
#[tokio::test(start_paused = true)]
async fn an_acquire_dropped_inside_a_store_call_is_as_safe_as_that_call() {
    let drops = (0..=30).map(|ms| Duration::from_millis(10_000 + ms));
    for hybrid in [false, true] {
        for drop_at in drops.clone() {
            let clock = virtual_clock();
            let store = FaultyStore::new(
                MemoryStore::with_clock(clock.clone()),
                Faults::default(),
                7,
                clock.clone(),
            )
            .with_latency(Duration::from_millis(4));
            let limiter = spent(hybrid, Some(store), &clock).await;
            let (taken, admitted) = drop_then_spend(&limiter, &clock, drop_at).await;
            let what = format!(
                "hybrid {hybrid}, dropped at {drop_at:?}: {admitted} admitted after the \
                 drop, {taken} by the acquire"
            );
            assert!(admitted + taken <= 3, "{what}");
            let lost = if hybrid { 0 } else { 1 };
            assert!(admitted + taken + lost >= 3, "{what}");
            limiter.shutdown().await;
        }
    }
}

/// Admissions per window of a run on Redis.
const LIMIT: u64 = 100;
const PROCESSES: usize = 4;
const TASKS_PER_PROCESS: usize = 50;
const RUN: Duration = Duration::from_secs(10);
const MAX_WAIT: Duration = Duration::from_secs(2);
/// Scheduling slack on a loaded 2-core machine: 200 tasks, four sync
/// tasks and Redis share it.
const MARGIN: Duration = Duration::from_millis(250);

/// One task's run: when it was admitted (wall µs after `acquire`
/// returned), how long its longest acquire took, how many ran out.
#[derive(Debug, Default)]
struct Waiter {
    admitted_at: Vec<u64>,
    longest: Duration,
    denied: u64,
}

/// Jain's fairness index of `xs`: 1 when all are equal, 1/n when one
/// has everything.
fn jain(xs: &[u64]) -> f64 {
    let sum: f64 = xs.iter().map(|&x| x as f64).sum();
    let squares: f64 = xs.iter().map(|&x| (x as f64).powi(2)).sum();
    if squares == 0.0 {
        return 0.0;
    }
    sum * sum / (xs.len() as f64 * squares)
}

/// Four limiters (four processes), each with fifty tasks calling
/// `acquire(key, 1, 2 s)` in a loop on one key of 100 per second, for
/// 10 s. Admissions are attributed to windows as `tests/hybrid.rs` does:
/// by the wall clock (Redis' `TIME` reads the same clock here) when the
/// call returned, with a 20 ms clock margin on the limiters so that a
/// permit of a window is spent at least 20 ms before the window ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_of_fifty_waiters_share_a_key_within_its_limit() {
    let server = RedisServer::start();
    let store = store(&server).await;
    let mut limiters = Vec::new();
    for _ in 0..PROCESSES {
        limiters.push(
            Limiter::builder(Quota::per_second(nonzero!(100)))
                .store(store.clone())
                .namespace("acquire")
                .hybrid(HybridConfig::strict().clock_margin(Duration::from_millis(20)))
                .build()
                .unwrap(),
        );
    }
    // From a window boundary on, so the run covers ten whole windows.
    let period_us = 1_000_000;
    let start_us = (wall_us() / period_us + 1) * period_us;
    let stop_us = start_us + RUN.as_micros() as u64;
    let mut tasks = Vec::new();
    for (p, limiter) in limiters.iter().enumerate() {
        for _ in 0..TASKS_PER_PROCESS {
            let limiter = limiter.clone();
            tasks.push((
                p,
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(start_us.saturating_sub(wall_us())))
                        .await;
                    let mut waiter = Waiter::default();
                    while wall_us() < stop_us {
                        let began = Instant::now();
                        let d = limiter.acquire("hot", 1, MAX_WAIT).await;
                        let at = wall_us();
                        waiter.longest = waiter.longest.max(began.elapsed());
                        if d.is_allowed() {
                            assert_eq!(d.source(), Source::Lease, "{d:?}");
                            waiter.admitted_at.push(at);
                        } else {
                            waiter.denied += 1;
                        }
                    }
                    waiter
                }),
            ));
        }
    }
    let mut waiters: Vec<(usize, Waiter)> = Vec::new();
    for (p, task) in tasks {
        waiters.push((p, task.await.unwrap()));
    }
    for limiter in &limiters {
        limiter.shutdown().await;
    }

    let mut per_window: BTreeMap<i64, u64> = BTreeMap::new();
    for (_, w) in &waiters {
        for at in &w.admitted_at {
            *per_window.entry((at / period_us) as i64).or_default() += 1;
        }
    }
    let (worst_window, worst) = per_window
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(w, n)| (*w, *n))
        .unwrap_or_default();
    assert!(
        worst <= LIMIT,
        "window {worst_window} admitted {worst} > {LIMIT}: {per_window:?}"
    );
    // Whole windows under load: all ten but the first (first leases).
    let first = (start_us / period_us) as i64;
    let full: Vec<i64> = (first + 1..first + RUN.as_secs() as i64).collect();
    let admitted_full: u64 = full
        .iter()
        .map(|w| per_window.get(w).copied().unwrap_or(0))
        .sum();
    let utilization = admitted_full as f64 / (full.len() as u64 * LIMIT) as f64;
    let longest = waiters.iter().map(|(_, w)| w.longest).max().unwrap();
    let per_process: Vec<u64> = (0..PROCESSES)
        .map(|p| {
            waiters
                .iter()
                .filter(|(q, _)| *q == p)
                .map(|(_, w)| w.admitted_at.len() as u64)
                .sum()
        })
        .collect();
    let per_task: Vec<u64> = waiters
        .iter()
        .map(|(_, w)| w.admitted_at.len() as u64)
        .collect();
    let ran_out: u64 = waiters.iter().map(|(_, w)| w.denied).sum();
    let stats: Vec<_> = limiters.iter().map(Limiter::stats).collect();
    println!(
        "acquire: utilization {utilization:.4} over {} windows, worst window {worst}/{LIMIT}, \
         longest acquire {longest:?} (max_wait {MAX_WAIT:?}), {ran_out} waits ran out; \
         per window {per_window:?}",
        full.len()
    );
    println!(
        "fairness: per process {per_process:?} (Jain {:.4}); per task min {} max {} (Jain {:.4}); \
         sleeps {}, timeouts {}, round trips {}",
        jain(&per_process),
        per_task.iter().min().unwrap(),
        per_task.iter().max().unwrap(),
        jain(&per_task),
        stats.iter().map(|s| s.acquire_waits).sum::<u64>(),
        stats.iter().map(|s| s.acquire_timeouts).sum::<u64>(),
        stats.iter().map(|s| s.round_trips).sum::<u64>(),
    );
    assert!(
        utilization >= 0.95,
        "utilization {utilization:.3}: {per_window:?}"
    );
    assert!(
        longest <= MAX_WAIT + MARGIN,
        "an acquire took {longest:?} (max_wait {MAX_WAIT:?})"
    );
    assert_eq!(
        stats.iter().map(|s| s.acquire_timeouts).sum::<u64>(),
        ran_out,
        "every wait that ran out is counted"
    );
    assert!(stats.iter().all(|s| s.acquire_waits > 0), "{stats:?}");
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// One call of a fairness run: when it arrived, when it was answered, and
/// whether it was admitted (virtual µs since the start).
struct Call {
    arrived: u64,
    answered: u64,
    admitted: bool,
}

/// Three workers of one process call `acquire` on one key of 5 per second
/// (2 s each), back to back, for 30 s of virtual time.
async fn three_waiters(limiter: Limiter) -> Vec<Call> {
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs(30);
    let us = move || start.elapsed().as_micros() as u64;
    let mut workers = Vec::new();
    for _ in 0..3 {
        let limiter = limiter.clone();
        workers.push(tokio::spawn(async move {
            let mut calls = Vec::new();
            while tokio::time::Instant::now() < end {
                let arrived = us();
                let d = limiter.acquire("jobs", 1, Duration::from_secs(2)).await;
                calls.push(Call {
                    arrived,
                    answered: us(),
                    admitted: d.is_allowed(),
                });
                // The job's own work.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            calls
        }));
    }
    let mut calls = Vec::new();
    for worker in workers {
        calls.extend(worker.await.unwrap());
    }
    calls
}

/// Within a process, waiters are served in arrival order: no waiter
/// gives up while one that arrived after it is admitted.
fn assert_first_come_first_served(calls: &[Call], what: &str) {
    let admitted = calls.iter().filter(|c| c.admitted).count();
    assert!(
        (140..=155).contains(&admitted),
        "{what}: {admitted} admitted in 30 s of 5 a second"
    );
    for gave_up in calls.iter().filter(|c| !c.admitted) {
        let overtaken = calls
            .iter()
            .find(|c| c.admitted && c.arrived > gave_up.arrived && c.answered < gave_up.answered);
        assert!(
            overtaken.is_none(),
            "{what}: a waiter from {} µs gave up at {} µs while one from {} µs was admitted",
            gave_up.arrived,
            gave_up.answered,
            overtaken.map_or(0, |c| c.arrived)
        );
    }
    let gave_up = calls.iter().filter(|c| !c.admitted).count();
    assert_eq!(gave_up, 0, "{what}: 3 waiters of 2 s on 5 a second all fit");
}

#[tokio::test(start_paused = true)]
async fn waiters_of_one_process_are_served_in_arrival_order() {
    let clock = virtual_clock();
    let calls = three_waiters(exact(Quota::per_second(nonzero!(5)), &clock)).await;
    assert_first_come_first_served(&calls, "exact");

    let clock = virtual_clock();
    let hybrid = Limiter::builder(Quota::per_second(nonzero!(5)))
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock.clone())
        .hybrid(HybridConfig::strict())
        .build()
        .unwrap();
    let calls = three_waiters(hybrid).await;
    assert_first_come_first_served(&calls, "hybrid");
}

/// A waiter whose wait runs out behind the queue's head answers with the
/// head's last denial, without asking (which could take a permit ahead of
/// the head); the queue leaves no entry behind.
#[tokio::test(start_paused = true)]
async fn a_wait_that_runs_out_in_the_queue_does_not_ask() {
    let clock = virtual_clock();
    let limiter = exact(Quota::new(1, Duration::from_secs(10)).unwrap(), &clock);
    assert!(limiter.check("k", 1).await.is_allowed());
    let head = {
        let limiter = limiter.clone();
        tokio::spawn(async move { limiter.acquire("k", 1, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    let asked = limiter.stats().allowed + limiter.stats().denied;
    let behind = limiter.acquire("k", 1, Duration::from_secs(1)).await;
    assert!(!behind.is_allowed());
    assert!(behind.retry_after().is_some());
    assert_eq!(
        limiter.stats().allowed + limiter.stats().denied,
        asked,
        "the waiter behind did not ask"
    );
    let head = head.await.unwrap();
    assert!(head.is_allowed(), "{head:?}");
    let stats = limiter.stats();
    assert_eq!((stats.acquire_waits, stats.acquire_timeouts), (2, 1));
}

/// Behind a waiting head, an acquire with no wait is one check (it may
/// be admitted: it asks for less than the head), and a cost no window can
/// ever admit is denied at once, without waiting its turn.
#[tokio::test(start_paused = true)]
async fn no_wait_and_impossible_costs_do_not_queue() {
    let clock = virtual_clock();
    let limiter = exact(Quota::per_second(nonzero!(10)), &clock);
    assert!(limiter.check("k", 7).await.is_allowed());
    let head = {
        let limiter = limiter.clone();
        tokio::spawn(async move { limiter.acquire("k", 5, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    let began = tokio::time::Instant::now();
    let now = limiter.acquire("k", 1, Duration::ZERO).await;
    assert!(now.is_allowed(), "{now:?}");
    let never = limiter.acquire("k", 11, Duration::from_secs(3)).await;
    assert!(!never.is_allowed());
    assert_eq!(never.retry_after(), None);
    assert_eq!(began.elapsed(), Duration::ZERO, "neither waited its turn");
    assert!(head.await.unwrap().is_allowed());
}
