//! The sync task: where the hybrid limiter leases, reports and gives back.
//! (The request path calls the store itself only to decide a key by one
//! exact call when it cannot hold a slot, and to refund what no lease
//! takes back.)
//!
//! Woken when a slot runs low, it drains the refill queue, sizes each
//! lease, and sends many keys' leases in one pipelined round trip; it also
//! gives back unused permits, reports debt, expires and evicts slots. It
//! never blocks the request path: slots are updated with atomics and the
//! few locks are held only between awaits.

mod maintain;
mod reply;
mod send;
mod watch;

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::sizing::{thin_want, SizingRule, COVER_MARGIN, SEED_PERMITS, THIN_AHEAD_CAP_DIVISOR};
use super::slot::{Credit, Installed, NextLease, Slot};
use futures_util::future::join_all;

use super::{Ablation, HybridConfig, Shared};
use crate::algorithm::{
    LeaseCall, LeaseKind, LeaseOrigin, LeaseReply, LeaseTarget, LeaseView, OpId, MAX_REPORT,
};
use crate::error::Error;
use crate::failure::{Report, RESEND_FOR};

use maintain::*;
use reply::*;
use send::*;
use watch::*;

pub(crate) use maintain::{maintain, SWEEP_SLICES};
pub(crate) use send::{give_back_all, round, RefillQueue};
#[cfg(test)]
pub(crate) use watch::{note_ahead, RIDE_SCAN_ALWAYS};
pub(crate) use watch::{Ahead, Watched};

/// Local clocks are assumed to run within this many parts per million of
/// Redis' clock (NTP keeps servers within tens of ppm; an undisciplined
/// crystal is within ±100). A deadline projected `d` µs ahead from a
/// Redis reply is brought forward by `d × MAX_DRIFT_PPM / 10^6`, so a
/// window-W permit is never spent after Redis ended W.
pub(crate) const MAX_DRIFT_PPM: u64 = 500;

/// The drift allowance for a deadline `ahead_us` in the future.
pub(crate) fn drift_us(ahead_us: u64) -> u64 {
    ahead_us / (1_000_000 / MAX_DRIFT_PPM)
}

/// Debt to report on its own (an evicted slot's, or one whose lease call
/// failed), under the identity it was first sent with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DebtReport {
    pub(crate) key: String,
    pub(crate) debt: u64,
    /// Fixed window: the window the debt was admitted in.
    pub(crate) window: i64,
    pub(crate) op: OpId,
    /// Deliveries that found the store unavailable, for the back-off.
    pub(crate) attempts: u32,
    /// Local µs before which it is not resent.
    pub(crate) not_before: u64,
    /// When it was first sent (see `RESEND_FOR`).
    pub(crate) first_sent: Option<u64>,
}

/// The back-off of a report the store could not take: 50 ms doubling to
/// at most 5 s.
fn backoff_us(attempts: u32) -> u64 {
    (50_000u64 << attempts.min(7)).min(5_000_000)
}

/// How often expiry, idle eviction and `max_keys` are enforced.
pub(crate) const MAINTENANCE: Duration = Duration::from_millis(100);

/// Clears `Shared::alive` however the sync task ends: returning, a panic
/// unwinding through it, or its runtime dropping it.
struct Alive<'a>(&'a Shared);

impl Drop for Alive<'_> {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
    }
}

pub(crate) async fn run(shared: Arc<Shared>) {
    let _alive = Alive(&shared);
    let mut maintenance = tokio::time::interval(MAINTENANCE);
    maintenance.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sweep = 0;
    // The last round stopped with work left (see `BATCHES_PER_ROUND`).
    let mut more = false;
    loop {
        let woken = if more {
            // Maintenance first if it is due, then straight on.
            tokio::select! {
                biased;
                _ = maintenance.tick() => sweep = tick(&shared, sweep),
                _ = tokio::task::yield_now() => {}
            }
            false
        } else {
            tokio::select! {
                _ = shared.wake.notified() => true,
                _ = maintenance.tick() => {
                    sweep = tick(&shared, sweep);
                    false
                }
            }
        };
        if woken && !shared.urgent.load(Ordering::Acquire) {
            // Nobody waits yet: let refills of other keys join this batch.
            let until = tokio::time::Instant::now() + shared.config.load().coalesce;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    _ = shared.wake.notified() => {
                        if shared.urgent.load(Ordering::Acquire) || shared.stopping.load(Ordering::Acquire) {
                            break;
                        }
                    }
                }
            }
        }
        if shared.stopping.load(Ordering::Acquire) {
            // Dropped without `shutdown`: do its work here, so unused
            // permits go back and debt is reported all the same.
            // (`shutdown` closes the limiter first and finishes itself.)
            if !shared.closed.load(Ordering::Acquire) {
                shared.finish().await;
            }
            return;
        }
        more = round(&shared).await;
    }
}

/// One maintenance tick: the next slice of the sweep.
fn tick(shared: &Shared, sweep: usize) -> usize {
    maintain(shared, Some(sweep % SWEEP_SLICES));
    sweep.wrapping_add(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_boundary_is_found_from_any_known_window_end() {
        assert_eq!(next_boundary(0, 5, 10), None);
        for known in [3, 13, 23, 103] {
            assert_eq!(next_boundary(known, 5, 10), Some(13), "{known}");
            assert_eq!(next_boundary(known, 13, 10), Some(23), "{known}");
            assert_eq!(next_boundary(known, 12, 10), Some(13), "{known}");
        }
    }

    fn slot(name: &str) -> Arc<Slot> {
        Arc::new(Slot::new(Arc::from(name), 0))
    }

    /// Queues `slot` the way `request_refill` does.
    fn queue(q: &mut RefillQueue, slot: &Arc<Slot>, waiting: bool) {
        if slot.enqueue(waiting) {
            q.push(slot.clone(), waiting);
        }
    }

    fn name(slot: Option<Arc<Slot>>) -> Option<String> {
        slot.map(|s| s.key().to_string())
    }

    #[test]
    fn waiters_go_first_and_a_promoted_refill_is_sent_once() {
        let mut q = RefillQueue::default();
        let (a, b, c, x) = (slot("a"), slot("b"), slot("c"), slot("x"));
        queue(&mut q, &a, false);
        queue(&mut q, &b, false);
        queue(&mut q, &c, false);
        queue(&mut q, &x, true);
        // b was queued ahead of need; a request now waits on it.
        queue(&mut q, &b, true);
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("x"));
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("b"));
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("a"));
        // b's first entry is a duplicate: skipped while it is in flight.
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("c"));
        assert!(q.pop(0, 1_000).is_none());
        // Settled and queued again: one entry, sent once.
        b.refill_done();
        queue(&mut q, &b, false);
        queue(&mut q, &b, true);
        assert_eq!(name(q.pop(0, 1_000)).as_deref(), Some("b"));
        assert!(q.pop(0, 1_000).is_none());
        // A waiter on a refill already in flight adds nothing.
        queue(&mut q, &b, true);
        assert!(q.pop(0, 1_000).is_none());
    }

    #[test]
    fn a_stale_entry_does_not_send_a_settled_refill() {
        let mut q = RefillQueue::default();
        let a = slot("a");
        queue(&mut q, &a, false);
        queue(&mut q, &a, true);
        assert!(q.pop(0, 1_000).is_some());
        a.refill_done();
        // The other entry is left over from the settled refill.
        assert!(q.pop(0, 1_000).is_none());
    }
}
