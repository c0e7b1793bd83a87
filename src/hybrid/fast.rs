//! The request path's fast half: a key's holding found, a permit taken with
//! one compare-and-swap, the decision written where the caller keeps it
//! (`Limiter::check_now`). Whatever it cannot answer goes to the slow
//! path (`HybridEngine::check`, in `mod.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::holding::{Holding, Spare, Take};
use super::thread_cache;
use super::HybridEngine;
use crate::decision::Decision;

impl HybridEngine {
    /// [`fast_into`](HybridEngine::fast_into), returned.
    #[cfg(test)]
    pub(crate) fn try_fast(&self, key: &str, cost: u64) -> Option<Decision> {
        let mut decided = None;
        self.fast_into(key, cost, &mut decided);
        decided
    }

    /// The request path's common case, without a future: a known key with
    /// valid local permits. Writes the decision into `decided` (where the
    /// caller keeps it; see `Limiter::check_now`), or leaves it `None`:
    /// "take the slow path".
    #[inline(always)]
    pub(crate) fn fast_into(&self, key: &str, cost: u64, decided: &mut Option<Decision>) {
        let s = &*self.shared;
        if cost > s.max_cost || s.life.closed.load(Ordering::Relaxed) {
            return;
        }
        // The per-thread cache pays off only when threads contend for a
        // key; uncontended, the map's lock is cheaper than the probe.
        let contended = s.contended.load(Ordering::Relaxed);
        if contended
            && thread_cache::with(self.id, key, |holding, stock| {
                self.fast_stocked(holding, stock, cost, decided)
            })
            .is_some()
        {
            return;
        }
        let Some(entry) = s.holdings.get(key) else {
            return;
        };
        self.fast_on(entry.value(), cost, decided);
        if contended && thread_cache::worth_caching() {
            let now = s.time.now_us();
            let lost = thread_cache::put(self.id, entry.value().clone(), now);
            s.counters.stranded.add(lost as u64);
        }
    }

    /// The fast path on a holding this thread cached: spends from the
    /// thread's stock of its permits while the stock's lease is valid, and
    /// refills the stock when it takes from the holding (see `thread_cache`).
    /// The decision into `decided`, as [`fast_on`](HybridEngine::fast_on):
    /// returned through the thread cache's `Option` and `Result`, it was
    /// copied whole three times, the first stalling on the stores that
    /// built it.
    #[inline(always)]
    fn fast_stocked(
        &self,
        holding: &Arc<Holding>,
        stock: &std::cell::Cell<thread_cache::Stock>,
        cost: u64,
        decided: &mut Option<Decision>,
    ) {
        let s = &*self.shared;
        if cost == 0 {
            return self.fast_on(holding, cost, decided);
        }
        let mut held = stock.get();
        if held.permits > 0 {
            match s.time.valid_until(held.deadline) {
                Some(now) if held.permits as u64 >= cost => {
                    held.permits -= cost as i64;
                    stock.set(held);
                    holding.touch(now, cost);
                    let left = holding.permits();
                    *decided = Some(s.spent(holding, left + held.permits, now, cost, held.window));
                    return;
                }
                // Too few for this cost: back to the holding, if its lease
                // is still the one they came from.
                Some(now) => {
                    if !holding.restore(held.window, held.deadline, held.permits, now) {
                        s.expired(holding, held.permits as u64);
                    }
                }
                None => s.expired(holding, held.permits as u64),
            }
            stock.set(thread_cache::Stock::NONE);
        }
        match holding.take_spare(cost, &s.time, thread_cache::stock_for) {
            (
                Take::Taken {
                    left,
                    now,
                    contended,
                    window,
                },
                Spare { permits, deadline },
            ) => {
                if contended && !s.contended.load(Ordering::Relaxed) {
                    s.contended.store(true, Ordering::Relaxed);
                }
                stock.set(thread_cache::Stock {
                    permits,
                    window,
                    deadline,
                });
                holding.touch(now, cost);
                *decided = Some(s.spent(holding, left + permits, now, cost, window));
            }
            (Take::Late { lost, .. }, _) => s.expired(holding, lost as u64),
            // A pre-lease to promote, or a denial to answer: the common way.
            (Take::Empty, _) => self.fast_on(holding, cost, decided),
        }
    }

