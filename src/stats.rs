//! Counters a limiter keeps about itself: readable without a recorder
//! ([`Limiter::stats`](crate::Limiter::stats)) and mirrored to the
//! `metrics` facade ([`crate::metrics`]).
//!
//! Plain relaxed atomics: they are statistics, not synchronisation.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use metrics::Counter;

use crate::breaker::CircuitState;
use crate::decision::Source;
use crate::error::ErrorKind;
use crate::metrics::{self as names, Meters};

/// One total: a local atomic and its metric.
pub(crate) struct Tally {
    value: AtomicU64,
    meter: Counter,
}

impl Tally {
    fn new(limiter: &str, metric: &'static str) -> Self {
        Tally {
            value: AtomicU64::new(0),
            meter: Meters::counter(limiter, metric),
        }
    }

    /// A total with no metric of its own.
    fn unmetered() -> Self {
        Tally {
            value: AtomicU64::new(0),
            meter: Counter::noop(),
        }
    }

    #[inline]
    pub(crate) fn add(&self, n: u64) {
        if n > 0 {
            self.value.fetch_add(n, Ordering::Relaxed);
            self.meter.increment(n);
        }
    }

    pub(crate) fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

/// A total bumped on every decision, spread over cache lines: threads
/// deciding at once each add to a line of their own (one shared atomic
/// would be a line every decision on every core writes), and a read sums
/// them.
///
/// A thread that holds a line alone adds with a plain load and store: no
/// other thread writes that line, and a locked add cost a tenth of a
/// decision on one hot key. Threads beyond [`OWNED`] at once share the
/// last lines and add atomically.
pub(crate) struct Spread {
    shards: Box<[Line; OWNED + SHARED]>,
}

/// Lines a thread can hold alone, and lines threads share.
const OWNED: usize = 16;
const SHARED: usize = 4;

/// One shard, alone on its cache line (128 bytes: adjacent-line
/// prefetchers pair 64-byte lines).
#[repr(align(128))]
#[derive(Default)]
struct Line(AtomicU64);

/// A thread's line in every [`Spread`]: held alone (`own`) until the
/// thread exits, when it goes back to the free list.
struct Claim {
    index: usize,
    own: bool,
}

/// Lines given back by threads that exited. Taking one from here orders
/// the new holder's first read after the old holder's last write.
static FREE: Mutex<Vec<usize>> = Mutex::new(Vec::new());

impl Claim {
    fn take() -> Claim {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        if let Some(index) = FREE.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Claim { index, own: true };
        }
        match NEXT.fetch_add(1, Ordering::Relaxed) {
            index if index < OWNED => Claim { index, own: true },
            n => Claim {
                index: OWNED + n % SHARED,
                own: false,
            },
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.own {
            FREE.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(self.index);
        }
    }
}

thread_local! {
    static CLAIM: Claim = Claim::take();
}

impl Spread {
    fn new() -> Self {
        Spread {
            shards: Box::new(std::array::from_fn(|_| Line::default())),
        }
    }

