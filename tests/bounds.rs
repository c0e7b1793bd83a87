//! Regression tests for schedules that once broke a published bound, each
//! through the public API or the Lua scripts on a private `redis-server`
//! (the embedded store's mirror of each rule is tested beside it in
//! `src/`). The seeded search for the next one is `tests/simulation.rs`.

use slicelimit_sim as support;

use std::future::Future;
use std::num::NonZeroU32;
use std::task::Poll;
use std::time::Duration;

use slicelimit::{
    nonzero, store::CircuitConfig, store::RedisOptions, Algorithm, FailurePolicy, HybridConfig,
    Limiter, MemoryStore, Quota, RedisStore, Source,
};
use support::{store, RedisServer};

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
];

/// Redis' clock, µs.
fn redis_now_us(server: &RedisServer) -> u64 {
    let t: Vec<String> = server.cmd(&["TIME"]);
    t[0].parse::<u64>().unwrap() * 1_000_000 + t[1].parse::<u64>().unwrap()
}

/// 1. A probe whose future is dropped must not leave the breaker
/// half-open: once Redis answers again, decisions come from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_probe_does_not_wedge_the_circuit_breaker() {
    let server = RedisServer::start();
    let options = RedisOptions::default()
        .response_timeout(Duration::from_millis(30))
        .connect_timeout(Duration::from_secs(2))
        .circuit_breaker(
            CircuitConfig::default()
                .min_failures(5)
                .min_span(Duration::ZERO)
                .backoff(Duration::from_millis(100), Duration::from_millis(200)),
        );
    let redis = RedisStore::connect_with(&server.url(), options)
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000)))
        .store(redis.clone())
        .namespace("probe")
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let _: String = server.cmd(&["CLIENT", "PAUSE", "2000", "ALL"]);
    for _ in 0..5 {
        assert_eq!(limiter.check("k", 1).await.source(), Source::FailClosed);
    }
    assert_eq!(redis.circuit_state(), slicelimit::store::CircuitState::Open);
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The probe: polled once (it is sent and waits), then dropped, as a
    // client hanging up or a caller's timeout would.
    {
        let mut probe = Box::pin(limiter.check("k", 1));
        let polled = std::future::poll_fn(|cx| Poll::Ready(probe.as_mut().poll(cx).is_pending()));
        assert!(polled.await, "the probe waits on the paused server");
    }
    let _: String = server.cmd(&["CLIENT", "UNPAUSE"]);
    // Healthy again: within a few back-offs, decisions come from Redis.
    let mut from_redis = false;
    for _ in 0..40 {
        if limiter.check("k", 1).await.source() == Source::Store {
            from_redis = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        from_redis,
        "the breaker stayed wedged: {:?}",
        redis.circuit_state()
    );
}

/// 2. A bucket give-back never returns what the bucket's cap would have
/// dropped while the lease was out (the scripts' rule, on Redis' clock).
#[tokio::test]
async fn a_late_bucket_give_back_returns_nothing_the_cap_dropped() {
    let server = RedisServer::start();
    let script = redis::Script::new(include_str!("../lua/give_back.lua"));
    let mut conn = server.conn();
    for algorithm in ["tb", "gc"] {
        let key = format!("sl:{{t:{algorithm}}}:{algorithm}");
        let now = redis_now_us(&server);
        // burst 10, 10/s. A lease of 9 left the bucket at 1, one second
        // ago; no give-back since (the counter is still 5000). The bucket
        // has refilled to 10 meanwhile: nothing of the 8 may go back.
        let gb = 5_000u64;
        match algorithm {
            "tb" => {
                let _: () = redis::cmd("HSET")
                    .arg(&key)
                    .arg("tk")
                    .arg(1)
                    .arg("ts")
                    .arg(now)
                    .arg("gb")
                    .arg(gb)
                    .query(&mut conn)
                    .unwrap();
            }
            _ => {
                // One token available: the TAT is 0.9 s ahead.
                let _: () = redis::cmd("HSET")
                    .arg(&key)
                    .arg("t")
                    .arg(now + 900_000)
                    .arg("gb")
                    .arg(gb)
                    .query(&mut conn)
                    .unwrap();
            }
        }
        let _: () = redis::cmd("PEXPIRE")
            .arg(&key)
            .arg(5_000)
            .query(&mut conn)
            .unwrap();
        let give_back = |origin: u64, op: &str| {
            script
                .key(&key)
                .key(format!("{key}:op:{op}"))
                .arg(algorithm)
                .arg(10)
                .arg(1_000_000)
                .arg(10)
                .arg(8)
                .arg(origin)
                .arg(1)
                .arg(gb)
                .invoke::<i64>(&mut server.conn())
                .unwrap()
        };
        assert_eq!(give_back(now - 1_000_000, "late"), 0, "{algorithm}: late");
        // The same lease given back 0.05 s after it was taken: the bucket
        // can have reached 1.5 at most, so 8 go back.
        assert_eq!(give_back(now - 50_000, "early"), 8, "{algorithm}: early");
        // Its second delivery changes nothing and answers the same.
        assert_eq!(give_back(now - 50_000, "early"), 8, "{algorithm}: again");
        let ttl: i64 = server.cmd(&["PTTL", &format!("{key}:op:early")]);
        assert!(ttl > 0, "the identity key expires");
    }
}

