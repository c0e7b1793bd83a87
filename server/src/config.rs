//! A rate limit service's configuration, in envoyproxy/ratelimit's YAML
//! format: one `domain` and its `descriptors`, nested to any depth, each
//! with a `key`, an optional `value` and at most one rule.
//!
//! ```yaml
//! domain: api
//! descriptors:
//!   - key: api_key
//!     rate_limit: { unit: minute, requests_per_unit: 100 }
//!     descriptors:
//!       - key: path
//!         value: /upload
//!         rate_limit: { unit: hour, requests_per_unit: 10 }
//!   - key: remote_address
//!     value: "10.0.*"
//!     unlimited: true
//! ```
//!
//! A request's descriptor (a list of key/value entries) is matched level
//! by level: an entry takes the node with its key and its exact value,
//! else the first (in file order) with its key and a value with `*` in it
//! that matches (each `*` any run of characters: `10.0.*`, `bar*b`,
//! `foo*bar*baz`), else one with its key and no value. The node the last entry
//! reaches decides: its rule, or none (the descriptor counts nothing).
//! `rate_limit` takes envoyproxy/ratelimit's fields: `unit` (second to
//! year), `requests_per_unit`, `name` and `unlimited`. Whatever slicelimit
//! cannot honour — a field it does not know (`replaces`, `detailed_metric`
//! …), a bad number — is an error naming the file, the descriptor and the
//! field, never ignored.

use std::time::Duration;

use yaml_serde::{Mapping, Value};

use slicelimit::Algorithm;
use slicelimit::Error;
use slicelimit::Quota;

mod limit;
mod rlqs;

use limit::{quota, rate_limit};
pub use limit::{unit_period, UNITS};

pub use self::rlqs::{BucketRule, NoMatch, RlqsConfig};

/// One domain's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    source: String,
    domain: String,
    descriptors: Vec<Node>,
    rlqs: Option<RlqsConfig>,
}

/// What a descriptor that reaches a rule is limited by.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Where the rule stands: its descriptors' `key=value` (or `key`)
    /// from the top, joined by `/`. Stable across reloads and replicas: a
    /// rule's counters are named by it.
    pub path: String,
    /// The rule's `name`, if it has one.
    pub name: Option<String>,
    /// Its limit; `None` for an `unlimited` rule, or one that blocks.
    pub quota: Option<Quota>,
    /// `requests_per_unit: 0`, envoyproxy/ratelimit's block-list idiom:
    /// every request is over the limit. The unit it names, told back.
    pub blocks: Option<Duration>,
    /// How its permits are counted (`slicelimit: { algorithm: … }`; a
    /// fixed window unless chosen).
    pub algorithm: Algorithm,
    /// Answered OK whatever the count; a would-be denial is only counted.
    pub shadow_mode: bool,
    /// `quota_mode`: over its limit, this descriptor's status says so,
    /// but the request is over only if every quota-mode descriptor of it
    /// is (and no other one is), as envoyproxy/ratelimit decides.
    pub quota_mode: bool,
    /// `slicelimit: { post_hoc: true }`: every hit is the cost of work
    /// already done (Envoy's `apply_on_stream_done` charges, tokens an
    /// LLM streamed), counted whatever is left, past the limit if need be
    /// (a debt the next requests wait out); a hit of 0 asks whether
    /// anything is left. Decided on its own, outside the all-or-nothing
    /// of the other descriptors, as envoyproxy/ratelimit counts every hit.
    pub post_hoc: bool,
    /// `rate_limit.replaces`: the names of rules this one replaces in a
    /// request that reaches both (the replaced one is not checked).
    pub replaces: Vec<String>,
    /// `detailed_metric`: the rule's stats are labelled with every
    /// entry's value as requested (see [`Level`]), up to a bound of
    /// series.
    pub detailed_metric: bool,
    /// What each descriptor on the way to the rule (the rule's own last)
    /// adds to how it counts and is labelled.
    pub levels: Vec<Level>,
}

/// One descriptor on the way to a rule, as it bears on the rule's
/// counter and labels.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Level {
    /// `share_threshold` on a wildcard value: every value it matches
    /// counts as this one (the pattern), sharing one count.
    pub shared: Option<String>,
    /// `value_to_metric`: the requested value goes into the stats label.
    pub value_to_metric: bool,
}

