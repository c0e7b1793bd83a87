//! The per-process limiter: one private [`MemoryStore`], no network.
//!
//! Used for `local()` mode and behind `FailurePolicy::LocalFallback`. Each
//! process counts alone, so a fleet of N admits up to N times the quota;
//! that is the point of the comparison, and the reason for the hybrid.

use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::Algorithm;
use crate::algorithm::OpIds;
use crate::algorithm::{Check, GiveBack, Lease, LeaseCall, LeaseReply, Params, Refunded};
use crate::checked::{decision_from, refund_call, taken_by_check};
use crate::clock::Clock;
use crate::decision::Decision;
use crate::decision::{Source, Taken, TakenFrom};
use crate::quota::Quota;
use crate::store::MemoryStore;

pub(crate) struct LocalEngine {
    store: MemoryStore,
    params: Params,
    source: Source,
    ops: OpIds,
}

impl LocalEngine {
    pub(crate) fn new(
        quota: Quota,
        algorithm: Algorithm,
        clock: Arc<dyn Clock>,
        source: Source,
    ) -> Self {
        LocalEngine {
            store: MemoryStore::with_shared_clock(clock),
            params: Params::new(&quota, algorithm),
            source,
            ops: OpIds::default(),
        }
    }

    pub(crate) fn check(&self, key: &str, cost: u64) -> Decision {
        let check = Check {
            key,
            params: &self.params,
            cost,
        };
        match self.store.run_now(&check) {
            Ok(reply) => decision_from(&reply, self.params.limit, self.source)
                .with_taken(taken_by_check(&self.params, &reply, cost, TakenFrom::Local)),
            // A private store holds one layout per limiter, so this cannot
            // happen; deny rather than panic if it ever does.
            Err(_) => Decision::deny(self.params.limit, 0, Duration::ZERO, None, self.source),
        }
    }

    /// Counts `cost` against `key` whatever is left, past the limit if
    /// need be (see `Limiter::charge`): the count (or the bucket's debt)
    /// the next decisions see.
    /// Returns the store's reply (`None` cannot happen: a private store
    /// holds one layout per limiter).
    pub(crate) fn force(&self, key: &str, cost: u64) -> Option<LeaseReply> {
        let call = LeaseCall::report(key.to_owned(), cost, self.ops.next());
        let lease = Lease {
            params: &self.params,
            call: &call,
        };
        self.store.run_now(&lease).ok()
    }

    /// Gives `taken` back to its window while that window lasts, or to
    /// its bucket; returns the permits taken back (a repeat: nothing, and
    /// what the first took back).
    pub(crate) fn refund(&self, key: &str, taken: Taken) -> Refunded {
        let call = refund_call(&self.params, key.to_owned(), &taken, &self.ops);
        let give_back = GiveBack {
            params: &self.params,
            call: &call,
        };
        self.store.run_now(&give_back).unwrap_or(Refunded::Now(0))
    }
}
