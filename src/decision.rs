//! The answer to "may this request proceed?", with what HTTP headers need.
//!
//! Times are exact to the microsecond here; rounding to whole seconds is the
//! HTTP layer's business.

use std::sync::Arc;
use std::time::Duration;

/// Where a [`Decision`] came from, so callers and metrics can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// One call to the shared store decided (exact limiter, or a hybrid key
    /// that had to be decided by the store).
    Store,
    /// A permit leased earlier from the store, spent locally.
    Lease,
    /// Admitted on credit while a refill was in flight (optimistic hybrid).
    Credit,
    /// Denied locally: the store said the key is exhausted until a known time.
    DeniedCache,
    /// The per-process limiter (`local()` mode).
    Local,
    /// The store was unavailable and the policy is fail-open.
    FailOpen,
    /// The store was unavailable and the policy is fail-closed.
    FailClosed,
    /// The store was unavailable and a per-process fallback quota decided.
    Fallback,
}

impl Source {
    /// A short, stable name, usable as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Store => "store",
            Source::Lease => "lease",
            Source::Credit => "credit",
            Source::DeniedCache => "denied_cache",
            Source::Local => "local",
            Source::FailOpen => "fail_open",
            Source::FailClosed => "fail_closed",
            Source::Fallback => "fallback",
        }
    }
}

/// The outcome of one [`Limiter::check`](crate::Limiter::check).
///
/// A denial is a decision, never an error.
///
/// A limiter with several quotas ([`Builder::and`](crate::Builder::and))
/// answers with the binding one's figures (the lowest remaining, the
/// longest wait) and keeps each quota's own in [`quotas`](Decision::quotas).
#[derive(Debug, Clone, PartialEq, Eq)]
// Kept small (times in µs, one pointer for the parts): a decision is
// returned by value on the request path, and past a few cache lines every
// move is a call to memmove. `repr(C)`: fields in declared order, the
// small ones last, so a move copies whole words; the reordered layout made
// every move on the request path an unaligned copy of an odd-sized tail
// that stalled on the stores just before it (a tenth of a decision).
#[repr(C)]
pub struct Decision {
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    reset_us: u64,
    /// `NEVER`: no retry can succeed (or allowed).
    retry_us: u64,
    /// The quota's period, for headers (0 where unknown).
    period_us: u64,
    /// What was taken, so a refund can find where it came from.
    pub(crate) taken: Taken,
    /// Several quotas: each one's decision, in the limiter's order.
    pub(crate) parts: Option<Arc<Vec<Decision>>>,
    /// The limiter that decided (0: none yet), so another cannot refund it.
    pub(crate) limiter: u32,
    pub(crate) allowed: bool,
    pub(crate) source: Source,
}

/// `retry_us` of a decision with no `retry_after`.
const NEVER: u64 = u64::MAX;

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX - 1)
}

/// Where an admission's permits came from, for [`Limiter::refund`](crate::Limiter::refund).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Origin {
    /// Nothing refundable: a denial, a peek, credit, a failure policy's
    /// decision, or a bucket (which refills by itself).
    #[default]
    None,
    /// Counted by the store in this window.
    Store,
    /// Spent from a lease of this window.
    Lease,
    /// Counted by the per-process limiter in this window.
    Local,
}

/// What a decision took: `cost` permits of window `window` from `origin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub(crate) struct Taken {
    pub(crate) cost: u64,
    pub(crate) window: i64,
    /// The admission's identity (with this process's nonce): its refund
    /// counts once.
    pub(crate) seq: u64,
    /// How long the window lasted after the decision, ms, rounded down, by
    /// the store's clock (`Origin::Store`; 0 otherwise).
    lasts_ms: u32,
    pub(crate) origin: Origin,
}

impl Taken {
    /// `cost` permits of `window`, from `origin`: refundable when both are
    /// known and something was taken.
    pub(crate) fn new(origin: Origin, cost: u64, window: Option<i64>) -> Taken {
        match window {
            Some(window) if cost > 0 => Taken {
                origin,
                cost,
                window,
                lasts_ms: 0,
                seq: crate::algorithm::admission_seq(),
            },
            _ => Taken::default(),
        }
    }

