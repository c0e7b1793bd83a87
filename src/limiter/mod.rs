//! The front door: [`Limiter`], its [`Builder`], and deciding.
//!
//! A key goes `Limiter` → `quotas` (one path for one or several quotas:
//! all-or-nothing, counted once) → `tiers` (the lane of the key's quota)
//! → `lane` (that quota's engine and failure layer) → the engine.
//! `all` decides across limiters (`check_all`) through the same undo
//! guard. Engines decide; this module makes sure every call ends in a
//! [`Decision`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::algorithm::Algorithm;
use crate::decision::Decision;
use crate::error::Error;
use crate::hybrid::HybridConfig;
use crate::key::{local_key, Key, MAX_LOCAL_KEY_LEN};
use crate::quota::Quota;
use crate::stats::{Counters, Stats};
use crate::store::Store;

mod all;
mod builder;
mod lane;
mod quotas;
mod receipt;
mod reserve;
mod tiers;
mod undo;

pub use all::{check_all, check_each, refund_all};
pub use builder::Builder;
use quotas::Quotas;
pub use receipt::Receipt;
pub use reserve::{Charge, Reservation, Reserve, Settled};

/// The most quotas one limiter enforces on a key (see [`Builder::and`]).
pub const MAX_QUOTAS: usize = 8;

/// A rate limiter. Cheap to clone; clones share one limit.
#[derive(Clone)]
pub struct Limiter {
    pub(crate) inner: Arc<Quotas>,
}

/// The future returned by [`Limiter::check`]: already resolved when the
/// decision was local, else the store call in flight.
#[must_use = "a Check does nothing unless awaited"]
pub struct Check<'a> {
    state: CheckState<'a>,
}

enum CheckState<'a> {
    Ready(Option<Decision>),
    Pending(Pin<Box<dyn Future<Output = Decision> + Send + 'a>>),
}

impl Future for Check<'_> {
    type Output = Decision;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Decision> {
        match &mut self.state {
            CheckState::Ready(decision) => match decision.take() {
                Some(decision) => Poll::Ready(decision),
                None => panic!("Check polled after completion"),
            },
            CheckState::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for Check<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            CheckState::Ready(d) => f.debug_tuple("Check::Ready").field(d).finish(),
            CheckState::Pending(_) => f.write_str("Check::Pending"),
        }
    }
}

impl fmt::Debug for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = self.inner.tiers[0].default_lane();
        f.debug_struct("Limiter")
            .field("quotas", &self.quotas())
            .field("algorithm", &self.inner.algorithm)
            .field("mode", &first.mode_name())
            .field("on_store_error", &first.failure.policy())
            .finish()
    }
}

impl Limiter {
    /// Starts building a limiter for `quota`.
    pub fn builder(quota: Quota) -> Builder {
        Builder::new(quota)
    }

    /// Decides whether a request of `cost` permits for `key` may proceed.
    ///
    /// Never fails: a store error becomes a decision by the failure policy.
    /// `cost` 0 asks without consuming; a cost above the limit (burst for
    /// token bucket and GCRA) is denied with no `retry_after`.
    ///
    /// A key longer than 64 bytes is replaced by its SHA-256 before it
    /// reaches any per-process map or the store, so a client-chosen key
    /// costs this process a bounded number of bytes.
    ///
    /// A hybrid key holding local permits (and every `local()` decision) is
    /// decided right here, before the returned future is first polled; only
    /// a decision that needs the store builds a (boxed) future.
    ///
    /// With several quotas ([`Builder::and`]) a request is admitted only if
    /// every quota admits it, and then counts against all of them; a
    /// denial counts against none (see [`Decision::quotas`]).
    pub fn check<'a>(&'a self, key: &'a str, cost: u64) -> Check<'a> {
        let given = key;
        let kept = local_key(given);
        let mut decided = None;
        // (The decision is written where the caller keeps it: one returned
        // up through the steps was copied whole at each, and the first
        // copy of one just made waited for its stores to drain; on one hot
        // key, a tenth of the decision's cost.)
        self.inner
            .check_now_into(Key { given, kept: &kept }, cost, &mut decided);
        match decided {
            Some(decision) => Check {
                state: CheckState::Ready(Some(decision)),
            },
            None => Check {
                state: CheckState::Pending(Box::pin(async move {
                    self.inner.decide(Key { given, kept: &kept }, cost).await
                })),
            },
        }
    }

