//! The ledger of what the fallback admitted while the store was away, and
//! its reconciliation: reported to the store as debt when it answers
//! again, each report under an identity, so the fleet does not get a
//! second budget right after an outage and a report resent after a lost
//! reply is counted once.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::report::{Report, Resend};
use crate::algorithm::{Lease, LeaseCall, OpIds, Params};
use crate::clock::micros;
use crate::clock::Clock;
use crate::key::KeyEncoder;
use crate::stats::Counters;
use crate::store::Store;

/// Permits admitted by the fallback while the store was away, per user key.
/// Reported to the store as debt when it answers again, so the fleet does
/// not get a second full budget right after an outage.
///
/// Each report carries an identity fixed when it is first sent:
/// a report that timed out is resent under the same identity, so the store
/// counts it once even if it had applied the first delivery.
pub(crate) struct Reconciler {
    pending: Mutex<Ledger>,
    has_pending: AtomicBool,
    /// Permits admitted for keys that found the ledger full, not yet
    /// added to `Stats::reports_dropped`.
    dropped: AtomicU64,
    ops: OpIds,
    /// Times resends (see `RESEND_FOR`).
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciler")
            .field("has_pending", &self.has_pending())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Ledger {
    /// Admitted and never sent.
    fresh: HashMap<String, u64>,
    /// Sent, not known to have applied: resent as they were.
    resend: Vec<Report>,
}

/// The most keys the ledger holds between two reports. Keys reach it
/// through `local_key`, so this bounds its bytes too; what a key beyond it
/// admitted is dropped and counted rather than remembered.
pub(crate) const MAX_LEDGER_KEYS: usize = 100_000;

impl Reconciler {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Reconciler {
            pending: Mutex::new(Ledger::default()),
            has_pending: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            ops: OpIds::default(),
            clock,
        }
    }

    pub(super) fn record(&self, key: &str, cost: u64) {
        if cost == 0 {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let full = pending.fresh.len() >= MAX_LEDGER_KEYS;
        match pending.fresh.get_mut(key) {
            Some(n) => *n = n.saturating_add(cost),
            None if full => {
                self.dropped.fetch_add(cost, Ordering::Relaxed);
                return;
            }
            None => {
                pending.fresh.insert(key.to_owned(), cost);
            }
        }
        self.has_pending.store(true, Ordering::Release);
    }

    /// Takes back `cost` recorded for `key` and not reported yet (a
    /// fallback admission undone); what was reported stays.
    pub(super) fn unrecord(&self, key: &str, cost: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = pending.fresh.get_mut(key) {
            *n = n.saturating_sub(cost);
            if *n == 0 {
                pending.fresh.remove(key);
            }
        }
        if pending.fresh.is_empty() && pending.resend.is_empty() {
            self.has_pending.store(false, Ordering::Release);
        }
    }

    /// Permits dropped because the ledger was full, since the last call.
    pub(crate) fn take_dropped(&self) -> u64 {
        self.dropped.swap(0, Ordering::Relaxed)
    }

    pub(crate) fn has_pending(&self) -> bool {
        self.has_pending.load(Ordering::Acquire)
    }

    /// Takes everything pending, each with its identity.
    pub(crate) fn drain(&self) -> Vec<Report> {
        if !self.has_pending() {
            return Vec::new();
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.has_pending.store(false, Ordering::Release);
        let now = micros(&*self.clock);
        let mut out = std::mem::take(&mut pending.resend);
        out.extend(
            pending
                .fresh
                .drain()
                .map(|(key, permits)| Report::new(key, permits, None, self.ops.next())),
        );
        for r in &mut out {
            r.sending(now);
        }
        out
    }

    /// Puts back reports that could not be delivered, to be resent as they
    /// are; returns the permits of those resent for too long, dropped.
    pub(crate) fn restore(&self, reports: impl IntoIterator<Item = Report>) -> u64 {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut dropped = 0;
        let now = micros(&*self.clock);
        for r in reports {
            match r.unavailable(now) {
                Resend::Later(r) => pending.resend.push(r),
                Resend::Dropped(permits) => dropped += permits,
            }
        }
        if !pending.resend.is_empty() {
            self.has_pending.store(true, Ordering::Release);
        }
        dropped
    }
}

/// Puts reconciliation reports back in the ledger if the future sending
/// them is dropped before the store answered.
struct RestoreOnDrop<'a> {
    ledger: &'a Reconciler,
    counters: &'a Counters,
    reports: Option<Vec<Report>>,
}

impl RestoreOnDrop<'_> {
    fn disarm(mut self) -> Vec<Report> {
        self.reports.take().unwrap_or_default()
    }
}

impl Drop for RestoreOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(reports) = self.reports.take() {
            // Those resent for too long are dropped here too, and counted.
            let dropped = self.ledger.restore(reports);
            self.counters.reports_dropped.add(dropped);
        }
    }
}

/// The store call that reports `report`, a fallback's admissions of a
/// user key: consumption of the key's current window or bucket.
pub(crate) fn report_call(report: &Report, keys: &KeyEncoder, params: &Params) -> LeaseCall {
    report.call(keys.store_key(&report.key, params.algorithm))
}

