//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` (RLQS): the
//! Envoys hold the quota themselves.
//!
//! Each Envoy streams usage reports per bucket and enforces the token
//! bucket it is assigned, with no call per request. For every bucket the
//! replicas divide the bucket's rate among themselves through the store
//! (`lua/rate_share.lua`: each holds a share under an expiry, never more
//! than the limit together), and each divides what it holds among the
//! Envoys connected to it, max-min fair by their reported demand.
//!
//! **The bound.** A bucket of `limit` per `period` admits at most `limit`
//! in any interval of one `period` across the fleet, once its Envoys have
//! assignments, given that
//! 1. an Envoy's assignment is a token bucket of at most [`RESERVE`]
//!    tokens filling at `rate` per `period` (its reach: `rate + tokens`,
//!    the most it admits in a period), and Envoy fills a bucket that
//!    replaces another in proportion to how full that one was, up to its
//!    own size (Envoy 1.40, checked by `tests/rlqs_envoy_buckets.rs`);
//!    a raise never shrinks a bucket and a lowering never grows one;
//! 2. a replica counts as in use, and holds in the store, at every moment
//!    the sum over its Envoys of the highest rate that may be in force
//!    (a replaced one until [`DELIVERY`] after its replacement was sent:
//!    a stream message arrives within that) and the most tokens of a
//!    bucket that may share a period with that moment (a replaced one's
//!    for `DELIVERY + period`); an Envoy that left counts until its last
//!    assignment lapses (`DELIVERY + ASSIGNMENT_TTL` after it was sent),
//!    its tokens a period longer;
//! 3. it hands out only what the store grants it beyond that, and the
//!    store's holds never sum past the limit (`lua/rate_share.lua`);
//! 4. a hold outlives what its assignments may admit: its rate part
//!    lasts [`HOLD_TTL`] and its tokens [`tokens_ttl`], renewed every
//!    [`RENEW`] (the replica's and the store's clocks run at the same
//!    rate); its claims count for [`CLAIMS_TTL`] only;
//! 5. the store keeps the holds (a replica that held a share and finds
//!    it gone raises nothing for [`tokens_ttl`]; one that held nothing
//!    cannot tell, and may be granted up to the limit again);
//! 6. Envoy's `expired_assignment_behavior` is DENY_ALL, with its
//!    `expired_assignment_behavior_timeout` set (unset, it is zero and
//!    `no_assignment_behavior` takes over at once).
//!
//! The admissions of an interval are then at most the tokens its buckets
//! held at its start, what they filled during it and what a replacement
//! carried over, which (1) and (2) bound by what is held. The seeded
//! simulation in `sim.rs` searches for an interval that breaks it.
//!
//! Before a bucket's first assignment Envoy's `no_assignment_behavior`
//! decides, outside this bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tokio::sync::{mpsc, Notify};
use tonic::Status;

use crate::table::Table;
use slicelimit::FailurePolicy;
use slicelimit::Store;

mod actions;
mod bucket;
mod round;
#[cfg(test)]
mod sim;
mod stream;
#[cfg(test)]
mod tests;

use actions::{blanket, send};
use bucket::{canonical, period, resolve, Bucket, Rule, Seat};

