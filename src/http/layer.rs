//! The layer: configuration, validated and formatted once, shared by every
//! service it builds.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Response};
use tokio::time::Instant;
use tower::Layer;

use super::headers::PolicyHeaders;
use super::key::{KeyExtractor, MissingKey, RequestView};
use super::reject::Rejection;
use super::service::RateLimit;
use crate::{Decision, Limiter};

type CostFn = dyn Fn(&RequestView<'_>) -> u64 + Send + Sync;
type ExemptFn = dyn Fn(&RequestView<'_>) -> bool + Send + Sync;
type RejectFn = dyn Fn(&Rejection, Response<Bytes>) -> Response<Bytes> + Send + Sync;
type RefundFn = dyn Fn(http::StatusCode) -> bool + Send + Sync;

/// Rate-limits HTTP (and gRPC) requests with one or more [`Limiter`]s.
///
/// ```no_run
/// # async fn demo() -> Result<(), slicelimit::Error> {
/// use slicelimit::http::{KeyExtractor, MissingKey, RateLimitLayer};
/// use slicelimit::{nonzero, HybridConfig, Limiter, Quota, RedisStore};
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let limiter = Limiter::builder(Quota::per_minute(nonzero!(100)))
///     .store(store.clone())
///     .hybrid(HybridConfig::strict())
///     .namespace("api")
///     .build()?;
/// let login = Limiter::builder(Quota::per_minute(nonzero!(5)))
///     .store(store)
///     .namespace("login")
///     .build()?;
/// let layer = RateLimitLayer::new(limiter)
///     .key(KeyExtractor::header("x-api-key"))
///     .on_missing_key(MissingKey::Reject(http::StatusCode::UNAUTHORIZED))
///     .policy_name("api")
///     .route("/login", "login", login);
/// // axum::Router::new().route(...).layer(layer)
/// # Ok(())
/// # }
/// ```
///
/// Every limiter of one layer counts in its own store keys: adding a
/// limiter built separately with the same namespace and algorithm as one
/// already in the layer panics, since the two would silently count the
/// same requests (give each its own [`namespace`](crate::Builder::namespace),
/// or pass clones of one limiter to share a budget on purpose).
#[derive(Clone)]
#[must_use]
pub struct RateLimitLayer {
    default: RouteSpec,
    routes: Vec<RouteSpec>,
    /// Policies every limited request counts against, besides its route's.
    also: Vec<PolicySpec>,
    key: KeyExtractor,
    missing: MissingKey,
    cost: Arc<CostFn>,
    allow_zero_cost: bool,
    methods: Option<Vec<Method>>,
    exempt: Option<Arc<ExemptFn>>,
    on_reject: Option<Arc<RejectFn>>,
    challenge: Option<HeaderValue>,
    shadow: bool,
    legacy: bool,
    /// How long a denied request may wait to be admitted (zero: no wait).
    wait: Duration,
    refund_on: Option<Arc<RefundFn>>,
}

#[derive(Clone)]
struct PolicySpec {
    name: String,
    limiter: Limiter,
    /// `None`: the layer's key.
    key: Option<KeyExtractor>,
}

#[derive(Clone)]
struct RouteSpec {
    prefix: String,
    methods: Option<Vec<Method>>,
    policy: PolicySpec,
}

/// A limiter with its headers formatted.
pub(crate) struct Policy {
    pub(crate) limiter: Limiter,
    pub(crate) headers: PolicyHeaders,
    /// `None`: the layer's key.
    key: Option<KeyExtractor>,
}

/// A route: which requests, and the policy they count against.
pub(crate) struct Route {
    prefix: String,
    methods: Option<Vec<Method>>,
    policy: Policy,
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
    routes: Vec<Route>,
    also: Vec<Policy>,
    pub(crate) key: KeyExtractor,
    pub(crate) missing: MissingKey,
    cost: Arc<CostFn>,
    allow_zero_cost: bool,
    methods: Option<Vec<Method>>,
    exempt: Option<Arc<ExemptFn>>,
    on_reject: Option<Arc<RejectFn>>,
    pub(crate) challenge: HeaderValue,
    pub(crate) shadow: bool,
    wait: Duration,
    refund_on: Option<Arc<RefundFn>>,
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
    /// `key`, in the order of [`policies`](Prepared::policies); `None` if
    /// a policy's own key is missing and such requests are rejected.
    pub(crate) fn keys(
        &self,
        route: usize,
        request: &RequestView<'_>,
        key: String,
    ) -> Option<Vec<String>> {
        let mut keys = Vec::with_capacity(1 + self.also.len());
        for policy in self.policies(route) {
            let own = match &policy.key {
                None => key.clone(),
                Some(extractor) => match (extractor.extract(request), &self.missing) {
                    (Some(own), _) => own,
                    (None, MissingKey::Shared(shared)) => shared.clone(),
                    (None, MissingKey::Reject(_)) => return None,
                },
            };
            keys.push(own);
        }
        Some(keys)
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

    /// Whether a request with these decisions (one per policy) waits:
    /// waiting is on, the request was denied (not in shadow mode, where
    /// every request passes at once), and every denial says it could
    /// pass within the wait.
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
    /// The policies that admitted at once keep their count, as they do
    /// when another policy denies.
    pub(crate) async fn wait_out(
        &self,
        route: usize,
        keys: &[String],
        cost: u64,
        began: Instant,
        decisions: &mut [Decision],
    ) {
        let deadline = crate::wait::deadline_from(began, self.wait);
        let policies: Vec<&Policy> = self.policies(route).collect();
        let mut denied: Vec<usize> = (0..decisions.len())
            .filter(|&i| !decisions[i].is_allowed())
            .collect();
        denied.sort_by_key(|&i| std::cmp::Reverse(decisions[i].retry_after()));
        for (n, i) in denied.into_iter().enumerate() {
            let limiter = &policies[i].limiter;
            let key = keys[i].as_str();
            let asked = Instant::now();
            let first = match n {
                0 => decisions[i].clone(),
                // Past the budget, no policy is asked again: the request
                // is answered within the budget and one decision.
                _ if asked >= deadline => return,
                _ => limiter.check(key, cost).await,
            };
            let took = if n == 0 {
                Duration::ZERO
            } else {
                asked.elapsed()
            };
            let decision = limiter.retry_until(key, cost, first, deadline, took).await;
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
    ) -> Response<Bytes> {
        let response = rejection.respond(quoted, headers, &self.challenge);
        match &self.on_reject {
            Some(hook) => hook(rejection, response),
            None => response,
        }
    }
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.default.policy.name)
            .field(
                "routes",
                &self.routes.iter().map(|r| &r.prefix).collect::<Vec<_>>(),
            )
            .field(
                "also",
                &self.also.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .field("key", &self.key)
            .field("missing", &self.missing)
            .field("shadow", &self.shadow)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Limits every request with `limiter`, keyed by the `x-api-key` header
    /// unless told otherwise; each request costs 1.
    pub fn new(limiter: Limiter) -> Self {
        RateLimitLayer {
            default: RouteSpec {
                prefix: String::new(),
                methods: None,
                policy: PolicySpec {
                    name: "default".to_owned(),
                    limiter,
                    key: None,
                },
            },
            routes: Vec::new(),
            also: Vec::new(),
            key: KeyExtractor::header("x-api-key"),
            missing: MissingKey::default(),
            cost: Arc::new(|_| 1),
            allow_zero_cost: false,
            methods: None,
            exempt: None,
            on_reject: None,
            challenge: None,
            shadow: false,
            legacy: false,
            wait: Duration::ZERO,
            refund_on: None,
        }
    }

    /// How the key is found (default: the `x-api-key` header). A key
    /// longer than 64 bytes is hashed by the limiter before it reaches any
    /// per-process map, so a client sending huge keys costs a bounded
    /// number of bytes per key.
    pub fn key(mut self, key: KeyExtractor) -> Self {
        self.key = key;
        self
    }

    /// What a request without a key gets (default: 401 with a
    /// `WWW-Authenticate` challenge).
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// The `WWW-Authenticate` challenge sent with a 401 for a request
    /// without a key (default: `ApiKey header="x-api-key"` for a header
    /// key, `ApiKey` otherwise).
    pub fn challenge(mut self, challenge: HeaderValue) -> Self {
        self.challenge = Some(challenge);
        self
    }

    /// What a request costs, in permits (default 1). A cost of 0 is
    /// counted as 1 unless [`allow_zero_cost`](RateLimitLayer::allow_zero_cost)
    /// is set, so a cost read from client input cannot be a free pass.
    pub fn cost(mut self, cost: impl Fn(&RequestView<'_>) -> u64 + Send + Sync + 'static) -> Self {
        self.cost = Arc::new(cost);
        self
    }

    /// Let a cost of 0 through as 0: the request is admitted while the
    /// quota has a permit left, and takes none.
    pub fn allow_zero_cost(mut self, on: bool) -> Self {
        self.allow_zero_cost = on;
        self
    }

    /// The name of the default policy in headers and problem bodies
    /// (default `"default"`).
    pub fn policy_name(mut self, name: &str) -> Self {
        self.default.policy.name = name.to_owned();
        self
    }

    /// Requests whose path is `prefix` or below it (whole segments:
    /// `/admin` matches `/admin/x`, not `/administrator`) use `limiter`
    /// and the policy `name` instead of the default; the longest matching
    /// prefix wins.
    ///
    /// # Panics
    /// If `limiter` was built separately from a limiter already in this
    /// layer yet has the same namespace and algorithm (they would count
    /// the same requests).
    pub fn route(self, prefix: &str, name: &str, limiter: Limiter) -> Self {
        self.route_spec(prefix, None, name, limiter)
    }

    /// [`route`](RateLimitLayer::route) for the requests of `methods` only;
    /// it wins over a route of the same prefix for every method.
    ///
    /// # Panics
    /// As [`route`](RateLimitLayer::route).
    pub fn route_methods(
        self,
        methods: &[Method],
        prefix: &str,
        name: &str,
        limiter: Limiter,
    ) -> Self {
        self.route_spec(prefix, Some(methods.to_vec()), name, limiter)
    }

    /// Every limited request also counts against `limiter` (policy
    /// `name`), whatever its route: for instance a per-second burst limit
    /// beside a per-hour quota. A request is admitted only if every policy
    /// admits it; each policy counts it either way, and a denial lists
    /// every policy that denied it.
    ///
    /// # Panics
    /// As [`route`](RateLimitLayer::route).
    pub fn also(mut self, name: &str, limiter: Limiter) -> Self {
        self.refuse_shared_keys(&limiter);
        self.also.push(PolicySpec {
            name: name.to_owned(),
            limiter,
            key: None,
        });
        self
    }

    /// [`also`](RateLimitLayer::also), keyed by its own extractor: a user
    /// policy keyed by the API key beside an organisation policy keyed by
    /// the `x-org-id` header. A request without this policy's key is
    /// handled as [`on_missing_key`](RateLimitLayer::on_missing_key) says.
    ///
    /// ```
    /// use slicelimit::http::{KeyExtractor, RateLimitLayer};
    /// use slicelimit::{nonzero, Limiter, MemoryStore, Quota};
    ///
    /// let store = MemoryStore::new();
    /// let users = Limiter::builder(Quota::per_minute(nonzero!(60)))
    ///     .store(store.clone())
    ///     .namespace("user")
    ///     .build()
    ///     .unwrap();
    /// let orgs = Limiter::builder(Quota::per_minute(nonzero!(600)))
    ///     .store(store)
    ///     .namespace("org")
    ///     .build()
    ///     .unwrap();
    /// let layer = RateLimitLayer::new(users)
    ///     .key(KeyExtractor::header("x-api-key"))
    ///     .also_keyed("org", orgs, KeyExtractor::header("x-org-id"));
    /// # let _ = layer;
    /// ```
    ///
    /// # Panics
    /// As [`route`](RateLimitLayer::route).
    pub fn also_keyed(mut self, name: &str, limiter: Limiter, key: KeyExtractor) -> Self {
        self.refuse_shared_keys(&limiter);
        self.also.push(PolicySpec {
            name: name.to_owned(),
            limiter,
            key: Some(key),
        });
        self
    }

    /// Only requests of these methods are limited; others pass untouched.
    pub fn methods(mut self, methods: &[Method]) -> Self {
        self.methods = Some(methods.to_vec());
        self
    }

    /// Requests for which `exempt` is true pass untouched (health checks,
    /// CORS preflights, internal callers).
    pub fn exempt(
        mut self,
        exempt: impl Fn(&RequestView<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.exempt = Some(Arc::new(exempt));
        self
    }

    /// Shapes the layer's own answers (429, 503, missing key): `hook` gets
    /// what happened and the default response (rate-limit headers
    /// included) and returns the response to send.
    pub fn on_reject(
        mut self,
        hook: impl Fn(&Rejection, Response<Bytes>) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.on_reject = Some(Arc::new(hook));
        self
    }

    /// Shadow (dry-run) mode: decide and record, but let every request
    /// through unchanged — a request without a key too. For trying a
    /// limit on live traffic.
    pub fn shadow(mut self, on: bool) -> Self {
        self.shadow = on;
        self
    }

    /// Lets a denied request wait up to `max` to be admitted instead of
    /// being answered 429 at once (default: no wait). When every policy
    /// that denied it says the request could pass within `max`
    /// ([`Decision::retry_after`]), the request waits as
    /// [`Limiter::acquire`] does (jittered, asking again at each retry
    /// time) and proceeds if admitted; otherwise, or when the wait runs
    /// out, it gets the 429 (or 503) it would have got, at once and never
    /// later than `max` after the layer began deciding (plus one store
    /// call). Shadow mode never waits.
    ///
    /// A waiting request holds its connection and task: bound how many
    /// there can be (a concurrency limit in front of this layer) when
    /// `max` is long.
    pub fn wait_up_to(mut self, max: Duration) -> Self {
        self.wait = max;
        self
    }

    /// Gives an admitted request's permits back when the inner service
    /// answers with a status `refund` picks, e.g. `|s| s.is_server_error()`:
    /// a request that failed on the server need not cost the client its
    /// quota. The refund goes to the window the permits came from and is
    /// ignored once that window ended (see
    /// [`Limiter::refund`](crate::Limiter::refund)); it is sent in the
    /// background, after the response. HTTP status only: a gRPC error
    /// travels in `grpc-status` trailers and is not seen here.
    pub fn refund_on(
        mut self,
        refund: impl Fn(http::StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.refund_on = Some(Arc::new(refund));
        self
    }

    /// Also send the legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset`
    /// headers.
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.legacy = on;
        self
    }

    fn route_spec(
        mut self,
        prefix: &str,
        methods: Option<Vec<Method>>,
        name: &str,
        limiter: Limiter,
    ) -> Self {
        self.refuse_shared_keys(&limiter);
        self.routes.push(RouteSpec {
            prefix: prefix.trim_end_matches('/').to_owned(),
            methods,
            policy: PolicySpec {
                name: name.to_owned(),
                limiter,
                key: None,
            },
        });
        self
    }

    fn limiters(&self) -> impl Iterator<Item = &Limiter> {
        std::iter::once(&self.default.policy.limiter)
            .chain(self.routes.iter().map(|r| &r.policy.limiter))
            .chain(self.also.iter().map(|p| &p.limiter))
    }

    fn refuse_shared_keys(&self, limiter: &Limiter) {
        if let Some(other) = self
            .limiters()
            .find(|other| !other.same_as(limiter) && other.shares_keys_with(limiter))
        {
            panic!(
                "two limiters of one RateLimitLayer share the namespace {:?} and algorithm {}: \
                 they would count the same requests; give each its own namespace \
                 (or pass clones of one limiter to share a budget)",
                other.namespace(),
                other.algorithm().as_str()
            );
        }
    }

    fn prepare(&self) -> Prepared {
        let policy = |spec: &PolicySpec| Policy {
            headers: PolicyHeaders::new(&spec.name, &spec.limiter.quota()).legacy(self.legacy),
            limiter: spec.limiter.clone(),
            key: spec.key.clone(),
        };
        let route = |spec: &RouteSpec| Route {
            prefix: spec.prefix.clone(),
            methods: spec.methods.clone(),
            policy: policy(&spec.policy),
        };
        let mut routes: Vec<Route> = self.routes.iter().map(route).collect();
        // Longest prefix first; at equal length, a method filter first.
        routes.sort_by_key(|r| (std::cmp::Reverse(r.prefix.len()), r.methods.is_none()));
        routes.push(route(&self.default));
        let challenge = self.challenge.clone().unwrap_or_else(|| {
            HeaderValue::from_str(&self.key.challenge())
                .unwrap_or_else(|_| HeaderValue::from_static("ApiKey"))
        });
        Prepared {
            routes,
            also: self.also.iter().map(policy).collect(),
            key: self.key.clone(),
            missing: self.missing.clone(),
            cost: self.cost.clone(),
            allow_zero_cost: self.allow_zero_cost,
            methods: self.methods.clone(),
            exempt: self.exempt.clone(),
            on_reject: self.on_reject.clone(),
            challenge,
            shadow: self.shadow,
            wait: self.wait,
            refund_on: self.refund_on.clone(),
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit::new(inner, Arc::new(self.prepare()))
    }
}
