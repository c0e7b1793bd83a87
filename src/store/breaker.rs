//! A layer: any store behind one circuit breaker, the way the Redis store
//! puts each of its nodes behind one.
//!
//! It owns the breaker's bookkeeping around a call (ask before, report
//! the outcome after, give up a probe whose caller went away) and nothing
//! else: what a call does is the wrapped store's, what a failure means
//! for a decision is the failure policy's.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::{Backend, Call, Ran, Store, StoreCost};
use crate::breaker::{CircuitBreaker, CircuitConfig, CircuitState};
use crate::clock::Clock;
use crate::error::Error;

/// A [`Store`] behind a circuit breaker (see [`CircuitConfig`]): for a
/// [`Backend`] of your own that has none, so that a store that keeps
/// timing out is left alone for a back-off instead of being asked by
/// every request.
///
/// A batch is one call to the breaker: it counts as failed when the store
/// was unavailable for it (the batch, or any call in it, failed with an
/// [`is_unavailable`](Error::is_unavailable) error). While the circuit is
/// open a batch fails at once with a
/// [`CircuitOpen`](crate::ErrorKind::CircuitOpen) error and costs nothing.
/// Clones share one breaker.
///
/// ```
/// use slicelimit::store::BreakerStore;
/// use slicelimit::{store::CircuitConfig, Limiter, MemoryStore, Quota, clock::SystemClock, nonzero};
///
/// let store = BreakerStore::new(MemoryStore::new(), CircuitConfig::default(), SystemClock::new())?;
/// let limiter = Limiter::builder(Quota::per_second(nonzero!(10)))
///     .store(store)
///     .build()?;
/// # Ok::<(), slicelimit::Error>(())
/// ```
#[derive(Clone)]
pub struct BreakerStore {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    breaker: CircuitBreaker,
}

impl fmt::Debug for BreakerStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BreakerStore")
            .field("store", &self.inner.store)
            .field("state", &self.inner.breaker.state())
            .finish()
    }
}

impl BreakerStore {
    /// Puts `store` (any backend: a [`Store`], a store of your own) behind a breaker configured by `config`, whose
    /// windows and back-offs run on `clock`.
    ///
    /// # Errors
    /// An [`InvalidInput`](crate::ErrorKind::InvalidInput) error for a
    /// configuration out of range (see [`CircuitConfig`]'s setters).
    pub fn new(
        store: impl Backend,
        config: CircuitConfig,
        clock: impl Clock,
    ) -> Result<Self, Error> {
        config.validate()?;
        Ok(BreakerStore {
            inner: Arc::new(Inner {
                store: Store::new(store),
                breaker: CircuitBreaker::new(config, Arc::new(clock)),
            }),
        })
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Store {
        &self.inner.store
    }

    /// Batches refused while the circuit was open.
    pub fn refused(&self) -> u64 {
        self.inner.breaker.refused()
    }
}

impl From<BreakerStore> for Store {
    fn from(store: BreakerStore) -> Self {
        Store::new(store)
    }
}

/// Whether the store could not be reached for a batch.
fn unavailable(replies: &Result<Vec<Result<Vec<i64>, Error>>, Error>) -> bool {
    match replies {
        Err(e) => e.is_unavailable(),
        Ok(each) => each
            .iter()
            .any(|reply| matches!(reply, Err(e) if e.is_unavailable())),
    }
}

impl Backend for BreakerStore {
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
        Box::pin(async move {
            // Held across the call: a caller that drops this future gives
            // up its probe (if it was one) instead of leaving the circuit
            // half-open for good.
            let admission = match self.inner.breaker.admit() {
                Ok(admission) => admission,
                Err(refused) => {
                    return Ran {
                        replies: Err(refused),
                        cost: StoreCost::default(),
                    }
                }
            };
            let ran = Backend::run(&self.inner.store, calls, ahead).await;
            self.inner
                .breaker
                .record(admission, unavailable(&ran.replies));
            ran
        })
    }

    fn retry_hint(&self, _key: Option<&str>) -> Option<Duration> {
        self.inner.breaker.retry_hint()
    }

    fn is_sharded(&self) -> bool {
        self.inner.store.is_sharded()
    }

    fn circuit_state(&self) -> CircuitState {
        self.inner.breaker.state()
    }

    fn circuit_trips(&self) -> u64 {
        self.inner.breaker.trips()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, Check, Params};
    use crate::clock::FakeClock;
    use crate::error::ErrorKind;
    use crate::nonzero;
    use crate::quota::Quota;
    use crate::store::MemoryStore;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A store that is down while `down` is set.
    #[derive(Debug, Clone, Default)]
    struct Flaky {
        memory: MemoryStore,
        down: Arc<AtomicBool>,
    }

    impl Backend for Flaky {
        fn run<'a>(
            &'a self,
            calls: &'a [&'a dyn Call],
            ahead: usize,
        ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
            if self.down.load(Ordering::Relaxed) {
                return Box::pin(std::future::ready(Ran {
                    replies: Err(Error::new(ErrorKind::Timeout, "down")),
                    cost: StoreCost::one_trip(calls.len()),
                }));
            }
            Backend::run(&self.memory, calls, ahead)
        }
    }

    #[tokio::test]
    async fn a_store_that_keeps_failing_is_left_alone_until_a_probe_finds_it_back() {
        let clock = FakeClock::new(Duration::from_secs(1_700_000_000));
        let flaky = Flaky::default();
        let config = CircuitConfig::default()
            .min_failures(2)
            .min_span(Duration::ZERO)
            .backoff(Duration::from_millis(100), Duration::from_millis(100));
        let store = Store::from(BreakerStore::new(flaky.clone(), config, clock.clone()).unwrap());
        let params = Params::new(&Quota::per_second(nonzero!(5)), Algorithm::FixedWindow);
        let check = Check {
            key: "k",
            params: &params,
            cost: 1,
        };
        assert!(store.run_one(&check).await.0.is_ok());
        flaky.down.store(true, Ordering::Relaxed);
        for _ in 0..2 {
            let (reply, cost) = store.run_one(&check).await;
            assert!(reply.unwrap_err().is_timeout());
            assert_eq!(cost.round_trips, 1);
        }
        assert_eq!(store.circuit_state(), CircuitState::Open);
        let (reply, cost) = store.run_one(&check).await;
        assert!(reply.unwrap_err().is_circuit_open());
        assert_eq!(cost, StoreCost::default(), "a refused call costs nothing");
        assert!(store.retry_hint().is_some());
        flaky.down.store(false, Ordering::Relaxed);
        clock.advance(Duration::from_millis(100));
        assert!(store.run_one(&check).await.0.is_ok(), "the probe");
        assert_eq!(store.circuit_state(), CircuitState::Closed);
        assert_eq!(store.circuit_trips(), 1);
        let layer = store.downcast_ref::<BreakerStore>().unwrap();
        assert_eq!(layer.refused(), 1);
    }

    #[test]
    fn a_configuration_out_of_range_is_refused() {
        let config = CircuitConfig::default().failure_rate(2.0);
        let built = BreakerStore::new(MemoryStore::new(), config, FakeClock::default());
        assert!(built.unwrap_err().is_invalid_input());
    }
}
