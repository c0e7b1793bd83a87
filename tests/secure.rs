//! TLS (a private CA, client certificates, a cluster whose nodes talk TLS)
//! and ACL users, against real `redis-server` processes: exact and hybrid
//! limiters decide as on a plain connection, and every wrong setting is a
//! clear connection error, never a plaintext fallback.

use slicelimit_sim as support;

use std::time::Duration;

use slicelimit::{
    check_all, nonzero, store::RedisOptions, store::TlsOptions, Algorithm, ErrorKind, HybridConfig,
    Limiter, Quota, RedisStore,
};
use support::tls::{Certs, TlsCluster, TlsServer};
use support::RedisServer;

fn tls_options(certs: &Certs) -> RedisOptions {
    support::test_options().tls(
        TlsOptions::new()
            .root_ca_pem(certs.ca_pem.as_bytes())
            .client_cert_pem(
                certs.client_cert_pem.as_bytes(),
                certs.client_key_pem.as_bytes(),
            ),
    )
}

/// Checks `key` until `limit` are admitted (a strict hybrid limiter may
/// deny while a lease is on its way) or `tries` run out; returns how many
/// were admitted, then checks that one more is denied.
async fn admitted(limiters: &[Limiter], key: &str, tries: usize) -> u64 {
    let mut admitted = 0;
    for i in 0..tries {
        if limiters[i % limiters.len()]
            .check(key, 1)
            .await
            .is_allowed()
        {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_and_hybrid_decide_over_tls_with_a_client_certificate() {
    let certs = Certs::new();
    let server = TlsServer::start(&certs, true);
    let quota = Quota::new(40, Duration::from_secs(86_400)).unwrap();
    for (mode, ns) in [("exact", "tls-exact"), ("hybrid", "tls-hybrid")] {
        let mut limiters = Vec::new();
        for _ in 0..2 {
            let store = RedisStore::connect_with(&server.url(), tls_options(&certs))
                .await
                .expect("connect over TLS");
            let builder = Limiter::builder(quota).store(store).namespace(ns);
            let builder = if mode == "hybrid" {
                builder.hybrid(HybridConfig::strict().max_wait(Duration::from_secs(1)))
            } else {
                builder
            };
            limiters.push(builder.build().unwrap());
        }
        assert_eq!(admitted(&limiters, "k", 120).await, 40, "{mode}");
        for limiter in &limiters {
            assert!(!limiter.check("k", 1).await.is_allowed(), "{mode}");
            assert_eq!(limiter.stats().store_errors, 0, "{mode}");
        }
    }
    // The budgets are on this server (read over its plain port).
    let keys = server.server.keys();
    assert!(keys.iter().any(|k| k.contains("tls-exact")), "{keys:?}");
    assert!(keys.iter().any(|k| k.contains("tls-hybrid")), "{keys:?}");
    assert!(server.server.immortal_keys().is_empty());
}

#[tokio::test]
async fn a_server_that_does_not_verify_is_a_connection_error() {
    let certs = Certs::new();
    let server = TlsServer::start(&certs, true);
    let other = Certs::new();

    // A CA that did not sign the server's certificate.
    let err = RedisStore::connect_with(&server.url(), tls_options(&other))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );

    // The system's roots do not know the test CA either.
    let err = RedisStore::connect_with(&server.url(), support::test_options())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");

    // The right CA but no client certificate, where the server asks one.
    let no_client =
        support::test_options().tls(TlsOptions::new().root_ca_pem(certs.ca_pem.as_bytes()));
    let err = RedisStore::connect_with(&server.url(), no_client)
        .await
        .unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::Connection | ErrorKind::Timeout),
        "{err}"
    );

    // TLS settings with a plain URL: refused, not sent in plaintext.
    let plain = format!("redis://127.0.0.1:{}/", server.tls_port);
    let err = RedisStore::connect_with(&plain, tls_options(&certs))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");

    // A client built elsewhere carries its own TLS: settings given beside
    // it are refused, never silently ignored.
    let plain_client = redis::Client::open(server.server.url()).unwrap();
    let err = RedisStore::from_client(plain_client, tls_options(&certs))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");

    // Without a client certificate, where the server does not ask one.
    let open = TlsServer::start(&certs, false);
    let store = RedisStore::connect_with(
        &open.url(),
        support::test_options().tls(TlsOptions::new().root_ca_pem(certs.ca_pem.as_bytes())),
    )
    .await
    .expect("server-verified TLS without a client certificate");
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1)))
        .store(store)
        .build()
        .unwrap();
    assert!(limiter.check("k", 1).await.is_allowed());
    assert!(!limiter.check("k", 1).await.is_allowed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_and_hybrid_decide_on_a_cluster_over_tls() {
    let certs = Certs::new();
    let cluster = TlsCluster::start(&certs);
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let quota = Quota::new(30, Duration::from_secs(86_400)).unwrap();
    let keys: Vec<String> = (0..6).map(|i| format!("key-{i}")).collect();
    for mode in ["exact", "hybrid"] {
        let mut limiters = Vec::new();
        for _ in 0..2 {
            let store = RedisStore::connect_cluster_with(&urls, tls_options(&certs))
                .await
                .expect("connect to the cluster over TLS");
            assert!(store.is_cluster());
            let builder = Limiter::builder(quota)
                .store(store)
                .namespace(&format!("tls-cluster-{mode}"));
            let builder = if mode == "hybrid" {
                builder.hybrid(HybridConfig::strict().max_wait(Duration::from_secs(1)))
            } else {
                builder
            };
            limiters.push(builder.build().unwrap());
        }
        for key in &keys {
            assert_eq!(admitted(&limiters, key, 90).await, 30, "{mode} {key}");
        }
        for limiter in &limiters {
            assert_eq!(limiter.stats().store_errors, 0, "{mode}");
        }
    }
    // The keys landed on more than one primary.
    let holding = cluster
        .cluster
        .nodes
        .iter()
        .filter(|n| !n.keys().is_empty())
        .count();
    assert!(holding >= 2, "keys on {holding} primaries");
    assert!(cluster.cluster.immortal_keys().is_empty());
}

/// The commands the crate needs (see docs/operations.md): the two it
/// sends, and those its scripts run (Redis checks a script's commands
/// against the caller's ACL too).
const NEEDED: &str = "+evalsha +script|load +exists +get +set +hdel +hget +hgetall \
                      +hincrby +hkeys +hlen +hmget +hset +pexpire +pttl +time";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_with_only_the_needed_commands_can_run_every_limiter() {
    let server = RedisServer::start();
    let mut rule = vec!["ACL", "SETUSER", "limiter", "on", ">s3cret", "~*", "-@all"];
    rule.extend(NEEDED.split_whitespace());
    let _: String = server.cmd(&rule);
    let url = format!("redis://limiter:s3cret@127.0.0.1:{}/", server.port());

    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        for hybrid in [false, true] {
            let store = RedisStore::connect_with(&url, support::test_options())
                .await
                .expect("connect as the ACL user");
            let builder = Limiter::builder(Quota::new(20, Duration::from_secs(86_400)).unwrap())
                .store(store)
                .algorithm(algorithm)
                .namespace(&format!("acl-{algorithm:?}-{hybrid}"));
            let builder = if hybrid {
                builder.hybrid(HybridConfig::strict().max_wait(Duration::from_secs(1)))
            } else {
                builder
            };
            let limiter = builder.build().unwrap();
            let n = admitted(std::slice::from_ref(&limiter), "k", 40).await;
            assert_eq!(n, 20, "{algorithm:?} hybrid={hybrid}");
            let d = limiter.check("other", 1).await;
            assert!(d.is_allowed());
            // The refund script runs under the user too.
            limiter.refund("other", &d).await;
            assert_eq!(limiter.stats().store_errors, 0, "{algorithm:?} {hybrid}");
        }
    }
    // Several quotas and several limiters, under the same user.
    let store = RedisStore::connect_with(&url, support::test_options())
        .await
        .unwrap();
    let user = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .and(Quota::per_hour(nonzero!(50)))
        .store(store.clone())
        .namespace("acl-user")
        .build()
        .unwrap();
    let org = Limiter::builder(Quota::per_minute(nonzero!(50)))
        .store(store)
        .namespace("acl-org")
        .build()
        .unwrap();
    let d = check_all(&[(&user, "alice"), (&org, "acme")], 1).await;
    assert!(d.is_allowed());
    assert_eq!(user.stats().store_errors + org.stats().store_errors, 0);

    // One command fewer than needed: the store says what was refused.
    let _: String = server.cmd(&["ACL", "SETUSER", "limiter", "-time"]);
    let store = RedisStore::connect_with(&url, support::test_options())
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(5)))
        .store(store)
        .namespace("acl-short")
        .on_store_error(slicelimit::FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let d = limiter.check("k", 1).await;
    assert!(!d.is_allowed());
    assert_eq!(d.source(), slicelimit::Source::FailClosed, "{d:?}");
    assert!(limiter.stats().policy_decisions >= 1);
}

