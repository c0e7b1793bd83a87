//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` on the
//! rule table.
//!
//! A request's descriptors are matched to rules, each one's cost is its
//! own `hits_addend`, else the request's (0 there means 1), and:
//! - the enforced descriptors (rules not in shadow mode) are decided
//!   **all-or-nothing** with [`check_each`]: a request one of them
//!   denies counts against none of them (envoyproxy/ratelimit counts it
//!   against every descriptor, so a client over one limit also spends the
//!   others);
//! - each shadow rule is decided on its own and always answered OK; the
//!   hits it would have denied are counted;
//! - each post-hoc rule (`slicelimit: { post_hoc: true }`) counts every
//!   hit whatever is left, past the limit if need be, and is over when
//!   nothing is left: costs of work already done (Envoy's
//!   `apply_on_stream_done`), as envoyproxy/ratelimit counts them;
//! - a descriptor that reaches no rule, or an `unlimited` one, is OK and
//!   counts nothing; so does every descriptor of a domain not configured.

use std::collections::HashSet;
use std::sync::Arc;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use crate::config::Rule;
mod answer;
mod descriptor;
mod plan;
mod post_hoc;
mod settle;

pub use answer::HeaderNames;
use answer::{headers_for, near_limit_hits, status, unit_of};
use plan::{Counted, Plan};
use post_hoc::post_hoc;
use settle::Role;
pub use settle::{RESERVE_ENTRY, SETTLE_ENTRY};

use crate::table::{Settings, Table};
use slicelimit::limiter::{check_each, refund_all};
use slicelimit::Limiter;
use slicelimit::{Decision, Source};

/// The most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// The most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 16;

/// The rate limit service: answers from whatever table is current.
#[derive(Debug, Clone)]
pub struct RateLimiter {
    table: Arc<ArcSwap<Table>>,
    settings: Arc<Settings>,
    /// Every rule in shadow mode (envoyproxy/ratelimit's `SHADOW_MODE`).
    shadow_everything: bool,
    /// Every rule in quota mode (envoyproxy/ratelimit's `QUOTA_MODE`).
    quota_everything: bool,
    /// Response headers for the descriptor nearest its limit
    /// (envoyproxy/ratelimit's `LIMIT_RESPONSE_HEADERS_ENABLED`).
    headers: Option<Arc<HeaderNames>>,
}

impl RateLimiter {
    /// A service answering from `table`, which a reload may swap;
    /// `settings` builds the limiters of `limit` overrides.
    pub fn new(table: Arc<ArcSwap<Table>>, settings: Settings) -> RateLimiter {
        RateLimiter {
            table,
            settings: Arc::new(settings),
            shadow_everything: false,
            quota_everything: false,
            headers: None,
        }
    }

    /// Every rule answered as a `shadow_mode` rule is (`SHADOW_MODE=true`
    /// in envoyproxy/ratelimit): OK whatever the count, a would-be denial
    /// only counted.
    #[must_use]
    pub fn shadow_everything(mut self, on: bool) -> RateLimiter {
        self.shadow_everything = on;
        self
    }

    /// How many limiters of requests' own `limit`s `domain` keeps live
    /// (0 for a domain not configured).
    pub fn overrides_live(&self, domain: &str) -> usize {
        self.table
            .load()
            .domain(domain)
            .map_or(0, |d| d.overrides.live_count())
    }

    /// Whether `rule` is in quota mode (see [`Rule::quota_mode`]).
    fn quota(&self, rule: &Rule) -> bool {
        rule.quota_mode || self.quota_everything
    }

    /// Every rule in quota mode (`QUOTA_MODE=true` in
    /// envoyproxy/ratelimit): the request is over only if every
    /// descriptor is.
    #[must_use]
    pub fn quota_everything(mut self, on: bool) -> RateLimiter {
        self.quota_everything = on;
        self
    }

    /// Adds response headers telling the limit, what is left and the
    /// seconds to its reset of the descriptor nearest its limit (the one
    /// over it, if any), as envoyproxy/ratelimit's
    /// `LIMIT_RESPONSE_HEADERS_ENABLED` does; `None`: no headers.
    #[must_use]
    pub fn response_headers(mut self, names: Option<HeaderNames>) -> RateLimiter {
        self.headers = names.map(Arc::new);
        self
    }

