//! Costs known only after the work: charges counted past the limit
//! ([`Limiter::charge`]) and reservations settled to the actual cost
//! ([`Reservation`]), the shape of a token budget for an LLM API.
//!
//! A reservation is an admission like any other (from the local lease in
//! hybrid mode), taken at an estimate. Settling gives the difference back
//! where it came from (a refund of part of the admission) or charges what
//! the estimate did not cover, even past the limit: a debt the key pays
//! before its next admission, since the store counts it like any
//! admission. The bound this gives is in `docs/costs.md`.

use super::all::check_each;
use super::lane::Forced;
use super::quotas::Quotas;
use super::Limiter;
use crate::decision::Decision;
use crate::key::{local_key, Key};

/// What a charge did ([`Limiter::charge`], [`Reservation::consume`],
/// [`Reservation::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    fit: Option<bool>,
    remaining: Option<u64>,
    /// Counted past the limit, summed over the quotas (`None`: unknown).
    past: Option<u64>,
}

impl Charge {
    /// Nothing charged (a denied reservation, a cost covered by the
    /// estimate).
    const NOTHING: Charge = Charge {
        fit: Some(true),
        remaining: None,
        past: Some(0),
    };

    /// Whether the whole cost fit within every quota: `Some(true)` counted
    /// within the limits, `Some(false)` partly past one (a debt the key
    /// pays before its next admission), `None` not known yet (the store
    /// did not answer: the charge is counted when it does).
    pub fn fit(&self) -> Option<bool> {
        self.fit
    }

    /// Whether some quota of the key is known to have nothing left: a
    /// request now would be denied, and a stream charged per frame should
    /// stop.
    pub fn exhausted(&self) -> bool {
        self.fit == Some(false) || self.remaining == Some(0)
    }

    /// What the key has left in its tightest quota after the charge, if
    /// the store said (`None`: taken from permits this process held, or
    /// not known yet).
    pub fn remaining(&self) -> Option<u64> {
        self.remaining
    }

    /// How much of the cost was counted past a limit: `Some(0)` when it
    /// all fit, `None` when not known yet (see [`fit`](Charge::fit)). With
    /// several quotas, the most any one quota counted past its limit.
    pub fn past_limit(&self) -> Option<u64> {
        self.past
    }

    /// Both charges, as one (several quotas or limiters).
    fn and(self, other: Charge) -> Charge {
        let fit = match (self.fit, other.fit) {
            (Some(false), _) | (_, Some(false)) => Some(false),
            (Some(true), Some(true)) => Some(true),
            _ => None,
        };
        let remaining = match (self.remaining, other.remaining) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let past = match (self.past, other.past) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
        Charge {
            fit,
            remaining,
            past,
        }
    }
}

impl From<Forced> for Charge {
    fn from(forced: Forced) -> Charge {
        match forced {
            Forced::Covered { left } => Charge {
                remaining: Some(left),
                ..Charge::NOTHING
            },
            Forced::Counted {
                uncovered,
                remaining,
            } => Charge {
                fit: Some(uncovered == 0),
                remaining: Some(remaining),
                past: Some(uncovered),
            },
            Forced::Unknown => Charge {
                fit: None,
                remaining: None,
                past: None,
            },
        }
    }
}

impl Quotas {
    /// Counts `cost` against every quota of `key`, past the limit if need
    /// be (see [`Limiter::charge`]).
    pub(super) async fn charge(&self, key: Key<'_>, cost: u64) -> Charge {
        if cost == 0 {
            return Charge::NOTHING;
        }
        self.counters.charged.add(cost);
        // Every quota's charge is made before any is sent: a future
        // dropped midway leaves each one in its ledger, none lost.
        let lanes: Vec<_> = (0..self.tiers.len()).map(|i| self.lane(key, i)).collect();
        let begun: Vec<_> = lanes
            .iter()
            .map(|lane| lane.begin_force(&key, cost))
            .collect();
        let mut charge = Charge::NOTHING;
        for forcing in begun {
            charge = charge.and(forcing.finish().await.into());
        }
        charge
    }

