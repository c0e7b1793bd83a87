//! Tower layers for [slicelimit]: HTTP and gRPC rate limits
//! and in-flight limits for axum, hyper and tonic services.
//!
//! ```no_run
//! use slicelimit::{nonzero, HybridConfig, Limiter, Quota, RedisStore};
//! use slicelimit_tower::{KeyExtractor, RateLimitLayer};
//!
//! # async fn demo() -> Result<(), slicelimit::Error> {
//! let limiter = Limiter::builder(Quota::per_minute(nonzero!(100)))
//!     .store(RedisStore::connect("redis://127.0.0.1:6379").await?)
//!     .hybrid(HybridConfig::strict())
//!     .build()?;
//! let layer = RateLimitLayer::new(limiter).key(KeyExtractor::header("x-api-key"));
//! // axum: Router::new().route(..).layer(layer)
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! [`RateLimitLayer`] is a tower [`Layer`](tower::Layer) that rate-limits
//! requests with one or more [`Limiter`](slicelimit::Limiter)s and always
//! returns a response (a denial is a response, never an error):
//!
//! - over quota: `429 Too Many Requests` with `Retry-After`, the IETF
//!   `RateLimit-Policy` / `RateLimit` headers and a problem+json body
//!   listing every violated policy; gRPC requests get a trailers-only
//!   answer with `grpc-status: 8` (`RESOURCE_EXHAUSTED`); with
//!   [`RateLimitLayer::wait_up_to`], a denial that would pass within a
//!   bounded wait is waited out first;
//! - limiter unavailable under fail-closed: `503` with the
//!   `temporary-reduced-capacity` problem type (gRPC `UNAVAILABLE`);
//! - no key: the configured status (401 with `WWW-Authenticate` by
//!   default), or a shared key.
//!
//! [`InFlightLayer`] limits requests *in flight* per key instead, with a
//! [`ConcurrencyLimiter`](slicelimit::ConcurrencyLimiter): `429` with
//! `Retry-After` and a problem type of its own when every slot is taken
//! (after a bounded wait, if configured), `503` when the store cannot
//! answer under fail-closed; the slot is held until the response body is
//! finished or dropped.
//!
//! Keys a client cannot choose: [`ClientIp`] reads forwarding headers only
//! from trusted proxies (rightmost-untrusted rule, `X-Forwarded-For` or
//! RFC 7239 `Forwarded`) and keys IPv6 clients per /64.
//!
//! # Problem types
//!
//! | status | `type` | when |
//! |---|---|---|
//! | 429 | [`PROBLEM_TYPE`] (IANA `quota-exceeded`) | over quota ([`RateLimitLayer`]) |
//! | 503 | [`PROBLEM_TYPE_UNAVAILABLE`] (IANA `temporary-reduced-capacity`) | the limiter cannot decide and fails closed (either layer) |
//! | 429 | [`PROBLEM_TYPE_IN_FLIGHT`] (documented below) | every slot of the key in flight ([`InFlightLayer`]) |
//!
//! # Too many in flight
//!
//! The problem type [`PROBLEM_TYPE_IN_FLIGHT`] names; this section is its
//! documentation. A `429` from [`InFlightLayer`] with this type says that
//! every slot of the request's key is taken by requests still running
//! (across every process sharing the limiter's store), not that a quota
//! is spent: an in-flight limit counts nothing over time, and a request
//! may start as soon as another ends. `Retry-After` is a hint; gRPC requests get
//! `RESOURCE_EXHAUSTED` with a `grpc-message` saying so. Body:
//! `{"type": "…#too-many-in-flight", "title": "Too many requests in
//! flight", "status": 429, "detail": "every slot of this key is in use;
//! retry in N s"}`.
//!
//! # Features
//!
//! - `axum`: [`KeyExtractor::client_ip`] reads the peer address axum
//!   records (`ConnectInfo<SocketAddr>`);
//! - `tonic`: the same for tonic (`TcpConnectInfo`).
//!
//! Without them, the peer address is read from a `SocketAddr` or `IpAddr`
//! request extension that your server inserts.
//!
//! # Layout
//!
//! `layer` (the builder, whose configuration every clone shares through
//! an `Arc`), `prepared` (what its services share: routes, policies and
//! their keys, waiting out denials), `service` (the per-request path),
//! `future` (its response future), `body` (the response body), `reject`
//! (the layer's own answers: 429, 503, missing key; gRPC statuses),
//! `headers` (header and body formatting), `key` (key and cost
//! extraction), `ip` (client addresses and trusted proxies), `inflight`
//! ([`InFlightLayer`]). The layers reach the limiters through
//! slicelimit's public API alone.
//!
//! The guide to keys, trusted proxies, headers, gRPC and security is
//! `docs/http.md` in this package.

mod body;
mod cost;
mod future;
mod headers;
mod inflight;
mod ip;
mod key;
mod layer;
mod prepared;
mod reject;
mod service;

pub use self::body::RateLimitBody;
pub use self::cost::{ActualCost, Cost, CostBody, CostLayer};
pub use self::future::ResponseFuture;
pub use self::headers::{
    PolicyHeaders, PROBLEM_TYPE, PROBLEM_TYPE_IN_FLIGHT, PROBLEM_TYPE_UNAVAILABLE, RATELIMIT,
    RATELIMIT_POLICY,
};
pub use self::inflight::{InFlight, InFlightBody, InFlightLayer};
pub use self::ip::{Cidr, ClientIp, ProxyHeader};
pub use self::key::{KeyExtractor, MissingKey, RequestView};
pub use self::layer::RateLimitLayer;
pub use self::reject::{Rejection, RejectionKind};
pub use self::service::RateLimit;

/// The README's code blocks, compiled as doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The code blocks of `docs/http.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/http.md")]
pub struct HttpDoctests;
