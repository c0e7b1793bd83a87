//! The server process: flags, the two listeners, reloads and shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;

use crate::files;
use crate::rlqs::Rlqs;
use crate::service::{HeaderNames, RateLimiter};
use crate::stats;
use crate::store_watch;
use crate::table::{Mode, Settings};
use slicelimit::metrics::PrometheusExporter;
use slicelimit::FailurePolicy;
use slicelimit::{store::RedisOptions, MemoryStore, Store};
use slicelimit::{Error, ErrorKind};

/// How long a shutdown waits for calls in flight before it closes their
/// connections, and then again for the leased permits to go back.
pub const SHUTDOWN_STEP: Duration = Duration::from_secs(5);

/// The command line of `slicelimit-server`; every flag can also come
/// from the environment variable named beside it.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "slicelimit-server",
    version,
    about = "Envoy's rate limit service (envoy.service.ratelimit.v3) on leased slices of Redis budgets"
)]
pub struct Options {
    /// A YAML file in envoyproxy/ratelimit's format, or a directory of
    /// them (one domain per file). Changes apply within a second. Without
    /// it, envoyproxy/ratelimit's layout: RUNTIME_ROOT, then
    /// RUNTIME_SUBDIRECTORY if set, then RUNTIME_APPDIRECTORY.
    #[arg(long, env = "SLICELIMIT_CONFIG")]
    pub config: Option<PathBuf>,
    /// envoyproxy/ratelimit's configuration root (used without --config).
    #[arg(long, env = "RUNTIME_ROOT")]
    pub runtime_root: Option<PathBuf>,
    /// The directory under --runtime-root, if any.
    #[arg(long, env = "RUNTIME_SUBDIRECTORY")]
    pub runtime_subdirectory: Option<PathBuf>,
    /// The directory of the configuration files under them.
    #[arg(long, env = "RUNTIME_APPDIRECTORY", default_value = "config")]
    pub runtime_appdirectory: PathBuf,
    /// Redis (or Valkey) shared by every replica: redis://host:port,
    /// rediss://host:port (TLS), or
    /// redis+sentinel://user:password@host:port,host:port/service (the
    /// credentials optional, one Sentinel or more).
    /// Without it, counts in this process alone. The server starts while
    /// a Redis node is unreachable, deciding by --on-store-error until it
    /// answers, and says on standard error when Redis stops and starts
    /// answering.
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: Option<String>,
    /// The rate limit service and grpc.health.v1.
    #[arg(long, env = "SLICELIMIT_GRPC_ADDR", default_value = "127.0.0.1:8081")]
    pub grpc_addr: SocketAddr,
    /// GET /metrics (Prometheus) and GET /healthz.
    #[arg(
        long,
        env = "SLICELIMIT_METRICS_ADDR",
        default_value = "127.0.0.1:9090"
    )]
    pub metrics_addr: SocketAddr,
    /// How to count.
    #[arg(
        long,
        env = "SLICELIMIT_MODE",
        value_enum,
        default_value = "hybrid-strict"
    )]
    pub mode: ModeFlag,
    /// What to answer while Redis cannot: admit (open) or deny (closed).
    #[arg(
        long,
        env = "SLICELIMIT_ON_STORE_ERROR",
        value_enum,
        default_value = "open"
    )]
    pub on_store_error: OnStoreError,
    /// How long one Redis call may take before the failure policy
    /// decides for it (25ms, 2s). While Redis answers slowly it
    /// stretches on its own, up to four times this.
    #[arg(
        long,
        env = "SLICELIMIT_REDIS_TIMEOUT",
        default_value = "25ms",
        value_parser = parse_timeout
    )]
    pub redis_timeout: Duration,
    /// Let every request through (overall OK) while each descriptor
    /// still tells its own answer, OVER_LIMIT included, and counts as
    /// usual (as envoyproxy/ratelimit's SHADOW_MODE): true or false.
    #[arg(
        long,
        env = "SHADOW_MODE",
        default_value_t = false,
        action = clap::ArgAction::Set,
        value_parser = reference_bool
    )]
    pub shadow_mode: bool,
    /// Merge the files of one domain instead of refusing them (as
    /// envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG): true or false.
    #[arg(
        long,
        env = "MERGE_DOMAIN_CONFIG",
        default_value_t = false,
        action = clap::ArgAction::Set,
        value_parser = reference_bool
    )]
    pub merge_domain_config: bool,
    /// Answer every rule as a quota_mode rule: a request is over only if
    /// every descriptor it is limited by is over (as envoyproxy/ratelimit's
    /// QUOTA_MODE): true or false.
    #[arg(
        long,
        env = "QUOTA_MODE",
        default_value_t = false,
        action = clap::ArgAction::Set,
        value_parser = reference_bool
    )]
    pub quota_mode: bool,
    /// Add response headers telling the limit, what is left and the
    /// seconds to its reset of the descriptor nearest its limit (as
    /// envoyproxy/ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED): true or
    /// false.
    #[arg(
        long,
        env = "LIMIT_RESPONSE_HEADERS_ENABLED",
        default_value_t = false,
        action = clap::ArgAction::Set,
        value_parser = reference_bool
    )]
    pub response_headers: bool,
    /// The name of the limit header.
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit")]
    pub limit_header: String,
    /// The name of the header telling what is left.
    #[arg(
        long,
        env = "LIMIT_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    pub remaining_header: String,
    /// The name of the header telling the seconds to the reset.
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset")]
    pub reset_header: String,
}

