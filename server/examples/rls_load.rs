//! `ShouldRateLimit` under load: calls per second, p50/p99 of a call and
//! Redis commands per call, exact against hybrid, for slicelimit-server
//! processes on a private `redis-server` (or `REDIS_URL`), on loopback.
//!
//! ```text
//! cargo build --release -p slicelimit-server
//! cargo run --release -p slicelimit-server --example rls_load
//! ```
//!
//! Two loads, each through two server processes (clients alternate):
//! - `long tail`: `--keys N` (10,000) keys picked at random, each far
//!   under its limit of 1,000 a minute; every key is asked once first
//!   (the warm-up), then the measurement;
//! - `hot key`: one key with a limit it never reaches.
//!
//! Flags: `--seconds N` per load and mode (5), `--clients N` concurrent
//! calls (16), `--keys N`, `--modes exact,hybrid-strict,…`.
//! envoyproxy/ratelimit sends two commands per descriptor (`INCRBY` and
//! `EXPIRE`, pipelined) on every call, warm or not.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use hdrhistogram::Histogram;
use tonic::transport::Channel;

const CONFIG: &str = "domain: load\ndescriptors:\n  - key: tail\n    rate_limit: { unit: minute, requests_per_unit: 1000 }\n  - key: hot\n    rate_limit: { unit: minute, requests_per_unit: 1000000000 }\n";

struct Args {
    seconds: u64,
    clients: usize,
    keys: usize,
    modes: Vec<String>,
}

fn args() -> Args {
    let mut args = Args {
        seconds: 5,
        clients: 16,
        keys: 10_000,
        modes: vec!["exact".into(), "hybrid-strict".into()],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--seconds" => args.seconds = value.parse().expect("--seconds N"),
            "--clients" => args.clients = value.parse().expect("--clients N"),
            "--keys" => args.keys = value.parse().expect("--keys N"),
            "--modes" => args.modes = value.split(',').map(str::to_owned).collect(),
            other => panic!("unknown flag {other}"),
        }
    }
    args
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

struct Reaper(Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn wait_for_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Commands Redis ran so far (INFO commandstats, which counts the
/// commands scripts run as well), less the INFOs: (all, scripts).
fn redis_commands(url: &str) -> (u64, u64) {
    let client = redis::Client::open(url).expect("a Redis URL");
    let mut conn = client.get_connection().expect("connect to Redis");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .expect("INFO");
    let mut all = 0;
    let mut scripts = 0;
    for line in info.lines().filter(|l| l.starts_with("cmdstat_")) {
        let (name, rest) = line.split_once(':').unwrap_or((line, ""));
        let calls: u64 = rest
            .split("calls=")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        match name {
            "cmdstat_info" => {}
            "cmdstat_evalsha" | "cmdstat_eval" => {
                scripts += calls;
                all += calls;
            }
            _ => all += calls,
        }
    }
    (all, scripts)
}

fn request(key: &str, value: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "load".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: key.into(),
                value: value.into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

/// Calls for `seconds` with `clients` concurrent callers; returns the
/// calls made, their latency histogram (µs) and how many were denied.
async fn drive(
    channels: &[Channel],
    clients: usize,
    seconds: u64,
    pick: Arc<dyn Fn(u64) -> RateLimitRequest + Send + Sync>,
) -> (u64, Histogram<u64>, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let denied = Arc::new(AtomicU64::new(0));
    let all = Arc::new(Mutex::new(Histogram::<u64>::new(3).expect("a histogram")));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mut client = RateLimitServiceClient::new(channels[c % channels.len()].clone());
        let (stop, calls, denied, all, pick) = (
            stop.clone(),
            calls.clone(),
            denied.clone(),
            all.clone(),
            pick.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut mine = Histogram::<u64>::new(3).expect("a histogram");
            while !stop.load(Ordering::Relaxed) {
                let n = calls.fetch_add(1, Ordering::Relaxed);
                let started = Instant::now();
                let r = client.should_rate_limit(pick(n)).await.expect("an answer");
                let _ = mine.record(started.elapsed().as_micros() as u64);
                if r.into_inner().overall_code != 1 {
                    denied.fetch_add(1, Ordering::Relaxed);
                }
            }
            all.lock().unwrap().add(&mine).expect("same bounds");
        }));
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a client task");
    }
    let histogram = all.lock().unwrap().clone();
    (histogram.len(), histogram, denied.load(Ordering::Relaxed))
}

