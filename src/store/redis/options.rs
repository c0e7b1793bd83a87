//! [`RedisOptions`]: timeouts, the circuit breaker and the clock of a
//! [`RedisStore`](super::RedisStore).

use super::*;

/// Connection settings for a [`RedisStore`].
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisOptions {
    pub(super) connect_timeout: Duration,
    pub(super) response_timeout: Duration,
    pub(super) circuit: CircuitConfig,
    /// What the circuit breakers time their windows and back-offs on.
    pub(super) clock: Arc<dyn Clock>,
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOptions")
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("circuit", &self.circuit)
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

    /// The response timeout in force.
    pub fn get_response_timeout(&self) -> Duration {
        self.response_timeout
    }
}
