//! The rule table: every domain's configuration, with one [`Limiter`]
//! per rule. A reload builds a new table from the old one, keeping the
//! limiter (and so the counters and leases) of every rule that is still
//! there, with [`Limiter::set_quota`] where its limit changed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::config::{Config, Rule};

mod series;
pub use series::MAX_DETAILED_SERIES;
pub(crate) use series::{RuleSeries, RuleStats};
use slicelimit::Error;
use slicelimit::FailurePolicy;
use slicelimit::HybridConfig;
use slicelimit::Limiter;
use slicelimit::Quota;
use slicelimit::Store;

/// How the server counts: the limiter mode of every rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Leased slices, waiting for a refill rather than admitting past
    /// the limit (the default).
    HybridStrict,
    /// Leased slices, admitting a little on credit while a refill is in
    /// flight ([`HybridConfig::optimistic`] with
    /// [`OPTIMISTIC_MAX_DEBT`]).
    HybridOptimistic,
    /// One store call per descriptor.
    Exact,
}

/// The debt each key may run up per process in
/// [`Mode::HybridOptimistic`].
pub const OPTIMISTIC_MAX_DEBT: u64 = 5;

/// How long a hybrid rule waits for a refill before it answers. Longer
/// than the store's longest response timeout (4 × 25 ms), so a stalled
/// Redis ends in a store error, which `--on-store-error` decides, not in a
/// denial; shorter than the 250 ms Envoy timeout `docs/envoy.md` advises.
pub const MAX_WAIT: Duration = Duration::from_millis(150);

/// The most override limiters a domain keeps live (see `Overrides`):
/// past it, the least recently used is retired, never a request refused.
pub const MAX_OVERRIDES: usize = 256;

/// An override limiter unused this long is retired the next time its
/// domain builds one.
pub const OVERRIDE_IDLE: Duration = Duration::from_secs(120);

/// The rule label of decisions made under a request's own `limit`.
pub const OVERRIDE_RULE: &str = "(override)";

/// What every rule's limiter is built with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where budgets are shared.
    pub store: Store,
    /// How to count.
    pub mode: Mode,
    /// What to decide when the store cannot answer.
    pub on_store_error: FailurePolicy,
    /// Several files of one domain are merged (envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG`), not refused.
    pub merge_domains: bool,
}

/// Every domain, by name.
#[derive(Debug, Default)]
pub struct Table {
    domains: HashMap<String, Domain>,
}

#[derive(Debug)]
pub(crate) struct Domain {
    pub(crate) config: Config,
    rules: HashMap<String, Arc<RuleLimiter>>,
    /// Kept across reloads while the domain is configured.
    pub(crate) overrides: Arc<Overrides>,
}

/// The limiters of requests that bring a `limit` of their own, for one
/// domain. As envoyproxy/ratelimit keys its counters by descriptor and
/// window, not by limit, every override of one period draws on one
/// count: a descriptor that matches a rule of that period shares the
/// rule's own count (its namespace), one of another period or of no rule
/// counts under the domain's namespace for that period. A limit that
/// changes between requests (10, then 9, … then 5 per minute) therefore
/// admits at most the largest of them in a window, and each request is
/// admitted only while the count leaves room under its own limit.
///
/// At most [`MAX_OVERRIDES`] limiters are live: the least recently used
/// is retired past it, and any unused for [`OVERRIDE_IDLE`] when another
/// is built. A retired limiter's count stays in the store, so a limiter
/// built again for the same override carries on from it.
pub(crate) struct Overrides {
    /// The stand-in rule of override decisions: counted under the rule
    /// label [`OVERRIDE_RULE`], never in shadow mode, without a name (the
    /// reference treats an override as a limit of its own, not the
    /// rule's).
    pub(crate) rule: Arc<RuleLimiter>,
    live: Mutex<HashMap<Slot, Live>>,
}

/// Where an override limiter counts, and how.
type Slot = (String, Quota, slicelimit::Algorithm);

struct Live {
    limiter: Limiter,
    used: std::time::Instant,
}

impl std::fmt::Debug for Overrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overrides")
            .field("live", &self.live_count())
            .finish_non_exhaustive()
    }
}

