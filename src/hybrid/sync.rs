//! The sync task: the only place the hybrid limiter talks to the store.
//!
//! Woken when a slot runs low, it drains the refill queue, sizes each
//! lease, and sends many keys' leases in one pipelined round trip; it also
//! gives back unused permits, reports debt, expires and evicts slots. It
//! never blocks the request path: slots are updated with atomics and the
//! few locks are held only between awaits.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::sizing::{SizingRule, SEED_PERMITS};
use super::slot::{Credit, Installed, NextLease, Slot};
use futures_util::future::join_all;

use super::{HybridConfig, Shared};
use crate::algorithm::{
    LeaseCall, LeaseKind, LeaseOrigin, LeaseReply, LeaseTarget, LeaseView, OpId, MAX_REPORT,
};
use crate::failure::{Report, RESEND_FOR};
use crate::Error;

/// Local clocks are assumed to run within this many parts per million of
/// Redis' clock (NTP keeps servers within tens of ppm; an undisciplined
/// crystal is within ±100). A deadline projected `d` µs ahead from a
/// Redis reply is brought forward by `d × MAX_DRIFT_PPM / 10^6`, so a
/// window-W permit is never spent after Redis ended W.
pub(crate) const MAX_DRIFT_PPM: u64 = 500;

/// The drift allowance for a deadline `ahead_us` in the future.
pub(crate) fn drift_us(ahead_us: u64) -> u64 {
    ahead_us / (1_000_000 / MAX_DRIFT_PPM)
}

/// Debt to report on its own (an evicted slot's, or one whose lease call
/// failed), under the identity it was first sent with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DebtReport {
    pub(crate) key: String,
    pub(crate) debt: u64,
    /// Fixed window: the window the debt was admitted in.
    pub(crate) window: i64,
    pub(crate) op: OpId,
    /// Deliveries that found the store unavailable, for the back-off.
    pub(crate) attempts: u32,
    /// Local µs before which it is not resent.
    pub(crate) not_before: u64,
    /// When it was first sent (see `RESEND_FOR`).
    pub(crate) first_sent: Option<u64>,
}

/// The back-off of a report the store could not take: 50 ms doubling to
/// at most 5 s.
fn backoff_us(attempts: u32) -> u64 {
    (50_000u64 << attempts.min(7)).min(5_000_000)
}

/// How often expiry, idle eviction and `max_keys` are enforced.
pub(crate) const MAINTENANCE: Duration = Duration::from_millis(100);

/// Clears `Shared::alive` however the sync task ends: returning, a panic
/// unwinding through it, or its runtime dropping it.
struct Alive<'a>(&'a Shared);

impl Drop for Alive<'_> {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
    }
}

pub(crate) async fn run(shared: Arc<Shared>) {
    let _alive = Alive(&shared);
    let mut maintenance = tokio::time::interval(MAINTENANCE);
    maintenance.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sweep = 0;
    // The last round stopped with work left (see `BATCHES_PER_ROUND`).
    let mut more = false;
    loop {
        let woken = if more {
            // Maintenance first if it is due, then straight on.
            tokio::select! {
                biased;
                _ = maintenance.tick() => sweep = tick(&shared, sweep),
                _ = tokio::task::yield_now() => {}
            }
            false
        } else {
            tokio::select! {
                _ = shared.wake.notified() => true,
                _ = maintenance.tick() => {
                    sweep = tick(&shared, sweep);
                    false
                }
            }
        };
        if woken && !shared.urgent.load(Ordering::Acquire) {
            // Nobody waits yet: let refills of other keys join this batch.
            let until = tokio::time::Instant::now() + shared.config.load().coalesce;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    _ = shared.wake.notified() => {
                        if shared.urgent.load(Ordering::Acquire) || shared.stopping.load(Ordering::Acquire) {
                            break;
                        }
                    }
                }
            }
        }
        if shared.stopping.load(Ordering::Acquire) {
            // Dropped without `shutdown`: do its work here, so unused
            // permits go back and debt is reported all the same.
            // (`shutdown` closes the limiter first and finishes itself.)
            if !shared.closed.load(Ordering::Acquire) {
                shared.finish().await;
            }
            return;
        }
        more = round(&shared).await;
    }
}

/// One maintenance tick: the next slice of the sweep.
fn tick(shared: &Shared, sweep: usize) -> usize {
    maintain(shared, Some(sweep % SWEEP_SLICES));
    sweep.wrapping_add(1)
}

/// What a round has taken from the queues and not yet settled. If the
/// round's future is dropped (`shutdown` abandoned by its caller, the
/// runtime going away), everything goes back where it came from: reports
/// to their queues under their identities, a lease's debt to the report
/// queue, its slot free to ask again.
struct Unsent<'a> {
    shared: &'a Shared,
    fallback: Vec<Report>,
    debts: Vec<DebtReport>,
    /// The batches in flight.
    batches: Vec<Vec<Pending>>,
    /// When it was sent (local µs): a lease's debt resent after a drop is
    /// timed from its first sending (see `RESEND_FOR`).
    sent_at: u64,
}

impl Drop for Unsent<'_> {
    fn drop(&mut self) {
        let shared = self.shared;
        let mut fallback = std::mem::take(&mut self.fallback);
        let mut debts = std::mem::take(&mut self.debts);
        for p in std::mem::take(&mut self.batches).into_iter().flatten() {
            if p.peek {
                // Took nothing, changed nothing: forgotten.
                continue;
            }
            match (p.report, p.slot) {
                (Some(Reported::Fallback(r)), _) => fallback.push(r),
                (Some(Reported::Debt(r)), _) => debts.push(r),
                (None, Some(slot)) => {
                    lose_lease(&slot, &p.call);
                    if let Some(op) = p.call.op.filter(|_| p.call.debt > 0) {
                        let recalled = slot.credit_settled(p.call.debt);
                        give_recalled_back(shared, &p.call, recalled);
                        shared.queue_report(DebtReport {
                            key: p.call.key.clone(),
                            debt: p.call.debt,
                            window: p.call.debt_window,
                            op,
                            attempts: 0,
                            not_before: 0,
                            first_sent: Some(self.sent_at),
                        });
                    }
                    slot.refill_done();
                    shared.refilled(&slot).notify_waiters();
                }
                (None, None) => {}
            }
        }
        if !fallback.is_empty() {
            let dropped = shared.reconciler.restore(fallback);
            shared.counters.reports_dropped.add(dropped);
        }
        if !debts.is_empty() {
            shared
                .reports
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(debts);
        }
    }
}

/// A lease call's reply is lost (an error, or its future dropped): its
/// identity is kept for the next lease of the slot.
fn lose_lease(slot: &Slot, call: &LeaseCall) {
    if call.lease_id != 0 {
        slot.books().lost_lease = call.lease_id;
    }
}

/// One lease in flight, with what is needed to apply its reply.
struct Pending {
    slot: Option<Arc<Slot>>,
    call: LeaseCall,
    /// Token bucket / GCRA: replace the current permits (fresh horizon).
    renew: bool,
    /// What the call reports, if it is a report rather than a lease.
    report: Option<Reported>,
    /// The lease is sized to last until its window ends: no refill ahead
    /// of need when it runs low (each would be cut smaller again by the
    /// time left, a trickle of ever smaller leases to the boundary).
    to_the_end: bool,
    /// A peek at a watched slot's window (see [`Watched`]): it takes
    /// nothing and leaves the slot's refill state alone.
    peek: bool,
}

/// A report in flight, to be settled or resent as it was.
enum Reported {
    /// Debt of an evicted slot, or of a failed lease call.
    Debt(DebtReport),
    /// What the failure policy's fallback admitted.
    Fallback(Report),
}

/// Refills waiting to be sent. Waiters first: a slot a request waits on
/// goes before one refilled ahead of need (low water, pre-lease). A slot
/// promoted while queued has an entry in both; the first taken wins and
/// the other is skipped as a duplicate.
#[derive(Default)]
pub(crate) struct RefillQueue {
    waiting: VecDeque<Arc<Slot>>,
    ahead: VecDeque<Arc<Slot>>,
}

impl RefillQueue {
    pub(crate) fn push(&mut self, slot: Arc<Slot>, waiting: bool) {
        if waiting {
            self.waiting.push_back(slot);
        } else {
            self.ahead.push_back(slot);
        }
    }

