//! A grant put in place, and permits taken out of the slot's hands: an
//! install (added or replacing), a trim of an idle holder's surplus, an
//! expiry; and which window the slot's clock places a time in.

use super::atomics::Ordering;
use super::Slot;

/// A lease granted by the store, placed in local time: what an install
/// puts in the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// Permits granted.
    pub(crate) permits: i64,
    /// Window algorithms: the window index they belong to. Buckets: 0
    /// (one lease at a time, told apart by its deadline).
    pub(crate) window: i64,
    /// Local µs at which they become void.
    pub(crate) deadline: u64,
    /// Window algorithms: local µs by which the window has surely ended.
    /// Buckets: local µs at which the bucket is full again.
    pub(crate) window_end: u64,
    /// A renewal (or a promotion): it replaces the permits held even of
    /// the same window, instead of adding to them.
    pub(crate) renew: bool,
}

/// What installing a lease did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Installed {
    /// Added to the permits of the lease in force (same window, its
    /// deadline unchanged): nothing was replaced.
    Added,
    /// In place of the lease before; this many of its permits (expired
    /// or superseded) were replaced, possibly none.
    Replaced(i64),
    /// The grant is for a window older than the one the slot already
    /// serves (a late reply): not installed, these permits are stranded.
    Stale(i64),
}

/// Where the slot's clock places a time (see [`Slot::window_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowAt {
    /// No lease yet: the slot cannot tell.
    Unknown,
    /// Close to a boundary: the store may be on either side of it.
    Boundary,
    /// Surely this window.
    In(i64),
}

/// Permits trimmed off an idle holder's lease, to be given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Trimmed {
    pub(crate) permits: i64,
    /// Their window (`None`: none known, so there is nowhere to give
    /// them back to).
    pub(crate) window: Option<i64>,
}

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
    pub(crate) fn install(&self, grant: Grant, now: u64) -> Installed {
        let _serial = self.next_lock();
        self.install_locked(grant, now)
    }

    /// [`install`](Slot::install), the `next` lock held by the caller.
    pub(super) fn install_locked(&self, grant: Grant, now: u64) -> Installed {
        let Grant {
            permits: granted,
            window,
            deadline,
            window_end,
            renew,
        } = grant;
        let current_deadline = self.deadline.load(Ordering::Acquire);
        let current_window = self.window.load(Ordering::Acquire).get();
        if !renew && now < current_deadline {
            if current_window == Some(window) {
                self.early_refill.store(true, Ordering::Relaxed);
                self.permits.fetch_add(granted, Ordering::AcqRel);
                return Installed::Added;
            }
            if current_window.is_some_and(|current| window < current) {
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
    pub(crate) fn trim(&self, keep: i64, now: u64) -> Option<Trimmed> {
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
        Some(Trimmed {
            permits: trimmed,
            window: self.window.load(Ordering::Acquire).get(),
        })
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

    /// Local estimate of the fixed window in force at `now`. The current
    /// window surely lasts until `deadline` (its earliest possible end,
    /// minus the margin) and surely ended at `window_end` (its latest
    /// possible end, plus the margin); later boundaries repeat every period.
    pub(crate) fn window_at(&self, now: u64, period_us: u64) -> WindowAt {
        let Some(window) = self.window.load(Ordering::Acquire).get() else {
            return WindowAt::Unknown;
        };
        let early = self.deadline.load(Ordering::Acquire);
        let late = self.window_end.load(Ordering::Acquire);
        if early == 0 {
            return WindowAt::Boundary;
        }
        if now < early {
            return WindowAt::In(window);
        }
        let period = period_us.max(1);
        let width = late.saturating_sub(early);
        let since = now - early;
        let k = since / period;
        if since - k * period < width {
            WindowAt::Boundary
        } else {
            WindowAt::In(window + 1 + k as i64)
        }
    }
}
