//! The refill protocol of a slot: when it wants a refill, and where its
//! one refill is ([`Refill`]), so that one at a time is asked for, sent
//! and settled. Every transition is a method here, one compare-and-swap.

use super::atomics::Ordering;
use super::Slot;

/// Where a slot's refill is. At most one per key: asked for (queued),
/// sent, settled (idle again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Refill {
    /// None asked for.
    Idle = 0,
    /// Asked for, in the refill queue, not sent.
    Queued = 1,
    /// Asked for, and a request waits on it: the slot also has an entry
    /// in the waiters' queue, sent first; the first entry taken wins.
    Waited = 2,
    /// In a batch the sync task has sent (or is building): any other
    /// queue entry for the slot is a duplicate to skip.
    Sent = 3,
}

impl Refill {
    fn of(state: u8) -> Refill {
        match state {
            1 => Refill::Queued,
            2 => Refill::Waited,
            3 => Refill::Sent,
            _ => Refill::Idle,
        }
    }
}

impl Slot {
    /// Whether the permits just spent leave the slot wanting a refill.
    #[inline]
    pub(crate) fn wants_refill(&self, left: i64, now: u64, lead: u64) -> bool {
        left < i64::from(self.low_water.load(Ordering::Relaxed))
            || (self.near_end(now, lead) && !self.has_next.load(Ordering::Acquire))
    }

    fn refill_state(&self) -> Refill {
        Refill::of(self.refill.load(Ordering::Acquire))
    }

    /// Moves the refill from `from` to `to`; `false` if it was elsewhere.
    fn refill_moves(&self, from: Refill, to: Refill) -> bool {
        self.refill
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// A refill is asked for (`waiting`: by a request that waits on it).
    /// Whether the slot gets a new entry in the refill queue: when none is
    /// asked for, or when a request now waits on one queued ahead of need
    /// (low water, pre-lease) and not yet sent — a second entry, in the
    /// waiters' queue; the first one taken wins (`RefillQueue::pop`).
    pub(crate) fn enqueue(&self, waiting: bool) -> bool {
        let asked = if waiting {
            Refill::Waited
        } else {
            Refill::Queued
        };
        loop {
            let moved = match self.refill_state() {
                Refill::Idle => self.refill_moves(Refill::Idle, asked),
                Refill::Queued if waiting => self.refill_moves(Refill::Queued, Refill::Waited),
                Refill::Queued | Refill::Waited | Refill::Sent => return false,
            };
            if moved {
                return true;
            }
        }
    }

    /// A queue entry of the slot is taken to be sent: `true` if it is the
    /// refill asked for, not yet sent (an entry whose refill is already
    /// on its way, or settled since it was queued, is a duplicate).
    pub(crate) fn send_queued(&self) -> bool {
        loop {
            let from = match self.refill_state() {
                from @ (Refill::Queued | Refill::Waited) => from,
                Refill::Idle | Refill::Sent => return false,
            };
            if self.refill_moves(from, Refill::Sent) {
                return true;
            }
        }
    }

    /// A refill the sync task sends unasked (a ride): sent at once, so a
    /// request that asks meanwhile finds it on its way. `false` if one is
    /// asked for already.
    pub(crate) fn send_unasked(&self) -> bool {
        self.refill_moves(Refill::Idle, Refill::Sent)
    }

    /// Whether a refill is on its way (sent, not settled).
    #[cfg(test)]
    pub(crate) fn refill_in_flight(&self) -> bool {
        self.refill_state() == Refill::Sent
    }

    /// Whether a refill is asked for or on its way.
    pub(crate) fn refill_pending(&self) -> bool {
        self.refill_state() != Refill::Idle
    }

    /// The refill is settled (applied, failed, or put back): the slot may
    /// ask for another.
    pub(crate) fn refill_done(&self) {
        self.refill.store(Refill::Idle as u8, Ordering::Release);
    }
}
