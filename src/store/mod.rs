//! Stores: where budgets live and are counted atomically.
//!
//! A store runs scripts (see [`Script`]): [`RedisStore`] runs their Lua
//! (`EVALSHA`, pipelined, routed by key on a cluster), [`MemoryStore`]
//! runs their Rust mirror in process. The library's algorithms, the
//! concurrency limiter's slots and any other package's scripts all pass
//! through the one [`Backend`] trait, which a user can implement for a
//! store of their own. [`Store`] is the handle a limiter holds: any
//! backend, behind an `Arc`; a limiter counts each of its calls once in
//! its statistics and metrics.
//!
//! [`fair`] is a building block for scripts that share a capacity among
//! claimants: the max-min fair level, in Lua and in Rust.
//!
//! # Writing a script
//!
//! A script of your own (a reservation, a counter of another shape) is a
//! type that implements [`Call`] and [`Script`]; any store runs it. The
//! rules its two halves keep, so that they answer alike:
//!
//! - **One hash slot.** `KEYS[1]` ([`Call::key`]) names where it runs;
//!   every other key ([`Call::more_keys`]) shares its `{hash tag}`.
//! - **The store's clock.** The Lua reads `redis.call('TIME')`; the
//!   mirror reads [`Memory::now_us`]. Never the caller's clock.
//! - **Every key expires.** The Lua sets a TTL on what it writes; the
//!   mirror passes the same expiry to [`Memory::set`].
//! - **Safe to deliver twice.** A call that timed out may have run: a
//!   store may send it again, so a call that changes state carries an
//!   identity the script remembers (as the library's leases and refunds
//!   do), or its effect must be harmless twice.
//! - **Integers back.** Both halves reply a list of integers, read by one
//!   [`Script::parse`]; [`bad_reply`] is the error for anything else.
//!
//! A parity test then runs the same calls on a private `redis-server` and
//! on a [`MemoryStore`] and compares the replies (this crate's own are
//! beside each script). A counter that expires, run here on the memory
//! store:
//!
//! ```
//! use slicelimit::store::{bad_reply, Arg, Call, Lua, Memory, MemoryStore, Script, Store};
//! use slicelimit::Error;
//!
//! static HITS: Lua = Lua::new(
//!     "hits",
//!     "local t = redis.call('TIME') \
//!      local n = redis.call('INCR', KEYS[1]) \
//!      redis.call('PEXPIRE', KEYS[1], ARGV[1]) \
//!      return {n, tonumber(t[1]) * 1000000 + tonumber(t[2])}",
//! );
//!
//! /// One hit on `key`, which lives `ttl_ms` after its last hit.
//! struct Hit {
//!     key: String,
//!     ttl_ms: u64,
//! }
//!
//! impl Call for Hit {
//!     fn lua(&self) -> &'static Lua {
//!         &HITS
//!     }
//!     fn key(&self) -> &str {
//!         &self.key
//!     }
//!     fn args(&self, args: &mut Vec<Arg>) {
//!         args.push(Arg::Uint(self.ttl_ms));
//!     }
//!     fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
//!         let now = memory.now_us();
//!         let n = memory.take::<i64>(&self.key).unwrap_or(0) + 1;
//!         memory.set(&self.key, n, now + self.ttl_ms * 1_000);
//!         Ok(vec![n, now as i64])
//!     }
//! }
//!
//! impl Script for Hit {
//!     /// The count so far.
//!     type Reply = i64;
//!     fn parse(&self, values: Vec<i64>) -> Result<i64, Error> {
//!         match values.as_slice() {
//!             &[n, _now] => Ok(n),
//!             _ => Err(bad_reply(&HITS, &values)),
//!         }
//!     }
//! }
//!
//! # async fn demo() -> Result<(), Error> {
//! let store: Store = MemoryStore::new().into();
//! let hit = Hit { key: "{user-7}:hits".into(), ttl_ms: 60_000 };
//! assert_eq!(store.run(&hit).await?, 1);
//! assert_eq!(store.run(&hit).await?, 2);
//! # Ok(())
//! # }
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
//! ```
//!
//! A store decides nothing about policies, leases or failures; layers
//! (a breaker: [`BreakerStore`]; the simulation's fault injection) wrap a
//! backend, a backend does not know them. It is the bottom of the crate:
//! it imports nothing above it but the algorithms' scripts and the key
//! encoding (the memory store's inspection of a window) and the
//! limiters' counters through `Recorder`.