    /// The same, with the time its window lasted after the decision.
    pub(crate) fn lasting(mut self, lasts: Duration) -> Taken {
        self.lasts_ms = u32::try_from(lasts.as_millis()).unwrap_or(u32::MAX);
        self
    }

    /// How long the window lasted after the decision (rounded down).
    pub(crate) fn lasts(&self) -> Duration {
        Duration::from_millis(u64::from(self.lasts_ms))
    }

    /// The admission's identity, for the store.
    pub(crate) fn op(&self) -> Option<crate::algorithm::OpId> {
        self.refundable()
            .then(|| crate::algorithm::OpId::admission(self.seq))
    }

    pub(crate) fn refundable(&self) -> bool {
        self.origin != Origin::None
    }
}

impl Decision {
    #[inline(always)]
    pub(crate) fn allow(limit: u64, remaining: u64, reset_after: Duration, source: Source) -> Self {
        Decision {
            allowed: true,
            limit,
            remaining,
            reset_us: micros(reset_after),
            retry_us: NEVER,
            source,
            period_us: 0,
            taken: Taken::default(),
            limiter: 0,
            parts: None,
        }
    }

    pub(crate) fn deny(
        limit: u64,
        remaining: u64,
        reset_after: Duration,
        retry_after: Option<Duration>,
        source: Source,
    ) -> Self {
        Decision {
            allowed: false,
            limit,
            remaining,
            reset_us: micros(reset_after),
            retry_us: retry_after.map_or(NEVER, micros),
            source,
            period_us: 0,
            taken: Taken::default(),
            limiter: 0,
            parts: None,
        }
    }

    /// The same decision, recording what it took.
    #[inline(always)]
    pub(crate) fn with_taken(mut self, taken: Taken) -> Self {
        if self.allowed {
            self.taken = taken;
        }
        self
    }

    /// The same decision, with its quota's period.
    #[inline(always)]
    pub(crate) fn with_period(mut self, period: Duration) -> Self {
        self.period_us = micros(period);
        self
    }

    /// Whether the request may proceed.
    pub fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// The quota's limit (permits per period).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Permits left. For the exact limiter this is the store's count after
    /// this request; for a hybrid limiter it is what this process still
    /// holds plus what the store last reported as unleased.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Time until the quota is whole again: the end of the current window
    /// (fixed window) or until the bucket is full (token bucket, GCRA).
    pub fn reset_after(&self) -> Duration {
        Duration::from_micros(self.reset_us)
    }

    /// When denied, how long to wait before the same request can succeed.
    /// `None` when allowed, and when it can never succeed (the cost exceeds
    /// the limit or burst).
    pub fn retry_after(&self) -> Option<Duration> {
        (self.retry_us != NEVER).then(|| Duration::from_micros(self.retry_us))
    }

    /// Where the decision came from.
    pub fn source(&self) -> Source {
        self.source
    }

    /// The quota's period (`ZERO` for a decision not made against a
    /// quota: a failure policy's fail-open or fail-closed).
    pub fn period(&self) -> Duration {
        Duration::from_micros(self.period_us)
    }

    /// Each quota's own decision, in the order the limiter's quotas were
    /// given (a limiter with one quota: this decision alone). When several
    /// quotas were checked, this decision is the binding one: denied if
    /// any denied (with the longest `retry_after` of those that did),
    /// else the lowest `remaining`.
    pub fn quotas(&self) -> &[Decision] {
        match &self.parts {
            Some(parts) => parts,
            None => std::slice::from_ref(self),
        }
    }

    /// Whether [`Limiter::refund`](crate::Limiter::refund) can give this
    /// decision's permits back: it admitted a cost above 0 from a window
    /// (fixed or sliding) this process or the store counted.
    pub fn is_refundable(&self) -> bool {
        self.quotas().iter().any(|d| d.taken.refundable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request path returns decisions by value: past this size each
    /// move becomes a memmove call (the hot path took 3× as long at 170
    /// bytes).
    #[test]
    fn a_decision_stays_small() {
        assert!(
            std::mem::size_of::<Decision>() <= 96,
            "{}",
            std::mem::size_of::<Decision>()
        );
    }
}
