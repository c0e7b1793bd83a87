//! A reply applied: a grant installed (or held until its window
//! starts), a denial cached, a report settled, the store clock observed.

use super::maintain::sweep_us;
use super::send::lose_lease;
use super::send::Kind;
use super::send::Pending;
use super::send::Reported;
use super::watch::expect_refill;
use super::watch::peek_answered;
use super::watch::watch;
use crate::algorithm::LeaseCall;
use crate::algorithm::LeaseKind;
use crate::algorithm::LeaseOrigin;
use crate::algorithm::LeaseReply;
use crate::clock::drift_us;
use crate::error::Error;
use crate::failure::Report;
use crate::failure::Resend;
use crate::hybrid::config::HybridConfig;
use crate::hybrid::holding::Grant;
use crate::hybrid::holding::Holding;
use crate::hybrid::holding::Installed;
use crate::hybrid::holding::NextLease;
use crate::hybrid::policy::low_water;
use crate::hybrid::policy::recheck_delay_us;
use crate::hybrid::policy::runs_out_early;
use crate::hybrid::policy::Granted;
use crate::hybrid::shared::Shared;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Applies one lease call's reply (or its failure) to its holding, or
/// settles a report; wakes whoever waits on the holding.
pub(super) fn apply(
    shared: &Shared,
    config: &HybridConfig,
    p: Pending,
    result: Result<LeaseReply, Error>,
    t0: u64,
    t1: u64,
) {
    let holding = match &p.kind {
        Kind::Lease { holding, .. } => holding.clone(),
        Kind::Peek(holding) => {
            if let Ok(r) = result {
                peek_answered(shared, config, holding, &r, t1);
            }
            return;
        }
        Kind::Report(_) => {
            if let Kind::Report(report) = p.kind {
                settle_report(shared, report, &result);
            }
            return;
        }
    };
    let recalled = if p.call.debt > 0 {
        let recalled = holding.credit_settled(p.call.debt);
        give_recalled_back(shared, &p.call, recalled);
        recalled
    } else {
        0
    };
    match result {
        Err(_) => lease_failed(shared, &holding, &p.call, t0),
        Ok(mut r) => {
            // Recalled credit goes back to the store: it was never
            // admitted, so what it left uncovered is no overshoot.
            r.uncovered = r.uncovered.saturating_sub(u64::from(recalled));
            lease_answered(shared, config, &holding, &p, &r, t0, t1)
        }
    }
    holding.refill_done();
    shared.refilled(&holding).notify_waiters();
}

/// Credit a lease call reported and another quota's denial recalled
/// meanwhile: the store counted it, so it goes back (to the window it
/// was reported in).
pub(super) fn give_recalled_back(shared: &Shared, call: &LeaseCall, recalled: u32) {
    // (A bucket's recalled credit stays taken: its give-back would need
    // the lease's origin, and a bucket refills by itself.)
    if recalled > 0 && shared.leases.windowed() {
        let origin = LeaseOrigin::default();
        // (Credit is taken only in a window known: `debt_window` is one.)
        let window = Some(call.debt_window);
        shared.give_back(&call.key, u64::from(recalled), window, origin);
    }
}

/// A report's reply: an evicted holding's debt, or the fallback's admissions.
/// Unavailability resends it as it was (same identity); a refusal (wrong
/// type, out of range) will never apply, so it is dropped and counted
/// rather than retried forever.
pub(super) fn settle_report(shared: &Shared, report: Reported, result: &Result<LeaseReply, Error>) {
    let counters = &shared.counters;
    let retry = matches!(result, Err(e) if e.is_unavailable());
    match report {
        Reported::Fallback(report) => {
            shared.reconciler.settle(report, result, counters);
        }
        Reported::Debt(report) if retry => {
            let (key, permits) = (report.key.clone(), report.permits);
            match report.unavailable(shared.time.precise_us()) {
                Resend::Later(report) => shared
                    .outbox
                    .reports
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(report),
                // Its identity may be forgotten by now: a resend could
                // count it twice. Dropped and counted instead.
                Resend::Dropped(_) => {
                    shared.debt_dropped(permits);
                    shared.report_settled(&key, permits);
                }
            }
        }

        Reported::Debt(report) => {
            match result {
                Ok(r) => counters.overshoot.add(r.uncovered),
                Err(_) => shared.debt_dropped(report.permits),
            }
            shared.report_settled(&report.key, report.permits);
        }
    }
}

/// A lease call that got no reply. The store may have granted it all the
/// same (a timeout after Redis ran the call): the next lease asks for that
/// grant back. Debt it carried is resent on its own under the same
/// identity, since the store may have applied it before the reply was lost.
pub(super) fn lease_failed(shared: &Shared, holding: &Holding, call: &LeaseCall, t0: u64) {
    lose_lease(holding, call);
    if let Some(op) = call.op.filter(|_| call.debt > 0) {
        // It was sent once, inside the lease call, and failed.
        let report = Report::new(call.key.clone(), call.debt, Some(call.debt_window), op);
        match report.sent_at(t0).unavailable(shared.time.precise_us()) {
            Resend::Later(report) => shared.queue_report(report),
            Resend::Dropped(permits) => shared.debt_dropped(permits),
        }
    }
    holding.set_refill_failed(true);
}

