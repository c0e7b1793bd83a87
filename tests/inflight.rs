//! Concurrency limits across OS processes on one private Redis: the most
//! requests in flight, counted where they run (each request logs when it
//! started and ended; the coordinator overlaps the logs of every
//! process), a process killed with SIGKILL while holding slots, and a
//! request that outlives its lease.
//!
//! This binary is its own harness: run plainly it coordinates; with
//! `--worker` it is one process of the fleet.

use slicelimit_sim as support;

use std::io::{BufRead, BufReader};
use std::num::NonZeroU32;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use slicelimit::ConcurrencyLimiter;
use support::load::wall_us;
use support::RedisServer;

const MAX: u32 = 20;
const PROCESSES: usize = 4;
const TASKS: usize = 50;
const SECONDS: u64 = 30;

fn limiter(store: slicelimit::RedisStore, mode: &str, lease: Duration) -> ConcurrencyLimiter {
    let builder = ConcurrencyLimiter::builder(NonZeroU32::new(MAX).unwrap())
        .store(store)
        .namespace("inflight-test")
        .lease(lease)
        .renew_every(lease / 3);
    match mode {
        "exact" => builder.exact(),
        _ => builder.hybrid(),
    }
    .build()
    .expect("builds")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--worker") {
        worker(&args[at + 1..]);
        return;
    }
    let filters: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with('-')).collect();
    let tests: [(&str, fn()); 6] = [
        (
            "four_processes_never_run_more_than_the_maximum_at_once",
            four_processes,
        ),
        (
            "a_killed_processs_slots_come_back_after_its_lease_and_not_before",
            killed_process,
        ),
        (
            "a_request_that_outlives_its_lease_five_times_keeps_its_slot",
            long_request,
        ),
        (
            "without_redis_the_failure_policy_decides_and_never_exceeds_n_per_process",
            store_down,
        ),
        (
            "at_a_two_millisecond_round_trip_the_bound_holds_and_hybrid_keeps_up",
            round_trip,
        ),
        (
            "a_slot_dropped_in_a_process_is_free_to_it_at_once",
            released_here,
        ),
    ];
    let chosen: Vec<_> = tests
        .iter()
        .filter(|(name, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str())))
        .collect();
    println!("\nrunning {} tests", chosen.len());
    for (name, test) in &chosen {
        test();
        println!("test {name} ... ok");
    }
    println!(
        "\ntest result: ok. {} passed; 0 failed; 0 ignored; 0 measured; {} filtered out\n",
        chosen.len(),
        tests.len() - chosen.len()
    );
}

fn spawn(args: &[String]) -> Child {
    Command::new(std::env::current_exe().expect("own path"))
        .arg("--worker")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a worker process")
}

/// The most intervals overlapping at once, and their mean overlap over
/// `[from, to)` (µs of the wall clock).
fn overlap(intervals: &[(u64, u64)], from: u64, to: u64) -> (u64, f64) {
    let mut edges: Vec<(u64, i64)> = Vec::with_capacity(intervals.len() * 2);
    for &(start, end) in intervals {
        edges.push((start, 1));
        edges.push((end, -1));
    }
    // Ends before starts at the same instant: a slot handed on is not
    // two requests at once.
    edges.sort_unstable();
    let (mut now, mut most, mut area, mut last) = (0i64, 0i64, 0f64, from);
    for (at, step) in edges {
        let at_clamped = at.clamp(from, to);
        area += now as f64 * (at_clamped - last.clamp(from, to)) as f64;
        last = at;
        now += step;
        most = most.max(now);
    }
    (most as u64, area / (to - from) as f64)
}

