//! Several quotas per key, several keys per decision, tiers and refunds,
//! on real Redis (a private server, or a private cluster) with four
//! limiters standing for four processes.
//!
//! `SLICELIMIT_SEVERAL_SECS` sets how long the two-quota loads run
//! (default 65 s: every per-minute window boundary case at least once).

use slicelimit_sim as support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use slicelimit::{
    check_all, nonzero, store::RedisOptions, Decision, HybridConfig, Limiter, Quota, RedisStore,
};
use support::cluster::RedisCluster;
use support::load::{wall_us, ZipfKeys};
use support::{store, RedisServer};

const FLEET: usize = 4;

fn run_for() -> Duration {
    let secs = std::env::var("SLICELIMIT_SEVERAL_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(65);
    Duration::from_secs(secs)
}

fn strict() -> HybridConfig {
    HybridConfig::strict().clock_margin(Duration::from_millis(20))
}

/// The window a decision's permits count in, for quota `part`: its end is
/// the decision time plus `reset_after`, and ends fall on multiples of the
/// period, so rounding places it even when the decision is stamped a
/// round trip late.
fn window_of(decision: &Decision, stamp_us: u64) -> i64 {
    let period = decision.period().as_micros() as u64;
    let end = stamp_us + decision.reset_after().as_micros() as u64;
    let end = (end + period / 2) / period;
    end as i64 - 1
}

/// (key, quota, window) → admitted.
type Counts = HashMap<(usize, usize, i64), u64>;

async fn over_limit_load(limiters: &[Limiter], keys: usize, per_second: f64) -> Counts {
    let stop_at = wall_us() + run_for().as_micros() as u64;
    let names: Vec<String> = (0..keys).map(|k| format!("k{k}")).collect();
    let mut tasks = Vec::new();
    for (i, limiter) in limiters.iter().enumerate() {
        let limiter = limiter.clone();
        let names = names.clone();
        tasks.push(tokio::spawn(async move {
            let mut zipf = ZipfKeys::new(names.len(), 1.0, 0xA5A5 + i as u64);
            let mut counts = Counts::new();
            let mut ticker = tokio::time::interval(Duration::from_millis(10));
            let per_tick = per_second / 100.0 / FLEET as f64;
            let mut carry = 0.0;
            while wall_us() < stop_at {
                ticker.tick().await;
                carry += per_tick;
                while carry >= 1.0 {
                    carry -= 1.0;
                    let key = zipf.next_key();
                    let before = wall_us();
                    let d = limiter.check(&names[key], 1).await;
                    let stamp = (before + wall_us()) / 2;
                    if d.is_allowed() {
                        for (q, part) in d.quotas().iter().enumerate() {
                            *counts.entry((key, q, window_of(part, stamp))).or_default() += 1;
                        }
                    }
                }
            }
            counts
        }));
    }
    let mut total = Counts::new();
    for t in tasks {
        for (k, n) in t.await.unwrap() {
            *total.entry(k).or_default() += n;
        }
    }
    total
}

fn field(server: &RedisServer, store_key: &str, window: i64) -> u64 {
    server
        .try_cmd::<Option<u64>>(&["HGET", store_key, &window.to_string()])
        .flatten()
        .unwrap_or(0)
}

/// 10/s and 50/min on each key, four limiters, Zipf load at several times
/// both limits: no window of either quota admits past its limit, and in
/// exact mode each quota's count in Redis equals what was admitted in
/// that window, so no request was counted by one quota and denied by the
/// other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_quotas_on_four_limiters_never_exceed_either() {
    let server = RedisServer::start();
    let per_second = Quota::per_second(nonzero!(10));
    let per_minute = Quota::per_minute(nonzero!(50));
    for hybrid in [false, true] {
        let ns = if hybrid { "two-h" } else { "two-x" };
        let mut limiters = Vec::new();
        for _ in 0..FLEET {
            let builder = Limiter::builder(per_second)
                .and(per_minute)
                .namespace(ns)
                .store(store(&server).await);
            limiters.push(if hybrid {
                builder.hybrid(strict()).build().unwrap()
            } else {
                builder.build().unwrap()
            });
        }
        let keys = 6;
        let counts = over_limit_load(&limiters, keys, 120.0).await;
        let limits = [10, 50];
        let mut worst = [0u64; 2];
        for (&(_, q, _), &n) in &counts {
            worst[q] = worst[q].max(n);
        }
        println!(
            "hybrid {hybrid}: worst per-second window {} (limit 10), per-minute {} (limit 50)",
            worst[0], worst[1]
        );
        for (&(k, q, w), &n) in &counts {
            assert!(
                n <= limits[q],
                "hybrid {hybrid}: key {k} quota {q} window {w}: {n}"
            );
        }
        let minute_total: u64 = counts
            .iter()
            .filter(|((_, q, _), _)| *q == 1)
            .map(|(_, n)| n)
            .sum();
        assert!(minute_total > 0);
        if !hybrid {
            // Redis keeps a key's current and previous windows; both are
            // over now that the load stopped, the newest a second ago.
            let now_s = (wall_us() / 1_000_000) as i64;
            let now_m = now_s / 60;
            for k in 0..keys {
                let tag = format!("sl:{{{ns}:k{k}}}:fw");
                for w in [now_s - 1, now_s - 2] {
                    let admitted = counts.get(&(k, 0, w)).copied().unwrap_or(0);
                    assert_eq!(field(&server, &tag, w), admitted, "key {k} second {w}");
                }
                for w in [now_m, now_m - 1] {
                    let admitted = counts.get(&(k, 1, w)).copied().unwrap_or(0);
                    assert_eq!(
                        field(&server, &format!("{tag}.1"), w),
                        admitted,
                        "key {k} minute {w}"
                    );
                }
            }
        }
        for limiter in &limiters {
            limiter.shutdown().await;
        }
    }
}

