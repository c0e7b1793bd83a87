//! The failure policy: what to decide for a request the store could not
//! decide. Pure: a policy, the request and what is known of the store in,
//! a [`Decision`] out.

use std::time::Duration;

use crate::decision::Decision;
use crate::decision::Source;
use crate::local::LocalEngine;
use crate::quota::Quota;

/// What to decide while the store is unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit every request. The usual choice for general traffic: the
    /// limiter must not become the outage. The default.
    #[default]
    FailOpen,
    /// Deny every request. For routes where over-admission is worse than
    /// unavailability (logins, payments, expensive jobs).
    FailClosed,
    /// Decide with a per-process limiter of this quota. Choose about
    /// `limit / expected_instances`, so the fleet together stays near the
    /// real limit.
    LocalFallback(Quota),
}

/// How long a fail-closed denial tells the caller to wait, when nothing
/// better is known.
pub(crate) const FAIL_CLOSED_RETRY: Duration = Duration::from_secs(1);

/// The decision under `policy` for a request the store could not decide.
/// `fallback`: the per-process limiter of `LocalFallback`; `retry_hint`:
/// when the store will next be tried, if known.
pub(crate) fn decide(
    policy: FailurePolicy,
    limit: u64,
    fallback: Option<&LocalEngine>,
    key: &str,
    cost: u64,
    retry_hint: Option<Duration>,
) -> Decision {
    match (policy, fallback) {
        (FailurePolicy::LocalFallback(_), Some(local)) => local.check(key, cost),
        // A peek takes nothing: it is answered under every policy.
        // (Fail-open's remaining is not known; fail-closed's is 0.)
        (FailurePolicy::FailClosed, _) if cost == 0 => {
            Decision::allow(limit, 0, Duration::ZERO, Source::FailClosed)
        }
        (FailurePolicy::FailClosed, _) => {
            let retry = retry_hint.unwrap_or(FAIL_CLOSED_RETRY);
            Decision::deny(limit, 0, retry, Some(retry), Source::FailClosed)
        }
        _ => Decision::allow(
            limit,
            limit.saturating_sub(cost),
            Duration::ZERO,
            Source::FailOpen,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peeks_are_answered_under_every_policy_and_costs_follow_it() {
        let open = decide(FailurePolicy::FailOpen, 10, None, "k", 0, None);
        assert!(open.is_allowed() && open.remaining() == 10);
        let peek = decide(FailurePolicy::FailClosed, 10, None, "k", 0, None);
        assert!(peek.is_allowed() && peek.remaining() == 0);
        let hint = Some(Duration::from_millis(300));
        let closed = decide(FailurePolicy::FailClosed, 10, None, "k", 3, hint);
        assert!(!closed.is_allowed());
        assert_eq!(closed.retry_after(), hint);
        let open = decide(FailurePolicy::FailOpen, 10, None, "k", 3, None);
        assert_eq!((open.is_allowed(), open.remaining()), (true, 7));
    }
}