#[tokio::test]
async fn a_wrong_password_is_a_clear_connection_error() {
    let server = RedisServer::start();
    let _: String = server.cmd(&["ACL", "SETUSER", "limiter", "on", ">right", "~*", "+@all"]);
    let url = format!("redis://limiter:wrong@127.0.0.1:{}/", server.port());
    let err = RedisStore::connect_with(&url, support::test_options())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    let message = err.to_string();
    assert!(
        message.contains("WRONGPASS") || message.to_lowercase().contains("password"),
        "{message}"
    );
    assert!(
        !message.contains("wrong@"),
        "the password leaked: {message}"
    );
}

/// `rediss://` to a port that serves plaintext: the error says TLS is
/// what went wrong, not only that the connection failed, whether the
/// server leaves the client's handshake unanswered (Redis: a timeout) or
/// answers it in plaintext (a connection error). (A cluster client's
/// connection error keeps only the text of its cause: it gets the hint
/// on a timeout alone.)
#[tokio::test]
async fn tls_to_a_plaintext_port_says_so() {
    let redis = RedisServer::start();
    for (port, clusters) in [
        (redis.port(), &[false, true][..]),
        (plaintext_answerer(), &[false][..]),
    ] {
        let address = format!("127.0.0.1:{port}");
        let url = format!("rediss://{address}/");
        for &cluster in clusters {
            let options = RedisOptions::default().connect_timeout(Duration::from_millis(500));
            let err = if cluster {
                RedisStore::connect_cluster_with(&[&url], options).await
            } else {
                RedisStore::connect_with(&url, options).await
            }
            .unwrap_err();
            assert!(
                matches!(err.kind(), ErrorKind::Timeout | ErrorKind::Connection),
                "{err}"
            );
            let message = err.to_string();
            let hint = format!("a TLS handshake to {address} got no TLS answer");
            assert!(message.contains(&hint), "cluster {cluster}: {message}");
        }
    }
}

/// A port that answers whatever it is sent with a plaintext Redis error
/// and closes the connection; its listener lives as long as the test.
fn plaintext_answerer() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = stream.read(&mut [0u8; 4096]);
            let _ = stream.write_all(b"-ERR unknown command\r\n");
        }
    });
    port
}