    /// Whether `rule` only counts its would-be denials (its own
    /// `shadow_mode`; the global one keeps each descriptor's answer and
    /// turns only the request's to OK, as envoyproxy/ratelimit does).
    fn shadow(&self, rule: &Rule) -> bool {
        rule.shadow_mode
    }

    /// Answers one request, as `ShouldRateLimit` does.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for an empty domain, no descriptors, too many
    /// descriptors or entries, or a `limit` override that cannot be a quota.
    pub async fn decide(&self, request: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let result = self.decide_inner(request).await;
        let label = match &result {
            Ok(r) if r.overall_code == Code::OverLimit as i32 => "over_limit",
            Ok(_) => "ok",
            Err(_) => "error",
        };
        metrics::counter!(crate::stats::CALLS, "result" => label).increment(1);
        result
    }

    async fn decide_inner(&self, request: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if request.domain.is_empty() {
            return Err(Status::invalid_argument("the domain must not be empty"));
        }
        if request.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "a request needs at least one descriptor",
            ));
        }
        if request.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "{} descriptors; at most {MAX_DESCRIPTORS}",
                request.descriptors.len()
            )));
        }
        let table = self.table.load_full();
        let default_cost = u64::from(request.hits_addend.max(1));
        let mut plans: Vec<Plan> = Vec::with_capacity(request.descriptors.len());
        for (i, descriptor) in request.descriptors.iter().enumerate() {
            plans.push(self.plan(&table, &request.domain, descriptor, default_cost, i)?);
        }

        // A rule another one the request reaches `replaces` is not
        // checked (as envoyproxy/ratelimit drops it).
        let replaced: HashSet<String> = plans
            .iter()
            .filter_map(Plan::rule)
            .flat_map(|r| r.rule.replaces.iter().cloned())
            .collect();
        if !replaced.is_empty() {
            for plan in &mut plans {
                let name = plan.rule().and_then(|r| r.rule.name.as_deref());
                if name.is_some_and(|n| replaced.contains(n)) {
                    *plan = Plan::Nothing;
                }
            }
        }
        // Post-hoc descriptors first: their charges are work already done,
        // counted whatever the others say, and one over its limit makes
        // the request over before anything else is counted.
        let mut charged: Vec<Option<Decided>> = Vec::with_capacity(plans.len());
        for plan in &plans {
            charged.push(match plan.counted() {
                Some(p) => match &p.role {
                    Role::Settle(id) => Some(settle::settle(&self.settings.store, p, id).await),
                    _ if p.charges() => Some(post_hoc(p).await),
                    _ => None,
                },
                None => None,
            });
        }
        let post_hoc_over = charged.iter().flatten().any(|d| d.over);
        // Enforced descriptors are decided together, all or nothing
        // (under the global shadow mode each on its own: the request
        // passes, and each counts what it admitted); shadow and
        // quota-mode ones each on its own.
        let enforced: Vec<(&Limiter, &str, u64)> = plans
            .iter()
            .filter_map(Plan::counted)
            .filter(|p| !self.shadow(&p.rule.rule) && !self.quota(&p.rule.rule) && !p.charges())
            .map(|p| (&p.limiter, p.key.as_str(), p.cost))
            .collect();
        let together = if self.shadow_everything {
            let mut each = Vec::with_capacity(enforced.len());
            for &(limiter, key, cost) in &enforced {
                each.push(limiter.check(key, cost).await);
            }
            Together::Each(each)
        } else {
            Together::All(check_each(&enforced).await)
        };
        // A rule of 0 (or an override of 0) denies the request whatever
        // the others say.
        let blocked = plans.iter().any(|p| match p {
            Plan::Blocked(rule, _) => !self.shadow(&rule.rule) && !self.quota(&rule.rule),
            _ => false,
        });
        let can_pass = together.is_allowed() && !blocked && !post_hoc_over;
        let mut in_together = together.decisions().iter();
        let mut decided: Vec<Option<Decided>> = Vec::with_capacity(plans.len());
        for (plan, charged) in plans.iter().zip(charged) {
            let Some(p) = plan.counted() else {
                decided.push(None);
                continue;
            };
            if charged.is_some() {
                decided.push(charged);
                continue;
            }
            let shadow = self.shadow(&p.rule.rule);
            let quota = self.quota(&p.rule.rule);
            let (decision, peeked) = if shadow {
                (p.limiter.check(&p.key, p.cost).await, false)
            } else if quota {
                // Counted only if the request can pass: after the
                // enforced descriptors denied, only looked at.
                if can_pass {
                    (p.limiter.check(&p.key, p.cost).await, false)
                } else {
                    (p.limiter.check(&p.key, 0).await, true)
                }
            } else {
                match in_together.next() {
                    Some(decision) => (decision.clone(), false),
                    None => (p.limiter.check(&p.key, 0).await, true),
                }
            };
            // A descriptor whose permits went back because another denied
            // reads `GivenBack`: it was within its limit. One only looked
            // at is over if its cost does not fit what is left.
            let over = if peeked {
                decision.remaining() < p.cost
            } else {
                !decision.is_allowed() && decision.source() != Source::GivenBack
            };
            decided.push(Some(Decided {
                decision,
                over,
                peeked,
                past: None,
                hits: None,
            }));
        }
        // Over if an enforced descriptor is, or if every quota-mode one is
        // (envoyproxy/ratelimit's rule); shadow rules never make it over.
        let mut quota_total = 0;
        let mut quota_over = 0;
        let mut enforced_over = false;
        for (plan, d) in plans.iter().zip(&decided) {
            let (rule, over) = match (plan, d) {
                (Plan::Blocked(rule, _), _) => (&rule.rule, true),
                (Plan::Counted(p), Some(d)) => (&p.rule.rule, d.over),
                _ => continue,
            };
            if self.shadow(rule) {
                continue;
            }
            if self.quota(rule) {
                quota_total += 1;
                quota_over += usize::from(over);
            } else {
                enforced_over |= over;
            }
        }
        let over = enforced_over || (quota_total > 0 && quota_over == quota_total);
        // Global shadow mode: the request passes, so what it took stays.
        let let_through = over && self.shadow_everything;
        // A reservation whose count stays is kept for its settlement: an
        // enforced descriptor's if the request passes (else it went
        // back), a shadow or quota-mode one's whenever it counted.
        let passes = !over || let_through;
        for (plan, d) in plans.iter().zip(&decided) {
            if let (Plan::Counted(p), Some(d)) = (plan, d) {
                if let Role::Reserve(id) = &p.role {
                    let apart = self.shadow(&p.rule.rule) || self.quota(&p.rule.rule);
                    if d.decision.is_allowed() && !d.peeked && (passes || apart) {
                        settle::keep(&self.settings.store, p, id, &d.decision).await;
                    }
                }
            }
        }
        if let_through {
            metrics::counter!(crate::stats::GLOBAL_SHADOW_MODE, "domain" => request.domain.clone())
                .increment(1);
        }
        if let (true, false, Together::All(all)) = (over, let_through, &together) {
            if all.is_allowed() && !enforced.is_empty() {
                // Over by a quota-mode or a post-hoc descriptor although
                // the enforced ones admitted: what they took goes back.
                let pairs: Vec<(&Limiter, &str)> =
                    enforced.iter().map(|&(l, k, _)| (l, k)).collect();
                refund_all(&pairs, all).await;
            }
        }
        let mut statuses = Vec::with_capacity(plans.len());
        for (plan, d) in plans.iter().zip(decided) {
            match (plan, d) {
                (Plan::Blocked(rule, unit), _) => {
                    let stats = rule.stats.for_request(&rule.rule, &[]);
                    stats.total_hits.increment(1);
                    let shadow = self.shadow(&rule.rule);
                    // Over either way; a shadow rule's is also counted as
                    // let through (as envoyproxy/ratelimit counts both).
                    stats.over_limit.increment(1);
                    if shadow {
                        stats.shadow_mode.increment(1);
                    }
                    statuses.push(DescriptorStatus {
                        code: if shadow { Code::Ok } else { Code::OverLimit } as i32,
                        current_limit: Some(RateLimit {
                            name: rule.rule.name.clone().unwrap_or_default(),
                            requests_per_unit: 0,
                            unit: unit_of(*unit) as i32,
                        }),
                        ..Default::default()
                    });
                }
                (Plan::Counted(p), Some(d)) => {
                    let stats = &p.stats;
                    // Hits as counted: a cost past any limit counts as one
                    // past u32::MAX (Envoy's own hits_addend is a u32), so
                    // a client cannot wrap the counters.
                    let hits = d.hits.unwrap_or(p.cost).min(u64::from(u32::MAX) + 1);
                    stats.total_hits.increment(hits);
                    let shadow = self.shadow(&p.rule.rule);
                    let denied = d.over && !shadow;
                    if let Some(past) = d.past {
                        // A post-hoc charge: what fit is within (near the
                        // limit past 80 %), what went past it is over.
                        let past = past.min(hits);
                        if past > 0 {
                            stats.over_limit.increment(past);
                        }
                        let within = hits - past;
                        if within > 0 {
                            stats.within_limit.increment(within);
                            let near = near_limit_hits(&d.decision, within);
                            if near > 0 {
                                stats.near_limit.increment(near);
                            }
                        }
                    } else if d.over {
                        // A shadow rule's would-be denial is over and let
                        // through: counted in both (as the reference does).
                        stats.over_limit.increment(hits);
                        if shadow {
                            stats.shadow_mode.increment(hits);
                        }
                    } else if d.decision.is_allowed() && !d.peeked && (!over || let_through) {
                        // Admitted and kept (not given back because
                        // another descriptor denied, not merely looked at).
                        stats.within_limit.increment(hits);
                        let near = near_limit_hits(&d.decision, hits);
                        if near > 0 {
                            stats.near_limit.increment(near);
                        }
                    }
                    let mut answer = status(p, &d.decision, denied);
                    if p.charges() && d.over {
                        // Charged past the limit (or nothing left): a
                        // replica's look may predate what others charged.
                        answer.limit_remaining = 0;
                    }
                    statuses.push(answer);
                }
                (plan, _) => {
                    let unlimited = matches!(plan, Plan::Unlimited(_));
                    statuses.push(DescriptorStatus {
                        code: Code::Ok as i32,
                        limit_remaining: if unlimited { u32::MAX } else { 0 },
                        ..Default::default()
                    });
                }
            }
        }
        let response_headers_to_add = match &self.headers {
            Some(names) => headers_for(names, &statuses),
            None => Vec::new(),
        };
        Ok(RateLimitResponse {
            overall_code: if over && !let_through {
                Code::OverLimit
            } else {
                Code::Ok
            } as i32,
            statuses,
            response_headers_to_add,
            ..Default::default()
        })
    }
}

/// The enforced descriptors' decisions: together (all or nothing, one
/// decision of parts), or each on its own (global shadow mode).
enum Together {
    All(Decision),
    Each(Vec<Decision>),
}

impl Together {
    fn is_allowed(&self) -> bool {
        match self {
            Together::All(all) => all.is_allowed(),
            Together::Each(each) => each.iter().all(Decision::is_allowed),
        }
    }

    /// One decision per enforced descriptor, in order.
    fn decisions(&self) -> &[Decision] {
        match self {
            Together::All(all) => all.quotas(),
            Together::Each(each) => each,
        }
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.decide(request.into_inner()).await.map(Response::new)
    }
}

/// One counted descriptor's decision.
struct Decided {
    decision: Decision,
    /// Over its limit (a decision given back because another descriptor
    /// denied is not).
    over: bool,
    /// Only looked at (cost 0), not counted.
    peeked: bool,
    /// A post-hoc charge: the hits counted past the limit.
    past: Option<u64>,
    /// The hits its stats count, where not the descriptor's (a
    /// settlement counts what it charged beyond its reservation).
    hits: Option<u64>,
}
