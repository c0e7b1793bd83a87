//! What a limiter does when its store cannot answer.
//!
//! The policy turns "could not decide" into a [`Decision`]; this module owns
//! that mapping and the per-process fallback limiter. It never talks to the
//! store itself.

use std::time::Duration;

use crate::decision::Source;
use crate::local::LocalEngine;
use crate::{Algorithm, Clock, Decision, Error, Quota};

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

/// Applies a [`FailurePolicy`].
pub(crate) struct FailureHandler {
    policy: FailurePolicy,
    /// The per-process limiter behind `LocalFallback`.
    fallback: Option<LocalEngine>,
    limit: u64,
}

impl FailureHandler {
    pub(crate) fn new(
        policy: FailurePolicy,
        algorithm: Algorithm,
        limit: u64,
        clock: std::sync::Arc<dyn Clock>,
    ) -> Result<Self, Error> {
        let fallback = match policy {
            FailurePolicy::LocalFallback(quota) => {
                quota
                    .validate()
                    .map_err(|e| Error::invalid(format!("LocalFallback quota: {e}")))?;
                Some(LocalEngine::new(quota, algorithm, clock, Source::Fallback))
            }
            _ => None,
        };
        Ok(FailureHandler {
            policy,
            fallback,
            limit,
        })
    }

    pub(crate) fn policy(&self) -> FailurePolicy {
        self.policy
    }

    /// The decision for a request the store could not decide.
    /// `retry_hint` is when the store will next be tried, if known.
    pub(crate) fn decide(&self, key: &str, cost: u64, retry_hint: Option<Duration>) -> Decision {
        match (&self.policy, &self.fallback) {
            (FailurePolicy::LocalFallback(_), Some(local)) => local.check(key, cost),
            (FailurePolicy::FailClosed, _) => Decision::deny(
                self.limit,
                0,
                retry_hint.unwrap_or(FAIL_CLOSED_RETRY),
                Some(retry_hint.unwrap_or(FAIL_CLOSED_RETRY)),
                Source::FailClosed,
            ),
            _ => Decision::allow(
                self.limit,
                self.limit.saturating_sub(cost),
                Duration::ZERO,
                Source::FailOpen,
            ),
        }
    }
}