/// envoyproxy/ratelimit's settings that ask for something this server
/// does not do, each with the value that asks for it and why not. A
/// migrating deployment that sets one fails at start, saying so, rather
/// than running without what it asked for.
const REFUSED_SETTINGS: [(&str, &str, &str); 9] = [
    (
        "RESPONSE_DYNAMIC_METADATA",
        "true",
        "the response's dynamic metadata is not sent",
    ),
    (
        "BACKEND_TYPE",
        "memcache",
        "the store is Redis (or Valkey); there is no memcache backend",
    ),
    (
        "CONFIG_TYPE",
        "GRPC_XDS_SOTW",
        "the configuration comes from files; there is no xDS provider",
    ),
    (
        "REDIS_TYPE",
        "cluster",
        "give --redis-url a single node or redis+sentinel://; Redis Cluster is not served by the server",
    ),
    (
        "GRPC_SERVER_USE_TLS",
        "true",
        "the gRPC listener is plaintext; put TLS in front of it (Envoy, a sidecar)",
    ),
    (
        "REDIS_TLS",
        "true",
        "write rediss:// in --redis-url (server feature `tls`)",
    ),
    (
        "REDIS_AUTH",
        "*",
        "write the password in --redis-url (redis://:password@host:port)",
    ),
    (
        "CACHE_KEY_PREFIX",
        "*",
        "store keys are named by domain and rule (see docs/migrating.md); there is no prefix",
    ),
    (
        "EXTRA_TAGS",
        "*",
        "stats carry their domain and rule labels only",
    ),
];

/// Refuses the reference's settings this server does not honour (see
/// `REFUSED_SETTINGS`; `*`: any value), read through `var`.
///
/// # Errors
/// The first such setting found, named, with why.
pub fn refuse_reference_settings(var: impl Fn(&str) -> Option<String>) -> Result<(), Error> {
    for (name, value, why) in REFUSED_SETTINGS {
        let asks = |v: &str| match value {
            "true" => reference_bool(v) == Ok(true),
            "*" => !v.trim().is_empty(),
            _ => v.trim().eq_ignore_ascii_case(value),
        };
        if var(name).is_some_and(|v| asks(&v)) {
            let set = if value == "*" { "set" } else { value };
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("{name}={set} is envoyproxy/ratelimit's, not supported here: {why}"),
            ));
        }
    }
    Ok(())
}

/// A boolean setting as envoyproxy/ratelimit reads one (Go's
/// `strconv.ParseBool`): `1`, `t`, `T`, `true`, `TRUE`, `True`, and their
/// false counterparts.
pub fn reference_bool(text: &str) -> Result<bool, String> {
    match text.trim() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        other => Err(format!(
            "{other:?} is not true or false (1, t, true, 0, f, false)"
        )),
    }
}