    /// The next refill to send, marked in flight. A waiters' entry whose
    /// slot was last used more than `max_wait_ms` ago has nobody waiting
    /// any more (they were denied at `max_wait`): it moves behind the
    /// waiters still in time, so an overload serves those it can still
    /// serve instead of those already turned away.
    fn pop(&mut self, now: u64, max_wait_ms: u64) -> Option<Arc<Slot>> {
        loop {
            let slot = match self.waiting.pop_front() {
                Some(slot) if slot.idle_ms(now) > max_wait_ms => {
                    self.ahead.push_back(slot);
                    continue;
                }
                Some(slot) => slot,
                None => self.ahead.pop_front()?,
            };
            // A duplicate: already sent, or settled since it was queued.
            if !slot.refill_pending.load(Ordering::Acquire)
                || slot.in_flight.swap(true, Ordering::AcqRel)
            {
                continue;
            }
            slot.promoted.store(false, Ordering::Release);
            return Some(slot);
        }
    }
}

/// Pipelines a round keeps in flight at once. On a real network the round
/// trip, not Redis, limits one pipeline at a time: four batches of 512
/// leases per round trip.
pub(crate) const PIPELINES: usize = 4;

/// Batches a round sends before it returns to the task's loop, so that
/// sustained refill demand cannot starve maintenance or the stop signal.
const BATCHES_PER_ROUND: usize = 16;

/// Sends what is queued, in this order: the fallback's admissions and
/// debt reports (Redis counts them before granting anything new), leases
/// (waiters first), then give-backs. Up to `PIPELINES` batches of
/// `batch_size` calls are in flight at once; a round ends when the queues
/// are empty or after `BATCHES_PER_ROUND` batches (it then wakes the task
/// again). Returns whether work is left.
pub(crate) async fn round(shared: &Shared) -> bool {
    shared.urgent.store(false, Ordering::Release);
    // Reports are taken once per round: one that fails goes back to its
    // queue for the next round (the maintenance tick paces retries), so a
    // round always ends, even while the store refuses every call.
    let mut unsent = Unsent {
        shared,
        fallback: shared.reconciler.drain(),
        debts: Vec::new(),
        batches: Vec::new(),
        sent_at: 0,
    };
    unsent.debts = {
        let now = shared.time.precise_us();
        let mut queued = shared.reports.lock().unwrap_or_else(|p| p.into_inner());
        let (due, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut *queued).into_iter().partition(|r| {
                // The last round (shutdown) sends everything it has.
                r.not_before <= now || shared.closed.load(Ordering::Acquire)
            });
        *queued = later;
        due
    };
    let last = shared.closed.load(Ordering::Acquire);
    let mut sent = 0;
    let mut more = false;
    loop {
        let config = shared.config.load_full();
        let now = shared.time.precise_us();
        let mut batches: Vec<Vec<Pending>> = Vec::new();
        while batches.len() < PIPELINES {
            let batch = next_batch(shared, &config, &mut unsent, now);
            if batch.is_empty() {
                break;
            }
            batches.push(batch);
        }
        if batches.is_empty() {
            break;
        }
        let calls: Vec<Vec<LeaseCall>> = batches
            .iter()
            .map(|b| b.iter().map(|p| p.call.clone()).collect())
            .collect();
        sent += batches.len();
        unsent.batches = batches;
        let t0 = shared.time.precise_us();
        unsent.sent_at = t0;
        let results = join_all(calls.iter().enumerate().map(|(i, batch)| {
            let ahead: usize = calls[..i].iter().map(Vec::len).sum();
            async move {
                let (result, cost) = shared
                    .store
                    .lease_batch(&shared.params, batch, ahead, &shared.counters)
                    .await;
                (result, cost, shared.time.precise_us())
            }
        }))
        .await;
        let batches = std::mem::take(&mut unsent.batches);
        shared.counters.circuit(shared.store.circuit_state());
        // One server ran the round's scripts in order (not so a cluster's
        // nodes, each with its own clock): the earliest clock any of them
        // read was read at `t0` or later.
        let first = (!shared.store.is_sharded())
            .then(|| {
                results
                    .iter()
                    .filter_map(|(r, ..)| r.as_ref().ok())
                    .flatten()
                    .filter_map(|r| r.as_ref().ok().map(|r| r.now_us))
                    .min()
            })
            .flatten();
        for (pending, (result, cost, t1)) in batches.into_iter().zip(results) {
            let sent = cost.round_trips > 0;
            settle(
                shared,
                &config,
                pending,
                result,
                sent,
                Sent { t0, t1, first },
            );
        }
        if sent >= BATCHES_PER_ROUND && !last {
            more = true;
            break;
        }
    }
    // What is left of the reports goes back to its queues.
    drop(unsent);
    give_back_all(shared).await;
    more
}

/// The next batch: reports first, then leases, waiters before the rest.
fn next_batch(
    shared: &Shared,
    config: &HybridConfig,
    unsent: &mut Unsent<'_>,
    now: u64,
) -> Vec<Pending> {
    let mut pending: Vec<Pending> = Vec::new();
    while pending.len() < config.batch_size {
        let Some(report) = unsent.fallback.pop() else {
            break;
        };
        pending.push(Pending {
            slot: None,
            call: LeaseCall::report(
                shared.keys.store_key(&report.key, shared.params.algorithm),
                report.permits,
                report.op,
            ),
            renew: false,
            report: Some(Reported::Fallback(report)),
            to_the_end: false,
            peek: false,
        });
    }
    while pending.len() < config.batch_size {
        let Some(mut report) = unsent.debts.pop() else {
            break;
        };
        report.first_sent.get_or_insert(now);
        pending.push(Pending {
            slot: None,
            call: LeaseCall {
                debt_window: report.window,
                ..LeaseCall::report(report.key.clone(), report.debt, report.op)
            },
            renew: false,
            report: Some(Reported::Debt(report)),
            to_the_end: false,
            peek: false,
        });
    }
    let room = config.batch_size.saturating_sub(pending.len());
    let slots: Vec<Arc<Slot>> = {
        let mut queue = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        let max_wait_ms = config.max_wait.as_millis() as u64;
        std::iter::from_fn(|| queue.pop(now, max_wait_ms))
            .take(room)
            .collect()
    };
    for slot in slots {
        if slot.evicted.load(Ordering::Acquire) {
            slot.refill_done();
            shared.refilled(&slot).notify_waiters();
            continue;
        }
        pending.push(lease_call(shared, config, slot, now));
    }
    if !pending.is_empty() && !shared.store.is_sharded() {
        add_rides(shared, config, &mut pending, now);
        add_peeks(shared, &mut pending, config.batch_size, now);
    }
    pending
}

/// When a batch went out and came back (local µs), and the earliest store
/// clock read by any script of its round (`None`: the round's scripts ran
/// on several servers).
#[derive(Clone, Copy)]
struct Sent {
    t0: u64,
    t1: u64,
    first: Option<u64>,
}

impl Sent {
    /// When the script that read the store's clock at `now_us` ran, as
    /// local bounds: within [t0, t1], and — the round's scripts having run
    /// in order on one server — at least as long after `t0` as it read
    /// after the round's first, and at least as long before `t1` as it
    /// read before its batch's `last` (less the drift allowance both
    /// ways). Without this, every reply of a long pipeline was placed
    /// anywhere in the whole round trip: its lease ended early and its
    /// pre-lease started late by the time the pipeline took to run.
    fn narrowed(self, now_us: u64, last: u64) -> (u64, u64) {
        let Some(first) = self.first else {
            return (self.t0, self.t1);
        };
        let after_first = now_us.saturating_sub(first);
        let before_last = last.saturating_sub(now_us);
        let lo = self.t0 + (after_first - drift_us(after_first));
        let hi = self.t1.saturating_sub(before_last - drift_us(before_last));
        if lo <= hi {
            (lo, hi)
        } else {
            (self.t0, self.t1)
        }
    }
}

