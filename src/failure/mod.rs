//! The failure layer: what a limiter decides when its store cannot answer,
//! and how what it decided meanwhile is settled with the store afterwards.
//!
//! - `policy`: [`FailurePolicy`] and the pure rule turning "could not
//!   decide" into a [`Decision`];
//! - `ledger`: what the fallback admitted, reported to the store as debt
//!   when it answers again;
//! - `report`: a report under its identity and how it is resent, for the
//!   ledger and for the hybrid engine's debt alike.
//!
//! [`FailureLayer`] is the one place the policy is applied, for every
//! limiter mode, and the owner of the ledger. It sits above the stores and
//! below the limiters; it imports nothing from them. The circuit breaker
//! that refuses calls to a failing node is the store's own
//! ([`crate::breaker`]): only the store knows which node serves a key.

mod ledger;
mod policy;
mod report;

pub(crate) use self::ledger::{report_call, PendingReport, Reconciler};
pub use self::policy::FailurePolicy;
pub(crate) use self::report::{Report, Resend};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::algorithm::Algorithm;
use crate::algorithm::Params;
use crate::clock::Clock;
use crate::clock::StoreClock;
use crate::decision::Decision;
use crate::decision::{Source, Taken, TakenFrom};
use crate::key::KeyEncoder;
use crate::local::LocalEngine;
use crate::stats::Counters;
use crate::store::Store;

/// Applies the failure policy and settles what it admitted.
pub(crate) struct FailureLayer {
    policy: FailurePolicy,
    /// The per-process limiter behind `LocalFallback`.
    fallback: Option<LocalEngine>,
    /// What the fallback admitted, to be reported when the store returns.
    pub(crate) reconciler: Arc<Reconciler>,
    /// The store's clock as last seen, which the fallback counts windows
    /// on (application clocks never decide windows).
    pub(crate) store_clock: Arc<StoreClock>,
    limit: u64,
    /// The store the limiter counts in (none for a per-process limiter):
    /// when it will be tried again, where reports go.
    store: Option<Store>,
    keys: KeyEncoder,
    params: Params,
    counters: Arc<Counters>,
    /// A task resends what waits in the ledger (see `resend_later`).
    resending: Arc<AtomicBool>,
}

/// What a [`FailureLayer`] is built from.
pub(crate) struct LayerParts {
    pub(crate) policy: FailurePolicy,
    pub(crate) algorithm: Algorithm,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) store: Option<Store>,
    pub(crate) keys: KeyEncoder,
    pub(crate) params: Params,
    pub(crate) counters: Arc<Counters>,
}

impl FailureLayer {
    pub(crate) fn new(parts: LayerParts) -> Self {
        let store_clock = Arc::new(StoreClock::new(parts.clock));
        let fallback = match parts.policy {
            FailurePolicy::LocalFallback(quota) => Some(LocalEngine::new(
                quota,
                parts.algorithm,
                store_clock.clone(),
                Source::Fallback,
            )),
            _ => None,
        };
        FailureLayer {
            policy: parts.policy,
            fallback,
            reconciler: Arc::new(Reconciler::new(store_clock.local().clone())),
            store_clock,
            limit: parts.params.limit,
            store: parts.store,
            keys: parts.keys,
            params: parts.params,
            counters: parts.counters,
            resending: Arc::new(AtomicBool::new(false)),
        }
    }

    pub(crate) fn policy(&self) -> FailurePolicy {
        self.policy
    }

    /// The decision for a request the store could not decide: the policy's,
    /// counted, with what the fallback admitted put in the ledger.
    pub(crate) fn decide(&self, key: &str, cost: u64) -> Decision {
        self.counters.policy_decisions.add(1);
        let hint = self.store.as_ref().and_then(|store| {
            if store.is_sharded() {
                store.retry_hint_for(&self.keys.store_key(key, self.params.algorithm))
            } else {
                store.retry_hint()
            }
        });
        let decision = policy::decide(
            self.policy,
            self.limit,
            self.fallback.as_ref(),
            key,
            cost,
            hint,
        );
        if decision.source() == Source::Fallback && decision.is_allowed() {
            self.reconciler.record(key, cost);
            self.counters.fallback_admitted.add(cost);
            let dropped = self.reconciler.take_dropped();
            if dropped > 0 {
                self.counters.reports_dropped.add(dropped);
            }
            let mut taken = decision.taken;
            taken.origin = TakenFrom::Fallback;
            return decision.with_taken(taken);
        }
        // Fail-open and fail-closed take nothing.
        decision.with_taken(Taken::default())
    }

    /// Gives back what the fallback admitted (another quota denied the
    /// request, or it was refunded): out of the fallback's count and, if
    /// not reported yet, out of what will be. Returns the permits given
    /// back (0 if refunded before: the fallback's count knows the
    /// admission).
    pub(crate) fn untake(&self, key: &str, taken: Taken) -> u64 {
        let Some(fallback) = &self.fallback else {
            return 0;
        };
        let mut local = taken;
        local.origin = TakenFrom::Local;
        let back = fallback.refund(key, local).now();
        if back == 0 {
            return 0;
        }
        self.reconciler.unrecord(key, back);
        back
    }

    /// A charge of `cost` for `key`, made but not sent (see
    /// [`ledger::PendingReport`]); `None` without a store.
    pub(crate) fn report(&self, key: &str, cost: u64) -> Option<ledger::PendingReport<'_>> {
        let store = self.store.as_ref()?;
        Some(ledger::PendingReport::new(
            &self.reconciler,
            store,
            &self.keys,
            &self.params,
            &self.counters,
            key,
            cost,
        ))
    }

    /// While charges wait in the ledger (their store did not answer), a
    /// task of its own resends them, backing off, until they land or are
    /// dropped (see `RESEND_FOR`): an exact limiter may make no further
    /// decision to carry them, and other processes must see them. One
    /// such task at a time; none without a runtime.
    pub(crate) fn resend_later(&self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        if !self.reconciler.has_pending() || self.resending.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.resending.store(false, Ordering::Release);
            return;
        };
        let (ledger, keys, params, counters) = (
            self.reconciler.clone(),
            self.keys.clone(),
            self.params,
            self.counters.clone(),
        );
        let resending = self.resending.clone();
        runtime.spawn(async move {
            let mut pause = std::time::Duration::from_millis(100);
            while ledger.has_pending() {
                tokio::time::sleep(pause).await;
                if ledger::reconcile(&ledger, &store, &keys, &params, &counters).await {
                    break;
                }
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
            resending.store(false, Ordering::Release);
        });
    }

    /// After an outage, reports what the fallback admitted meanwhile;
    /// `false` if the store is still unavailable (see
    /// [`ledger::reconcile`]).
    pub(crate) async fn reconcile(&self) -> bool {
        match &self.store {
            Some(store) => {
                ledger::reconcile(
                    &self.reconciler,
                    store,
                    &self.keys,
                    &self.params,
                    &self.counters,
                )
                .await
            }
            None => true,
        }
    }
}