    /// Gives `n` of an admission of this limiter back, quota by quota
    /// (each at most what it took), once (a reservation settles once);
    /// returns the permits given back.
    pub(super) async fn refund_part(&self, key: Key<'_>, decision: &Decision, n: u64) -> u64 {
        let parts = decision.quotas();
        if n == 0 || decision.limiter != self.id || parts.len() != self.tiers.len() {
            return 0;
        }
        let mut back = 0;
        for (index, part) in parts.iter().enumerate() {
            if self.lane(key, index).quota.period() != part.period() {
                continue;
            }
            let mut taken = part.taken;
            taken.cost = taken.cost.min(n);
            // Into the lease it came from while that lease lasts (no store
            // call: a reservation settled at once costs none), else to
            // its window in the store.
            if !taken.refundable() {
                continue;
            }
            if let Some(local) = self.lane(key, index).give_back_once(&key, taken) {
                self.counters.refunded.add(local);
                back += local;
                continue;
            }
            back += self.refund_taken(key, index, taken).await;
        }
        back
    }
}

impl Limiter {
    /// Counts `cost` against every quota of `key` **whatever is left**:
    /// work already done (tokens a model streamed, bytes sent) that a
    /// denial can no longer prevent. What does not fit is counted past the
    /// limit, a debt the key pays before its next admission: the store
    /// counts it like any admission, so the key's next requests are denied
    /// until its window has room again (a bucket refills past it; a
    /// bucket carries at most one burst of debt, and what lies beyond
    /// that is counted in [`Stats::overshoot`](crate::Stats::overshoot)).
    ///
    /// How it is counted, by mode:
    /// - exact: one store call now; if the store does not answer, or this
    ///   future is dropped first, the charge waits in the limiter and is
    ///   resent by a task of its own, before the limiter's next decision,
    ///   and at its shutdown;
    /// - hybrid: from this process's leased permits first (no store
    ///   call), the rest reported to the store as in exact mode (if it does
    ///   not answer, the background task resends it before any lease it
    ///   asks for);
    /// - local: the per-process count takes it at once.
    ///
    /// Each report carries an identity: one delivered twice (a lost reply,
    /// a retry) counts once. A charge the store has not taken is resent,
    /// backing off, for 50 s: the store remembers an identity for 60 s, so
    /// a later resend could count twice, and the charge is dropped instead
    /// (counted in [`Stats::reports_dropped`](crate::Stats::reports_dropped)).
    /// A cost of 0 charges nothing.
    pub async fn charge(&self, key: &str, cost: u64) -> Charge {
        let kept = local_key(key);
        let key = Key {
            given: key,
            kept: &kept,
        };
        self.inner.charge(key, cost).await
    }

    /// Reserves `estimate` for `key` (see [`Reservation`]); settled later
    /// to the actual cost. [`Reserve`] reserves across several limiters
    /// (tokens per minute and requests per minute, say).
    pub async fn reserve(&self, key: &str, estimate: u64) -> Reservation {
        // One limiter: its own decision, without `check_each`'s bookkeeping
        // (a reservation from a held lease is as cheap as a check).
        let estimate = estimate.max(1);
        let decision = self.check(key, estimate).await;
        Reservation {
            items: vec![Item {
                limiter: self.clone(),
                key: key.to_owned(),
                settles: true,
                beyond: 0,
            }],
            estimate,
            used: 0,
            beyond: 0,
            decision,
            alone: true,
        }
    }
}

/// One limiter of a reservation and the key it is asked for.
#[derive(Debug)]
struct Item {
    limiter: Limiter,
    key: String,
    /// Counts the work's cost (settled); else one permit per request.
    settles: bool,
    /// Charged past the estimate so far.
    beyond: u64,
}

