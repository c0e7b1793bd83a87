//! Liveness of the sync engine and the store connection under messy
//! failures: a report that can never apply, a frozen server, a connection
//! that silently stops answering, a background task whose runtime went
//! away. Each on private `redis-server` processes.

use slicelimit_sim as support;

use std::time::{Duration, Instant};

use slicelimit::clock::SystemClock;
use slicelimit::{
    nonzero, store::CircuitConfig, store::RedisOptions, FailurePolicy, HybridConfig, Limiter,
    Quota, RedisStore, Source,
};
use support::proxy::Proxy;
use support::{store, RedisServer};
use support::{Faults, FaultyStore};

/// CPU seconds this process has used so far (user + system).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("procfs");
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn fast_options() -> RedisOptions {
    RedisOptions::default()
        .response_timeout(Duration::from_millis(25))
        .connect_timeout(Duration::from_millis(500))
}

/// A debt report that can never apply (the key holds another type) is
/// dropped and counted: no resend loop, maintenance goes on, shutdown
/// returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_that_can_never_apply_is_dropped_not_resent_forever() {
    let server = RedisServer::start();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(10)))
        .store(store(&server).await)
        .namespace("wrongtype")
        .hybrid(
            HybridConfig::optimistic(5)
                .idle_ttl(Duration::from_millis(200))
                .max_wait(Duration::from_millis(20)),
        )
        .build()
        .unwrap();
    // One reply so first-touch credit knows the window; then exhaust "k".
    assert!(limiter.check("warm", 1).await.is_allowed());
    for _ in 0..10 {
        let _ = limiter.check("k", 1).await;
    }
    let key = server
        .keys()
        .into_iter()
        .find(|k| k.contains("wrongtype:k") && k.ends_with(":fw"))
        .expect("the key");
    let _: i64 = server.cmd(&["DEL", &key]);
    let _: String = server.cmd(&["SET", &key, "not a hash"]);
    let mut credit = 0;
    for _ in 0..5 {
        if limiter.check("k", 1).await.source() == Source::Credit {
            credit += 1;
        }
    }
    let before = server.command_calls("evalsha");
    let cpu = cpu_seconds();
    // Idle eviction queues the debt; the report fails with WRONGTYPE.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let calls = server.command_calls("evalsha") - before;
    let used = cpu_seconds() - cpu;
    assert!(calls < 50, "{calls} script calls in 2 s: a resend loop");
    assert!(used < 0.5, "{used:.2} CPU seconds in 2 s idle");
    assert_eq!(
        limiter.local_keys(),
        0,
        "maintenance still evicts idle keys"
    );
    let began = Instant::now();
    limiter.shutdown().await;
    assert!(began.elapsed() < Duration::from_secs(1));
    let stats = limiter.stats();
    assert!(
        credit == 0 || stats.reports_dropped > 0 || stats.store_errors > 0,
        "{stats:?}"
    );
}

/// With Redis frozen (SIGSTOP) and debt to report, shutdown returns within
/// its bound and does not spin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_promptly_against_a_frozen_server() {
    let server = RedisServer::start();
    let redis = RedisStore::connect_with(&server.url(), fast_options())
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(100)))
        .store(redis)
        .namespace("frozen")
        .hybrid(HybridConfig::optimistic(5).lease_bounds(1, 2))
        .build()
        .unwrap();
    assert!(limiter.check("warm", 1).await.is_allowed());
    for i in 0..200 {
        let _ = limiter.check(&format!("k{}", i % 20), 1).await;
    }
    server.freeze();
    for i in 0..100 {
        let _ = limiter.check(&format!("k{}", i % 20), 1).await;
    }
    let cpu = cpu_seconds();
    let began = Instant::now();
    limiter.shutdown().await;
    let took = began.elapsed();
    let used = cpu_seconds() - cpu;
    server.thaw();
    assert!(took < Duration::from_secs(2), "shutdown took {took:?}");
    assert!(used < 1.0, "{used:.2} CPU seconds during shutdown");
}

/// A fail-closed exact limiter on `server` through a proxy that can
/// blackhole its connections, its first decision made by Redis.
async fn behind_proxy(server: &RedisServer, ns: &str) -> (Proxy, Limiter) {
    let proxy = Proxy::start(server.port()).await;
    let options = fast_options().circuit_breaker(
        CircuitConfig::default()
            .min_span(Duration::ZERO)
            .backoff(Duration::from_millis(50), Duration::from_millis(200)),
    );
    let redis = RedisStore::connect_with(&proxy.url(), options)
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(10_000)))
        .store(redis)
        .namespace(ns)
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    assert_eq!(limiter.check("k", 1).await.source(), Source::Store);
    (proxy, limiter)
}

