//! Counters a limiter keeps about itself, readable without a metrics
//! recorder ([`Limiter::stats`](crate::Limiter::stats)).
//!
//! Plain relaxed atomics: they are statistics, not synchronisation.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters; one per limiter, shared by its engine and sync task.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) allowed: AtomicU64,
    pub(crate) denied: AtomicU64,
    pub(crate) round_trips: AtomicU64,
    pub(crate) store_errors: AtomicU64,
    pub(crate) policy_decisions: AtomicU64,
    pub(crate) credit_admitted: AtomicU64,
    pub(crate) overshoot: AtomicU64,
    pub(crate) leases: AtomicU64,
    pub(crate) permits_leased: AtomicU64,
    pub(crate) stranded: AtomicU64,
    pub(crate) given_back: AtomicU64,
    pub(crate) reconciled: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        if n > 0 {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            allowed: get(&self.allowed),
            denied: get(&self.denied),
            round_trips: get(&self.round_trips),
            store_errors: get(&self.store_errors),
            policy_decisions: get(&self.policy_decisions),
            credit_admitted: get(&self.credit_admitted),
            overshoot: get(&self.overshoot),
            leases: get(&self.leases),
            permits_leased: get(&self.permits_leased),
            stranded: get(&self.stranded),
            given_back: get(&self.given_back),
            reconciled: get(&self.reconciled),
        }
    }
}

/// A snapshot of a limiter's counters since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Decisions that admitted the request.
    pub allowed: u64,
    /// Decisions that denied the request.
    pub denied: u64,
    /// Calls to the store; one pipelined batch of many leases counts once.
    pub round_trips: u64,
    /// Store calls (or batch items) that failed.
    pub store_errors: u64,
    /// Decisions made by the failure policy.
    pub policy_decisions: u64,
    /// Permits admitted on credit (optimistic hybrid).
    pub credit_admitted: u64,
    /// Permits admitted on credit that the store could not cover: admitted
    /// beyond the limit.
    pub overshoot: u64,
    /// Lease calls that granted at least one permit.
    pub leases: u64,
    /// Permits granted by leases.
    pub permits_leased: u64,
    /// Leased permits that expired unused and could not be given back.
    pub stranded: u64,
    /// Leased permits given back to the store unused.
    pub given_back: u64,
    /// Permits the local fallback admitted during an outage, reported to
    /// the store once it answered again.
    pub reconciled: u64,
}
