//! Stores: where budgets live and are counted atomically.
//!
//! [`RedisStore`] runs the Lua scripts in `lua/`; [`MemoryStore`] implements
//! the same semantics in process (one process only, chosen explicitly).
//! This module owns the dispatch between them (where every call is
//! counted once); the request and reply shapes are `algorithm::calls`.
//! It decides nothing about policies, leases or failures.

#[cfg(feature = "test-support")]
pub(crate) mod faults;
pub(crate) mod memory;
#[cfg(test)]
mod parity;
pub(crate) mod redis;
pub(crate) mod topology;

#[cfg(feature = "test-support")]
pub use self::faults::{FaultCounts, Faults, FaultyStore};
pub use self::memory::MemoryStore;
#[cfg(feature = "sentinel")]
pub use self::redis::Sentinel;
#[cfg(feature = "tls")]
pub use self::redis::TlsOptions;
pub use self::redis::{RedisOptions, RedisStore};

use crate::algorithm::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, Params};
use crate::error::Error;
use crate::stats::{Counters, StoreCost};

/// A store a limiter can count in: a [`RedisStore`] or a [`MemoryStore`].
///
/// Built with `From`, so [`Builder::store`](crate::Builder::store) takes
/// either directly.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Store {
    /// A Redis server (single node or cluster).
    Redis(RedisStore),
    /// The in-process store.
    Memory(MemoryStore),
    /// A store that misbehaves on purpose, for simulations.
    #[cfg(feature = "test-support")]
    Faulty(Box<FaultyStore>),
}

#[cfg(feature = "test-support")]
impl From<FaultyStore> for Store {
    fn from(store: FaultyStore) -> Self {
        Store::Faulty(Box::new(store))
    }
}

impl From<RedisStore> for Store {
    fn from(store: RedisStore) -> Self {
        Store::Redis(store)
    }
}

impl From<MemoryStore> for Store {
    fn from(store: MemoryStore) -> Self {
        Store::Memory(store)
    }
}

impl Store {
    /// While the store refuses calls (circuit open), when it will next try.
    pub(crate) fn retry_hint(&self) -> Option<std::time::Duration> {
        match self {
            Store::Redis(s) => s.retry_hint(),
            Store::Memory(_) => None,
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => s.retry_hint(),
        }
    }

    /// As [`retry_hint`](Self::retry_hint), for calls on `store_key` (on a
    /// cluster, its primary's breaker).
    pub(crate) fn retry_hint_for(&self, store_key: &str) -> Option<std::time::Duration> {
        match self {
            Store::Redis(s) => s.retry_hint_for(store_key),
            _ => self.retry_hint(),
        }
    }

    /// Whether calls on different keys may meet different breakers.
    pub(crate) fn is_sharded(&self) -> bool {
        match self {
            Store::Redis(s) => s.is_cluster(),
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => s.inner().is_sharded(),
            Store::Memory(_) => false,
        }
    }

    /// The circuit breaker's state (an embedded store never trips).
    pub(crate) fn circuit_state(&self) -> crate::breaker::CircuitState {
        match self {
            Store::Redis(s) => s.circuit_state(),
            Store::Memory(_) => crate::breaker::CircuitState::Closed,
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => s.circuit_state(),
        }
    }

    /// Times the store's circuit breakers have opened (see
    /// [`RedisStore::circuit_trips`]).
    pub(crate) fn circuit_trips(&self) -> u64 {
        match self {
            Store::Redis(s) => s.circuit_trips(),
            Store::Memory(_) => 0,
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => s.circuit_trips(),
        }
    }

    /// Checks and counts one request; returns what that cost. Not counted
    /// on any limiter (see [`acquire`](Self::acquire)).
    pub(crate) async fn send_acquire(
        &self,
        key: &str,
        params: &Params,
        cost: u64,
    ) -> (Result<AcquireReply, Error>, StoreCost) {
        match self {
            Store::Redis(s) => s.acquire(key, params, cost).await,
            Store::Memory(s) => (s.acquire(key, params, cost), StoreCost::one_trip(1)),
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => Box::pin(s.acquire(key, params, cost)).await,
        }
    }

    /// Runs many leases in as few round trips as the store allows; one
    /// result per call, in order, and what the batch cost.
    ///
    /// `ahead`: calls already in flight before these (concurrent batches
    /// of one round), which a batch's timeout allows for.
    pub(crate) async fn send_acquire_all(
        &self,
        keys: &[String],
        params: &[Params],
        cost: u64,
    ) -> (Result<Vec<AcquireReply>, Error>, StoreCost) {
        match self {
            Store::Redis(s) => s.acquire_all(keys, params, cost).await,
            Store::Memory(s) => (s.acquire_all(keys, params, cost), StoreCost::one_trip(1)),
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => Box::pin(s.acquire_all(keys, params, cost)).await,
        }
    }

