//! One quota's engine: a lane.
//!
//! A limiter enforces one or more quotas on each key; each is a lane, with
//! its own engine (per-process, exact or hybrid), its own store keys and
//! its own failure layer. A lane decides, takes back what it took
//! (refunds, and the undoing of a take another quota denied) and never
//! counts decisions: the limiter counts each decision once, whatever
//! number of lanes it went through.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::algorithm::Algorithm;
use crate::algorithm::Params;
use crate::algorithm::Refunded;
use crate::clock::Clock;
use crate::decision::Decision;
use crate::decision::{Source, Taken, TakenFrom};
use crate::error::{Error, ErrorKind};
use crate::exact::ExactEngine;
use crate::failure::FailurePolicy;
use crate::failure::{FailureLayer, LayerParts};
use crate::hybrid::{HybridConfig, HybridEngine, Wiring};
use crate::key::KeyEncoder;
use crate::local::LocalEngine;
use crate::quota::Quota;
use crate::stats::Counters;
use crate::store::Store;

/// What a charge past the limit did, as far as the lane knows now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Forced {
    /// Taken from permits this process held; `left` is what it knows
    /// is left after them.
    Covered { left: u64 },
    /// Counted by the store: `uncovered` of it beyond the limit,
    /// `remaining` left after it.
    Counted { uncovered: u64, remaining: u64 },
    /// Waiting for a store that did not answer: not known yet.
    Unknown,
}

/// A charge begun by [`Lane::begin_force`].
pub(crate) enum Forcing<'a> {
    Done(Forced),
    Report {
        report: Box<crate::failure::PendingReport<'a>>,
        /// The hybrid engine whose holding learns what is left.
        hybrid: Option<&'a HybridEngine>,
        key: &'a str,
        failure: &'a FailureLayer,
    },
}

impl Forcing<'_> {
    /// Sends what the charge reports, if anything.
    pub(crate) async fn finish(self) -> Forced {
        match self {
            Forcing::Done(forced) => forced,
            Forcing::Report {
                report,
                hybrid,
                key,
                failure,
            } => match report.send().await {
                Some(reply) => {
                    if let Some(hybrid) = hybrid {
                        hybrid.charged(key, reply.remaining);
                    }
                    Forced::Counted {
                        uncovered: reply.uncovered,
                        remaining: reply.remaining,
                    }
                }
                None => {
                    if hybrid.is_none() {
                        // The sync task resends a hybrid engine's.
                        failure.resend_later();
                    }
                    Forced::Unknown
                }
            },
        }
    }
}

/// How decisions are made.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Mode {
    Exact,
    Local,
    Hybrid(HybridConfig),
}

/// Everything a lane is built from but its quota and keys: what every
/// lane of one limiter shares.
pub(crate) struct Recipe {
    /// The limiter's identity (`Quotas::id`), stamped on its decisions.
    pub(crate) limiter: u32,
    pub(crate) mode: Mode,
    pub(crate) store: Option<Store>,
    pub(crate) algorithm: Algorithm,
    pub(crate) policy: FailurePolicy,
    /// The local clock (injected or the system's).
    pub(crate) clock: Arc<dyn Clock>,
    /// The injected clock, if any (the hybrid engine reads the system's
    /// coarse clock otherwise).
    pub(crate) injected: Option<Arc<dyn Clock>>,
    pub(crate) fast_clock: Option<(Arc<dyn Clock>, Duration)>,
    pub(crate) counters: Arc<Counters>,
    /// Refunds gone back into local leases or credit, for every lane.
    pub(crate) local_refunds: Arc<Mutex<crate::hybrid::LocalRefunds>>,
}

pub(crate) enum Engine {
    Local(LocalEngine),
    Exact(ExactEngine),
    Hybrid(HybridEngine),
}

pub(crate) struct Lane {
    pub(crate) engine: Engine,
    pub(crate) failure: FailureLayer,
    pub(crate) quota: Quota,
    store: Option<Store>,
    counters: Arc<Counters>,
}