/// `--redis-timeout`: a whole number of milliseconds (`ms`) or seconds
/// (`s`).
fn parse_timeout(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a timeout such as 25ms or 2s");
    let (number, unit) = match text.strip_suffix("ms") {
        Some(number) => (number, Duration::from_millis(1)),
        None => (
            text.strip_suffix('s').ok_or_else(bad)?,
            Duration::from_secs(1),
        ),
    };
    let n: u32 = number.trim().parse().map_err(|_| bad())?;
    match unit.checked_mul(n) {
        Some(timeout) if !timeout.is_zero() => Ok(timeout),
        _ => Err(bad()),
    }
}

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeFlag {
    /// Each replica leases slices of every key's budget and decides
    /// locally, waiting for a refill rather than admitting past the limit
    HybridStrict,
    /// As hybrid-strict, but admitting a few requests per key on credit
    /// while a refill is in flight
    HybridOptimistic,
    /// One Redis call per descriptor: exact, a round trip per request
    Exact,
}

/// `--on-store-error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStoreError {
    /// Admit every request the store could not decide.
    Open,
    /// Deny every request the store could not decide.
    Closed,
}

impl Options {
    /// The file or directory the configuration is read from: --config,
    /// else envoyproxy/ratelimit's runtime layout.
    ///
    /// # Errors
    /// Neither given.
    pub fn config_path(&self) -> Result<PathBuf, Error> {
        if let Some(config) = &self.config {
            return Ok(config.clone());
        }
        let Some(root) = &self.runtime_root else {
            return Err(Error::invalid(
                "no configuration: give --config (SLICELIMIT_CONFIG), or RUNTIME_ROOT as \
                 envoyproxy/ratelimit reads it",
            ));
        };
        let mut path = root.clone();
        if let Some(sub) = &self.runtime_subdirectory {
            path.push(sub);
        }
        path.push(&self.runtime_appdirectory);
        Ok(path)
    }

    fn mode(&self) -> Mode {
        match self.mode {
            ModeFlag::HybridStrict => Mode::HybridStrict,
            ModeFlag::HybridOptimistic => Mode::HybridOptimistic,
            ModeFlag::Exact => Mode::Exact,
        }
    }

    fn policy(&self) -> FailurePolicy {
        match self.on_store_error {
            OnStoreError::Open => FailurePolicy::FailOpen,
            OnStoreError::Closed => FailurePolicy::FailClosed,
        }
    }
}