fn four_processes() {
    let server = RedisServer::start();
    for mode in ["exact", "hybrid"] {
        let start_at = wall_us() + 2_000_000;
        let stop_at = start_at + SECONDS * 1_000_000;
        let children: Vec<Child> = (0..PROCESSES)
            .map(|i| {
                spawn(&[
                    "run".into(),
                    server.url(),
                    mode.into(),
                    start_at.to_string(),
                    stop_at.to_string(),
                    i.to_string(),
                ])
            })
            .collect();
        let mut intervals = Vec::new();
        let (mut calls, mut acquired) = (0u64, 0u64);
        for child in children {
            let out = child.wait_with_output().expect("worker finished");
            assert!(out.status.success(), "a worker failed: {}", out.status);
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let fields: Vec<u64> = line[2..]
                    .split(' ')
                    .map(|f| f.parse().expect("a number"))
                    .collect();
                match &line[..1] {
                    "I" => intervals.push((fields[0], fields[1])),
                    "C" => {
                        calls += fields[0];
                        acquired += fields[1];
                    }
                    _ => {}
                }
            }
        }
        // Demand exceeds 20 throughout: 200 tasks, each wanting a slot
        // again at once. The first and last second are left out.
        let (most, mean) = overlap(&intervals, start_at + 1_000_000, stop_at - 1_000_000);
        let per_1000 = calls as f64 * 1_000.0 / acquired as f64;
        println!(
            "{mode}: {acquired} requests, at most {most} at once, mean {mean:.2} in flight \
             (utilization {:.1} %), {per_1000:.0} store calls per 1,000 acquisitions",
            mean * 100.0 / f64::from(MAX)
        );
        assert!(most <= u64::from(MAX), "{mode}: {most} at once");
        assert!(acquired > 10_000, "{mode}: {acquired} requests");
        if mode == "hybrid" {
            assert!(mean >= 0.9 * f64::from(MAX), "hybrid utilization {mean:.2}");
        }
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

fn killed_process() {
    let server = RedisServer::start();
    let lease = Duration::from_secs(3);
    let renew = lease / 3;
    for mode in ["exact", "hybrid"] {
        let mut child = spawn(&["hold".into(), server.url(), mode.into(), "10".into()]);
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let line = lines.next().expect("a line").expect("readable");
        assert_eq!(line, "HELD 10");
        // Past at least one renewal, then killed.
        std::thread::sleep(Duration::from_millis(1_500));
        child.kill().expect("SIGKILL");
        let killed = Instant::now();
        child.wait().expect("reaped");
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        let recovered = runtime.block_on(async {
            let store = support::store(&server).await;
            let other = limiter(store, mode, lease);
            let mut held = Vec::new();
            let mut most_before_expiry = 0;
            loop {
                while let Ok(permit) = other.try_acquire(mode).await {
                    held.push(permit);
                }
                // Its last renewal was at most `renew` before the kill.
                if killed.elapsed() < lease - renew {
                    most_before_expiry = most_before_expiry.max(held.len());
                }
                if held.len() == MAX as usize {
                    let after = killed.elapsed();
                    drop(held);
                    other.shutdown().await;
                    break (after, most_before_expiry);
                }
                assert!(
                    killed.elapsed() < Duration::from_secs(20),
                    "never recovered"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let (after, before) = recovered;
        println!(
            "{mode}: killed holding 10; all 20 usable again {:.2} s later \
             (lease {lease:?}, renewed every {renew:?}); at most {before} before the expiry",
            after.as_secs_f64()
        );
        assert_eq!(before, 10, "{mode}: the dead process's slots went early");
        assert!(
            after <= lease + renew + Duration::from_millis(300),
            "{mode}: {after:?}"
        );
        assert!(after >= lease - renew, "{mode}: {after:?}");
    }
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

fn long_request() {
    let server = RedisServer::start();
    let lease = Duration::from_secs(1);
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        for mode in ["exact", "hybrid"] {
            let long = limiter(support::store(&server).await, mode, lease);
            let other = limiter(support::store(&server).await, mode, lease);
            let mut slots = Vec::new();
            for _ in 0..MAX {
                slots.push(long.try_acquire(mode).await.expect("a slot"));
            }
            // Five leases and a half: no second holder meanwhile.
            let began = Instant::now();
            while began.elapsed() < lease * 5 + lease / 2 {
                assert!(other.try_acquire(mode).await.is_err(), "{mode}: taken");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            drop(slots);
            let freed = Instant::now();
            let _after = other
                .acquire(mode, Duration::from_secs(3))
                .await
                .expect("free once released");
            println!(
                "{mode}: held {:.1} s on a lease of {lease:?}; free {:.2} s after release",
                began.elapsed().as_secs_f64() - freed.elapsed().as_secs_f64(),
                freed.elapsed().as_secs_f64()
            );
            long.shutdown().await;
            other.shutdown().await;
        }
    });
}

/// Two holders (limiters on their own connections) × 30 tasks through a
/// proxy that delays every byte 1 ms each way; counted where requests run.
fn round_trip() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        let proxy = support::proxy::Proxy::start_delayed(server.port(), Duration::from_millis(1)).await;
        for mode in ["exact", "hybrid"] {
            let running = std::sync::Arc::new((
                std::sync::atomic::AtomicU64::new(0),
                std::sync::atomic::AtomicU64::new(0),
            ));
            let mut limiters = Vec::new();
            for _ in 0..2 {
                let store = slicelimit::RedisStore::connect_with(&proxy.url(), support::test_options())
                    .await
                    .expect("connect");
                limiters.push(limiter(store, mode, Duration::from_secs(3)));
            }
            let until = Instant::now() + Duration::from_secs(5);
            let began = Instant::now();
            let tasks: Vec<_> = (0..60)
                .map(|t| {
                    let limiter = limiters[t % 2].clone();
                    let running = running.clone();
                    let key = format!("rtt-{mode}");
                    tokio::spawn(async move {
                        let (mut done, mut busy) = (0u64, Duration::ZERO);
                        while Instant::now() < until {
                            let Ok(permit) = limiter.acquire(&key, Duration::from_secs(1)).await
                            else {
                                continue;
                            };
                            let now = running.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                            running.1.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                            let start = Instant::now();
                            tokio::time::sleep(Duration::from_millis(5 + (t as u64 * 7 + done) % 46)).await;
                            busy += start.elapsed();
                            running.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                            drop(permit);
                            done += 1;
                        }
                        (done, busy)
                    })
                })
                .collect();
            let (mut done, mut busy) = (0, Duration::ZERO);
            for task in tasks {
                let (d, b) = task.await.expect("a task");
                done += d;
                busy += b;
            }
            let span = began.elapsed();
            let calls: u64 = limiters.iter().map(|l| l.store_calls()).sum();
            let most = running.1.load(std::sync::atomic::Ordering::SeqCst);
            let mean = busy.as_secs_f64() / span.as_secs_f64();
            println!(
                "{mode} at a 2 ms round trip: {done} requests, at most {most} at once, mean {mean:.2} \
                 in flight (utilization {:.1} %), {:.0} store calls per 1,000 acquisitions",
                mean * 100.0 / f64::from(MAX),
                calls as f64 * 1_000.0 / done as f64
            );
            assert!(most <= u64::from(MAX), "{mode}: {most} at once");
            for limiter in limiters {
                limiter.shutdown().await;
            }
        }
    });
}

/// Every slot taken, every permit dropped, every slot taken again at
/// once, many times over: the releases race the takes to Redis and no
/// take may lose (a dropped slot is free to its own process at once).
fn released_here() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        for mode in ["exact", "hybrid"] {
            let mine = limiter(support::store(&server).await, mode, Duration::from_secs(3));
            let other = limiter(support::store(&server).await, mode, Duration::from_secs(3));
            let key = format!("again-{mode}");
            let mut held = Vec::new();
            let (mut refused, rounds) = (0, 200);
            for _ in 0..rounds {
                held.clear();
                for _ in 0..MAX {
                    match mine.try_acquire(&key).await {
                        Ok(permit) => held.push(permit),
                        Err(_) => refused += 1,
                    }
                }
            }
            // The bound: nothing for another holder while all are held.
            let theirs = other.try_acquire(&key).await;
            println!(
                "{mode}: {rounds} rounds of {MAX} taken, dropped and taken again at once: \
                 {refused} refused"
            );
            assert_eq!(refused, 0, "{mode}");
            assert_eq!(held.len(), MAX as usize, "{mode}");
            assert!(theirs.is_err(), "{mode}: another holder got a slot");
            drop(held);
            mine.shutdown().await;
            other.shutdown().await;
        }
    });
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

