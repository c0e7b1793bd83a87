//! A store that misbehaves on purpose (feature `test-support`): the
//! simulation's way of delaying, losing and duplicating replies, refusing
//! calls through a circuit breaker, and restarting empty, on a seeded
//! random schedule so that every run can be replayed; and of giving an
//! embedded store the round trip of a remote one.
//!
//! It wraps another [`Store`] and owns no semantics of its own: whatever it
//! lets through is decided by the store inside.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::future::Future;
use std::pin::Pin;

use super::{Backend, Call, MemoryStore, Ran, Store, StoreCost};
use crate::breaker::{CircuitBreaker, CircuitConfig, CircuitState};
use crate::clock::Clock;
use crate::error::{Error, ErrorKind};

/// How often each fault happens, per call (probabilities in `[0, 1]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Faults {
    /// Each call waits a random time up to `max_delay`; past `timeout` the
    /// caller sees a timeout (whether or not the store applied the call).
    pub max_delay: Duration,
    /// The caller's response timeout.
    pub timeout: Duration,
    /// The store applies the call, the reply is lost (a timeout).
    pub lost_after: f64,
    /// The call never reaches the store (a timeout).
    pub lost_before: f64,
    /// The store applies the call twice (a client retry, a resent
    /// pipeline); the caller sees the first reply.
    pub duplicated: f64,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            max_delay: Duration::ZERO,
            timeout: Duration::from_millis(25),
            lost_after: 0.0,
            lost_before: 0.0,
            duplicated: 0.0,
        }
    }
}

/// What a [`FaultyStore`] did, for a test to compare with what the
/// limiters saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FaultCounts {
    /// Calls that reached the store (duplicates count twice).
    pub applied: u64,
    /// Replies lost after the store applied the call.
    pub lost_after: u64,
    /// Calls lost before reaching the store.
    pub lost_before: u64,
    /// Calls applied twice.
    pub duplicated: u64,
    /// Calls that timed out waiting.
    pub timed_out: u64,
    /// Calls refused by the circuit breaker.
    pub refused: u64,
}

/// A [`Store`] wrapper that injects faults; see the module docs.
#[derive(Clone)]
pub struct FaultyStore {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    faults: Mutex<Faults>,
    rng: Mutex<u64>,
    breaker: CircuitBreaker,
    counts: Mutex<FaultCounts>,
    calls: AtomicU64,
    /// The simulated network round trip of every call, in nanoseconds (0:
    /// in-process speed); apart from the fault schedule, so it never times
    /// a call out.
    latency_ns: AtomicU64,
}

impl fmt::Debug for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore")
            .field("store", &self.inner.store)
            .field(
                "faults",
                &*self.inner.faults.lock().unwrap_or_else(|p| p.into_inner()),
            )
            .finish()
    }
}

/// An unavailability outcome, as a real store would report it.
fn timeout(after: Duration) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!("injected: no reply within {after:?}"),
    )
}

impl FaultyStore {
    /// Wraps `store`; `seed` fixes the schedule, `clock` drives the
    /// circuit breaker (the simulation's virtual clock).
    pub fn new(store: impl Into<Store>, faults: Faults, seed: u64, clock: impl Clock) -> Self {
        let clock: Arc<dyn Clock> = Arc::new(clock);
        FaultyStore {
            inner: Arc::new(Inner {
                store: store.into(),
                faults: Mutex::new(faults),
                rng: Mutex::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
                breaker: CircuitBreaker::new(
                    CircuitConfig::default()
                        .min_failures(5)
                        .backoff(Duration::from_millis(50), Duration::from_millis(400)),
                    clock,
                ),
                counts: Mutex::new(FaultCounts::default()),
                calls: AtomicU64::new(0),
                latency_ns: AtomicU64::new(0),
            }),
        }
    }

    /// Makes every call take `round_trip` (half before the store acts,
    /// half after) on top of any injected delay, like a remote store: for
    /// simulations on a virtual clock (`tokio::time::pause`) and for
    /// testing timing behaviour. It applies to every clone of this store.
    #[must_use]
    pub fn with_latency(self, round_trip: Duration) -> Self {
        let ns = u64::try_from(round_trip.as_nanos()).unwrap_or(u64::MAX);
        self.inner.latency_ns.store(ns, Ordering::Relaxed);
        self
    }

    /// Changes the fault rates from now on (an outage starts or ends).
    pub fn set_faults(&self, faults: Faults) {
        *self.inner.faults.lock().unwrap_or_else(|p| p.into_inner()) = faults;
    }

