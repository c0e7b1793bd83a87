//! RLQS through real Envoys: three Envoys with the `rate_limit_quota`
//! filter, two slicelimit-server replicas, one private Redis; one bucket
//! of 100 requests a second with demand split 1 : 3 : 6.

#[path = "support/envoy.rs"]
mod envoy;
#[path = "support/rls.rs"]
mod rls;
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy::Envoy;
use rls::{scratch, write_config, RlsServer};
use support::RedisServer;

const BUCKET: &str = "domain: api\nrlqs:\n  buckets:\n    - match: { name: api }\n      rate_limit: { unit: second, requests_per_unit: 100 }\n  no_match: deny\n";

/// Open-loop load: `rate` requests a second to `envoy` for `user` until
/// `until`, from 4 threads; each answer as (seconds since `start`, passed).
fn load(
    envoy: &Envoy,
    user: &str,
    rate: f64,
    start: Instant,
    until: Duration,
    out: &Mutex<Vec<(usize, f64, bool)>>,
    which: usize,
) {
    let threads = 4;
    std::thread::scope(|scope| {
        for t in 0..threads {
            scope.spawn(move || {
                let gap = Duration::from_secs_f64(threads as f64 / rate);
                let mut next = start + gap.mul_f64(t as f64 / threads as f64);
                while next.duration_since(start) < until {
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    }
                    let reply = envoy.get(user);
                    let at = start.elapsed().as_secs_f64();
                    out.lock().unwrap().push((which, at, reply.status == 200));
                    next += gap;
                }
            });
        }
    });
}

#[test]
fn three_envoys_two_servers_one_bucket_hold_100_a_second_shared_fairly() {
    let redis = RedisServer::start();
    let dir = scratch("rlqs");
    let config = dir.join("api.yaml");
    write_config(&config, BUCKET);
    let flags = ["--redis-url", &redis.url()];
    let servers = [
        RlsServer::start(&config, &flags),
        RlsServer::start(&config, &flags),
    ];
    let envoys = [
        Envoy::start_rlqs(&[servers[0].grpc_port]),
        Envoy::start_rlqs(&[servers[1].grpc_port]),
        Envoy::start_rlqs(&[servers[1].grpc_port]),
    ];
    let seconds: u64 = std::env::var("RLQS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let demand = [30.0, 90.0, 180.0];
    let answers = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (i, envoy) in envoys.iter().enumerate() {
            let answers = answers.clone();
            scope.spawn(move || {
                load(
                    envoy,
                    "alice",
                    demand[i],
                    start,
                    Duration::from_secs(seconds),
                    &answers,
                    i,
                )
            });
        }
    });
    let answers = answers.lock().unwrap().clone();
    let mut per_second = vec![[0usize; 3]; seconds as usize + 1];
    for (which, at, passed) in &answers {
        if *passed {
            per_second[*at as usize][*which] += 1;
        }
    }
    for (s, counts) in per_second.iter().enumerate() {
        eprintln!("second {s}: {counts:?} = {}", counts.iter().sum::<usize>());
    }
    // The bound, in every whole second after the first assignments.
    let assigned = &per_second[1..seconds as usize];
    let worst = assigned
        .iter()
        .map(|c| c.iter().sum::<usize>())
        .max()
        .unwrap();
    let mean = assigned
        .iter()
        .map(|c| c.iter().sum::<usize>())
        .sum::<usize>() as f64
        / assigned.len() as f64;
    eprintln!("seconds 1..{seconds}: worst {worst}, mean {mean:.1}");
    assert!(worst <= 100, "worst second {worst}");
    // Fair shares once each Envoy's demand is known (Envoy 1.40 reports
    // about every 5 s): max-min of what the bound leaves after each
    // Envoy's reserve, 100 - 3 x 2 = 94, for demands of 30, 90 and 180:
    // 30, 32, 32 (the plain max-min shares of 100 are 30, 35, 35).
    let learned = &per_second[seconds as usize / 2..seconds as usize];
    for (i, fair) in [30.0, 32.0, 32.0].into_iter().enumerate() {
        let got = learned.iter().map(|c| c[i]).sum::<usize>() as f64 / learned.len() as f64;
        eprintln!("envoy {i}: {got:.1} a second, fair share {fair}");
        assert!(
            (got - fair).abs() <= fair * 0.1,
            "envoy {i}: {got:.1} against {fair}"
        );
    }
}
