//! `slicelimit-server`, Envoy's rate limit service on leased slices
//! (feature `server`), and its parts:
//!
//! - [`config`]: one domain's YAML, in envoyproxy/ratelimit's format;
//! - [`files`]: the file or directory it comes from, read again as it
//!   changes;
//! - [`table`]: every domain's rules, one [`Limiter`](crate::Limiter)
//!   each, kept across reloads;
//! - [`service`]: `ShouldRateLimit` on the table;
//! - [`rlqs`]: the rate limit quota service (Envoys hold the quota);
//! - [`stats`]: the server's own metrics;
//! - [`run`]: the process (flags, listeners, shutdown).
//!
//! `docs/envoy.md` tells how to put it behind Envoy.

pub mod config;
pub mod files;
pub mod rlqs;
pub mod run;
pub mod service;
pub mod stats;
pub mod table;
