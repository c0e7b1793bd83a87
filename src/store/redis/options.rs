//! [`RedisOptions`]: timeouts, the circuit breaker, the clock and (feature
//! `tls`) the [`TlsOptions`] of a [`RedisStore`](super::RedisStore).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::breaker::CircuitConfig;
use crate::clock::{Clock, SystemClock};
use crate::error::Error;

/// Connection settings for a [`RedisStore`](super::RedisStore).
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisOptions {
    pub(super) connect_timeout: Duration,
    pub(super) response_timeout: Duration,
    pub(super) circuit: CircuitConfig,
    /// What the circuit breakers time their windows and back-offs on.
    pub(super) clock: Arc<dyn Clock>,
    #[cfg(feature = "tls")]
    pub(super) tls: Option<TlsOptions>,
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOptions")
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("circuit", &self.circuit)
            .field("tls", &self.has_tls())
            .finish_non_exhaustive()
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_millis(500),
            response_timeout: Duration::from_millis(25),
            circuit: CircuitConfig::default(),
            clock: Arc::new(SystemClock::new()),
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl RedisOptions {
    pub(super) fn validate(&self) -> Result<(), Error> {
        let day = Duration::from_secs(86_400);
        if self.response_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::invalid("Redis timeouts must be positive"));
        }
        if self.response_timeout > day || self.connect_timeout > day {
            return Err(Error::invalid(
                "Redis timeouts above a day are not timeouts",
            ));
        }
        self.circuit.validate()
    }

    /// How long establishing a connection may take (default 500 ms).
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one store call may take, reconnection included (default
    /// 25 ms, half the hybrid limiter's default `max_wait`, so a failed
    /// refill is known before a waiting request gives up). A rate limiter
    /// that waits longer than its callers' budget is worse than none.
    ///
    /// When answered calls take long (a Redis several milliseconds away,
    /// or a loaded one), the timeout in force stretches to six times their
    /// smoothed time, at most four times this: slow is not down. A Redis
    /// that stops answering adds nothing to that average.
    #[must_use]
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// When the circuit breaker opens and for how long (default: once at
    /// least 3 calls within 1 s failed and failures have gone on, most of
    /// the time, for 200 ms; open for 100 ms doubling to at most 1 s, with
    /// jitter). On a cluster each primary has a breaker of this
    /// configuration. See [`CircuitConfig`].
    #[must_use]
    pub fn circuit_breaker(mut self, config: CircuitConfig) -> Self {
        self.circuit = config;
        self
    }

    /// The clock the circuit breakers run on (default: the system clock):
    /// a test drives their windows and back-offs without sleeping. Call
    /// timeouts are real time whatever this says.
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// TLS settings for `rediss://` URLs: a private CA and a client
    /// certificate. Without them, a `rediss://` URL verifies the server
    /// against the system's roots. Certificates are always verified; the
    /// `tls-insecure` feature's `rediss://host:port/#insecure` turns that
    /// off, for tests against self-signed servers only.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), slicelimit::Error> {
    /// use slicelimit::{store::RedisOptions, RedisStore, store::TlsOptions};
    ///
    /// let tls = TlsOptions::new()
    ///     .root_ca_pem(std::fs::read("ca.pem").unwrap())
    ///     .client_cert_pem(std::fs::read("client.pem").unwrap(), std::fs::read("client.key").unwrap());
    /// let store = RedisStore::connect_with(
    ///     "rediss://limiter:s3cret@redis.internal:6380",
    ///     RedisOptions::default().tls(tls),
    /// )
    /// .await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls(mut self, tls: TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    pub(super) fn has_tls(&self) -> bool {
        #[cfg(feature = "tls")]
        return self.tls.is_some();
        #[cfg(not(feature = "tls"))]
        false
    }

    /// The response timeout in force.
    pub fn get_response_timeout(&self) -> Duration {
        self.response_timeout
    }
}

/// A private CA and a client certificate for TLS connections to Redis; see
/// [`RedisOptions::tls`].
#[cfg(feature = "tls")]
#[derive(Clone, Default)]
pub struct TlsOptions {
    root_ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

#[cfg(feature = "tls")]
impl fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsOptions")
            .field("root_ca", &self.root_ca.is_some())
            .field("client_cert", &self.client.is_some())
            .finish()
    }
}

#[cfg(feature = "tls")]
impl TlsOptions {
    /// Verify servers against the system's roots, with no client
    /// certificate.
    pub fn new() -> TlsOptions {
        TlsOptions::default()
    }

    /// Verify servers against these CA certificates (PEM) instead of the
    /// system's roots.
    #[must_use]
    pub fn root_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> TlsOptions {
        self.root_ca = Some(pem.into());
        self
    }

    /// Present this certificate chain and private key (PEM) to servers
    /// that ask for one (`tls-auth-clients yes`, Redis' default).
    #[must_use]
    pub fn client_cert_pem(
        mut self,
        cert_chain: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> TlsOptions {
        self.client = Some((cert_chain.into(), key.into()));
        self
    }

    pub(super) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.root_ca.clone(),
        }
    }
}