/// Runs the server until `shutdown` completes, then stops accepting,
/// lets calls in flight finish (at most [`SHUTDOWN_STEP`]) and gives
/// every leased permit back (at most [`SHUTDOWN_STEP`] again).
///
/// # Errors
/// A configuration that does not load, a Redis URL that is not one, a
/// Sentinel that cannot be reached at start, an address that cannot be
/// bound, a metrics recorder already installed in this process. (A Redis
/// node that cannot be reached is no error: the server starts and decides
/// by `--on-store-error` until it answers.)
pub async fn run(options: Options, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
    refuse_reference_settings(|name| std::env::var(name).ok())?;
    let config = options.config_path()?;
    let exporter = slicelimit::metrics::install_prometheus_recorder()?;
    stats::describe();
    let mut watch = None;
    let store: Store = match &options.redis_url {
        Some(url) => {
            let redis = RedisOptions::default().response_timeout(options.redis_timeout);
            let store = store_watch::connect(url, redis).await?;
            let policy = match options.on_store_error {
                OnStoreError::Open => {
                    "each request it would decide is admitted (--on-store-error open)"
                }
                OnStoreError::Closed => {
                    "each request it would decide is denied (--on-store-error closed)"
                }
            };
            watch = Some(tokio::spawn(store_watch::watch(store.clone(), policy)));
            store
        }
        None => {
            eprintln!(
                "slicelimit-server: no --redis-url (REDIS_URL): counting in this process \
                 alone; run a single replica, or give every replica the same Redis"
            );
            MemoryStore::new().into()
        }
    };
    let settings = Settings {
        store,
        mode: options.mode(),
        on_store_error: options.policy(),
        merge_domains: options.merge_domain_config,
    };
    let (first, seen) = files::load(&config, &settings)?;
    eprintln!(
        "slicelimit-server: {} rules from {}; gRPC on {}, metrics on {}, mode {:?}, on store error {:?}",
        first.rules(),
        config.display(),
        options.grpc_addr,
        options.metrics_addr,
        options.mode,
        options.on_store_error,
    );
    let table = Arc::new(ArcSwap::from_pointee(first));
    let service = RateLimiter::new(table.clone(), settings.clone())
        .shadow_everything(options.shadow_mode)
        .quota_everything(options.quota_mode)
        .response_headers(options.response_headers.then(|| HeaderNames {
            limit: options.limit_header.clone(),
            remaining: options.remaining_header.clone(),
            reset: options.reset_header.clone(),
        }));
    if options.shadow_mode {
        eprintln!(
            "slicelimit-server: shadow mode: every request is let through; each descriptor still tells its own answer"
        );
    }
    if options.quota_mode {
        eprintln!(
            "slicelimit-server: quota mode: a request is over only if every descriptor of it is"
        );
    }
    let rlqs = Rlqs::new(
        table.clone(),
        settings.store.clone(),
        settings.on_store_error,
    );
    let renewer = tokio::spawn(rlqs.clone().run());

    let bind_error = |what: &str, addr: SocketAddr, e: std::io::Error| {
        Error::new(ErrorKind::Io, format!("cannot serve {what} on {addr}: {e}")).caused_by(e)
    };
    let grpc = tokio::net::TcpListener::bind(options.grpc_addr)
        .await
        .map_err(|e| bind_error("gRPC", options.grpc_addr, e))?;
    let http = tokio::net::TcpListener::bind(options.metrics_addr)
        .await
        .map_err(|e| bind_error("metrics", options.metrics_addr, e))?;

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<RateLimitServiceServer<RateLimiter>>()
        .await;
    // envoyproxy/ratelimit's name for itself, which its users' probes ask.
    health
        .set_service_status(REFERENCE_HEALTH_NAME, tonic_health::ServingStatus::Serving)
        .await;

    let watcher = tokio::spawn(files::watch(config.clone(), table.clone(), settings, seen));
    let upkeep = {
        let exporter = exporter.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                exporter.run_upkeep();
            }
        })
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let metrics_server = tokio::spawn(std::future::IntoFuture::into_future(axum::serve(
        http,
        metrics_router(exporter, stop_rx.clone()),
    )));
    let grpc_server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(RateLimitServiceServer::new(service))
            .add_service(RateLimitQuotaServiceServer::new(rlqs.clone()))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
                stopped(stop_rx.clone()),
            ),
    );

    shutdown.await;
    eprintln!("slicelimit-server: shutting down");
    health
        .set_not_serving::<RateLimitServiceServer<RateLimiter>>()
        .await;
    health
        .set_service_status(
            REFERENCE_HEALTH_NAME,
            tonic_health::ServingStatus::NotServing,
        )
        .await;
    let _ = stop_tx.send(true);
    watcher.abort();
    renewer.abort();
    if tokio::time::timeout(SHUTDOWN_STEP, rlqs.close())
        .await
        .is_err()
    {
        eprintln!("slicelimit-server: RLQS claims not all let go after {SHUTDOWN_STEP:?}");
    }
    // Calls in flight finish; connections that stay open past the step
    // are closed with the process.
    if tokio::time::timeout(SHUTDOWN_STEP, grpc_server)
        .await
        .is_err()
    {
        eprintln!("slicelimit-server: calls still in flight after {SHUTDOWN_STEP:?}; closing");
    }
    let limiters = table.load().limiters();
    let give_back = futures_util::future::join_all(limiters.iter().map(|l| l.shutdown()));
    if tokio::time::timeout(SHUTDOWN_STEP, give_back)
        .await
        .is_err()
    {
        eprintln!("slicelimit-server: leases not all given back after {SHUTDOWN_STEP:?}");
    }
    upkeep.abort();
    if let Some(watch) = watch {
        watch.abort();
    }
    metrics_server.abort();
    eprintln!("slicelimit-server: stopped");
    Ok(())
}

/// The gRPC health service name envoyproxy/ratelimit answers for, served
/// here too (besides `envoy.service.ratelimit.v3.RateLimitService` and the
/// server as a whole, `""`).
pub const REFERENCE_HEALTH_NAME: &str = "ratelimit";

