//! Distributed rate limiting on Redis without a Redis round trip per request.
//!
//! A key may make `limit` requests per `period` across every process of a
//! fleet. slicelimit offers three ways to count:
//!
//! - **exact**: one atomic Lua script per decision, on Redis' clock — exact,
//!   at the price of a round trip ([`Builder::exact`]);
//! - **hybrid**: each process *leases a slice* of every key's budget through
//!   an atomic script and decides locally from a lock-free map, refilling in
//!   the background — a round trip per lease, not per request, with a
//!   published bound on overshoot ([`Builder::hybrid`]);
//! - **local**: per-process counting only, for comparison or single
//!   processes ([`Builder::local`]).
//!
//! ```no_run
//! use slicelimit::{nonzero, Algorithm, HybridConfig, Limiter, Quota, RedisStore};
//!
//! # async fn demo() -> Result<(), slicelimit::Error> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let limiter = Limiter::builder(Quota::per_minute(nonzero!(100)))
//!     .store(store)
//!     .algorithm(Algorithm::FixedWindow)
//!     .hybrid(HybridConfig::strict())
//!     .namespace("api")
//!     .build()?;
//! let decision = limiter.check("key-77", 1).await;
//! if !decision.is_allowed() {
//!     println!("retry in {:?}", decision.retry_after());
//! }
//! limiter.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Data flow (hybrid)
//!
//! ```text
//! request ──► Limiter::check(key, cost)
//!               ├─ local map (DashMap<key, Arc<Slot>>): atomics only ─► Decision
//!               │        │ below the low-water mark / lease ending
//!               │        ▼
//!               └─ refill queue ──► sync task: coalesce per key, batch many
//!                                     keys into one pipelined round trip
//!                                     ──► Redis: lease script (atomic, Redis TIME)
//!                                     ◄── grant, time to reset, remaining
//! ```
//!
//! # Bounds
//!
//! - fixed window, strict: admitted per window ≤ `limit`;
//! - fixed window, optimistic: ≤ `limit + N × max_debt` per window for a
//!   fleet of N processes, and every permit beyond the limit is counted in
//!   [`Stats::overshoot`];
//! - token bucket / GCRA, strict: over any interval T, admitted ≤
//!   `burst + rate × (T + h)` where h is the lease horizon
//!   ([`HybridConfig::lease_ttl`]).
//!
//! # Layout
//!
//! - `quota`, `decision`, `error`, `clock`: value types and injected time;
//! - `key`: injective store-key encoding with one Cluster hash tag per key;
//! - `store`: the Redis store (scripts in `lua/`; on a cluster, a slot map
//!   and a circuit breaker per primary) and the embedded [`MemoryStore`]
//!   with the same semantics;
//! - `exact`, `local`: one store call per decision, or none;
//! - `hybrid`: slots, lease sizing, the sync task;
//! - `failure`: what a limiter decides when its store cannot answer;
//! - `limiter`: the [`Limiter`] front door and its [`Builder`];
//! - `stats`: counters readable with [`Limiter::stats`].

mod algorithm;
mod breaker;
mod clock;
mod decision;
mod error;
mod exact;
mod failure;
#[cfg(feature = "tower")]
pub mod http;
mod hybrid;
mod key;
mod limiter;
mod local;
pub mod metrics;
mod quota;
mod stats;
mod store;

pub use algorithm::Algorithm;
pub use breaker::{CircuitConfig, CircuitState};
pub use clock::{Clock, FakeClock, SystemClock};
pub use decision::{Decision, Source};
pub use error::{Error, ErrorKind};
pub use failure::FailurePolicy;
pub use hybrid::{Consistency, HybridConfig};
pub use limiter::{Builder, Check, Limiter};
pub use quota::{Quota, MAX_LIMIT, MAX_PERIOD, MIN_PERIOD};
pub use stats::Stats;
#[cfg(feature = "test-support")]
pub use store::{FaultCounts, Faults, FaultyStore};
pub use store::{MemoryStore, RedisOptions, RedisStore, Store};

/// The README's code blocks, compiled as doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
