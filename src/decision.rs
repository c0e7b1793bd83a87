//! The answer to "may this request proceed?", with what HTTP headers need.
//!
//! Times are exact to the microsecond here; rounding to whole seconds is the
//! HTTP layer's business.

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub(crate) allowed: bool,
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) reset_after: Duration,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) source: Source,
}

impl Decision {
    pub(crate) fn allow(limit: u64, remaining: u64, reset_after: Duration, source: Source) -> Self {
        Decision {
            allowed: true,
            limit,
            remaining,
            reset_after,
            retry_after: None,
            source,
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
            reset_after,
            retry_after,
            source,
        }
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
        self.reset_after
    }

    /// When denied, how long to wait before the same request can succeed.
    /// `None` when allowed, and when it can never succeed (the cost exceeds
    /// the limit or burst).
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Where the decision came from.
    pub fn source(&self) -> Source {
        self.source
    }
}
