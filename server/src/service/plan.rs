//! What each descriptor of a request asks for: its rule, its counter,
//! its cost, and whether it reserves or settles.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tonic::Status;

use super::descriptor::{key_of, key_with_names, override_limit, OverrideLimit};
use super::settle::Role;
use super::{RateLimiter, MAX_ENTRIES};
use crate::log::Throttled;
use crate::table::{RuleLimiter, RuleStats, Table};
use slicelimit::Limiter;

impl RateLimiter {
    /// What to do for one descriptor.
    pub(super) fn plan(
        &self,
        table: &Table,
        domain: &str,
        descriptor: &RateLimitDescriptor,
        default_cost: u64,
        index: usize,
    ) -> Result<Plan, Status> {
        if descriptor.entries.len() > MAX_ENTRIES {
            return Err(Status::invalid_argument(format!(
                "descriptor {index} has {} entries; at most {MAX_ENTRIES}",
                descriptor.entries.len()
            )));
        }
        let Some(domain) = table.domain(domain) else {
            return Ok(Plan::Nothing);
        };
        let entries: Vec<(&str, &str)> = descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        let (role, entries) = Role::of(entries, index)?;
        let rule = domain.rule(&entries);
        let cost = descriptor
            .hits_addend
            .as_ref()
            .map_or(default_cost, |h| h.value);
        // A request's own limit applies wherever the domain is configured,
        // matched by a rule or not, as envoyproxy/ratelimit applies it.
        // One the server cannot honour falls back to the rule (logged):
        // refusing the request would let Envoy's default failure mode
        // admit it, past every limit.
        if let Some(limit) = &descriptor.limit {
            let overrides = &domain.overrides;
            match override_limit(limit.requests_per_unit, limit.unit).and_then(|o| match o {
                OverrideLimit::Blocks(unit) => Ok(Plan::Blocked(overrides.rule.clone(), unit)),
                OverrideLimit::Quota(quota) => {
                    let limiter = overrides.limiter(rule.map(|r| &**r), quota, &self.settings)?;
                    Ok(Plan::Counted(Counted {
                        stats: overrides.rule.stats.for_request(&overrides.rule.rule, &[]),
                        post_hoc: rule.is_some_and(|r| r.rule.post_hoc),
                        rule: overrides.rule.clone(),
                        limiter,
                        key: match rule {
                            Some(rule) => key_of(&entries, &rule.rule),
                            None => key_with_names(&entries),
                        },
                        cost,
                        role: role.clone(),
                    }))
                }
            }) {
                Ok(plan) => return Ok(plan),
                Err(e) => {
                    metrics::counter!(crate::stats::OVERRIDES_IGNORED).increment(1);
                    IGNORED_OVERRIDE.say(|| {
                        format!(
                            "domain {:?}, descriptor {index}: its `limit` is ignored, \
                             the rule's applies: {e}",
                            domain.config.domain()
                        )
                    });
                }
            }
        }
        let Some(rule) = rule else {
            return Ok(Plan::Nothing);
        };
        let Some(limiter) = rule.limiter().cloned() else {
            return Ok(match rule.rule.blocks {
                Some(unit) => Plan::Blocked(rule.clone(), unit),
                None => Plan::Unlimited(rule.clone()),
            });
        };
        Ok(Plan::Counted(Counted {
            stats: rule.stats.for_request(&rule.rule, &entries),
            post_hoc: rule.rule.post_hoc,
            rule: rule.clone(),
            limiter,
            key: key_of(&entries, &rule.rule),
            cost,
            role,
        }))
    }
}

pub(super) enum Plan {
    /// Counts nothing: no rule, an unknown domain, a replaced rule.
    Nothing,
    /// An unlimited rule: counts nothing, and says so with every permit
    /// left (`u32::MAX`, as envoyproxy/ratelimit answers).
    Unlimited(Arc<RuleLimiter>),
    /// A rule of `requests_per_unit: 0` (and its unit): every request is
    /// over its limit, none is counted.
    Blocked(Arc<RuleLimiter>, Duration),
    Counted(Counted),
}

pub(super) struct Counted {
    pub(super) rule: Arc<RuleLimiter>,
    /// The rule matched counts costs of work already done (see
    /// `Rule::post_hoc`; a request's own `limit` keeps it).
    pub(super) post_hoc: bool,
    pub(super) limiter: Limiter,
    pub(super) key: String,
    pub(super) cost: u64,
    /// The stats this descriptor counts in (its rule's, or a series of
    /// them with the requested values: `detailed_metric`).
    pub(super) stats: Arc<RuleStats>,
    /// A reservation, its settlement, or neither (see `settle`).
    pub(super) role: Role,
}

impl Counted {
    /// Whether its hits are charged whatever is left (a post-hoc rule's
    /// that reserves nothing, and every settlement).
    pub(super) fn charges(&self) -> bool {
        match self.role {
            Role::Plain => self.post_hoc,
            Role::Reserve(_) => false,
            Role::Settle(_) => true,
        }
    }
}

impl Plan {
    pub(super) fn counted(&self) -> Option<&Counted> {
        match self {
            Plan::Counted(c) => Some(c),
            _ => None,
        }
    }

    pub(super) fn rule(&self) -> Option<&Arc<RuleLimiter>> {
        match self {
            Plan::Nothing => None,
            Plan::Unlimited(rule) | Plan::Blocked(rule, _) => Some(rule),
            Plan::Counted(c) => Some(&c.rule),
        }
    }
}

/// Ignored `limit` overrides, logged at most once a minute.
static IGNORED_OVERRIDE: Throttled = Throttled::new(Duration::from_secs(60));