/// 3. Every `u64` cost is compared, not cast: the embedded store denies a
/// cost the quota can never hold, as the scripts do, and counts nothing.
#[tokio::test]
async fn huge_costs_are_denied_and_uncounted_everywhere() {
    let server = RedisServer::start();
    for algorithm in ALGORITHMS {
        let quota = Quota::per_minute(nonzero!(10));
        let embedded = Limiter::builder(quota)
            .algorithm(algorithm)
            .store(MemoryStore::new())
            .build()
            .unwrap();
        let local = Limiter::builder(quota)
            .algorithm(algorithm)
            .local()
            .build()
            .unwrap();
        let redis = Limiter::builder(quota)
            .algorithm(algorithm)
            .store(store(&server).await)
            .namespace(&format!("huge-{}", algorithm.as_str()))
            .build()
            .unwrap();
        let fallback = Limiter::builder(quota)
            .algorithm(algorithm)
            .store(
                RedisStore::connect_lazy("redis://127.0.0.1:1/", RedisOptions::default()).unwrap(),
            )
            .on_store_error(FailurePolicy::LocalFallback(quota))
            .build()
            .unwrap();
        for limiter in [&embedded, &local, &redis, &fallback] {
            for cost in [u64::MAX, 1 << 63, (1 << 53) + 1, 11] {
                let d = limiter.check("k", cost).await;
                assert!(!d.is_allowed(), "{algorithm:?} {cost}: {d:?}");
                assert_eq!(d.retry_after(), None, "never admissible");
            }
            let d = limiter.check("k", 1).await;
            assert!(d.is_allowed());
            assert_eq!(d.remaining(), 9, "{algorithm:?}: nothing was counted");
        }
    }
}

/// 4. After an outage, one report Redis refuses for good is dropped and
/// counted; the others are applied once; decisions are not held hostage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_report_that_cannot_apply_holds_no_decision_hostage() {
    let server = RedisServer::start();
    let options = RedisOptions::default()
        .response_timeout(Duration::from_millis(50))
        .connect_timeout(Duration::from_secs(2))
        .circuit_breaker(
            CircuitConfig::default()
                .min_failures(1)
                .min_span(Duration::ZERO)
                .backoff(Duration::from_millis(50), Duration::from_millis(50)),
        );
    let redis = RedisStore::connect_with(&server.url(), options)
        .await
        .unwrap();
    let quota = Quota::new(100, Duration::from_secs(3600)).unwrap();
    let limiter = Limiter::builder(quota)
        .store(redis)
        .namespace("hostage")
        .on_store_error(FailurePolicy::LocalFallback(
            Quota::new(50, Duration::from_secs(3600)).unwrap(),
        ))
        .build()
        .unwrap();
    // Both keys exist in Redis before the outage.
    assert_eq!(limiter.check("good", 1).await.source(), Source::Store);
    assert_eq!(limiter.check("bad", 1).await.source(), Source::Store);
    server.freeze();
    let mut fallback = 0;
    for key in ["good", "good", "good", "bad", "bad"] {
        let d = limiter.check(key, 1).await;
        if d.source() == Source::Fallback && d.is_allowed() {
            fallback += 1;
        }
    }
    server.thaw();
    assert!(fallback >= 3, "the fallback decided during the outage");
    // "bad" now holds a value its reports can never apply to.
    let keys = server.keys();
    let bad = keys
        .iter()
        .find(|k| k.contains("bad") && k.ends_with(":fw"))
        .unwrap()
        .clone();
    let _: i64 = server.cmd(&["DEL", &bad]);
    let _: String = server.cmd(&["SET", &bad, "not a hash"]);
    tokio::time::sleep(Duration::from_millis(120)).await;
    let mut from_redis = 0;
    for _ in 0..5 {
        if limiter.check("good", 1).await.source() == Source::Store {
            from_redis += 1;
        }
    }
    assert!(
        from_redis >= 4,
        "decisions came from Redis again ({from_redis} of 5)"
    );
    let stats = limiter.stats();
    assert_eq!(
        stats.reports_dropped, 2,
        "bad's report was dropped and counted: {stats:?}"
    );
    // good: 1 before, 3 by the fallback (reported once), then 5 or so.
    let good = keys
        .iter()
        .find(|k| k.contains("good") && k.ends_with(":fw"))
        .unwrap();
    let fields: Vec<String> = server.cmd(&["HVALS", good]);
    let counted: i64 = fields.iter().map(|v| v.parse::<i64>().unwrap()).sum();
    // The check that met the frozen server timed out, yet Redis ran it
    // once thawed: it may be counted too, but nothing twice.
    let expected = 1 + stats.reconciled + from_redis;
    assert!(
        counted as u64 == expected || counted as u64 == expected + 1,
        "each fallback admission counted once: {counted} vs {expected}"
    );
}

