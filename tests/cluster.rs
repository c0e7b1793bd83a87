//! The same limiters on a private Redis Cluster (three primaries, three
//! replicas): the exact race and the strict hybrid bound with keys spread
//! over every primary, and a primary killed mid-run.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use slicelimit::{FailurePolicy, HybridConfig, Limiter, Quota, RedisOptions, RedisStore, Source};
use support::cluster::RedisCluster;
use support::load::{drive, wall_us, LoadSpec, Tally};

async fn connect(cluster: &RedisCluster, options: RedisOptions) -> RedisStore {
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    RedisStore::connect_cluster_with(&urls, options)
        .await
        .expect("connect to the cluster")
}

fn generous() -> RedisOptions {
    support::test_options()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_race_and_strict_hybrid_bound_hold_across_three_primaries() {
    let cluster = RedisCluster::start();

    // Exact race: 8 limiters on 8 connections, 64 tasks, 6 keys of 100.
    let quota = Quota::new(100, Duration::from_secs(86_400)).unwrap();
    let mut limiters = Vec::new();
    for _ in 0..8 {
        limiters.push(
            Limiter::builder(quota)
                .store(connect(&cluster, generous()).await)
                .namespace("race")
                .on_store_error(FailurePolicy::FailClosed)
                .build()
                .unwrap(),
        );
    }
    let admitted: Arc<Vec<AtomicU64>> = Arc::new((0..6).map(|_| AtomicU64::new(0)).collect());
    let mut tasks = Vec::new();
    for t in 0..64 {
        let limiter = limiters[t % 8].clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..18 {
                let k = (t + i) % 6;
                let d = limiter
                    .try_check(&format!("key-{k}"), 1)
                    .await
                    .expect("the cluster answers");
                if d.is_allowed() {
                    admitted[k].fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let counts: Vec<u64> = admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    assert_eq!(counts, vec![100; 6], "each key admits exactly its limit");

    // Strict hybrid fleet, 4 limiters, 40 Zipf keys at 3× the limit.
    let spec = LoadSpec {
        keys: 40,
        limit: 100,
        period: Duration::from_secs(1),
        demand_factor: 3.0,
        duration: Duration::from_millis(6_500),
        tick: Duration::from_millis(10),
    };
    let mut fleet = Vec::new();
    for _ in 0..4 {
        fleet.push(
            Limiter::builder(Quota::new(spec.limit, spec.period).unwrap())
                .store(connect(&cluster, generous()).await)
                .namespace("fleet")
                .hybrid(HybridConfig::strict().clock_margin(Duration::from_millis(20)))
                .build()
                .unwrap(),
        );
    }
    let stop_at = wall_us() + spec.duration.as_micros() as u64;
    let mut tasks = Vec::new();
    for (i, l) in fleet.iter().enumerate() {
        tasks.push(tokio::spawn(drive(
            l.clone(),
            spec,
            0.25,
            77 + i as u64,
            stop_at,
        )));
    }
    let mut tally = Tally::default();
    for t in tasks {
        tally.merge(&t.await.unwrap());
    }
    for l in &fleet {
        l.shutdown().await;
    }
    let ((key, window), worst) = tally.worst();
    assert!(
        worst <= spec.limit,
        "key {key} admitted {worst} in window {window}"
    );
    let (utilization, cells) = tally.utilization(spec.limit);
    println!(
        "cluster strict: worst {worst}/{}, utilization {utilization:.4} over {cells} cells",
        spec.limit
    );
    assert!(utilization >= 0.95, "{utilization}");

    // Keys landed on every primary; none is immortal.
    let primaries: Vec<usize> = (0..40)
        .map(|k| cluster.primary_for(&format!("{{fleet:user-{k}}}")))
        .collect();
    let mut distinct = primaries.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        3,
        "keys spread over all three primaries: {primaries:?}"
    );
    for node in &cluster.nodes {
        let role: String = node.cmd(&["INFO", "replication"]);
        if role.contains("role:master") {
            assert!(
                !node.keys().is_empty(),
                "primary on port {} holds keys",
                node.port()
            );
        }
    }
    assert_eq!(cluster.immortal_keys(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_survived_through_the_policy_then_recovered_from() {
    let mut cluster = RedisCluster::start();
    let policy = FailurePolicy::LocalFallback(Quota::per_second(50));
    let options = RedisOptions::default().connect_timeout(Duration::from_secs(2));
    let exact = Limiter::builder(Quota::per_second(1_000))
        .store(connect(&cluster, options.clone()).await)
        .namespace("fo")
        .on_store_error(policy)
        .build()
        .unwrap();
    let hybrid = Limiter::builder(Quota::per_second(1_000))
        .store(connect(&cluster, options).await)
        .namespace("fo-h")
        .on_store_error(policy)
        .hybrid(HybridConfig::strict())
        .build()
        .unwrap();
    // A key on the primary we are about to kill.
    // Keys of both limiters on the primary we are about to kill (one
    // primary only: killing two of three would lose the majority).
    let victim = cluster.primary_for("{fo:k0}");
    let hybrid_key = (0..1000)
        .map(|i| format!("k{i}"))
        .find(|k| cluster.primary_for(&format!("{{fo-h:{k}}}")) == victim)
        .expect("a key on the same primary");
    assert!(exact.check("k0", 1).await.is_allowed());
    assert!(hybrid.check(&hybrid_key, 1).await.is_allowed());
    let killed_at = Instant::now();
    cluster.nodes[victim].kill();
    let mut slowest = Duration::ZERO;
    let mut by_policy = 0;
    let mut back: Option<Duration> = None;
    while killed_at.elapsed() < Duration::from_secs(25) {
        for (limiter, key, is_hybrid) in
            [(&exact, "k0", false), (&hybrid, hybrid_key.as_str(), true)]
        {
            let began = Instant::now();
            let d = limiter.check(key, 1).await;
            slowest = slowest.max(began.elapsed());
            match d.source() {
                Source::Fallback => by_policy += 1,
                Source::Store | Source::Lease | Source::DeniedCache
                    if !is_hybrid || d.source() != Source::Store => {}
                other => panic!("unexpected source {other:?}"),
            }
        }
        // Back when a fresh key on the failed-over slots gets a store decision.
        let fresh = format!("k0-{}", killed_at.elapsed().as_millis());
        let d = exact.check(&fresh, 1).await;
        if std::env::var("CLUSTER_DEBUG").is_ok() {
            eprintln!(
                "{:?} {:?} {:?}",
                killed_at.elapsed(),
                d.source(),
                exact.try_check(&fresh, 0).await.err()
            );
        }
        if d.source() == Source::Store && by_policy > 0 && back.is_none() {
            back = Some(killed_at.elapsed());
        }
        if back.is_some() && killed_at.elapsed() > back.unwrap() + Duration::from_secs(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let back = back.expect("the limiter came back after the replica's promotion");
    println!("failover: {by_policy} policy decisions, slowest check {slowest:?}, back on Redis {back:?} after the kill");
    assert!(by_policy > 0, "the outage was decided by the policy");
    assert!(
        slowest < Duration::from_millis(25 + 50 + 250),
        "{slowest:?}"
    );
    // The promoted replica serves the key again, hybrid included.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let d = hybrid
            .check(&format!("k-after-{}", deadline.elapsed().as_nanos()), 1)
            .await;
        if d.source() == Source::Lease {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the hybrid limiter did not recover"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    exact.shutdown().await;
    hybrid.shutdown().await;
    assert_eq!(cluster.immortal_keys(), Vec::<String>::new());
}