/// Applies a batch's replies; `sent`: it left the process (a call the
/// breaker refused is neither a lease requested nor a round-trip sample).
fn settle(
    shared: &Shared,
    config: &HybridConfig,
    pending: Vec<Pending>,
    results: Result<Vec<Result<LeaseReply, Error>>, Error>,
    sent: bool,
    at: Sent,
) {
    let Sent { t0, t1, .. } = at;
    if sent {
        let requested = pending.iter().filter(|p| p.call.want > 0).count() as u64;
        shared.counters.leases_requested.add(requested);
        let rtt = t1.saturating_sub(t0);
        let old = shared.rtt_us.load(Ordering::Relaxed);
        shared.rtt_us.store(
            if old == 0 { rtt } else { (old * 7 + rtt) / 8 },
            Ordering::Relaxed,
        );
    }
    match results {
        Ok(results) => {
            let last = results
                .iter()
                .filter_map(|r| r.as_ref().ok().map(|r| r.now_us))
                .max()
                .unwrap_or(0);
            for (p, result) in pending.into_iter().zip(results) {
                let (t0, t1) = match &result {
                    Ok(r) => at.narrowed(r.now_us, last),
                    Err(_) => (t0, t1),
                };
                apply(shared, config, p, result, t0, t1);
            }
        }
        Err(e) => {
            for p in pending {
                apply(shared, config, p, Err(e.clone()), t0, t1);
            }
        }
    }
}

/// Sends the queued give-backs. They go last: a waiter's lease matters
/// more than returning permits nobody is asking for yet.
pub(crate) async fn give_back_all(shared: &Shared) {
    let returns = std::mem::take(&mut *shared.returns.lock().unwrap_or_else(|p| p.into_inner()));
    for chunk in returns.chunks(shared.config.load().batch_size) {
        let (result, _) = shared
            .store
            .give_back_batch(&shared.params, chunk, &shared.counters)
            .await;
        match result {
            Ok(results) => {
                for (call, result) in chunk.iter().zip(results) {
                    match result {
                        Ok(back) => {
                            shared.counters.given_back.add(back);
                            shared
                                .counters
                                .stranded
                                .add(call.returned.saturating_sub(back));
                        }
                        Err(_) => shared.counters.stranded.add(call.returned),
                    }
                }
            }
            Err(_) => {
                let lost: u64 = chunk.iter().map(|c| c.returned).sum();
                shared.counters.stranded.add(lost);
            }
        }
    }
}

fn lease_call(shared: &Shared, config: &HybridConfig, slot: Arc<Slot>, now: u64) -> Pending {
    let period = shared.params.period_us;
    let permits = slot.permits.load(Ordering::Acquire);
    let valid = now < slot.deadline.load(Ordering::Acquire);
    let near_end = slot.near_end(now, shared.early_lead());
    let mut books = slot.books();
    let credit = Credit {
        debt: books.credit.debt,
        window: books.credit.window,
        in_flight: 0,
        recalled: 0,
    };
    books.credit.in_flight += books.credit.debt;
    books.credit.debt = 0;
    let need = u64::from(slot.need.swap(0, Ordering::AcqRel));
    let rule = SizingRule {
        min_lease: config.min_lease,
        max_lease: config.max_lease,
        horizon_us: config.refill_horizon.as_micros() as u64,
    };
    let window = slot.window.load(Ordering::Acquire);
    let windowed = shared.leases.windowed();
    books.sizing.observe(
        permits,
        u64::from(credit.debt),
        now,
        (windowed && window != super::slot::UNKNOWN_WINDOW).then_some(window),
    );
    let deadline = slot.deadline.load(Ordering::Acquire);
    // Permits that would arrive void (they end within a round trip and
    // the margin) are not worth asking for.
    let rtt = shared.rtt_us.load(Ordering::Relaxed) + shared.time.tick_us();
    let swept = slot.swept_ahead.swap(false, Ordering::AcqRel);
    let LeaseTarget {
        min_window,
        renew,
        time_left_us: time_left,
    } = shared.leases.target(&LeaseView {
        window: (window != super::slot::UNKNOWN_WINDOW).then_some(window),
        valid,
        near_end,
        ending: now + rtt >= deadline,
        // An ended lease's slot is pre-leased only when swept for it
        // with nobody waiting (a waiter needs the current window).
        prelease: !shared.prelease_lead(config).is_zero()
            && if valid {
                (near_end && permits > 0) || swept
            } else {
                swept && need == 0
            },
        has_next: slot.has_next(),
        left_us: deadline.saturating_sub(now),
        since_us: now.saturating_sub(deadline),
        period_us: period,
    });
    let ahead = if valid {
        min_window > window
    } else {
        swept && need == 0 && window != super::slot::UNKNOWN_WINDOW
    };
    let (want, to_the_end) =
        books
            .sizing
            .want_to_the_end(rule, if ahead { 0 } else { permits }, now, need, time_left);
    let mut ceiling = books.sizing.ceiling(
        want,
        time_left.unwrap_or(config.lease_ttl.as_micros() as u64),
        (shared.params.limit.max(shared.params.burst) / 32).max(1),
        config.max_lease,
    );
    // A window lease is earned by use (see `sizing::EARNED_FLOOR_DIVISOR`):
    // what a burst seemed to promise is not taken from processes that
    // keep asking.
    let mut want = want;
    let mut ahead_cap = 0;
    if windowed {
        let earned = books.sizing.earned(shared.params.limit, config.min_lease);
        // A thin holder's pre-lease: what its next window will likely
        // use, only while the key is far under its limit (the store
        // checks; see `Sizing::thin`).
        if let Some(used) = books
            .sizing
            .per_window()
            .filter(|_| ahead && books.sizing.thin())
        {
            want = want.max(thin_want(used));
            ahead_cap = (shared.params.limit / THIN_AHEAD_CAP_DIVISOR).max(1);
        }
        want = want.min(earned).max(need);
        ceiling = ceiling.min(earned).max(want);
    }
    // Window leases have an identity; after a lost reply the next one
    // reuses it (see `LeaseCall::lease_id`).
    let lease_id = if shared.leases.identified() {
        match std::mem::take(&mut books.lost_lease) {
            0 => shared.ops.next_lease(),
            lost => lost,
        }
    } else {
        0
    };
    drop(books);
    let call = LeaseCall {
        key: shared.store_key(&slot),
        want,
        share_cap: config.share_cap,
        debt: u64::from(credit.debt).min(MAX_REPORT),
        debt_window: credit.window,
        min_window,
        need: shared.leases.need(need, shared.params.limit),
        patience: need.max(want / 4).max(1),
        op: (credit.debt > 0).then(|| shared.ops.next()),
        holder: Some(shared.holder.clone()),
        ceiling,
        lease_id,
        ahead_cap,
    };
    Pending {
        slot: Some(slot),
        call,
        renew,
        report: None,
        to_the_end,
        peek: false,
    }
}

/// Applies one lease call's reply (or its failure) to its slot, or
/// settles a report; wakes whoever waits on the slot.
fn apply(
    shared: &Shared,
    config: &HybridConfig,
    p: Pending,
    result: Result<LeaseReply, Error>,
    t0: u64,
    t1: u64,
) {
    let Some(slot) = p.slot.clone() else {
        settle_report(shared, p.report, &result);
        return;
    };
    if p.peek {
        if let Ok(r) = result {
            peek_answered(shared, config, &slot, &r, t1);
        }
        return;
    }
    let recalled = if p.call.debt > 0 {
        let recalled = slot.credit_settled(p.call.debt);
        give_recalled_back(shared, &p.call, recalled);
        recalled
    } else {
        0
    };
    match result {
        Err(_) => lease_failed(shared, &slot, &p.call, t0),
        Ok(mut r) => {
            // Recalled credit goes back to the store: it was never
            // admitted, so what it left uncovered is no overshoot.
            r.uncovered = r.uncovered.saturating_sub(u64::from(recalled));
            lease_answered(shared, config, &slot, &p, &r, t0, t1)
        }
    }
    slot.refill_done();
    shared.refilled(&slot).notify_waiters();
}

/// Credit a lease call reported and another quota's denial recalled
/// meanwhile: the store counted it, so it goes back (to the window it
/// was reported in).
fn give_recalled_back(shared: &Shared, call: &LeaseCall, recalled: u32) {
    // (A bucket's recalled credit stays taken: its give-back would need
    // the lease's origin, and a bucket refills by itself.)
    if recalled > 0 && shared.leases.windowed() {
        let origin = LeaseOrigin::default();
        shared.give_back(&call.key, u64::from(recalled), call.debt_window, origin);
    }
}