impl Lane {
    /// A lane for `quota` counting in `keys`, with `config` for a hybrid
    /// engine (the limiter's current one, which may have been replaced
    /// since it was built).
    pub(crate) fn build(
        recipe: &Recipe,
        quota: Quota,
        keys: KeyEncoder,
        config: Option<HybridConfig>,
    ) -> Result<Lane, Error> {
        recipe.algorithm.check_quota(&quota)?;
        let params = Params::new(&quota, recipe.algorithm);
        let failure = FailureLayer::new(LayerParts {
            policy: recipe.policy,
            algorithm: recipe.algorithm,
            clock: recipe.clock.clone(),
            store: recipe.store.clone(),
            keys: keys.clone(),
            params,
            counters: recipe.counters.clone(),
        });
        let engine = match (&recipe.mode, recipe.store.clone()) {
            (Mode::Hybrid(built_with), Some(store)) => Engine::Hybrid(HybridEngine::start(
                config.unwrap_or_else(|| built_with.clone()),
                Wiring {
                    limiter: recipe.limiter,
                    store,
                    keys,
                    params,
                    clock: recipe.injected.clone(),
                    fast_clock: recipe.fast_clock.clone(),
                    counters: recipe.counters.clone(),
                    max_cost: recipe.algorithm.max_cost(&quota),
                    reconciler: failure.reconciler.clone(),
                    local_refunds: recipe.local_refunds.clone(),
                    store_clock: failure.store_clock.clone(),
                },
            )?),
            (Mode::Exact, Some(store)) => Engine::Exact(ExactEngine::new(
                store,
                keys,
                params,
                recipe.counters.clone(),
            )),
            _ => Engine::Local(LocalEngine::new(
                quota,
                recipe.algorithm,
                recipe.clock.clone(),
                Source::Local,
            )),
        };
        Ok(Lane {
            engine,
            failure,
            quota,
            store: recipe.store.clone(),
            counters: recipe.counters.clone(),
        })
    }

