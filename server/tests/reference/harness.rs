//! What the ports of envoyproxy/ratelimit's tests share: a service on a
//! private Redis built from the reference's files, its answers as the
//! reference's tests compare them, the server's stats, and windows.
#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use slicelimit::metrics::PrometheusExporter;
use slicelimit::{FailurePolicy, RedisStore};
use slicelimit_server::config::Config;
use slicelimit_server::service::RateLimiter;
use slicelimit_server::table::{Mode, Settings, Table};
use slicelimit_sim::RedisServer;

/// The modes every scenario runs in.
pub const MODES: [Mode; 2] = [Mode::Exact, Mode::HybridStrict];

pub const OK: i32 = Code::Ok as i32;
pub const OVER: i32 = Code::OverLimit as i32;

/// A service and the table it answers from (swap a new one in to
/// reload).
pub struct Service {
    pub limiter: RateLimiter,
    pub table: Arc<ArcSwap<Table>>,
    pub settings: Settings,
}

impl Service {
    /// Builds the table again from `files`, as a reload does: rules still
    /// there keep their counts.
    pub fn reload(&self, files: &[(&str, &str)]) {
        let (table, _) = Table::build(parse(files), &self.settings, Some(&self.table.load()))
            .expect("the new configuration builds");
        self.table.store(Arc::new(table));
    }
}

impl std::ops::Deref for Service {
    type Target = RateLimiter;

    fn deref(&self) -> &RateLimiter {
        &self.limiter
    }
}

fn parse(files: &[(&str, &str)]) -> Vec<Config> {
    files
        .iter()
        .map(|(name, text)| Config::parse(name, text).expect("the configuration parses"))
        .collect()
}

/// The settings of a service on `redis` in `mode`, failing closed (no
/// test here wants the failure policy to decide).
pub async fn settings(redis: &RedisServer, mode: Mode) -> Settings {
    let store = RedisStore::connect_with(&redis.url(), slicelimit_sim::test_options())
        .await
        .expect("connect to the test Redis");
    Settings {
        store: store.into(),
        mode,
        on_store_error: FailurePolicy::FailClosed,
        merge_domains: false,
    }
}

/// A service on `redis` in `mode` answering from `files` (name, YAML).
pub async fn service(redis: &RedisServer, mode: Mode, files: &[(&str, &str)]) -> Service {
    service_of(settings(redis, mode).await, parse(files))
}

/// A service with `settings` answering from `configs`.
pub fn service_of(settings: Settings, configs: Vec<Config>) -> Service {
    // Rules' series are registered when the table is built: the recorder
    // must be there first.
    stats();
    let (table, _) = Table::build(configs, &settings, None).expect("the configuration builds");
    let table = Arc::new(ArcSwap::from_pointee(table));
    Service {
        limiter: RateLimiter::new(table.clone(), settings.clone()),
        table,
        settings,
    }
}