/// 5. A bucket quota whose numbers would overflow the scripts is refused
/// at build; the largest accepted one writes keys that expire.
#[tokio::test]
async fn extreme_bucket_quotas_are_refused_or_expire() {
    let server = RedisServer::start();
    let year = Duration::from_secs(366 * 24 * 3600);
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let absurd = Quota::new(1, year).unwrap().with_burst(NonZeroU32::MAX);
        let e = Limiter::builder(absurd)
            .store(MemoryStore::new())
            .algorithm(algorithm)
            .exact()
            .build()
            .unwrap_err();
        assert!(
            e.is_invalid_input() && e.to_string().contains("fill"),
            "{e}"
        );
        let largest = Quota::new(1_000, year).unwrap().with_burst(nonzero!(1_000));
        for mode in 0..2 {
            let b = Limiter::builder(largest)
                .algorithm(algorithm)
                .store(store(&server).await)
                .namespace(&format!("extreme-{}-{mode}", algorithm.as_str()));
            let limiter = if mode == 0 {
                b.exact().build().unwrap()
            } else {
                b.hybrid(HybridConfig::optimistic(5)).build().unwrap()
            };
            for _ in 0..20 {
                let _ = limiter.check("k", 7).await;
            }
            limiter.shutdown().await;
        }
    }
    assert!(
        server.immortal_keys().is_empty(),
        "{:?}",
        server.immortal_keys()
    );
}

/// 6. A peek (cost 0) is always answered, even when debt pushed the count
/// past the limit.
#[tokio::test]
async fn a_peek_is_allowed_after_debt_pushed_the_count_past_the_limit() {
    let server = RedisServer::start();
    for algorithm in ALGORITHMS {
        let ns = format!("peek-{}", algorithm.as_str());
        let limiter = Limiter::builder(Quota::per_minute(nonzero!(10)))
            .algorithm(algorithm)
            .store(store(&server).await)
            .namespace(&ns)
            .build()
            .unwrap();
        assert!(limiter.check("k", 1).await.is_allowed());
        let key = server.keys().into_iter().find(|k| k.contains(&ns)).unwrap();
        let now = redis_now_us(&server);
        // Overdrawn, as optimistic debt leaves a key.
        match algorithm {
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let w = (now / 60_000_000).to_string();
                let _: i64 = server.cmd(&["HSET", &key, &w, "13"]);
            }
            Algorithm::TokenBucket => {
                let _: i64 = server.cmd(&["HSET", &key, "tk", "-3", "ts", &now.to_string()]);
            }
            _ => {
                let tat = (now + 78_000_000).to_string();
                let _: i64 = server.cmd(&["HSET", &key, "t", &tat]);
            }
        }
        let peek = limiter.check("k", 0).await;
        assert!(peek.is_allowed(), "{algorithm:?}: {peek:?}");
        assert_eq!(peek.remaining(), 0);
        assert!(!limiter.check("k", 1).await.is_allowed());
    }
}