    pub(crate) fn mode_name(&self) -> &'static str {
        match self.engine {
            Engine::Local(_) => "local",
            Engine::Exact(_) => "exact",
            Engine::Hybrid(_) => "hybrid",
        }
    }

    /// The decision if it needs no store call (a hybrid key with local
    /// permits or known exhausted, any per-process decision); `None`
    /// otherwise, with nothing taken.
    #[inline(always)]
    pub(crate) fn check_now(&self, key: &str, cost: u64) -> Option<Decision> {
        let mut decided = None;
        self.check_now_into(key, cost, &mut decided);
        decided
    }

    /// The denial this lane's cache gives `key` at `cost` now, taking
    /// nothing (hybrid lanes; see `HybridEngine::cached_denial`).
    pub(crate) fn cached_denial(&self, key: &str, cost: u64) -> Option<Decision> {
        match &self.engine {
            Engine::Hybrid(hybrid) => hybrid
                .cached_denial(key, cost)
                .map(|d| d.with_period(self.quota.period())),
            _ => None,
        }
    }

    /// [`check_now`](Lane::check_now), written into `decided` (see
    /// `Limiter::check_now`).
    #[inline(always)]
    pub(crate) fn check_now_into(&self, key: &str, cost: u64, decided: &mut Option<Decision>) {
        match &self.engine {
            Engine::Local(local) => *decided = Some(local.check(key, cost)),
            Engine::Hybrid(hybrid) => hybrid.fast_into(key, cost, decided),
            Engine::Exact(_) => {}
        }
        if let Some(decision) = decided {
            decision.set_period(self.quota.period());
        }
    }

    /// A decision, by the store if need be; a store error becomes the
    /// failure policy's decision.
    pub(crate) async fn decide(&self, key: &str, cost: u64) -> Decision {
        let decision = match &self.engine {
            Engine::Local(local) => local.check(key, cost),
            Engine::Exact(exact) => self.decide_exact(exact, key, cost).await,
            Engine::Hybrid(hybrid) => match hybrid.check(key, cost).await {
                Ok(decision) => decision,
                Err(_) => self.policy_decision(key, cost),
            },
        };
        decision.with_period(self.quota.period())
    }

    async fn decide_exact(&self, exact: &ExactEngine, key: &str, cost: u64) -> Decision {
        // After an outage, what the fallback admitted is reported before
        // anything new is decided.
        if self.failure.reconciler.has_pending() && !self.failure.reconcile().await {
            return self.policy_decision(key, cost);
        }
        let began = std::time::Instant::now();
        let local_before = self.failure.store_clock.local_us();
        let result = exact.check_timed(key, cost).await;
        let took = began.elapsed().as_micros() as u64;
        if let Some(store) = &self.store {
            self.counters.circuit(store.circuit_state());
        }
        match result {
            Ok((decision, store_us)) => {
                self.failure
                    .store_clock
                    .observe(local_before, local_before + took, store_us);
                decision
            }
            Err(_) => self.policy_decision(key, cost),
        }
    }

    /// The exact engine, if this lane has one.
    pub(crate) fn exact(&self) -> Option<&ExactEngine> {
        match &self.engine {
            Engine::Exact(exact) => Some(exact),
            _ => None,
        }
    }

    /// Reports what the fallback admitted during an outage, if anything is
    /// pending; `false` while the store is still unavailable.
    pub(crate) async fn reconciled(&self) -> bool {
        !self.failure.reconciler.has_pending() || self.failure.reconcile().await
    }

    /// The failure policy's decision: what a fallback admits is taken
    /// from the fallback's count (and recorded for the store), so it can
    /// go back; fail-open and fail-closed take nothing.
    pub(crate) fn policy_decision(&self, key: &str, cost: u64) -> Decision {
        self.failure
            .decide(key, cost)
            .with_period(self.quota.period())
    }

    /// An exact engine's decision from its reply to a call that decided
    /// several quotas at once (`applied`: every quota admitted).
    pub(crate) fn replied(
        &self,
        exact: &ExactEngine,
        reply: &crate::algorithm::AcquireReply,
        cost: u64,
        applied: bool,
    ) -> Decision {
        exact
            .decision(reply, cost, applied)
            .with_period(self.quota.period())
    }

    /// A denial for a moment: leases kept slipping away while several
    /// quotas were decided (a map at `max_keys`, refills failing).
    pub(crate) fn denied_briefly(&self) -> Decision {
        let retry = std::time::Duration::from_millis(1);
        Decision::deny(self.quota.limit(), 0, retry, Some(retry), Source::Lease)
            .with_period(self.quota.period())
    }

    /// Like [`decide`](Lane::decide), with the store's error instead of
    /// the policy's decision.
    pub(crate) async fn try_decide(&self, key: &str, cost: u64) -> Result<Decision, Error> {
        let decision = match &self.engine {
            Engine::Local(local) => Ok(local.check(key, cost)),
            Engine::Exact(exact) => exact.check(key, cost).await,
            Engine::Hybrid(hybrid) => hybrid.check(key, cost).await,
        }?;
        Ok(decision.with_period(self.quota.period()))
    }

    /// Undoes a take without waiting: back into the local lease (hybrid)
    /// or the per-process count. `false` if it needs the store.
    pub(crate) fn untake(&self, key: &str, taken: Taken) -> bool {
        match (&self.engine, taken.origin) {
            (Engine::Hybrid(hybrid), TakenFrom::Lease | TakenFrom::Credit) => {
                hybrid.untake(key, taken)
            }
            (Engine::Local(local), TakenFrom::Local) => {
                local.refund(key, taken) == Refunded::Now(taken.cost)
            }
            (_, TakenFrom::Fallback) => self.failure.untake(key, taken) > 0,
            _ => false,
        }
    }

    /// Gives `taken` back without a store call where it can, once per
    /// admission: into the hybrid lease it came from, or the per-process
    /// count; `Some(permits)` then (0: it went back before), `None` when
    /// it must go to the store (see `refund`).
    pub(crate) fn give_back_once(&self, key: &str, taken: Taken) -> Option<u64> {
        match (&self.engine, taken.origin) {
            (Engine::Hybrid(hybrid), TakenFrom::Lease | TakenFrom::Credit) => {
                hybrid.give_back_once(key, taken)
            }
            (Engine::Local(local), TakenFrom::Local) => Some(local.refund(key, taken).now()),
            _ => None,
        }
    }

    /// Gives `taken` back to the window it came from, while that window
    /// lasts; returns the permits given back (0: ignored).
    ///
    /// A refund that failed (its reply lost, say) is sent once more under
    /// the same identity: if the first landed, the store answers with what
    /// it gave back then, so it is neither lost nor counted twice.
    ///
    /// A refund of an admission already refunded gives nothing back: the
    /// store knows its identity (for as long as its window lasts).
    pub(crate) async fn refund(&self, key: &str, taken: Taken) -> u64 {
        match self.refund_once(key, taken).await {
            // Refunded before, by an earlier call: nothing now.
            Ok(back) => back.now(),
            // A repeat now is this call's own first send landing.
            Err(_) => self
                .refund_once(key, taken)
                .await
                .map_or(0, Refunded::permits),
        }
    }

    async fn refund_once(&self, key: &str, taken: Taken) -> Result<Refunded, Error> {
        match (&self.engine, taken.origin) {
            (_, TakenFrom::None) => Ok(Refunded::Now(0)),
            (Engine::Local(local), TakenFrom::Local) => Ok(local.refund(key, taken)),
            (_, TakenFrom::Fallback) => Ok(Refunded::Now(self.failure.untake(key, taken))),
            (Engine::Hybrid(hybrid), TakenFrom::Lease | TakenFrom::Store | TakenFrom::Credit) => {
                hybrid.refund(key, taken).await
            }
            (Engine::Exact(exact), TakenFrom::Store) => exact.refund(key, taken).await,
            // A decision of another engine (a lane rebuilt in another
            // mode cannot happen; a decision of another limiter is refused
            // before it gets here).
            _ => Ok(Refunded::Now(0)),
        }
    }

    /// Counts `cost` against `key` whatever is left, past the limit if
    /// need be (see `Limiter::charge`), in two steps: this one, at once
    /// (a per-process count takes it; a hybrid engine what it can from its
    /// local lease; the rest becomes a report under an identity, held for
    /// the ledger), then [`Forcing::finish`], which sends the report. A
    /// report dropped unsent waits in the ledger and is resent (see
    /// `PendingReport`), so a caller that begins every quota's charge
    /// before finishing any loses none to a cancellation.
    pub(crate) fn begin_force<'a>(&'a self, key: &'a str, cost: u64) -> Forcing<'a> {
        if cost == 0 {
            return Forcing::Done(Forced::Covered { left: 0 });
        }
        let (rest, hybrid) = match &self.engine {
            Engine::Local(local) => {
                return Forcing::Done(match local.force(key, cost) {
                    Some(reply) => Forced::Counted {
                        uncovered: reply.uncovered,
                        remaining: reply.remaining,
                    },
                    None => Forced::Unknown,
                })
            }
            Engine::Hybrid(hybrid) => {
                let (covered, left) = hybrid.force(key, cost);
                if covered == cost {
                    return Forcing::Done(Forced::Covered { left });
                }
                (cost - covered, Some(hybrid))
            }
            Engine::Exact(_) => (cost, None),
        };
        match self.failure.report(key, rest) {
            Some(report) => Forcing::Report {
                report: Box::new(report),
                hybrid,
                key,
                failure: &self.failure,
            },
            None => Forcing::Done(Forced::Unknown),
        }
    }

    /// Gives up whatever this lane holds for `key` (see
    /// `HybridEngine::release`); other engines hold nothing per key that
    /// another quota's lane would not see.
    pub(crate) async fn release(&self, key: &str, wait: bool) {
        if let Engine::Hybrid(hybrid) = &self.engine {
            hybrid.release(key, wait).await;
        }
    }

    /// Forgets every denial a hybrid engine cached: its keys ask the
    /// store again (see `Tiers::set_default`).
    pub(crate) fn forget_denials(&self) {
        if let Engine::Hybrid(hybrid) = &self.engine {
            hybrid.forget_denials();
        }
    }

    pub(crate) async fn shutdown(&self) {
        match &self.engine {
            Engine::Hybrid(hybrid) => hybrid.shutdown().await,
            // Charges (and a fallback's admissions) still waiting for the
            // store go now, once more.
            Engine::Exact(_) => {
                self.reconciled().await;
            }
            Engine::Local(_) => {}
        }
    }

    /// Stops a hybrid engine's sync task without waiting (see
    /// `HybridEngine::stop`).
    pub(crate) fn stop(&self) {
        if let Engine::Hybrid(hybrid) = &self.engine {
            hybrid.stop();
        }
    }

    pub(crate) fn reconfigure(&self, config: HybridConfig) -> Result<(), Error> {
        match &self.engine {
            Engine::Hybrid(hybrid) => hybrid.reconfigure(config),
            _ => Err(Error::new(
                ErrorKind::Unsupported,
                "only a hybrid limiter has a HybridConfig",
            )),
        }
    }

    pub(crate) fn local_keys(&self) -> usize {
        match &self.engine {
            Engine::Hybrid(hybrid) => hybrid.local_keys(),
            _ => 0,
        }
    }
}