#[tokio::main]
async fn main() {
    let args = args();
    let me = std::env::current_exe().expect("this program's path");
    let server_bin: PathBuf = me
        .parent()
        .and_then(|examples| examples.parent())
        .map(|dir| dir.join("slicelimit-server"))
        .expect("the target directory");
    assert!(
        server_bin.exists(),
        "{} is missing: cargo build --release -p slicelimit-server",
        server_bin.display()
    );
    let mut redis = Reaper(Vec::new());
    let redis_url = match std::env::var("REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            let port = free_port();
            let child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .stdout(Stdio::null())
                .spawn()
                .expect("redis-server on PATH (apt-get install redis-server), or set REDIS_URL");
            redis.0.push(child);
            wait_for_port(port);
            format!("redis://127.0.0.1:{port}")
        }
    };
    let dir = std::env::temp_dir().join(format!("slicelimit-rls-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let config = dir.join("load.yaml");
    std::fs::write(&config, CONFIG).expect("write the configuration");

    println!(
        "| mode | load | calls/s | p50 µs | p99 µs | scripts per call | Redis commands per call (scripts' own included) | denied |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for mode in &args.modes {
        let mut servers = Reaper(Vec::new());
        let mut channels = Vec::new();
        for _ in 0..2 {
            let port = free_port();
            let child = Command::new(&server_bin)
                .arg("--config")
                .arg(&config)
                .args(["--redis-url", &redis_url, "--mode", mode])
                .args(["--grpc-addr", &format!("127.0.0.1:{port}")])
                .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
                .stderr(Stdio::null())
                .spawn()
                .expect("start slicelimit-server");
            servers.0.push(child);
            wait_for_port(port);
            let channel = Channel::from_shared(format!("http://127.0.0.1:{port}"))
                .expect("a URL")
                .connect()
                .await
                .expect("connect");
            channels.push(channel);
        }
        let run = format!("{mode}-{}", std::process::id());

        // The long tail: warm every key once, then measure.
        let keys = args.keys as u64;
        let prefix = run.clone();
        let warm: Arc<dyn Fn(u64) -> RateLimitRequest + Send + Sync> =
            Arc::new(move |n| request("tail", &format!("{prefix}-{}", n % keys)));
        let mut clients: Vec<_> = channels
            .iter()
            .cloned()
            .map(RateLimitServiceClient::new)
            .collect();
        for k in 0..keys {
            let client = &mut clients[(k % 2) as usize];
            client.should_rate_limit(warm(k)).await.expect("an answer");
        }
        let prefix = run.clone();
        let tail: Arc<dyn Fn(u64) -> RateLimitRequest + Send + Sync> = Arc::new(move |n| {
            // A cheap hash of the call number picks the key.
            let x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
            request("tail", &format!("{prefix}-{}", x % keys))
        });
        report(mode, "long tail", &channels, &args, tail, &redis_url).await;

        let prefix = run.clone();
        let hot: Arc<dyn Fn(u64) -> RateLimitRequest + Send + Sync> =
            Arc::new(move |_| request("hot", &prefix));
        report(mode, "hot key", &channels, &args, hot, &redis_url).await;
        drop(servers);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

async fn report(
    mode: &str,
    load: &str,
    channels: &[Channel],
    args: &Args,
    pick: Arc<dyn Fn(u64) -> RateLimitRequest + Send + Sync>,
    redis_url: &str,
) {
    let before = redis_commands(redis_url);
    let started = Instant::now();
    let (calls, histogram, denied) = drive(channels, args.clients, args.seconds, pick).await;
    let elapsed = started.elapsed().as_secs_f64();
    let after = redis_commands(redis_url);
    let per_call = |n: u64| n as f64 / calls.max(1) as f64;
    println!(
        "| {mode} | {load} | {:.0} | {} | {} | {:.3} | {:.3} | {denied} |",
        calls as f64 / elapsed,
        histogram.value_at_quantile(0.5),
        histogram.value_at_quantile(0.99),
        per_call(after.1 - before.1),
        per_call(after.0 - before.0),
    );
}
