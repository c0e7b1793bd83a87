//! How a [`RedisStore`] reaches its server: a URL (plain or `rediss://`),
//! a cluster's seed URLs, Redis Sentinel, or a client set up elsewhere;
//! and how the connection is made again after a failover.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;

use super::calls::batch_timeout;
use super::{Conn, Rebuild, RedisOptions, RedisStore};
use crate::error::Error;
use crate::store::topology::Topology;

#[cfg(feature = "sentinel")]
use super::sentinel::{Sentinel, SentinelClient};
use super::url::{
    check_scheme, connect_error, connect_timeout, ensure_crypto_provider, redact, tls_address,
};

/// How to make a fresh connection, kept for rebuilding it.
pub(super) enum Client {
    Cluster(redis::cluster::ClusterClient),
    Single(redis::Client, ConnectionManagerConfig),
    /// The primary the Sentinels name now (asked again on every rebuild).
    #[cfg(feature = "sentinel")]
    Sentinel(Box<SentinelClient>),
}

impl Client {
    pub(super) async fn connect(&self) -> Option<Conn> {
        match self {
            Client::Cluster(c) => c.get_async_connection().await.ok().map(Conn::Cluster),
            Client::Single(c, config) => c
                .get_connection_manager_with_config(config.clone())
                .await
                .ok()
                .map(Conn::Single),
            #[cfg(feature = "sentinel")]
            Client::Sentinel(s) => s.primary().await.ok().map(Conn::Single),
        }
    }

    /// How long making a fresh connection may take: the connect timeout,
    /// and through Sentinels one more per Sentinel (they are asked in
    /// turn, and one that hangs costs a timeout before the next is asked).
    pub(super) fn connect_limit(&self, connect_timeout: Duration) -> Duration {
        match self {
            #[cfg(feature = "sentinel")]
            Client::Sentinel(s) => connect_timeout_through(s, connect_timeout),
            _ => connect_timeout,
        }
    }
}

/// Through Sentinels, the connect timeout once more per Sentinel (they
/// are asked in turn, and one that hangs costs a timeout before the next).
#[cfg(feature = "sentinel")]
fn connect_timeout_through(sentinels: &SentinelClient, connect_timeout: Duration) -> Duration {
    connect_timeout * (sentinels.urls.len() as u32 + 1)
}

/// A client built elsewhere carries its own TLS setup; settings given to
/// the store would be ignored, so they are refused.
fn refuse_tls_for_built(options: &RedisOptions) -> Result<(), Error> {
    if options.has_tls() {
        return Err(Error::invalid(
            "TLS settings were given with a client built elsewhere, which they would not \
             change: set TLS up on the client (redis::Client::build_with_tls)",
        ));
    }
    Ok(())
}

impl RedisStore {
    /// Connects to a single Redis node with the default options.
    ///
    /// The URL may carry a user and password (`redis://user:pass@host:6379`,
    /// for an ACL user) and a database (`/2`); `rediss://` connects over
    /// TLS (the `tls` feature; see [`RedisOptions::tls`] for a private CA
    /// and client certificates).
    ///
    /// # Errors
    /// A [`Connection`](crate::ErrorKind::Connection) or
    /// [`Timeout`](crate::ErrorKind::Timeout) error if the server cannot be
    /// reached within the connect timeout, refuses the credentials, or
    /// presents a certificate that does not verify; an
    /// [`InvalidInput`](crate::ErrorKind::InvalidInput) error for a bad URL;
    /// [`Unsupported`](crate::ErrorKind::Unsupported) for `rediss://`
    /// without the `tls` feature.
    pub async fn connect(url: &str) -> Result<RedisStore, Error> {
        RedisStore::connect_with(url, RedisOptions::default()).await
    }

