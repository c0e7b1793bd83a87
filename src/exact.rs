//! The exact limiter: one store call per decision.
//!
//! Correct across any number of processes (the script is atomic on the
//! store's clock) at the price of a round trip per request. It owns nothing
//! but the call; failures go back to the limiter, which applies the policy.

use std::sync::Arc;

use crate::decision::Source;
use crate::key::KeyEncoder;
use crate::local::decision_from;
use crate::stats::Counters;
use crate::store::{Params, Store};
use crate::{Decision, Error};

pub(crate) struct ExactEngine {
    store: Store,
    keys: KeyEncoder,
    params: Params,
    /// Where its store calls are counted.
    counters: Arc<Counters>,
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
            .acquire(&store_key, &self.params, cost, &self.counters)
            .await;
        reply.map(|reply| {
            (
                decision_from(&reply, self.params.limit, Source::Store),
                reply.now_us,
            )
        })
    }
}
