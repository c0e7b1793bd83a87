//! The same limiters on a private Redis Cluster (three primaries, three
//! replicas): the exact race and the strict hybrid bound with keys spread
//! over every primary, and a primary killed mid-run.

use slicelimit_sim as support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use slicelimit::{
    nonzero, store::CircuitState, store::RedisOptions, FailurePolicy, HybridConfig, Limiter, Quota,
    RedisStore, Source,
};
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
    // A batch goes out as a pipeline per hash slot: a peek would be a
    // round trip of its own, so none is sent.
    let peeks: u64 = fleet.iter().map(|l| l.stats().peeks).sum();
    assert_eq!(peeks, 0, "peeks sent to a cluster");
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
    let policy = FailurePolicy::LocalFallback(Quota::per_second(nonzero!(50)));
    let options = RedisOptions::default().connect_timeout(Duration::from_secs(2));
    let exact = Limiter::builder(Quota::per_second(nonzero!(1_000)))
        .store(connect(&cluster, options.clone()).await)
        .namespace("fo")
        .on_store_error(policy)
        .build()
        .unwrap();
    let hybrid = Limiter::builder(Quota::per_second(nonzero!(1_000)))
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
    // Fresh keys on the victim's slots: they move to its replica together,
    // so a store decision on one says those slots are served again (keys
    // on the other primaries never stopped being served).
    let owners = cluster.primaries_by_slot();
    let mut fresh_keys = (0..20_000)
        .map(|i| format!("k0-{i}"))
        .filter(|k| {
            owners[usize::from(support::cluster::slot(&format!("{{fo:{k}}}")))] == Some(victim)
        })
        .take(2_000);
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
        let fresh = fresh_keys
            .next()
            .expect("enough fresh keys on the victim's slots");
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

/// Keys `k0`, `k1`, … of namespace `ns`, sorted by the primary serving
/// them: (the primary serving `victim_of`, or `victim` if given; `per` keys
/// on it, `2 × per` keys on the others).
fn keys_around(
    cluster: &RedisCluster,
    ns: &str,
    victim_of: &str,
    victim: Option<usize>,
    per: usize,
) -> (usize, Vec<String>, Vec<String>) {
    let owners = cluster.primaries_by_slot();
    let owner = |key: &str| owners[usize::from(support::cluster::slot(&format!("{{{ns}:{key}}}")))];
    let victim = victim.unwrap_or_else(|| owner(victim_of).expect("an owner"));
    let (mut on_victim, mut elsewhere) = (Vec::new(), Vec::new());
    for i in 0..100_000 {
        if on_victim.len() >= per && elsewhere.len() >= 2 * per {
            break;
        }
        let key = format!("k{i}");
        if owner(&key) == Some(victim) {
            if on_victim.len() < per {
                on_victim.push(key);
            }
        } else if elsewhere.len() < 2 * per {
            elsewhere.push(key);
        }
    }
    let mut others: Vec<usize> = elsewhere.iter().filter_map(|k| owner(k)).collect();
    others.sort_unstable();
    others.dedup();
    assert_eq!(others.len(), 2, "keys on both other primaries");
    (victim, on_victim, elsewhere)
}

