//! A store that misbehaves on purpose: the simulation's way of delaying,
//! losing and duplicating replies, refusing calls through a circuit
//! breaker, and restarting empty, on a seeded random schedule so that
//! every run can be replayed; and of giving an embedded store the round
//! trip of a remote one.
//!
//! It wraps another [`Store`] and owns no semantics of its own: whatever
//! it lets through is decided by the store inside. It is built on the
//! library's public store API alone (a [`Backend`] behind the library's
//! [`BreakerStore`]), so the library ships no fault injection.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use slicelimit::store::{Backend, BreakerStore, Call, Ran, StoreCost};
use slicelimit::{
    clock::Clock, store::CircuitConfig, store::CircuitState, Error, ErrorKind, MemoryStore, Store,
};

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

/// A [`Store`] wrapper that injects faults; see the module docs. Clones
/// share one schedule, one breaker and one set of counts.
#[derive(Clone)]
pub struct FaultyStore {
    /// The breaker, around the fault schedule, around the store: a call
    /// the breaker refuses meets no fault and reaches nothing.
    breaker: BreakerStore,
    faults: Arc<Schedule>,
}

/// The fault schedule: the layer between the breaker and the store.
struct Schedule {
    store: Store,
    faults: Mutex<Faults>,
    rng: Mutex<u64>,
    counts: Mutex<FaultCounts>,
    /// The simulated network round trip of every call, in nanoseconds (0:
    /// in-process speed); apart from the fault schedule, so it never times
    /// a call out.
    latency_ns: AtomicU64,
}

/// The schedule as a backend, so the breaker can wrap it.
#[derive(Clone)]
struct Scheduled(Arc<Schedule>);

impl fmt::Debug for Scheduled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults")
            .field("store", &self.0.store)
            .field("faults", &*lock(&self.0.faults))
            .finish()
    }
}

impl fmt::Debug for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore")
            .field("store", &self.faults.store)
            .field("faults", &*lock(&self.faults.faults))
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        let schedule = Arc::new(Schedule {
            store: store.into(),
            faults: Mutex::new(faults),
            rng: Mutex::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            counts: Mutex::new(FaultCounts::default()),
            latency_ns: AtomicU64::new(0),
        });
        let breaker = BreakerStore::new(
            Scheduled(schedule.clone()),
            CircuitConfig::default()
                .min_failures(5)
                .backoff(Duration::from_millis(50), Duration::from_millis(400)),
            clock,
        )
        .expect("a valid breaker configuration");
        FaultyStore {
            breaker,
            faults: schedule,
        }
    }

    /// An embedded store on `clock`, every call `round_trip` away and
    /// nothing else wrong: a store to drop futures against mid-call.
    pub fn slow(clock: &crate::VirtualClock, round_trip: Duration) -> Self {
        FaultyStore::new(
            slicelimit::MemoryStore::with_clock(clock.clone()),
            Faults::default(),
            7,
            clock.clone(),
        )
        .with_latency(round_trip)
    }

    /// Makes every call take `round_trip` (half before the store acts,
    /// half after) on top of any injected delay, like a remote store: for
    /// simulations on a virtual clock (`tokio::time::pause`) and for
    /// testing timing behaviour. It applies to every clone of this store.
    #[must_use]
    pub fn with_latency(self, round_trip: Duration) -> Self {
        let ns = u64::try_from(round_trip.as_nanos()).unwrap_or(u64::MAX);
        self.faults.latency_ns.store(ns, Ordering::Relaxed);
        self
    }

    /// Changes the fault rates from now on (an outage starts or ends).
    pub fn set_faults(&self, faults: Faults) {
        *lock(&self.faults.faults) = faults;
    }

    /// What was injected so far.
    pub fn counts(&self) -> FaultCounts {
        FaultCounts {
            refused: self.breaker.refused(),
            ..*lock(&self.faults.counts)
        }
    }

    /// Forgets everything the store holds, like a Redis restarted without
    /// persistence (embedded stores only; a no-op on Redis, which a test
    /// restarts itself).
    pub fn restart_empty(&self) {
        if let Some(m) = self.faults.store.downcast_ref::<MemoryStore>() {
            m.flush();
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Store {
        &self.faults.store
    }
}

impl Schedule {
    fn roll(&self) -> f64 {
        let mut x = lock(&self.rng);
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        (*x >> 11) as f64 / (1u64 << 53) as f64
    }

    fn count(&self, f: impl FnOnce(&mut FaultCounts)) {
        f(&mut lock(&self.counts));
    }

    /// Runs one batch through the fault schedule. `call` is the store
    /// operation; it may run zero, one or two times.
    async fn through_faults<T, F, Fut>(&self, call: F) -> Result<T, Error>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let faults = *lock(&self.faults);
        let delay = faults.max_delay.mul_f64(self.roll());
        let fate = self.roll();
        let waited = delay.min(faults.timeout);
        let latency = Duration::from_nanos(self.latency_ns.load(Ordering::Relaxed));
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
        if delay >= faults.timeout && result.is_ok() {
            self.count(|c| c.timed_out += 1);
            return Err(timeout(faults.timeout));
        }
        result
    }
}