/// A reservation across several limiters, all or nothing: the limiters
/// that count the work's cost (tokens per minute, tokens per day) and
/// those that count requests (one permit each, never settled).
///
/// ```
/// # async fn demo() -> Result<(), slicelimit::Error> {
/// use slicelimit::limiter::Reserve;
/// use slicelimit::{nonzero, Limiter, MemoryStore, Quota};
///
/// let store = MemoryStore::new();
/// let day = std::time::Duration::from_secs(86_400);
/// let tokens = Limiter::builder(Quota::per_minute(nonzero!(10_000)))
///     .and(Quota::new(1_000_000, day)?)
///     .store(store.clone())
///     .namespace("tokens")
///     .build()?;
/// let requests = Limiter::builder(Quota::per_minute(nonzero!(60)))
///     .store(store)
///     .namespace("requests")
///     .build()?;
/// let reservation = Reserve::new()
///     .cost(&tokens, "acme")
///     .request(&requests, "acme")
///     .reserve(1_500)
///     .await;
/// assert!(reservation.is_allowed());
/// reservation.settle(900).await; // 600 tokens go back
/// # Ok(())
/// # }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Debug, Default)]
#[must_use = "a Reserve does nothing until `reserve` is awaited"]
pub struct Reserve {
    items: Vec<Item>,
}

impl Reserve {
    /// An empty reservation (which admits).
    pub fn new() -> Self {
        Reserve::default()
    }

    /// `limiter` counts the work's cost for `key`: it is asked for the
    /// estimate and settled to the actual cost.
    pub fn cost(mut self, limiter: &Limiter, key: &str) -> Self {
        self.push(limiter, key, true);
        self
    }

    /// `limiter` counts requests for `key`: one permit, never settled.
    pub fn request(mut self, limiter: &Limiter, key: &str) -> Self {
        self.push(limiter, key, false);
        self
    }

    fn push(&mut self, limiter: &Limiter, key: &str, settles: bool) {
        self.items.push(Item {
            limiter: limiter.clone(),
            key: key.to_owned(),
            settles,
            beyond: 0,
        });
    }

    /// Asks every limiter at once, all or nothing (as
    /// [`check_each`](crate::limiter::check_each)): `estimate` from those
    /// that count the cost, one from those that count requests. A denial
    /// takes nothing and carries the binding `retry_after`. An estimate
    /// of 0 reserves 1: work of unknown cost is asked for like a request,
    /// never waved through as a look (a key in debt is denied).
    pub async fn reserve(self, estimate: u64) -> Reservation {
        let estimate = estimate.max(1);
        let asks: Vec<(&Limiter, &str, u64)> = self
            .items
            .iter()
            .map(|i| {
                (
                    &i.limiter,
                    i.key.as_str(),
                    if i.settles { estimate } else { 1 },
                )
            })
            .collect();
        let decision = check_each(&asks).await;
        Reservation {
            items: self.items,
            estimate,
            used: 0,
            beyond: 0,
            decision,
            alone: false,
        }
    }
}

/// A cost reserved now at an estimate and settled later to the actual
/// cost: an LLM request's tokens, known when the response has streamed.
///
/// - [`settle`](Reservation::settle) gives back what the estimate
///   over-counted, or charges what it did not cover, even past the
///   limit (see [`Limiter::charge`]);
/// - [`consume`](Reservation::consume) charges as the work goes (a
///   stream's frames): within the estimate it costs nothing more, past it
///   each unit is charged, and the answer says when the key's budget is
///   gone;
/// - **dropped unsettled, a reservation settles at its estimate** (or at
///   what was consumed, if more): nothing goes back. Charges a dropped
///   `consume` or `settle` had not finished are sent from the drop, in a
///   task of its own.
///
/// A denied reservation took nothing; settling it does nothing.
#[derive(Debug)]
#[must_use = "a reservation dropped at once settles at its estimate"]
pub struct Reservation {
    items: Vec<Item>,
    estimate: u64,
    /// Consumed so far.
    used: u64,
    /// Charged past the estimate so far, as decided: each item catches up
    /// to it (`Item::beyond`), from the drop if need be.
    beyond: u64,
    decision: Decision,
    /// One limiter's own decision (its parts are its quotas'), not
    /// `check_each`'s (one part per limiter).
    alone: bool,
}

