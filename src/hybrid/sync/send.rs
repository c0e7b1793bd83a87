//! A round: the next batches (reports first, then leases, waiters
//! before the rest), each lease call sized, sent in pipelines, and the
//! replies placed in time.

use super::give_back::{give_back_before, give_back_some};
use super::reply::apply;
use super::reply::give_recalled_back;
use super::watch::add_peeks;
use super::watch::add_rides;
use crate::algorithm::Lease;
use crate::algorithm::LeaseCall;
use crate::algorithm::LeaseReply;
use crate::algorithm::LeaseTarget;
use crate::algorithm::LeaseView;
use crate::algorithm::MAX_REPORT;
use crate::clock::drift_us;
use crate::error::Error;
use crate::failure::report_call;
use crate::failure::Report;
use crate::hybrid::config::Ablation;
use crate::hybrid::config::HybridConfig;
use crate::hybrid::holding::Holding;
use crate::hybrid::policy::SizingRule;
use crate::hybrid::policy::{WindowAsk, WindowTerms};
use crate::hybrid::shared::Shared;
use futures_util::future::join_all;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// What a round has taken from the queues and not yet settled. If the
/// round's future is dropped (`shutdown` abandoned by its caller, the
/// runtime going away), everything goes back where it came from: reports
/// to their queues under their identities, a lease's debt to the report
/// queue, its holding free to ask again.
pub(super) struct Unsent<'a> {
    pub(super) shared: &'a Shared,
    pub(super) fallback: Vec<Report>,
    pub(super) debts: Vec<Report>,
    /// The batches in flight.
    pub(super) batches: Vec<Vec<Pending>>,
    /// When it was sent (local µs): a lease's debt resent after a drop is
    /// timed from its first sending (see `RESEND_FOR`).
    pub(super) sent_at: u64,
}

impl Drop for Unsent<'_> {
    fn drop(&mut self) {
        let shared = self.shared;
        let mut fallback = std::mem::take(&mut self.fallback);
        let mut debts = std::mem::take(&mut self.debts);
        for p in std::mem::take(&mut self.batches).into_iter().flatten() {
            match p.kind {
                // Took nothing, changed nothing: forgotten.
                Kind::Peek(_) => {}
                Kind::Report(Reported::Fallback(r)) => fallback.push(r),
                Kind::Report(Reported::Debt(r)) => debts.push(r),
                Kind::Lease { holding, .. } => {
                    lose_lease(&holding, &p.call);
                    if let Some(op) = p.call.op.filter(|_| p.call.debt > 0) {
                        let recalled = holding.credit_settled(p.call.debt);
                        give_recalled_back(shared, &p.call, recalled);
                        let report = Report::new(
                            p.call.key.clone(),
                            p.call.debt,
                            Some(p.call.debt_window),
                            op,
                        );
                        shared.queue_report(report.sent_at(self.sent_at));
                    }
                    holding.refill_done();
                    shared.refilled(&holding).notify_waiters();
                }
            }
        }
        if !fallback.is_empty() {
            let dropped = shared.reconciler.restore(fallback);
            shared.counters.reports_dropped.add(dropped);
        }
        if !debts.is_empty() {
            shared
                .outbox
                .reports
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(debts);
        }
    }
}

/// A lease call's reply is lost (an error, or its future dropped): its
/// identity is kept for the next lease of the holding.
pub(super) fn lose_lease(holding: &Holding, call: &LeaseCall) {
    holding.books().lose_lease(call.lease_id);
}

/// One lease in flight, with what is needed to apply its reply.
pub(super) struct Pending {
    /// The script's arguments.
    pub(super) call: LeaseCall,
    /// What the call is for, which says what its reply changes.
    pub(super) kind: Kind,
}