/// A report's reply: an evicted slot's debt, or the fallback's admissions.
/// Unavailability resends it as it was (same identity); a refusal (wrong
/// type, out of range) will never apply, so it is dropped and counted
/// rather than retried forever.
fn settle_report(shared: &Shared, report: Option<Reported>, result: &Result<LeaseReply, Error>) {
    let counters = &shared.counters;
    let retry = matches!(result, Err(e) if e.is_unavailable());
    match report {
        Some(Reported::Fallback(report)) if retry => {
            let dropped = shared.reconciler.restore([report]);
            counters.reports_dropped.add(dropped);
        }
        Some(Reported::Debt(report))
            if retry
                && report.first_sent.is_some_and(|t| {
                    shared.time.precise_us().saturating_sub(t) > RESEND_FOR.as_micros() as u64
                }) =>
        {
            // Its identity may be forgotten by now: a resend could count
            // it twice. Dropped and counted instead.
            counters.reports_dropped.add(report.debt);
            shared.report_settled(&report);
        }
        Some(Reported::Debt(mut report)) if retry => {
            report.attempts += 1;
            report.not_before = shared.time.precise_us() + backoff_us(report.attempts);
            shared
                .reports
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(report)
        }
        Some(Reported::Fallback(report)) => match result {
            Ok(r) => {
                counters.overshoot.add(r.uncovered);
                counters.reconciled.add(report.permits);
            }
            Err(_) => counters.reports_dropped.add(report.permits),
        },
        Some(Reported::Debt(report)) => {
            match result {
                Ok(r) => counters.overshoot.add(r.uncovered),
                Err(_) => counters.reports_dropped.add(report.debt),
            }
            shared.report_settled(&report);
        }
        None => {}
    }
}

/// A lease call that got no reply. The store may have granted it all the
/// same (a timeout after Redis ran the call): the next lease asks for that
/// grant back. Debt it carried is resent on its own under the same
/// identity, since the store may have applied it before the reply was lost.
fn lease_failed(shared: &Shared, slot: &Slot, call: &LeaseCall, t0: u64) {
    lose_lease(slot, call);
    if let Some(op) = call.op.filter(|_| call.debt > 0) {
        shared.queue_report(DebtReport {
            key: call.key.clone(),
            debt: call.debt,
            window: call.debt_window,
            op,
            attempts: 1,
            not_before: shared.time.precise_us() + backoff_us(1),
            // It was sent once, inside the lease call.
            first_sent: Some(t0),
        });
    }
    slot.refill_failed.store(true, Ordering::Release);
}

/// A lease call's reply: what it says of the store (its clock, what
/// remains, debt it could not cover), then the grant (installed, or given
/// back if the slot was retired meanwhile) or the denial.
fn lease_answered(
    shared: &Shared,
    config: &HybridConfig,
    slot: &Arc<Slot>,
    p: &Pending,
    r: &LeaseReply,
    t0: u64,
    t1: u64,
) {
    let counters = &shared.counters;
    slot.refill_failed.store(false, Ordering::Release);
    observe_store_clock(shared, r, t0, t1);
    counters.overshoot.add(r.uncovered);
    let windowed = shared.leases.windowed();
    if r.uncovered > 0 && windowed {
        // The window the debt went to (the store's current one when the
        // process did not know it) is closed to credit.
        let current = r.window - i64::from(r.start_after_us > 0);
        let mut books = slot.books();
        books.credit_closed = books.credit_closed.max(p.call.debt_window.max(current));
    }
    slot.store_remaining.store(
        r.remaining.min(u64::from(u32::MAX)) as u32,
        Ordering::Relaxed,
    );
    if windowed && r.start_after_us == 0 && r.remaining == 0 {
        slot.books().used_up = r.window as u32;
    }
    if windowed {
        shared
            .window_end_hint
            .store(t0 + r.reset_after_us, Ordering::Relaxed);
    } else {
        // Buckets have no window: the field holds when they are full.
        slot.window_end
            .store(t0 + r.reset_after_us, Ordering::Relaxed);
    }
    // Window leases: the deadline is the window's end, `reset_after`
    // ahead. Buckets: the lease horizon, drift added when installed.
    let margin = config.clock_margin.as_micros() as u64
        + shared.time.tick_us()
        + if windowed {
            drift_us(r.reset_after_us)
        } else {
            0
        };
    let now = shared.time.precise_us();
    if r.granted > 0 && slot.evicted.load(Ordering::Acquire) {
        // The slot was retired while its lease was in flight: no request
        // will spend these permits here. Give them back.
        counters.lease_granted(r.granted);
        shared.give_back(&p.call.key, r.granted, r.window, origin_of(r));
    } else if r.granted > 0 {
        counters.lease_granted(r.granted);
        install_grant(
            shared,
            config,
            slot,
            p,
            r,
            Times {
                t0,
                t1,
                margin,
                now,
            },
        );
        let low_water = low_water_after(shared, slot, p, r);
        if windowed && r.start_after_us > 0 {
            // A pre-lease: its mark applies once it is in place; the
            // current window's permits keep theirs (a mark sized from the
            // next window's grant would ask the current one, often already
            // fully leased, for more).
            slot.set_next_low_water(r.window, low_water);
        } else {
            slot.low_water.store(low_water, Ordering::Relaxed);
            if windowed && r.remaining > 0 {
                // The store has room in this window after all (a peek
                // that found it full was overtaken by a give-back).
                slot.deny_until(0);
            }
            if windowed && !shared.store.is_sharded() {
                expect_refill(shared, slot, r, low_water, now);
            }
        }
        if windowed && !shared.store.is_sharded() {
            if let Some(rate) = runs_out_early(slot, r, config.max_lease) {
                let until = t0.saturating_add(r.reset_after_us).saturating_sub(margin);
                watch(shared, slot, r, rate, until, t1);
            }
        }
    } else if p.call.want > 0 && p.call.ahead_cap == 0 {
        // (A thin holder's pre-lease refused changes nothing: the key is
        // near its limit, or crowded, and its current lease stands.)
        if r.start_after_us == 0 {
            // Redis answered before t1: from t1 + retry_after on, the
            // store surely has something again.
            let mut until = t1 + r.retry_after_us + margin;
            // The first denial after a calm spell asks once more, after
            // the time an idle holder takes to give back what it will not
            // spend (`trim_idle`): a window fully leased is not always
            // fully spent.
            let before = slot.denied_until.load(Ordering::Acquire);
            let calm = before.saturating_add(shared.params.period_us) <= t1;
            if windowed && calm {
                until = until.min(t1 + trim_delay_us(shared.params.period_us));
            }
            slot.deny_until(until);
        } else if now >= slot.deadline.load(Ordering::Acquire) {
            // Nothing left of the next window, which has not begun in the
            // store, while this process's permits of the current one are
            // void: nothing can be admitted here before the next window
            // starts. Denied until then (asking again at once would spin
            // on the store).
            slot.deny_until(t1 + r.start_after_us + margin);
        }
        // Nothing to be had: spend what is held, then ask again (the
        // denied-until time keeps that from costing round trips).
        slot.low_water.store(0, Ordering::Relaxed);
        slot.early_refill.store(false, Ordering::Relaxed);
    }
    let level = slot.permits.load(Ordering::Acquire);
    slot.books().sizing.applied(level, now);
}

/// The store's clock as a reply read it, for the fallback's windows and
/// for credit before a key's first lease. Redis read it somewhere in
/// [t0, t1] locally: the middle, give or take half the round trip.
fn observe_store_clock(shared: &Shared, r: &LeaseReply, t0: u64, t1: u64) {
    let mid = t0 + (t1 - t0) / 2;
    let fallback_local = shared.fallback_clock.local_us();
    shared
        .fallback_clock
        .observe(fallback_local.saturating_sub(t1 - mid), r.now_us);
    *shared.store_clock.lock().unwrap_or_else(|p| p.into_inner()) = Some(super::StoreClock {
        offset_us: r.now_us as i64 - mid as i64,
        error_us: (t1 - t0) / 2 + 1,
        at_us: t1,
    });
}

/// Where a bucket lease's permits came from (see [`LeaseOrigin`]).
fn origin_of(r: &LeaseReply) -> LeaseOrigin {
    LeaseOrigin {
        at_us: r.now_us,
        level: r.level,
        given_back: r.given_back,
    }
}

/// The local times a reply is placed by: sent at `t0`, answered at `t1`,
/// applied at `now`, with `margin` for clocks and drift.
#[derive(Clone, Copy)]
struct Times {
    t0: u64,
    t1: u64,
    margin: u64,
    now: u64,
}

