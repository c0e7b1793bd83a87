//! What a descriptor asks for: the key its rule counts it under, and the
//! limit it brings of its own.

use std::time::Duration;

use crate::config::Rule;
use slicelimit::Quota;

/// The limiter key of a descriptor: its values, each prefixed with its
/// length so that no two descriptors of one rule share a key (the keys of
/// the entries are the rule's own, the same for all).
pub(super) fn key_of(entries: &[(&str, &str)], rule: &Rule) -> String {
    // A wildcard with `share_threshold` counts every value it matches as
    // its pattern: one count for them all.
    let shared: Vec<(&str, &str)> = entries
        .iter()
        .enumerate()
        .map(
            |(i, &(name, value))| match rule.levels.get(i).and_then(|l| l.shared.as_deref()) {
                Some(pattern) => (name, pattern),
                None => (name, value),
            },
        )
        .collect();
    key_from(&shared, false)
}

/// The limiter key of a descriptor that no rule reaches (its own
/// `limit` counts it): its entries' names and values, each prefixed
/// with its length.
pub(super) fn key_with_names(entries: &[(&str, &str)]) -> String {
    key_from(entries, true)
}

fn key_from(entries: &[(&str, &str)], names: bool) -> String {
    let mut key = String::new();
    for (name, value) in entries {
        if names {
            key.push_str(&name.len().to_string());
            key.push(':');
            key.push_str(name);
            key.push('=');
        }
        key.push_str(&value.len().to_string());
        key.push(':');
        key.push_str(value);
        key.push(';');
    }
    key
}

/// What a descriptor's own `limit` asks for.
pub(super) enum OverrideLimit {
    Quota(Quota),
    /// `requests_per_unit: 0`: every request over the limit, as a rule of
    /// 0 blocks (the unit, told back).
    Blocks(Duration),
}

/// The limit a descriptor's own `limit` asks for.
pub(super) fn override_limit(requests: u32, unit: i32) -> Result<OverrideLimit, slicelimit::Error> {
    use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
    let name = match RateLimitUnit::try_from(unit) {
        Ok(RateLimitUnit::Unknown) | Err(_) => None,
        Ok(known) => Some(known.as_str_name()),
    };
    let Some(period) = name.and_then(crate::config::unit_period) else {
        return Err(slicelimit::Error::invalid(format!(
            "unit {unit}: one of SECOND, MINUTE, HOUR, DAY, MONTH, YEAR"
        )));
    };
    if requests == 0 {
        return Ok(OverrideLimit::Blocks(period));
    }
    Quota::new(u64::from(requests), period).map(OverrideLimit::Quota)
}