/// The three uses of the lease script.
pub(super) enum Kind {
    /// Permits for a holding (and, on the same call, its debt reported).
    Lease {
        holding: Arc<Holding>,
        /// Token bucket / GCRA: replace the current permits (fresh
        /// horizon).
        renew: bool,
        /// The lease is sized to last until its window ends: no refill
        /// ahead of need when it runs low (each would be cut smaller again
        /// by the time left, a trickle of ever smaller leases to the
        /// boundary).
        to_the_end: bool,
    },
    /// A look at a watched holding's window (see [`Watched`]): it takes
    /// nothing and leaves the holding's refill state alone.
    Peek(Arc<Holding>),
    /// Debt or what the fallback admitted, recorded and nothing taken.
    Report(Reported),
}

impl Pending {
    /// A lease's `renew` (see [`Kind::Lease`]); `false` for the others.
    pub(super) fn renew(&self) -> bool {
        matches!(self.kind, Kind::Lease { renew: true, .. })
    }

    /// A lease's `to_the_end` (see [`Kind::Lease`]); `false` for the
    /// others.
    pub(super) fn to_the_end(&self) -> bool {
        matches!(
            self.kind,
            Kind::Lease {
                to_the_end: true,
                ..
            }
        )
    }
}

/// A report in flight, to be settled or resent as it was.
pub(super) enum Reported {
    /// Debt of an evicted holding, or of a failed lease call.
    Debt(Report),
    /// What the failure policy's fallback admitted.
    Fallback(Report),
}

/// Pipelines a round keeps in flight at once. On a real network the round
/// trip, not Redis, limits one pipeline at a time: four batches of 512
/// leases per round trip.
pub(crate) const PIPELINES: usize = 4;

/// Batches a round sends before it returns to the task's loop, so that
/// sustained refill demand cannot starve maintenance or the stop signal.
pub(super) const BATCHES_PER_ROUND: usize = 16;

/// Sends what is queued, in this order: the fallback's admissions and
/// debt reports (Redis counts them before granting anything new), leases
/// (waiters first), then give-backs. Up to `PIPELINES` batches of
/// `batch_size` calls are in flight at once; a round ends when the queues
/// are empty or after `BATCHES_PER_ROUND` batches (it then wakes the task
/// again). Returns whether work is left.
pub(crate) async fn round(shared: &Shared) -> bool {
    shared.outbox.urgent.store(false, Ordering::Release);
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
        let mut queued = shared
            .outbox
            .reports
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (due, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut *queued).into_iter().partition(|r| {
                // The last round (shutdown) sends everything it has.
                r.due(now) || shared.life.closed.load(Ordering::Acquire)
            });
        *queued = later;
        due
    };
    let last = shared.life.closed.load(Ordering::Acquire);
    let mut sent = 0;
    let mut more = false;
    loop {
        let config = shared.config.load_full();
        let now = shared.time.precise_us();
        let mut batches: Vec<Vec<Pending>> = Vec::new();
        let ahead_only = !waiters_queued(shared);
        while batches.len() < PIPELINES {
            // Work nobody waits for (refills ahead of need, pre-leases of
            // the next window) goes one batch at a time: a step's replies
            // are applied when all its batches are back, and four batches
            // of a boundary's pre-leases (a long tail of 400,000 keys) held
            // the first requests of new keys past `max_wait`.
            if batches.len() >= AHEAD_PIPELINES && !waiters_queued(shared) {
                break;
            }
            let batch = next_batch(shared, &config, &mut unsent, now);
            if batch.is_empty() {
                break;
            }
            batches.push(batch);
        }
        if batches.is_empty() {
            break;
        }
        give_back_before(
            shared,
            batches.iter().flatten().map(|p| p.call.key.as_str()),
        )
        .await;
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
                let leases: Vec<Lease<'_>> = batch
                    .iter()
                    .map(|call| Lease {
                        params: &shared.params,
                        call,
                    })
                    .collect();
                let (result, cost) = shared
                    .store
                    .run_batch_counted(&leases, ahead, &shared.counters)
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
        if ahead_only && !last {
            rest_after_ahead(shared, shared.time.precise_us().saturating_sub(t0) / 2).await;
        }
        if sent >= BATCHES_PER_ROUND && !last {
            more = true;
            break;
        }
    }
    // What is left of the reports goes back to its queues.
    drop(unsent);
    // Give-backs go a batch at a time: after a mass eviction (a long
    // tail of keys gone idle together) they were 200,000 calls sent in
    // one go, and every first request of a new key was denied behind
    // them for two seconds. The last round sends them all.
    let limit = (!last).then_some(GIVE_BACK_BATCHES_PER_ROUND);
    more | give_back_some(shared, limit).await
}