mod breaker;
#[cfg(test)]
pub(crate) mod distant;
pub mod fair;
pub(crate) mod memory;
#[cfg(test)]
pub(crate) mod parity;
pub(crate) mod redis;
mod script;
pub(crate) mod topology;

pub use self::breaker::BreakerStore;
pub use self::memory::{Memory, MemoryStore};
#[cfg(feature = "sentinel")]
pub use self::redis::Sentinel;
#[cfg(feature = "tls")]
pub use self::redis::TlsOptions;
pub use self::redis::{RedisOptions, RedisStore};
pub use self::script::{bad_reply, Arg, Call, Lua, Script};
pub use crate::breaker::{CircuitConfig, CircuitState};

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;

/// Where a limiter records what its store calls did (its counters): the
/// store reports to it without knowing what keeps the numbers.
pub(crate) trait Recorder {
    /// A call (or batch) that cost `cost`, took `took` and failed with
    /// `errors` (none when it succeeded).
    fn store_call<'a>(
        &self,
        cost: StoreCost,
        took: Duration,
        errors: impl Iterator<Item = &'a Error>,
    );
}

/// What a batch cost the store: round trips (pipelines and script loads
/// sent; on a cluster a batch is one pipeline per hash slot) and script
/// calls (each call of the batch once, however often it was resent). A
/// call the circuit breaker refused costs nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCost {
    /// Round trips to the store.
    pub round_trips: u64,
    /// Script calls the store received.
    pub calls: u64,
}

impl StoreCost {
    /// One round trip carrying `calls` script calls.
    pub fn one_trip(calls: usize) -> Self {
        StoreCost {
            round_trips: 1,
            calls: calls as u64,
        }
    }

    /// `calls` script calls sent in `round_trips` round trips (a resend
    /// after `NOSCRIPT` is one more); none if nothing was sent (the
    /// breaker refused them).
    pub fn sent(round_trips: u64, calls: u64) -> Self {
        StoreCost {
            round_trips,
            calls: if round_trips > 0 { calls } else { 0 },
        }
    }
}

impl<R: Recorder> Recorder for Arc<R> {
    fn store_call<'a>(
        &self,
        cost: StoreCost,
        took: Duration,
        errors: impl Iterator<Item = &'a Error>,
    ) {
        (**self).store_call(cost, took, errors);
    }
}

/// What a [`Backend`] answers for a batch: the integers each call
/// replied (or its error), or one error for the whole batch, and what the
/// batch cost.
#[derive(Debug)]
pub struct Ran {
    /// One reply per call, in call order; `Err` when the batch failed
    /// whole (nothing is known of any call).
    pub replies: Result<Vec<Result<Vec<i64>, Error>>, Error>,
    /// What it cost.
    pub cost: StoreCost,
}

