//! Building blocks of `slicelimit-server`, a rate limit service for Envoy
//! (feature `server`): its configuration, in envoyproxy/ratelimit's
//! format.

pub mod config;
