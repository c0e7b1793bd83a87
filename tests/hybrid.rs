//! The hybrid limiter against real, private Redis servers: bounds on what
//! a fleet admits, round trips, denied traffic and shutdown.

use slicelimit_sim as support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slicelimit::{Algorithm, HybridConfig, Limiter, Quota, Source};
use support::load::{drive, key_name, wall_us, LoadSpec, Tally};
use support::{store, RedisServer};

const FLEET: usize = 4;

fn spec() -> LoadSpec {
    LoadSpec {
        keys: 50,
        limit: 100,
        period: Duration::from_secs(1),
        demand_factor: 3.0,
        duration: Duration::from_millis(7_500),
        tick: Duration::from_millis(10),
    }
}

/// A 20 ms margin keeps the wall-clock attribution of admissions to
/// windows honest on a loaded machine (see `support::load`).
fn test_config(config: HybridConfig) -> HybridConfig {
    config.clock_margin(Duration::from_millis(20))
}

async fn fleet(
    server: &RedisServer,
    spec: LoadSpec,
    config: HybridConfig,
    ns: &str,
) -> Vec<Limiter> {
    let mut limiters = Vec::new();
    for _ in 0..FLEET {
        limiters.push(
            Limiter::builder(Quota::new(spec.limit, spec.period).unwrap())
                .store(store(server).await)
                .namespace(ns)
                .hybrid(test_config(config.clone()))
                .build()
                .unwrap(),
        );
    }
    limiters
}

