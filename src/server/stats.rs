//! The server's own metrics, beside every rule limiter's `slicelimit_*`
//! series. Per rule (labels `domain`, `rule`), in the style of
//! envoyproxy/ratelimit's stats; hits are permits asked for (the
//! request's `hits_addend`), not calls.

use metrics::{describe_counter, describe_gauge, Unit};

/// Hits on a rule.
pub const TOTAL_HITS: &str = "slicelimit_server_total_hits_total";
/// Hits denied (answered OVER_LIMIT).
pub const OVER_LIMIT: &str = "slicelimit_server_over_limit_total";
/// Hits admitted with the rule's use past 80 % of its limit.
pub const NEAR_LIMIT: &str = "slicelimit_server_near_limit_total";
/// Hits admitted.
pub const WITHIN_LIMIT: &str = "slicelimit_server_within_limit_total";
/// Hits a `shadow_mode` rule answered OK but would have denied.
pub const SHADOW_MODE: &str = "slicelimit_server_shadow_mode_total";
/// `ShouldRateLimit` calls, by `result`: `ok`, `over_limit`, `error`.
pub const CALLS: &str = "slicelimit_server_calls_total";
/// Configuration loads, by `result`: `ok` or `error`.
pub const CONFIG_LOADS: &str = "slicelimit_server_config_loads_total";
/// 1 while the configuration on disk fails to load (the last good one
/// is in use), else 0.
pub const CONFIG_FAILING: &str = "slicelimit_server_config_failing";
/// Rules in the configuration in use.
pub const RULES: &str = "slicelimit_server_rules";

/// Describes the server's metrics to the installed recorder.
pub fn describe() {
    describe_counter!(
        TOTAL_HITS,
        Unit::Count,
        "Hits (permits asked for) on a rule."
    );
    describe_counter!(OVER_LIMIT, Unit::Count, "Hits a rule denied.");
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
    describe_counter!(CALLS, Unit::Count, "ShouldRateLimit calls, by result.");
    describe_counter!(CONFIG_LOADS, Unit::Count, "Configuration loads, by result.");
    describe_gauge!(
        CONFIG_FAILING,
        "1 while the configuration on disk fails to load and the last good one is in use."
    );
    describe_gauge!(RULES, "Rules in the configuration in use.");
}