fn store_down() {
    let mut server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        let options = support::test_options().response_timeout(Duration::from_millis(200));
        let url = server.url();
        let connect = || slicelimit::RedisStore::connect_with(&url, options.clone());
        let builder = |store, policy| {
            ConcurrencyLimiter::builder(NonZeroU32::new(3).unwrap())
                .store(store)
                .namespace("down")
                .on_store_error(policy)
                .build()
                .expect("builds")
        };
        let closed = builder(
            connect().await.expect("connect"),
            slicelimit::FailurePolicy::FailClosed,
        );
        let open = builder(
            connect().await.expect("connect"),
            slicelimit::FailurePolicy::FailOpen,
        );
        let before = closed
            .try_acquire("k")
            .await
            .expect("a slot while Redis is up");
        server.kill();
        let began = Instant::now();
        let refused = closed.try_acquire("k").await;
        assert!(
            matches!(
                refused,
                Err(slicelimit::concurrency::AcquireError::Unavailable { .. })
            ),
            "{refused:?}"
        );
        let mut admitted = Vec::new();
        for _ in 0..10 {
            if let Ok(permit) = open.try_acquire("k").await {
                assert!(permit.is_fallback());
                admitted.push(permit);
            }
        }
        let took = began.elapsed();
        println!(
            "Redis down: fail-closed refused, fail-open admitted {} of 10 (N = 3 per \
             process) in {:.2} s",
            admitted.len(),
            took.as_secs_f64()
        );
        assert_eq!(admitted.len(), 3);
        // Bounded by the store's timeout, not hung.
        assert!(took < Duration::from_secs(10), "{took:?}");
        drop(before);
    });
}