/// A user limit and an organisation limit on a Redis Cluster, the two
/// keys in different slots: `check_all` never lets either past its limit,
/// refunds of the user's permit when the organisation denies land, and
/// the undershoot (users denied while the organisation had room) is
/// reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_all_holds_user_and_organisation_on_a_cluster() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let connect = || RedisStore::connect_cluster_with(&urls, support::test_options());
    let mut users = Vec::new();
    let mut orgs = Vec::new();
    for _ in 0..FLEET {
        users.push(
            Limiter::builder(Quota::per_second(nonzero!(10)))
                .namespace("user")
                .store(connect().await.unwrap())
                .build()
                .unwrap(),
        );
        orgs.push(
            Limiter::builder(Quota::per_second(nonzero!(25)))
                .namespace("org")
                .store(connect().await.unwrap())
                .build()
                .unwrap(),
        );
    }
    let names: Vec<String> = (0..5).map(|u| format!("user-{u}")).collect();
    assert_ne!(
        support::cluster::slot("sl:{user:user-0}:fw"),
        support::cluster::slot("sl:{org:acme}:fw"),
        "the test needs the two keys in different slots"
    );
    let stop_at = wall_us() + 12_000_000;
    let mut tasks = Vec::new();
    for p in 0..FLEET {
        let (user, org, names) = (users[p].clone(), orgs[p].clone(), names.clone());
        tasks.push(tokio::spawn(async move {
            let mut counts: HashMap<(String, i64), u64> = HashMap::new();
            let mut i = p;
            let mut ticker = tokio::time::interval(Duration::from_millis(5));
            while wall_us() < stop_at {
                ticker.tick().await;
                // 5 users × 4 processes × 200/s offered: far over both.
                i += 1;
                let name = &names[i % names.len()];
                let before = wall_us();
                let d = check_all(&[(&user, name), (&org, "acme")], 1).await;
                let stamp = (before + wall_us()) / 2;
                if d.is_allowed() {
                    let parts = d.quotas();
                    *counts
                        .entry((name.clone(), window_of(&parts[0], stamp)))
                        .or_default() += 1;
                    *counts
                        .entry(("org".into(), window_of(&parts[1], stamp)))
                        .or_default() += 1;
                }
            }
            counts
        }));
    }
    let mut counts: HashMap<(String, i64), u64> = HashMap::new();
    for t in tasks {
        for (k, n) in t.await.unwrap() {
            *counts.entry(k).or_default() += n;
        }
    }
    let mut org_windows: Vec<(i64, u64)> = counts
        .iter()
        .filter(|((n, _), _)| n == "org")
        .map(|((_, w), n)| (*w, *n))
        .collect();
    org_windows.sort();
    for ((name, w), n) in &counts {
        let limit = if name == "org" { 25 } else { 10 };
        assert!(*n <= limit, "{name} window {w}: {n} > {limit}");
    }
    // Full windows only (the first and last are cut by the run).
    let full = &org_windows[1..org_windows.len() - 1];
    let used: u64 = full.iter().map(|(_, n)| n).sum();
    let undershoot = 1.0 - used as f64 / (25 * full.len()) as f64;
    let refunded: u64 = users.iter().map(|l| l.stats().refunded).sum();
    let ignored: u64 = users.iter().map(|l| l.stats().refunds_ignored).sum();
    println!(
        "org windows {:?}; undershoot {:.1} %; user refunds landed {refunded}, ignored {ignored}",
        full.iter().map(|(_, n)| n).collect::<Vec<_>>(),
        undershoot * 100.0
    );
    assert!(
        refunded > 0,
        "the organisation denied, and the users' permits came back"
    );
    assert!(undershoot < 0.10, "undershoot {:.1} %", undershoot * 100.0);
}

