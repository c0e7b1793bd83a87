//! What a request is answered: each descriptor's status, and the response
//! headers for the one nearest its limit.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use slicelimit::Decision;

use super::Counted;

/// The names of the response headers that tell a client its limit, what
/// is left and when it resets (envoyproxy/ratelimit's
/// `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNames {
    /// The limit's header.
    pub limit: String,
    /// The header telling what is left.
    pub remaining: String,
    /// The header telling the seconds to the reset.
    pub reset: String,
}

impl Default for HeaderNames {
    /// The reference's: `RateLimit-Limit`, `RateLimit-Remaining`,
    /// `RateLimit-Reset`.
    fn default() -> HeaderNames {
        HeaderNames {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// The headers for the status nearest its limit: the last one over it,
/// else the one with the fewest left (the first of equals), among those
/// that tell a limit; none if no status does.
pub(super) fn headers_for(names: &HeaderNames, statuses: &[DescriptorStatus]) -> Vec<HeaderValue> {
    let limited = || statuses.iter().filter(|s| s.current_limit.is_some());
    let nearest = limited()
        .rev()
        .find(|s| s.code == Code::OverLimit as i32)
        .or_else(|| limited().min_by_key(|s| s.limit_remaining));
    let Some(status) = nearest else {
        return Vec::new();
    };
    let limit = status
        .current_limit
        .as_ref()
        .map_or(0, |l| l.requests_per_unit);
    let reset = status
        .duration_until_reset
        .as_ref()
        .map_or(0, |d| d.seconds);
    let header = |key: &str, value: String| HeaderValue {
        key: key.to_owned(),
        value,
        ..Default::default()
    };
    vec![
        header(&names.limit, limit.to_string()),
        header(&names.remaining, status.limit_remaining.to_string()),
        header(&names.reset, reset.to_string()),
    ]
}

pub(super) fn unit_of(period: Duration) -> Unit {
    match period.as_secs() {
        1 => Unit::Second,
        60 => Unit::Minute,
        3_600 => Unit::Hour,
        86_400 => Unit::Day,
        604_800 => Unit::Week,
        2_592_000 => Unit::Month,
        31_536_000 => Unit::Year,
        _ => Unit::Unknown,
    }
}

/// A descriptor's status: its limit, what is left and when it resets, so
/// Envoy's `x-ratelimit-*` headers tell what happened.
pub(super) fn status(plan: &Counted, decision: &Decision, denied: bool) -> DescriptorStatus {
    let reset = decision.reset_after();
    let limiter_quota = plan.limiter.quota();
    DescriptorStatus {
        code: if denied { Code::OverLimit } else { Code::Ok } as i32,
        current_limit: Some(RateLimit {
            name: plan.rule.rule.name.clone().unwrap_or_default(),
            requests_per_unit: u32::try_from(limiter_quota.limit()).unwrap_or(u32::MAX),
            unit: unit_of(limiter_quota.period()) as i32,
        }),
        limit_remaining: u32::try_from(decision.remaining()).unwrap_or(u32::MAX),
        // Whole seconds, rounded up: Envoy's `x-ratelimit-reset` header
        // drops the fraction, and a client told 0 in a window's last
        // second would be denied again if it came back at once.
        duration_until_reset: Some(ProtoDuration {
            seconds: i64::try_from(reset.as_secs() + u64::from(reset.subsec_nanos() > 0))
                .unwrap_or(i64::MAX),
            nanos: 0,
        }),
        quota: None,
    }
}

/// Of `hits` just admitted by `decision`, those past 80 % of its limit
/// (the threshold rounded down, as envoyproxy/ratelimit's near-limit
/// count): all of them when the count was past it before, else the part
/// beyond it.
pub(super) fn near_limit_hits(decision: &Decision, hits: u64) -> u64 {
    let limit = decision.limit();
    let threshold = limit.saturating_mul(4) / 5;
    let after = limit.saturating_sub(decision.remaining());
    let before = after.saturating_sub(hits);
    after.saturating_sub(before.max(threshold))
}