/// A store: something that runs scripts atomically.
///
/// Implement it for a store of your own (another client, a test double, a
/// layer around another store); [`Store::new`] wraps it for a limiter.
/// A backend that speaks the Redis protocol sends each call as `EVALSHA`
/// of [`Call::lua`]'s [`sha`](Lua::sha) (loading its
/// [`source`](Lua::source) on `NOSCRIPT`) with [`Call::key`] and
/// [`Call::more_keys`] as KEYS and [`Call::args`] as ARGV; any other
/// backend can hand the calls to a [`MemoryStore`] (its `run`), which
/// runs each script's mirror. A layer wraps a [`Store`], itself a
/// `Backend`.
///
/// # Contract
/// - Each call runs atomically, alone, on its keys, which share one hash
///   tag (`{…}`), as Redis Cluster requires of a script's keys.
/// - A reply is an integer or a flat list of integers, one per call, in
///   call order.
/// - A call whose reply is lost may have been applied, and a call may be
///   applied twice: every script tolerates both.
/// - Nothing waits past the store's own timeout. An error of kind
///   [`Timeout`](crate::ErrorKind::Timeout),
///   [`Connection`](crate::ErrorKind::Connection) or
///   [`CircuitOpen`](crate::ErrorKind::CircuitOpen) means the store is
///   unavailable (the failure policy decides); any other means it
///   answered wrongly.
pub trait Backend: Any + fmt::Debug + Send + Sync {
    /// Runs `calls` in as few round trips as the store allows, replies in
    /// call order. `ahead`: calls the caller already has in flight on
    /// this store (concurrent batches of one round); only a hint, which a
    /// batch's timeout may allow for, and which a backend may ignore.
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>>;

    /// While the store refuses calls on `key` (a circuit open), when it
    /// will next try.
    fn retry_hint(&self, key: Option<&str>) -> Option<Duration> {
        let _ = key;
        None
    }

    /// Whether calls on different keys may run on different servers (a
    /// cluster): then they meet different breakers, read different
    /// clocks and do not run in one order. `false` promises one server,
    /// one clock, calls run in the order sent, which the hybrid engine
    /// relies on to narrow what a round's replies tell it; a backend of
    /// several nodes must say `true`.
    fn is_sharded(&self) -> bool {
        false
    }

    /// The circuit breaker's state, if the store has one.
    fn circuit_state(&self) -> CircuitState {
        CircuitState::Closed
    }

    /// Times the store's circuit breakers have opened.
    fn circuit_trips(&self) -> u64 {
        0
    }
}

/// The store a limiter counts in: a [`RedisStore`], a [`MemoryStore`] or
/// any [`Backend`]. Cheap to clone; clones share the backend.
///
/// Built with `From`, so [`Builder::store`](crate::Builder::store) takes
/// either store directly.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.backend.fmt(f)
    }
}

impl From<RedisStore> for Store {
    fn from(store: RedisStore) -> Self {
        Store::new(store)
    }
}

impl From<MemoryStore> for Store {
    fn from(store: MemoryStore) -> Self {
        Store::new(store)
    }
}

impl Store {
    /// A store that runs scripts on `backend`.
    pub fn new(backend: impl Backend) -> Self {
        Store {
            backend: Arc::new(backend),
        }
    }

    /// The backend, if it is a `B`.
    pub fn downcast_ref<B: Backend>(&self) -> Option<&B> {
        let any: &dyn Any = &*self.backend;
        any.downcast_ref::<B>()
    }

    /// Runs one script.
    ///
    /// # Errors
    /// The store's (see [`Error`]), or the script's parser's.
    pub async fn run<S: Script>(&self, script: &S) -> Result<S::Reply, Error> {
        self.run_one(script).await.0
    }

    /// Runs scripts in as few round trips as the store allows; one reply
    /// per script, in order.
    ///
    /// # Errors
    /// One error when the batch failed whole.
    pub async fn run_all<S: Script>(
        &self,
        scripts: &[S],
    ) -> Result<Vec<Result<S::Reply, Error>>, Error> {
        self.run_batch(scripts, 0).await.0
    }

    /// One script, and what it cost.
    pub(crate) async fn run_one<S: Script>(
        &self,
        script: &S,
    ) -> (Result<S::Reply, Error>, StoreCost) {
        let calls: [&dyn Call; 1] = [script];
        let ran = self.backend.run(&calls, 0).await;
        let reply = ran
            .replies
            .and_then(|mut replies| match (replies.pop(), replies.is_empty()) {
                (Some(reply), true) => reply,
                _ => Err(bad_reply(script.lua(), &[])),
            });
        (reply.and_then(|values| script.parse(values)), ran.cost)
    }