impl Overrides {
    fn new(domain: &str) -> Overrides {
        let rule = Rule {
            path: OVERRIDE_RULE.to_owned(),
            name: None,
            quota: None,
            blocks: None,
            algorithm: slicelimit::Algorithm::FixedWindow,
            shadow_mode: false,
            quota_mode: false,
            post_hoc: false,
            replaces: Vec::new(),
            detailed_metric: false,
            levels: Vec::new(),
        };
        Overrides {
            rule: Arc::new(RuleLimiter {
                namespace: namespace(domain, OVERRIDE_RULE),
                domain: domain.to_owned(),
                limiter: None,
                stats: Arc::new(RuleSeries::new(domain, &rule)),
                rule,
            }),
            live: Mutex::default(),
        }
    }

    /// How many override limiters are live.
    pub(crate) fn live_count(&self) -> usize {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The limiter for `quota`, a request's own limit, on a descriptor
    /// that reaches `rule` (or none).
    ///
    /// Override limiters decide by one store call each (the exact mode),
    /// whatever `--mode`: they lease nothing, so permits a denied request
    /// gives back, or a limit used once, are never stranded in a slice
    /// the rule's own requests cannot reach.
    ///
    /// # Errors
    /// A rule counted as a bucket (token bucket, GCRA): its level cannot
    /// be shared by different rates (a large one refills it for a small
    /// one), so a request's own limit does not apply there. A quota the
    /// rule's algorithm cannot count; a limiter that cannot be built.
    pub(crate) fn limiter(
        &self,
        rule: Option<&RuleLimiter>,
        quota: Quota,
        settings: &Settings,
    ) -> Result<Limiter, Error> {
        let algorithm = rule.map_or(slicelimit::Algorithm::FixedWindow, |r| r.rule.algorithm);
        if matches!(
            algorithm,
            slicelimit::Algorithm::TokenBucket | slicelimit::Algorithm::Gcra
        ) {
            return Err(Error::invalid(format!(
                "a rule counted as a {} does not take a request's own limit",
                algorithm.as_str()
            )));
        }
        let own_period = rule
            .and_then(|r| r.limiter.as_ref())
            .map(|l| l.quota().period());
        let namespace = match rule {
            Some(r) if own_period == Some(quota.period()) => r.namespace.clone(),
            Some(r) => format!("{}#{}ms", r.namespace, quota.period().as_millis()),
            None => format!("{}#{}ms", self.rule.namespace, quota.period().as_millis()),
        };
        let now = std::time::Instant::now();
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let slot = (namespace, quota, algorithm);
        if let Some(found) = live.get_mut(&slot) {
            found.used = now;
            return Ok(found.limiter.clone());
        }
        algorithm.check_quota(&quota)?;
        let mut gone: Vec<Slot> = live
            .iter()
            .filter(|(_, l)| now.duration_since(l.used) >= OVERRIDE_IDLE)
            .map(|(k, _)| k.clone())
            .collect();
        if live.len() - gone.len() >= MAX_OVERRIDES {
            if let Some(oldest) = live
                .iter()
                .filter(|(k, _)| !gone.contains(k))
                .min_by_key(|(_, l)| l.used)
                .map(|(k, _)| k.clone())
            {
                gone.push(oldest);
            }
        }
        let retired: Vec<Limiter> = gone
            .iter()
            .filter_map(|k| live.remove(k))
            .map(|l| l.limiter)
            .collect();
        retire(retired);
        let domain = &self.rule.domain;
        let path = rule.map_or(OVERRIDE_RULE, |r| r.rule.path.as_str());
        let builder = Limiter::builder(quota)
            .name(&format!("{domain}:{path}{OVERRIDE_RULE}"))
            .namespace(&slot.0)
            .algorithm(algorithm);
        let exact = Settings {
            mode: Mode::Exact,
            ..settings.clone()
        };
        let limiter = with_settings(builder, &exact)?;
        live.insert(
            slot,
            Live {
                limiter: limiter.clone(),
                used: now,
            },
        );
        metrics::gauge!(crate::stats::OVERRIDES_LIVE, "domain" => domain.clone())
            .set(live.len() as f64);
        Ok(limiter)
    }

    fn limiters(&self) -> Vec<Limiter> {
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.values().map(|l| l.limiter.clone()).collect()
    }
}

/// Shuts evicted override limiters down at once, where a runtime runs
/// (their unused permits go back). Not after [`RETIRE_AFTER`], as a
/// reload's are: a client sending a new limit on every request would
/// keep that many seconds' worth of limiters alive (10,000 in a second
/// held 460 MB). A request still deciding on one when it stops is
/// decided by the store directly, as a stopped hybrid limiter decides.
fn retire(limiters: Vec<Limiter>) {
    if limiters.is_empty() {
        return;
    }
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            for limiter in limiters {
                limiter.shutdown().await;
            }
        });
    }
}