/// How often every bucket's hold is renewed and its assignments sent.
pub const RENEW: Duration = Duration::from_millis(500);
/// How long a replica's hold on a bucket's rate lasts without renewal:
/// past the end of the assignments it sent (delivered within
/// [`DELIVERY`], in force for [`ASSIGNMENT_TTL`]), with two renewals to
/// spare.
pub const HOLD_TTL: Duration = Duration::from_secs(4);
/// How long the tokens part of a hold on a bucket of `period` lasts: what
/// its Envoys' tokens admitted may share a period with what comes after.
pub fn tokens_ttl(period: Duration) -> Duration {
    HOLD_TTL + period
}
/// How long a replica's claims (its Envoys' demand) shape the others'
/// shares without renewal: a replica gone quiet stops holding the others
/// back sooner than its hold lapses.
pub const CLAIMS_TTL: Duration = Duration::from_secs(2);
/// The most buckets a replica serves; reports on more get the failure
/// policy's blanket answer.
pub const MAX_BUCKETS: usize = 10_000;
/// The most entries, and bytes, of a bucket id a replica serves.
pub const MAX_ID_ENTRIES: usize = 16;
/// See [`MAX_ID_ENTRIES`].
pub const MAX_ID_BYTES: usize = 1_024;
/// How long a bucket refused for want of room keeps its blanket answer.
const REFUSED_TTL: Duration = Duration::from_secs(60);
/// Store calls of one round in flight at once.
const ROUND_CALLS: usize = 32;
/// How long an assignment lasts in Envoy without renewal (whole seconds:
/// Envoy reads only the seconds).
pub const ASSIGNMENT_TTL: Duration = Duration::from_secs(2);
/// The tokens an Envoy's bucket may hold, set aside from its share: what
/// it may admit at once beyond its rate. One token wastes the time it
/// sits full between requests (measured: assigned 33 a second against a
/// demand of 90, an Envoy admitted 30; assigned its own demand of 30,
/// about 20); two absorb most of that.
pub const RESERVE: u64 = 2;
/// How long an assignment sent takes to be in force in its Envoy, at
/// most (a gRPC stream message): until then the rate before it counts as
/// in use.
pub const DELIVERY: Duration = Duration::from_secs(1);
/// How long an Envoy may go without reporting on a bucket before it loses
/// its seat (Envoy 1.40 reported about every 5 s).
pub const SILENT: Duration = Duration::from_secs(20);
/// How long a bucket no Envoy reports on is kept before it is abandoned.
pub const IDLE: Duration = Duration::from_secs(60);

/// The RLQS service of one replica.
#[derive(Clone)]
pub struct Rlqs {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Rlqs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rlqs")
            .field("holder", &self.inner.holder)
            .finish_non_exhaustive()
    }
}

struct Inner {
    table: Arc<ArcSwap<Table>>,
    store: Store,
    policy: FailurePolicy,
    /// This replica's name in the store's holds.
    holder: String,
    state: Mutex<State>,
    next_envoy: AtomicU64,
    wake: Notify,
    /// The time, when a test sets it (else the system's).
    fixed: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct State {
    envoys: HashMap<u64, mpsc::Sender<Result<RateLimitQuotaResponse, Status>>>,
    buckets: HashMap<(String, String), Bucket>,
}

impl Rlqs {
    /// The service on `table`'s `rlqs` sections, sharing each bucket's
    /// rate through `store` with the other replicas.
    pub fn new(table: Arc<ArcSwap<Table>>, store: Store, policy: FailurePolicy) -> Rlqs {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let holder = format!(
            "{}-{}-{nanos:x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Rlqs {
            inner: Arc::new(Inner {
                table,
                store,
                policy,
                holder,
                state: Mutex::default(),
                next_envoy: AtomicU64::new(1),
                wake: Notify::new(),
                fixed: Mutex::new(None),
            }),
        }
    }

    /// Renews holds and sends assignments every [`RENEW`] (or sooner, when
    /// a bucket appears) until dropped.
    pub async fn run(self) {
        loop {
            let woken = self.inner.wake.notified();
            self.inner.round(Instant::now()).await;
            let _ = tokio::time::timeout(RENEW, woken).await;
        }
    }