/// A lease call's reply: what it says of the store (its clock, what
/// remains, debt it could not cover), then the grant (installed, or given
/// back if the holding was retired meanwhile) or the denial.
pub(super) fn lease_answered(
    shared: &Shared,
    config: &HybridConfig,
    holding: &Arc<Holding>,
    p: &Pending,
    r: &LeaseReply,
    t0: u64,
    t1: u64,
) {
    let counters = &shared.counters;
    holding.set_refill_failed(false);
    observe_store_clock(shared, r, t0, t1);
    counters.overshoot.add(r.uncovered);
    let windowed = shared.leases.windowed();
    if r.uncovered > 0 && windowed {
        // The window the debt went to (the store's current one when the
        // process did not know it) is closed to credit.
        let current = r.window - i64::from(r.start_after_us > 0);
        holding
            .books()
            .close_credit_through(p.call.debt_window.max(current));
    }
    holding.set_store_remaining(r.remaining);
    if windowed && r.start_after_us == 0 && r.remaining == 0 {
        holding.books().mark_used_up(r.window);
    }
    if windowed {
        shared
            .window_end_hint
            .store(t0 + r.reset_after_us, Ordering::Relaxed);
    } else {
        holding.set_bucket_full_at(t0 + r.reset_after_us);
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
    if r.granted > 0 && holding.is_evicted() {
        // The holding was retired while its lease was in flight: no request
        // will spend these permits here. Give them back.
        counters.lease_granted(r.granted);
        shared.give_back(&p.call.key, r.granted, Some(r.window), origin_of(r));
    } else if r.granted > 0 {
        counters.lease_granted(r.granted);
        install_grant(
            shared,
            config,
            holding,
            p,
            r,
            Times {
                t0,
                t1,
                margin,
                now,
            },
        );
        let low_water = low_water_after(shared, holding, p, r);
        if windowed && r.start_after_us > 0 {
            // A pre-lease: its mark applies once it is in place; the
            // current window's permits keep theirs (a mark sized from the
            // next window's grant would ask the current one, often already
            // fully leased, for more).
            holding.set_next_low_water(r.window, low_water);
        } else {
            holding.set_low_water(low_water);
            if windowed && r.remaining > 0 {
                // The store has room in this window after all (a peek
                // that found it full was overtaken by a give-back).
                holding.forget_denial();
            }
            if !windowed {
                // Tokens were just taken: a denial cached for a larger
                // cost (a smaller one was granted before its time) tells a
                // time they now push back. The next such request asks.
                holding.forget_denial();
            }
            if windowed && !shared.store.is_sharded() {
                expect_refill(shared, holding, r, low_water, now);
            }
        }
        if windowed && !shared.store.is_sharded() {
            let g = granted(shared, holding, p, r);
            if runs_out_early(&g, r.remaining, config.max_lease) {
                let rate = g.rate_per_us;
                let until = t0.saturating_add(r.reset_after_us).saturating_sub(margin);
                watch(shared, holding, r, rate, until, t1);
            }
        }
    } else if p.call.want > 0 && p.call.ahead_cap == 0 {
        // (A thin holder's pre-lease refused changes nothing: the key is
        // near its limit, or crowded, and its current lease stands.)
        if r.start_after_us == 0 {
            // Redis answered before t1: from t1 + retry_after on, the
            // store surely has something again. (Without the drift
            // allowance a lease's deadline needs: a denial that ends a
            // little early costs one more ask, and an hour's allowance
            // would tell the client seconds too many.)
            let margin = config.clock_margin.as_micros() as u64 + shared.time.tick_us();
            let until = t1 + r.retry_after_us + margin;
            let calm = holding
                .denied_until()
                .is_none_or(|before| before.saturating_add(shared.params.period_us) <= t1);
            if windowed && calm {
                // The first denial after a calm spell asks once more, after
                // the time other holders take to give back what they will
                // not spend (`recheck_delay_us`): a window fully leased is
                // not always fully spent. That re-check is not what the client
                // is told: the window's end is.
                let idle_ttl = config.idle_ttl.as_micros() as u64;
                let recheck = t1 + recheck_delay_us(shared.params.period_us, idle_ttl, sweep_us());
                holding.deny_for(recheck, until, p.call.cost);
            } else {
                // The store said when the waiting request's cost fits
                // (a bucket's `need`, a window's `cost`).
                let cost = if windowed { p.call.cost } else { p.call.need };
                holding.deny_for(until, until, cost);
            }
        } else if now >= holding.deadline() {
            // Nothing left of the next window, which has not begun in the
            // store, while this process's permits of the current one are
            // void: nothing can be admitted here before the next window
            // starts, nor before the store said a request fits (a sliding
            // window's carry still weighs at the start of the next).
            // Denied until then (asking again at once would spin on the
            // store).
            holding.deny_until(t1 + r.start_after_us.max(r.retry_after_us) + margin);
        }
        // Nothing to be had: spend what is held, then ask again (the
        // denied-until time keeps that from costing round trips).
        holding.set_low_water(0);
        holding.no_early_refill();
    }
    let level = holding.permits();
    holding.books().sizing.applied(level, now);
}

/// The store's clock as a reply read it, for the fallback's windows and
/// for credit before a key's first lease. Redis read it somewhere in
/// [t0, t1] locally: the middle, give or take half the round trip.
pub(super) fn observe_store_clock(shared: &Shared, r: &LeaseReply, t0: u64, t1: u64) {
    // t0 and t1 are precise readings: the store clock's own local clock.
    shared.store_clock.observe(t0, t1, r.now_us);
}

/// Where a bucket lease's permits came from (see [`LeaseOrigin`]).
pub(super) fn origin_of(r: &LeaseReply) -> LeaseOrigin {
    LeaseOrigin {
        at_us: r.now_us,
        level: r.level,
        given_back: r.given_back,
    }
}

/// The local times a reply is placed by: sent at `t0`, answered at `t1`,
/// applied at `now`, with `margin` for clocks and drift.
#[derive(Clone, Copy)]
pub(super) struct Times {
    pub(super) t0: u64,
    pub(super) t1: u64,
    pub(super) margin: u64,
    pub(super) now: u64,
}

/// Puts a grant in place: a window lease in the holding (or, ahead of its
/// window, held apart until it starts); a bucket lease in the holding, its
/// origin merged with or replacing the one held.
pub(super) fn install_grant(
    shared: &Shared,
    config: &HybridConfig,
    holding: &Arc<Holding>,
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
                counters.stranded.add(holding.hold_next(lease) as u64);
            } else {
                let grant = Grant {
                    permits: granted,
                    window: r.window,
                    deadline,
                    window_end,
                    renew: false,
                };
                match holding.install(grant, now) {
                    Installed::Added => {}
                    Installed::Replaced(n) | Installed::Stale(n) => counters.stranded.add(n as u64),
                }
            }
        }
        LeaseKind::Bucket => {
            let horizon = config.lease_ttl.as_micros() as u64;
            let deadline = (t0 + horizon).saturating_sub(margin + drift_us(horizon));
            let full_at = t0 + r.reset_after_us;
            let origin = origin_of(r);
            let mut books = holding.books();
            let before = books.origin();
            let grant = Grant {
                permits: granted,
                window: 0,
                deadline,
                window_end: full_at,
                renew: p.renew(),
            };
            match holding.install(grant, now) {
                Installed::Added if before.at_us != 0 => {
                    // Added to permits still held: the merged lease
                    // answers to the older origin too.
                    books.set_origin(origin, r.granted, true, now);
                }
                // In place of a lease whose permits were all spent or void
                // (none replaced) or are given back here: the new lease
                // answers to its own origin alone. Merging in the old one
                // would cap its give-backs by a level long gone.
                Installed::Added => books.set_origin(origin, r.granted, false, now),
                Installed::Replaced(replaced) => {
                    let before = books.origin_for(replaced as u64);
                    books.set_origin(origin, r.granted, false, now);
                    drop(books);
                    if replaced > 0 {
                        let key = shared.store_key(holding);
                        shared.give_back(&key, replaced as u64, None, before);
                    }
                }
                Installed::Stale(n) => counters.stranded.add(n as u64),
            }
        }
    }
}