/// One rule and what counts for it.
pub(crate) struct RuleLimiter {
    pub(crate) rule: Rule,
    pub(crate) domain: String,
    /// `None` for an `unlimited` rule.
    limiter: Option<Limiter>,
    namespace: String,
    /// Carried across reloads while the rule's path stays, so the bound
    /// on its detailed series holds across them.
    pub(crate) stats: Arc<RuleSeries>,
}

impl std::fmt::Debug for RuleLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleLimiter")
            .field("rule", &self.rule)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Table {
    /// The table for `configs` (one per domain), keeping what `previous`
    /// had for rules that are still there. Returns the table and the
    /// limiters of the rules it dropped, to be shut down once no request
    /// uses the previous table any more.
    ///
    /// # Errors
    /// Two configurations for one domain; a limiter that cannot be built.
    pub fn build(
        configs: Vec<Config>,
        settings: &Settings,
        previous: Option<&Table>,
    ) -> Result<(Table, Vec<Limiter>), Error> {
        let mut names: Vec<(&str, &str)> =
            configs.iter().map(|c| (c.domain(), c.source())).collect();
        names.sort_unstable();
        if let Some(twice) = names.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::invalid(format!(
                "domain {:?} is configured twice: in {} and in {}",
                twice[0].0, twice[0].1, twice[1].1
            )));
        }
        let mut domains: HashMap<String, Domain> = HashMap::new();
        // The old rules carried over, by address: a set, so a reload of
        // many rules stays linear.
        let mut kept: std::collections::HashSet<*const RuleLimiter> = Default::default();
        // Quotas change in place only once every rule is built: a table
        // that fails to build changes nothing.
        let mut changes: Vec<(Limiter, Quota)> = Vec::new();
        for config in configs {
            let name = config.domain().to_owned();
            let mut rules = HashMap::new();
            for rule in config.rules() {
                let old = previous
                    .and_then(|t| t.domains.get(&name))
                    .and_then(|d| d.rules.get(&rule.path));
                let series = old.map(|o| o.stats.clone());
                let entry = match old {
                    Some(old) if old.can_become(rule) => {
                        kept.insert(Arc::as_ptr(old));
                        if let (Some(limiter), Some(quota)) = (&old.limiter, rule.quota) {
                            if limiter.quota() != quota {
                                changes.push((limiter.clone(), quota));
                            }
                        }
                        old.become_(rule)
                    }
                    _ => RuleLimiter::new(&name, rule, settings, series)?,
                };
                rules.insert(rule.path.clone(), Arc::new(entry));
            }
            let overrides = previous
                .and_then(|t| t.domains.get(&name))
                .map_or_else(|| Arc::new(Overrides::new(&name)), |d| d.overrides.clone());
            domains.insert(
                name,
                Domain {
                    config,
                    rules,
                    overrides,
                },
            );
        }
        for (limiter, quota) in changes {
            limiter.set_quota(quota)?;
        }
        let mut retired = Vec::new();
        if let Some(previous) = previous {
            for (name, domain) in &previous.domains {
                for old in domain.rules.values() {
                    if kept.contains(&Arc::as_ptr(old)) {
                        continue;
                    }
                    retired.extend(old.limiter.clone());
                }
                if !domains.contains_key(name) {
                    retired.extend(domain.overrides.limiters());
                }
            }
        }
        Ok((Table { domains }, retired))
    }

    /// The domain requests name `domain`.
    pub(crate) fn domain(&self, domain: &str) -> Option<&Domain> {
        self.domains.get(domain)
    }

    /// How many rules the table holds.
    pub fn rules(&self) -> usize {
        self.domains.values().map(|d| d.rules.len()).sum()
    }

    /// Every limiter of the table, for shutdown.
    pub fn limiters(&self) -> Vec<Limiter> {
        let mut out = Vec::new();
        for domain in self.domains.values() {
            for rule in domain.rules.values() {
                out.extend(rule.limiter.clone());
            }
            out.extend(domain.overrides.limiters());
        }
        out
    }
}

