//! Header values and problem bodies.
//!
//! `RateLimit-Policy` and `RateLimit` follow
//! draft-ietf-httpapi-ratelimit-headers-11: Structured-Field lists whose
//! items are the policy name (an sf-string) with parameters `q` (quota) and
//! `w` (window, seconds), or `r` (remaining) and `t` (seconds until the
//! client can expect quota again). Items are appended, never replaced, so
//! stacked layers, several policies and a handler's own items make one
//! list. `Retry-After` is whole seconds rounded up, never 0 while denied.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use slicelimit::{Decision, Quota, Source};

/// `RateLimit-Policy`.
pub const RATELIMIT_POLICY: &str = "ratelimit-policy";
/// `RateLimit`.
pub const RATELIMIT: &str = "ratelimit";
/// The problem type of a 429 body.
pub const PROBLEM_TYPE: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";
/// The problem type of a 503 body, when the limiter cannot decide and its
/// policy is to fail closed.
pub const PROBLEM_TYPE_UNAVAILABLE: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";
/// The problem type of an [`InFlightLayer`](crate::InFlightLayer) 429
/// body: every slot of the key is in flight. Not a quota, so not IANA's
/// `quota-exceeded`, and no registered type says "too many at once":
/// the URI names this crate's own documentation of it (the crate
/// root's "Too many in flight" section), in the same `page#name` form.
pub const PROBLEM_TYPE_IN_FLIGHT: &str =
    "https://docs.rs/slicelimit-tower/latest/slicelimit_tower/index.html#too-many-in-flight";

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// An sf-string: quoted, with `"` and `\` escaped; other characters outside
/// visible ASCII are replaced, since sf-strings cannot carry them. The
/// result is a valid JSON string too.
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

/// When a denied request may be retried, whole seconds (at least 1);
/// `None` if it never can.
pub(crate) fn retry_secs(decision: &Decision) -> Option<u64> {
    decision.retry_after().map(|wait| ceil_secs(wait).max(1))
}

/// The rate-limit headers of one policy: its name and quota formatted
/// once, then one call per decision.
///
/// The layer uses this for every response; use it to send the same
/// headers when you call [`Limiter::check`](slicelimit::Limiter::check)
/// yourself:
///
/// ```
/// # async fn demo() {
/// use slicelimit_tower::PolicyHeaders;
/// use slicelimit::{nonzero, Limiter, MemoryStore, Quota};
///
/// let limiter = Limiter::builder(Quota::per_minute(nonzero!(10)))
///     .store(MemoryStore::new())
///     .build()
///     .unwrap();
/// let headers = PolicyHeaders::new("search", &limiter.quota());
/// let decision = limiter.check("alice", 1).await;
/// let mut response = http::Response::new(());
/// headers.append_to(response.headers_mut(), &decision);
/// assert!(response.headers().contains_key("ratelimit"));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PolicyHeaders {
    /// `"name";q=100;w=60`.
    policy: HeaderValue,
    /// The name as an sf-string (also a JSON string).
    quoted: String,
    name: String,
    legacy: bool,
    /// The quota `policy` was formatted for.
    limit: u64,
    period: Duration,
}

impl PolicyHeaders {
    /// The headers of the policy `name` enforcing `quota`.
    pub fn new(name: &str, quota: &Quota) -> Self {
        let quoted = sf_string(name);
        let value = format!(
            "{quoted};q={};w={}",
            quota.limit(),
            ceil_secs(quota.period()).max(1)
        );
        PolicyHeaders {
            // sf_string leaves only visible ASCII, so this cannot fail.
            policy: HeaderValue::from_str(&value)
                .unwrap_or_else(|_| HeaderValue::from_static("\"default\"")),
            quoted,
            name: name.to_owned(),
            legacy: false,
            limit: quota.limit(),
            period: quota.period(),
        }
    }

