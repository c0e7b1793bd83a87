//! A slot's bookkeeping, behind its `books` lock: credit, the window
//! closed to credit, sizing, a bucket lease's origin, a lost lease's
//! identity, and the once-per-window marks. Each change is a method.

use super::credit::Credit;
use super::MaybeWindow;
use crate::algorithm::LeaseOrigin;
use crate::hybrid::policy::Sizing;

/// A slot's slow-path bookkeeping.
#[derive(Debug)]
pub(crate) struct Books {
    /// Optimistic mode: credit admitted, not yet reported.
    pub(super) credit: Credit,
    /// Fixed window: no credit in this window or earlier. Set once the
    /// store reports debt it could not cover, so each process overshoots a
    /// window by at most `max_debt`, whatever else the reply granted.
    /// (None: no window closed yet.)
    pub(super) credit_closed: MaybeWindow,
    /// Lease sizing: the policy's state of the key (its rate, what it
    /// spent), updated by the sync task and by a promotion.
    pub(crate) sizing: Sizing,
    /// Token bucket, GCRA: where the permits held came from, for the
    /// give-back of those left unused.
    pub(super) origin: LeaseOrigin,
    /// Fixed window: the identity of a lease whose reply was lost (0:
    /// none). The next lease is sent under it, so the store hands back
    /// what it granted then instead of counting a second grant.
    pub(super) lost_lease: u64,
    /// Fixed window: the boundary a pre-lease was last asked for (local
    /// µs ÷ period, wrapping), so it is asked once per window.
    pub(super) ahead_asked: u32,
    /// Fixed and sliding window: the last window the store said had no
    /// permit left to lease (its index, wrapping). Until it ends, a waiter
    /// holding the next window's pre-lease waits for it instead of asking
    /// again.
    pub(super) used_up: u32,
}

impl Books {
    /// The debt to report with a lease call being sent, moved in flight
    /// (settled by `Slot::credit_settled` when the reply comes back).
    pub(crate) fn send_credit(&mut self) -> Credit {
        let sent = Credit {
            debt: self.credit.debt,
            window: self.credit.window,
            in_flight: 0,
            recalled: 0,
        };
        self.credit.in_flight += self.credit.debt;
        self.credit.debt = 0;
        sent
    }

    /// No credit in `window` or earlier: the store reported debt there it
    /// could not cover.
    pub(crate) fn close_credit_through(&mut self, window: i64) {
        let closed = self.credit_closed.get().map_or(window, |c| c.max(window));
        self.credit_closed = MaybeWindow::of(closed);
    }

    /// A lease call's reply was lost: the next lease goes under its
    /// identity (`id`, 0: none).
    pub(crate) fn lose_lease(&mut self, id: u64) {
        if id != 0 {
            self.lost_lease = id;
        }
    }

    /// The identity of a lease whose reply was lost, once (0: none).
    pub(crate) fn take_lost_lease(&mut self) -> u64 {
        std::mem::take(&mut self.lost_lease)
    }

    /// Whether the next window's pre-lease, at `boundary`, is asked for
    /// now: once per boundary.
    pub(crate) fn ask_ahead_once(&mut self, boundary: u32) -> bool {
        let first = self.ahead_asked != boundary;
        self.ahead_asked = boundary;
        first
    }

    /// The store said `window` had no permit left to lease.
    pub(crate) fn mark_used_up(&mut self, window: i64) {
        self.used_up = window as u32;
    }

    /// Whether the store said `window` had no permit left to lease.
    pub(crate) fn used_up(&self, window: i64) -> bool {
        self.used_up == window as u32
    }

    /// Where the permits held came from (buckets).
    pub(crate) fn origin(&self) -> LeaseOrigin {
        self.origin
    }

    /// Permits of a new lease from `origin` are in place (`added`: to
    /// permits still held, which then answer to both origins).
    pub(crate) fn set_origin(&mut self, origin: LeaseOrigin, added: bool) {
        self.origin = if added {
            self.origin.merge(origin)
        } else {
            origin
        };
    }
}