/// Puts a grant in place: a window lease in the slot (or, ahead of its
/// window, held apart until it starts); a bucket lease in the slot, its
/// origin merged with or replacing the one held.
fn install_grant(
    shared: &Shared,
    config: &HybridConfig,
    slot: &Arc<Slot>,
    p: &Pending,
    r: &LeaseReply,
    at: Times,
) {
    let counters = &shared.counters;
    let granted = r.granted as i64;
    let Times {
        t0,
        t1,
        margin,
        now,
    } = at;
    match shared.leases {
        LeaseKind::Window => {
            // Redis evaluated somewhere in [t0, t1] locally: the window
            // ends no earlier than t0 + reset and starts no later than
            // t1 + start_after.
            let deadline = (t0 + r.reset_after_us).saturating_sub(margin);
            let window_end = t1 + r.reset_after_us + margin;
            if r.start_after_us > 0 {
                let lease = NextLease {
                    permits: granted,
                    window: r.window,
                    start: t1 + r.start_after_us + margin,
                    deadline,
                    window_end,
                    low_water: 0,
                };
                counters.stranded.add(slot.hold_next(lease) as u64);
            } else {
                match slot.install(granted, r.window, deadline, window_end, now, false) {
                    Installed::Replaced(n) | Installed::Stale(n) => counters.stranded.add(n as u64),
                }
            }
        }
        LeaseKind::Bucket => {
            let horizon = config.lease_ttl.as_micros() as u64;
            let deadline = (t0 + horizon).saturating_sub(margin + drift_us(horizon));
            let full_at = t0 + r.reset_after_us;
            let origin = origin_of(r);
            let mut books = slot.books();
            let before = books.origin;
            match slot.install(granted, 0, deadline, full_at, now, p.renew) {
                Installed::Replaced(0) if !p.renew && before.at_us != 0 => {
                    // Added to permits still held: the merged lease
                    // answers to the older origin too.
                    books.origin = before.merge(origin);
                }
                Installed::Replaced(replaced) => {
                    books.origin = origin;
                    drop(books);
                    if replaced > 0 {
                        shared.give_back(&shared.store_key(slot), replaced as u64, 0, before);
                    }
                }
                Installed::Stale(n) => counters.stranded.add(n as u64),
            }
        }
    }
}

/// A window lease covers its window when it holds this much more than the
/// rate spends until the window ends (the rate is an average; demand runs
/// ahead of it).
const COVER_MARGIN: f64 = 1.2;

/// The low-water mark after a grant: below it, a refill is requested.
fn low_water_after(shared: &Shared, slot: &Slot, p: &Pending, r: &LeaseReply) -> u32 {
    let windowed = shared.leases.windowed();
    // Refill before the lease runs dry: at half of what the rate asked
    // for, or a quarter of a headroom grant. Not when the store cut the
    // lease below half the ask (a contested key: many holders, little
    // left): a permit fetched ahead of need would wait idle in every
    // holder, and at the window's end a thousand holders' one permit each
    // is a thousand stranded.
    let contested = windowed && r.granted < p.call.want / 2;
    // Nor for a thin holder (a few permits a window): what it fetched
    // ahead would wait idle for its next request, and with many such
    // holders, a window's budget with it. (A key whose rate is not known
    // yet is not thin: its first lease says nothing about it.)
    let thin = windowed && slot.books().sizing.thin();
    if contested {
        // Nor a pre-lease of the next window: spread over every holder
        // whatever its rate, it strands the same way.
        slot.early_refill.store(false, Ordering::Relaxed);
    }
    // A window lease that, with what is held, covers what the rate spends
    // until its window ends is that window's last: refilled only if demand
    // outruns it, not at half (a refill at half would ask a window that is
    // often fully leased by then, for permits this process will not use).
    let covers = windowed && {
        let rate = slot.books().sizing.rate_per_us();
        let serves = r.reset_after_us.saturating_sub(r.start_after_us) as f64;
        // After the install a current lease's permits include the grant;
        // a pre-lease's (held apart until its window starts) are its
        // grant alone.
        let lasting = if r.start_after_us > 0 {
            r.granted as i64
        } else {
            slot.permits.load(Ordering::Acquire)
        };
        rate > 0.0 && lasting.max(0) as f64 >= rate * serves * COVER_MARGIN
    };
    let low_water = if contested || thin {
        0
    } else if p.to_the_end || covers {
        // Sized to last until the window ends: refill only if demand
        // outruns it, when what is left would be spent within two round
        // trips (and a millisecond).
        let rtt = shared.rtt_us.load(Ordering::Relaxed) as f64;
        let rate = slot.books().sizing.rate_per_us();
        (rate * (2.0 * rtt + 1_000.0)).ceil().max(1.0) as u64
    } else {
        (p.call.want / 2).max(r.granted / 4)
    };
    low_water.min(u64::from(u32::MAX)) as u32
}

/// A slot whose window lease runs out before its window ends, granted
/// while the store still had room in that window. The other holders of a
/// key over its limit usually lease that room within milliseconds (a
/// pre-lease round, a ramp's second asks), and then each of them, its
/// share spent, would ask once more only to find nothing: one round trip
/// per holder and key, each on its own. Instead, shortly before the slot
/// runs out (by its rate), the window is peeked at (a call that takes
/// nothing) in a batch that goes out anyway, with whatever lease the
/// process asks for next. A holder that finds it fully leased spends what
/// it holds and, if it runs out within [`peek_trust_us`] of the peek, is
/// denied here until the window ends, as after an ask that got nothing;
/// later, it asks as before (permits given back meanwhile are found). One
/// peek per grant; none on a cluster, where a batch goes out as a pipeline
/// per hash slot and a peek would cost a round trip of its own.
pub(crate) struct Watched {
    slot: Weak<Slot>,
    /// The window the lease is for (a pre-lease's: the next one, peeked
    /// only once it is the slot's current window).
    window: i64,
    /// Not peeked before this local µs: the other holders' leases of the
    /// same round land in the meantime.
    after: u64,
    /// The window's lease deadline (local µs): no peek after it.
    until: u64,
    /// The slot's rate when the lease was granted (permits per µs).
    rate_per_us: f64,
}

/// How long after a grant its window is peeked at the earliest (at least
/// two round trips): a round of pre-leases over a fleet lands well within
/// it.
const PEEK_AFTER_US: u64 = 10_000;

/// The most slots watched at once; beyond it, slots ask as before.
const MAX_WATCHED: usize = 4096;

/// How long a peek that found the window full is believed: a period, at
/// most a second. The slot is peeked at when, by its rate, it runs out
/// within this time, and denied on the peek's word only if it does; a
/// permit given back longer before it runs out is found by its ask.
fn peek_trust_us(period_us: u64) -> u64 {
    period_us.min(1_000_000)
}

/// Whether the slot, by its rate, spends what it now holds of the reply's
/// window before that window ends (a thick holder of a busy key) and the
/// window may be fully leased by then; its rate if so.
fn runs_out_early(slot: &Slot, r: &LeaseReply, max_lease: u64) -> Option<f64> {
    let rate = slot.books().sizing.rate_per_us();
    if rate <= 0.0 {
        return None;
    }
    let serves = r.reset_after_us.saturating_sub(r.start_after_us) as f64;
    let holds = if r.start_after_us > 0 {
        r.granted as i64
    } else {
        slot.permits.load(Ordering::Acquire)
    };
    // With the margin `low_water_after` gives a lease that covers its
    // window: a slot refilled at half (not covered) is watched, or its
    // refill would ask a window often fully leased by then, alone.
    // Not a lease cut by `max_lease` with what the slot still needs left
    // in the store: a key far under its limit, whose ask when it runs out
    // is served (a peek would only find room).
    let short = rate * serves * COVER_MARGIN - holds.max(0) as f64;
    let capped = r.granted >= max_lease && r.remaining as f64 >= short;
    (short > 0.0 && !capped).then_some(rate)
}

/// Watches the slot's window `r.window` (or moves its watch there),
/// peeked from `t1 + PEEK_AFTER_US` until `until`.
fn watch(shared: &Shared, slot: &Arc<Slot>, r: &LeaseReply, rate_per_us: f64, until: u64, t1: u64) {
    let entry = Watched {
        slot: Arc::downgrade(slot),
        window: r.window,
        after: t1 + PEEK_AFTER_US.max(2 * shared.rtt_us.load(Ordering::Relaxed)),
        until,
        rate_per_us,
    };
    let mut watched = shared.watched.lock().unwrap_or_else(|p| p.into_inner());
    let id = Arc::as_ptr(slot) as usize;
    let room = watched.len() < MAX_WATCHED;
    match watched.get_mut(&id) {
        Some(w) if w.window <= r.window => *w = entry,
        Some(_) => {}
        None if room => {
            watched.insert(id, entry);
        }
        None => {}
    }
}

