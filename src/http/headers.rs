//! Header values and problem bodies, formatted once per response.
//!
//! `RateLimit-Policy` and `RateLimit` follow
//! draft-ietf-httpapi-ratelimit-headers-11: Structured-Field lists whose
//! items are the policy name (an sf-string) with parameters `q` (quota) and
//! `w` (window, seconds), or `r` (remaining) and `t` (seconds until reset).
//! `Retry-After` is whole seconds rounded up, never 0 while denied.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::{Decision, Quota};

/// `RateLimit-Policy`.
pub const RATELIMIT_POLICY: &str = "ratelimit-policy";
/// `RateLimit`.
pub const RATELIMIT: &str = "ratelimit";
/// The problem type of a 429 body.
pub const PROBLEM_TYPE: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// An sf-string: quoted, with `"` and `\` escaped; other characters outside
/// visible ASCII are replaced, since sf-strings cannot carry them.
pub(crate) fn sf_string(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len() + 2);
    out.push('"');
    for c in raw.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

/// The headers every response of a limited route carries.
pub(crate) struct PolicyHeaders {
    /// `"name";q=100;w=60`, formatted once.
    policy: HeaderValue,
    name: String,
    legacy: bool,
}

impl PolicyHeaders {
    pub(crate) fn new(name: &str, quota: &Quota, legacy: bool) -> Self {
        let value = format!(
            "{};q={};w={}",
            sf_string(name),
            quota.limit(),
            ceil_secs(quota.period()).max(1)
        );
        PolicyHeaders {
            policy: HeaderValue::from_str(&value)
                .unwrap_or_else(|_| HeaderValue::from_static("\"default\"")),
            name: sf_string(name),
            legacy,
        }
    }

    /// Adds `RateLimit-Policy`, `RateLimit` and (optionally) the legacy
    /// `X-RateLimit-*` headers for `decision`.
    pub(crate) fn apply(&self, headers: &mut HeaderMap, decision: &Decision) {
        let reset = ceil_secs(decision.reset_after());
        headers.insert(
            HeaderName::from_static(RATELIMIT_POLICY),
            self.policy.clone(),
        );
        let value = format!("{};r={};t={}", self.name, decision.remaining(), reset);
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(RATELIMIT), value);
        }
        if self.legacy {
            headers.insert("x-ratelimit-limit", HeaderValue::from(decision.limit()));
            headers.insert(
                "x-ratelimit-remaining",
                HeaderValue::from(decision.remaining()),
            );
            headers.insert("x-ratelimit-reset", HeaderValue::from(reset));
        }
        if !decision.is_allowed() {
            if let Some(wait) = decision.retry_after() {
                headers.insert(
                    http::header::RETRY_AFTER,
                    HeaderValue::from(ceil_secs(wait).max(1)),
                );
            }
        }
    }

    /// A problem+json body for a denial.
    pub(crate) fn problem(&self, decision: &Decision) -> String {
        let detail = match decision.retry_after() {
            Some(wait) => format!("retry in {} s", ceil_secs(wait).max(1)),
            None => "the request costs more than the quota allows".to_owned(),
        };
        format!(
            "{{\"type\":\"{PROBLEM_TYPE}\",\"title\":\"Request cannot be satisfied as assigned quota has been exceeded\",\"status\":429,\"detail\":\"{detail}\",\"violated-policies\":[{}]}}",
            self.name
        )
    }
}

/// A problem+json body for a request without a key.
pub(crate) fn missing_key_problem(status: http::StatusCode) -> String {
    format!(
        "{{\"title\":\"no rate-limit key in the request\",\"status\":{}}}",
        status.as_u16()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(ceil_secs(Duration::from_millis(300)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
        assert_eq!(ceil_secs(Duration::from_millis(2_001)), 3);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }

    #[test]
    fn policy_names_are_valid_sf_strings() {
        assert_eq!(sf_string("default"), "\"default\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("é"), "\"_\"");
    }
}