/// How long until decisions come from Redis again, polling every 10 ms
/// for at most `limit`.
async fn back_on_redis(limiter: &Limiter, limit: Duration) -> Option<Duration> {
    let began = Instant::now();
    while began.elapsed() < limit {
        if limiter.check("k", 1).await.source() == Source::Store {
            return Some(began.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// A connection that silently stops answering is replaced: decisions come
/// from Redis again within seconds, not never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_connection_is_replaced() {
    let server = RedisServer::start();
    let (proxy, limiter) = behind_proxy(&server, "blackhole").await;
    proxy.blackhole_existing();
    let back = back_on_redis(&limiter, Duration::from_secs(5))
        .await
        .expect("decisions never came from Redis again");
    assert!(proxy.connections() >= 2, "a new connection was made");
    println!("back on Redis {back:?} after the blackhole");
}

/// A connection that silently stops answering is replaced even when too
/// few calls reach it to open the breaker (one every 600 ms): answering
/// nothing for a while is evidence enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_connection_is_replaced_at_low_traffic() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let redis = RedisStore::connect_with(&proxy.url(), fast_options())
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(10_000)))
        .store(redis.clone())
        .namespace("quiet")
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    assert_eq!(limiter.check("k", 1).await.source(), Source::Store);
    proxy.blackhole_existing();
    let mut calls = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(600)).await;
        calls += 1;
        if limiter.check("k", 1).await.source() == Source::Store {
            break;
        }
        assert!(calls < 8, "still no answer after {calls} calls");
    }
    assert!(calls >= 2, "one timeout alone replaced the connection");
    assert_eq!(
        redis.circuit_trips(),
        0,
        "too few calls to open the breaker"
    );
    assert!(proxy.connections() >= 2, "a new connection was made");
}

/// A hybrid limiter whose background task died with its runtime restarts
/// it on the caller's runtime, and says so.
#[test]
fn a_sync_task_lost_with_its_runtime_is_restarted() {
    let server = RedisServer::start();
    let url = server.url();
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let limiter = first.block_on(async {
        let redis = RedisStore::connect_with(&url, fast_options())
            .await
            .unwrap();
        let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000)))
            .store(redis)
            .namespace("lost")
            .hybrid(HybridConfig::strict())
            .build()
            .unwrap();
        assert!(limiter.check("a", 1).await.is_allowed());
        limiter
    });
    drop(first);
    let second = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        // The store's connection died with the first runtime too: give it
        // a fresh one, as a service would; the limiter is the same.
        for i in 0..50 {
            let d = limiter.check(&format!("new{}", i % 5), 1).await;
            assert!(d.is_allowed(), "{d:?}");
        }
        let stats = limiter.stats();
        assert_eq!(stats.sync_restarts, 1, "{stats:?}");
        assert!(
            stats.leases > 1,
            "leases came from the restarted task: {stats:?}"
        );
    });
}

/// A connection rebuild started on a runtime that then goes away (a
/// blocking handler's short-lived `block_on`) must not leave the store
/// unable to rebuild again.
#[test]
fn a_rebuild_lost_with_its_runtime_is_retried() {
    let server = RedisServer::start();
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (proxy, limiter) = main.block_on(behind_proxy(&server, "rebuild"));
    proxy.blackhole_existing();
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    assert_ne!(
        other.block_on(limiter.check("k", 1)).source(),
        Source::Store
    );
    drop(other);
    let back = main.block_on(back_on_redis(&limiter, Duration::from_secs(6)));
    assert!(back.is_some(), "the silent connection was never rebuilt");
}

/// A lease whose reply is lost after Redis ran it (a timeout that fired
/// after the store applied the call) is not stranded: the next lease of the
/// key is sent under the lost one's identity and gets that grant back, and
/// a lease delivered twice is granted once. A strict fail-closed limiter
/// alone on its key, with a third of its replies lost and some calls
/// applied twice, still admits its whole budget and Redis counts exactly
/// that (it used to strand a lease per lost reply).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_lost_to_a_timeout_are_recovered() {
    let server = RedisServer::start();
    let faulty = FaultyStore::new(
        store(&server).await,
        Faults {
            lost_after: 0.3,
            duplicated: 0.1,
            ..Faults::default()
        },
        11,
        SystemClock::new(),
    );
    let limit = 1_000;
    let limiter = Limiter::builder(Quota::new(limit, Duration::from_secs(60)).unwrap())
        .store(faulty.clone())
        .namespace("lost")
        .on_store_error(FailurePolicy::FailClosed)
        .hybrid(
            HybridConfig::strict()
                .lease_bounds(50, 50)
                .max_wait(Duration::from_millis(200))
                .prelease_lead(Duration::ZERO),
        )
        .build()
        .unwrap();
    // Keep clear of a window boundary: the test needs one window.
    let into = support::load::wall_us() % 60_000_000;
    if into > 45_000_000 {
        tokio::time::sleep(Duration::from_micros(60_000_000 - into + 100_000)).await;
    }
    let mut admitted = 0u64;
    let mut denied_in_a_row = 0;
    while denied_in_a_row < 50 {
        let d = limiter.check("k", 1).await;
        if d.is_allowed() {
            admitted += 1;
            denied_in_a_row = 0;
        } else {
            denied_in_a_row += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let faults = faulty.counts();
    assert!(faults.lost_after >= 5, "{faults:?}");
    let window = support::load::wall_us() / 60_000_000;
    let counted: u64 = server.cmd(&["HGET", "sl:{lost:k}:fw", &window.to_string()]);
    assert_eq!(
        (admitted, counted),
        (limit, limit),
        "every permit Redis counted was admitted ({faults:?}, {:?})",
        limiter.stats()
    );
}

/// Limiters sharing one `RedisStore` share its connection: each one's
/// pipelines queue behind the others'. A pipeline's timeout allows for
/// every call in flight on the store, so a burst of new keys on two
/// limiters at once times nothing out on a healthy Redis (it used to turn
/// up to every decision into a policy decision).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiters_sharing_a_store_do_not_time_each_other_out() {
    let server = RedisServer::start();
    let store = store(&server).await;
    let limiters: Vec<Limiter> = (0..2)
        .map(|i| {
            Limiter::builder(Quota::per_minute(nonzero!(1_000_000)))
                .store(store.clone())
                .namespace(&format!("shared{i}"))
                .on_store_error(FailurePolicy::FailClosed)
                .hybrid(HybridConfig::strict().max_wait(Duration::from_secs(2)))
                .build()
                .unwrap()
        })
        .collect();
    for l in &limiters {
        assert!(l.check("warm", 1).await.is_allowed());
    }
    for round in 0..3 {
        let mut tasks = tokio::task::JoinSet::new();
        for l in &limiters {
            for i in 0..2_048 {
                let l = l.clone();
                tasks.spawn(async move { l.check(&format!("r{round}-{i}"), 1).await });
            }
        }
        let mut not_leased = 0;
        while let Some(d) = tasks.join_next().await {
            not_leased += usize::from(d.unwrap().source() != Source::Lease);
        }
        assert_eq!(not_leased, 0, "round {round}");
    }
    let errors: u64 = limiters.iter().map(|l| l.stats().store_errors).sum();
    assert_eq!(errors, 0);
}