    /// Connects to a single Redis node.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<RedisStore, Error> {
        options.validate()?;
        let client = Self::client(url, &options)?;
        Self::connect_client(client, options).await
    }

    /// Connects through a [`redis::Client`] set up elsewhere (a custom
    /// resolver, TLS material from a secret store, a Unix socket …). The
    /// store keeps it to reconnect.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn from_client(
        client: redis::Client,
        options: RedisOptions,
    ) -> Result<RedisStore, Error> {
        options.validate()?;
        refuse_tls_for_built(&options)?;
        Self::connect_client(client, options).await
    }

    /// Connects through `client`, which carries the TLS settings if any.
    async fn connect_client(
        client: redis::Client,
        options: RedisOptions,
    ) -> Result<RedisStore, Error> {
        ensure_crypto_provider();
        let addr = client.get_connection_info().addr();
        let target = redact(&addr.to_string());
        let tls = tls_address(addr);
        let config = Self::manager_config(&options);
        let conn = tokio::time::timeout(
            options.connect_timeout,
            client.get_connection_manager_with_config(config.clone()),
        )
        .await
        .map_err(|_| connect_timeout(&target, options.connect_timeout, tls.as_deref()))?
        .map_err(|e| connect_error(&target, e, tls.as_deref()))?;
        Ok(Self::with_rebuild(
            Self::from_parts(Conn::Single(conn), options, &target),
            Client::Single(client, config),
        ))
    }

    pub(super) fn with_rebuild(mut store: RedisStore, client: Client) -> RedisStore {
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            inner.rebuild = Some(Rebuild {
                client,
                running: AtomicBool::new(false),
                last_us: AtomicU64::new(0),
                born: std::time::Instant::now(),
            });
        }
        store
    }

    /// Connects to a Redis Cluster through any of its nodes, with the
    /// default options.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_cluster(urls: &[&str]) -> Result<RedisStore, Error> {
        RedisStore::connect_cluster_with(urls, RedisOptions::default()).await
    }

    /// Connects to a Redis Cluster through any of its nodes. Each script
    /// call goes to the primary of its key's hash slot. Credentials and
    /// TLS (`rediss://`, with [`RedisOptions::tls`]) come from the URLs as
    /// for a single node and apply to every node.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_cluster_with(
        urls: &[&str],
        options: RedisOptions,
    ) -> Result<RedisStore, Error> {
        options.validate()?;
        check_scheme(urls, &options)?;
        let shown: Vec<String> = urls.iter().map(|u| redact(u)).collect();
        // The client's own timeouts also bound its topology refreshes after
        // a failover, which must be allowed to finish in the background;
        // each call is still bounded by `response_timeout` here.
        let builder = redis::cluster::ClusterClientBuilder::new(urls.iter().copied())
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.connect_timeout.max(options.response_timeout))
            .retries(2)
            .min_retry_wait(5)
            .max_retry_wait(50);
        #[cfg(feature = "tls")]
        let builder = match &options.tls {
            Some(tls) => builder.certs(tls.certificates()),
            None => builder,
        };
        let client = builder.build().map_err(|e| {
            Error::invalid(format!("bad Redis Cluster URLs {shown:?}: {e}")).caused_by(e)
        })?;
        let seeds: Vec<redis::ConnectionAddr> = urls
            .iter()
            .filter_map(|u| redis::Client::open(*u).ok())
            .map(|c| c.get_connection_info().addr().clone())
            .collect();
        let seed_host = match seeds.first() {
            Some(redis::ConnectionAddr::Tcp(host, _)) => host.clone(),
            Some(redis::ConnectionAddr::TcpTls { host, .. }) => host.clone(),
            _ => String::new(),
        };
        let tls: Vec<String> = seeds.iter().filter_map(tls_address).collect();
        let tls = (!tls.is_empty()).then(|| tls.join(","));
        Self::from_cluster(client, options, &shown.join(","), &seed_host, tls).await
    }

    /// Connects through a [`redis::cluster::ClusterClient`] set up
    /// elsewhere (its own TLS, credentials, timeouts); `seed_host` is the
    /// host the nodes are reached on when they announce no address.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn from_cluster_client(
        client: redis::cluster::ClusterClient,
        options: RedisOptions,
        seed_host: &str,
    ) -> Result<RedisStore, Error> {
        options.validate()?;
        refuse_tls_for_built(&options)?;
        Self::from_cluster(client, options, "a Redis Cluster", seed_host, None).await
    }

    /// `tls`: the seeds' addresses when they are reached over TLS.
    async fn from_cluster(
        client: redis::cluster::ClusterClient,
        options: RedisOptions,
        target: &str,
        seed_host: &str,
        tls: Option<String>,
    ) -> Result<RedisStore, Error> {
        ensure_crypto_provider();
        let cluster = format!("the cluster at {target}");
        let conn = tokio::time::timeout(options.connect_timeout, client.get_async_connection())
            .await
            .map_err(|_| connect_timeout(&cluster, options.connect_timeout, tls.as_deref()))?
            .map_err(|e| connect_error(&cluster, e, tls.as_deref()))?;
        let mut store = Self::from_parts(Conn::Cluster(conn), options, target);
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            inner.topology = Some(Topology::new(
                inner.options.circuit,
                inner.options.clock.clone(),
                seed_host,
            ));
        }
        let store = Self::with_rebuild(store, Client::Cluster(client));
        // The slot map; without it every call uses the store-wide breaker
        // until the first refresh.
        let _ =
            tokio::time::timeout(store.inner.options.connect_timeout, store.read_topology()).await;
        Ok(store)
    }

    /// Builds a store without connecting: the first call connects. A
    /// limiter built on it starts even while Redis is unreachable and
    /// applies its failure policy until Redis answers.
    ///
    /// # Errors
    /// An [`InvalidInput`](crate::ErrorKind::InvalidInput) error for a bad
    /// URL; [`Unsupported`](crate::ErrorKind::Unsupported) for `rediss://`
    /// without the `tls` feature.
    pub fn connect_lazy(url: &str, options: RedisOptions) -> Result<RedisStore, Error> {
        options.validate()?;
        let client = Self::client(url, &options)?;
        let config = Self::manager_config(&options);
        let conn = client
            .get_connection_manager_lazy(config.clone())
            .map_err(|e| {
                Error::invalid(format!("bad Redis configuration for {}: {e}", redact(url)))
                    .caused_by(e)
            })?;
        Ok(Self::with_rebuild(
            Self::from_parts(Conn::Single(conn), options, &redact(url)),
            Client::Single(client, config),
        ))
    }

    fn client(url: &str, options: &RedisOptions) -> Result<redis::Client, Error> {
        check_scheme(&[url], options)?;
        ensure_crypto_provider();
        let bad = |e: redis::RedisError| {
            Error::invalid(format!("bad Redis URL {:?}: {e}", redact(url))).caused_by(e)
        };
        #[cfg(feature = "tls")]
        if let Some(tls) = &options.tls {
            return redis::Client::build_with_tls(url, tls.certificates()).map_err(bad);
        }
        redis::Client::open(url).map_err(bad)
    }

    pub(super) fn manager_config(options: &RedisOptions) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            // Each call is bounded here, by `batch_timeout`; the manager's
            // own limit only backs that up for the largest batch.
            .set_response_timeout(Some(batch_timeout(options.response_timeout, usize::MAX)))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500))
    }
}