/// `text` with its `domain:` line naming `domain` instead: each test (and
/// mode) gets its own stats series and its own counts.
pub fn with_domain(text: &str, domain: &str) -> String {
    text.lines()
        .map(|line| {
            if line.starts_with("domain:") {
                format!("domain: {domain}")
            } else {
                line.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the reference's `newDescriptorStatus` builds, less the reset
/// (compared on its own).
pub fn status(code: Code, limit: u32, unit: Unit, remaining: u32) -> Seen {
    (code as i32, Some((limit, unit as i32)), remaining)
}

/// A status as compared: code, limit (requests, unit), remaining.
pub type Seen = (i32, Option<(u32, i32)>, u32);

/// `got` is `want`: whole in the exact mode; in the hybrid modes, where
/// `limit_remaining` is an estimate (what this replica holds plus what
/// Redis last said: docs/envoy.md), the code and the limit whole and
/// the estimate within the limit, and 0 when over.
pub fn check(mode: Mode, got: &DescriptorStatus, want: Seen, what: &str) {
    let got = seen(got);
    if mode == Mode::Exact {
        assert_eq!(got, want, "{what}");
        return;
    }
    assert_eq!((got.0, got.1), (want.0, want.1), "{what}");
    let limit = want.1.map_or(0, |(l, _)| l);
    // An unlimited descriptor's remaining is u32::MAX in every mode.
    if want.1.is_none() {
        assert_eq!(got.2, want.2, "{what}");
        return;
    }
    assert!(got.2 <= limit, "{what}: {got:?}");
    if want.0 == OVER {
        assert_eq!(got.2, 0, "{what}");
    }
}

/// Every status of `r` is the matching one of `want`, and the overall
/// code is `overall`.
pub fn check_all(mode: Mode, r: &RateLimitResponse, overall: i32, want: &[Seen], what: &str) {
    assert_eq!(r.overall_code, overall, "{what}: overall of {r:?}");
    assert_eq!(r.statuses.len(), want.len(), "{what}: {r:?}");
    for (i, (got, want)) in r.statuses.iter().zip(want).enumerate() {
        check(mode, got, *want, &format!("{what}, status {i}"));
    }
}

pub fn seen(s: &DescriptorStatus) -> Seen {
    (
        s.code,
        s.current_limit
            .as_ref()
            .map(|l| (l.requests_per_unit, l.unit)),
        s.limit_remaining,
    )
}

/// The limit a status tells: (requests, unit, name).
pub fn limit_of(s: &DescriptorStatus) -> Option<(u32, i32, String)> {
    s.current_limit
        .as_ref()
        .map(|l| (l.requests_per_unit, l.unit, l.name.clone()))
}

pub fn reset_secs(r: &RateLimitResponse, i: usize) -> i64 {
    r.statuses[i]
        .duration_until_reset
        .as_ref()
        .map_or(0, |d| d.seconds)
}

/// A value no earlier run used: the reference draws a random one.
pub fn fresh(tag: &str) -> String {
    format!("{tag}-{}", now().as_nanos())
}

pub fn now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap()
}

/// Returns once at least `margin` is left of the current window of
/// `period` (windows start at multiples of the period since the epoch,
/// on Redis' clock, which is this machine's): a sequence that fits in the
/// margin counts in one window.
pub async fn clear_of_rollover(period: Duration, margin: Duration) {
    let into = Duration::from_nanos((now().as_nanos() % period.as_nanos()) as u64);
    if period - into < margin {
        tokio::time::sleep(period - into + Duration::from_millis(50)).await;
    }
}

/// The server's Prometheus exposition (installed once per test binary).
pub fn stats() -> &'static PrometheusExporter {
    static EXPORTER: OnceLock<PrometheusExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        slicelimit::metrics::install_prometheus_recorder().expect("install the stats recorder")
    })
}

/// The value of the server's per-rule series `stat` (`total_hits`,
/// `over_limit`, `near_limit`, `within_limit`, `shadow_mode`) for `rule`
/// (its label: the rule's path, or with requested values) of `domain`;
/// 0 when it has none.
pub fn stat(stat: &str, domain: &str, rule: &str) -> u64 {
    let prefix = format!("slicelimit_server_{stat}_total{{domain=\"{domain}\",rule=\"{rule}\"}} ");
    stats()
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().expect("a count"))
}

/// Every series of `stat` for `domain`: (rule label, value).
pub fn series(stat: &str, domain: &str) -> Vec<(String, u64)> {
    let prefix = format!("slicelimit_server_{stat}_total{{domain=\"{domain}\",rule=\"");
    let mut out: Vec<(String, u64)> = stats()
        .render()
        .lines()
        .filter_map(|line| line.strip_prefix(&prefix))
        .filter_map(|rest| rest.split_once("\"} "))
        .map(|(rule, v)| (rule.to_owned(), v.trim().parse().expect("a count")))
        .collect();
    out.sort();
    out
}

/// The five series of one rule: total, over, near, within, shadow.
pub fn stats_of(domain: &str, rule: &str) -> [u64; 5] {
    [
        "total_hits",
        "over_limit",
        "near_limit",
        "within_limit",
        "shadow_mode",
    ]
    .map(|s| stat(s, domain, rule))
}

/// Waits until `done` holds (polled every 50 ms), or fails after 20 s
/// saying `what` did not happen.
pub async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `--mode` flag of `mode`.
pub fn mode_flag(mode: Mode) -> &'static str {
    match mode {
        Mode::Exact => "exact",
        Mode::HybridStrict => "hybrid-strict",
        Mode::HybridOptimistic => "hybrid-optimistic",
    }
}

/// Returns once a look (`hits_addend` 0) at `entries` of `domain` sees at
/// least `left` left: what a denied request took has gone back (in the
/// background, a moment after its answer: docs/envoy.md).
pub async fn given_back(c: &RateLimiter, domain: &str, entries: &[(&str, &str)], left: u32) {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use envoy_types::pb::google::protobuf::UInt64Value;
    let look = || RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).to_owned(),
                    value: (*v).to_owned(),
                })
                .collect(),
            hits_addend: Some(UInt64Value { value: 0 }),
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while c.decide(look()).await.unwrap().statuses[0].limit_remaining < left {
        assert!(
            std::time::Instant::now() < deadline,
            "{entries:?}: {left} never back within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The series of `domain` that counted hits: (rule label, hits).
pub fn counted(domain: &str) -> Vec<(String, u64)> {
    series("total_hits", domain)
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect()
}
