//! What the request path, refunds and maintenance hand the sync task:
//! refills to send, permits to give back, debt to report. Filled from
//! anywhere in the engine; drained only by the sync task (`sync::round`).

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::holding::Holding;
use crate::algorithm::GiveBackCall;
use crate::failure::Report;

/// The sync task's work, and how it is woken for it.
pub(crate) struct Outbox {
    /// Holdings waiting for a refill, those with a request waiting first.
    pub(super) refills: Mutex<RefillQueue>,
    /// Permits to give back in the next round.
    pub(super) returns: Mutex<Vec<GiveBackCall>>,
    /// Debt of evicted holdings (or of lease calls whose reply was lost) to
    /// report, each under the identity it was first sent with (store
    /// keys; see `failure::Report`).
    pub(super) reports: Mutex<Vec<Report>>,
    /// A queued refill has a request waiting on it: no coalescing delay.
    pub(super) urgent: AtomicBool,
    /// Wakes the sync task.
    pub(super) wake: Notify,
}

impl Outbox {
    /// The permits queued to go back.
    pub(super) fn returns(&self) -> std::sync::MutexGuard<'_, Vec<GiveBackCall>> {
        self.returns.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn new() -> Self {
        Outbox {
            refills: Mutex::new(RefillQueue::default()),
            returns: Mutex::new(Vec::new()),
            reports: Mutex::new(Vec::new()),
            urgent: AtomicBool::new(false),
            wake: Notify::new(),
        }
    }
}

/// Refills waiting to be sent. Waiters first: a holding a request waits on
/// goes before one refilled ahead of need (low water, pre-lease). A holding
/// waited on while queued (`Refill::Waited`) has an entry in both; the
/// first taken wins and the other is skipped as a duplicate.
#[derive(Default)]
pub(crate) struct RefillQueue {
    waiting: VecDeque<Arc<Holding>>,
    ahead: VecDeque<Arc<Holding>>,
}

impl RefillQueue {
    pub(crate) fn push(&mut self, holding: Arc<Holding>, waiting: bool) {
        if waiting {
            self.waiting.push_back(holding);
        } else {
            self.ahead.push_back(holding);
        }
    }

    /// Whether a refill somebody waits for is queued.
    pub(crate) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The next refill to send, marked in flight. A waiters' entry whose
    /// holding was last used more than `max_wait_ms` ago has nobody waiting
    /// any more (they were denied at `max_wait`): it moves behind the
    /// waiters still in time, so an overload serves those it can still
    /// serve instead of those already turned away.
    pub(crate) fn pop(&mut self, now: u64, max_wait_ms: u64) -> Option<Arc<Holding>> {
        loop {
            let holding = match self.waiting.pop_front() {
                Some(holding) if holding.idle_ms(now) > max_wait_ms => {
                    self.ahead.push_back(holding);
                    continue;
                }
                Some(holding) => holding,
                None => self.ahead.pop_front()?,
            };
            // A duplicate: already sent, or settled since it was queued.
            if holding.send_queued() {
                return Some(holding);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(name: &str) -> Arc<Holding> {
        Arc::new(Holding::new(Arc::from(name), 0))
    }

    /// Queues `holding` the way `request_refill` does.
    fn queue(q: &mut RefillQueue, holding: &Arc<Holding>, waiting: bool) {
        if holding.enqueue(waiting) {
            q.push(holding.clone(), waiting);
        }
    }

    fn name(holding: Option<Arc<Holding>>) -> Option<String> {
        holding.map(|s| s.key().to_string())
    }

    #[test]
    fn waiters_go_first_and_a_refill_waited_on_is_sent_once() {
        let mut q = RefillQueue::default();
        let (a, b, c, x) = (holding("a"), holding("b"), holding("c"), holding("x"));
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
        let a = holding("a");
        queue(&mut q, &a, false);
        queue(&mut q, &a, true);
        assert!(q.pop(0, 1_000).is_some());
        a.refill_done();
        // The other entry is left over from the settled refill.
        assert!(q.pop(0, 1_000).is_none());
    }
}
