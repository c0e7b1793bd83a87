//! Permits spent from a slot and put back: the request path's
//! compare-and-swap (with a thread's spare stock besides), and a take
//! undone into the very lease it came from.

use super::atomics::Ordering;
use super::Slot;
use crate::clock::TimeSource;

/// The result of trying to spend local permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    /// Spent.
    Taken {
        /// Permits the slot holds after the take.
        left: i64,
        /// The local time (µs) the take was decided at.
        now: u64,
        /// Another thread's swap got in the way: the key is contended.
        contended: bool,
        /// The window the permits surely came from (`None` when a lease
        /// of another window was installed meanwhile, or before any).
        window: Option<i64>,
    },
    /// No valid permits (empty, expired or not yet leased).
    Empty,
    /// The deadline passed while the permits were being taken (a thread
    /// preempted between its check and its compare-and-swap): they are
    /// void. Treat as `Empty`, except that they were taken from `window`,
    /// which a take across the boundary counts as paid (see
    /// [`Slot::take_across`]).
    Late {
        /// Permits taken and lost (stranded).
        lost: i64,
        /// The window they came from (`None`: unsure).
        window: Option<i64>,
    },
}

impl Take {
    /// A late take's window, if it took at least `cost` of it: that
    /// window's side of a take across is paid (see [`Slot::take_across`]).
    pub(crate) fn paid(&self, cost: u64) -> Option<i64> {
        match *self {
            Take::Late { lost, window } => window.filter(|_| lost as u64 >= cost),
            Take::Taken { .. } | Take::Empty => None,
        }
    }
}

/// Permits taken besides the cost for a thread's own stock (see
/// `thread_cache`), and the deadline they are valid until.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spare {
    pub(crate) permits: i64,
    pub(crate) deadline: u64,
}

impl Spare {
    const NONE: Spare = Spare {
        permits: 0,
        deadline: 0,
    };
}

impl Slot {
    /// Spends `cost` local permits if they are valid now.
    ///
    /// The clock is read once, after the compare-and-swap that takes the
    /// permits, against the deadline read before it: a thread preempted
    /// anywhere before its decision is judged by the time it decides, so
    /// no permit is spent after its deadline (permits taken too late are
    /// void: [`Take::Late`]). `time` may read a coarse clock; within its
    /// guard of the deadline it reads the precise one
    /// ([`TimeSource::valid_until`]). `cost` is at most the quota's
    /// largest cost (callers check).
    #[inline]
    pub(crate) fn take(&self, cost: u64, time: &TimeSource) -> Take {
        self.take_spare(cost, time, |_| 0).0
    }

    /// [`take`](Slot::take), taking besides `cost` a spare share of what
    /// the slot holds: `spare(left after cost)` permits more, if there are
    /// that many. Returns the spare permits taken (none unless `Taken`)
    /// and the deadline they are valid until: a thread's own stock (see
    /// `thread_cache`), spent without touching the slot.
    #[inline]
    pub(crate) fn take_spare(
        &self,
        cost: u64,
        time: &TimeSource,
        spare: impl Fn(i64) -> i64,
    ) -> (Take, Spare) {
        // Read before the deadline and again after the swap: an install
        // publishes its window after its permits, so an unchanged window
        // means the permits are that window's (for refunds).
        let window = self.window.load(Ordering::Acquire);
        let deadline = self.deadline.load(Ordering::Acquire);
        if deadline == 0 {
            return (Take::Empty, Spare::NONE);
        }
        let cost = cost.min(i64::MAX as u64) as i64;
        let mut current = self.permits.load(Ordering::Acquire);
        let mut contended = false;
        loop {
            if current < cost {
                return (Take::Empty, Spare::NONE);
            }
            let extra = spare(current - cost).clamp(0, current - cost);
            match self.permits.compare_exchange_weak(
                current,
                current - cost - extra,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // A lease installed between the read and the swap (a
                    // bucket renewal keeps the window) may end sooner: the
                    // permits taken are valid until the earlier deadline.
                    // (0: an install is publishing its deadline; the one
                    // read before stands, as for any take.)
                    let after = self.deadline.load(Ordering::Acquire);
                    let deadline = if after == 0 {
                        deadline
                    } else {
                        deadline.min(after)
                    };
                    let same = || self.window.load(Ordering::Acquire) == window;
                    return match time.valid_until(deadline) {
                        Some(now) => {
                            let taken = Take::Taken {
                                left: current - cost - extra,
                                now,
                                contended,
                                window: window.get().filter(|_| same()),
                            };
                            let spare = Spare {
                                permits: extra,
                                deadline,
                            };
                            (taken, spare)
                        }
                        None if cost + extra > 0 => {
                            let late = Take::Late {
                                lost: cost + extra,
                                window: window.get().filter(|_| same()),
                            };
                            (late, Spare::NONE)
                        }
                        None => (Take::Empty, Spare::NONE),
                    };
                }
                Err(actual) => {
                    contended = true;
                    current = actual;
                }
            }
        }
    }

    /// Puts back a thread's spare permits, taken from the lease of
    /// `window` valid until `deadline`, if the slot still holds that very
    /// lease and it is still valid; `false` otherwise (they are stranded).
    pub(crate) fn restore(
        &self,
        window: Option<i64>,
        deadline: u64,
        permits: i64,
        now: u64,
    ) -> bool {
        permits > 0 && self.put_back(window, Some(deadline), permits, now)
    }

    /// Puts back `cost` permits spent from `window`'s lease (a refund, or
    /// the undoing of one quota's take when another denied), if the slot
    /// still holds a valid lease of that window; `false` otherwise (the
    /// caller returns them to the store, which takes them only while the
    /// window lasts).
    pub(crate) fn untake(&self, window: i64, cost: u64, now: u64) -> bool {
        self.put_back(Some(window), None, cost.min(i64::MAX as u64) as i64, now)
    }

    /// Adds `permits` if the slot holds a lease of `window` (with this
    /// `deadline`, when given) valid at `now`. Under the `next` lock, which
    /// serialises installs: a lease of another window cannot slip in
    /// between the check and the add.
    fn put_back(&self, window: Option<i64>, deadline: Option<u64>, permits: i64, now: u64) -> bool {
        let _serial = self.next_lock();
        let current = self.deadline.load(Ordering::Acquire);
        if self.evicted.load(Ordering::Acquire)
            || self.window.load(Ordering::Acquire).get() != window
            || deadline.is_some_and(|d| d != current)
            || now >= current
        {
            return false;
        }
        self.permits.fetch_add(permits, Ordering::AcqRel);
        true
    }
}
