//! The layer: configuration, validated and formatted once, shared by every
//! service it builds.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Response};
use slicelimit::{Limiter, Quota};
use tower::Layer;

use crate::headers::PolicyHeaders;
use crate::key::{KeyExtractor, MissingKey, RequestView};
use crate::prepared::{CostFn, ExemptFn, Policy, Prepared, RefundFn, RejectFn, Route};
use crate::reject::Rejection;
use crate::service::RateLimit;

/// Rate-limits HTTP (and gRPC) requests with one or more [`Limiter`]s.
///
/// ```no_run
/// # async fn demo() -> Result<(), slicelimit::Error> {
/// use slicelimit_tower::{KeyExtractor, MissingKey, RateLimitLayer};
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
/// same requests (give each its own [`namespace`](slicelimit::Builder::namespace),
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
    /// use slicelimit_tower::{KeyExtractor, RateLimitLayer};
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
    /// ([`Decision::retry_after`](slicelimit::Decision::retry_after)), the request waits as
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
        // No retry is further away than the longest period, so a longer
        // wait is that long, and an absurd `max` (`Duration::MAX`) cannot
        // overflow the clock when a deadline is taken from it.
        self.wait = max.min(Quota::MAX_PERIOD);
        self
    }

    /// Gives an admitted request's permits back when the inner service
    /// answers with a status `refund` picks, e.g. `|s| s.is_server_error()`:
    /// a request that failed on the server need not cost the client its
    /// quota. The refund goes to the window the permits came from and is
    /// ignored once that window ended (see
    /// [`Limiter::refund`](slicelimit::Limiter::refund)); it is sent in the
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