/// 100 keys, 10 of them premium at 10× the quota, hybrid, four limiters:
/// each key is held to its own quota; a tier change at run time takes
/// effect within one refill (measured: the time until the promoted key is
/// first admitted past its old limit in one window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_hold_each_key_to_its_own_quota_and_change_within_a_refill() {
    let server = RedisServer::start();
    let free = Quota::per_second(nonzero!(20));
    let premium = Quota::per_second(nonzero!(200));
    let is_premium = |k: &str| {
        k.strip_prefix('k')
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n < 10)
    };
    let mut limiters = Vec::new();
    for _ in 0..FLEET {
        limiters.push(
            Limiter::builder(free)
                .quota_for(move |k| is_premium(k).then_some(premium))
                .namespace("tiers")
                .store(store(&server).await)
                .hybrid(strict())
                .build()
                .unwrap(),
        );
    }
    let run = |limiters: Vec<Limiter>, secs: u64| async move {
        let stop_at = wall_us() + secs * 1_000_000;
        let mut tasks = Vec::new();
        for (p, limiter) in limiters.into_iter().enumerate() {
            tasks.push(tokio::spawn(async move {
                let mut counts: HashMap<(usize, i64), u64> = HashMap::new();
                let mut ticker = tokio::time::interval(Duration::from_millis(10));
                let mut round = p;
                while wall_us() < stop_at {
                    ticker.tick().await;
                    round += 1;
                    // Every key offered 2.5× its quota across the fleet:
                    // premium keys 5 a tick per limiter, the rest 1 in two.
                    for k in 0..100usize {
                        let n = if k < 10 { 5 } else { (round + k) % 2 };
                        for _ in 0..n {
                            let before = wall_us();
                            let d = limiter.check(&format!("k{k}"), 1).await;
                            if d.is_allowed() {
                                let stamp = (before + wall_us()) / 2;
                                *counts.entry((k, window_of(&d, stamp))).or_default() += 1;
                            }
                        }
                    }
                }
                counts
            }));
        }
        let mut total: HashMap<(usize, i64), u64> = HashMap::new();
        for t in tasks {
            for (k, n) in t.await.unwrap() {
                *total.entry(k).or_default() += n;
            }
        }
        total
    };
    let counts = run(limiters.clone(), 6).await;
    let mut best = [0u64; 2];
    for (&(k, w), &n) in &counts {
        let limit = if k < 10 { 200 } else { 20 };
        assert!(n <= limit, "key {k} window {w}: {n} > {limit}");
        best[usize::from(k < 10)] = best[usize::from(k < 10)].max(n);
    }
    println!(
        "best window: free {} of 20, premium {} of 200",
        best[0], best[1]
    );
    assert!(best[0] >= 18 && best[1] >= 180, "{best:?}");

    // Promote k50 on every limiter; time its first window past 20.
    for limiter in &limiters {
        limiter.set_quota_for(move |k| (is_premium(k) || k == "k50").then_some(premium));
    }
    let changed = Instant::now();
    let mut first_past = None;
    let mut admitted_in: HashMap<i64, u64> = HashMap::new();
    while changed.elapsed() < Duration::from_secs(3) && first_past.is_none() {
        let before = wall_us();
        let d = limiters[0].check("k50", 1).await;
        if d.is_allowed() {
            let w = window_of(&d, (before + wall_us()) / 2);
            let n = admitted_in.entry(w).or_default();
            *n += 1;
            if *n > 20 {
                first_past = Some(changed.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let took = first_past.expect("the promoted key was admitted past its old limit within 3 s");
    println!("tier change took effect after {took:?}");
    assert_eq!(limiters[0].quota_of("k50"), premium);
    for limiter in &limiters {
        limiter.shutdown().await;
    }
}

/// Refunds on Redis: a hybrid refund goes back into the local lease, an
/// exact one into the store's count, and one for an ended window is
/// ignored and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_land_in_their_window_on_redis() {
    let server = RedisServer::start();
    for hybrid in [false, true] {
        let ns = if hybrid { "ref-h" } else { "ref-x" };
        let builder = Limiter::builder(Quota::per_minute(nonzero!(5)))
            .namespace(ns)
            .store(
                RedisStore::connect_with(&server.url(), RedisOptions::default())
                    .await
                    .unwrap(),
            );
        let limiter = if hybrid {
            builder.hybrid(strict()).build().unwrap()
        } else {
            builder.build().unwrap()
        };
        // Start clear of a minute's end.
        while wall_us() % 60_000_000 > 50_000_000 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut admitted = Vec::new();
        for _ in 0..5 {
            let d = limiter.check("k", 1).await;
            assert!(d.is_allowed(), "hybrid {hybrid}");
            admitted.push(d);
        }
        assert!(!limiter.check("k", 1).await.is_allowed());
        assert_eq!(
            limiter.refund("k", &admitted[0]).await,
            1,
            "hybrid {hybrid}"
        );
        assert!(limiter.check("k", 1).await.is_allowed(), "hybrid {hybrid}");
        assert!(!limiter.check("k", 1).await.is_allowed(), "hybrid {hybrid}");
        limiter.shutdown().await;
        // The whole window's count never passed the limit.
        let w = (wall_us() / 60_000_000) as i64;
        let count = field(&server, &format!("sl:{{{ns}:k}}:fw"), w);
        assert!(count <= 5, "hybrid {hybrid}: {count}");
        if !hybrid {
            assert_eq!(count, 5);
        }
    }
}