/// 9. A give-back or a debt report delivered twice is applied once.
#[tokio::test]
async fn reports_delivered_twice_are_applied_once() {
    let server = RedisServer::start();
    let give_back = redis::Script::new(include_str!("../lua/give_back.lua"));
    let lease = redis::Script::new(concat!(
        include_str!("../lua/carry_fixed_window.lua"),
        include_str!("../lua/lease_window.lua")
    ));
    let key = "sl:{t:dup}:fw";
    let period = 3_600_000_000u64;
    let w = redis_now_us(&server) / period;
    let _: i64 = server.cmd(&["HSET", key, &w.to_string(), "10"]);
    let _: i64 = server.cmd(&["PEXPIRE", key, "60000"]);
    for _ in 0..2 {
        let back: i64 = give_back
            .key(key)
            .key(format!("{key}:op:gb1"))
            .arg("w")
            .arg(100)
            .arg(period)
            .arg(100)
            .arg(4)
            .arg(w)
            .invoke(&mut server.conn())
            .unwrap();
        assert_eq!(back, 4);
    }
    let count: i64 = server.cmd(&["HGET", key, &w.to_string()]);
    assert_eq!(count, 6, "given back once");
    for _ in 0..2 {
        let reply: Vec<i64> = lease
            .key(key)
            .key(format!("{key}:op:debt1"))
            .arg(100)
            .arg(period)
            .arg(0)
            .arg(1.0)
            .arg(5)
            .arg(w)
            .arg(-1)
            .arg(1)
            .invoke(&mut server.conn())
            .unwrap();
        assert_eq!(reply[6], 0, "covered");
    }
    let count: i64 = server.cmd(&["HGET", key, &w.to_string()]);
    assert_eq!(count, 11, "the debt was recorded once");
    assert!(server.immortal_keys().is_empty());
}

/// 10. Durations near `Duration::MAX` are refused at build, not overflowed.
#[tokio::test]
async fn absurd_durations_are_refused_at_build() {
    let huge = Duration::MAX;
    for config in [
        HybridConfig::strict().lease_ttl(huge),
        HybridConfig::strict().prelease_lead(huge),
        HybridConfig::strict().idle_ttl(huge),
        HybridConfig::strict().refill_horizon(huge),
        HybridConfig::strict().clock_margin(huge),
        HybridConfig::strict().max_wait(huge),
    ] {
        let e = Limiter::builder(Quota::per_second(nonzero!(10)))
            .store(MemoryStore::new())
            .hybrid(config)
            .build()
            .unwrap_err();
        assert!(e.is_invalid_input(), "{e}");
    }
    let options =
        RedisOptions::default().circuit_breaker(CircuitConfig::default().backoff(huge, huge));
    let e = RedisStore::connect_lazy("redis://127.0.0.1:1/", options).unwrap_err();
    assert!(e.is_invalid_input(), "{e}");
}

/// 11. A reconciliation whose future is dropped after its reports were
/// resent for longer than the store remembers an identity drops them and
/// counts them; it never loses one silently.
#[tokio::test(start_paused = true)]
async fn a_dropped_reconciliation_counts_what_it_drops() {
    use slicelimit::clock::FakeClock;
    use slicelimit_sim::{Faults, FaultyStore};
    let clock = FakeClock::new(Duration::from_secs(1_700_000_000));
    let memory = MemoryStore::with_clock(clock.clone());
    let down = Faults {
        lost_before: 1.0,
        ..Faults::default()
    };
    let faulty = FaultyStore::new(memory, down, 7, clock.clone());
    let limiter = Limiter::builder(Quota::new(10, Duration::from_secs(1)).unwrap())
        .store(faulty.clone())
        .namespace("dropped")
        .clock(clock.clone())
        .on_store_error(FailurePolicy::LocalFallback(
            Quota::new(5, Duration::from_secs(1)).unwrap(),
        ))
        .exact()
        .build()
        .unwrap();
    // The store is down: the fallback admits, and a report fails.
    assert_eq!(limiter.check("k", 1).await.source(), Source::Fallback);
    assert_eq!(limiter.check("k", 1).await.source(), Source::Fallback);
    // Past the resend age, the store answers slowly and the caller gives up.
    clock.advance(Duration::from_secs(51));
    faulty.set_faults(Faults {
        max_delay: Duration::from_millis(20),
        timeout: Duration::from_millis(25),
        ..Faults::default()
    });
    let _ = tokio::time::timeout(Duration::from_micros(1), limiter.check("k", 1)).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    limiter.check("k", 1).await;
    let stats = limiter.stats();
    assert!(stats.fallback_admitted >= 2, "{stats:?}");
    assert_eq!(
        stats.reconciled + stats.reports_dropped,
        stats.fallback_admitted,
        "every fallback admission is reported or counted as dropped: {stats:?}"
    );
}
