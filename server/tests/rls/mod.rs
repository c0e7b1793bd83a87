//! `slicelimit-server` processes and a gRPC client for them.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

use slicelimit_sim::free_port;
use slicelimit_sim::RedisServer;

/// One `slicelimit-server` process.
pub struct RlsServer {
    child: Option<Child>,
    pub grpc_port: u16,
    pub metrics_port: u16,
    log: PathBuf,
}

/// A private directory for one test's files.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "slicelimit-rls-{}-{name}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

impl RlsServer {
    /// Starts the server with `--config config` and `extra` flags and waits
    /// until /healthz answers.
    pub fn start(config: &Path, extra: &[&str]) -> RlsServer {
        let grpc_port = free_port();
        let metrics_port = free_port();
        let log = std::env::temp_dir().join(format!("slicelimit-rls-{grpc_port}.log"));
        let out = std::fs::File::create(&log).expect("create the server's log");
        let child = Command::new(env!("CARGO_BIN_EXE_slicelimit-server"))
            .arg("--config")
            .arg(config)
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(extra)
            .env_remove("REDIS_URL")
            // Generous, as `test_options` gives the tests' own stores: on a
            // loaded machine a call can take longer than the default 25 ms,
            // and the failure policy would decide it (a test about timeouts
            // passes `--redis-timeout`).
            .env("SLICELIMIT_REDIS_TIMEOUT", "2s")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("start slicelimit-server");
        let mut server = RlsServer {
            child: Some(child),
            grpc_port,
            metrics_port,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if server
                .get("/healthz")
                .is_some_and(|(status, _)| status == 200)
            {
                return server;
            }
            if let Some(status) = server
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("slicelimit-server exited ({status}): {}", server.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("slicelimit-server did not become healthy: {}", server.log());
    }

    /// What the server wrote to stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn grpc_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    /// GET on the metrics listener: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let status = response.split(' ').nth(1)?.parse().ok()?;
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Some((status, body))
    }

    /// The value of one series of /metrics (labels as written there, e.g.
    /// `{domain="api",rule="k"}`), 0 when absent.
    pub fn metric(&self, name: &str, labels: &str) -> f64 {
        let (_, body) = self.get("/metrics").expect("scrape /metrics");
        metric_in(&body, name, labels)
    }

    /// Sends SIGTERM and waits for the exit; returns how long it took.
    pub fn terminate(&mut self) -> Duration {
        let child = self.child.as_mut().expect("running");
        let started = Instant::now();
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let status = child.wait().expect("wait for slicelimit-server");
        assert!(status.success(), "exit status {status}: {}", self.log());
        self.child = None;
        started.elapsed()
    }

    /// SIGKILL: the process vanishes without giving anything back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub async fn client(&self) -> RateLimitServiceClient<tonic::transport::Channel> {
        RateLimitServiceClient::connect(self.grpc_url())
            .await
            .expect("connect to slicelimit-server")
    }
}

impl Drop for RlsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// The value of a series in a Prometheus exposition, 0 when absent.
pub fn metric_in(body: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{labels} ");
    body.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().expect("a number"))
}

/// A descriptor of `(key, value)` entries.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request of one hit for `descriptors` in `domain`.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 1,
    }
}

/// Whether a response admits.
pub fn is_ok(response: &RateLimitResponse) -> bool {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    response.overall_code == Code::Ok as i32
}

/// Writes `text` to `path` at once (a new file renamed over the old), as
/// an editor or a deploy tool would.
pub fn write_config(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write the configuration");
    std::fs::rename(&tmp, path).expect("move the configuration into place");
}

/// The service in process, on `redis`, in `mode`, answering from the
/// domain file `config` (fail-closed, as a test wants to see errors).
pub async fn service_on(
    redis: &RedisServer,
    mode: slicelimit_server::table::Mode,
    config: &str,
) -> slicelimit_server::service::RateLimiter {
    use slicelimit_server::table::{Settings, Table};
    let store = slicelimit::RedisStore::connect_with(&redis.url(), slicelimit_sim::test_options())
        .await
        .expect("connect to the test Redis");
    let settings = Settings {
        store: store.into(),
        mode,
        on_store_error: slicelimit::FailurePolicy::FailClosed,
        merge_domains: false,
    };
    let config = slicelimit_server::config::Config::parse("test.yaml", config).expect("parses");
    let (table, _) = Table::build(vec![config], &settings, None).expect("builds");
    slicelimit_server::service::RateLimiter::new(
        std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(table)),
        settings,
    )
}

/// The modes a service test runs in.
pub fn modes() -> [slicelimit_server::table::Mode; 2] {
    use slicelimit_server::table::Mode;
    [Mode::Exact, Mode::HybridStrict]
}

/// Away from an hour's end: every call of a test in one window.
pub async fn in_one_hour() {
    while slicelimit_sim::load::wall_us() % 3_600_000_000 > 3_590_000_000 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