/// Batches a step sends when nobody waits (see [`round`]).
const AHEAD_PIPELINES: usize = 1;

/// After a step nobody waited for, the store and this process rest
/// (half as long as the step took, at most [`AHEAD_REST_MAX`]), or until
/// a request waits: a boundary's pre-leases (a long tail of 260,000 keys)
/// use at most about two thirds of what the store and the machine can
/// do, and the first requests of new keys get the rest. (Resting as long
/// as the step took left 0.4 % of a rollover's requests denied at a 1 ms
/// round trip: the pre-leases came too late.)
async fn rest_after_ahead(shared: &Shared, took_us: u64) {
    let until = tokio::time::Instant::now() + Duration::from_micros(took_us).min(AHEAD_REST_MAX);
    while tokio::time::Instant::now() < until {
        if shared.outbox.urgent.load(Ordering::Acquire) || waiters_queued(shared) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The longest rest after a step nobody waited for.
const AHEAD_REST_MAX: Duration = Duration::from_millis(10);

/// Whether a refill somebody waits for is queued.
fn waiters_queued(shared: &Shared) -> bool {
    shared
        .outbox
        .refills
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .has_waiting()
}

/// Batches of give-backs a round sends before it lets waiting refills
/// go first (see [`round`]).
const GIVE_BACK_BATCHES_PER_ROUND: usize = 1;

/// The next batch: reports first, then leases, waiters before the rest.
pub(super) fn next_batch(
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
            call: report_call(&report, &shared.keys, &shared.params),
            kind: Kind::Report(Reported::Fallback(report)),
        });
    }
    while pending.len() < config.batch_size {
        let Some(mut report) = unsent.debts.pop() else {
            break;
        };
        report.sending(now);
        pending.push(Pending {
            call: report.call(report.key.clone()),
            kind: Kind::Report(Reported::Debt(report)),
        });
    }
    let room = config.batch_size.saturating_sub(pending.len());
    let holdings: Vec<Arc<Holding>> = {
        let mut queue = shared
            .outbox
            .refills
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let max_wait_ms = config.max_wait.as_millis() as u64;
        std::iter::from_fn(|| queue.pop(now, max_wait_ms))
            .take(room)
            .collect()
    };
    for holding in holdings {
        if holding.is_evicted() {
            holding.refill_done();
            shared.refilled(&holding).notify_waiters();
            continue;
        }
        pending.push(lease_call(shared, config, holding, now));
    }
    if !pending.is_empty() && !shared.store.is_sharded() {
        if !config.ablate.off(Ablation::RIDES) {
            add_rides(shared, config, &mut pending, now);
        }
        if !config.ablate.off(Ablation::PEEKS) {
            add_peeks(shared, &mut pending, config.batch_size, now);
        }
    }
    pending
}

/// When a batch went out and came back (local µs), and the earliest store
/// clock read by any script of its round (`None`: the round's scripts ran
/// on several servers).
#[derive(Clone, Copy)]
pub(super) struct Sent {
    pub(super) t0: u64,
    pub(super) t1: u64,
    pub(super) first: Option<u64>,
}

