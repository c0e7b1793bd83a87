//! The exact limiter: one store call per decision.
//!
//! Correct across any number of processes (the script is atomic on the
//! store's clock) at the price of a round trip per request. It owns nothing
//! but the call; failures go back to the limiter, which applies the policy.

use crate::decision::Source;
use crate::failure::Report;
use crate::key::KeyEncoder;
use crate::local::decision_from;
use crate::store::{LeaseCall, Params, Store, StoreCost};
use crate::{Decision, Error};

pub(crate) struct ExactEngine {
    store: Store,
    keys: KeyEncoder,
    params: Params,
}

impl ExactEngine {
    pub(crate) fn new(store: Store, keys: KeyEncoder, params: Params) -> Self {
        ExactEngine {
            store,
            keys,
            params,
        }
    }

    /// One decision by the store, and what asking cost.
    pub(crate) async fn check(&self, key: &str, cost: u64) -> (Result<Decision, Error>, StoreCost) {
        let (result, spent) = self.check_timed(key, cost).await;
        (result.map(|(d, _)| d), spent)
    }

    /// As [`check`](Self::check), with the store's clock (µs) at the call.
    pub(crate) async fn check_timed(
        &self,
        key: &str,
        cost: u64,
    ) -> (Result<(Decision, u64), Error>, StoreCost) {
        let store_key = self.keys.store_key(key, self.params.algorithm);
        let (reply, spent) = self.store.acquire(&store_key, &self.params, cost).await;
        let decided = reply.map(|reply| {
            (
                decision_from(&reply, self.params.limit, Source::Store),
                reply.now_us,
            )
        });
        (decided, spent)
    }

    /// Records permits admitted elsewhere (the fallback, during an outage)
    /// as consumption of each key's current window or bucket, each report
    /// under its identity. One result per report: the permits the store
    /// could not cover, or why it refused; and what sending them cost.
    pub(crate) async fn report(
        &self,
        reports: &[Report],
    ) -> (Result<Vec<Result<u64, Error>>, Error>, StoreCost) {
        let calls: Vec<LeaseCall> = reports
            .iter()
            .map(|r| {
                LeaseCall::report(
                    self.keys.store_key(&r.key, self.params.algorithm),
                    r.permits,
                    r.op,
                )
            })
            .collect();
        let (replies, cost) = self.store.lease_batch(&self.params, &calls, 0).await;
        let uncovered = replies.map(|replies| {
            replies
                .into_iter()
                .map(|reply| reply.map(|r| r.uncovered))
                .collect()
        });
        (uncovered, cost)
    }
}
