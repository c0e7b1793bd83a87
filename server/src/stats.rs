//! The server's own metrics, beside every rule limiter's `slicelimit_*`
//! series. Per rule (labels `domain`, `rule`), in the style of
//! envoyproxy/ratelimit's stats; hits are permits asked for (the
//! request's `hits_addend`), not calls.

use metrics::{describe_counter, describe_gauge, Unit};

/// Hits on a rule.
pub const TOTAL_HITS: &str = "slicelimit_server_total_hits_total";
/// Hits over the limit: answered OVER_LIMIT, or let through by a
/// `shadow_mode` rule (then counted in `SHADOW_MODE` too).
pub const OVER_LIMIT: &str = "slicelimit_server_over_limit_total";
/// Hits admitted with the rule's use past 80 % of its limit.
pub const NEAR_LIMIT: &str = "slicelimit_server_near_limit_total";
/// Hits admitted.
pub const WITHIN_LIMIT: &str = "slicelimit_server_within_limit_total";
/// Hits a `shadow_mode` rule answered OK but would have denied.
pub const SHADOW_MODE: &str = "slicelimit_server_shadow_mode_total";
/// Requests over a limit let through by the global shadow mode
/// (`SHADOW_MODE`), by `domain`.
pub const GLOBAL_SHADOW_MODE: &str = "slicelimit_server_global_shadow_mode_total";
/// `ShouldRateLimit` calls, by `result`: `ok`, `over_limit`, `error`.
pub const CALLS: &str = "slicelimit_server_calls_total";
/// Descriptors whose own `limit` could not be honoured (an unknown
/// unit, a limit the rule's algorithm cannot count): the rule's limit
/// applied instead.
pub const OVERRIDES_IGNORED: &str = "slicelimit_server_overrides_ignored_total";
/// Live limiters of requests' own `limit`s, by `domain`.
pub const OVERRIDES_LIVE: &str = "slicelimit_server_overrides_live";
/// Settlements of reservations (`slicelimit_settle`), by `outcome`:
/// `charged` (the work cost more than reserved), `refunded` (less, given
/// back), `expired` (less, but its window had ended), `exact`, `again`
/// (settled before: nothing), `unreserved` (no reservation found, or two
/// under one identity: charged in full).
pub const SETTLEMENTS: &str = "slicelimit_server_settlements_total";
/// Reservations (`slicelimit_reserve`) of passing requests, by `result`:
/// `kept` for their settlement, `duplicate` (another request's was kept
/// under the same identity: both settle unreserved), `failed` (the store
/// did not answer).
pub const RESERVATIONS: &str = "slicelimit_server_reservations_total";
/// Configuration loads, by `result`: `ok` or `error`.
pub const CONFIG_LOADS: &str = "slicelimit_server_config_loads_total";
/// 1 while the configuration on disk fails to load (the last good one
/// is in use), else 0.
pub const CONFIG_FAILING: &str = "slicelimit_server_config_failing";
/// Rules in the configuration in use.
pub const RULES: &str = "slicelimit_server_rules";

/// Requests Envoys reported on an RLQS rule's buckets, by `outcome`:
/// `allowed` or `denied`.
pub const RLQS_REPORTED: &str = "slicelimit_server_rlqs_reported_requests_total";
/// Requests Envoys' assignments allowed (their reach over time) in the
/// report intervals an assignment covered from start to end, an RLQS
/// rule's buckets summed.
pub const RLQS_ALLOWANCE: &str = "slicelimit_server_rlqs_allowance_requests_total";
/// Requests an Envoy reported allowed in such an interval beyond its
/// allowance and a bucket's tokens, an RLQS rule's buckets summed: 0
/// unless an Envoy admits more than it is assigned.
pub const RLQS_EXCESS: &str = "slicelimit_server_rlqs_excess_requests_total";
/// The rate (requests per period) this replica has assigned to its Envoys
/// on an RLQS rule's buckets, summed.
pub const RLQS_ASSIGNED: &str = "slicelimit_server_rlqs_assigned_rate";
/// The rate this replica holds in the store for an RLQS rule's buckets.
pub const RLQS_HELD: &str = "slicelimit_server_rlqs_held_rate";
/// RLQS stream messages, by `direction`: `received` (usage reports) or
/// `sent` (assignments).
pub const RLQS_MESSAGES: &str = "slicelimit_server_rlqs_messages_total";
/// Envoys connected over RLQS.
pub const RLQS_STREAMS: &str = "slicelimit_server_rlqs_streams";