    /// The decision, if it can be made without waiting: a hybrid key with
    /// local permits (or known exhausted), or any `local()` decision.
    /// `None` means [`check`](Limiter::check) would need the store; nothing
    /// was counted or consumed then.
    #[inline]
    pub fn check_now(&self, key: &str, cost: u64) -> Option<Decision> {
        let mut decided = None;
        if key.len() > MAX_LOCAL_KEY_LEN {
            self.check_hashed_key(key, cost, &mut decided);
        } else {
            self.inner
                .check_now_into(Key::short(key), cost, &mut decided);
        }
        decided
    }

    /// [`check_now`](Limiter::check_now) for a key replaced by its hash.
    #[inline(never)]
    fn check_hashed_key(&self, key: &str, cost: u64, decided: &mut Option<Decision>) {
        let kept = local_key(key);
        let key = Key {
            given: key,
            kept: &kept,
        };
        self.inner.check_now_into(key, cost, decided);
    }

    /// Like [`check`](Limiter::check), but returns the store's error instead
    /// of applying the failure policy. For tests and diagnostics.
    ///
    /// # Errors
    /// The store's error, classified (see [`Error::kind`]).
    pub async fn try_check(&self, key: &str, cost: u64) -> Result<Decision, Error> {
        let kept = local_key(key);
        let key = Key {
            given: key,
            kept: &kept,
        };
        self.inner.try_decide(key, cost).await
    }

    /// Gives an admitted request's permits back to where they were taken
    /// from, for each of the limiter's quotas: a request that failed (a
    /// 5xx, a cancelled job) need not cost its client the quota.
    ///
    /// A window's permits go back to the window they came from, never a
    /// later one: a refund arriving after that window ended is ignored. A
    /// bucket's tokens (token bucket, GCRA) go back as far as the bucket
    /// could have held them had they never been taken (never above its
    /// burst, nor what it would have dropped at full meanwhile); a hybrid
    /// limiter's, only while the lease they came from lasts. Credit
    /// (optimistic hybrid) goes back as unreported debt, or to its window.
    /// What a `LocalFallback` admitted goes back to the fallback's count
    /// and, if not reported yet, out of what will be reported. A denial
    /// took nothing and gives nothing back, nor does a peek or a fail-open
    /// or fail-closed decision. Returns the permits given back, summed
    /// over the quotas; what was ignored is counted in
    /// [`Stats::refunds_ignored`].
    ///
    /// A decision is refunded once: each admission carries an identity the
    /// store (or, for what goes back into a local lease, the limiter)
    /// remembers for as long as a refund could still land, so refunding it
    /// again (or a retry after a lost reply) gives nothing more back. A decision
    /// of another limiter is ignored. `key` must be the key the decision
    /// was made for.
    pub async fn refund(&self, key: &str, decision: &Decision) -> u64 {
        let kept = local_key(key);
        let key = Key {
            given: key,
            kept: &kept,
        };
        // A denial took nothing: what one quota took before another
        // denied went back when it was decided.
        if !decision.is_allowed() {
            return 0;
        }
        self.inner.refund(key, decision).await
    }

    /// Stops background work and gives unused leased permits back to the
    /// store (hybrid); sends once more what waits for the store (charges,
    /// a fallback's admissions). Decisions after shutdown are still
    /// answered, by one store call each.
    pub async fn shutdown(&self) {
        for tiers in self.inner.tiers.iter() {
            for lane in tiers.all() {
                lane.shutdown().await;
            }
        }
    }

    /// Replaces a hybrid limiter's tunables while it runs; the consistency
    /// mode, lease sizes and timeouts take effect with the next refill.
    ///
    /// # Errors
    /// [`InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid
    /// configuration, [`Unsupported`](crate::ErrorKind::Unsupported) if this
    /// limiter is not hybrid.
    pub fn reconfigure(&self, config: HybridConfig) -> Result<(), Error> {
        let inner = &*self.inner;
        for tiers in inner.tiers.iter() {
            for lane in tiers.all() {
                lane.reconfigure(config.clone())?;
            }
        }
        *inner.config.lock().unwrap_or_else(|p| p.into_inner()) = Some(config);
        Ok(())
    }