    #[inline]
    pub(crate) fn add(&self, n: u64) {
        match CLAIM.try_with(|claim| (claim.index, claim.own)) {
            Ok((index, true)) => {
                let line = &self.shards[index].0;
                line.store(line.load(Ordering::Relaxed) + n, Ordering::Relaxed);
            }
            Ok((index, false)) => {
                self.shards[index].0.fetch_add(n, Ordering::Relaxed);
            }
            // This thread is exiting and gave its line back.
            Err(_) => {
                self.shards[OWNED].0.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn get(&self) -> u64 {
        self.shards
            .iter()
            .map(|l| l.0.load(Ordering::Relaxed))
            .sum()
    }
}

pub(crate) use crate::store::StoreCost;

/// Live counters; one per limiter, shared by its engine and sync task.
pub(crate) struct Counters {
    pub(crate) allowed: Spread,
    pub(crate) denied: Spread,
    pub(crate) round_trips: Tally,
    pub(crate) store_calls: Tally,
    store_errors: Tally,
    store_timeouts: Tally,
    pub(crate) policy_decisions: Tally,
    pub(crate) credit_admitted: Tally,
    pub(crate) overshoot: Tally,
    pub(crate) leases_requested: Tally,
    pub(crate) leases: Tally,
    pub(crate) permits_leased: Tally,
    pub(crate) stranded: Tally,
    pub(crate) given_back: Tally,
    pub(crate) reconciled: Tally,
    pub(crate) fallback_admitted: Tally,
    pub(crate) reports_dropped: Tally,
    pub(crate) sync_restarts: Tally,
    pub(crate) shadow_denials: Tally,
    pub(crate) refunded: Tally,
    pub(crate) refunds_ignored: Tally,
    pub(crate) charged: Tally,
    pub(crate) acquire_waits: Tally,
    pub(crate) acquire_timeouts: Tally,
    pub(crate) peeks: Tally,
    pub(crate) peeks_full: Tally,
    pub(crate) rides: Tally,
    pub(crate) meters: Meters,
}

impl Counters {
    pub(crate) fn new(limiter: &str) -> Self {
        Counters {
            allowed: Spread::new(),
            denied: Spread::new(),
            round_trips: Tally::new(limiter, names::ROUND_TRIPS),
            store_calls: Tally::new(limiter, names::STORE_CALLS),
            store_errors: Tally::unmetered(),
            store_timeouts: Tally::unmetered(),
            policy_decisions: Tally::unmetered(),
            credit_admitted: Tally::new(limiter, names::CREDIT),
            overshoot: Tally::new(limiter, names::OVERSHOOT),
            leases_requested: Tally::new(limiter, names::LEASES_REQUESTED),
            leases: Tally::new(limiter, names::LEASES_GRANTED),
            permits_leased: Tally::unmetered(),
            stranded: Tally::new(limiter, names::STRANDED),
            given_back: Tally::new(limiter, names::GIVEN_BACK),
            reconciled: Tally::new(limiter, names::RECONCILED),
            fallback_admitted: Tally::new(limiter, names::FALLBACK_ADMISSIONS),
            reports_dropped: Tally::new(limiter, names::REPORTS_DROPPED),
            sync_restarts: Tally::new(limiter, names::SYNC_RESTARTS),
            shadow_denials: Tally::new(limiter, names::SHADOW_DENIALS),
            refunded: Tally::new(limiter, names::REFUNDED),
            refunds_ignored: Tally::new(limiter, names::REFUNDS_IGNORED),
            charged: Tally::new(limiter, names::CHARGED),
            acquire_waits: Tally::new(limiter, names::ACQUIRE_WAITS),
            acquire_timeouts: Tally::new(limiter, names::ACQUIRE_TIMEOUTS),
            peeks: Tally::unmetered(),
            peeks_full: Tally::unmetered(),
            rides: Tally::unmetered(),
            meters: Meters::new(limiter),
        }
    }

    /// Counts a decision (the decisions metric is labelled by outcome and
    /// source, so it carries allowed/denied/policy counts itself).
    #[inline]
    pub(crate) fn decision(&self, allowed: bool, source: Source) {
        if allowed {
            self.allowed.add(1);
        } else {
            self.denied.add(1);
        }
        self.meters.decision(allowed, source);
    }

    fn store_error(&self, kind: ErrorKind) {
        self.store_errors.add(1);
        if kind == ErrorKind::Timeout {
            self.store_timeouts.add(1);
        }
        self.meters.error(kind);
    }

    /// A store call, or a batch, that cost `cost` and took `micros` (one
    /// latency sample however many pipelines it sent).
    fn round_trip(&self, cost: StoreCost, micros: u64) {
        self.round_trips.add(cost.round_trips);
        self.store_calls.add(cost.calls);
        self.meters.store_latency.record(micros as f64 / 1e6);
    }

    pub(crate) fn lease_granted(&self, permits: u64) {
        self.leases.add(1);
        self.permits_leased.add(permits);
        self.meters.lease_size.record(permits as f64);
    }

    pub(crate) fn circuit(&self, state: CircuitState) {
        self.meters.circuit(state);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            allowed: self.allowed.get(),
            denied: self.denied.get(),
            round_trips: self.round_trips.get(),
            store_calls: self.store_calls.get(),
            store_errors: self.store_errors.get(),
            store_timeouts: self.store_timeouts.get(),
            circuit_trips: 0,
            policy_decisions: self.policy_decisions.get(),
            credit_admitted: self.credit_admitted.get(),
            overshoot: self.overshoot.get(),
            leases: self.leases.get(),
            permits_leased: self.permits_leased.get(),
            stranded: self.stranded.get(),
            given_back: self.given_back.get(),
            reconciled: self.reconciled.get(),
            fallback_admitted: self.fallback_admitted.get(),
            reports_dropped: self.reports_dropped.get(),
            sync_restarts: self.sync_restarts.get(),
            shadow_denials: self.shadow_denials.get(),
            refunded: self.refunded.get(),
            refunds_ignored: self.refunds_ignored.get(),
            charged: self.charged.get(),
            acquire_waits: self.acquire_waits.get(),
            acquire_timeouts: self.acquire_timeouts.get(),
            peeks: self.peeks.get(),
            peeks_full: self.peeks_full.get(),
            rides: self.rides.get(),
        }
    }
}

/// A snapshot of a limiter's counters since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Decisions that admitted the request.
    pub allowed: u64,
    /// Decisions that denied the request.
    pub denied: u64,
    /// Round trips to the store: pipelines and single calls sent (a batch
    /// of leases is one pipeline on a single node, one per hash slot on a
    /// cluster), script loads included.
    pub round_trips: u64,
    /// Script calls sent to the store: each lease, give-back, report or
    /// exact check once, whether it travelled alone or in a pipeline.
    pub store_calls: u64,
    /// Store calls (or batch items) that failed.
    pub store_errors: u64,
    /// Of those, calls that got no answer within the store's response
    /// timeout.
    pub store_timeouts: u64,
    /// Times the circuit breaker of the limiter's store opened since the
    /// limiter was built (on a cluster, any primary's; a store shared by
    /// several limiters counts its openings in each).
    pub circuit_trips: u64,
    /// Decisions made by the failure policy.
    pub policy_decisions: u64,
    /// Permits admitted on credit (optimistic hybrid).
    pub credit_admitted: u64,
    /// Permits admitted that the store could not cover: admitted beyond
    /// the limit.
    pub overshoot: u64,
    /// Lease calls that granted at least one permit.
    pub leases: u64,
    /// Permits granted by leases.
    pub permits_leased: u64,
    /// Leased permits that expired unused and could not be given back.
    pub stranded: u64,
    /// Leased permits given back to the store unused.
    pub given_back: u64,
    /// Permits reported to the store after the fact: what the local
    /// fallback admitted during an outage, once the store answered again,
    /// and charges.
    pub reconciled: u64,
    /// Permits the local fallback admitted while the store was unavailable.
    pub fallback_admitted: u64,
    /// Permits of debt or reconciliation reports the store refused for good
    /// (a key of the wrong type, a value out of range): dropped, not
    /// retried forever.
    pub reports_dropped: u64,
    /// Times the hybrid limiter's background task was found gone (its
    /// runtime dropped, a panic) and started again on a caller's runtime.
    pub sync_restarts: u64,
    /// Denials let through in shadow (dry-run) mode, as counted by
    /// [`Limiter::record_shadow_denial`](crate::Limiter::record_shadow_denial)
    /// (slicelimit-tower's layer counts each one).
    pub shadow_denials: u64,
    /// Permits given back by [`Limiter::refund`](crate::Limiter::refund)
    /// (and by the undoing of a take that another quota or key denied) to
    /// the window they were taken from.
    pub refunded: u64,
    /// Permits a refund could not give back: their window had ended, or
    /// the decision took nothing refundable.
    pub refunds_ignored: u64,
    /// Permits counted by [`Limiter::charge`](crate::Limiter::charge)
    /// (and reservations charged past their estimate), whatever was left;
    /// what went past a limit is in `overshoot` too.
    pub charged: u64,
    /// Sleeps [`Limiter::acquire`](crate::Limiter::acquire) (or
    /// `acquire_until`, `wait_out`: slicelimit-tower's `wait_up_to`) took
    /// before asking again.
    pub acquire_waits: u64,
    /// Waits that ran out: `acquire` calls (and `acquire_until`,
    /// `wait_out`) that slept and were still denied when the retry fell
    /// beyond what was left of the wait. A denial returned without
    /// sleeping (it can never pass, or its retry lies beyond the whole
    /// wait) is not a wait and is not counted.
    pub acquire_timeouts: u64,
    /// Hybrid: calls that took nothing and asked whether a window this
    /// process holds a lease of, and will spend before it ends, had any
    /// room left; sent along with a batch of leases, never on their own.
    pub peeks: u64,
    /// Peeks that found the window fully leased: the process denies the
    /// key locally once its permits are spent, without asking again in
    /// that window.
    pub peeks_full: u64,
    /// Hybrid: refills ahead of need sent early, with a batch that went
    /// out anyway, because by its rate the key would have asked within a
    /// fraction of its window (a round trip of its own saved).
    pub rides: u64,
}

/// The one place store calls are counted.
impl crate::store::Recorder for Counters {
    /// One store call (a check, a batch): what it cost, how long it took,
    /// and the errors it returned. A call the breaker refused never left
    /// the process: it is neither a round trip nor a latency sample, but
    /// its error counts.
    fn store_call<'a>(
        &self,
        cost: StoreCost,
        took: std::time::Duration,
        errors: impl Iterator<Item = &'a crate::error::Error>,
    ) {
        if cost.round_trips > 0 {
            self.round_trip(cost, took.as_micros() as u64);
        }
        for e in errors {
            self.store_error(e.kind());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_total_sums_what_every_thread_added() {
        // More threads at once than lines held alone, twice over: the
        // second wave takes the lines the first gave back.
        let n = (OWNED + SHARED + 3) as u64;
        let total = std::sync::Arc::new(Spread::new());
        for _wave in 0..2 {
            let all_started = std::sync::Arc::new(std::sync::Barrier::new(n as usize));
            let threads: Vec<_> = (0..n)
                .map(|t| {
                    let total = total.clone();
                    let all_started = all_started.clone();
                    std::thread::spawn(move || {
                        all_started.wait();
                        for _ in 0..10_000 {
                            total.add(t + 1);
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
        }
        assert_eq!(total.get(), 2 * 10_000 * n * (n + 1) / 2);
        assert_eq!(std::mem::align_of::<Line>(), 128);
    }
}