#[derive(Debug, Clone, PartialEq)]
struct Node {
    key: String,
    value: Match,
    rule: Option<Rule>,
    descriptors: Vec<Node>,
}

#[derive(Debug, Clone, PartialEq)]
enum Match {
    Any,
    Exact(String),
    /// A value with `*` in it, split there: each `*` stands for any run
    /// of characters (none included), as envoyproxy/ratelimit reads it.
    Wildcard(Vec<String>),
}

const DESCRIPTOR_FIELDS: [&str; 13] = [
    "key",
    "value",
    "rate_limit",
    "unlimited",
    "shadow_mode",
    "name",
    "descriptors",
    "slicelimit",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    // Free-form annotations (envoyproxy/ratelimit reads them for nothing
    // a decision depends on): accepted and left alone.
    "metadata",
];

impl Config {
    /// Parses one file's text; `source` (its path) names it in errors.
    ///
    /// # Errors
    /// An [`InvalidInput`](slicelimit::ErrorKind::InvalidInput) error naming
    /// `source`, the descriptor and the field for anything malformed or
    /// not supported.
    pub fn parse(source: &str, text: &str) -> Result<Config, Error> {
        let fail = |what: String| Error::invalid(format!("{source}: {what}"));
        let top: Value = yaml_serde::from_str(text).map_err(|e| fail(format!("not YAML: {e}")))?;
        let top = top
            .as_mapping()
            .ok_or_else(|| fail("expected a mapping with `domain` and `descriptors`".into()))?;
        for (field, _) in top {
            match field.as_str() {
                Some("domain" | "descriptors" | "rlqs") => {}
                _ => {
                    return Err(fail(format!(
                        "unsupported top-level field {:?}",
                        field_name(field)
                    )))
                }
            }
        }
        let domain = match top.get("domain").and_then(Value::as_str) {
            Some(domain) if !domain.is_empty() => domain.to_owned(),
            _ => return Err(fail("`domain` must be a non-empty string".into())),
        };
        let descriptors = nodes(top.get("descriptors"), "", &[], &|at, what| {
            fail(format!("descriptor {at}: {what}"))
        })?;
        let rlqs = match top.get("rlqs") {
            Some(section) => Some(RlqsConfig::parse(section, &fail)?),
            None => None,
        };
        Ok(Config {
            source: source.to_owned(),
            domain,
            descriptors,
            rlqs,
        })
    }

    /// `self` and `other`, a configuration of the same domain from another
    /// file, as one (envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`): their
    /// top-level descriptors side by side.
    ///
    /// # Errors
    /// Another domain; a top-level descriptor (key and value) in both;
    /// an `rlqs` section in both.
    pub fn merge(mut self, other: Config) -> Result<Config, Error> {
        let both = format!("{} and {}", self.source, other.source);
        if self.domain != other.domain {
            return Err(Error::invalid(format!(
                "{both}: domains {:?} and {:?} cannot be merged",
                self.domain, other.domain
            )));
        }
        for node in other.descriptors {
            if self
                .descriptors
                .iter()
                .any(|n| n.key == node.key && n.value == node.value)
            {
                return Err(Error::invalid(format!(
                    "{both}: descriptor {} of domain {:?} is in both",
                    segment(&node),
                    self.domain
                )));
            }
            self.descriptors.push(node);
        }
        self.rlqs = match (self.rlqs, other.rlqs) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(format!(
                    "{both}: an `rlqs` section for domain {:?} in both",
                    self.domain
                )))
            }
            (one, other) => one.or(other),
        };
        self.source = both;
        Ok(self)
    }

    /// Where it was read from (as given to [`parse`](Config::parse)).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `rlqs` section: quotas for the buckets of Envoy's
    /// `rate_limit_quota` filter.
    pub fn rlqs(&self) -> Option<&RlqsConfig> {
        self.rlqs.as_ref()
    }

    /// The domain requests name to use this configuration.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The rule a request's descriptor (its entries in order) reaches, or
    /// `None`: it matches no node, or a node without a rule.
    pub fn rule(&self, entries: &[(&str, &str)]) -> Option<&Rule> {
        let (first, rest) = entries.split_first()?;
        let mut node = best(&self.descriptors, first)?;
        for entry in rest {
            node = best(&node.descriptors, entry)?;
        }
        node.rule.as_ref()
    }

    /// Every rule, depth first in file order.
    pub fn rules(&self) -> Vec<&Rule> {
        fn walk<'a>(nodes: &'a [Node], out: &mut Vec<&'a Rule>) {
            for node in nodes {
                out.extend(node.rule.as_ref());
                walk(&node.descriptors, out);
            }
        }
        let mut out = Vec::new();
        walk(&self.descriptors, &mut out);
        out
    }
}