    /// Scripts in one batch, and what it cost.
    pub(crate) async fn run_batch<S: Script>(
        &self,
        scripts: &[S],
        ahead: usize,
    ) -> (Result<Vec<Result<S::Reply, Error>>, Error>, StoreCost) {
        let calls: Vec<&dyn Call> = scripts.iter().map(|s| s as &dyn Call).collect();
        let ran = self.backend.run(&calls, ahead).await;
        let replies = ran.replies.and_then(|replies| {
            if replies.len() != scripts.len() {
                return Err(Error::new(
                    crate::error::ErrorKind::Store,
                    format!(
                        "a batch of {} calls got {} replies",
                        scripts.len(),
                        replies.len()
                    ),
                ));
            }
            Ok(replies
                .into_iter()
                .zip(scripts)
                .map(|(reply, script)| reply.and_then(|values| script.parse(values)))
                .collect())
        });
        (replies, ran.cost)
    }

    /// [`run_one`](Self::run_one), recorded on `counters`.
    pub(crate) async fn run_counted<S: Script>(
        &self,
        script: &S,
        counters: &impl Recorder,
    ) -> (Result<S::Reply, Error>, StoreCost) {
        let began = std::time::Instant::now();
        let (reply, spent) = self.run_one(script).await;
        counters.store_call(spent, began.elapsed(), reply.as_ref().err().into_iter());
        (reply, spent)
    }

    /// [`run_batch`](Self::run_batch), recorded on `counters`.
    pub(crate) async fn run_batch_counted<S: Script>(
        &self,
        scripts: &[S],
        ahead: usize,
        counters: &impl Recorder,
    ) -> (Result<Vec<Result<S::Reply, Error>>, Error>, StoreCost) {
        let began = std::time::Instant::now();
        let (replies, spent) = self.run_batch(scripts, ahead).await;
        counters.store_call(spent, began.elapsed(), errors(&replies));
        (replies, spent)
    }

    /// While the store refuses calls (circuit open), when it will next try.
    pub(crate) fn retry_hint(&self) -> Option<Duration> {
        self.backend.retry_hint(None)
    }

    /// As [`retry_hint`](Self::retry_hint), for calls on `store_key` (on a
    /// cluster, its primary's breaker).
    pub(crate) fn retry_hint_for(&self, store_key: &str) -> Option<Duration> {
        self.backend.retry_hint(Some(store_key))
    }

    /// Whether calls on different keys may meet different breakers.
    pub(crate) fn is_sharded(&self) -> bool {
        self.backend.is_sharded()
    }

    /// The circuit breaker's state (an embedded store never trips).
    pub fn circuit_state(&self) -> CircuitState {
        self.backend.circuit_state()
    }

    /// Times the store's circuit breakers have opened.
    pub fn circuit_trips(&self) -> u64 {
        self.backend.circuit_trips()
    }
}

/// A [`Store`] is a backend too, so a layer can wrap any store.
impl Backend for Store {
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
        self.backend.run(calls, ahead)
    }

    fn retry_hint(&self, key: Option<&str>) -> Option<Duration> {
        self.backend.retry_hint(key)
    }

    fn is_sharded(&self) -> bool {
        self.backend.is_sharded()
    }

    fn circuit_state(&self) -> CircuitState {
        self.backend.circuit_state()
    }

    fn circuit_trips(&self) -> u64 {
        self.backend.circuit_trips()
    }
}

/// The errors of a batch: its own when it failed whole (one error, not one
/// per call), else each call's.
fn errors<T>(replies: &Result<Vec<Result<T, Error>>, Error>) -> impl Iterator<Item = &Error> {
    let (whole, each) = match replies {
        Err(e) => (Some(e), None),
        Ok(replies) => (None, Some(replies.iter().filter_map(|r| r.as_ref().err()))),
    };
    whole.into_iter().chain(each.into_iter().flatten())
}
