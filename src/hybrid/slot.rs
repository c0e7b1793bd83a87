//! One key's local state: atomics the request path reads and writes.
//!
//! The request path touches only atomics here (no lock, no allocation);
//! the two mutexes are for the slow path and the sync task, and are never
//! held across an await. A slot never talks to the store.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::sizing::Sizing;

/// Local µs as wrapping milliseconds (idle times are far below 49 days).
fn millis(us: u64) -> u32 {
    (us / 1_000) as u32
}

/// "No window known yet": the store charges such debt to its current window.
pub(crate) const UNKNOWN_WINDOW: i64 = -1;

/// A slice of the next window, granted ahead of the boundary.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NextLease {
    pub(crate) permits: i64,
    pub(crate) window: i64,
    /// Local µs from which the permits may be spent (the window's start,
    /// as late as it can be locally, plus the margin).
    pub(crate) start: u64,
    /// Local µs at which they become void.
    pub(crate) deadline: u64,
    /// Local µs by which the window has surely ended.
    pub(crate) window_end: u64,
}

/// Permits admitted on credit and not yet reported.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Credit {
    /// At most `max_debt`, which configuration keeps within `u32`.
    pub(crate) debt: u32,
    pub(crate) window: i64,
    /// Debt sent in a lease call whose reply has not arrived: it still
    /// counts against `max_debt`, or credit could be taken twice in one
    /// window before the store says it is exhausted.
    pub(crate) in_flight: u32,
}

pub(crate) struct Slot {
    /// The user key, shared with the map's key (no second copy).
    pub(crate) key: Arc<str>,
    /// Permits held locally, all granted by the store.
    pub(crate) permits: AtomicI64,
    /// Local µs at which the permits become void (window end or lease
    /// horizon, minus the margin).
    pub(crate) deadline: AtomicU64,
    /// Fixed window: the window index the permits belong to.
    pub(crate) window: AtomicI64,
    /// Fixed window: local µs by which `window` has surely ended (its
    /// latest possible end plus the margin). Token bucket and GCRA: local
    /// µs at which the bucket is full again, per the store. Either way,
    /// when the quota is whole again (`Decision::reset_after`).
    pub(crate) window_end: AtomicU64,
    /// Below this many permits, a refill is requested.
    pub(crate) low_water: AtomicU32,
    /// Within the limiter's early-refill lead of the deadline, a refill
    /// (fixed window: a pre-lease of the next window; bucket: a renewal)
    /// is requested even above the low-water mark. Off after the store
    /// had nothing to give, until the next lease.
    pub(crate) early_refill: AtomicBool,
    /// The store said the key is exhausted until this local µs.
    pub(crate) denied_until: AtomicU64,
    /// A refill is queued or in flight; at most one per key.
    pub(crate) refill_pending: AtomicBool,
    /// The last refill failed: the failure policy applies once local
    /// permits are gone.
    pub(crate) refill_failed: AtomicBool,
    /// Removed from the map; whoever still holds it must look the key up again.
    pub(crate) evicted: AtomicBool,
    /// Largest cost a waiting request needs (so the next lease covers it).
    pub(crate) need: AtomicU32,
    /// Last use, local milliseconds (wrapping), for idle eviction.
    pub(crate) last_used: AtomicU32,
    /// What the store last said remains unleased.
    /// (Saturating: a header value, not an accounting one.)
    pub(crate) store_remaining: AtomicU32,
    /// Whether `next` holds a lease (checked without the lock).
    pub(crate) has_next: AtomicBool,
    /// Boxed: most slots never hold one, and a box is one word.
    pub(crate) next: Mutex<Option<Box<NextLease>>>,
    /// Credit and sizing: the slow path's and the sync task's, behind one
    /// lock to keep the slot small.
    pub(crate) books: Mutex<Books>,
}

/// A slot's slow-path bookkeeping.
#[derive(Debug)]
pub(crate) struct Books {
    /// Optimistic mode: credit admitted, not yet reported.
    pub(crate) credit: Credit,
    /// Fixed window: no credit in this window or earlier. Set once the
    /// store reports debt it could not cover, so each process overshoots a
    /// window by at most `max_debt`, whatever else the reply granted.
    pub(crate) credit_closed: i64,
    /// Lease sizing (sync task only).
    pub(crate) sizing: Sizing,
}

/// The result of trying to spend local permits.
pub(crate) enum Take {
    /// Spent; this many remain locally.
    Taken(i64),
    /// No valid permits (empty, expired or not yet leased).
    Empty,
}

