//! What every service one layer builds shares: the routes and policies,
//! formatted once, and the steps of a request that involve more than one
//! policy (their keys, their refunds, waiting out their denials).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Response};
use slicelimit::{Decision, Limiter};
use tokio::time::Instant;

use crate::headers::PolicyHeaders;
use crate::key::{KeyExtractor, MissingKey, RequestView};
use crate::reject::Rejection;

pub(crate) type CostFn = dyn Fn(&RequestView<'_>) -> u64 + Send + Sync;
pub(crate) type ExemptFn = dyn Fn(&RequestView<'_>) -> bool + Send + Sync;
pub(crate) type RejectFn = dyn Fn(&Rejection, Response<Bytes>) -> Response<Bytes> + Send + Sync;
pub(crate) type RefundFn = dyn Fn(http::StatusCode) -> bool + Send + Sync;

/// A limiter with its headers formatted.
pub(crate) struct Policy {
    pub(crate) limiter: Limiter,
    pub(crate) headers: PolicyHeaders,
    /// `None`: the layer's key.
    pub(crate) key: Option<KeyExtractor>,
}

/// A route: which requests, and the policy they count against.
pub(crate) struct Route {
    pub(crate) prefix: String,
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) policy: Policy,
}

impl Route {
    /// Matches by whole path segments: `/admin` matches `/admin` and
    /// `/admin/x`, never `/administrator`.
    fn matches(&self, method: &Method, path: &str) -> bool {
        let segment = path == self.prefix
            || path
                .strip_prefix(self.prefix.as_str())
                .is_some_and(|rest| rest.starts_with('/'));
        segment
            && self
                .methods
                .as_ref()
                .is_none_or(|methods| listed(methods, method))
    }
}

/// Whether a method filter names `method`. HEAD counts as GET: servers
/// (axum, hyper) answer a HEAD with the GET handler, so a filter on GET
/// that let HEAD through would leave that handler unlimited.
fn listed(methods: &[Method], method: &Method) -> bool {
    methods.contains(method) || (*method == Method::HEAD && methods.contains(&Method::GET))
}

/// What every service built by one `layer()` call shares.
pub(crate) struct Prepared {
    /// Most specific first; the default route (matching everything) last.
    pub(crate) routes: Vec<Route>,
    pub(crate) also: Vec<Policy>,
    pub(crate) key: KeyExtractor,
    pub(crate) missing: MissingKey,
    pub(crate) cost: Arc<CostFn>,
    pub(crate) allow_zero_cost: bool,
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) exempt: Option<Arc<ExemptFn>>,
    pub(crate) on_reject: Option<Arc<RejectFn>>,
    pub(crate) challenge: HeaderValue,
    pub(crate) shadow: bool,
    pub(crate) wait: Duration,
    pub(crate) refund_on: Option<Arc<RefundFn>>,
}

impl Prepared {
    /// Whether the request is limited at all.
    pub(crate) fn limits(&self, request: &RequestView<'_>) -> bool {
        self.methods
            .as_ref()
            .is_none_or(|methods| listed(methods, request.method))
            && !self.exempt.as_ref().is_some_and(|exempt| exempt(request))
    }

    /// The index of the request's route.
    pub(crate) fn route(&self, method: &Method, path: &str) -> usize {
        self.routes
            .iter()
            .position(|r| r.matches(method, path))
            .unwrap_or(self.routes.len() - 1)
    }

    /// The policies a request of route `route` counts against, in the
    /// order of its decisions.
    pub(crate) fn policies(&self, route: usize) -> impl Iterator<Item = &Policy> {
        std::iter::once(&self.routes[route].policy).chain(&self.also)
    }

    /// Each policy's key for a request of route `route` whose layer key is
    /// `key`, in the order of [`policies`](Prepared::policies); `Err` with
    /// the index of a policy whose own key is missing, where such requests
    /// are rejected.
    pub(crate) fn keys(
        &self,
        route: usize,
        request: &RequestView<'_>,
        key: String,
    ) -> Result<Vec<String>, usize> {
        let mut keys = Vec::with_capacity(1 + self.also.len());
        for (index, policy) in self.policies(route).enumerate() {
            let own = match &policy.key {
                None => key.clone(),
                Some(extractor) => match (extractor.extract(request), &self.missing) {
                    (Some(own), _) => own,
                    (None, MissingKey::Shared(shared)) => shared.clone(),
                    (None, MissingKey::Reject(_)) => return Err(index),
                },
            };
            keys.push(own);
        }
        Ok(keys)
    }

    /// The `WWW-Authenticate` challenge of a 401 for a request whose key
    /// is missing: the layer's, or where the key of policy `index` of
    /// route `route` is the one missing, that policy's own header.
    pub(crate) fn challenge_for(&self, route: usize, index: Option<usize>) -> HeaderValue {
        index
            .and_then(|i| self.policies(route).nth(i))
            .and_then(|policy| policy.key.as_ref())
            .and_then(|key| HeaderValue::from_str(&key.challenge()).ok())
            .unwrap_or_else(|| self.challenge.clone())
    }

