//! `slicelimit-server`: Envoy's rate limit service on leased slices of
//! Redis budgets, over the [`slicelimit`] library. The binary is the
//! product; this library is its parts, public for the binary and the
//! tests, not a stable API:
//!
//! - [`config`]: one domain's YAML, in envoyproxy/ratelimit's format;
//! - [`files`]: the file or directory it comes from, read again as it
//!   changes;
//! - [`table`]: every domain's rules, one [`Limiter`](slicelimit::Limiter)
//!   each, kept across reloads;
//! - [`service`]: `ShouldRateLimit` on the table;
//! - [`rlqs`]: the rate limit quota service (Envoys hold the quota;
//!   experimental);
//! - [`reservation`]: what a request reserved, kept in the store until
//!   its settlement (its script, `lua/reservation.lua`, and the mirror);
//! - [`share`]: how replicas share an RLQS bucket's rate in the store
//!   (its script, `lua/rate_share.lua`, and the script's mirror);
//! - [`stats`]: the server's own metrics;
//! - [`store_watch`]: the store from `--redis-url`, and what the server
//!   says when it stops and starts answering;
//! - [`log`]: lines about trouble that can repeat, throttled;
//! - [`run`]: the process (flags, listeners, shutdown).
//!
//! [`guide`] (`docs/envoy.md`) tells how to put it behind Envoy, and
//! [`migrating`] (`docs/migrating.md`) how to come from envoyproxy/ratelimit.

pub mod config;
pub mod files;
pub mod log;
pub mod reservation;
pub mod rlqs;
pub mod run;
pub mod service;
pub mod share;
pub mod stats;
pub mod store_watch;
pub mod table;

/// How to run slicelimit-server behind Envoy (`docs/envoy.md`).
#[doc = include_str!("../docs/envoy.md")]
pub mod guide {}

/// Coming from envoyproxy/ratelimit (`docs/migrating.md`).
#[doc = include_str!("../docs/migrating.md")]
pub mod migrating {}