    /// What was injected so far.
    pub fn counts(&self) -> FaultCounts {
        *self.inner.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets everything the store holds, like a Redis restarted without
    /// persistence (embedded stores only; a no-op on Redis, which a test
    /// restarts itself).
    pub fn restart_empty(&self) {
        if let Some(m) = self.inner.store.downcast_ref::<MemoryStore>() {
            m.flush();
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Store {
        &self.inner.store
    }

    fn roll(&self) -> f64 {
        let mut x = self.inner.rng.lock().unwrap_or_else(|p| p.into_inner());
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        (*x >> 11) as f64 / (1u64 << 53) as f64
    }

    fn count(&self, f: impl FnOnce(&mut FaultCounts)) {
        f(&mut self.inner.counts.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Runs one call through the breaker and the fault schedule. `call` is
    /// the store operation; it may run zero, one or two times.
    async fn through_faults<T, F, Fut>(&self, call: F) -> Result<T, Error>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, Error>>,
    {
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        let admission = match self.inner.breaker.admit() {
            Ok(a) => a,
            Err(e) => {
                self.count(|c| c.refused += 1);
                return Err(e);
            }
        };
        let faults = *self.inner.faults.lock().unwrap_or_else(|p| p.into_inner());
        let delay = faults.max_delay.mul_f64(self.roll());
        let fate = self.roll();
        let waited = delay.min(faults.timeout);
        let latency = Duration::from_nanos(self.inner.latency_ns.load(Ordering::Relaxed));
        if !latency.is_zero() {
            tokio::time::sleep(latency / 2).await;
        }
        // Half the wait before the store acts, half after, like a round trip.
        tokio::time::sleep(waited / 2).await;
        let result = if fate < faults.lost_before {
            self.count(|c| c.lost_before += 1);
            Err(timeout(faults.timeout))
        } else {
            let first = call().await;
            self.count(|c| c.applied += 1);
            if fate < faults.lost_before + faults.duplicated {
                let _ = call().await;
                self.count(|c| {
                    c.applied += 1;
                    c.duplicated += 1;
                });
            }
            if fate >= 1.0 - faults.lost_after {
                self.count(|c| c.lost_after += 1);
                Err(timeout(faults.timeout))
            } else {
                first
            }
        };
        tokio::time::sleep(waited - waited / 2).await;
        if !latency.is_zero() {
            tokio::time::sleep(latency - latency / 2).await;
        }
        let result = if delay >= faults.timeout && result.is_ok() {
            self.count(|c| c.timed_out += 1);
            Err(timeout(faults.timeout))
        } else {
            result
        };
        let unavailable = matches!(&result, Err(e) if e.is_unavailable());
        self.inner.breaker.record(admission, unavailable);
        result
    }

    /// One round trip per batch, unless the breaker refused it.
    fn cost<T>(result: &Result<T, Error>, calls: usize) -> StoreCost {
        match result {
            Err(e) if e.is_circuit_open() => StoreCost::default(),
            _ => StoreCost::one_trip(calls),
        }
    }
}

impl From<FaultyStore> for Store {
    fn from(store: FaultyStore) -> Self {
        Store::new(store)
    }
}

impl Backend for FaultyStore {
    /// The batch is one unit of the fault schedule: it is delayed, lost
    /// or applied twice whole, as one pipeline would be.
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
        Box::pin(async move {
            let replies = self
                .through_faults(|| async {
                    Backend::run(&self.inner.store, calls, ahead).await.replies
                })
                .await;
            let cost = Self::cost(&replies, calls.len());
            Ran { replies, cost }
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
    use crate::nonzero;
    use crate::quota::Quota;
    use crate::store::MemoryStore;

    #[tokio::test(start_paused = true)]
    async fn every_call_takes_the_round_trip_and_only_the_wrapper_knows_it() {
        let clock = FakeClock::new(Duration::from_secs(1_700_000_000));
        let memory = MemoryStore::with_clock(clock.clone());
        let slow = FaultyStore::new(memory.clone(), Faults::default(), 1, clock)
            .with_latency(Duration::from_millis(10));
        let params = Params::new(&Quota::per_second(nonzero!(5)), Algorithm::FixedWindow);
        let check = Check {
            key: "k",
            params: &params,
            cost: 1,
        };
        let start = tokio::time::Instant::now();
        let (reply, cost) = Store::from(slow.clone()).run_one(&check).await;
        assert!(reply.is_ok() && cost.round_trips == 1);
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(10) && took < Duration::from_millis(12),
            "{took:?}"
        );
        let start = tokio::time::Instant::now();
        let (reply, _) = Store::from(memory).run_one(&check).await;
        assert!(reply.is_ok());
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "the embedded store itself is instant"
        );
    }
}
