//! Maintenance, every tick: expiry, idle trimming, pre-leases of the
//! next window, eviction.

use super::MAINTENANCE;
use crate::hybrid::config::Ablation;
use crate::hybrid::holding::Holding;
use crate::hybrid::holding::Trimmed;
use crate::hybrid::policy::prelease_lead_us;
use crate::hybrid::policy::IDLE_TRIM_DIVISOR;
use crate::hybrid::policy::IDLE_TRIM_GAPS;
use crate::hybrid::policy::MAX_SPREAD_US;
use crate::hybrid::policy::THIN_ACTIVE_PERIODS;
use crate::hybrid::shared::Shared;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Maintenance visits one holding in this many per tick: each holding once per
/// `SWEEP_SLICES × MAINTENANCE` (1 s). Skipping a holding reads only the
/// map's table, not the holding, so a tick over a million idle keys costs a
/// few milliseconds instead of a full walk.
pub(crate) const SWEEP_SLICES: usize = 10;

/// A full sweep of the maintenance, and a tick: how long an idle holding
/// may wait for its visit.
pub(super) fn sweep_us() -> u64 {
    (SWEEP_SLICES as u64 + 1) * MAINTENANCE.as_micros() as u64
}

/// Which slice of the sweep a holding is in: from its key's place, which
/// (unlike the map's iteration order) does not move as keys come and go.
pub(super) fn slice_of(holding: &Holding) -> usize {
    ((u64::from(holding.place()) * SWEEP_SLICES as u64) >> 16) as usize
}

/// When, in the window about to end, keys get a pre-lease of the next one
/// from the background, rather than a wait on the first request after
/// the boundary (keys asked less often than the pre-lease lead would
/// otherwise never be pre-leased by a request).
pub(super) struct PreleasePlan {
    /// The boundary ahead (local µs).
    pub(super) end: u64,
    /// Every key used in its window is due this long before `end` (the
    /// round), and stays due until then (a key whose refill was in flight
    /// at the round is asked at the next tick).
    pub(super) lead: u64,
    /// Thin holders are due earlier, each at its own time spread over
    /// this much before the round, so that a thousand thin keys' leases
    /// do not reach the store in one burst (measured: four processes'
    /// rounds of 1,000 thin keys held Redis for ~100 ms, and requests
    /// waiting for a refill behind them past their wait).
    pub(super) spread: u64,
    /// A holding is looked at once a sweep (when the maintenance visits its
    /// slice), so it is due this much earlier: the next visit may be too
    /// late.
    pub(super) sweep: u64,
}

pub(super) fn prelease_if_active(
    shared: &Shared,
    holding: &Arc<Holding>,
    now: u64,
    idle_ms: u64,
    plan: &PreleasePlan,
) {
    let ablate = shared.config.load().ablate;
    if ablate.off(Ablation::PRELEASE) {
        return;
    }
    let to_end = plan.end.saturating_sub(now);
    if to_end > plan.lead + plan.spread + plan.sweep {
        return;
    }
    // A pre-lease whose window has begun with no request yet to put it
    // in place goes in place now, so that the next one can follow it.
    if let Some(replaced) = holding.promote(now) {
        shared.counters.stranded.add(replaced as u64);
    }
    // (A key whose lease has ended is pre-leased too if it is active: a
    // thin holder often skips a window, and waiting for its next request
    // to lease the current window first would cost that request a round
    // trip, every time.)
    let deadline = holding.deadline();
    if holding.window().is_none()
        || deadline > plan.end
        || holding.has_next()
        || holding.refill_pending()
    {
        return;
    }
    let window_start = holding.window_end().saturating_sub(shared.params.period_us);
    let idle_us = idle_ms.saturating_mul(1_000);
    // A key that goes idle long enough to be evicted before the next
    // window begins would give its pre-lease straight back: two store
    // calls for nothing (a long tail of a million keys pre-leased every
    // key used in the window, most of them then evicted at the boundary).
    if idle_us.saturating_add(to_end) >= shared.config.load().idle_ttl.as_micros() as u64 {
        return;
    }
    let mut books = holding.books();
    if ablate.off(Ablation::THIN_PRELEASE) && books.sizing.thin() {
        return;
    }
    let rate = books.sizing.rate_per_us();
    // Used in this window, or within its last few usual gaps (a thin
    // holder with one request a window skips about a third of them).
    let active = now.saturating_sub(idle_us) >= window_start
        || holding
            .request_gap_us(rate)
            .is_some_and(|gap| (idle_us as f64) < IDLE_TRIM_GAPS * gap)
        || (books.sizing.thin() && idle_us < THIN_ACTIVE_PERIODS * shared.params.period_us);
    let due = to_end
        <= plan.lead
            + plan.sweep
            + if books.sizing.thin() {
                spread_of(holding, plan.spread)
            } else {
                0
            };
    // Asked once per boundary (the store may refuse a thin holder, the
    // key being near its limit).
    let boundary = (plan.end / shared.params.period_us.max(1)) as u32;
    if !active || !due || !books.ask_ahead_once(boundary) {
        return;
    }
    drop(books);
    holding.mark_swept_ahead();
    shared.request_refill(holding, false);
}