impl Sent {
    /// When the script that read the store's clock at `now_us` ran, as
    /// local bounds: within [t0, t1], and — the round's scripts having run
    /// in order on one server — at least as long after `t0` as it read
    /// after the round's first, and at least as long before `t1` as it
    /// read before its batch's `last` (less the drift allowance both
    /// ways). Otherwise every reply of a long pipeline could be anywhere in
    /// the whole round trip: its lease would end early and its pre-lease
    /// start late by the time the pipeline took to run.
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
pub(super) fn settle(
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

pub(super) fn lease_call(
    shared: &Shared,
    config: &HybridConfig,
    holding: Arc<Holding>,
    now: u64,
) -> Pending {
    let period = shared.params.period_us;
    let permits = holding.permits();
    let valid = now < holding.deadline();
    let near_end = holding.near_end(now, shared.early_lead());
    let mut books = holding.books();
    let credit = books.send_credit();
    let need = holding.take_need();
    let rule = SizingRule {
        min_lease: config.min_lease,
        max_lease: config.max_lease,
        horizon_us: config.refill_horizon.as_micros() as u64,
    };
    let window = holding.window();
    let windowed = shared.leases.windowed();
    books.sizing.observe(
        permits,
        u64::from(credit.debt),
        now,
        window.filter(|_| windowed),
    );
    let deadline = holding.deadline();
    // Permits that would arrive void (they end within a round trip and
    // the margin) are not worth asking for.
    let rtt = shared.rtt_us.load(Ordering::Relaxed) + shared.time.tick_us();
    let swept = holding.take_swept_ahead();
    let LeaseTarget {
        min_window,
        renew,
        time_left_us: time_left,
    } = shared.leases.target(&LeaseView {
        window,
        valid,
        near_end,
        ending: now + rtt >= deadline,
        // A holding is pre-leased only with nobody waiting for more than
        // it holds: a waiter needs the current window (a pre-lease the
        // store refuses tells it nothing, and it would ask again at once).
        prelease: !shared.prelease_lead(config).is_zero()
            && if valid {
                ((near_end && permits > 0) || swept) && need <= permits.max(0) as u64
            } else {
                swept && need == 0
            },
        has_next: holding.has_next(),
        left_us: deadline.saturating_sub(now),
        since_us: now.saturating_sub(deadline),
        period_us: period,
    });
    let ahead = if valid {
        // (A valid lease has a window; before any, -1 as the store reads it.)
        min_window > window.unwrap_or(-1)
    } else {
        swept && need == 0 && window.is_some()
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
    let (mut want, mut ahead_cap) = (want, 0);
    if windowed {
        let ask = books.sizing.window_ask(
            WindowAsk {
                want,
                ceiling,
                ahead_cap: 0,
            },
            &WindowTerms {
                need,
                ahead,
                time_left_us: time_left,
                period_us: period,
                limit: shared.params.limit,
                min_lease: config.min_lease,
                max_lease: config.max_lease,
            },
        );
        (want, ceiling, ahead_cap) = (ask.want, ask.ceiling, ask.ahead_cap);
    }
    // Window leases have an identity; after a lost reply the next one
    // reuses it (see `LeaseCall::lease_id`).
    let lease_id = if shared.leases.identified() {
        match books.take_lost_lease() {
            0 => shared.ops.next_lease(),
            lost => lost,
        }
    } else {
        0
    };
    drop(books);
    let call = LeaseCall {
        key: shared.store_key(&holding),
        want,
        share_cap: config.share_cap,
        debt: u64::from(credit.debt).min(MAX_REPORT),
        debt_window: credit.window,
        min_window,
        need: shared.leases.need(need, shared.params.limit),
        // A lease that grants nothing says when the waiting request fits:
        // what its client is told.
        cost: need.max(1),
        op: (credit.debt > 0).then(|| shared.ops.next()),
        holder: Some(shared.holder.clone()),
        ceiling,
        lease_id,
        ahead_cap,
    };
    Pending {
        call,
        kind: Kind::Lease {
            holding,
            renew,
            to_the_end,
        },
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