/// Adds peeks of watched slots that are due to a batch about to be sent,
/// up to `max` calls in all; drops watches that can no longer tell
/// anything (slot gone, window over, or already known full).
fn add_peeks(shared: &Shared, pending: &mut Vec<Pending>, max: usize, now: u64) {
    let trust = peek_trust_us(shared.params.period_us) as f64;
    let mut watched = shared.watched.lock().unwrap_or_else(|p| p.into_inner());
    watched.retain(|_, w| {
        if pending.len() >= max {
            return true;
        }
        let Some(slot) = w.slot.upgrade() else {
            return false;
        };
        let current = slot.window.load(Ordering::Acquire);
        // (A denial known now is of the current window: a watch of the
        // next one, a pre-lease's, stays.)
        if slot.evicted.load(Ordering::Acquire)
            || current > w.window
            || now >= w.until
            || (current == w.window && slot.denied_until.load(Ordering::Acquire) > now)
        {
            return false;
        }
        // Due once its lease is in place and, by the rate, soon spent;
        // not while a refill of the slot is queued or in flight (its reply
        // tells the same).
        let soon = slot.permits.load(Ordering::Acquire).max(0) as f64 <= w.rate_per_us * trust;
        let due = current == w.window
            && now >= w.after
            && soon
            && !slot.refill_pending.load(Ordering::Acquire);
        if !due {
            return true;
        }
        shared.counters.peeks.add(1);
        pending.push(Pending {
            call: LeaseCall::peek(shared.store_key(&slot), w.window),
            slot: Some(slot),
            renew: false,
            report: None,
            to_the_end: false,
            peek: true,
        });
        false
    });
}

/// A peek's reply: a window found fully leased (the one the slot holds
/// permits of) is denied here once they are spent, if that is soon, until
/// the store has room again, and asks for nothing meanwhile.
fn peek_answered(shared: &Shared, config: &HybridConfig, slot: &Slot, r: &LeaseReply, t1: u64) {
    if r.remaining > 0
        || r.start_after_us > 0
        || r.retry_after_us == 0
        || r.window != slot.window.load(Ordering::Acquire)
        || slot.denied_until.load(Ordering::Acquire) > t1
    {
        return;
    }
    let margin =
        config.clock_margin.as_micros() as u64 + shared.time.tick_us() + drift_us(r.reset_after_us);
    shared.counters.peeks_full.add(1);
    slot.deny_on_peek(
        t1 + r.retry_after_us + margin,
        t1 + peek_trust_us(shared.params.period_us),
    );
    slot.low_water.store(0, Ordering::Relaxed);
}

/// A slot that, by its rate, falls to its low-water mark shortly, before
/// its window's lease ends: a refill ahead of need that would go out on
/// its own. Keys that ramp up together (past their first refill) or run
/// down leases refilled at half would each send theirs alone, a round
/// trip apiece a few milliseconds apart. Instead, a batch that goes out
/// anyway takes along the refills of watched slots (only those whose rate
/// was known at the grant, see [`expect_refill`]) due within
/// [`ride_horizon_us`]: sized by the same rule (what the rate spends until
/// the window ends, less what is held), only sent a little earlier. None
/// on a cluster (a pipeline per hash slot: riding saves nothing there).
pub(crate) struct Ahead {
    slot: Weak<Slot>,
    /// The window of the lease the mark belongs to.
    window: i64,
    /// When the lease was installed (local µs), and what the slot held
    /// then: the rate since is what it spends now.
    since: u64,
    held: i64,
    /// The rate known at the grant (permits per µs, above 0).
    rate_per_us: f64,
}

/// How far ahead of its mark a refill rides along: an eighth of a period,
/// at most 100 ms (a fraction of the window's permits fetched early, by
/// processes that spend them).
fn ride_horizon_us(period_us: u64) -> u64 {
    (period_us / 8).min(100_000)
}

/// How often a large `ahead` is scanned at most (see [`add_rides`]).
fn ride_scan_every_us(horizon_us: u64) -> u64 {
    horizon_us / 8
}

/// Up to this many entries, `ahead` is scanned with every batch.
pub(crate) const RIDE_SCAN_ALWAYS: usize = 256;

/// Notes the slot, just granted a lease of its current window, as one
/// whose refill may ride along (see [`Ahead`]), unless by its rate it
/// does not fall to `low_water` before the lease ends.
fn expect_refill(shared: &Shared, slot: &Arc<Slot>, r: &LeaseReply, low_water: u32, now: u64) {
    let rate = slot.books().sizing.rate_per_us();
    let held = slot.permits.load(Ordering::Acquire);
    let above = held - i64::from(low_water);
    // Not a slot whose rate is not known yet (a first lease): a ride seeds
    // the rate from what was spent since the grant, and a short burst then
    // silence sized a lease for the rest of the window (eight requests
    // 1 ms apart, or one of cost 12: 987 of 1 000 held by one process,
    // none left for the others; without rides it keeps its first lease).
    // Its own refill at the mark seeds it, as without rides.
    if low_water == 0 || above <= 0 || rate <= 0.0 {
        return;
    }
    if now.saturating_add((above as f64 / rate) as u64) >= slot.deadline.load(Ordering::Acquire) {
        return;
    }
    let mut ahead = shared.ahead.lock().unwrap_or_else(|p| p.into_inner());
    let id = Arc::as_ptr(slot) as usize;
    if ahead.len() < MAX_WATCHED || ahead.contains_key(&id) {
        ahead.insert(
            id,
            Ahead {
                slot: Arc::downgrade(slot),
                window: r.window,
                since: now,
                held,
                rate_per_us: rate,
            },
        );
    }
}

/// Notes `slot` as one whose refill may ride along, at a rate so slow it
/// is not due within the horizon (tests of the scan's pace).
#[cfg(test)]
pub(crate) fn note_ahead(shared: &Shared, slot: &Arc<Slot>, window: i64, now: u64) {
    shared.ahead.lock().unwrap().insert(
        Arc::as_ptr(slot) as usize,
        Ahead {
            slot: Arc::downgrade(slot),
            window,
            since: now,
            held: slot.permits.load(Ordering::Acquire),
            rate_per_us: 1e-9,
        },
    );
}

/// Adds to a batch about to be sent the refills of slots that, by what
/// they spend, fall to their low-water mark within the ride horizon, up
/// to the batch size. Drops entries that no longer apply: slot gone, lease
/// over or replaced, a refill already pending, nothing held (the slot
/// asks, or is denied, on its own), or, once watched for a horizon, not
/// due before the lease ends at the rate seen.
fn add_rides(shared: &Shared, config: &HybridConfig, pending: &mut Vec<Pending>, now: u64) {
    let horizon = ride_horizon_us(shared.params.period_us);
    let room = config.batch_size.saturating_sub(pending.len());
    // A full batch takes nothing along and does not use up the scan's turn.
    if room == 0 {
        return;
    }
    let mut ahead = shared.ahead.lock().unwrap_or_else(|p| p.into_inner());
    // A scan visits every entry (a `Weak` upgraded each). Past a few
    // hundred entries, at most one scan per eighth of the horizon, which
    // still finds a refill an eighth ahead of its mark at worst: scanning
    // per batch, a burst of new keys asked one at a time (a batch each,
    // every one an entry) cost the sync task a quadratic walk, two thirds
    // of its time warming 10 000 keys.
    let last = shared.ride_scan_at.load(Ordering::Relaxed);
    if ahead.len() > RIDE_SCAN_ALWAYS && now < last.saturating_add(ride_scan_every_us(horizon)) {
        return;
    }
    shared.ride_scan_at.store(now, Ordering::Relaxed);
    let mut rides: Vec<Arc<Slot>> = Vec::new();
    ahead.retain(|_, a| {
        if rides.len() >= room {
            return true;
        }
        let Some(slot) = a.slot.upgrade() else {
            return false;
        };
        let deadline = slot.deadline.load(Ordering::Acquire);
        if slot.evicted.load(Ordering::Acquire)
            || slot.window.load(Ordering::Acquire) != a.window
            || now >= deadline
        {
            return false;
        }
        let held = slot.permits.load(Ordering::Acquire);
        let elapsed = now.saturating_sub(a.since);
        let spent = a.held - held;
        // When it falls due: by the rate known at the grant, or by what it
        // spent since, once that is enough permits to say (two requests
        // a moment apart say little).
        let rate = if spent as f64 >= SEED_PERMITS && elapsed > 0 {
            spent as f64 / elapsed as f64
        } else {
            a.rate_per_us
        };
        let above = held - i64::from(slot.low_water.load(Ordering::Relaxed));
        let eta = if rate > 0.0 {
            (above.max(0) as f64 / rate) as u64
        } else {
            u64::MAX
        };
        if eta > horizon {
            // Kept while it may still fall due in time.
            return elapsed <= horizon || now.saturating_add(eta) < deadline;
        }
        if held <= 0
            || slot.denied_until.load(Ordering::Acquire) > now
            // Claimed first, then marked in flight (as a queue entry
            // taken by `RefillQueue::pop`): a request that asks
            // meanwhile finds the refill on its way.
            || slot.refill_pending.swap(true, Ordering::AcqRel)
        {
            return false;
        }
        slot.in_flight.store(true, Ordering::Release);
        slot.promoted.store(false, Ordering::Release);
        rides.push(slot);
        false
    });
    drop(ahead);
    shared.counters.rides.add(rides.len() as u64);
    for slot in rides {
        pending.push(lease_call(shared, config, slot, now));
    }
}