impl Slot {
    pub(crate) fn new(key: Arc<str>, now: u64) -> Self {
        Slot {
            key,
            permits: AtomicI64::new(0),
            deadline: AtomicU64::new(0),
            window: AtomicI64::new(UNKNOWN_WINDOW),
            window_end: AtomicU64::new(0),
            low_water: AtomicU32::new(0),
            early_refill: AtomicBool::new(false),
            denied_until: AtomicU64::new(0),
            refill_pending: AtomicBool::new(false),
            refill_failed: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            need: AtomicU32::new(0),
            last_used: AtomicU32::new(millis(now)),
            store_remaining: AtomicU32::new(0),
            has_next: AtomicBool::new(false),
            next: Mutex::new(None),
            books: Mutex::new(Books {
                credit: Credit::default(),
                credit_closed: i64::MIN,
                sizing: Sizing::default(),
            }),
        }
    }

    /// Spends `cost` local permits if they are valid at `now`.
    ///
    /// `now` may come from a coarse clock that lags when its thread is
    /// starved; within `guard_us` of the deadline, `precise` is read instead,
    /// so a lagging clock can never spend a permit past its deadline.
    #[inline]
    pub(crate) fn take(
        &self,
        cost: u64,
        now: u64,
        guard_us: u64,
        precise: impl FnOnce() -> u64,
    ) -> Take {
        let deadline = self.deadline.load(Ordering::Acquire);
        if now >= deadline || (now + guard_us >= deadline && precise() >= deadline) {
            return Take::Empty;
        }
        let cost = cost as i64;
        let mut current = self.permits.load(Ordering::Acquire);
        loop {
            if current < cost {
                return Take::Empty;
            }
            match self.permits.compare_exchange_weak(
                current,
                current - cost,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Take::Taken(current - cost),
                Err(actual) => current = actual,
            }
        }
    }

    /// Records use for idle eviction without writing the shared line on
    /// every decision.
    #[inline]
    pub(crate) fn touch(&self, now: u64) {
        let ms = millis(now);
        if self.last_used.load(Ordering::Relaxed) != ms {
            self.last_used.store(ms, Ordering::Relaxed);
        }
    }

    /// Milliseconds since last use.
    pub(crate) fn idle_ms(&self, now: u64) -> u64 {
        u64::from(millis(now).wrapping_sub(self.last_used.load(Ordering::Relaxed)))
    }

    pub(crate) fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the permits just spent leave the slot wanting a refill.
    #[inline]
    pub(crate) fn wants_refill(&self, left: i64, now: u64, lead: u64) -> bool {
        left < i64::from(self.low_water.load(Ordering::Relaxed)) || self.near_end(now, lead)
    }

    /// Within `lead` of the current lease's deadline, with early refills on.
    #[inline]
    pub(crate) fn near_end(&self, now: u64, lead: u64) -> bool {
        lead > 0
            && self.early_refill.load(Ordering::Relaxed)
            && now + lead >= self.deadline.load(Ordering::Acquire)
    }

    /// Installs a lease. If the current permits are still valid and belong
    /// to the same window (and this is not a renewal), the grant is added
    /// and the deadline kept, so no permit outlives its own lease.
    /// Otherwise the grant replaces them; the replaced permits are returned
    /// (expired leftovers, for the caller to give back or count as
    /// stranded).
    pub(crate) fn install(
        &self,
        granted: i64,
        window: i64,
        deadline: u64,
        window_end: u64,
        now: u64,
        renew: bool,
    ) -> i64 {
        let current_deadline = self.deadline.load(Ordering::Acquire);
        self.early_refill.store(true, Ordering::Relaxed);
        if !renew && now < current_deadline && self.window.load(Ordering::Acquire) == window {
            self.permits.fetch_add(granted, Ordering::AcqRel);
            return 0;
        }
        // Void the old permits first, then publish the new ones, so the
        // request path never pairs new permits with an old deadline.
        self.deadline.store(0, Ordering::Release);
        let old = self.permits.swap(granted, Ordering::AcqRel);
        self.window.store(window, Ordering::Release);
        self.window_end.store(window_end, Ordering::Release);
        self.deadline.store(deadline, Ordering::Release);
        old.max(0)
    }

    /// Voids permits whose deadline has passed; returns how many there were.
    pub(crate) fn expire(&self, now: u64) -> i64 {
        if now < self.deadline.load(Ordering::Acquire) {
            return 0;
        }
        self.permits.swap(0, Ordering::AcqRel).max(0)
    }