/// One primary stops answering (SIGSTOP; no replica takes over): its keys
/// follow the failure policy, keys on the two other primaries are still
/// decided by Redis, and once it answers again everything is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_primary_refuses_only_its_own_keys() {
    let cluster = RedisCluster::start_primaries_only();
    let options = RedisOptions::default().connect_timeout(Duration::from_millis(500));
    let store = connect(&cluster, options).await;
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000_000)))
        .store(store.clone())
        .namespace("shard")
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let (victim, on_victim, elsewhere) = keys_around(&cluster, "shard", "k0", None, 10);
    // A hybrid limiter on the same store; its keys stay cold until the
    // primary is stopped.
    let hybrid = Limiter::builder(Quota::per_minute(nonzero!(1_000_000)))
        .store(store.clone())
        .namespace("shard-h")
        .on_store_error(FailurePolicy::FailClosed)
        .hybrid(HybridConfig::strict())
        .build()
        .unwrap();
    let (_, cold_on_victim, cold_elsewhere) =
        keys_around(&cluster, "shard-h", "", Some(victim), 10);
    for key in on_victim.iter().chain(&elsewhere) {
        assert_eq!(limiter.check(key, 1).await.source(), Source::Store);
    }
    let states = store.circuit_states();
    assert_eq!(states.len(), 3, "{states:?}");
    assert!(states.iter().all(|(_, s)| *s == CircuitState::Closed));
    let victim_address = format!("127.0.0.1:{}", cluster.nodes[victim].port());

    cluster.nodes[victim].freeze();
    // (store, policy) decisions on the stopped primary and elsewhere.
    let (mut stopped, mut live) = ([0u64; 2], [0u64; 2]);
    for _ in 0..20 {
        for key in &on_victim {
            let d = limiter.check(key, 1).await;
            assert_ne!(d.source(), Source::Store, "{key} on the stopped primary");
            assert_eq!(d.source(), Source::FailClosed);
            stopped[1] += 1;
        }
        for key in &elsewhere {
            let d = limiter.check(key, 1).await;
            live[usize::from(d.source() != Source::Store)] += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let states = store.circuit_states();
    println!("stopped primary: {stopped:?}, live primaries: {live:?}, breakers {states:?}");
    // Every call to the stopped primary is the policy's; of those to the
    // live ones, at most one in a hundred (a 25 ms response timeout that
    // a loaded 2-core machine misses now and then), not a breaker's worth.
    assert!(
        live[1] * 100 <= live[0],
        "keys on the live primaries were decided by the policy: {live:?}"
    );
    for (address, state) in &states {
        if *address == victim_address {
            assert_ne!(*state, CircuitState::Closed, "{states:?}");
        } else {
            assert_eq!(*state, CircuitState::Closed, "{states:?}");
        }
    }
    assert_eq!(store.circuit_state(), CircuitState::HalfOpen);
    assert!(store.circuit_trips() >= 1);
    assert!(store.calls_refused() > 0, "the open breaker refused calls");
    // Cold hybrid keys asked for together: their leases share batches that
    // span every primary; only the stopped primary's fail.
    let checks: Vec<_> = cold_on_victim
        .iter()
        .map(|k| (true, k))
        .chain(cold_elsewhere.iter().map(|k| (false, k)))
        .map(|(stopped, key)| {
            let hybrid = hybrid.clone();
            let key = key.clone();
            tokio::spawn(
                async move { (stopped, key.clone(), hybrid.check(&key, 1).await.source()) },
            )
        })
        .collect();
    for check in checks {
        let (stopped, key, source) = check.await.unwrap();
        let expected = if stopped {
            Source::FailClosed
        } else {
            Source::Lease
        };
        assert_eq!(source, expected, "hybrid key {key}");
    }
    // The live primaries forget their scripts: each reloads what it needs
    // alone (loading on every node would fail while one is stopped).
    for (i, node) in cluster.nodes.iter().enumerate() {
        if i != victim {
            let _: String = node.cmd(&["SCRIPT", "FLUSH"]);
        }
    }
    for key in &elsewhere {
        assert_eq!(
            limiter.check(key, 1).await.source(),
            Source::Store,
            "{key} after SCRIPT FLUSH"
        );
    }

    cluster.nodes[victim].thaw();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut all = true;
        for key in on_victim.iter().chain(&elsewhere) {
            all &= limiter.check(key, 1).await.source() == Source::Store;
        }
        if all {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stopped primary never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The hybrid keys whose leases failed are leased again once their
    // refill is retried.
    for key in cold_on_victim.iter().chain(&cold_elsewhere) {
        loop {
            let d = hybrid.check(key, 1).await;
            if matches!(d.source(), Source::Lease | Source::Store) {
                break;
            }
            assert_eq!(d.source(), Source::FailClosed);
            assert!(
                Instant::now() < deadline,
                "hybrid key {key} never came back"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(store.circuit_state(), CircuitState::Closed);
    assert!(store
        .circuit_states()
        .iter()
        .all(|(_, s)| *s == CircuitState::Closed));
    hybrid.shutdown().await;
}

/// 512 cold keys on a cluster: their leases go out as one pipeline per
/// hash slot. Round trips count the pipelines actually sent, store calls
/// count the 512 lease scripts (which Redis ran exactly 512 times).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_count_pipelines_and_store_calls_count_scripts() {
    // Clear of a minute's end: a key used within the pre-lease lead of its
    // window's end is leased for the next window too (a second script).
    let into_minute = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 60_000;
    if into_minute > 50_000 {
        tokio::time::sleep(Duration::from_millis(61_000 - into_minute as u64)).await;
    }
    let cluster = RedisCluster::start_primaries_only();
    let store = connect(&cluster, generous()).await;
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000_000)))
        .store(store.clone())
        .namespace("cost")
        .hybrid(HybridConfig::strict().max_wait(Duration::from_secs(2)))
        .build()
        .unwrap();
    // Load the lease script on every primary first, so the batch below
    // meets no NOSCRIPT (a reload would be a round trip of its own).
    let (_, warm_a, warm_b) = keys_around(&cluster, "cost", "k0", None, 1);
    for key in warm_a.iter().chain(&warm_b) {
        assert_eq!(limiter.check(key, 1).await.source(), Source::Lease);
    }
    let primaries: Vec<&support::RedisServer> = cluster.nodes.iter().collect();
    let evalsha = || -> u64 { primaries.iter().map(|n| n.command_calls("evalsha")).sum() };
    let before = limiter.stats();
    let sent_before = store.calls_sent();
    let scripts_before = evalsha();

    let keys: Vec<String> = (0..512).map(|i| format!("cold-{i}")).collect();
    let mut slots: Vec<u16> = keys
        .iter()
        .map(|k| support::cluster::slot(&format!("{{cost:{k}}}")))
        .collect();
    slots.sort_unstable();
    slots.dedup();
    let checks: Vec<_> = keys
        .iter()
        .map(|key| {
            let limiter = limiter.clone();
            let key = key.clone();
            tokio::spawn(async move { limiter.check(&key, 1).await })
        })
        .collect();
    for check in checks {
        assert_eq!(check.await.unwrap().source(), Source::Lease);
    }
    let after = limiter.stats();
    let round_trips = after.round_trips - before.round_trips;
    let calls = after.store_calls - before.store_calls;
    let sent = store.calls_sent() - sent_before;
    println!(
        "512 cold keys over {} slots: {round_trips} round trips, {calls} store calls",
        slots.len()
    );
    assert_eq!(calls, 512, "one lease script per key");
    assert_eq!(evalsha() - scripts_before, 512, "Redis ran 512 scripts");
    assert_eq!(round_trips, sent, "round trips are the pipelines sent");
    assert!(
        round_trips >= slots.len() as u64,
        "at least one pipeline per slot: {round_trips} < {}",
        slots.len()
    );
    limiter.shutdown().await;
}