/// A holding's own share of `span`, from its key's place (see `slice_of`).
pub(super) fn spread_of(holding: &Holding, span: u64) -> u64 {
    if span == 0 {
        return 0;
    }
    u64::from(holding.place())
        .wrapping_mul(0xD1B5_4A32_D192_ED03)
        .rotate_left(29)
        % span
}

/// The first window boundary after `now`, from `known`, the end of some
/// window (0: none known yet).
pub(super) fn next_boundary(known: u64, now: u64, period: u64) -> Option<u64> {
    if known == 0 || period == 0 {
        return None;
    }
    Some(if known > now {
        known - (known - now - 1) / period * period
    } else {
        known + ((now - known) / period + 1) * period
    })
}

/// A process that burst and went quiet gives back what it holds above a
/// sixteenth of the limit once its key has been idle for a sixteenth of
/// the period and for several of its usual gaps between requests: others
/// asking in the same window must not be denied while it sits unused here
/// (the fairness promise). A key used steadily is never idle that long
/// (measured: trimming after a sixteenth of the period alone took a
/// per-second long tail from 4.7 to 18 round trips per 1,000 decisions,
/// give-backs of keys between two requests); a thin key holds less than
/// the floor anyway.
///
/// A holding `denied`, asked since the last look and denied from what it
/// knows until a time still to come (it holds less than those requests
/// cost), gives back at once what it holds above the floor: those permits
/// cannot serve the requests that keep coming, and another process may
/// need them for one.
pub(super) fn trim_idle(shared: &Shared, holding: &Holding, idle_ms: u64, now: u64, denied: bool) {
    let period = shared.params.period_us;
    let idle_us = idle_ms.saturating_mul(1_000);
    if !shared.leases.windowed() || (!denied && idle_us < period / IDLE_TRIM_DIVISOR) {
        return;
    }
    let keep = (shared.params.limit / crate::hybrid::policy::EARNED_FLOOR_DIVISOR)
        .max(1)
        .min(i64::MAX as u64) as i64;
    if holding.permits() <= keep {
        return;
    }
    let rate = holding.books().sizing.rate_per_us();
    if !denied
        && holding
            .request_gap_us(rate)
            .is_some_and(|gap| (idle_us as f64) < IDLE_TRIM_GAPS * gap)
    {
        return;
    }
    if let Some(Trimmed { permits, window }) = holding.trim(keep, now) {
        let origin = holding.books().origin_for(permits as u64);
        shared.give_back(&shared.store_key(holding), permits as u64, window, origin);
    }
}