/// `/metrics` and `/healthz` (503 once shutting down, so a load balancer
/// stops sending first).
fn metrics_router(
    exporter: PrometheusExporter,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> axum::Router {
    use axum::http::StatusCode;
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let exporter = exporter.clone();
                async move {
                    (
                        [("content-type", "text/plain; version=0.0.4")],
                        exporter.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let stopping = *stopping.borrow();
                async move {
                    if stopping {
                        (StatusCode::SERVICE_UNAVAILABLE, "stopping")
                    } else {
                        (StatusCode::OK, "ok")
                    }
                }
            }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_timeouts_are_milliseconds_or_seconds() {
        assert_eq!(parse_timeout("25ms"), Ok(Duration::from_millis(25)));
        assert_eq!(parse_timeout("2s"), Ok(Duration::from_secs(2)));
        for bad in ["", "25", "0ms", "1.5s", "-1s", "2m", "ms", "99999999999s"] {
            assert!(parse_timeout(bad).is_err(), "{bad:?}");
        }
    }
}

#[cfg(test)]
mod reference_settings {
    use super::*;
    use clap::Parser;

    #[test]
    fn without_config_the_references_runtime_layout_is_read() {
        let options = Options::try_parse_from([
            "slicelimit-server",
            "--runtime-root",
            "/srv/runtime_data/current",
            "--runtime-subdirectory",
            "ratelimit",
        ])
        .unwrap();
        assert_eq!(
            options.config_path().unwrap(),
            PathBuf::from("/srv/runtime_data/current/ratelimit/config")
        );
        let explicit =
            Options::try_parse_from(["slicelimit-server", "--config", "a.yaml"]).unwrap();
        assert_eq!(explicit.config_path().unwrap(), PathBuf::from("a.yaml"));
        let neither = Options::try_parse_from(["slicelimit-server"]).unwrap();
        let e = neither.config_path().unwrap_err().to_string();
        assert!(e.contains("--config") && e.contains("RUNTIME_ROOT"), "{e}");
    }

    #[test]
    fn booleans_read_as_the_reference_reads_them() {
        for (text, want) in [
            ("1", true),
            ("T", true),
            ("True", true),
            ("false", false),
            ("F", false),
            ("0", false),
        ] {
            let options = Options::try_parse_from([
                "slicelimit-server",
                "--shadow-mode",
                text,
                "--quota-mode",
                text,
            ])
            .unwrap();
            assert_eq!(
                (options.shadow_mode, options.quota_mode),
                (want, want),
                "{text}"
            );
        }
        assert!(Options::try_parse_from(["slicelimit-server", "--shadow-mode", "yes"]).is_err());
    }

    #[test]
    fn a_reference_setting_asking_for_what_is_not_done_is_refused_by_name() {
        let set = |name: &'static str, value: &'static str| {
            move |n: &str| (n == name).then(|| value.to_owned())
        };
        let e = refuse_reference_settings(set("RESPONSE_DYNAMIC_METADATA", "True"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RESPONSE_DYNAMIC_METADATA"), "{e}");
        assert!(refuse_reference_settings(set("RESPONSE_DYNAMIC_METADATA", "1")).is_err());
        assert!(refuse_reference_settings(set("RESPONSE_DYNAMIC_METADATA", "T")).is_err());
        assert!(refuse_reference_settings(set("BACKEND_TYPE", "memcache")).is_err());
        assert!(refuse_reference_settings(set("BACKEND_TYPE", "redis")).is_ok());
        assert!(refuse_reference_settings(set("RESPONSE_DYNAMIC_METADATA", "false")).is_ok());
        assert!(refuse_reference_settings(|_| None).is_ok());
        // Asked for TLS, a prefix or tags: refused, never silently ignored.
        let e = refuse_reference_settings(set("GRPC_SERVER_USE_TLS", "true")).unwrap_err();
        assert!(e.to_string().contains("plaintext"), "{e}");
        assert!(refuse_reference_settings(set("GRPC_SERVER_USE_TLS", "false")).is_ok());
        let e = refuse_reference_settings(set("CACHE_KEY_PREFIX", "prefix:")).unwrap_err();
        assert!(e.to_string().contains("CACHE_KEY_PREFIX=set"), "{e}");
        assert!(refuse_reference_settings(set("CACHE_KEY_PREFIX", "")).is_ok());
        assert!(refuse_reference_settings(set("EXTRA_TAGS", "foo:bar")).is_err());
        assert!(refuse_reference_settings(set("REDIS_AUTH", "secret")).is_err());
        assert!(refuse_reference_settings(set("REDIS_TLS", "1")).is_err());
    }
}
