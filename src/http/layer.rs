//! The layer: configuration, validated and formatted once, shared by every
//! service it builds.

use std::fmt;
use std::sync::Arc;

use tower::Layer;

use super::headers::PolicyHeaders;
use super::key::{KeyExtractor, MissingKey, RequestView};
use super::service::RateLimit;
use crate::Limiter;

type CostFn = dyn Fn(&RequestView<'_>) -> u64 + Send + Sync;

/// Rate-limits HTTP requests with a [`Limiter`].
///
/// ```no_run
/// # async fn demo() -> Result<(), slicelimit::Error> {
/// use slicelimit::http::{KeyExtractor, MissingKey, RateLimitLayer};
/// use slicelimit::{HybridConfig, Limiter, Quota};
///
/// let limiter = Limiter::builder(Quota::per_minute(100))
///     .hybrid(HybridConfig::strict())
///     .build()?;
/// let layer = RateLimitLayer::new(limiter)
///     .key(KeyExtractor::header("x-api-key"))
///     .on_missing_key(MissingKey::Reject(http::StatusCode::UNAUTHORIZED))
///     .policy_name("coupons");
/// // axum::Router::new().route(...).layer(layer)
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct RateLimitLayer {
    default: RouteSpec,
    routes: Vec<RouteSpec>,
    key: KeyExtractor,
    missing: MissingKey,
    cost: Arc<CostFn>,
    shadow: bool,
    legacy: bool,
}

#[derive(Clone)]
struct RouteSpec {
    prefix: String,
    limiter: Limiter,
    name: String,
}

/// A route's limiter with its headers formatted.
pub(crate) struct Route {
    pub(crate) limiter: Limiter,
    pub(crate) headers: PolicyHeaders,
    pub(crate) name: String,
    prefix: String,
}

/// What every service built by one `layer()` call shares.
pub(crate) struct Prepared {
    default: Route,
    /// Longest prefix first.
    routes: Vec<Route>,
    pub(crate) key: KeyExtractor,
    pub(crate) missing: MissingKey,
    pub(crate) cost: Arc<CostFn>,
    pub(crate) shadow: bool,
}

impl Prepared {
    pub(crate) fn route(&self, path: &str) -> &Route {
        self.routes
            .iter()
            .find(|r| path.starts_with(&r.prefix))
            .unwrap_or(&self.default)
    }
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.default.name)
            .field(
                "routes",
                &self.routes.iter().map(|r| &r.prefix).collect::<Vec<_>>(),
            )
            .field("key", &self.key)
            .field("missing", &self.missing)
            .field("shadow", &self.shadow)
            .finish()
    }
}

impl RateLimitLayer {
    /// Limits every request with `limiter`, keyed by the `x-api-key` header
    /// unless told otherwise; each request costs 1.
    pub fn new(limiter: Limiter) -> Self {
        RateLimitLayer {
            default: RouteSpec {
                prefix: String::new(),
                limiter,
                name: "default".to_owned(),
            },
            routes: Vec::new(),
            key: KeyExtractor::header("x-api-key"),
            missing: MissingKey::default(),
            cost: Arc::new(|_| 1),
            shadow: false,
            legacy: false,
        }
    }

    /// How the key is found (default: the `x-api-key` header).
    pub fn key(mut self, key: KeyExtractor) -> Self {
        self.key = key;
        self
    }

    /// What a request without a key gets (default: 401).
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// What a request costs, in permits (default 1).
    pub fn cost(mut self, cost: impl Fn(&RequestView<'_>) -> u64 + Send + Sync + 'static) -> Self {
        self.cost = Arc::new(cost);
        self
    }

    /// The policy name in `RateLimit-Policy` / `RateLimit` (default
    /// `"default"`).
    pub fn policy_name(mut self, name: &str) -> Self {
        self.default.name = name.to_owned();
        self
    }

    /// Requests whose path starts with `prefix` use `limiter` (and the
    /// policy `name`) instead; the longest matching prefix wins.
    pub fn route(mut self, prefix: &str, name: &str, limiter: Limiter) -> Self {
        self.routes.push(RouteSpec {
            prefix: prefix.to_owned(),
            limiter,
            name: name.to_owned(),
        });
        self
    }

    /// Shadow (dry-run) mode: decide and record, but let every request
    /// through unchanged. For trying a limit on live traffic.
    pub fn shadow(mut self, on: bool) -> Self {
        self.shadow = on;
        self
    }

    /// Also send the legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset`
    /// headers.
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.legacy = on;
        self
    }

    fn prepare(&self) -> Prepared {
        let route = |spec: &RouteSpec| Route {
            headers: PolicyHeaders::new(&spec.name, &spec.limiter.quota(), self.legacy),
            limiter: spec.limiter.clone(),
            name: spec.name.clone(),
            prefix: spec.prefix.clone(),
        };
        let mut routes: Vec<Route> = self.routes.iter().map(route).collect();
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
        Prepared {
            default: route(&self.default),
            routes,
            key: self.key.clone(),
            missing: self.missing.clone(),
            cost: self.cost.clone(),
            shadow: self.shadow,
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit::new(inner, Arc::new(self.prepare()))
    }
}
