//! HTTP and gRPC integration: a tower [`Layer`](tower::Layer) that
//! rate-limits requests and always returns a response (a denial is a
//! response, never an error):
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
//! [`ConcurrencyLimiter`](crate::ConcurrencyLimiter): `429` with
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
//! Files: `layer` (configuration, shared by every clone through an `Arc`),
//! `service` (the per-request path), `future` (its response future),
//! `body` (the response body), `reject` (the layer's own answers),
//! `headers` (header and body formatting), `key` (key and cost
//! extraction), `ip` (client addresses and trusted proxies).

mod body;
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
