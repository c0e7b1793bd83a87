//! What a descriptor's `rate_limit` and `slicelimit` sections say: the
//! units, the limit (or `unlimited`, or 0 that blocks, its `name` and
//! `replaces`), and how its permits are counted.

use std::time::Duration;

use yaml_serde::Value;

use super::{field_name, Fail};
use slicelimit::{Algorithm, Error, Quota};

/// The units envoyproxy/ratelimit accepts, by name, and their length in
/// seconds: a month is 30 days and a year 365, as it counts them.
pub const UNITS: [(&str, u64); 7] = [
    ("second", 1),
    ("minute", 60),
    ("hour", 3_600),
    ("day", 86_400),
    ("week", 604_800),
    ("month", 2_592_000),
    ("year", 31_536_000),
];

/// The length of the unit called `name` (any case).
pub fn unit_period(name: &str) -> Option<Duration> {
    UNITS
        .iter()
        .find(|(unit, _)| unit.eq_ignore_ascii_case(name))
        .map(|&(_, secs)| Duration::from_secs(secs))
}

/// A `rate_limit` section, in envoyproxy/ratelimit's form: `unit` and
/// `requests_per_unit`, or `unlimited: true` (and no unit), and a `name`.
pub(super) struct RateLimit {
    pub(super) quota: Option<Quota>,
    pub(super) unlimited: bool,
    /// `requests_per_unit: 0`: the unit of a rule that blocks.
    pub(super) blocks: Option<Duration>,
    pub(super) name: Option<String>,
    /// `replaces: [{ name: … }]`.
    pub(super) replaces: Vec<String>,
}

pub(super) fn rate_limit(limit: &Value, at: &str, fail: Fail<'_>) -> Result<RateLimit, Error> {
    let map = limit
        .as_mapping()
        .ok_or_else(|| fail(at, "`rate_limit` must be a mapping".into()))?;
    for (field, _) in map {
        match field.as_str() {
            Some("unit" | "requests_per_unit" | "unlimited" | "name" | "replaces") => {}
            _ => {
                return Err(fail(
                    at,
                    format!("`rate_limit`: unsupported field {:?}", field_name(field)),
                ))
            }
        }
    }
    let name = match map.get("name") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| fail(at, "`rate_limit.name` must be a string".into()))?
                .to_owned(),
        ),
    };
    let replaces = match map.get("replaces") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Sequence(list)) => list
            .iter()
            .map(|item| {
                item.as_mapping()
                    .filter(|m| m.len() == 1)
                    .and_then(|m| m.get("name"))
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        fail(
                            at,
                            "`rate_limit.replaces`: each item is `{ name: <a rule's name> }`"
                                .into(),
                        )
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(fail(
                at,
                "`rate_limit.replaces` must be a list of `{ name: … }`".into(),
            ))
        }
    };
    let unlimited = match map.get("unlimited") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| fail(at, "`rate_limit.unlimited` must be true or false".into()))?,
    };
    if unlimited {
        if map.get("unit").is_some() || map.get("requests_per_unit").is_some() {
            return Err(fail(
                at,
                "`rate_limit`: an unlimited rule has no `unit` or `requests_per_unit`".into(),
            ));
        }
        return Ok(RateLimit {
            quota: None,
            unlimited,
            blocks: None,
            name,
            replaces,
        });
    }
    let unit = map.get("unit").and_then(Value::as_str);
    let Some(period) = unit.and_then(unit_period) else {
        let known: Vec<&str> = UNITS.iter().map(|(u, _)| *u).collect();
        return Err(fail(
            at,
            format!("`rate_limit.unit` {unit:?}: one of {}", known.join(", ")),
        ));
    };
    let requests = map
        .get("requests_per_unit")
        .and_then(Value::as_u64)
        .ok_or_else(|| {
            fail(
                at,
                "`rate_limit.requests_per_unit` must be a whole number (0 blocks every request)"
                    .into(),
            )
        })?;
    if requests == 0 {
        return Ok(RateLimit {
            quota: None,
            unlimited: false,
            blocks: Some(period),
            name,
            replaces,
        });
    }
    let quota = Quota::new(requests, period).map_err(|e| fail(at, format!("`rate_limit`: {e}")))?;
    Ok(RateLimit {
        quota: Some(quota),
        unlimited: false,
        blocks: None,
        name,
        replaces,
    })
}

/// A `rate_limit` that must limit (an RLQS bucket's): no `unlimited`, no
/// `name`.
pub(super) fn quota(limit: &Value, at: &str, fail: Fail<'_>) -> Result<Quota, Error> {
    let parsed = rate_limit(limit, at, fail)?;
    if parsed.blocks.is_some() {
        return Err(fail(
            at,
            "`rate_limit.requests_per_unit` 0 is not for an RLQS bucket".into(),
        ));
    }
    if parsed.name.is_some() {
        return Err(fail(
            at,
            "`rate_limit.name` is not for an RLQS bucket".into(),
        ));
    }
    parsed.quota.ok_or_else(|| {
        fail(
            at,
            "`rate_limit.unlimited` is not for an RLQS bucket (leave the bucket out)".into(),
        )
    })
}

/// slicelimit's own fields of a descriptor (`slicelimit: { … }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Extensions {
    /// How the rule counts (`algorithm`; a fixed window unless chosen).
    pub(super) algorithm: Algorithm,
    /// `post_hoc: true`: every hit is a cost of work already done,
    /// counted whatever is left (see `Rule::post_hoc`).
    pub(super) post_hoc: bool,
}

/// Reads a descriptor's `slicelimit` section.
pub(super) fn extensions(
    section: Option<&Value>,
    at: &str,
    fail: Fail<'_>,
) -> Result<Extensions, Error> {
    let mut extensions = Extensions {
        algorithm: Algorithm::FixedWindow,
        post_hoc: false,
    };
    let Some(section) = section else {
        return Ok(extensions);
    };
    let map = section
        .as_mapping()
        .ok_or_else(|| fail(at, "`slicelimit` must be a mapping".into()))?;
    for (field, value) in map {
        match field.as_str() {
            Some("algorithm") => extensions.algorithm = algorithm(value, at, fail)?,
            Some("post_hoc") => {
                extensions.post_hoc = value.as_bool().ok_or_else(|| {
                    fail(at, "`slicelimit.post_hoc` must be true or false".into())
                })?;
            }
            _ => {
                return Err(fail(
                    at,
                    format!("`slicelimit`: unsupported field {:?}", field_name(field)),
                ))
            }
        }
    }
    Ok(extensions)
}

/// `slicelimit.algorithm`, by the algorithm's own name.
fn algorithm(value: &Value, at: &str, fail: Fail<'_>) -> Result<Algorithm, Error> {
    let name = value.as_str().unwrap_or("");
    // `token_bucket` or `token-bucket`, as the algorithm's own name.
    let wanted = name.replace('_', "-");
    Algorithm::all()
        .into_iter()
        .find(|a| a.as_str() == wanted)
        .ok_or_else(|| {
            let known: Vec<&str> = Algorithm::all().iter().map(|a| a.as_str()).collect();
            fail(
                at,
                format!(
                    "`slicelimit.algorithm` {name:?}: one of {}",
                    known.join(", ")
                ),
            )
        })
}