    pub(crate) async fn send_lease_batch(
        &self,
        params: &Params,
        calls: &[LeaseCall],
        ahead: usize,
    ) -> (Result<Vec<Result<LeaseReply, Error>>, Error>, StoreCost) {
        match self {
            Store::Redis(s) => s.lease_batch(params, calls, ahead).await,
            Store::Memory(s) => {
                let replies = calls.iter().map(|c| s.lease(params, c)).collect();
                (Ok(replies), StoreCost::one_trip(calls.len()))
            }
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => Box::pin(s.lease_batch(params, calls, ahead)).await,
        }
    }

    /// Gives permits back; returns how many the store took back, and what
    /// the batch cost.
    pub(crate) async fn send_give_back_batch(
        &self,
        params: &Params,
        calls: &[GiveBackCall],
    ) -> (Result<Vec<Result<u64, Error>>, Error>, StoreCost) {
        match self {
            Store::Redis(s) => s.give_back_batch(params, calls).await,
            Store::Memory(s) => {
                let replies = calls.iter().map(|c| s.give_back(params, c)).collect();
                (Ok(replies), StoreCost::one_trip(calls.len()))
            }
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => Box::pin(s.give_back_batch(params, calls)).await,
        }
    }

    /// Checks and counts one request, recorded on `counters`.
    pub(crate) async fn acquire(
        &self,
        key: &str,
        params: &Params,
        cost: u64,
        counters: &Counters,
    ) -> (Result<AcquireReply, Error>, StoreCost) {
        let began = std::time::Instant::now();
        let (reply, spent) = self.send_acquire(key, params, cost).await;
        counters.store_call(spent, began.elapsed(), reply.as_ref().err().into_iter());
        (reply, spent)
    }

    /// Runs many leases (see [`send_lease_batch`](Self::send_lease_batch)),
    /// recorded on `counters`.
    /// Several quotas of one key, all-or-nothing, in one call.
    pub(crate) async fn acquire_all(
        &self,
        keys: &[String],
        params: &[Params],
        cost: u64,
        counters: &Counters,
    ) -> (Result<Vec<AcquireReply>, Error>, StoreCost) {
        let began = std::time::Instant::now();
        let (reply, spent) = self.send_acquire_all(keys, params, cost).await;
        counters.store_call(spent, began.elapsed(), reply.as_ref().err().into_iter());
        (reply, spent)
    }

    pub(crate) async fn lease_batch(
        &self,
        params: &Params,
        calls: &[LeaseCall],
        ahead: usize,
        counters: &Counters,
    ) -> (Result<Vec<Result<LeaseReply, Error>>, Error>, StoreCost) {
        let began = std::time::Instant::now();
        let (replies, spent) = self.send_lease_batch(params, calls, ahead).await;
        counters.store_call(spent, began.elapsed(), errors(&replies));
        (replies, spent)
    }

    /// Gives permits back (see
    /// [`send_give_back_batch`](Self::send_give_back_batch)), recorded on
    /// `counters`.
    pub(crate) async fn give_back_batch(
        &self,
        params: &Params,
        calls: &[GiveBackCall],
        counters: &Counters,
    ) -> (Result<Vec<Result<u64, Error>>, Error>, StoreCost) {
        let began = std::time::Instant::now();
        let (replies, spent) = self.send_give_back_batch(params, calls).await;
        counters.store_call(spent, began.elapsed(), errors(&replies));
        (replies, spent)
    }
}

impl Store {
    /// Sets leases on a key's in-flight slots (see `slots.rs`).
    pub(crate) async fn slots(
        &self,
        key: &str,
        call: &crate::slots::SlotsCall,
    ) -> Result<(Vec<crate::slots::SlotsReply>, u64), Error> {
        match self {
            Store::Redis(s) => s.slots(key, call).await,
            Store::Memory(s) => Ok(s.slots(key, call)),
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => Box::pin(s.slots(key, call)).await,
        }
    }
}

#[cfg(feature = "server")]
impl Store {
    /// A holder's share of a rate (see `share.rs`), under `key`.
    pub(crate) async fn share(
        &self,
        key: &str,
        call: &crate::share::ShareCall,
    ) -> Result<crate::share::ShareReply, Error> {
        match self {
            Store::Redis(s) => s.share(key, call).await,
            Store::Memory(s) => Ok(s.share(key, call)),
            #[cfg(feature = "test-support")]
            Store::Faulty(s) => Box::pin(s.inner().share(key, call)).await,
        }
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