    /// What the request costs: never 0 unless allowed, since a cost of 0
    /// asks without counting.
    pub(crate) fn cost(&self, request: &RequestView<'_>) -> u64 {
        let cost = (self.cost)(request);
        if cost == 0 && !self.allow_zero_cost {
            1
        } else {
            cost
        }
    }

    /// Adds every policy's headers for `decisions` (one per policy, in
    /// order) to `headers`.
    pub(crate) fn append_headers(
        &self,
        route: usize,
        decisions: &[Decision],
        headers: &mut http::HeaderMap,
    ) {
        for (policy, decision) in self.policies(route).zip(decisions) {
            policy.headers.append_to(headers, decision);
        }
    }

    /// Whether some response can get its permits back.
    pub(crate) fn refunds_any(&self) -> bool {
        self.refund_on.is_some()
    }

    /// Whether a response with `status` gets its permits back.
    pub(crate) fn refunds(&self, status: http::StatusCode) -> bool {
        self.refund_on.as_ref().is_some_and(|f| f(status))
    }

    /// Gives back, in the background, what each admitting decision of
    /// `route` took: a request another policy denied (the layer's
    /// policies are all-or-nothing), or one whose response earns a refund.
    pub(crate) fn refund(&self, route: usize, keys: &[String], decisions: &[Decision]) {
        let refunds: Vec<(Limiter, String, Decision)> = self
            .policies(route)
            .zip(keys)
            .zip(decisions)
            .filter(|(_, d)| d.is_refundable())
            .map(|((p, k), d)| (p.limiter.clone(), k.clone(), d.clone()))
            .collect();
        if refunds.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            for (limiter, key, decision) in refunds {
                limiter.refund(&key, &decision).await;
            }
        });
    }

    /// Whether a request with these decisions (one per policy) waits:
    /// waiting is on, the request was denied (not in shadow mode, where
    /// every request passes at once), and every denial says it could
    /// pass within the wait.
    pub(crate) fn waits_for<'a>(&self, decisions: impl IntoIterator<Item = &'a Decision>) -> bool {
        if self.wait.is_zero() || self.shadow {
            return false;
        }
        let mut denied = decisions.into_iter().filter(|d| !d.is_allowed()).peekable();
        denied.peek().is_some() && denied.all(|d| d.retry_after().is_some_and(|r| r <= self.wait))
    }

    /// Waits out the denials among `decisions` (one per policy of route
    /// `route`, asked from `began` on), replacing each with the decision
    /// that ended its wait. The policies share the one budget; the
    /// longest wait goes first, so that when it runs out, the policies
    /// behind it have not been asked again and have taken nothing more.
    /// Once it is over, the others' retry times have passed too: they are
    /// asked afresh, not after the retries their first denials named.
    /// The policies that admitted at once keep their count while it
    /// waits; if the wait ends denied, they are refunded as for any
    /// denial.
    pub(crate) async fn wait_out(
        &self,
        route: usize,
        keys: &[String],
        cost: u64,
        began: Instant,
        decisions: &mut [Decision],
    ) {
        let deadline = began + self.wait;
        let policies: Vec<&Policy> = self.policies(route).collect();
        let mut denied: Vec<usize> = (0..decisions.len())
            .filter(|&i| !decisions[i].is_allowed())
            .collect();
        denied.sort_by_key(|&i| std::cmp::Reverse(decisions[i].retry_after()));
        for (n, i) in denied.into_iter().enumerate() {
            let limiter = &policies[i].limiter;
            let key = keys[i].as_str();
            let decision = match n {
                // Its denial was just seen: no need to ask before the
                // retry time it names.
                0 => {
                    limiter
                        .wait_out(key, cost, decisions[i].clone(), deadline)
                        .await
                }
                // Past the budget, no policy is asked again: the request
                // is answered within the budget and one decision.
                _ if Instant::now() >= deadline => return,
                // Its first denial is stale by now: asked afresh, then
                // waited out within what is left of the budget.
                _ => limiter.acquire_until(key, cost, deadline).await,
            };
            let admitted = decision.is_allowed();
            decisions[i] = decision;
            if !admitted {
                return;
            }
        }
    }

    /// The layer's answer, through the user's hook if there is one.
    pub(crate) fn reject(
        &self,
        rejection: &Rejection,
        quoted: &[&str],
        headers: http::HeaderMap,
        challenge: &HeaderValue,
    ) -> Response<Bytes> {
        let response = rejection.respond(quoted, headers, challenge);
        match &self.on_reject {
            Some(hook) => hook(rejection, response),
            None => response,
        }
    }
}
