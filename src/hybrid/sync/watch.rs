//! Peeks and rides: asking after keys that will soon run out, in batches
//! going out anyway, instead of in calls of their own.

use super::send::lease_call;
use super::send::Kind;
use super::send::Pending;
use crate::algorithm::LeaseCall;
use crate::algorithm::LeaseReply;
use crate::hybrid::config::HybridConfig;
use crate::hybrid::holding::Holding;
use crate::hybrid::policy::peek_trust_us;
use crate::hybrid::policy::ride_horizon_us;
use crate::hybrid::policy::ride_scan_every_us;
use crate::hybrid::policy::PEEK_AFTER_US;
use crate::hybrid::policy::SEED_PERMITS;
use crate::hybrid::shared::Shared;
use crate::hybrid::watchlist::{Ahead, Watched};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The most holdings watched at once; beyond it, holdings ask as before.
pub(super) const MAX_WATCHED: usize = 4096;

/// Watches the holding's window `r.window` (or moves its watch there),
/// peeked from `t1 + PEEK_AFTER_US` until `until`.
pub(super) fn watch(
    shared: &Shared,
    holding: &Arc<Holding>,
    r: &LeaseReply,
    rate_per_us: f64,
    until: u64,
    t1: u64,
) {
    let entry = Watched {
        holding: Arc::downgrade(holding),
        window: r.window,
        after: t1 + PEEK_AFTER_US.max(2 * shared.rtt_us.load(Ordering::Relaxed)),
        until,
        rate_per_us,
    };
    let mut watched = shared
        .watch
        .watched
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let id = Arc::as_ptr(holding) as usize;
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

/// Adds peeks of watched holdings that are due to a batch about to be sent,
/// up to `max` calls in all; drops watches that can no longer tell
/// anything (holding gone, window over, or already known full).
pub(super) fn add_peeks(shared: &Shared, pending: &mut Vec<Pending>, max: usize, now: u64) {
    let trust = peek_trust_us(shared.params.period_us) as f64;
    let mut watched = shared
        .watch
        .watched
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    watched.retain(|_, w| {
        if pending.len() >= max {
            return true;
        }
        let Some(holding) = w.holding.upgrade() else {
            return false;
        };
        let current = holding.window();
        // (A denial known now is of the current window: a watch of the
        // next one, a pre-lease's, stays.)
        if holding.is_evicted()
            || current > Some(w.window)
            || now >= w.until
            || (current == Some(w.window) && holding.denied_until().is_some_and(|u| u > now))
        {
            return false;
        }
        // Due once its lease is in place and, by the rate, soon spent;
        // not while a refill of the holding is queued or in flight (its reply
        // tells the same).
        let soon = holding.permits().max(0) as f64 <= w.rate_per_us * trust;
        let due = current == Some(w.window) && now >= w.after && soon && !holding.refill_pending();
        if !due {
            return true;
        }
        shared.counters.peeks.add(1);
        pending.push(Pending {
            call: LeaseCall::peek(shared.store_key(&holding), w.window),
            kind: Kind::Peek(holding),
        });
        false
    });
}

/// A peek's reply: a window found fully leased (the one the holding holds
/// permits of) is denied here once they are spent, if that is soon, until
/// the store has room again, and asks for nothing meanwhile.
pub(super) fn peek_answered(
    shared: &Shared,
    config: &HybridConfig,
    holding: &Holding,
    r: &LeaseReply,
    t1: u64,
) {
    if r.remaining > 0
        || r.start_after_us > 0
        || r.retry_after_us == 0
        || Some(r.window) != holding.window()
        || holding.denied_until().is_some_and(|u| u > t1)
    {
        return;
    }
    // (No drift allowance: see the denial in `lease_answered`.)
    let margin = config.clock_margin.as_micros() as u64 + shared.time.tick_us();
    shared.counters.peeks_full.add(1);
    holding.deny_on_peek(
        t1 + r.retry_after_us + margin,
        t1 + peek_trust_us(shared.params.period_us),
    );
    holding.set_low_water(0);
}

/// Up to this many entries, `ahead` is scanned with every batch.
pub(crate) const RIDE_SCAN_ALWAYS: usize = 256;

/// Notes the holding, just granted a lease of its current window, as one
/// whose refill may ride along (see [`Ahead`]), unless by its rate it
/// does not fall to `low_water` before the lease ends.
pub(super) fn expect_refill(
    shared: &Shared,
    holding: &Arc<Holding>,
    r: &LeaseReply,
    low_water: u32,
    now: u64,
) {
    let rate = holding.books().sizing.rate_per_us();
    let held = holding.permits();
    let above = held - i64::from(low_water);
    // Not a holding whose rate is not known yet (a first lease): a ride seeds
    // the rate from what was spent since the grant, and a short burst then
    // silence sized a lease for the rest of the window (eight requests
    // 1 ms apart, or one of cost 12: 987 of 1 000 held by one process,
    // none left for the others; without rides it keeps its first lease).
    // Its own refill at the mark seeds it, as without rides.
    if low_water == 0 || above <= 0 || rate <= 0.0 {
        return;
    }
    if now.saturating_add((above as f64 / rate) as u64) >= holding.deadline() {
        return;
    }
    let mut ahead = shared.watch.ahead.lock().unwrap_or_else(|p| p.into_inner());
    let id = Arc::as_ptr(holding) as usize;
    if ahead.len() < MAX_WATCHED || ahead.contains_key(&id) {
        ahead.insert(
            id,
            Ahead {
                holding: Arc::downgrade(holding),
                window: r.window,
                since: now,
                held,
                rate_per_us: rate,
            },
        );
    }
}

/// Notes `holding` as one whose refill may ride along, at a rate so slow it
/// is not due within the horizon (tests of the scan's pace).
#[cfg(test)]
pub(crate) fn note_ahead(shared: &Shared, holding: &Arc<Holding>, window: i64, now: u64) {
    shared.watch.ahead.lock().unwrap().insert(
        Arc::as_ptr(holding) as usize,
        Ahead {
            holding: Arc::downgrade(holding),
            window,
            since: now,
            held: holding.permits(),
            rate_per_us: 1e-9,
        },
    );
}

/// Adds to a batch about to be sent the refills of holdings that, by what
/// they spend, fall to their low-water mark within the ride horizon, up
/// to the batch size. Drops entries that no longer apply: holding gone, lease
/// over or replaced, a refill already pending, nothing held (the holding
/// asks, or is denied, on its own), or, once watched for a horizon, not
/// due before the lease ends at the rate seen.
pub(super) fn add_rides(
    shared: &Shared,
    config: &HybridConfig,
    pending: &mut Vec<Pending>,
    now: u64,
) {
    let horizon = ride_horizon_us(shared.params.period_us);
    let room = config.batch_size.saturating_sub(pending.len());
    // A full batch takes nothing along and does not use up the scan's turn.
    if room == 0 {
        return;
    }
    let mut ahead = shared.watch.ahead.lock().unwrap_or_else(|p| p.into_inner());
    // A scan visits every entry (a `Weak` upgraded each). Past a few
    // hundred entries, at most one scan per eighth of the horizon, which
    // still finds a refill an eighth ahead of its mark at worst: scanning
    // per batch, a burst of new keys asked one at a time (a batch each,
    // every one an entry) cost the sync task a quadratic walk, two thirds
    // of its time warming 10 000 keys.
    let last = shared.watch.ride_scan_at.load(Ordering::Relaxed);
    if ahead.len() > RIDE_SCAN_ALWAYS && now < last.saturating_add(ride_scan_every_us(horizon)) {
        return;
    }
    shared.watch.ride_scan_at.store(now, Ordering::Relaxed);
    let mut rides: Vec<Arc<Holding>> = Vec::new();
    ahead.retain(|_, a| {
        if rides.len() >= room {
            return true;
        }
        let Some(holding) = a.holding.upgrade() else {
            return false;
        };
        let deadline = holding.deadline();
        if holding.is_evicted() || holding.window() != Some(a.window) || now >= deadline {
            return false;
        }
        let held = holding.permits();
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
        let above = held - holding.low_water();
        let eta = if rate > 0.0 {
            (above.max(0) as f64 / rate) as u64
        } else {
            u64::MAX
        };
        if eta > horizon {
            // Kept while it may still fall due in time.
            return elapsed <= horizon || now.saturating_add(eta) < deadline;
        }
        if held <= 0 || holding.denied_until().is_some_and(|u| u > now) || !holding.send_unasked() {
            return false;
        }
        rides.push(holding);
        false
    });
    drop(ahead);
    shared.counters.rides.add(rides.len() as u64);
    for holding in rides {
        pending.push(lease_call(shared, config, holding, now));
    }
}
