//! The refill protocol of a slot: when it wants a refill, and the three
//! flags that make sure one refill at a time is asked for, sent and
//! settled (`refill_pending`, `in_flight`, `promoted`), each transition a
//! method here.

use super::*;

impl Slot {
    /// Whether the permits just spent leave the slot wanting a refill.
    #[inline]
    pub(crate) fn wants_refill(&self, left: i64, now: u64, lead: u64) -> bool {
        left < i64::from(self.low_water.load(Ordering::Relaxed))
            || (self.near_end(now, lead) && !self.has_next.load(Ordering::Acquire))
    }

    /// A refill is asked for (`waiting`: by a request that waits on it).
    /// Whether the slot gets a new entry in the refill queue: when none is
    /// pending, or when a request now waits on one queued ahead of need
    /// (low water, pre-lease) and not yet sent — a second entry, in the
    /// waiters' queue; the first one taken wins (`RefillQueue::pop`).
    pub(crate) fn enqueue(&self, waiting: bool) -> bool {
        let fresh = !self.refill_pending.swap(true, Ordering::AcqRel);
        let promote = waiting
            && !self.in_flight.load(Ordering::Acquire)
            && !self.promoted.swap(true, Ordering::AcqRel);
        fresh || promote
    }

    /// A queue entry of the slot is taken to be sent: `true` if it is the
    /// refill asked for, not yet sent (an entry whose refill is already
    /// on its way, or settled since it was queued, is a duplicate).
    pub(crate) fn send_queued(&self) -> bool {
        if !self.refill_pending.load(Ordering::Acquire)
            || self.in_flight.swap(true, Ordering::AcqRel)
        {
            return false;
        }
        self.promoted.store(false, Ordering::Release);
        true
    }

    /// A refill the sync task sends unasked (a ride): claimed first, then
    /// marked in flight as a queue entry taken by
    /// [`send_queued`](Slot::send_queued) is, so a request that asks
    /// meanwhile finds the refill on its way. `false` if one is pending.
    pub(crate) fn send_unasked(&self) -> bool {
        if self.refill_pending.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.in_flight.store(true, Ordering::Release);
        self.promoted.store(false, Ordering::Release);
        true
    }

    /// Whether a refill is on its way (sent, not settled).
    #[cfg(test)]
    pub(crate) fn refill_in_flight(&self) -> bool {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether a refill is asked for or on its way.
    pub(crate) fn refill_pending(&self) -> bool {
        self.refill_pending.load(Ordering::Acquire)
    }

    /// The refill is settled (applied, failed, or put back): the slot may
    /// queue another. `in_flight` clears first, so a queue entry seen
    /// after `refill_pending` is set again is never taken for the old one.
    pub(crate) fn refill_done(&self) {
        self.in_flight.store(false, Ordering::Release);
        self.refill_pending.store(false, Ordering::Release);
    }
}