/// The node `entry` takes among `nodes`: exact value, else the first
/// wildcard value that matches, in file order (as envoyproxy/ratelimit
/// takes it), else the key alone.
fn best<'a>(nodes: &'a [Node], (key, value): &(&str, &str)) -> Option<&'a Node> {
    let of_key = || nodes.iter().filter(move |n| n.key == *key);
    of_key()
        .find(|n| matches!(&n.value, Match::Exact(v) if v == value))
        .or_else(|| {
            of_key().find(|n| matches!(&n.value, Match::Wildcard(parts) if glob(parts, value)))
        })
        .or_else(|| of_key().find(|n| n.value == Match::Any))
}

/// Whether `value` matches a wildcard value split on `*` (two parts at
/// least): it starts with the first part, ends with the last, and holds
/// the ones between in order, none overlapping.
fn glob(parts: &[String], value: &str) -> bool {
    let (Some((first, rest)), Some(last)) = (parts.split_first(), parts.last()) else {
        return false;
    };
    let Some(mut left) = value.strip_prefix(first.as_str()) else {
        return false;
    };
    for part in &rest[..rest.len().saturating_sub(1)] {
        match left.find(part.as_str()) {
            Some(at) => left = &left[at + part.len()..],
            None => return false,
        }
    }
    left.ends_with(last.as_str())
}

type Fail<'a> = &'a dyn Fn(&str, String) -> Error;

fn nodes(
    list: Option<&Value>,
    parent: &str,
    above: &[Level],
    fail: Fail<'_>,
) -> Result<Vec<Node>, Error> {
    // No list, or `descriptors:` with nothing after it (YAML's null).
    let Some(list) = list.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let at = if parent.is_empty() { "(top)" } else { parent };
    let list = list
        .as_sequence()
        .ok_or_else(|| fail(at, "`descriptors` must be a list".into()))?;
    let mut out: Vec<Node> = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let here = format!("{at} #{}", i + 1);
        let map = item
            .as_mapping()
            .ok_or_else(|| fail(&here, "expected a mapping".into()))?;
        let node = node(map, parent, above, &here, fail)?;
        if out
            .iter()
            .any(|n| n.key == node.key && n.value == node.value)
        {
            return Err(fail(&here, format!("{} is given twice", segment(&node))));
        }
        out.push(node);
    }
    Ok(out)
}

/// A node's part of a rule's path; `%`, `/`, `=` and `*` inside keys and
/// values are percent-encoded, so no two rules share a path.
fn segment(node: &Node) -> String {
    let key = escape(&node.key);
    match &node.value {
        Match::Any => key,
        Match::Exact(v) => format!("{key}={}", escape(v)),
        Match::Wildcard(parts) => {
            let parts: Vec<String> = parts.iter().map(|p| escape(p)).collect();
            format!("{key}={}", parts.join("*"))
        }
    }
}

/// `text` as it stands in a rule's path (see `segment`).
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            '=' => out.push_str("%3D"),
            '*' => out.push_str("%2A"),
            c => out.push(c),
        }
    }
    out
}

