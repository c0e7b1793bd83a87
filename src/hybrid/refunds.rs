//! Refunds that go back locally: into the lease a permit came from, or
//! into credit not yet reported, each at most once.

use std::collections::{HashMap, VecDeque};

use super::HybridEngine;
use crate::algorithm::Refunded;
use crate::decision::{Taken, TakenFrom};
use crate::error::Error;

/// Admissions refunded that could go back locally, and where each went,
/// each kept until the lease or credit it could go back into has surely
/// ended: a second refund of one must not go back locally again (the
/// debt or lease it would go into may hold others' permits by then).
#[derive(Default)]
pub(crate) struct LocalRefunds {
    /// Admission → (local µs after which it is forgotten, where it went).
    seen: HashMap<u64, (u64, Went)>,
    /// The same admissions in the order they were recorded, with their
    /// ends: forgotten from the front, a few at each record (a scan of
    /// the whole map at each record, once it was half full, took a
    /// settlement tens of microseconds and cooled the caches of the
    /// decisions around it: a reservation's p50 went from 120 to 450 ns).
    order: VecDeque<(u64, u64)>,
}

/// Where a refund that could go back locally went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Went {
    /// Into the lease or the unreported debt: a repeat gives nothing.
    Local,
    /// To the store (its credit was reported): a repeat goes there too,
    /// and the store knows the admission's identity.
    Store,
}

/// The most local refunds remembered at once; past it, a refund that
/// would go back locally is ignored (and counted) instead.
const MAX_LOCAL_REFUNDS: usize = 65_536;

impl LocalRefunds {
    /// Where an earlier refund of `seq` went, if one did; else records
    /// that this one goes `went`. `Some(Local)` too when there is no room
    /// to remember it (nothing goes back then).
    fn route(&mut self, seq: u64, now: u64, until: u64, went: Went) -> Option<Went> {
        while let Some(&(end, old)) = self.order.front() {
            if end > now {
                break;
            }
            self.order.pop_front();
            if self.seen.get(&old).is_some_and(|&(e, _)| e == end) {
                self.seen.remove(&old);
            }
        }
        if let Some(&(_, before)) = self.seen.get(&seq) {
            return Some(before);
        }
        if self.seen.len() >= MAX_LOCAL_REFUNDS {
            return Some(Went::Local);
        }
        self.seen.insert(seq, (until, went));
        self.order.push_back((until, seq));
        None
    }

    fn set(&mut self, seq: u64, went: Went) {
        if let Some(entry) = self.seen.get_mut(&seq) {
            entry.1 = went;
        }
    }
}

impl HybridEngine {
    /// Until when a local refund is remembered: past the lease or credit
    /// it could go back into.
    fn local_refund_horizon(&self, now: u64) -> u64 {
        let s = &*self.shared;
        // A window lease's take goes back only into that window's lease,
        // which ends within a period of the take (and of any refund after
        // it); a bucket lease's, into the lease it came from.
        let window = if s.leases.windowed() {
            s.params.period_us
        } else {
            0
        };
        now + s.config.load().lease_ttl.as_micros() as u64 + window + 1_000_000
    }

    /// Gives `taken` back into the lease (or credit) it came from, once
    /// per admission, with no store call: `Some(permits)` when it went
    /// there (0: it had gone back before), `None` when it must go to the
    /// store (the lease is gone, or an earlier refund went there). For a
    /// settlement made at once (`Reservation::settle`); a later
    /// `Limiter::refund` of the same admission then gives nothing.
    pub(crate) fn give_back_once(&self, key: &str, taken: Taken) -> Option<u64> {
        if !matches!(taken.origin, TakenFrom::Lease | TakenFrom::Credit) {
            return None;
        }
        let now = self.shared.time.precise_us();
        let until = self.local_refund_horizon(now);
        let mut refunds = self.local_refunds.lock().unwrap_or_else(|p| p.into_inner());
        match refunds.route(taken.seq, now, until, Went::Local) {
            Some(Went::Local) => Some(0),
            Some(Went::Store) => None,
            None if self.untake(key, taken) => Some(taken.cost),
            None => {
                refunds.set(taken.seq, Went::Store);
                None
            }
        }
    }

