//! The exact limiter: one store call per decision.
//!
//! Correct across any number of processes (the script is atomic on the
//! store's clock) at the price of a round trip per request. It owns nothing
//! but the call; failures go back to the limiter, which applies the policy.

use std::sync::Arc;

use crate::algorithm::OpIds;
use crate::algorithm::{Check, GiveBack, Params, Refunded};
use crate::checked::{decision_from, refund_call, taken_by_check};
use crate::decision::Decision;
use crate::decision::{Source, Taken, TakenFrom};
use crate::error::Error;
use crate::key::KeyEncoder;
use crate::stats::Counters;
use crate::store::Store;

pub(crate) struct ExactEngine {
    store: Store,
    keys: KeyEncoder,
    params: Params,
    /// Where its store calls are counted.
    counters: Arc<Counters>,
    /// Identities of refunds (a refund delivered twice counts once).
    ops: OpIds,
}

impl ExactEngine {
    pub(crate) fn new(
        store: Store,
        keys: KeyEncoder,
        params: Params,
        counters: Arc<Counters>,
    ) -> Self {
        ExactEngine {
            store,
            keys,
            params,
            counters,
            ops: OpIds::default(),
        }
    }

    /// One decision by the store (its cost is counted by the store).
    pub(crate) async fn check(&self, key: &str, cost: u64) -> Result<Decision, Error> {
        self.check_timed(key, cost).await.map(|(d, _)| d)
    }

    /// As [`check`](Self::check), with the store's clock (µs) at the call.
    pub(crate) async fn check_timed(&self, key: &str, cost: u64) -> Result<(Decision, u64), Error> {
        let store_key = self.keys.store_key(key, self.params.algorithm);
        let (reply, _) = self
            .store
            .run_counted(
                &Check {
                    key: &store_key,
                    params: &self.params,
                    cost,
                },
                &self.counters,
            )
            .await;
        reply.map(|reply| {
            let decision = self.decision(&reply, cost, true);
            (decision, reply.now_us)
        })
    }

    /// The store key and parameters of `key`'s check (several quotas are
    /// checked together in one call, see `limiter::quotas`).
    pub(crate) fn call_for(&self, key: &str) -> (String, Params) {
        (self.keys.store_key(key, self.params.algorithm), self.params)
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// The decision a reply of this engine's check stands for; `applied`:
    /// the store counted it (a check of several quotas that another
    /// denied counted nothing).
    pub(crate) fn decision(
        &self,
        reply: &crate::algorithm::AcquireReply,
        cost: u64,
        applied: bool,
    ) -> Decision {
        let taken = if applied {
            taken_by_check(&self.params, reply, cost, TakenFrom::Store)
        } else {
            Taken::default()
        };
        decision_from(reply, self.params.limit, Source::Store).with_taken(taken)
    }

    /// Gives `taken` back to the store: to its window's count while that
    /// window lasts, or to its bucket as far as the bucket could have
    /// held it had it never been taken. Returns the permits it took back.
    pub(crate) async fn refund(&self, key: &str, taken: Taken) -> Result<Refunded, Error> {
        let store_key = self.keys.store_key(key, self.params.algorithm);
        let call = refund_call(&self.params, store_key, &taken, &self.ops);
        let give_back = GiveBack {
            params: &self.params,
            call: &call,
        };
        self.store.run_counted(&give_back, &self.counters).await.0
    }
}