/// What settling a reservation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Permits given back, summed over the limiters that count the cost
    /// and their quotas.
    pub given_back: u64,
    /// What was charged past what was already counted (per limiter).
    pub charged: u64,
    /// What that charge did.
    pub charge: Charge,
}

impl Reservation {
    /// Whether the reservation was admitted.
    pub fn is_allowed(&self) -> bool {
        self.decision.is_allowed()
    }

    /// The admission decision (its `retry_after` when denied, its
    /// `remaining` and headers when admitted).
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The estimate reserved.
    pub fn estimate(&self) -> u64 {
        self.estimate
    }

    /// What [`consume`](Reservation::consume) counted so far.
    pub fn consumed(&self) -> u64 {
        self.used
    }

    /// `n` more units of the actual cost, as the work goes. Within the
    /// estimate nothing more is counted; past it, each unit is charged to
    /// every limiter that counts the cost, even past the limit. The answer
    /// says whether the key's budget is gone ([`Charge::exhausted`]): a
    /// stream should stop there.
    pub async fn consume(&mut self, n: u64) -> Charge {
        if !self.is_allowed() {
            return Charge::NOTHING;
        }
        self.used = self.used.saturating_add(n);
        self.beyond = self.beyond.max(self.used.saturating_sub(self.estimate));
        self.catch_up().await
    }

    /// Settles at `actual`, the whole cost: what the estimate and the
    /// consumed units counted beyond it goes back (at most the estimate:
    /// what was charged past it stays), what they did not cover is
    /// charged, even past the limit.
    pub async fn settle(mut self, actual: u64) -> Settled {
        if !self.is_allowed() {
            return Settled {
                given_back: 0,
                charged: 0,
                charge: Charge::NOTHING,
            };
        }
        let counted = self.estimate.saturating_add(self.beyond);
        let (charged, charge) = if actual > counted {
            self.beyond = actual - self.estimate;
            (actual - counted, self.catch_up().await)
        } else {
            (0, self.catch_up().await)
        };
        let mut given_back = 0;
        let over = counted.saturating_sub(actual).min(self.estimate);
        if over > 0 {
            let parts = if self.alone {
                vec![self.decision.clone()]
            } else {
                self.decision.quotas().to_vec()
            };
            for (item, part) in self.items.iter().zip(parts) {
                if item.settles {
                    given_back += item.limiter.refund_part(&item.key, &part, over).await;
                }
            }
        }
        Settled {
            given_back,
            charged,
            charge,
        }
    }

    /// Charges every item what it is short of `beyond`, each marked as
    /// charged before its call (a call dropped midway is still counted:
    /// see [`Limiter::charge`]).
    async fn catch_up(&mut self) -> Charge {
        let mut charge = Charge::NOTHING;
        for i in 0..self.items.len() {
            let item = &mut self.items[i];
            if !item.settles || item.beyond >= self.beyond {
                continue;
            }
            let extra = self.beyond - item.beyond;
            item.beyond = self.beyond;
            let (limiter, key) = (item.limiter.clone(), item.key.clone());
            charge = charge.and(limiter.charge(&key, extra).await);
        }
        charge
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.decision.is_allowed() {
            return;
        }
        let owed: Vec<(Limiter, String, u64)> = self
            .items
            .iter()
            .filter(|i| i.settles && i.beyond < self.beyond)
            .map(|i| (i.limiter.clone(), i.key.clone(), self.beyond - i.beyond))
            .collect();
        if owed.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for (limiter, key, extra) in owed {
                    limiter.charge(&key, extra).await;
                }
            });
        }
    }
}

impl Limiter {
    /// Gives `n` of `decision` (an admission of this limiter for `key`)
    /// back; see [`Limiter::refund`].
    async fn refund_part(&self, key: &str, decision: &Decision, n: u64) -> u64 {
        if !decision.is_allowed() {
            return 0;
        }
        let kept = local_key(key);
        let key = Key {
            given: key,
            kept: &kept,
        };
        Quotas::refund_part(&self.inner, key, decision, n).await
    }
}