    /// Also send the legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset`
    /// (single values: with several policies, the one with the fewest
    /// permits left).
    #[must_use]
    pub fn legacy(mut self, on: bool) -> Self {
        self.legacy = on;
        self
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name as it appears in headers and problem bodies (quoted).
    pub(crate) fn quoted(&self) -> &str {
        &self.quoted
    }

    /// Appends this policy's items to `RateLimit-Policy` and, unless the
    /// decision was made up by a fail-open policy (nothing is known about
    /// what remains), to `RateLimit`: one item per quota the decision
    /// holds (see [`Decision::quotas`]), the first named after the policy,
    /// the next ones `name.1`, `name.2`… Each item states the quota the
    /// key was held to (its tier's, if it has one). When denied, sets
    /// `Retry-After` unless one already there asks for a longer wait.
    /// Items already in `headers` (another layer's, the handler's) are
    /// kept.
    pub fn append_to(&self, headers: &mut HeaderMap, decision: &Decision) {
        for (index, part) in decision.quotas().iter().enumerate() {
            self.append_quota(headers, part, index);
        }
    }

    fn append_quota(&self, headers: &mut HeaderMap, decision: &Decision, index: usize) {
        let own;
        let quoted = if index == 0 {
            &self.quoted
        } else {
            own = sf_string(&format!("{}.{index}", self.name));
            &own
        };
        let period = if decision.period().is_zero() {
            self.period
        } else {
            decision.period()
        };
        let policy = if index == 0 && decision.limit() == self.limit && period == self.period {
            self.policy.clone()
        } else {
            let value = format!(
                "{quoted};q={};w={}",
                decision.limit(),
                ceil_secs(period).max(1)
            );
            HeaderValue::from_str(&value).unwrap_or_else(|_| self.policy.clone())
        };
        headers.append(HeaderName::from_static(RATELIMIT_POLICY), policy);
        if decision.source() == Source::FailOpen {
            return;
        }
        let retry = retry_secs(decision);
        let reset = ceil_secs(decision.reset_after());
        // On a denial the quota the client can use comes back when the
        // request can be retried (for a bucket, long before it is full).
        let t = match (decision.is_allowed(), retry) {
            (false, Some(retry)) => retry,
            _ => reset,
        };
        let value = format!("{quoted};r={};t={t}", decision.remaining());
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.append(HeaderName::from_static(RATELIMIT), value);
        }
        if self.legacy {
            let fewer = headers
                .get("x-ratelimit-remaining")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                .is_none_or(|left| decision.remaining() < left);
            if fewer {
                headers.insert("x-ratelimit-limit", HeaderValue::from(decision.limit()));
                headers.insert(
                    "x-ratelimit-remaining",
                    HeaderValue::from(decision.remaining()),
                );
                headers.insert("x-ratelimit-reset", HeaderValue::from(t));
            }
        }
        if let (false, Some(retry)) = (decision.is_allowed(), retry) {
            let longer = headers
                .get(http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                .is_none_or(|there| retry > there);
            if longer {
                headers.insert(http::header::RETRY_AFTER, HeaderValue::from(retry));
            }
        }
    }
}

/// A JSON array of the quoted names.
fn policy_array<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let mut out = String::from("[");
    for (i, name) in names.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(name);
    }
    out.push(']');
    out
}

/// A problem+json body for a request over its quota; `violated` are the
/// quoted names of every policy that denied it.
pub(crate) fn quota_problem<'a>(
    violated: impl Iterator<Item = &'a str>,
    retry: Option<u64>,
) -> String {
    let detail = match retry {
        Some(secs) => format!("retry in {secs} s"),
        None => "the request costs more than the quota allows".to_owned(),
    };
    format!(
        "{{\"type\":\"{PROBLEM_TYPE}\",\"title\":\"Request cannot be satisfied as assigned quota has been exceeded\",\"status\":429,\"detail\":\"{detail}\",\"violated-policies\":{}}}",
        policy_array(violated)
    )
}

/// A problem+json body for a request denied because the limiter could not
/// decide and fails closed.
pub(crate) fn unavailable_problem<'a>(
    policies: impl Iterator<Item = &'a str>,
    retry: Option<u64>,
) -> String {
    let retry = retry.unwrap_or(1);
    format!(
        "{{\"type\":\"{PROBLEM_TYPE_UNAVAILABLE}\",\"title\":\"Request cannot be satisfied due to temporary reduced capacity\",\"status\":503,\"detail\":\"the rate limiter cannot decide; retry in {retry} s\",\"violated-policies\":{}}}",
        policy_array(policies)
    )
}

/// A problem+json body for a request denied because its key has every
/// slot in flight.
pub(crate) fn in_flight_problem(retry: Option<u64>) -> String {
    let retry = retry.unwrap_or(1);
    format!(
        "{{\"type\":\"{PROBLEM_TYPE_IN_FLIGHT}\",\"title\":\"Too many requests in flight\",\"status\":429,\"detail\":\"every slot of this key is in use; retry in {retry} s\"}}"
    )
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

    #[test]
    fn problem_bodies_list_every_violated_policy() {
        let body = quota_problem(["\"a\"", "\"b\""].into_iter(), Some(3));
        assert!(
            body.contains("\"violated-policies\":[\"a\",\"b\"]"),
            "{body}"
        );
        let body = unavailable_problem(std::iter::empty(), None);
        assert!(body.contains("temporary-reduced-capacity"), "{body}");
        assert!(body.contains("\"status\":503"), "{body}");
    }

    #[test]
    fn an_in_flight_refusal_has_a_problem_type_of_its_own() {
        let body = in_flight_problem(Some(1));
        let quota = quota_problem(std::iter::empty(), Some(1));
        assert!(
            body.contains(&format!("\"type\":\"{PROBLEM_TYPE_IN_FLIGHT}\"")),
            "{body}"
        );
        assert!(!body.contains(PROBLEM_TYPE), "{body}");
        assert!(quota.contains(PROBLEM_TYPE), "{quota}");
        assert_ne!(PROBLEM_TYPE_IN_FLIGHT, PROBLEM_TYPE);
        assert_ne!(PROBLEM_TYPE_IN_FLIGHT, PROBLEM_TYPE_UNAVAILABLE);
        assert!(body.contains("\"status\":429"), "{body}");
    }
}