    /// At shutdown: lets go of every claim and of every hold beyond what
    /// the assignments sent may still admit (that part expires), and ends
    /// every Envoy's stream.
    pub async fn close(&self) {
        self.inner.let_go(Instant::now()).await;
        self.inner.lock().envoys.clear();
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Now: the system's time, or the one a test set.
    fn now(&self) -> Instant {
        let fixed = *self.fixed.lock().unwrap_or_else(|e| e.into_inner());
        fixed.unwrap_or_else(Instant::now)
    }

    /// What the failure policy assigns when the store cannot answer.
    fn fallback(&self) -> BlanketRule {
        match self.policy {
            FailurePolicy::FailClosed => BlanketRule::DenyAll,
            _ => BlanketRule::AllowAll,
        }
    }

    /// Folds one message of Envoy `envoy`, received at `now`, in.
    fn report(&self, envoy: u64, domain: &str, reports: &RateLimitQuotaUsageReports, now: Instant) {
        let table = self.table.load();
        let mut state = self.lock();
        let State { envoys, buckets } = &mut *state;
        let mut fresh = false;
        for usage in &reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id.clone() else {
                continue;
            };
            let size: usize = id.bucket.iter().map(|(k, v)| k.len() + v.len()).sum();
            let key = (domain.to_owned(), canonical(&id));
            let known = buckets.contains_key(&key);
            if !known
                && (buckets.len() >= MAX_BUCKETS
                    || id.bucket.len() > MAX_ID_ENTRIES
                    || size > MAX_ID_BYTES
                    || domain.len() > MAX_ID_BYTES)
            {
                // Served without state: what the store's failure would get.
                crate::stats::rlqs_message("refused");
                send(
                    envoys,
                    envoy,
                    &id,
                    blanket(self.fallback(), Some(REFUSED_TTL)),
                );
                continue;
            }
            let bucket = buckets.entry(key.clone()).or_insert_with(|| {
                fresh = true;
                Bucket {
                    rule: resolve(&table, domain, &id),
                    id,
                    store_key: format!("rlqs:{domain}:{}", key.1),
                    envoys: HashMap::new(),
                    held: 0,
                    hold_until: None,
                    frozen_until: None,
                    departed: Vec::new(),
                    last_report: now,
                }
            });
            bucket.last_report = now;
            let period = period(&bucket.rule);
            let limit = match &bucket.rule {
                Rule::Quota { quota, .. } => quota.limit(),
                Rule::Blanket(_) => 1,
            };
            let seat = bucket.envoys.entry(envoy).or_insert_with(|| {
                fresh = true;
                Seat::default()
            });
            let seen = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            // Measured here, between reports: Envoy's own `time_elapsed`
            // was seen to run short of the time its counts covered.
            let elapsed = seat
                .reported
                .map(|last| now.duration_since(last).max(Duration::from_millis(100)));
            let allowance = seat.allowance(now, period);
            if let Rule::Quota { label, .. } = &bucket.rule {
                crate::stats::rlqs_reported(domain, label, usage, allowance);
            }
            seat.demand = match elapsed {
                // The first report comes with the bucket's first request
                // and says nothing of its rate: until the next one, the
                // Envoy may want all of it (the shares split evenly).
                None => limit,
                Some(elapsed) => {
                    let per_period = seen as f64 * period.as_secs_f64() / elapsed.as_secs_f64();
                    let measured = (per_period.round() as u64).clamp(1, limit.max(1));
                    // A steady Envoy measures a request more or less from
                    // one report to the next: that moves no assignment.
                    let noise = (seat.demand / 20).max(1);
                    if measured.abs_diff(seat.demand) <= noise {
                        seat.demand
                    } else {
                        measured
                    }
                }
            };
            seat.reported = Some(now);
        }
        drop(state);
        if fresh {
            self.wake.notify_one();
        }
    }

    /// Envoy `envoy`'s stream ended at `now`.
    fn leave(&self, envoy: u64, now: Instant) {
        let mut state = self.lock();
        state.envoys.remove(&envoy);
        for bucket in state.buckets.values_mut() {
            // Its stream is gone, not its assignment: that stays counted
            // until it lapses.
            let period = period(&bucket.rule);
            if let Some(seat) = bucket.envoys.remove(&envoy) {
                bucket.departed.extend(seat.departing(now, period));
            }
        }
        drop(state);
        self.wake.notify_one();
    }
}