#[cfg(feature = "sentinel")]
impl RedisStore {
    /// Connects to the primary of `service` as Redis Sentinel names it,
    /// and follows failovers: when the primary stops answering or answers
    /// as a replica, the store asks the Sentinels again (at most every
    /// 500 ms) while the failure policy decides, and sends its calls to
    /// the new primary once they name it.
    ///
    /// # Errors
    /// A [`Connection`](crate::ErrorKind::Connection) or
    /// [`Timeout`](crate::ErrorKind::Timeout) error if no Sentinel answers,
    /// none knows the service, or its primary cannot be reached within the
    /// connect timeout; [`InvalidInput`](crate::ErrorKind::InvalidInput)
    /// for a bad URL or an empty list.
    pub async fn connect_sentinel(
        sentinel: Sentinel,
        options: RedisOptions,
    ) -> Result<RedisStore, Error> {
        options.validate()?;
        let sentinels = SentinelClient::new(&sentinel, &options, Self::manager_config(&options))?;
        ensure_crypto_provider();
        let target = format!("the primary of {:?} through Sentinel", sentinels.service());
        let limit = connect_timeout_through(&sentinels, options.connect_timeout);
        let conn = tokio::time::timeout(limit, sentinels.primary())
            .await
            .map_err(|_| connect_timeout(&target, limit, None))?
            .map_err(|e| connect_error(&target, e, None))?;
        let store = Self::with_rebuild(
            Self::from_parts(Conn::Single(conn), options, &target),
            Client::Sentinel(Box::new(sentinels)),
        );
        watch_sentinels(&store);
        Ok(store)
    }
}

