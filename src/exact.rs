//! The exact limiter: one store call per decision.
//!
//! Correct across any number of processes (the script is atomic on the
//! store's clock) at the price of a round trip per request. It owns nothing
//! but the call; failures go back to the limiter, which applies the policy.

use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::{GiveBackCall, LeaseOrigin, OpIds};
use crate::decision::{Origin, Source, Taken};
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
            .acquire(&store_key, &self.params, cost, &self.counters)
            .await;
        reply.map(|reply| {
            let decision = self.decision(&reply, cost, true);
            (decision, reply.now_us)
        })
    }

    /// The store key and parameters of `key`'s check (several quotas are
    /// checked together in one call, see `several`).
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
        reply: &crate::store::AcquireReply,
        cost: u64,
        applied: bool,
    ) -> Decision {
        let taken = if applied {
            taken_by_check(&self.params, reply, cost, Origin::Store)
        } else {
            Taken::default()
        };
        decision_from(reply, self.params.limit, Source::Store).with_taken(taken)
    }

    /// Gives `taken` back to the store: to its window's count while that
    /// window lasts, or to its bucket as far as the bucket could have
    /// held it had it never been taken. Returns the permits it took back.
    pub(crate) async fn refund(&self, key: &str, taken: Taken) -> Result<u64, Error> {
        let store_key = self.keys.store_key(key, self.params.algorithm);
        let call = refund_call(&self.params, store_key, &taken, &self.ops);
        let (replies, _) = self
            .store
            .give_back_batch(&self.params, std::slice::from_ref(&call), &self.counters)
            .await;
        replies?.pop().unwrap_or(Ok(0))
    }
}

/// The window a store reading at `now_us` falls in, for window algorithms
/// (the scripts' `floor(now / period)`); `None` for buckets.
pub(crate) fn window_of(params: &Params, now_us: u64) -> Option<i64> {
    params
        .algorithm
        .spec()
        .leases
        .windowed()
        .then(|| (now_us / params.period_us.max(1)) as i64)
}

/// What a check by a store (shared or per-process) that admitted `cost`
/// took: permits of the window it counted them in, or a bucket's tokens
/// at the reply's level and time.
pub(crate) fn taken_by_check(
    params: &Params,
    reply: &crate::store::AcquireReply,
    cost: u64,
    origin: Origin,
) -> Taken {
    match window_of(params, reply.now_us) {
        Some(window) => {
            let period = params.period_us.max(1);
            let lasts = Duration::from_micros(period - reply.now_us % period);
            Taken::new(origin, cost, Some(window)).lasting(lasts)
        }
        None => Taken::of_bucket(origin, cost, LeaseOrigin::of_check(reply)),
    }
}

/// The give-back that refunds `taken` to `store_key`, under the
/// admission's identity.
pub(crate) fn refund_call(
    params: &Params,
    store_key: String,
    taken: &Taken,
    ops: &OpIds,
) -> GiveBackCall {
    let windowed = params.algorithm.spec().leases.windowed();
    GiveBackCall {
        key: store_key,
        returned: taken.cost,
        window: if windowed { taken.window } else { 0 },
        origin: if windowed {
            LeaseOrigin::default()
        } else {
            taken.bucket_origin()
        },
        op: taken.op().unwrap_or_else(|| ops.next()),
        remember_us: remember_refund(params),
        refund: true,
    }
}

/// How long a refund's identity is remembered: past the end of its window,
/// or past the time its bucket takes to fill from empty, after which the
/// store gives it nothing back anyway.
pub(crate) fn remember_refund(params: &Params) -> u64 {
    let lasts = if params.algorithm.spec().leases.windowed() {
        params.period_us
    } else {
        let fill = params.burst as f64 * params.period_us as f64 / params.limit.max(1) as f64;
        fill.min(u64::MAX as f64 / 2.0) as u64
    };
    lasts.saturating_add(1_000_000)
}
