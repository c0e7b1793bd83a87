//! The strict hybrid fleet as four separate OS processes sharing one
//! private Redis: the same bound as `tests/hybrid.rs`, with nothing shared
//! but the store.
//!
//! This binary is its own harness: run plainly it coordinates; with
//! `--worker` it is one server of the fleet.

use slicelimit_sim as support;

use std::process::{Command, Stdio};
use std::time::Duration;

use slicelimit::{HybridConfig, Limiter, Quota};
use support::load::{drive, wall_us, LoadSpec, Tally};
use support::RedisServer;

const NAME: &str = "strict_fleet_of_four_processes_never_exceeds_the_limit";
const FLEET: usize = 4;

fn spec() -> LoadSpec {
    LoadSpec {
        keys: 60,
        limit: 100,
        period: Duration::from_secs(1),
        demand_factor: 3.0,
        duration: Duration::from_millis(7_500),
        tick: Duration::from_millis(10),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--worker") {
        worker(
            &args[at + 1],
            args[at + 2].parse().unwrap(),
            args[at + 3].parse().unwrap(),
        );
        return;
    }
    let filters: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with('-')).collect();
    if !filters.is_empty() && !filters.iter().any(|f| NAME.contains(f.as_str())) {
        println!("\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out\n");
        return;
    }
    println!("\nrunning 1 test");
    coordinate();
    println!("test {NAME} ... ok\n\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n");
}

fn coordinate() {
    let server = RedisServer::start();
    let spec = spec();
    // Start together once every process is up.
    let stop_at = wall_us() + 2_000_000 + spec.duration.as_micros() as u64;
    let exe = std::env::current_exe().expect("own path");
    let children: Vec<_> = (0..FLEET)
        .map(|i| {
            Command::new(&exe)
                .arg("--worker")
                .arg(server.url())
                .arg(stop_at.to_string())
                .arg((0xA5A5 + i).to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn a worker process")
        })
        .collect();
    let mut tally = Tally::default();
    for child in children {
        let out = child.wait_with_output().expect("worker finished");
        assert!(out.status.success(), "a worker failed: {}", out.status);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            tally.parse_line(line);
        }
    }
    let ((key, window), worst) = tally.worst();
    assert!(
        worst <= spec.limit,
        "key {key} admitted {worst} in window {window}"
    );
    assert!(
        tally.full_windows().len() >= 5,
        "{:?}",
        tally.full_windows()
    );
    let (utilization, cells) = tally.utilization(spec.limit);
    println!(
        "4 processes: worst {worst}/{}, utilization {utilization:.4} over {cells} saturated cells",
        spec.limit
    );
    assert!(cells >= 100, "{cells} saturated cells");
    assert!(utilization >= 0.95, "utilization {utilization:.3}");
    assert_eq!(server.immortal_keys(), Vec::<String>::new());
}

fn worker(url: &str, stop_at: u64, seed: u64) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let spec = spec();
        let store = slicelimit::RedisStore::connect_with(url, support::test_options())
            .await
            .expect("connect");
        let limiter = Limiter::builder(Quota::new(spec.limit, spec.period).unwrap())
            .store(store)
            .namespace("multiprocess")
            .hybrid(HybridConfig::strict().clock_margin(Duration::from_millis(20)))
            .build()
            .unwrap();
        let start_at = stop_at - spec.duration.as_micros() as u64;
        while wall_us() < start_at {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let tally = drive(limiter.clone(), spec, 1.0 / FLEET as f64, seed, stop_at).await;
        limiter.shutdown().await;
        print!("{}", tally.to_lines());
    });
}
