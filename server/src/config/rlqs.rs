//! A domain's `rlqs` section: which quota each bucket of Envoy's
//! `rate_limit_quota` filter gets.
//!
//! ```yaml
//! rlqs:
//!   buckets:
//!     - match: { name: api }        # every entry must be in the bucket id;
//!       rate_limit: { unit: second, requests_per_unit: 100 }   # "*": any value
//!   no_match: allow                 # or deny: a bucket id no rule matches
//! ```
//!
//! A bucket id (a map of strings) takes the rule that matches the most of
//! its entries (the first in the file among equals). Each distinct bucket
//! id is its own key with that rule's quota.

use yaml_serde::Value;

use slicelimit::Error;
use slicelimit::Quota;

/// The `rlqs` section.
#[derive(Debug, Clone, PartialEq)]
pub struct RlqsConfig {
    /// The rules, in file order.
    pub buckets: Vec<BucketRule>,
    /// What a bucket id no rule matches gets.
    pub no_match: NoMatch,
}

/// One `buckets` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketRule {
    /// Its place in the file, from 1: names its counters and metrics.
    pub index: usize,
    /// The entries a bucket id must have; `None`: any value (`"*"`).
    pub entries: Vec<(String, Option<String>)>,
    /// The quota each matching bucket id gets, shared by the fleet.
    pub quota: Quota,
}

/// What an unmatched bucket gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoMatch {
    /// Every request passes (the default).
    Allow,
    /// Every request is denied.
    Deny,
}

impl BucketRule {
    /// How many of the bucket id's entries this rule matched, or `None`
    /// when it does not match.
    fn matches(&self, id: &[(&str, &str)]) -> Option<usize> {
        for (key, value) in &self.entries {
            let found = id.iter().find(|(k, _)| k == key)?;
            if let Some(value) = value {
                if found.1 != value {
                    return None;
                }
            }
        }
        Some(self.entries.len())
    }

    /// A stable label for metrics and store keys: `#index`.
    pub fn label(&self) -> String {
        format!("rlqs#{}", self.index)
    }
}

impl RlqsConfig {
    /// The rule a bucket id gets: the one matching most of its entries,
    /// the first among equals.
    pub fn rule(&self, id: &[(&str, &str)]) -> Option<&BucketRule> {
        let mut best: Option<(usize, &BucketRule)> = None;
        for rule in &self.buckets {
            if let Some(n) = rule.matches(id) {
                if best.is_none_or(|(m, _)| n > m) {
                    best = Some((n, rule));
                }
            }
        }
        best.map(|(_, rule)| rule)
    }

    /// Parses the section; `fail(what)` makes the error naming the file.
    pub(super) fn parse(
        section: &Value,
        fail: &dyn Fn(String) -> Error,
    ) -> Result<RlqsConfig, Error> {
        let map = section
            .as_mapping()
            .ok_or_else(|| fail("`rlqs` must be a mapping".into()))?;
        for (field, _) in map {
            match field.as_str() {
                Some("buckets" | "no_match") => {}
                other => return Err(fail(format!("`rlqs`: unsupported field {other:?}"))),
            }
        }
        let no_match = match map.get("no_match").map(Value::as_str) {
            None | Some(Some("allow")) => NoMatch::Allow,
            Some(Some("deny")) => NoMatch::Deny,
            Some(other) => return Err(fail(format!("`rlqs.no_match` {other:?}: allow or deny"))),
        };
        let list = match map.get("buckets") {
            None => &Vec::new(),
            Some(v) => v
                .as_sequence()
                .ok_or_else(|| fail("`rlqs.buckets` must be a list".into()))?,
        };
        let mut buckets = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            let at = |what: String| fail(format!("`rlqs.buckets` #{}: {what}", i + 1));
            let item = item
                .as_mapping()
                .ok_or_else(|| at("expected a mapping".into()))?;
            for (field, _) in item {
                match field.as_str() {
                    Some("match" | "rate_limit") => {}
                    other => return Err(at(format!("unsupported field {other:?}"))),
                }
            }
            let matcher = item
                .get("match")
                .and_then(Value::as_mapping)
                .ok_or_else(|| at("`match` must be a mapping of bucket id entries".into()))?;
            let mut entries = Vec::with_capacity(matcher.len());
            for (key, value) in matcher {
                let key = super::scalar(key)
                    .filter(|k| !k.is_empty())
                    .ok_or_else(|| at("a `match` key must be a non-empty string".into()))?;
                let value = super::scalar(value)
                    .ok_or_else(|| at(format!("`match.{key}` must be a string")))?;
                entries.push((key, (value != "*").then_some(value)));
            }
            let limit = item
                .get("rate_limit")
                .ok_or_else(|| at("`rate_limit` is required".into()))?;
            let quota = super::quota(limit, &format!("rlqs.buckets #{}", i + 1), &|_, what| {
                at(what)
            })?;
            buckets.push(BucketRule {
                index: i + 1,
                entries,
                quota,
            });
        }
        Ok(RlqsConfig { buckets, no_match })
    }
}