/// Runs `scenario` on a paused-time runtime of its own in a thread, and
/// fails if it has not finished after `limit` of real time: a decision
/// that spins without letting virtual time move never finishes there.
fn finishes_within(limit: Duration, scenario: impl FnOnce() + Send + 'static) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        scenario();
        let _ = done_tx.send(());
    });
    match done_rx.recv_timeout(limit) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the scenario panicked"),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("still deciding after {limit:?} of real time: a spin")
        }
    }
}

/// A waiter whose cost exceeds what its holding keeps, near the end of a
/// window, must not be answered by asking for the next window (a thin
/// holder's pre-lease the store refuses tells it nothing): it asked again
/// at once, forever, and under paused time the 93rd check never returned.
#[test]
fn a_waiter_near_a_window_end_is_never_answered_by_a_refused_pre_lease() {
    finishes_within(Duration::from_secs(60), || {
        let runtime = support::seeds::paused_runtime();
        runtime.block_on(async {
            let clock = support::VirtualClock::new(Duration::from_millis(1_700_000_017_300));
            let store = slicelimit::MemoryStore::with_clock(clock.clone());
            let limiter = Limiter::builder(Quota::new(5, Duration::from_secs(2)).unwrap())
                .and(Quota::new(17, Duration::from_secs(2)).unwrap())
                .and(Quota::per_minute(nonzero!(16)))
                .algorithm(slicelimit::Algorithm::FixedWindow)
                .hybrid(HybridConfig::strict())
                .store(store)
                .clock(clock)
                .build()
                .unwrap();
            for _ in 0..200 {
                limiter.check("k", 2).await;
                tokio::time::sleep(Duration::from_millis(964)).await;
            }
        });
    });
}

/// Waiters in the last milliseconds of a window, when its lease there is
/// void (past its deadline, the clock margin before the window's end),
/// are served by the next window within a few store calls, and in the
/// time paused runtime lets pass (a waiter that asks again on every
/// refill, without letting time move, never returns there).
#[test]
fn waiters_in_a_window_s_void_end_are_served_by_the_next_window() {
    finishes_within(Duration::from_secs(60), || {
        let runtime = support::seeds::paused_runtime();
        runtime.block_on(async {
            // The start of a minute.
            let clock = support::VirtualClock::new(Duration::from_secs(1_700_000_040));
            let store = slicelimit::MemoryStore::with_clock(clock.clone());
            let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000_000)))
                .algorithm(slicelimit::Algorithm::FixedWindow)
                .hybrid(HybridConfig::strict())
                .store(store)
                .clock(clock)
                .build()
                .unwrap();
            // A steady key: 1,000 a request, ten requests a second.
            for _ in 0..599 {
                assert!(limiter.check("k", 1_000).await.is_allowed());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // 2 ms before the minute ends: more than the lease holds.
            tokio::time::sleep(Duration::from_millis(98)).await;
            let before = limiter.stats().store_calls;
            let (a, b, c) = tokio::join!(
                limiter.check("k", 150_000),
                limiter.check("k", 140_000),
                limiter.check("k", 200_000)
            );
            let calls = limiter.stats().store_calls - before;
            assert!(calls <= 4, "{calls} store calls for three requests");
            for decision in [a, b, c] {
                assert!(decision.is_allowed(), "{decision:?}");
                assert_eq!(decision.reset_after().as_secs(), 59, "{decision:?}");
            }
        });
    });
}