/// Maintenance visits one slot in this many per tick: each slot once per
/// `SWEEP_SLICES × MAINTENANCE` (1 s). Skipping a slot reads only the
/// map's table, not the slot, so a tick over a million idle keys costs a
/// few milliseconds instead of a full walk.
pub(crate) const SWEEP_SLICES: usize = 10;

/// Which slice of the sweep a slot is in: from its address, which (unlike
/// the map's iteration order) does not move as keys come and go.
fn slice_of(slot: &Arc<Slot>) -> usize {
    let address = Arc::as_ptr(slot) as usize as u64;
    (address.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize % SWEEP_SLICES
}

/// What one lease costs Redis, about (a fixed-window lease script on this
/// crate's reference machine: 17–20 µs), for spreading pre-leases of many
/// keys ahead of a boundary.
const LEASE_COST_US: u64 = 25;

/// Round trips a pre-lease round allows for, besides its fixed lead: the
/// round's pipelines, a reply that waits behind them, and a lease sent
/// again after a lost reply.
const PRELEASE_ROUND_TRIPS: u64 = 4;

/// The longest a thin holder's pre-lease goes out before the round: a
/// full sweep of the maintenance, enough to spread a thousand keys' leases.
/// (Spread over half an hour-long window, they went out half an hour early
/// and a key's requests waited on a pre-lease instead of its window.)
const MAX_SPREAD_US: u64 = 1_000_000;

/// When, in the window about to end, keys get a pre-lease of the next one
/// from the background, rather than a wait on the first request after
/// the boundary (keys asked less often than the pre-lease lead would
/// otherwise never be pre-leased by a request).
struct PreleasePlan {
    /// The boundary ahead (local µs).
    end: u64,
    /// Every key used in its window is due this long before `end` (the
    /// round), and stays due until then (a key whose refill was in flight
    /// at the round is asked at the next tick).
    lead: u64,
    /// Thin holders are due earlier, each at its own time spread over
    /// this much before the round, so that a thousand thin keys' leases
    /// do not reach the store in one burst (measured: four processes'
    /// rounds of 1,000 thin keys held Redis for ~100 ms, and requests
    /// waiting for a refill behind them past their wait).
    spread: u64,
}

fn prelease_if_active(
    shared: &Shared,
    slot: &Arc<Slot>,
    now: u64,
    idle_ms: u64,
    plan: &PreleasePlan,
) {
    let to_end = plan.end.saturating_sub(now);
    if to_end > plan.lead + plan.spread {
        return;
    }
    // A pre-lease whose window has begun with no request yet to put it
    // in place goes in place now, so that the next one can follow it.
    if let Some(replaced) = slot.promote(now) {
        shared.counters.stranded.add(replaced as u64);
    }
    // (A key whose lease has ended is pre-leased too if it is active: a
    // thin holder often skips a window, and waiting for its next request
    // to lease the current window first would cost that request a round
    // trip, every time.)
    let deadline = slot.deadline.load(Ordering::Acquire);
    if slot.window.load(Ordering::Acquire) == super::slot::UNKNOWN_WINDOW
        || deadline > plan.end
        || slot.has_next()
        || slot.refill_pending.load(Ordering::Acquire)
    {
        return;
    }
    let window_start = slot
        .window_end
        .load(Ordering::Relaxed)
        .saturating_sub(shared.params.period_us);
    let idle_us = idle_ms.saturating_mul(1_000);
    let mut books = slot.books();
    let rate = books.sizing.rate_per_us();
    // Used in this window, or within its last few usual gaps (a thin
    // holder with one request a window skips about a third of them).
    let active = now.saturating_sub(idle_us) >= window_start
        || (rate > 0.0 && (idle_us as f64) < IDLE_TRIM_GAPS / rate);
    let due = to_end
        <= plan.lead
            + if books.sizing.thin() {
                spread_of(slot, plan.spread)
            } else {
                0
            };
    // Asked once per boundary (the store may refuse a thin holder, the
    // key being near its limit).
    let boundary = (plan.end / shared.params.period_us.max(1)) as u32;
    if !active || !due || books.ahead_asked == boundary {
        return;
    }
    books.ahead_asked = boundary;
    drop(books);
    slot.swept_ahead.store(true, Ordering::Release);
    shared.request_refill(slot, false);
}

/// A slot's own share of `span`, from its address (see `slice_of`).
fn spread_of(slot: &Arc<Slot>, span: u64) -> u64 {
    if span == 0 {
        return 0;
    }
    let address = Arc::as_ptr(slot) as usize as u64;
    address.wrapping_mul(0xD1B5_4A32_D192_ED03).rotate_left(29) % span
}

/// The first window boundary after `now`, from `known`, the end of some
/// window (0: none known yet).
fn next_boundary(known: u64, now: u64, period: u64) -> Option<u64> {
    if known == 0 || period == 0 {
        return None;
    }
    Some(if known > now {
        known - (known - now - 1) / period * period
    } else {
        known + ((now - known) / period + 1) * period
    })
}

/// A thin holder's pre-leases are refused once the key's current window,
/// its next window, or every holder's ask together
/// would pass this share of the limit (the lease script decides).
const THIN_AHEAD_CAP_DIVISOR: u64 = 2;

/// What a thin holder's pre-lease asks for: enough that a window with
/// twice its usual requests (and two more) rarely waits on the store —
/// a holder's requests in a window vary as much as their number.
fn thin_want(per_window: u64) -> u64 {
    2 * per_window + 2
}

/// Expires leases, evicts idle slots and enforces `max_keys`, on one slice
/// of the map (`None`: all of it; all of it too while over `max_keys`).
/// Network work it creates (give-backs, reports) goes out with the next
/// round.
/// A window lease idle for this share of its period gives back what it
/// holds above the earned floor (`sizing::EARNED_FLOOR_DIVISOR`).
const IDLE_TRIM_DIVISOR: u64 = 16;

/// The longest an idle holder's surplus takes to go back: its idle time,
/// a full sweep of the maintenance, and a tick.
fn trim_delay_us(period_us: u64) -> u64 {
    period_us / IDLE_TRIM_DIVISOR + (SWEEP_SLICES as u64 + 1) * MAINTENANCE.as_micros() as u64
}

/// Idle for this many of its usual gaps between requests, a key's rate
/// no longer says what it will spend.
const IDLE_TRIM_GAPS: f64 = 4.0;

/// A process that burst and went quiet gives back what it holds above a
/// sixteenth of the limit once its key has been idle for a sixteenth of
/// the period and for several of its usual gaps between requests: others
/// asking in the same window must not be denied while it sits unused here
/// (the fairness promise). A key used steadily is never idle that long
/// (measured: trimming after a sixteenth of the period alone took a
/// per-second long tail from 4.7 to 18 round trips per 1,000 decisions,
/// give-backs of keys between two requests); a thin key holds less than
/// the floor anyway.
fn trim_idle(shared: &Shared, slot: &Slot, idle_ms: u64, now: u64) {
    let period = shared.params.period_us;
    let idle_us = idle_ms.saturating_mul(1_000);
    if !shared.leases.windowed() || idle_us < period / IDLE_TRIM_DIVISOR {
        return;
    }
    let keep = (shared.params.limit / super::sizing::EARNED_FLOOR_DIVISOR)
        .max(1)
        .min(i64::MAX as u64) as i64;
    if slot.permits.load(Ordering::Relaxed) <= keep {
        return;
    }
    let rate = slot.books().sizing.rate_per_us();
    if rate > 0.0 && (idle_us as f64) < IDLE_TRIM_GAPS / rate {
        return;
    }
    if let Some((trimmed, window)) = slot.trim(keep, now) {
        let origin = slot.books().origin;
        shared.give_back(&shared.store_key(slot), trimmed as u64, window, origin);
    }
}

pub(crate) fn maintain(shared: &Shared, slice: Option<usize>) {
    let config = shared.config.load();
    let now = shared.time.precise_us();
    let idle_us = config.idle_ttl.as_micros() as u64;
    let mut idle: Vec<(u64, Arc<str>)> = Vec::new();
    let mut all: Vec<(u64, Arc<str>)> = Vec::new();
    let over = shared.slots.len().saturating_sub(config.max_keys);
    let slice = slice.filter(|_| over == 0);
    // Fixed window: once per window, shortly before its end, every key
    // used in it is pre-leased for the next one, all in the same rounds
    // (a few pipelines, not one round trip per key). Early enough for the
    // next tick to be too late: a tick, the pre-lease lead, 50 ms, a few
    // of the round trips the limiter measures (`PRELEASE_ROUND_TRIPS`),
    // and what leasing every key in the map takes Redis (`LEASE_COST_US`
    // each); at most half a window.
    let period = shared.params.period_us;
    let plan = (!shared.prelease_lead(&config).is_zero())
        .then(|| {
            let leasing = shared.slots.len() as u64 * LEASE_COST_US;
            let round_trips = PRELEASE_ROUND_TRIPS * shared.rtt_us.load(Ordering::Relaxed);
            (MAINTENANCE.as_micros() as u64
                + shared.prelease_lead(&config).as_micros() as u64
                + 50_000
                + round_trips
                + leasing)
                .min(period / 2)
        })
        .and_then(|lead| {
            let end = next_boundary(shared.window_end_hint.load(Ordering::Relaxed), now, period)?;
            Some(PreleasePlan {
                end,
                lead,
                spread: (period / 2).saturating_sub(lead).min(MAX_SPREAD_US),
            })
        });
    for entry in shared.slots.iter() {
        let slot = entry.value();
        if slice.is_some_and(|s| slice_of(slot) != s) {
            if let Some(plan) = &plan {
                prelease_if_active(shared, slot, now, slot.idle_ms(now), plan);
            }
            continue;
        }
        let expired = slot.expire(now);
        if expired > 0 {
            match shared.leases {
                // The window they belong to is over.
                LeaseKind::Window => shared.counters.stranded.add(expired as u64),
                LeaseKind::Bucket => {
                    let origin = slot.books().origin;
                    shared.give_back(&shared.store_key(slot), expired as u64, 0, origin)
                }
            }
        }
        shared.counters.stranded.add(slot.expire_next(now) as u64);
        let idle_for = slot.idle_ms(now);
        trim_idle(shared, slot, idle_for, now);
        if let Some(plan) = &plan {
            prelease_if_active(shared, slot, now, idle_for, plan);
        }
        if idle_for * 1_000 >= idle_us && !slot.refill_pending.load(Ordering::Acquire) {
            idle.push((idle_for, entry.key().clone()));
        } else if over > 0 {
            all.push((idle_for, entry.key().clone()));
        }
    }
    shared
        .counters
        .meters
        .local_keys
        .set(shared.slots.len() as f64);
    shared.prune_ledgers(now);
    shared.contended.store(false, Ordering::Relaxed);
    // Kept current while traffic is quiet too: a breaker's state moves on
    // with time alone.
    shared.counters.circuit(shared.store.circuit_state());
    let mut evict: Vec<Arc<str>> = idle.into_iter().map(|(_, k)| k).collect();
    let still_over = over.saturating_sub(evict.len());
    if still_over > 0 {
        // Least recently used first, down to 90 % of the cap.
        let target = still_over + config.max_keys / 10;
        all.sort_unstable_by_key(|(idle_for, _)| std::cmp::Reverse(*idle_for));
        evict.extend(all.into_iter().take(target).map(|(_, k)| k));
    }
    for key in evict {
        if let Some((_, slot)) = shared.slots.remove(&key) {
            shared.retire(&slot, now);
            shared.refilled(&slot).notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_boundary_is_found_from_any_known_window_end() {
        assert_eq!(next_boundary(0, 5, 10), None);
        for known in [3, 13, 23, 103] {
            assert_eq!(next_boundary(known, 5, 10), Some(13), "{known}");
            assert_eq!(next_boundary(known, 13, 10), Some(23), "{known}");
            assert_eq!(next_boundary(known, 12, 10), Some(13), "{known}");
        }
    }

    fn slot(name: &str) -> Arc<Slot> {
        Arc::new(Slot::new(Arc::from(name), 0))
    }

    /// Queues `slot` the way `request_refill` does.
    fn queue(q: &mut RefillQueue, slot: &Arc<Slot>, waiting: bool) {
        if slot.enqueue(waiting) {
            q.push(slot.clone(), waiting);
        }
    }

    fn name(slot: Option<Arc<Slot>>) -> Option<String> {
        slot.map(|s| s.key.to_string())
    }

    #[test]
    fn waiters_go_first_and_a_promoted_refill_is_sent_once() {
        let mut q = RefillQueue::default();
        let (a, b, c, x) = (slot("a"), slot("b"), slot("c"), slot("x"));
        queue(&mut q, &a, false);
        queue(&mut q, &b, false);
        queue(&mut q, &c, false);
        queue(&mut q, &x, true);
        // b was queued ahead of need; a request now waits on it.
        queue(&mut q, &b, true);
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("x"));
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("b"));
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("a"));
        // b's first entry is a duplicate: skipped while it is in flight.
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("c"));
        assert!(q.pop(0, 1_000).is_none());
        // Settled and queued again: one entry, sent once.
        b.refill_done();
        queue(&mut q, &b, false);
        queue(&mut q, &b, true);
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("b"));
        assert!(q.pop(0, 1_000).is_none());
        // A waiter on a refill already in flight adds nothing.
        queue(&mut q, &b, true);
        assert!(q.pop(0, 1_000).is_none());
    }

    #[test]
    fn a_stale_entry_does_not_send_a_settled_refill() {
        let mut q = RefillQueue::default();
        let a = slot("a");
        queue(&mut q, &a, false);
        queue(&mut q, &a, true);
        assert!(q.pop(0, 1_000).is_some());
        a.refill_done();
        // The other entry is left over from the settled refill.
        assert!(q.pop(0, 1_000).is_none());
    }
}

