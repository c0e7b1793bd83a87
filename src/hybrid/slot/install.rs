//! A grant put in place, and permits taken out of the slot's hands: an
//! install (added or replacing), a trim of an idle holder's surplus, an
//! expiry; and which window the slot's clock places a time in.

use super::*;

impl Slot {
    /// Installs a lease. If the current permits are still valid and belong
    /// to the same window (and this is not a renewal), the grant is added
    /// and the deadline kept, so no permit outlives its own lease. A grant
    /// for a window older than the valid one in place is refused (a late
    /// reply must not bring back an ended window). Otherwise the grant
    /// replaces the permits held, which are returned (expired leftovers,
    /// for the caller to give back or count as stranded).
    ///
    /// Installs are serialised by the `next` lock (the sync task installs
    /// replies, a request may promote a pre-lease at the same moment).
    pub(crate) fn install(
        &self,
        granted: i64,
        window: i64,
        deadline: u64,
        window_end: u64,
        now: u64,
        renew: bool,
    ) -> Installed {
        let _serial = self.next.lock().unwrap_or_else(|p| p.into_inner());
        self.install_locked(granted, window, deadline, window_end, now, renew)
    }

    pub(super) fn install_locked(
        &self,
        granted: i64,
        window: i64,
        deadline: u64,
        window_end: u64,
        now: u64,
        renew: bool,
    ) -> Installed {
        let current_deadline = self.deadline.load(Ordering::Acquire);
        let current_window = self.window.load(Ordering::Acquire);
        if !renew && now < current_deadline {
            if current_window == window {
                self.early_refill.store(true, Ordering::Relaxed);
                self.permits.fetch_add(granted, Ordering::AcqRel);
                return Installed::Added;
            }
            if window < current_window {
                return Installed::Stale(granted);
            }
        }
        self.early_refill.store(true, Ordering::Relaxed);
        // Void the old permits first, then publish the new ones, so the
        // request path never pairs new permits with an old deadline.
        self.deadline.store(0, Ordering::Release);
        let old = self.permits.swap(granted, Ordering::AcqRel);
        self.window.store(window, Ordering::Release);
        self.window_end.store(window_end, Ordering::Release);
        self.deadline.store(deadline, Ordering::Release);
        Installed::Replaced(old.max(0))
    }

    /// Takes every permit above `keep` out of a lease still valid at
    /// `now`, to be given back; returns them and their window (`None`:
    /// nothing above `keep`, or no valid lease). Under the `next` lock,
    /// which serialises installs, so the window is the permits' own.
    pub(crate) fn trim(&self, keep: i64, now: u64) -> Option<(i64, i64)> {
        let _serial = self.next_lock();
        if self.evicted.load(Ordering::Acquire) || now >= self.deadline.load(Ordering::Acquire) {
            return None;
        }
        let before = self
            .permits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                (p > keep).then_some(keep)
            })
            .ok()?;
        let trimmed = before - keep;
        self.books().sizing.moved(0, trimmed);
        Some((trimmed, self.window.load(Ordering::Acquire)))
    }

    /// Voids permits whose deadline has passed; returns how many there were.
    pub(crate) fn expire(&self, now: u64) -> i64 {
        if now < self.deadline.load(Ordering::Acquire) {
            return 0;
        }
        let voided = self.permits.swap(0, Ordering::AcqRel).max(0);
        if voided > 0 {
            self.books().sizing.moved(0, voided);
        }
        voided
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