#[cfg(feature = "sentinel")]
/// How often the Sentinels are asked which node is the primary, so a
/// planned failover (where the old primary keeps answering as one until
/// it is reconfigured) is followed within about this long.
const SENTINEL_CHECK_EVERY: Duration = Duration::from_secs(1);

#[cfg(feature = "sentinel")]
/// Asks the Sentinels every [`SENTINEL_CHECK_EVERY`] which node is the
/// primary, and rebuilds the connection when it is not the one the store
/// uses; ends with the store.
fn watch_sentinels(store: &RedisStore) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let weak = Arc::downgrade(&store.inner);
    runtime.spawn(async move {
        let mut tick = tokio::time::interval(SENTINEL_CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let Some(inner) = weak.upgrade() else {
                return;
            };
            let store = RedisStore { inner };
            let Some(Rebuild {
                client: Client::Sentinel(sentinel),
                ..
            }) = &store.inner.rebuild
            else {
                return;
            };
            let each = store.inner.options.connect_timeout;
            if let Some(named) = sentinel.named_primary(each).await {
                if sentinel.moved_from(&named) {
                    store.maybe_rebuild();
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(feature = "tls")]
    use crate::error::ErrorKind;
    #[cfg(feature = "tls")]
    use crate::store::redis::TlsOptions;

    #[test]
    fn redact_hides_credentials() {
        assert_eq!(
            redact("redis://user:pw@host:6379/0"),
            "redis://<credentials>@host:6379/0"
        );
        assert_eq!(redact("rediss://:pw@h:1"), "rediss://<credentials>@h:1");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        assert_eq!(redact("user:pw@host:1"), "<credentials>@host:1");
        assert_eq!(redact("//user:pw@host:1"), "<credentials>@host:1");
        assert_eq!(
            redact("redis://u:p@ss@host:1/0"),
            "redis://<credentials>@host:1/0"
        );
        assert_eq!(
            redact("redis+unix:///tmp/r.sock?db=1&pass=hunter2"),
            "redis+unix:///tmp/r.sock?db=1&pass=<redacted>"
        );
        assert!(!redact("unix:///s?password=hunter2&db=x").contains("hunter2"));
    }

    #[test]
    fn tls_settings_never_fall_back_to_plaintext() {
        let err = check_scheme(&["redis://127.0.0.1:1"], &RedisOptions::default());
        assert!(err.is_ok());
        #[cfg(feature = "tls")]
        {
            let options = RedisOptions::default().tls(TlsOptions::new());
            let err = check_scheme(&["redis://127.0.0.1:1"], &options).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
        }
        #[cfg(not(feature = "tls"))]
        {
            let err = check_scheme(&["rediss://127.0.0.1:1"], &RedisOptions::default());
            assert_eq!(err.unwrap_err().kind(), ErrorKind::Unsupported);
        }
    }
}
