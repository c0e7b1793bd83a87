//! Metrics through a local recorder: overshoot and decision counts in an
//! optimistic scenario, with fixed label sets; the Grafana dashboard
//! charts them.

use std::time::Duration;

use metrics::{SharedString, Unit};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::CompositeKey;
use slicelimit::{clock::FakeClock, nonzero, HybridConfig, Limiter, MemoryStore, Quota, Source};

type Snapshot = Vec<(CompositeKey, Option<Unit>, Option<SharedString>, DebugValue)>;

fn counter(snapshot: &Snapshot, name: &str, labels: &[(&str, &str)]) -> u64 {
    snapshot
        .iter()
        .filter(|(key, _, _, _)| {
            let key = key.key();
            key.name() == name
                && labels
                    .iter()
                    .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => *n,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .sum()
}

#[tokio::test]
async fn optimistic_overshoot_and_decisions_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let clock = FakeClock::new(Duration::from_secs(1_700_000_000));
    let store = MemoryStore::with_clock(clock.clone());
    let quota = Quota::per_second(nonzero!(100));
    let (limiter, rival) = metrics::with_local_recorder(&recorder, || {
        let limiter = Limiter::builder(quota)
            .store(store.clone())
            .clock(clock.clone())
            .namespace("coupons")
            .name("opt")
            .hybrid(HybridConfig::optimistic(5).max_wait(Duration::from_millis(200)))
            .build()
            .unwrap();
        let rival = Limiter::builder(quota)
            .store(store.clone())
            .namespace("coupons")
            .name("rival")
            .build()
            .unwrap();
        (limiter, rival)
    });
    // Mid-window, with one reply seen (a key's first-touch credit needs
    // the store's clock).
    clock.advance(Duration::from_millis(100));
    assert!(limiter.check("warm", 1).await.is_allowed());
    // Another process spends the whole window first.
    assert!(rival.check("k", 100).await.is_allowed());
    let mut credit = 0;
    for _ in 0..5 {
        let d = limiter.check("k", 1).await;
        assert!(d.is_allowed());
        if d.source() == Source::Credit {
            credit += 1;
        }
    }
    assert_eq!(credit, 5);
    // The sync task reports the debt: all of it beyond the limit.
    let mut waited = 0;
    while limiter.stats().overshoot < 5 && waited < 200 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        waited += 1;
    }
    for _ in 0..10 {
        assert!(!limiter.check("k", 1).await.is_allowed());
    }
    let opt = [("limiter", "opt")];
    // One snapshot: reading a debugging recorder's counters resets them.
    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(
        counter(&snapshot, "slicelimit_overshoot_permits_total", &opt),
        5
    );
    assert_eq!(
        counter(&snapshot, "slicelimit_credit_permits_total", &opt),
        5
    );
    assert_eq!(
        counter(
            &snapshot,
            "slicelimit_decisions_total",
            &[
                ("limiter", "opt"),
                ("outcome", "allowed"),
                ("source", "credit")
            ]
        ),
        5
    );
    assert_eq!(
        counter(
            &snapshot,
            "slicelimit_decisions_total",
            &[("limiter", "opt"), ("outcome", "denied")]
        ),
        10
    );
    assert_eq!(
        counter(
            &snapshot,
            "slicelimit_decisions_total",
            &[
                ("limiter", "rival"),
                ("outcome", "allowed"),
                ("source", "store")
            ]
        ),
        1
    );
    assert!(counter(&snapshot, "slicelimit_store_round_trips_total", &opt) >= 1);
    // Script calls are counted too (the sync task may have sent more
    // since the snapshot, never fewer).
    let calls = counter(&snapshot, "slicelimit_store_calls_total", &opt);
    let stats = limiter.stats();
    assert!(
        calls >= 1 && calls <= stats.store_calls,
        "{calls} {stats:?}"
    );
    assert!(stats.store_calls >= stats.round_trips, "{stats:?}");
    // Labels stay fixed: no user key anywhere.
    for (key, _, _, _) in &snapshot {
        for label in key.key().labels() {
            assert!(
                ["limiter", "outcome", "source", "kind"].contains(&label.key()),
                "unexpected label {}",
                label.key()
            );
            assert_ne!(label.value(), "k", "a user key became a label");
        }
    }
    let stats = limiter.stats();
    assert_eq!((stats.overshoot, stats.credit_admitted), (5, 5));
}

/// `docs/grafana/slicelimit.json` asks for its data source on import
/// and charts the limiters' and the in-flight limits' metrics.
#[test]
fn the_grafana_dashboard_prompts_for_a_data_source_and_charts_the_limiters() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/grafana/slicelimit.json");
    let text = std::fs::read_to_string(path).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let inputs = dashboard["__inputs"].as_array().expect("an __inputs list");
    assert!(inputs
        .iter()
        .any(|i| i["type"] == "datasource" && i["pluginId"] == "prometheus"));
    let name = inputs[0]["name"].as_str().unwrap();
    assert!(text.contains(&format!("${{{name}}}")), "the prompt is used");
    let exprs = slicelimit_sim::dashboard_queries();
    use slicelimit::concurrency::stats as inflight;
    for metric in [
        inflight::IN_FLIGHT,
        inflight::LEASED,
        inflight::EXPIRED,
        inflight::LOST,
        inflight::WAITED,
        inflight::DENIED,
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(metric)),
            "{metric} is charted"
        );
    }
    use slicelimit::metrics::*;
    for metric in [
        DECISIONS,
        CREDIT,
        RECONCILED,
        REPORTS_DROPPED,
        SHADOW_DENIALS,
        FALLBACK_ADMISSIONS,
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(metric)),
            "{metric} is charted"
        );
    }
}
