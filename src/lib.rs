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
//!               ├─ local map (DashMap<key, Arc<Holding>>): atomics only ─► Decision
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
//! - sliding window, strict: at every admission, the window's admissions
//!   plus the previous window's, weighted by the share of it the trailing
//!   period still covers, ≤ `limit` (the exact sliding-window counter's
//!   own rule); optimistic: ≤ `limit + 2 × N × max_debt`;
//! - token bucket / GCRA, strict: over any interval T, admitted ≤
//!   `burst + rate × (T + h)` where h is the lease horizon
//!   ([`HybridConfig::lease_ttl`]).
//!
//! # Architecture
//!
//! Where things happen, top to bottom: each layer imports only from the
//! layers below it, no file imports one on its own layer or above (no
//! circle of imports but `store`'s script and memory files, which name
//! each other's types), and within the crate a type is named by the path
//! of the module that defines it, not through these re-exports:
//!
//! ```text
//! wait                  acquire
//! limiter/              the front door, its builder; check_all (all.rs)
//!   quotas              one decision path: one or several quotas
//!   tiers               the lane of a key's quota, at any position
//!   lane                one quota's engine and failure layer
//! hybrid                holdings, lease sizing, the sync task
//! failure               the failure policy and its ledger
//! exact, local          one store call per decision, or none
//! queues                waiters per key
//! stats                 counters a limiter keeps
//! metrics, checked      metric names; what a store's check answered
//! decision, key         the answer; store-key encoding
//! algorithm             its scripts, their arguments, their mirrors
//! store                 the open store: Backend, Script; Redis, memory
//! quota, breaker        quotas; the circuit breaker
//! error, clock          the error type; injected time
//! ```
//!
//! - **A request is decided** in `limiter` ([`Limiter::check`]): the hybrid
//!   engine's fast path (`hybrid::HybridEngine::fast_into`, atomics on a
//!   holding, no await), else its slow path (wait briefly for a refill), or
//!   one exact store call (`exact`), or the per-process count (`local`).
//!   Whatever cannot be decided goes to the failure layer
//!   (`failure::FailureLayer::decide`), the one place the
//!   [`FailurePolicy`] is applied.
//! - **A lease is fetched** by the hybrid engine's background task
//!   (`hybrid::sync`): it sizes each key's lease (`hybrid::policy`),
//!   batches the keys waiting for one into pipelined lease scripts, and
//!   installs the replies in the holdings (`hybrid::holding`, whose fields
//!   are private: every change goes through a method that keeps its
//!   invariants).
//! - **Redis is touched** only in `store::redis`: every script call goes
//!   through a node's circuit breaker (`breaker`) under the response
//!   timeout. A script is a type ([`store::Script`]: its Lua, its
//!   arguments, its reply, its Rust mirror); any [`store::Backend`] runs
//!   it, and [`Store`] is where round trips, script calls, latency and
//!   errors are counted, once, for [`Limiter::stats`] and the metrics
//!   alike. The embedded [`MemoryStore`] runs each script's mirror in
//!   process. Other packages (slicelimit-server's rate shares) add
//!   scripts of their own the same way.
//! - **An algorithm** lives in one file of `algorithm/`: its Lua scripts,
//!   their typed arguments, the embedded store's mirror of them (pure
//!   state transitions) and the kind of lease it grants. `Algorithm::spec`
//!   is the only match on the variants; nothing else asks which algorithm
//!   it runs.
//!
//! # Adding an algorithm
//!
//! 1. Write `lua/<name>.lua` (the exact check) and its lease script: for a
//!    window algorithm a carry file in front of `lua/lease_window.lua`
//!    (see `lua/carry_sliding_window.lua`), for a bucket its own lease
//!    script answering like `lua/lease_token_bucket.lua`.
//! 2. Write `src/algorithm/<name>.rs` with a `pub(super) static SPEC:
//!    Spec`: names, scripts, argument builders, quota checks, the mirror
//!    of each script, and its `LeaseKind`.
//! 3. Add the variant to [`Algorithm`] and one arm to `Algorithm::spec`.
//! 4. Add it to the differential tests (`tests/exact.rs`), the simulation
//!    oracle (`tests/simulation.rs`) and the bounds table of `docs/bounds.md`.
//!
//! # Layout
//!
//! - `quota`, `decision`, `error`, `clock`: value types and injected time;
//! - `key`: injective store-key encoding with one Cluster hash tag per key;
//! - `algorithm`: one file per algorithm, and what window and bucket
//!   algorithms share (`window`, `bucket`);
//! - `breaker`: the circuit breaker, on an injected clock;
//! - `stats`, `metrics`: counters readable with [`Limiter::stats`], and
//!   their metric names;
//! - `store`: the open store ([`store::Backend`], [`store::Script`]), the
//!   Redis store (on a cluster, a slot map and a breaker per primary) and
//!   the embedded [`MemoryStore`], which runs each script's mirror;
//! - `failure`: the failure policy and the ledger of what its fallback
//!   admitted;
//! - `checked`: what a store's check answered (decision, take, refund);
//! - `exact`, `local`: one store call per decision, or none;
//! - `hybrid`: holdings (a key's lease here), lease sizing, the sync task;
//! - `limiter`: the [`Limiter`] front door and its [`Builder`], and the
//!   one decision path under it: `quotas` (one or several quotas,
//!   all-or-nothing, one undo guard), `tiers` (the lane of a key's quota),
//!   `lane` (one quota's engine and failure layer), `all` ([`check_all`]
//!   and [`refund_all`](limiter::refund_all), across limiters);
//! - `wait`: [`Limiter::acquire`], waiting out a denial instead of
//!   returning it; `queues`: its waiters per key, in arrival order;
//! - `concurrency`: the fleet-wide in-flight limit and its slots script.
//!
//! The tower layers (429, `Retry-After`, `RateLimit` headers; in-flight
//! limits) are the package `slicelimit-tower`, in `tower/` of the
//! repository; Envoy's rate limit service is the package
//! `slicelimit-server`, in `server/`; the test harness every package's
//! tests share is the unpublished `slicelimit-sim`, in `sim/`.

mod algorithm;
mod breaker;
mod checked;
pub mod clock;
pub mod concurrency;
mod decision;
mod error;
mod exact;
mod failure;
mod hybrid;
mod key;
pub mod limiter;
mod local;
pub mod metrics;
mod queues;
mod quota;
mod stats;
pub mod store;
mod wait;

pub use algorithm::Algorithm;
pub use concurrency::ConcurrencyLimiter;
pub use decision::{Decision, DeniedBy, Source};
pub use error::{Error, ErrorKind};
pub use failure::FailurePolicy;
pub use hybrid::{Consistency, HybridConfig};
pub use limiter::{check_all, Builder, Charge, Check, Limiter, Receipt, Reservation, Reserve};
pub use quota::Quota;
pub use stats::Stats;
pub use store::{MemoryStore, RedisStore, Store};

/// The README's code blocks, compiled as doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The code blocks of `docs/usage.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/usage.md")]
pub struct UsageDoctests;

/// The code blocks of `docs/concurrency.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/concurrency.md")]
pub struct ConcurrencyDoctests;

/// The code blocks of `docs/operations.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/operations.md")]
pub struct OperationsDoctests;

/// The code blocks of `docs/costs.md`, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/costs.md")]
pub struct CostsDoctests;