/// The low-water mark after a grant: below it, a refill is requested.
pub(super) fn low_water_after(
    shared: &Shared,
    holding: &Holding,
    p: &Pending,
    r: &LeaseReply,
) -> u32 {
    let mark = low_water(&granted(shared, holding, p, r), shared.config.load().ablate);
    if mark.contested {
        // Nor a pre-lease of the next window: spread over every holder
        // whatever its rate, it strands the same way.
        holding.no_early_refill();
    }
    mark.low_water
}

/// A reply to `p`, as the numbers the lease policy decides on.
pub(super) fn granted(shared: &Shared, holding: &Holding, p: &Pending, r: &LeaseReply) -> Granted {
    let sizing = holding.books().sizing.clone();
    Granted {
        windowed: shared.leases.windowed(),
        want: p.call.want,
        granted: r.granted,
        // (A key whose rate is not known yet is not thin: its first lease
        // says nothing about it.)
        thin: sizing.thin(),
        rate_per_us: sizing.rate_per_us(),
        serves_us: r.reset_after_us.saturating_sub(r.start_after_us),
        // After the install a current lease's permits include the grant;
        // a pre-lease's (held apart until its window starts) are its grant
        // alone.
        holds: if r.start_after_us > 0 {
            r.granted as i64
        } else {
            holding.permits()
        },
        to_the_end: p.to_the_end(),
        rtt_us: shared.rtt_us.load(Ordering::Relaxed),
    }
}
