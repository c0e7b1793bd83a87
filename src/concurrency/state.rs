//! One key's slots in this process: the exact permits' leases, the hybrid
//! lease's slots and what is in use of them. Pure bookkeeping on the
//! local clock; the calls to the store are the limiter's.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

/// A key's slots, and the waiters for one.
#[derive(Debug, Default)]
pub(crate) struct KeySlots {
    state: Mutex<Slots>,
    /// Signalled when a slot of the key may have come free here.
    pub(crate) freed: Notify,
    /// Signalled when a call on the key's lease has answered (or was
    /// given up).
    pub(crate) answered: Notify,
}

impl KeySlots {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Slots> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug, Default)]
pub(crate) struct Slots {
    /// Live exact permits' lease ids (renewed together).
    pub(crate) exact: HashSet<u64>,
    /// Exact leases whose permits dropped, and when (local clock): their
    /// release may not have reached the store yet, so the next call on
    /// the key from here sends it again (a release is idempotent), and a
    /// take right after a drop finds the slot free instead of still held
    /// by a lease this process gave up. Forgotten once a call carrying
    /// them answers, or a lease after the drop (the lease has expired).
    pub(crate) released: Vec<(u64, Duration)>,
    /// Slots this process's lease holds in the store (hybrid), as last
    /// answered.
    pub(crate) held: u64,
    /// Of those, in use by live permits.
    pub(crate) in_use: u64,
    /// What the store last answered the lease holds (`held` may be lower
    /// while a call that shrinks it is in flight).
    pub(crate) stored: u64,
    /// The lease's fair share of the key, as last answered.
    pub(crate) fair: u64,
    /// Until when (local clock) the lease surely lives: counted from
    /// before the call that renewed it.
    pub(crate) valid_until: Duration,
    /// A call on the lease is in flight: no other may be sent (values are
    /// absolute, so a late one would undo an earlier one).
    pub(crate) asking: bool,
    /// Permits the failure policy admitted.
    pub(crate) fallback: u64,
    /// The last call on the lease did not answer.
    pub(crate) failed: bool,
    /// Acquisitions waiting for a slot of the key here: the demand the
    /// lease asks for besides what is in use.
    pub(crate) waiting: u64,
    /// The last answer's fair share was below what was asked: others
    /// want slots too.
    pub(crate) capped: bool,
    /// What the last call asked for.
    pub(crate) asked: u64,
    /// When (local clock) the last call was sent.
    pub(crate) sent_at: Duration,
    /// Until when (local clock) not to ask for more: the last ask got
    /// nothing (every slot is taken), and asking again at once would only
    /// load the store.
    pub(crate) quiet_until: Duration,
}

/// What [`Slots::ask`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// Send a call for this many.
    Send(u64),
    /// Another call is in flight: wait for its answer.
    Busy,
    /// Asked in vain a moment ago: not yet.
    Quiet,
}

/// How often a busy hybrid lease is synced at least: how soon it learns
/// that others wait.
pub(crate) const REFRESH: Duration = Duration::from_millis(200);

/// How long a process does not ask again after an ask got nothing.
pub(crate) const QUIET: Duration = Duration::from_millis(20);