impl Domain {
    /// The rule a descriptor's entries reach.
    pub(crate) fn rule(&self, entries: &[(&str, &str)]) -> Option<&Arc<RuleLimiter>> {
        let rule = self.config.rule(entries)?;
        self.rules.get(&rule.path)
    }
}

impl RuleLimiter {
    fn new(
        domain: &str,
        rule: &Rule,
        settings: &Settings,
        series: Option<Arc<RuleSeries>>,
    ) -> Result<RuleLimiter, Error> {
        let namespace = namespace(domain, &rule.path);
        let limiter = match rule.quota {
            Some(quota) => Some(build(domain, rule, quota, &namespace, settings)?),
            None => None,
        };
        Ok(RuleLimiter {
            rule: rule.clone(),
            domain: domain.to_owned(),
            limiter,
            namespace,
            stats: series.unwrap_or_else(|| Arc::new(RuleSeries::new(domain, rule))),
        })
    }

    /// Whether this rule's limiter can serve `rule`, a new version of it:
    /// the same algorithm, unit and `post_hoc` (which decides its mode),
    /// and limited both times (or unlimited both). A changed unit is a new count, as in envoyproxy/ratelimit
    /// (its counters are keyed by the window), and the rebuilt limiter
    /// counts where a request's own `limit` of that unit counts.
    fn can_become(&self, rule: &Rule) -> bool {
        self.rule.algorithm == rule.algorithm
            && self.rule.post_hoc == rule.post_hoc
            && self.rule.quota.map(|q| q.period()) == rule.quota.map(|q| q.period())
    }

    /// This rule's limiter serving `rule`, its counters and leases kept
    /// (the caller changes its quota).
    fn become_(&self, rule: &Rule) -> RuleLimiter {
        RuleLimiter {
            rule: rule.clone(),
            domain: self.domain.clone(),
            limiter: self.limiter.clone(),
            namespace: self.namespace.clone(),
            stats: self.stats.clone(),
        }
    }

    /// The rule's own limiter; `None` for an unlimited rule or one that
    /// blocks.
    pub(crate) fn limiter(&self) -> Option<&Limiter> {
        self.limiter.as_ref()
    }
}

fn build(
    domain: &str,
    rule: &Rule,
    quota: Quota,
    namespace: &str,
    settings: &Settings,
) -> Result<Limiter, Error> {
    let builder = Limiter::builder(quota)
        .name(&format!("{domain}:{}", rule.path))
        .namespace(namespace)
        .algorithm(rule.algorithm);
    if rule.post_hoc {
        // A post-hoc rule's asks must see what every replica charged: a
        // replica that only asks would hold a stale look in a hybrid mode
        // (its leases would see the debt only when they ran out). Each
        // ask and charge is one store call.
        let exact = Settings {
            mode: Mode::Exact,
            ..settings.clone()
        };
        return with_settings(builder, &exact);
    }
    with_settings(builder, settings)
}

/// `builder` with the server's store, failure policy and mode, built.
fn with_settings(builder: slicelimit::Builder, settings: &Settings) -> Result<Limiter, Error> {
    let builder = builder
        .store(settings.store.clone())
        .on_store_error(settings.on_store_error);
    match settings.mode {
        Mode::Exact => builder.exact(),
        Mode::HybridStrict => builder.hybrid(HybridConfig::strict().max_wait(MAX_WAIT)),
        Mode::HybridOptimistic => {
            builder.hybrid(HybridConfig::optimistic(OPTIMISTIC_MAX_DEBT).max_wait(MAX_WAIT))
        }
    }
    .build()
}

/// The store namespace of a rule: the same on every replica, from the
/// domain and the rule's place in the file; hashed when long.
fn namespace(domain: &str, path: &str) -> String {
    // The domain's length first: no domain and path can read as another.
    let plain = format!("rls:{}:{domain}:{path}", domain.len());
    if plain.len() <= 128 {
        return plain;
    }
    let digest = Sha256::digest(plain.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("rls:{hex}")
}

/// How long [`Table::build`]'s retired limiters are left running, so that
/// requests still holding the previous table finish on them.
pub const RETIRE_AFTER: Duration = Duration::from_secs(5);