    /// Moves a due pre-leased slice of the next window into place; returns
    /// the permits it replaced, or `None` if nothing was due.
    pub(crate) fn promote(&self, now: u64) -> Option<i64> {
        if !self.has_next.load(Ordering::Acquire) {
            return None;
        }
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let lease = **next.as_ref()?;
        if now < lease.start {
            return None;
        }
        *next = None;
        self.has_next.store(false, Ordering::Release);
        drop(next);
        Some(self.install(
            lease.permits,
            lease.window,
            lease.deadline,
            lease.window_end,
            now,
            true,
        ))
    }

    /// Local estimate of the fixed window in force at `now`: `Some(index)`
    /// when certain, `UNKNOWN_WINDOW` before the first lease, `None` close
    /// to a boundary, where the store may be on either side of it. The
    /// current window surely lasts until `deadline` (its earliest possible
    /// end, minus the margin) and surely ended at `window_end` (its latest
    /// possible end, plus the margin); later boundaries repeat every period.
    pub(crate) fn window_at(&self, now: u64, period_us: u64) -> Option<i64> {
        let window = self.window.load(Ordering::Acquire);
        if window == UNKNOWN_WINDOW {
            return Some(UNKNOWN_WINDOW);
        }
        let early = self.deadline.load(Ordering::Acquire);
        let late = self.window_end.load(Ordering::Acquire);
        if early == 0 {
            return None;
        }
        if now < early {
            return Some(window);
        }
        let period = period_us.max(1);
        let width = late.saturating_sub(early);
        let since = now - early;
        let k = since / period;
        if since - k * period < width {
            None
        } else {
            Some(window + 1 + k as i64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_are_spent_only_before_the_deadline() {
        let slot = Slot::new("k".into(), 0);
        assert!(matches!(slot.take(1, 10, 0, || 0), Take::Empty));
        slot.install(3, 7, 100, 103, 10, false);
        assert!(matches!(slot.take(2, 50, 0, || 0), Take::Taken(1)));
        assert!(matches!(slot.take(2, 50, 0, || 0), Take::Empty));
        assert!(
            matches!(slot.take(1, 100, 0, || 0), Take::Empty),
            "deadline passed"
        );
        assert_eq!(slot.expire(100), 1);
    }

    #[test]
    fn a_grant_for_the_same_window_adds_and_a_new_window_replaces() {
        let slot = Slot::new("k".into(), 0);
        slot.install(3, 7, 100, 103, 10, false);
        assert_eq!(slot.install(2, 7, 200, 203, 20, false), 0);
        assert!(matches!(slot.take(5, 30, 0, || 0), Take::Taken(0)));
        slot.install(3, 7, 100, 103, 40, false);
        // window 8 replaces window 7's leftovers, which are handed back
        assert_eq!(slot.install(4, 8, 200, 203, 150, false), 3);
        assert!(matches!(slot.take(4, 160, 0, || 0), Take::Taken(0)));
    }

    #[test]
    fn a_pre_lease_is_usable_only_from_its_start() {
        let slot = Slot::new("k".into(), 0);
        slot.install(1, 7, 100, 103, 10, false);
        *slot.next.lock().unwrap() = Some(Box::new(NextLease {
            permits: 5,
            window: 8,
            start: 106,
            deadline: 200,
            window_end: 203,
        }));
        slot.has_next.store(true, Ordering::Release);
        assert_eq!(slot.promote(105), None);
        assert_eq!(slot.promote(106), Some(1));
        assert!(matches!(slot.take(5, 106, 0, || 0), Take::Taken(0)));
        assert_eq!(slot.window_at(150, 100), Some(8));
        assert_eq!(
            slot.window_at(200, 100),
            None,
            "between deadline and sure end"
        );
        assert_eq!(slot.window_at(202, 100), None);
        assert_eq!(slot.window_at(203, 100), Some(9));
        assert_eq!(slot.window_at(299, 100), Some(9));
        assert_eq!(slot.window_at(301, 100), None);
        assert_eq!(slot.window_at(303, 100), Some(10));
    }
}

#[cfg(test)]
mod size {
    /// The slot's size is part of the bytes-per-key budget (README,
    /// Performance): growing it should be a decision, not an accident.
    #[test]
    fn a_slot_stays_within_its_budget() {
        let size = std::mem::size_of::<super::Slot>();
        assert!(size <= 152, "Slot grew to {size} bytes");
    }
}