impl Reconciler {
    /// Settles a report with the store's answer: counted as reconciled
    /// (and what it found uncovered as overshoot); put back to be resent
    /// under its identity if the store was unavailable; dropped and
    /// counted if the store refused it for good (a key of the wrong type,
    /// a value out of range), never retried before every decision.
    /// Returns whether the store was available. The one place a report's
    /// fate is decided, for the exact path and the hybrid sync task.
    pub(crate) fn settle(
        &self,
        report: Report,
        answer: &Result<crate::algorithm::LeaseReply, crate::error::Error>,
        counters: &Counters,
    ) -> bool {
        match answer {
            Ok(reply) => {
                counters.reconciled.add(report.permits);
                counters.overshoot.add(reply.uncovered);
                true
            }
            Err(e) if e.is_unavailable() => {
                let dropped = self.restore([report]);
                counters.reports_dropped.add(dropped);
                false
            }
            Err(_) => {
                counters.reports_dropped.add(report.permits);
                true
            }
        }
    }
}

/// Reports what the fallback admitted as consumption of each key's
/// current window or bucket; `false` if the store is still unavailable.
/// Each report stands alone: one the store refuses for good (a key of the
/// wrong type, a value out of range) is dropped and counted, never retried
/// before every decision; one that timed out is resent later under the
/// same identity, so it is counted once even if the store had applied it.
/// A dropped future loses nothing: reports leave the ledger only here,
/// after the store answered, and go back otherwise.
pub(crate) async fn reconcile(
    ledger: &Reconciler,
    store: &Store,
    keys: &KeyEncoder,
    params: &Params,
    counters: &Counters,
) -> bool {
    let reports = ledger.drain();
    if reports.is_empty() {
        return true;
    }
    let guard = RestoreOnDrop {
        ledger,
        counters,
        reports: Some(reports),
    };
    let calls: Vec<LeaseCall> = guard
        .reports
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|r| report_call(r, keys, params))
        .collect();
    let leases: Vec<Lease<'_>> = calls.iter().map(|call| Lease { params, call }).collect();
    let (replies, _) = store.run_batch_counted(&leases, 0, counters).await;
    let reports = guard.disarm();
    let replies = match replies {
        Ok(replies) => replies,
        Err(e) => {
            let available = !e.is_unavailable();
            if available {
                let total: u64 = reports.iter().map(|r| r.permits).sum();
                counters.reports_dropped.add(total);
            } else {
                let dropped = ledger.restore(reports);
                counters.reports_dropped.add(dropped);
            }
            return available;
        }
    };
    let mut available = true;
    for (report, reply) in reports.into_iter().zip(replies) {
        available &= ledger.settle(report, &reply, counters);
    }
    available
}

/// A charge of `cost` permits for a user key, made (its identity fixed,
/// held for the ledger) but not yet sent: [`send`](PendingReport::send)
/// sends it. Dropped unsent, or dropped while the store has not answered,
/// it goes into the ledger under its identity, to be resent before the
/// limiter's next decision (exact) or with its sync task's next round
/// (hybrid): so it counts once whatever happened to a first delivery,
/// and a caller that makes several (one per quota) before awaiting any
/// loses none of them to a cancellation.
pub(crate) struct PendingReport<'a> {
    guard: RestoreOnDrop<'a>,
    call: LeaseCall,
    store: &'a Store,
    params: &'a Params,
}

impl<'a> PendingReport<'a> {
    pub(crate) fn new(
        ledger: &'a Reconciler,
        store: &'a Store,
        keys: &KeyEncoder,
        params: &'a Params,
        counters: &'a Counters,
        key: &str,
        cost: u64,
    ) -> Self {
        let mut report = Report::new(key.to_owned(), cost, None, ledger.ops.next());
        report.sending(micros(&*ledger.clock));
        let call = report_call(&report, keys, params);
        PendingReport {
            guard: RestoreOnDrop {
                ledger,
                counters,
                reports: Some(vec![report]),
            },
            call,
            store,
            params,
        }
    }

    /// Sends it; the store's reply, or `None` if it did not answer (the
    /// charge then waits in the ledger).
    pub(crate) async fn send(self) -> Option<crate::algorithm::LeaseReply> {
        let (answer, _) = self
            .store
            .run_counted(
                &Lease {
                    params: self.params,
                    call: &self.call,
                },
                self.guard.counters,
            )
            .await;
        let (ledger, counters) = (self.guard.ledger, self.guard.counters);
        for report in self.guard.disarm() {
            ledger.settle(report, &answer, counters);
        }
        answer.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use std::time::Duration;

    #[test]
    fn the_reconciliation_ledger_is_bounded_and_counts_what_it_drops() {
        let ledger = Reconciler::new(Arc::new(FakeClock::new(Duration::ZERO)));
        for i in 0..MAX_LEDGER_KEYS + 10 {
            ledger.record(&format!("k{i}"), 2);
        }
        ledger.record("k0", 1); // a key already held still adds up
        assert_eq!(ledger.take_dropped(), 20);
        assert_eq!(ledger.take_dropped(), 0);
        let reports = ledger.drain();
        assert_eq!(reports.len(), MAX_LEDGER_KEYS);
        let k0 = reports.iter().find(|r| r.key == "k0").map(|r| r.permits);
        assert_eq!(k0, Some(3));
    }
}
