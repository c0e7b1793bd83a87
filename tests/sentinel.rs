//! Redis Sentinel: a store that finds the primary through three Sentinels
//! follows a failover. A primary killed mid-run: the failure policy
//! decides meanwhile, then decisions come from the promoted replica.

use slicelimit_sim as support;

use std::time::{Duration, Instant};

use slicelimit::{
    nonzero, store::RedisOptions, store::Sentinel, FailurePolicy, HybridConfig, Limiter, Quota,
    RedisStore, Source,
};
use support::sentinel::{SentinelSetup, SERVICE};

fn options() -> RedisOptions {
    RedisOptions::default()
        .response_timeout(Duration::from_millis(200))
        .connect_timeout(Duration::from_millis(500))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_follow_the_primary_across_a_failover() {
    let mut setup = SentinelSetup::start();
    let urls = setup.sentinel_urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let store = RedisStore::connect_sentinel(Sentinel::new(&urls, SERVICE), options())
        .await
        .expect("connect through the Sentinels");
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1000)))
        .store(store.clone())
        .namespace("sentinel")
        .on_store_error(FailurePolicy::FailOpen)
        .build()
        .unwrap();

    for i in 0..20 {
        let d = limiter.check(&format!("before-{i}"), 1).await;
        assert_eq!(d.source(), Source::Store, "{d:?}");
    }
    assert!(setup.primary.keys().iter().any(|k| k.contains("before-")));

    let replica_port = setup.replica.port();
    setup.primary.kill();
    let killed = Instant::now();
    let mut by_policy = 0;
    let mut from_new_primary = None;
    let mut n = 0;
    while killed.elapsed() < Duration::from_secs(60) {
        let began = Instant::now();
        let d = limiter.check(&format!("during-{n}"), 1).await;
        n += 1;
        // No decision waits past the response timeout (plus scheduling).
        assert!(
            began.elapsed() < Duration::from_secs(2),
            "{:?}",
            began.elapsed()
        );
        match d.source() {
            Source::Store => {
                from_new_primary = Some(killed.elapsed());
                break;
            }
            Source::FailOpen => by_policy += 1,
            other => panic!("unexpected source {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = from_new_primary.expect("no decision from the new primary within 60 s");
    eprintln!(
        "Sentinel failover: decisions from the new primary {took:?} after the kill \
         ({by_policy} by the failure policy meanwhile)"
    );
    assert!(
        by_policy > 0,
        "the old primary is dead: the policy decided meanwhile"
    );
    assert_eq!(setup.named_primary(), Some(replica_port));
    assert!(setup.replica.keys().iter().any(|k| k.contains("during-")));

    // The new primary counts exactly, for exact and hybrid limiters.
    let exact = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .store(store.clone())
        .namespace("after-exact")
        .build()
        .unwrap();
    let hybrid = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .store(store)
        .namespace("after-hybrid")
        .hybrid(HybridConfig::strict().max_wait(Duration::from_secs(1)))
        .build()
        .unwrap();
    for limiter in [&exact, &hybrid] {
        let mut admitted = 0;
        for _ in 0..10 {
            let d = limiter.check("k", 1).await;
            assert!(
                !matches!(d.source(), Source::FailOpen | Source::FailClosed),
                "{d:?}"
            );
            admitted += u32::from(d.is_allowed());
        }
        assert_eq!(admitted, 5);
    }
    assert!(setup.replica.immortal_keys().is_empty());
}

#[tokio::test]
async fn no_sentinel_answering_is_a_connection_error() {
    let err =
        RedisStore::connect_sentinel(Sentinel::new(&["redis://127.0.0.1:1/"], SERVICE), options())
            .await
            .unwrap_err();
    assert!(
        matches!(
            err.kind(),
            slicelimit::ErrorKind::Connection | slicelimit::ErrorKind::Timeout
        ),
        "{err}"
    );
    let err = RedisStore::connect_sentinel(Sentinel::new(&[], SERVICE), options())
        .await
        .unwrap_err();
    assert!(err.is_invalid_input(), "{err}");
}

/// A planned failover (`SENTINEL FAILOVER`): the old primary keeps
/// answering as one until the Sentinels reconfigure it, so no error says
/// the primary moved; the store asks the Sentinels every second and
/// follows within a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_failover_is_followed_without_an_error() {
    let setup = SentinelSetup::start();
    let urls = setup.sentinel_urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let store = RedisStore::connect_sentinel(Sentinel::new(&urls, SERVICE), options())
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_hour(nonzero!(1000)))
        .store(store)
        .namespace("planned")
        .build()
        .unwrap();
    assert_eq!(limiter.check("before", 1).await.source(), Source::Store);
    let replica_port = setup.replica.port();
    let _: String = setup.sentinels[0]
        .query(&["SENTINEL", "FAILOVER", SERVICE])
        .expect("SENTINEL FAILOVER");
    let began = Instant::now();
    let mut n = 0;
    let followed = loop {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "decisions never reached the new primary"
        );
        let key = format!("after-{n}");
        n += 1;
        limiter.check(&key, 1).await;
        if setup.named_primary() == Some(replica_port)
            && setup.replica.keys().iter().any(|k| k.contains(&key))
        {
            break began.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "planned failover: decisions on the new primary {followed:?} after SENTINEL FAILOVER"
    );
    assert!(followed < Duration::from_secs(10), "{followed:?}");
}

/// TLS settings cannot apply to a Sentinel store: refused, not ignored.
#[tokio::test]
async fn tls_settings_for_a_sentinel_store_are_refused() {
    let with_tls = options().tls(slicelimit::store::TlsOptions::new());
    let err =
        RedisStore::connect_sentinel(Sentinel::new(&["redis://127.0.0.1:1/"], SERVICE), with_tls)
            .await
            .unwrap_err();
    assert_eq!(err.kind(), slicelimit::ErrorKind::Unsupported, "{err}");
    // Nor a TLS URL for the Sentinels, which would leave the primary
    // in plaintext.
    let err = RedisStore::connect_sentinel(
        Sentinel::new(&["rediss://127.0.0.1:1/"], SERVICE),
        options(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), slicelimit::ErrorKind::Unsupported, "{err}");
}