async fn run_fleet(limiters: &[Limiter], spec: LoadSpec) -> Tally {
    let stop_at = wall_us() + spec.duration.as_micros() as u64;
    let mut tasks = Vec::new();
    for (i, limiter) in limiters.iter().enumerate() {
        tasks.push(tokio::spawn(drive(
            limiter.clone(),
            spec,
            1.0 / FLEET as f64,
            0x9E37_79B9 + i as u64,
            stop_at,
        )));
    }
    let mut total = Tally::default();
    for t in tasks {
        total.merge(&t.await.unwrap());
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_fleet_never_exceeds_the_limit_and_uses_nearly_all_of_it() {
    let server = RedisServer::start();
    let spec = spec();
    let limiters = fleet(&server, spec, HybridConfig::strict(), "strict").await;
    let tally = run_fleet(&limiters, spec).await;
    for l in &limiters {
        l.shutdown().await;
    }
    let ((key, window), worst) = tally.worst();
    assert!(
        worst <= spec.limit,
        "key {key} admitted {worst} > {} in window {window}",
        spec.limit
    );
    assert!(
        tally.full_windows().len() >= 5,
        "{:?}",
        tally.full_windows()
    );
    let (utilization, cells) = tally.utilization(spec.limit);
    assert!(cells >= 5 * 20, "{cells} saturated (key, window) cells");
    assert!(
        utilization >= 0.95,
        "utilization {utilization:.3} over {cells} cells"
    );
    println!(
        "strict: worst {worst}/{}, utilization {utilization:.4} over {cells} cells",
        spec.limit
    );
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

/// Reads every key's per-window counts as the run goes, keeping the largest
/// value seen per (key, window): windows are dropped from the hash two
/// windows later, after their last possible write.
fn watch_counts(
    server: &RedisServer,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<HashMap<(String, i64), i64>> {
    let mut conn = server.conn();
    std::thread::spawn(move || {
        let mut seen: HashMap<(String, i64), i64> = HashMap::new();
        loop {
            let done = stop.load(Ordering::Acquire);
            let keys: Vec<String> = redis::cmd("KEYS").arg("sl:*").query(&mut conn).unwrap();
            for key in keys {
                // Values as text: besides window counts the hash holds
                // holder records ("g<holder>" = "id granted window").
                let fields: HashMap<String, String> = redis::cmd("HGETALL")
                    .arg(&key)
                    .query(&mut conn)
                    .unwrap_or_default();
                for (field, count) in fields {
                    if let (Ok(window), Ok(count)) = (field.parse::<i64>(), count.parse::<i64>()) {
                        let cell = seen.entry((key.clone(), window)).or_insert(0);
                        *cell = (*cell).max(count);
                    }
                }
            }
            if done {
                return seen;
            }
            std::thread::sleep(Duration::from_millis(15));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_fleet_overshoot_is_bounded_and_fully_counted() {
    let server = RedisServer::start();
    let spec = spec();
    let max_debt = 5;
    let limiters = fleet(
        &server,
        spec,
        HybridConfig::optimistic(max_debt),
        "optimistic",
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_counts(&server, stop.clone());
    let tally = run_fleet(&limiters, spec).await;
    for l in &limiters {
        l.shutdown().await;
    }
    stop.store(true, Ordering::Release);
    let counts = watcher.join().unwrap();

    let bound = spec.limit + FLEET as u64 * max_debt;
    let ((key, window), worst) = tally.worst();
    let store_key = counts.keys().map(|(k, _)| k.clone()).find(|k| {
        k.contains(&format!("%3a{}{}", key_name(key), "}"))
            || k.contains(&format!(":{}}}", key_name(key)))
    });
    assert!(
        worst <= bound,
        "key {key} admitted {worst} > {bound} in window {window}; Redis counted {:?}; per window {:?}",
        store_key.and_then(|k| counts.get(&(k, window)).copied()),
        tally.cells.iter().filter(|((k, _), _)| *k == key).collect::<Vec<_>>()
    );
    let counted: u64 = limiters.iter().map(|l| l.stats().overshoot).sum();
    let recorded: i64 = counts
        .values()
        .map(|c| (c - spec.limit as i64).max(0))
        .sum();
    // Every permit beyond the limit is counted. Redis' own excess can end
    // lower: permits given back after a window went over (shutdown, idle
    // keys) lower its count, not the metric.
    let given_back: u64 = limiters.iter().map(|l| l.stats().given_back).sum();
    assert!(
        counted >= recorded as u64 && counted <= recorded as u64 + given_back,
        "limiters' overshoot {counted} vs Redis' excess {recorded} (given back {given_back})"
    );
    let credit: u64 = limiters.iter().map(|l| l.stats().credit_admitted).sum();
    let (utilization, cells) = tally.utilization(spec.limit);
    println!(
        "optimistic: worst {worst}/{bound}, overshoot {counted} (= Redis {recorded}), credit {credit}, utilization {utilization:.4} over {cells} cells"
    );
    assert!(utilization >= 0.95, "utilization {utilization:.3}");
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_costs_at_most_ten_round_trips_per_thousand_decisions() {
    let server = RedisServer::start();
    let limiter = Limiter::builder(Quota::new(10_000_000, Duration::from_secs(60)).unwrap())
        .store(store(&server).await)
        .namespace("hot")
        .hybrid(HybridConfig::strict())
        .build()
        .unwrap();
    // Warm up, then measure a steady stretch: 20 000 decisions/s for 2 s.
    for _ in 0..2_000 {
        limiter.check("hot", 1).await;
    }
    let before = limiter.stats();
    let mut ticker = tokio::time::interval(Duration::from_millis(5));
    for _ in 0..400 {
        ticker.tick().await;
        for _ in 0..100 {
            assert!(limiter.check("hot", 1).await.is_allowed());
        }
    }
    let after = limiter.stats();
    let decisions = after.allowed - before.allowed;
    let trips = after.round_trips - before.round_trips;
    let per_thousand = trips as f64 * 1000.0 / decisions as f64;
    println!("{trips} round trips for {decisions} decisions: {per_thousand:.2} per 1000");
    assert_eq!(decisions, 40_000);
    assert!(
        per_thousand <= 10.0,
        "{per_thousand:.2} round trips per 1000 decisions"
    );
    limiter.shutdown().await;
}

#[tokio::test]
async fn an_exhausted_key_is_denied_without_round_trips_until_its_reset() {
    let server = RedisServer::start();
    for algorithm in Algorithm::all() {
        let limiter = Limiter::builder(Quota::new(20, Duration::from_secs(3600)).unwrap())
            .store(store(&server).await)
            .algorithm(algorithm)
            .namespace(&format!("denied-{}", algorithm.as_str()))
            .hybrid(HybridConfig::strict())
            .build()
            .unwrap();
        let mut admitted = 0;
        for _ in 0..40 {
            if limiter.check("k", 1).await.is_allowed() {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 20, "{algorithm:?}");
        let before = limiter.stats().round_trips;
        let commands = server.command_calls("evalsha");
        for _ in 0..10_000 {
            let d = limiter.check("k", 1).await;
            assert!(!d.is_allowed());
            assert_eq!(d.source(), Source::DeniedCache);
            assert!(d.retry_after().unwrap() > Duration::ZERO);
        }
        assert_eq!(limiter.stats().round_trips, before, "{algorithm:?}");
        assert_eq!(
            server.command_calls("evalsha"),
            commands,
            "Redis saw nothing"
        );
        limiter.shutdown().await;
    }
}

#[tokio::test]
async fn after_shutdown_redis_holds_exactly_what_was_admitted() {
    let server = RedisServer::start();
    for algorithm in Algorithm::all() {
        let quota = Quota::new(1_000, Duration::from_secs(3600)).unwrap();
        let ns = format!("shutdown-{}", algorithm.as_str());
        let limiters: Vec<Limiter> = {
            let mut v = Vec::new();
            for _ in 0..FLEET {
                v.push(
                    Limiter::builder(quota)
                        .store(store(&server).await)
                        .algorithm(algorithm)
                        .namespace(&ns)
                        .hybrid(HybridConfig::strict().lease_bounds(50, 200))
                        .build()
                        .unwrap(),
                );
            }
            v
        };
        let mut admitted = 0u64;
        for i in 0..333 {
            if limiters[i % FLEET].check("k", 1).await.is_allowed() {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 333);
        let leased: u64 = limiters.iter().map(|l| l.stats().permits_leased).sum();
        assert!(leased > admitted, "permits were leased ahead of use");
        for l in &limiters {
            l.shutdown().await;
        }
        let exact = Limiter::builder(quota)
            .store(store(&server).await)
            .algorithm(algorithm)
            .namespace(&ns)
            .build()
            .unwrap();
        let remaining = exact.try_check("k", 0).await.unwrap().remaining();
        let stranded: u64 = limiters.iter().map(|l| l.stats().stranded).sum();
        match algorithm {
            Algorithm::FixedWindow | Algorithm::SlidingWindow => assert_eq!(
                remaining,
                1_000 - admitted,
                "{algorithm:?}: nothing stranded"
            ),
            // A bucket takes back only what it could have held had the
            // lease never been taken: with the whole fleet giving back at
            // once, each give-back counts the others' as possible level, so
            // some permits strand (counted) rather than risk the cap.
            _ => {
                assert!(
                    remaining <= 1_000 - admitted + 1,
                    "{algorithm:?}: {remaining}"
                );
                assert!(
                    remaining + stranded + 1 >= 1_000 - admitted,
                    "{algorithm:?}: {remaining} + {stranded} stranded"
                );
            }
        }
    }
}

#[tokio::test]
async fn local_clocks_30_s_apart_agree_on_windows() {
    let server = RedisServer::start();
    let quota = Quota::new(50, Duration::from_secs(2)).unwrap();
    let mut limiters = Vec::new();
    for offset in [0u64, 30] {
        let clock = OffsetClock(Duration::from_secs(offset));
        limiters.push(
            Limiter::builder(quota)
                .store(store(&server).await)
                .namespace("clocks")
                .clock(clock)
                .hybrid(test_config(HybridConfig::strict()))
                .build()
                .unwrap(),
        );
    }
    let period_us = 2_000_000;
    let mut per_window: HashMap<u64, u64> = HashMap::new();
    let stop_at = wall_us() + 5_000_000;
    let mut i = 0;
    while wall_us() < stop_at {
        let d = limiters[i % 2].check("k", 1).await;
        if d.is_allowed() {
            *per_window.entry(wall_us() / period_us).or_default() += 1;
        }
        i += 1;
        if i % 20 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert!(per_window.len() >= 2);
    assert!(per_window.values().all(|n| *n <= 50), "{per_window:?}");
    let full: Vec<u64> = per_window.values().copied().filter(|n| *n == 50).collect();
    assert!(
        !full.is_empty(),
        "some window used its whole budget: {per_window:?}"
    );
}

/// A monotonic clock shifted by a fixed offset: a process whose local time
/// disagrees with everyone else's.
struct OffsetClock(Duration);

impl slicelimit::clock::Clock for OffsetClock {
    fn now(&self) -> Duration {
        static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        BASE.get_or_init(std::time::Instant::now).elapsed() + self.0
    }
}

/// Threads racing for one hot key each spend a stock of its permits of
/// their own (the slot's count is written once per stock, not once per
/// decision); every permit the store granted is still spent at most once.
/// Two limiters, two threads each, drain a key's whole hour.
#[test]
fn threads_racing_for_one_hot_key_admit_at_most_what_the_store_granted() {
    const LIMIT: u64 = 20_000;
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let limiters: Vec<Limiter> = rt.block_on(async {
        let mut limiters = Vec::new();
        for _ in 0..2 {
            limiters.push(
                Limiter::builder(Quota::new(LIMIT, Duration::from_secs(3600)).unwrap())
                    .store(store(&server).await)
                    .namespace("racing")
                    .hybrid(HybridConfig::strict())
                    .build()
                    .unwrap(),
            );
        }
        limiters
    });
    let threads: Vec<_> = limiters
        .iter()
        .flat_map(|l| [l.clone(), l.clone()])
        .map(|limiter| {
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let (mut admitted, mut denied_since) = (0u64, None);
                    // Until denied for 300 ms on end: refills in flight land.
                    loop {
                        if limiter.check("hot", 1).await.is_allowed() {
                            admitted += 1;
                            denied_since = None;
                        } else {
                            let since = *denied_since.get_or_insert_with(std::time::Instant::now);
                            if since.elapsed() > Duration::from_millis(300) {
                                return admitted;
                            }
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
        })
        .collect();
    let admitted: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let stranded: u64 = limiters.iter().map(|l| l.stats().stranded).sum();
    rt.block_on(async {
        for l in &limiters {
            l.shutdown().await;
        }
    });
    assert!(admitted <= LIMIT, "admitted {admitted} > {LIMIT}");
    // Stocks left when the threads stopped, and permits stranded on the
    // way, are all that is missing.
    assert!(
        admitted + stranded + 4 * 64 >= LIMIT,
        "admitted {admitted}, stranded {stranded} of {LIMIT}"
    );
    println!("racing threads: admitted {admitted} of {LIMIT}, stranded {stranded}");
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}
