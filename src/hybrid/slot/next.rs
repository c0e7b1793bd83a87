//! The pre-lease a slot holds apart: a slice of the next window, granted
//! ahead of the boundary, put in place once its window starts.

use super::atomics::{MutexGuard, Ordering};
use super::install::{Grant, Installed};
use super::Slot;

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
    /// The low-water mark for these permits once they are in place. (A
    /// pre-lease does not move the current lease's mark: that one is for
    /// the permits of the window still running.)
    pub(crate) low_water: u32,
}

/// A spend across a boundary (see [`Slot::take_across`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Across {
    /// Permits the next window's slice has left (`None`: nothing was
    /// admitted).
    pub(crate) left: Option<i64>,
    /// The next window, which the admission is counted in (meaningless
    /// unless `left` is `Some`).
    pub(crate) window: i64,
    /// Local µs by which the next window has surely ended: the decision
    /// resets then.
    pub(crate) window_end: u64,
    /// Permits taken and not spent on the admission (stranded).
    pub(crate) stranded: i64,
}

impl Slot {
    /// Whether a pre-leased slice of the next window is held.
    #[inline]
    pub(crate) fn has_next(&self) -> bool {
        self.has_next.load(Ordering::Acquire)
    }

    pub(super) fn next_lock(&self) -> MutexGuard<'_, Option<Box<NextLease>>> {
        self.next.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds a pre-leased slice of the next window: added to one held for
    /// the same window, else in place of it. Returns the permits of a slice
    /// for another window it replaced (stranded).
    pub(crate) fn hold_next(&self, lease: NextLease) -> i64 {
        let mut next = self.next_lock();
        let (merged, replaced) = match next.as_deref().copied() {
            Some(n) if n.window == lease.window => (
                NextLease {
                    permits: n.permits + lease.permits,
                    ..n
                },
                0,
            ),
            Some(n) => (lease, n.permits.max(0)),
            None => (lease, 0),
        };
        *next = Some(Box::new(merged));
        self.has_next.store(true, Ordering::Release);
        replaced
    }

    /// Sets the low-water mark a held slice of `window` takes once in place.
    pub(crate) fn set_next_low_water(&self, window: i64, low_water: u32) {
        if let Some(n) = self.next_lock().as_mut().filter(|n| n.window == window) {
            n.low_water = low_water;
        }
    }

    /// Drops a held slice whose deadline has passed; returns its permits
    /// (stranded).
    pub(crate) fn expire_next(&self, now: u64) -> i64 {
        if !self.has_next() {
            return 0;
        }
        let mut next = self.next_lock();
        match next.as_deref().copied() {
            Some(n) if now >= n.deadline => {
                *next = None;
                self.has_next.store(false, Ordering::Release);
                n.permits.max(0)
            }
            _ => 0,
        }
    }

    /// The permits of the held slice of the next window (0: none).
    #[cfg(test)]
    pub(crate) fn next_permits(&self) -> i64 {
        self.next_lock().as_ref().map_or(0, |n| n.permits)
    }

    /// When a held slice becomes usable, if one is held.
    pub(crate) fn next_start(&self) -> Option<u64> {
        if !self.has_next() {
            return None;
        }
        self.next_lock().as_ref().map(|n| n.start)
    }

    /// Spends `cost` at local `now` across a boundary: after the current
    /// lease's deadline, before the held slice of the next window may be
    /// spent on its own. Until the current window has surely ended, the
    /// store may be on either side of the boundary, so `cost` is taken
    /// from both windows' permits, and whichever window `now` falls in
    /// has a permit of its own for it (the other's is stranded: a thin
    /// holder has permits to spare there; a hot key seldom has, and
    /// waits as before). Once it has surely ended, the next window's
    /// permits alone are spent. `paid`: the current window, if a late
    /// take (see [`Take::Late`](super::Take::Late)) already took `cost`
    /// of its permits.
    ///
    /// `clock` is read again once the permits are taken, as [`take`]
    /// does: a thread preempted past the slice's deadline spends nothing
    /// (what it took is stranded).
    ///
    /// [`take`]: Slot::take
    pub(crate) fn take_across(
        &self,
        cost: i64,
        now: u64,
        paid: Option<i64>,
        clock: impl Fn() -> u64,
    ) -> Across {
        let nothing = Across {
            left: None,
            window: 0,
            window_end: 0,
            stranded: 0,
        };
        if !self.has_next.load(Ordering::Acquire) {
            return nothing;
        }
        let mut next = self.next_lock();
        let Some(lease) = next.as_deref_mut() else {
            return nothing;
        };
        let Some(window) = self.window.load(Ordering::Acquire).get() else {
            return nothing;
        };
        let deadline = self.deadline.load(Ordering::Acquire);
        if lease.window != window + 1
            || deadline == 0
            || now < deadline
            || now >= lease.deadline
            || lease.permits < cost
        {
            return nothing;
        }
        let both = now < self.window_end.load(Ordering::Acquire) && paid != Some(window);
        // Taken under the `next` lock, which serialises installs: the
        // permits are still the current window's.
        if both
            && self
                .permits
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                    (p >= cost).then_some(p - cost)
                })
                .is_err()
        {
            return nothing;
        }
        lease.permits -= cost;
        let stranded = if both { cost } else { 0 };
        if clock() >= lease.deadline {
            return Across {
                stranded: stranded + cost,
                ..nothing
            };
        }
        Across {
            left: Some(lease.permits),
            window: lease.window,
            window_end: lease.window_end,
            stranded,
        }
    }

    /// Moves a due pre-leased slice of the next window into place; returns
    /// the permits it replaced, or `None` if nothing was due.
    pub(crate) fn promote(&self, now: u64) -> Option<i64> {
        if !self.has_next.load(Ordering::Acquire) {
            return None;
        }
        let mut next = self.next_lock();
        let lease = **next.as_ref()?;
        if now < lease.start {
            return None;
        }
        *next = None;
        self.has_next.store(false, Ordering::Release);
        self.low_water.store(lease.low_water, Ordering::Relaxed);
        let grant = Grant {
            permits: lease.permits,
            window: lease.window,
            deadline: lease.deadline,
            window_end: lease.window_end,
            renew: true,
        };
        let installed = self.install_locked(grant, now);
        drop(next);
        Some(match installed {
            Installed::Added => 0,
            Installed::Replaced(n) => {
                self.books().sizing.moved(lease.permits, n);
                n
            }
            Installed::Stale(n) => n,
        })
    }
}
