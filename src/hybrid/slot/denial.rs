//! A denial the slot caches: until when the store said the key is
//! exhausted, whether an ask or a peek said so, and what the client is
//! told. It never asks the store; the sync task stores what it heard.

use super::atomics::{AtomicU64, Ordering};
use super::Slot;

/// What `Slot::denied_until` holds: no denial, or one until a local µs,
/// from an ask (definitive) or from a peek (believed only while fresh,
/// see `Slot::peek_trust`). One word, so the request path reads a denial
/// with one atomic load and a peek's latching is one compare-and-swap:
/// an ask's time is even, a peek's odd, and that bit is read and written
/// here alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Denial(u64);

impl Denial {
    const NONE: Denial = Denial(0);

    /// An ask's answer: exhausted until `until` (rounded up to an even
    /// µs; 0 stays none).
    fn asked(until: u64) -> Denial {
        Denial(until.saturating_add(1) & !1)
    }

    /// A peek's answer: exhausted until `until` (odd, so never equal to
    /// an ask's stored meanwhile).
    fn peeked(until: u64) -> Denial {
        Denial(until | 1)
    }

    /// The local µs it lasts until (`None`: no denial).
    fn until(self) -> Option<u64> {
        (self.0 != 0).then_some(self.0)
    }

    fn is_peek(self) -> bool {
        self.0 & 1 == 1
    }
}

/// The slot's cached denial, read and written through [`Denial`].
#[derive(Debug)]
pub(super) struct DenialCell(AtomicU64);

impl DenialCell {
    pub(super) fn new() -> Self {
        DenialCell(AtomicU64::new(Denial::NONE.0))
    }

    #[inline]
    fn load(&self) -> Denial {
        Denial(self.0.load(Ordering::Acquire))
    }

    fn store(&self, denial: Denial) {
        self.0.store(denial.0, Ordering::Release);
    }

    /// Replaces `from` by `to` unless another denial was stored meanwhile.
    fn replace(&self, from: Denial, to: Denial) {
        let _ = self
            .0
            .compare_exchange(from.0, to.0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// What a cached denial tells the client (see [`Slot::retry_hint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RetryHint {
    /// The local µs from which the request can succeed, as far as the
    /// store said.
    pub(crate) at: u64,
    /// The cost that answer was for.
    pub(crate) cost: u64,
}

impl Slot {
    /// Until when (local µs) the last denial stored lasts, whatever said
    /// it and whether or not it still stands (`None`: none stored).
    pub(crate) fn denied_until(&self) -> Option<u64> {
        self.denied_until.load().until()
    }

    /// Until when (local µs) the key is known exhausted, if it is at `now`:
    /// the store's answer to an ask that got nothing, or a peek's that
    /// found the window full, if the slot ran out soon enough after it
    /// (see `peek_trust`). A peek too old to deny on is forgotten, so the
    /// slot asks: permits given back meanwhile are found. (Forgetting a
    /// peek never erases an ask's answer stored meanwhile, whatever its
    /// time: see [`Denial`].)
    pub(crate) fn denied(&self, now: u64) -> Option<u64> {
        let denial = self.denied_until.load();
        let until = denial.until().filter(|&until| now < until)?;
        if !denial.is_peek() {
            return Some(until);
        }
        let trust = self.peek_trust.load(Ordering::Acquire);
        if now < trust && now < self.deadline.load(Ordering::Acquire) {
            // Run out while the peek is fresh: as good as an ask now.
            let asked = Denial::asked(until);
            self.denied_until.replace(denial, asked);
            return asked.until();
        }
        self.denied_until.replace(denial, Denial::NONE);
        None
    }

    /// Forgets the denial cached, if any: the next request asks the store.
    pub(crate) fn forget_denial(&self) {
        self.deny_for(0, 0, 1);
    }

    /// A definitive denial (an ask's answer) until `until`.
    pub(crate) fn deny_until(&self, until: u64) {
        self.deny_for(until, until, 1);
    }

    /// An ask's denial that holds until `retry` (what the client is told),
    /// cached only until `recheck` (no later than `retry`): the store is
    /// asked again then, for permits an idle holder may have given back.
    /// The store's answer was for a request of `cost`.
    pub(crate) fn deny_for(&self, recheck: u64, retry: u64, cost: u64) {
        self.hint_cost
            .store(cost.clamp(1, u64::from(u32::MAX)) as u32, Ordering::Release);
        let denial = Denial::asked(recheck.min(retry));
        let later_ms = retry
            .saturating_sub(denial.until().unwrap_or(0))
            .div_ceil(1_000);
        // The hint first: a request that sees the denial sees its hint.
        self.retry_later_ms
            .store(later_ms.min(u64::from(u32::MAX)) as u32, Ordering::Release);
        self.denied_until.store(denial);
    }

    /// What a denial cached until `until` tells the client.
    pub(crate) fn retry_hint(&self, until: u64) -> RetryHint {
        let later = u64::from(self.retry_later_ms.load(Ordering::Acquire));
        RetryHint {
            at: until.saturating_add(later * 1_000),
            cost: u64::from(self.hint_cost.load(Ordering::Acquire)),
        }
    }

    /// A peek's denial until `until`, believed until `trust` (see
    /// [`denied`](Slot::denied)).
    pub(crate) fn deny_on_peek(&self, until: u64, trust: u64) {
        // The trust first: a request that sees the denial sees its trust.
        self.peek_trust.store(trust, Ordering::Release);
        self.retry_later_ms.store(0, Ordering::Release);
        self.denied_until.store(Denial::peeked(until));
    }
}