/// Expires leases, evicts idle holdings and enforces `max_keys`, on one slice
/// of the map (`None`: all of it; all of it too while over `max_keys`).
/// Network work it creates (give-backs, reports) goes out with the next
/// round.
pub(crate) fn maintain(shared: &Shared, slice: Option<usize>) {
    let config = shared.config.load();
    let now = shared.time.precise_us();
    let idle_us = config.idle_ttl.as_micros() as u64;
    let mut idle: Vec<(u64, Arc<str>)> = Vec::new();
    let mut all: Vec<(u64, Arc<str>)> = Vec::new();
    let over = shared.holdings.len().saturating_sub(config.max_keys);
    let slice = slice.filter(|_| over == 0);
    // Fixed window: once per window, shortly before its end, every key
    // used in it is pre-leased for the next one, all in the same rounds
    // (a few pipelines, not one round trip per key). Early enough for the
    // next tick to be too late (`policy::prelease_lead_us`).
    let period = shared.params.period_us;
    let plan = (!shared.prelease_lead(&config).is_zero())
        .then(|| {
            prelease_lead_us(
                MAINTENANCE.as_micros() as u64,
                shared.prelease_lead(&config).as_micros() as u64,
                shared.rtt_us.load(Ordering::Relaxed),
                shared.holdings.len() as u64,
                period,
            )
        })
        .and_then(|lead| {
            let end = next_boundary(shared.window_end_hint.load(Ordering::Relaxed), now, period)?;
            Some(PreleasePlan {
                end,
                lead,
                spread: (period / 2).saturating_sub(lead).min(MAX_SPREAD_US),
                // (A full walk, over `max_keys`, looks at every holding now.)
                sweep: if slice.is_some() && period >= VISIT_ONCE_A_SWEEP_PERIODS * sweep_us() {
                    sweep_us()
                } else {
                    0
                },
            })
        });
    for entry in shared.holdings.iter() {
        let holding = entry.value();
        // Pre-leases too are planned at a holding's own visit, once a sweep
        // (due a sweep early, see `PreleasePlan::sweep`): looking at every
        // holding on every tick before a boundary took the sync task tens of
        // milliseconds a tick with 260,000 keys held, and new keys' first
        // requests waited behind it past `max_wait`.
        // (Short windows, where a sweep is a good part of the window, are
        // still looked at on every tick.)
        if slice.is_some_and(|s| slice_of(holding) != s) {
            if let Some(plan) = plan.as_ref().filter(|p| p.sweep == 0) {
                prelease_if_active(shared, holding, now, holding.idle_ms(now), plan);
            }
            continue;
        }
        shared.expired(holding, holding.expire(now) as u64);
        shared
            .counters
            .stranded
            .add(holding.expire_next(now) as u64);
        let idle_for = holding.idle_ms(now);
        // (A key denied from what its holding knows is asked, not idle;
        // while that denial stands, what it holds cannot serve it.)
        let asked = holding.take_asked();
        let still_denied = asked && holding.denied(now).is_some();
        trim_idle(shared, holding, idle_for, now, still_denied);
        if let Some(plan) = &plan {
            prelease_if_active(shared, holding, now, idle_for, plan);
        }
        if idle_for * 1_000 >= idle_us && !holding.refill_pending() && !asked {
            idle.push((idle_for, entry.key().clone()));
        } else if over > 0 {
            all.push((idle_for, entry.key().clone()));
        }
    }
    shared
        .counters
        .meters
        .local_keys
        .set(shared.holdings.len() as f64);
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
        if let Some((_, holding)) = shared.holdings.remove(&key) {
            shared.retire(&holding, now);
            shared.refilled(&holding).notify_waiters();
        }
    }
    // The map's table does not shrink by itself: after a long tail went
    // idle (420,000 keys to 60,000) it kept the size of its peak. Once a
    // sweep (slice 0), a table four times too large is rebuilt to fit.
    if slice.is_none_or(|s| s == 0) {
        let capacity = shared.holdings.capacity();
        if capacity > SHRINK_ABOVE && shared.holdings.len() * 4 < capacity {
            shared.holdings.shrink_to_fit();
        }
    }
}

/// Windows at least this many sweeps long plan their pre-leases at each
/// holding's visit, a sweep early; shorter ones look at every holding on every
/// tick before the boundary (a sweep early would be a good part of the
/// window).
const VISIT_ONCE_A_SWEEP_PERIODS: u64 = 10;

/// Tables of up to this many entries are never shrunk (rebuilding them
/// saves nothing worth the work).
const SHRINK_ABOVE: usize = 4_096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keys_place_in_the_sweep_comes_from_its_name_alone() {
        // Two holdings of one key, wherever they were allocated, sit in
        // the same slice at the same spread: a seeded run replays alike.
        let first = Arc::new(Holding::new(Arc::from("user-7"), 0));
        let _between: Vec<Box<[u8; 48]>> = (0..64).map(|_| Box::new([0; 48])).collect();
        let second = Arc::new(Holding::new(Arc::from("user-7"), 5));
        assert_eq!(slice_of(&first), slice_of(&second));
        assert_eq!(spread_of(&first, 1_000_000), spread_of(&second, 1_000_000));
        // Keys still spread over every slice.
        let slices: std::collections::HashSet<usize> = (0..200)
            .map(|i| slice_of(&Holding::new(Arc::from(format!("user-{i}")), 0)))
            .collect();
        assert_eq!(slices.len(), SWEEP_SLICES);
    }
}