    /// Replaces the default quota while the limiter runs (for every key
    /// without a quota of its own, see [`Builder::quota_for`]).
    ///
    /// The new limit applies to what the current window (or bucket) has
    /// already counted (for a quota of the same period; another period
    /// counts on its own, see [`Builder::quota_for`]): raising a limit mid-window admits the difference at
    /// once, lowering it below the count denies until the window ends. A
    /// hybrid limiter gives the permits it leased under the old quota back
    /// and leases under the new one from the next request on, so the fleet
    /// converges within one refill (each process as its own `set_quota`
    /// call lands).
    ///
    /// # Errors
    /// [`InvalidInput`](crate::ErrorKind::InvalidInput) for a quota the algorithm
    /// refuses; [`Unsupported`](crate::ErrorKind::Unsupported) for a hybrid
    /// limiter changed outside a Tokio runtime.
    pub fn set_quota(&self, quota: Quota) -> Result<(), Error> {
        let lane = self.inner.build_lane(quota, 0)?;
        self.inner.tiers[0].set_default(lane);
        Ok(())
    }

    /// Replaces the per-key quota resolver while the limiter runs (see
    /// [`Builder::quota_for`]); `None` from it means the default quota.
    /// As with [`set_quota`](Limiter::set_quota), a key's new quota applies
    /// to what its window already counted.
    pub fn set_quota_for(&self, resolver: impl Fn(&str) -> Option<Quota> + Send + Sync + 'static) {
        self.inner.tiers[0].set_resolver(Some(Box::new(resolver)));
    }

    /// Keys this process tracks locally (hybrid), over every quota; 0 for
    /// other modes.
    pub fn local_keys(&self) -> usize {
        let tiers = self.inner.tiers.iter();
        tiers.flat_map(|t| t.all()).map(|l| l.local_keys()).sum()
    }

    /// The default quota (the first one given, or the latest
    /// [`set_quota`](Limiter::set_quota)).
    pub fn quota(&self) -> Quota {
        self.inner.tiers[0].default_quota()
    }

    /// The quota `key` is held to first: its own (see
    /// [`Builder::quota_for`]) or the default.
    pub fn quota_of(&self, key: &str) -> Quota {
        let kept = local_key(key);
        let key = Key {
            given: key,
            kept: &kept,
        };
        self.inner.lane(key, 0).quota
    }

    /// Every quota this limiter enforces on a key without one of its own,
    /// in order: the default, then those added with [`Builder::and`].
    pub fn quotas(&self) -> Vec<Quota> {
        self.inner.tiers.iter().map(|t| t.default_quota()).collect()
    }

    /// How this limiter counts.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// This limiter's name: [`Builder::name`], else its namespace. It
    /// labels the limiter's metrics and names it in
    /// [`Decision::denied_by`] after [`check_all`].
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The namespace of this limiter's store keys (see
    /// [`Builder::namespace`]).
    pub fn namespace(&self) -> &str {
        self.inner.keys.namespace()
    }

    /// Whether `other` is this limiter or a clone of it (one budget).
    pub fn same_as(&self, other: &Limiter) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether this limiter and `other`, built separately, would count in
    /// the same store keys: same namespace and algorithm.
    pub fn shares_keys_with(&self, other: &Limiter) -> bool {
        self.namespace() == other.namespace() && self.algorithm() == other.algorithm()
    }

    /// Counts a denial that was let through anyway, in shadow (dry-run)
    /// mode: in [`Stats::shadow_denials`] and its metric. For middleware
    /// that decides without enforcing, such as slicelimit-tower's shadow
    /// mode; a `check` alone does not know whether its denial was obeyed.
    pub fn record_shadow_denial(&self) {
        self.inner.counters.shadow_denials.add(1);
    }

    /// Counters since the limiter was built.
    pub fn stats(&self) -> Stats {
        let mut stats = self.inner.counters.snapshot();
        let trips = self
            .inner
            .recipe
            .store
            .as_ref()
            .map_or(0, Store::circuit_trips);
        stats.circuit_trips = trips.saturating_sub(self.inner.trips_at_build);
        stats
    }

    /// The live counters, for what is built on `check` outside this
    /// module (waiting, in `wait`).
    pub(crate) fn counters(&self) -> &Counters {
        &self.inner.counters
    }
}
