//! HTTP integration: a tower [`Layer`](tower::Layer) that rate-limits
//! requests, answers denials with `429 Too Many Requests`, `Retry-After`
//! and the IETF `RateLimit-Policy` / `RateLimit` headers, and always
//! returns a response (a denial is a response, never an error).
//!
//! Files: `layer` (configuration, shared by every clone through an `Arc`),
//! `service` (the per-request path), `future` (its response future),
//! `headers` (header and body formatting), `key` (key and cost extraction).

mod future;
mod headers;
mod key;
mod layer;
mod service;

pub use self::future::ResponseFuture;
pub use self::headers::{PROBLEM_TYPE, RATELIMIT, RATELIMIT_POLICY};
pub use self::key::{KeyExtractor, MissingKey, RequestView};
pub use self::layer::RateLimitLayer;
pub use self::service::RateLimit;