fn node(
    map: &Mapping,
    parent: &str,
    above: &[Level],
    here: &str,
    fail: Fail<'_>,
) -> Result<Node, Error> {
    for (field, _) in map {
        let name = field.as_str().unwrap_or("");
        if !DESCRIPTOR_FIELDS.contains(&name) {
            return Err(fail(
                here,
                format!("unsupported field {:?}", field_name(field)),
            ));
        }
    }
    let key = match map.get("key").and_then(Value::as_str) {
        Some(key) if !key.is_empty() => key.to_owned(),
        _ => return Err(fail(here, "`key` must be a non-empty string".into())),
    };
    let value = match map.get("value") {
        None => Match::Any,
        Some(v) => match scalar(v) {
            Some(v) if v.contains('*') => {
                Match::Wildcard(v.split('*').map(str::to_owned).collect())
            }
            Some(v) => Match::Exact(v),
            None => return Err(fail(here, "`value` must be a string".into())),
        },
    };
    let mut node = Node {
        key,
        value,
        rule: None,
        descriptors: Vec::new(),
    };
    let path = if parent.is_empty() {
        segment(&node)
    } else {
        format!("{parent}/{}", segment(&node))
    };
    let at = path.as_str();
    let flag = |field: &str| -> Result<bool, Error> {
        match map.get(field) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| fail(at, format!("`{field}` must be true or false"))),
        }
    };
    // `unlimited` and `name` belong in `rate_limit` (envoyproxy/ratelimit's
    // form); beside it, on the descriptor, they are read as well.
    let mut unlimited = flag("unlimited")?;
    let shadow_mode = flag("shadow_mode")?;
    let quota_mode = flag("quota_mode")?;
    let detailed_metric = flag("detailed_metric")?;
    let shared = match (flag("share_threshold")?, &node.value) {
        (false, _) => None,
        (true, Match::Wildcard(parts)) => Some(parts.join("*")),
        (true, _) => {
            return Err(fail(
                at,
                "`share_threshold` needs a wildcard `value` (with a `*`)".into(),
            ))
        }
    };
    let mut levels = above.to_vec();
    levels.push(Level {
        shared,
        value_to_metric: flag("value_to_metric")?,
    });
    let mut name = match map.get("name") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| fail(at, "`name` must be a string".into()))?
                .to_owned(),
        ),
    };
    let limit::Extensions {
        algorithm,
        post_hoc,
    } = limit::extensions(map.get("slicelimit"), at, fail)?;
    let mut blocks = None;
    let mut replaces = Vec::new();
    let quota = match (map.get("rate_limit"), unlimited) {
        (Some(_), true) => {
            return Err(fail(
                at,
                "`unlimited` and `rate_limit` exclude each other \
                 (write `rate_limit: { unlimited: true }`)"
                    .into(),
            ))
        }
        (Some(limit), false) => {
            let limit = rate_limit(limit, at, fail)?;
            if limit.name.is_some() {
                if name.is_some() {
                    return Err(fail(at, "`name` is given twice".into()));
                }
                name = limit.name;
            }
            unlimited = limit.unlimited;
            blocks = limit.blocks;
            replaces = limit.replaces;
            if let Some(own) = name.as_deref().filter(|n| replaces.iter().any(|r| r == n)) {
                return Err(fail(
                    at,
                    format!("`rate_limit.replaces`: a rule cannot replace itself ({own:?})"),
                ));
            }
            limit.quota
        }
        (None, _) => None,
    };
    if let Some(quota) = &quota {
        algorithm
            .check_quota(quota)
            .map_err(|e| fail(at, format!("`rate_limit`: {e}")))?;
    }
    if quota.is_some() || unlimited || blocks.is_some() {
        node.rule = Some(Rule {
            path: path.clone(),
            name,
            quota,
            blocks,
            algorithm,
            shadow_mode,
            quota_mode,
            post_hoc,
            replaces,
            detailed_metric,
            levels: levels.clone(),
        });
    } else if shadow_mode || quota_mode || post_hoc || name.is_some() {
        return Err(fail(
            at,
            "`shadow_mode`, `quota_mode`, `slicelimit.post_hoc` and `name` need a rule \
             (`rate_limit`)"
                .into(),
        ));
    }
    // (`detailed_metric` on a descriptor without a rule labels nothing,
    // as in envoyproxy/ratelimit.)
    node.descriptors = nodes(map.get("descriptors"), &path, &levels, fail)?;
    Ok(node)
}

/// A YAML scalar as the string a request's value would be.
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn field_name(field: &Value) -> String {
    scalar(field).unwrap_or_else(|| format!("{field:?}"))
}

#[cfg(test)]
mod tests;