    /// Puts back what `taken` took locally: permits into the lease they
    /// were spent from, if this process still holds it, or credit into
    /// the debt not yet reported (no store call); `false` otherwise.
    pub(crate) fn untake(&self, key: &str, taken: Taken) -> bool {
        let s = &*self.shared;
        if taken.engine != s.tag {
            return false;
        }
        let Some(holding) = s.holdings.get(key).map(|e| e.value().clone()) else {
            return false;
        };
        match taken.origin {
            TakenFrom::Lease if s.leases.windowed() => taken
                .window()
                .is_some_and(|window| holding.untake(window, taken.cost, s.time.precise_us())),
            // A bucket's permits go back only into the lease they were
            // taken from: one applied after the take was granted with the
            // bucket's level then, and a take from an earlier lease going
            // into it would be a permit the bucket never had.
            TakenFrom::Lease => {
                let Some(taken_at) = taken.leased_at_us() else {
                    return false;
                };
                holding.books().granted_at() <= taken_at
                    && holding.untake(0, taken.cost, s.time.precise_us())
            }
            TakenFrom::Credit => taken
                .window()
                .is_some_and(|window| holding.untake_credit(window, taken.cost)),
            _ => false,
        }
    }

    /// Gives `taken` back, once per admission however often it is sent.
    ///
    /// A window's permits go to the store's count of their window, which
    /// takes them only while the window lasts (the refund carries the
    /// admission's identity); not into the local lease, which would take
    /// them back again on every call. A bucket lease's permits have no
    /// window to go to: they go back into the lease while it lasts, and
    /// credit into the debt not yet reported (else, for a window, to its
    /// count), each admission once (remembered here). Returns the permits
    /// taken back, or that the admission was refunded before.
    pub(crate) async fn refund(&self, key: &str, taken: Taken) -> Result<Refunded, Error> {
        let s = &*self.shared;
        let windowed = s.leases.windowed();
        let local = match taken.origin {
            TakenFrom::Lease => !windowed,
            TakenFrom::Credit => true,
            _ => false,
        };
        // Taken by another engine (a lane of another tier): nothing of it
        // is here to go back into.
        if local && taken.engine != s.tag && (taken.origin != TakenFrom::Credit || !windowed) {
            return Ok(Refunded::Now(0));
        }
        if local {
            let now = s.time.precise_us();
            let until = self.local_refund_horizon(now);
            let mut refunds = self.local_refunds.lock().unwrap_or_else(|p| p.into_inner());
            match refunds.route(taken.seq, now, until, Went::Local) {
                // (What the first took back is not kept: none is told.)
                Some(Went::Local) => return Ok(Refunded::Already(0)),
                Some(Went::Store) => {}
                None => {
                    if self.untake(key, taken) {
                        return Ok(Refunded::Now(taken.cost));
                    }
                    // Credit already reported counts in its window; the
                    // rest has nowhere to go.
                    if taken.origin != TakenFrom::Credit || !windowed {
                        return Ok(Refunded::Now(0));
                    }
                    refunds.set(taken.seq, Went::Store);
                }
            }
        }
        if taken.origin == TakenFrom::Lease && windowed {
            // A window's permits go to the store, unless a settlement put
            // them back into the lease already (`give_back_once`): then
            // they went, once.
            let now = s.time.precise_us();
            let until = self.local_refund_horizon(now);
            let mut refunds = self.local_refunds.lock().unwrap_or_else(|p| p.into_inner());
            if refunds.route(taken.seq, now, until, Went::Store) == Some(Went::Local) {
                return Ok(Refunded::Already(0));
            }
        }
        let back = s.exact.refund(key, taken).await?;
        if back.now() > 0 {
            // The store has room again: a key known exhausted asks anew.
            if let Some(holding) = self.shared.holdings.get(key) {
                holding.forget_denial();
            }
        }
        Ok(back)
    }
}