fn worker(args: &[String]) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let store = slicelimit::RedisStore::connect_with(&args[1], support::test_options())
            .await
            .expect("connect");
        match args[0].as_str() {
            "hold" => {
                let limiter = limiter(store, &args[2], Duration::from_secs(3));
                let count: usize = args[3].parse().unwrap();
                let mut held = Vec::new();
                while held.len() < count {
                    held.push(limiter.try_acquire(&args[2]).await.expect("a slot"));
                }
                println!("HELD {count}");
                tokio::time::sleep(Duration::from_secs(3_600)).await;
            }
            _ => run(store, args).await,
        }
    });
}

async fn run(store: slicelimit::RedisStore, args: &[String]) {
    let limiter = limiter(store, &args[2], Duration::from_secs(3));
    let start_at: u64 = args[3].parse().unwrap();
    let stop_at: u64 = args[4].parse().unwrap();
    let seed: u64 = args[5].parse().unwrap();
    while wall_us() < start_at {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let limiter = limiter.clone();
            let mode = args[2].clone();
            tokio::spawn(async move {
                let mut x = (seed * 1_000 + t as u64) | 1;
                let mut out = Vec::new();
                while wall_us() < stop_at {
                    let Ok(permit) = limiter.acquire(&mode, Duration::from_secs(1)).await else {
                        continue;
                    };
                    let start = wall_us();
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    tokio::time::sleep(Duration::from_millis(5 + x % 46)).await;
                    out.push((start, wall_us()));
                    drop(permit);
                }
                out
            })
        })
        .collect();
    let mut lines = String::new();
    let mut acquired = 0;
    for task in tasks {
        for (start, end) in task.await.expect("a task") {
            lines.push_str(&format!("I {start} {end}\n"));
            acquired += 1;
        }
    }
    limiter.shutdown().await;
    lines.push_str(&format!("C {} {acquired}\n", limiter.store_calls()));
    print!("{lines}");
}