impl Slots {
    /// Permits of the key alive in this process.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_use + self.exact.len() as u64 + self.fallback
    }

    /// Takes a leased slot at `now`, if one is free and the lease lives.
    pub(crate) fn take(&mut self, now: Duration) -> bool {
        if now < self.valid_until && self.in_use < self.held {
            self.in_use += 1;
            return true;
        }
        false
    }

    /// What to ask the store for at `now` when no slot is free: what is in
    /// use, one for each acquisition waiting (at least this one), and a
    /// batch of a quarter of that besides.
    pub(crate) fn ask(&mut self, now: Duration) -> Ask {
        if self.asking {
            return Ask::Busy;
        }
        // Asked in vain a moment ago, or giving slots back (a call now
        // would take them again before the others could). Not after a
        // call that did not answer: what the store holds is then unknown
        // (a shrink that failed leaves `held` below `stored` until a call
        // answers), and only asking can tell "full" from "unreachable".
        if !self.failed
            && ((now < self.quiet_until && now < self.valid_until) || self.held < self.stored)
        {
            return Ask::Quiet;
        }
        let want = self.in_use + self.waiting.max(1);
        let want = want + want / 4;
        if self.capped {
            // Others wait too: no more than the fair share, which the
            // answer brings up to date.
            return Ask::Send(self.sending(want.min(self.fair.max(self.in_use))));
        }
        Ask::Send(self.sending(want))
    }

    /// A call setting the lease to `want` is about to go: no other may
    /// go meanwhile, and no more than `want` may be in use here until it
    /// answers (the store may apply it at any moment).
    pub(crate) fn sending(&mut self, want: u64) -> u64 {
        self.asking = true;
        self.asked = want;
        self.held = self.held.min(want);
        want
    }

    /// What the lease should hold when renewed: what is in use, and a
    /// spare batch while it is busy, but never above its fair share
    /// unless in use (`closing`: only what is in use).
    pub(crate) fn desired(&self, closing: bool) -> u64 {
        if closing {
            return self.in_use;
        }
        let spare = self.in_use.div_ceil(4);
        let want = self.held.min(self.in_use + spare);
        want.min(self.fair.max(self.in_use))
    }

    /// Records what the store answered; returns the change in slots the
    /// store says the lease holds.
    pub(crate) fn granted(
        &mut self,
        held: u64,
        fair: u64,
        sent_at: Duration,
        lease: Duration,
    ) -> i64 {
        let valid_until = sent_at + lease;
        self.sent_at = sent_at;
        let change = held as i64 - self.stored as i64;
        self.stored = held;
        self.held = held;
        self.fair = fair;
        self.capped = fair < self.asked;
        self.valid_until = valid_until;
        change
    }

    /// A leased slot's permit dropped at `now`. Returns whether the lease
    /// should be synced at once: it held more than its fair share (others
    /// want the slot, so the slot goes back instead of to the next
    /// request here), or its last call is [`REFRESH`] old.
    pub(crate) fn put_back(&mut self, now: Duration) -> bool {
        self.in_use = self.in_use.saturating_sub(1);
        if self.held > self.fair && self.held > self.in_use {
            // Others wait for it: not reused here, given back.
            self.held -= 1;
            return true;
        }
        // A busy lease is synced now and then, so that it learns when
        // others start to wait (its fair share comes with the answer).
        now >= self.sent_at + REFRESH && !self.asking
    }

    /// The exact leases whose release to carry in a call sent at `now`:
    /// those released within `lease` (older ones have expired).
    pub(crate) fn releases_to_carry(&mut self, now: Duration, lease: Duration) -> Vec<u64> {
        self.released.retain(|&(_, at)| now < at + lease);
        self.released.iter().map(|&(id, _)| id).collect()
    }

    /// A call carrying the releases of `carried` answered: the store has
    /// applied them.
    pub(crate) fn released_applied(&mut self, carried: &[u64]) {
        self.released.retain(|(id, _)| !carried.contains(id));
    }

    /// Nothing held, in use or asked for: the entry may go.
    pub(crate) fn idle(&self) -> bool {
        self.released.is_empty()
            && self.stored == 0
            && self.held == 0
            && self.in_flight() == 0
            && self.waiting == 0
            && !self.asking
    }
}

/// A call on a hybrid lease in flight; dropped (the call's future was),
/// it lets the next call go.
pub(crate) struct Asking {
    slots: Option<Arc<KeySlots>>,
}

impl Asking {
    pub(crate) fn new(slots: Arc<KeySlots>) -> Self {
        Asking { slots: Some(slots) }
    }

    /// The call answered: `slots` is the locked state.
    pub(crate) fn done(mut self, slots: &mut Slots) {
        slots.asking = false;
        if let Some(key) = self.slots.take() {
            key.answered.notify_waiters();
        }
    }
}

impl Drop for Asking {
    fn drop(&mut self) {
        if let Some(slots) = self.slots.take() {
            slots.lock().asking = false;
            slots.answered.notify_waiters();
        }
    }
}

/// An acquisition waiting for a slot of a key: counted in the lease's
/// demand until it ends, however it ends.
pub(crate) struct Waiting(Arc<KeySlots>);

impl Waiting {
    pub(crate) fn new(slots: Arc<KeySlots>) -> Self {
        slots.lock().waiting += 1;
        Waiting(slots)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut slots = self.0.lock();
        slots.waiting = slots.waiting.saturating_sub(1);
    }
}