impl Backend for Scheduled {
    /// The batch is one unit of the fault schedule: it is delayed, lost
    /// or applied twice whole, as one pipeline would be, and costs one
    /// round trip whatever became of it.
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
        Box::pin(async move {
            let replies = self
                .0
                .through_faults(|| async {
                    Backend::run(&self.0.store, calls, ahead).await.replies
                })
                .await;
            Ran {
                replies,
                cost: StoreCost::one_trip(calls.len()),
            }
        })
    }

    fn is_sharded(&self) -> bool {
        self.0.store.is_sharded()
    }
}

impl From<FaultyStore> for Store {
    fn from(store: FaultyStore) -> Self {
        Store::new(store)
    }
}

impl Backend for FaultyStore {
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
        Backend::run(&self.breaker, calls, ahead)
    }

    fn retry_hint(&self, key: Option<&str>) -> Option<Duration> {
        self.breaker.retry_hint(key)
    }

    fn is_sharded(&self) -> bool {
        self.breaker.is_sharded()
    }

    fn circuit_state(&self) -> CircuitState {
        self.breaker.circuit_state()
    }

    fn circuit_trips(&self) -> u64 {
        self.breaker.circuit_trips()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slicelimit::clock::FakeClock;
    use slicelimit::store::{bad_reply, Arg, Lua, Memory, Script};

    static INCR: Lua = Lua::new("incr", "return redis.call('INCR', KEYS[1])");

    /// Counts its own calls in the store: what the store applied.
    struct Incr;

    impl Call for Incr {
        fn lua(&self) -> &'static Lua {
            &INCR
        }

        fn key(&self) -> &str {
            "n"
        }

        fn args(&self, _: &mut Vec<Arg>) {}

        fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
            let n = memory.get::<i64>("n").copied().unwrap_or(0) + 1;
            let expires = memory.now_us() + 60_000_000;
            memory.set("n", n, expires);
            Ok(vec![n])
        }
    }

    impl Script for Incr {
        type Reply = i64;

        fn parse(&self, values: Vec<i64>) -> Result<i64, Error> {
            values
                .first()
                .copied()
                .ok_or_else(|| bad_reply(&INCR, &values))
        }
    }

    fn clock() -> FakeClock {
        FakeClock::new(Duration::from_secs(1_700_000_000))
    }

    #[tokio::test(start_paused = true)]
    async fn every_call_takes_the_round_trip_and_only_the_wrapper_knows_it() {
        let clock = clock();
        let memory = MemoryStore::with_clock(clock.clone());
        let slow = FaultyStore::new(memory.clone(), Faults::default(), 1, clock)
            .with_latency(Duration::from_millis(10));
        let start = tokio::time::Instant::now();
        assert_eq!(Store::from(slow.clone()).run(&Incr).await.unwrap(), 1);
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(10) && took < Duration::from_millis(12),
            "{took:?}"
        );
        let start = tokio::time::Instant::now();
        assert_eq!(Store::from(memory).run(&Incr).await.unwrap(), 2);
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "the embedded store itself is instant"
        );
        assert_eq!(slow.counts().applied, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_duplicated_call_is_applied_twice_and_answered_once() {
        let clock = clock();
        let memory = MemoryStore::with_clock(clock.clone());
        let twice = Faults {
            duplicated: 1.0,
            ..Faults::default()
        };
        let store = FaultyStore::new(memory.clone(), twice, 1, clock);
        assert_eq!(Store::from(store.clone()).run(&Incr).await.unwrap(), 1);
        assert_eq!(memory.run_now(&Incr).unwrap(), 3, "applied twice");
        let counts = store.counts();
        assert_eq!((counts.applied, counts.duplicated), (2, 1), "{counts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_lost_for_good_opens_the_breaker_which_refuses_calls() {
        let clock = clock();
        let memory = MemoryStore::with_clock(clock.clone());
        let down = Faults {
            lost_before: 1.0,
            ..Faults::default()
        };
        let store = FaultyStore::new(memory.clone(), down, 1, clock.clone());
        let handle = Store::from(store.clone());
        for _ in 0..40 {
            let _ = handle.run(&Incr).await;
            clock.advance(Duration::from_millis(10));
        }
        let counts = store.counts();
        assert_eq!(counts.applied, 0, "{counts:?}");
        assert!(counts.lost_before >= 5, "{counts:?}");
        assert!(counts.refused > 0, "{counts:?}");
        assert_eq!(
            counts.lost_before + counts.refused,
            40,
            "every call was lost or refused: {counts:?}"
        );
        assert!(handle.circuit_trips() > 0);
        assert_eq!(
            memory.run_now(&Incr).unwrap(),
            1,
            "nothing reached the store"
        );
    }
}