#[cfg(test)]
mod narrowing {
    use super::Sent;

    const ROUND: Sent = Sent {
        t0: 1_000,
        t1: 1_900,
        first: Some(50_000),
    };

    #[test]
    fn a_reply_is_placed_by_the_clocks_its_round_read_before_and_after_it() {
        // The batch's scripts read 50_000 … 50_600: the one at 50_200 ran
        // at least 200 µs after the round left, 400 µs before it was back.
        assert_eq!(ROUND.narrowed(50_200, 50_600), (1_200, 1_500));
        // The first and the last keep the round's own bounds.
        assert_eq!(ROUND.narrowed(50_000, 50_600).0, 1_000);
        assert_eq!(ROUND.narrowed(50_600, 50_600).1, 1_900);
    }

    #[test]
    fn inconsistent_clocks_fall_back_to_the_whole_round_trip() {
        // Read 2 ms apart within a round trip of 0.9 ms: the store's clock
        // stepped; nothing is narrowed.
        assert_eq!(ROUND.narrowed(52_000, 52_000), (1_000, 1_900));
        // Several servers' clocks: nothing to narrow by.
        let sharded = Sent {
            first: None,
            ..ROUND
        };
        assert_eq!(sharded.narrowed(50_200, 50_600), (1_000, 1_900));
    }
}