pub(crate) fn rlqs_reported(
    domain: &str,
    rule: &str,
    usage: &envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage,
    allowance: Option<(f64, u64)>,
) {
    let labels = |outcome: &'static str| {
        [
            ("domain", domain.to_owned()),
            ("rule", rule.to_owned()),
            ("outcome", outcome.to_owned()),
        ]
    };
    metrics::counter!(RLQS_REPORTED, &labels("allowed")).increment(usage.num_requests_allowed);
    metrics::counter!(RLQS_REPORTED, &labels("denied")).increment(usage.num_requests_denied);
    if let Some((allowance, tokens)) = allowance {
        let labels = [("domain", domain.to_owned()), ("rule", rule.to_owned())];
        metrics::counter!(RLQS_ALLOWANCE, &labels).increment(allowance.floor() as u64);
        let excess = usage.num_requests_allowed as f64 - allowance.ceil() - tokens as f64;
        if excess > 0.0 {
            metrics::counter!(RLQS_EXCESS, &labels).increment(excess as u64);
        }
    }
}

pub(crate) fn rlqs_assigned(domain: &str, rule: &str, assigned: u64, held: u64) {
    let labels = [("domain", domain.to_owned()), ("rule", rule.to_owned())];
    metrics::gauge!(RLQS_ASSIGNED, &labels).set(assigned as f64);
    metrics::gauge!(RLQS_HELD, &labels).set(held as f64);
}

pub(crate) fn rlqs_message(direction: &'static str) {
    metrics::counter!(RLQS_MESSAGES, "direction" => direction).increment(1);
}

pub(crate) fn rlqs_streams(change: f64) {
    metrics::gauge!(RLQS_STREAMS).increment(change);
}

/// Describes the server's metrics to the installed recorder.
pub fn describe() {
    describe_counter!(
        TOTAL_HITS,
        Unit::Count,
        "Hits (permits asked for) on a rule."
    );
    describe_counter!(OVER_LIMIT, Unit::Count, "Hits a rule denied.");
    describe_counter!(
        SETTLEMENTS,
        Unit::Count,
        "Settlements of reservations, by outcome."
    );
    describe_counter!(
        RESERVATIONS,
        Unit::Count,
        "Reservations kept for their settlement."
    );
    describe_counter!(
        NEAR_LIMIT,
        Unit::Count,
        "Hits a rule admitted past 80% of its limit."
    );
    describe_counter!(WITHIN_LIMIT, Unit::Count, "Hits a rule admitted.");
    describe_counter!(
        SHADOW_MODE,
        Unit::Count,
        "Hits a shadow_mode rule admitted but would have denied."
    );
    describe_counter!(
        GLOBAL_SHADOW_MODE,
        Unit::Count,
        "Requests over a limit let through by the global shadow mode."
    );
    describe_counter!(CALLS, Unit::Count, "ShouldRateLimit calls, by result.");
    describe_counter!(
        OVERRIDES_IGNORED,
        Unit::Count,
        "Descriptors whose own limit was ignored (the rule's applied)."
    );
    describe_gauge!(
        OVERRIDES_LIVE,
        Unit::Count,
        "Live limiters of requests' own limits, by domain."
    );
    describe_counter!(CONFIG_LOADS, Unit::Count, "Configuration loads, by result.");
    describe_gauge!(
        CONFIG_FAILING,
        "1 while the configuration on disk fails to load and the last good one is in use."
    );
    describe_gauge!(RULES, "Rules in the configuration in use.");
    describe_counter!(
        RLQS_REPORTED,
        Unit::Count,
        "Requests Envoys reported on an RLQS rule's buckets, by outcome."
    );
    describe_gauge!(
        RLQS_ASSIGNED,
        "Rate (requests per period) assigned to this replica's Envoys on an RLQS rule, summed."
    );
    describe_gauge!(
        RLQS_HELD,
        "Rate this replica holds in the store for an RLQS rule."
    );
    describe_counter!(
        RLQS_MESSAGES,
        Unit::Count,
        "RLQS stream messages, by direction."
    );
    describe_gauge!(RLQS_STREAMS, "Envoys connected over RLQS.");
    describe_counter!(
        RLQS_ALLOWANCE,
        Unit::Count,
        "Requests Envoys' RLQS assignments allowed over the intervals they reported on."
    );
    describe_counter!(
        RLQS_EXCESS,
        Unit::Count,
        "Requests Envoys reported allowed beyond their RLQS assignments."
    );
}