    /// The fast path on a holding found: one clock read, after the permit
    /// was taken (see [`Holding::take`]); the decision into `decided`.
    #[inline(always)]
    fn fast_on(&self, holding: &Arc<Holding>, cost: u64, decided: &mut Option<Decision>) {
        let s = &*self.shared;
        match holding.take(cost, &s.time) {
            Take::Taken {
                left,
                now,
                contended,
                window,
            } => {
                if contended && s.stocks && !s.contended.load(Ordering::Relaxed) {
                    s.contended.store(true, Ordering::Relaxed);
                }
                holding.touch(now, cost);
                *decided = Some(s.spent(holding, left, now, cost, window));
            }
            missed => *decided = self.fast_missed(holding, cost, missed),
        }
    }

    /// The denial `key`'s cache gives a request of `cost` now, taking
    /// nothing; `None` if the holding would admit it or knows no denial.
    /// For a request another quota denied: a part admitted on credit
    /// while its lease call was out may have heard since that its quota
    /// is spent, and the client is told that wait too.
    pub(crate) fn cached_denial(&self, key: &str, cost: u64) -> Option<Decision> {
        let s = &*self.shared;
        let holding = s.holdings.get(key)?.value().clone();
        if cost == 0 || holding.permits() >= cost as i64 {
            return None;
        }
        let now = s.time.precise_us();
        holding
            .denied(now)
            .filter(|&until| s.denial_covers(&holding, until, now, cost))
            .map(|until| s.cached_denial(&holding, until, now, cost))
    }

    /// [`fast_on`](HybridEngine::fast_on) when the holding's lease could not
    /// pay: a pre-lease to promote, a window to spend across, or a denial
    /// known until a time.
    #[inline(never)]
    fn fast_missed(&self, holding: &Arc<Holding>, cost: u64, missed: Take) -> Option<Decision> {
        let s = &*self.shared;
        match missed {
            Take::Taken { .. } => None,
            Take::Empty => {
                if let Some(decided) = self.promoted(holding, cost, None) {
                    return Some(decided);
                }
                // Known exhausted: answer from the denied-until time. The
                // coarse clock may lag, which only lengthens the denial.
                if cost == 0 || holding.denied_until().is_none() {
                    return None;
                }
                let now = s.time.now_us();
                let denial = holding
                    .denied(now)
                    .filter(|&until| s.denial_covers(holding, until, now, cost))
                    .map(|until| s.cached_denial(holding, until, now, cost));
                // A key asked while it is denied is in use, though idle
                // (what it holds is not spent: a trim may give it back).
                // Evicted, it lost what its process spent of it, and its
                // next window started cold, in a dozen small leases
                // instead of one (a tenant over its budget for 50 s of
                // every minute).
                if denial.is_some() {
                    holding.mark_asked();
                }
                denial
            }
            // The lease ended (its permits are void): the next window's
            // may be held already.
            late @ Take::Late { lost, .. } => {
                s.expired(holding, lost as u64);
                self.promoted(holding, cost, late.paid(cost))
            }
        }
    }

    /// A pre-lease of the window that has just begun, put in place and
    /// spent from. Its start is read on the precise clock: the coarse one,
    /// anchored to it once, may read up to a kernel tick ahead, and a
    /// pre-lease must never start early. `paid`: the window a late take
    /// just took `cost` from (see [`Take::Late`]).
    fn promoted(&self, holding: &Arc<Holding>, cost: u64, paid: Option<i64>) -> Option<Decision> {
        let s = &*self.shared;
        if !holding.has_next() {
            return None;
        }
        let now = s.time.precise_us();
        let Some(replaced) = holding.promote(now) else {
            return self.across(holding, cost, now, paid);
        };
        s.counters.stranded.add(replaced as u64);
        match holding.take(cost, &s.time) {
            Take::Taken {
                left, now, window, ..
            } => {
                holding.touch(now, cost);
                Some(s.spent(holding, left, now, cost, window))
            }
            _ => None,
        }
    }

    /// Spent across a window boundary from both windows' permits (see
    /// `Holding::take_across`): near a boundary, a holding holding permits of
    /// the window ending and of the next one need not wait for either.
    pub(super) fn across(
        &self,
        holding: &Arc<Holding>,
        cost: u64,
        now: u64,
        paid: Option<i64>,
    ) -> Option<Decision> {
        let s = &*self.shared;
        let cost_now = cost.min(i64::MAX as u64) as i64;
        let across = holding.take_across(cost_now, now, paid, || s.time.precise_us());
        s.counters.stranded.add(across.stranded as u64);
        let left = across.left?;
        // Counted in the next window: it resets when that one ends.
        let mut decided = s.spent(holding, left, now, cost, Some(across.window));
        decided.set_reset_after(Duration::from_micros(across.window_end.saturating_sub(now)));
        Some(decided)
    }
}
