//! Redis Sentinel (feature `sentinel`): where the primary is, asked of
//! the Sentinels when the store connects, when it rebuilds its connection
//! and every second, so a failover is followed whether or not an error
//! announced it.

use std::fmt;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::RedisOptions;
use crate::error::{Error, ErrorKind};

use super::url::{check_scheme, is_tls, redact};

/// A Redis Sentinel deployment: where its Sentinels are, which monitored
/// service holds the budgets, and how to log in to that service's primary.
/// See [`RedisStore::connect_sentinel`](super::RedisStore::connect_sentinel).
///
/// ```
/// use slicelimit::store::Sentinel;
///
/// let sentinel = Sentinel::new(
///     &["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
///     "limits",
/// )
/// .primary_auth(Some("limiter"), "s3cret");
/// # let _ = sentinel;
/// ```
#[derive(Clone)]
pub struct Sentinel {
    sentinels: Vec<String>,
    service: String,
    username: Option<String>,
    password: Option<String>,
}

impl fmt::Debug for Sentinel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sentinel")
            .field(
                "sentinels",
                &self.sentinels.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
            .field("service", &self.service)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

impl Sentinel {
    /// The Sentinels' URLs (`redis://host:26379`, with credentials if the
    /// Sentinels require them) and the name of the monitored service.
    pub fn new(sentinels: &[&str], service: &str) -> Sentinel {
        Sentinel {
            sentinels: sentinels.iter().map(|s| (*s).to_owned()).collect(),
            service: service.to_owned(),
            username: None,
            password: None,
        }
    }

    /// The user (`None`: the default user) and password for the primary
    /// itself; the Sentinels' own come from their URLs.
    #[must_use]
    pub fn primary_auth(mut self, username: Option<&str>, password: &str) -> Sentinel {
        self.username = username.map(str::to_owned);
        self.password = Some(password.to_owned());
        self
    }
}

/// Asks the Sentinels for the primary and connects to it.
pub(super) struct SentinelClient {
    sentinel: tokio::sync::Mutex<redis::sentinel::Sentinel>,
    pub(super) urls: Vec<String>,
    service: String,
    node: redis::sentinel::SentinelNodeConnectionInfo,
    config: ConnectionManagerConfig,
    /// The primary the store's connection goes to (host, port).
    current: std::sync::Mutex<Option<(String, u16)>>,
}

impl SentinelClient {
    /// The client for `sentinel`, refusing what it cannot do as asked: TLS
    /// (the primary would be reached in plaintext) and bad URLs.
    pub(super) fn new(
        sentinel: &Sentinel,
        options: &RedisOptions,
        config: ConnectionManagerConfig,
    ) -> Result<SentinelClient, Error> {
        if options.has_tls() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "TLS settings were given for a Sentinel store; TLS through Sentinel is not \
                 supported (the Sentinels and the primary are reached in plaintext)",
            ));
        }
        let urls: Vec<&str> = sentinel.sentinels.iter().map(String::as_str).collect();
        if let Some(url) = urls.iter().find(|u| is_tls(u)) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} is a TLS URL; TLS through Sentinel is not supported (the primary \
                     would be reached in plaintext)",
                    redact(url)
                ),
            ));
        }
        check_scheme(&urls, options)?;
        let sentinels = redis::sentinel::Sentinel::build(urls).map_err(|e| {
            Error::invalid(format!("bad Sentinel URLs {:?}: {e}", sentinel)).caused_by(e)
        })?;
        let mut info = redis::RedisConnectionInfo::default();
        if let Some(user) = &sentinel.username {
            info = info.set_username(user);
        }
        if let Some(password) = &sentinel.password {
            info = info.set_password(password);
        }
        Ok(SentinelClient {
            sentinel: tokio::sync::Mutex::new(sentinels),
            urls: sentinel.sentinels.clone(),
            current: std::sync::Mutex::new(None),
            service: sentinel.service.clone(),
            node: redis::sentinel::SentinelNodeConnectionInfo::default()
                .set_redis_connection_info(info),
            config,
        })
    }

    /// The monitored service's name.
    pub(super) fn service(&self) -> &str {
        &self.service
    }

    /// A connection to the primary the Sentinels name now; the client
    /// checks that the node it finds calls itself a primary.
    pub(super) async fn primary(&self) -> redis::RedisResult<ConnectionManager> {
        let client = {
            let mut sentinel = self.sentinel.lock().await;
            sentinel
                .async_master_for(&self.service, Some(&self.node))
                .await?
        };
        let addr = match client.get_connection_info().addr() {
            redis::ConnectionAddr::Tcp(host, port) => Some((host.clone(), *port)),
            redis::ConnectionAddr::TcpTls { host, port, .. } => Some((host.clone(), *port)),
            _ => None,
        };
        let conn = client
            .get_connection_manager_with_config(self.config.clone())
            .await?;
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = addr;
        Ok(conn)
    }

    /// The primary the first Sentinel to answer names, each asked for at
    /// most `each`.
    pub(super) async fn named_primary(&self, each: Duration) -> Option<(String, u16)> {
        for url in &self.urls {
            let Ok(client) = redis::Client::open(url.as_str()) else {
                continue;
            };
            let ask = async {
                let mut conn = client.get_multiplexed_async_connection().await.ok()?;
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.service)
                    .query_async::<Option<(String, u16)>>(&mut conn)
                    .await
                    .ok()?
            };
            if let Ok(Some(addr)) = tokio::time::timeout(each, ask).await {
                return Some(addr);
            }
        }
        None
    }

    /// Whether the store's connection goes to a node other than `named`.
    pub(super) fn moved_from(&self, named: &(String, u16)) -> bool {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|current| current != named)
    }
}
