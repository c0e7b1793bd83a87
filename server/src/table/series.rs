//! A rule's stats series: its own, and those labelled with requested
//! values (`detailed_metric`, `value_to_metric`), bounded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use metrics::Counter;

use crate::config::{escape, Rule};

/// A rule's counters, in the style of envoyproxy/ratelimit's stats: hits
/// (permits asked for), and of them those over the limit, those within
/// it but past 80 % of it, and those a shadow rule would have denied.
#[derive(Debug)]
pub(crate) struct RuleStats {
    pub(crate) total_hits: Counter,
    pub(crate) over_limit: Counter,
    pub(crate) near_limit: Counter,
    pub(crate) within_limit: Counter,
    pub(crate) shadow_mode: Counter,
}

/// The most series one rule's `detailed_metric` or `value_to_metric`
/// labels create; requests past it count in the rule's own series.
pub const MAX_DETAILED_SERIES: usize = 100;

/// A rule's stats: its own series, and those labelled with requested
/// values (`detailed_metric`, `value_to_metric`), at most
/// [`MAX_DETAILED_SERIES`] of them.
#[derive(Debug)]
pub(crate) struct RuleSeries {
    domain: String,
    own: Arc<RuleStats>,
    detailed: Mutex<HashMap<String, Arc<RuleStats>>>,
}

impl RuleSeries {
    pub(super) fn new(domain: &str, rule: &Rule) -> RuleSeries {
        RuleSeries {
            domain: domain.to_owned(),
            own: Arc::new(RuleStats::labelled(domain, &rule.path)),
            detailed: Mutex::default(),
        }
    }

    /// The series a request with `entries` counts in: the rule's own,
    /// unless the rule labels requested values. Then its path with each
    /// such descriptor's value as requested (a shared wildcard's as its
    /// pattern), as envoyproxy/ratelimit builds its detailed keys.
    pub(crate) fn for_request(&self, rule: &Rule, entries: &[(&str, &str)]) -> Arc<RuleStats> {
        let labels_values = rule.detailed_metric || rule.levels.iter().any(|l| l.value_to_metric);
        if !labels_values || entries.is_empty() {
            return self.own.clone();
        }
        let label: Vec<String> = rule
            .path
            .split('/')
            .zip(&rule.levels)
            .zip(entries)
            .map(|((segment, level), (key, value))| {
                match (&level.shared, rule.detailed_metric || level.value_to_metric) {
                    (_, false) => segment.to_owned(),
                    (Some(pattern), true) => {
                        let parts: Vec<String> = pattern.split('*').map(escape).collect();
                        format!("{}={}", escape(key), parts.join("*"))
                    }
                    (None, true) => format!("{}={}", escape(key), escape(value)),
                }
            })
            .collect();
        let label = label.join("/");
        let mut detailed = self.detailed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(stats) = detailed.get(&label) {
            return stats.clone();
        }
        if detailed.len() >= MAX_DETAILED_SERIES {
            return self.own.clone();
        }
        let stats = Arc::new(RuleStats::labelled(&self.domain, &label));
        detailed.insert(label, stats.clone());
        stats
    }
}

impl std::ops::Deref for RuleSeries {
    type Target = RuleStats;

    fn deref(&self) -> &RuleStats {
        &self.own
    }
}

impl RuleStats {
    fn labelled(domain: &str, label: &str) -> RuleStats {
        let counter = |name: &'static str| metrics::counter!(name, "domain" => domain.to_owned(), "rule" => label.to_owned());
        RuleStats {
            total_hits: counter(crate::stats::TOTAL_HITS),
            over_limit: counter(crate::stats::OVER_LIMIT),
            near_limit: counter(crate::stats::NEAR_LIMIT),
            within_limit: counter(crate::stats::WITHIN_LIMIT),
            shadow_mode: counter(crate::stats::SHADOW_MODE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn detailed_series_carry_requested_values_and_stop_at_their_bound() {
        let text = "domain: d\ndescriptors:\n  - key: route\n    value: api/*\n    share_threshold: true\n    value_to_metric: true\n    descriptors:\n      - key: user\n        detailed_metric: true\n        rate_limit: { unit: minute, requests_per_unit: 1 }\n  - key: plain\n    rate_limit: { unit: minute, requests_per_unit: 1 }\n";
        let config = Config::parse("d.yaml", text).unwrap();
        let rule = config
            .rule(&[("route", "api/x"), ("user", "u1")])
            .unwrap()
            .clone();
        let series = RuleSeries::new("d", &rule);
        let label = |entries: &[(&str, &str)]| {
            let stats = series.for_request(&rule, entries);
            let detailed = series.detailed.lock().unwrap();
            detailed
                .iter()
                .find(|(_, s)| Arc::ptr_eq(s, &stats))
                .map(|(l, _)| l.clone())
        };
        // The shared wildcard is labelled by its pattern, the user by value.
        assert_eq!(
            label(&[("route", "api/x"), ("user", "u1")]).as_deref(),
            Some("route=api%2F*/user=u1")
        );
        for i in 0..MAX_DETAILED_SERIES + 10 {
            series.for_request(&rule, &[("route", "api/y"), ("user", &format!("n{i}"))]);
        }
        assert_eq!(series.detailed.lock().unwrap().len(), MAX_DETAILED_SERIES);
        // Past the bound: the rule's own series.
        assert!(Arc::ptr_eq(
            &series.for_request(&rule, &[("route", "api/z"), ("user", "late")]),
            &series.own
        ));
        // A rule without them: always its own.
        let plain = config.rule(&[("plain", "p")]).unwrap().clone();
        let own = RuleSeries::new("d", &plain);
        assert!(Arc::ptr_eq(
            &own.for_request(&plain, &[("plain", "p")]),
            &own.own
        ));
    }
}
