//! A limiter's waiters, per key, in arrival order (see
//! [`Limiter::acquire`](crate::Limiter::acquire)): only the head of a
//! key's queue asks and sleeps. A waiter holds one thing across its
//! sleeps, its place in its key's queue ([`Turn`]), which goes when its
//! future is dropped.

use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

use crate::decision::Decision;

/// A limiter's waiters, per key, served in arrival order: only the head
/// of a key's queue asks the store and sleeps; the others wait for their
/// turn. Keys without waiters have no entry.
#[derive(Default)]
pub(crate) struct Queues {
    map: DashMap<Box<str>, Arc<Queue>, ahash::RandomState>,
}

#[derive(Default)]
struct Queue {
    /// Held by the head; tokio's mutex hands it on in the order of the
    /// `lock` calls, so the queue is first come, first served.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The last denial the queue's head saw: the answer of a waiter whose
    /// wait ran out before its turn came, which does not ask (asking
    /// could take a permit ahead of the waiters before it). The one
    /// exception: a head that has not been answered yet (a wait shorter
    /// than its first check) leaves nothing to return, and that waiter
    /// asks once.
    last: Mutex<Option<Decision>>,
}

/// A waiter's place: its queue's head while `guard` is held. Dropped, it
/// leaves the queue, and the queue's entry goes with its last waiter.
pub(crate) struct Turn<'a> {
    queues: &'a Queues,
    key: &'a str,
    queue: Option<Arc<Queue>>,
    guard: Option<OwnedMutexGuard<()>>,
    /// It waited behind another before its turn came.
    waited: bool,
}

impl Queues {
    /// Joins `key`'s queue and waits for its turn until `deadline`; `Err`
    /// with the head's last denial (if any) when the deadline came first.
    /// A turn that was not free at once is a wait, counted in `waits`, and
    /// one that never came a wait that ran out.
    pub(crate) async fn join<'a>(
        &'a self,
        key: &'a str,
        deadline: Instant,
        counters: &crate::stats::Counters,
    ) -> Result<Turn<'a>, Option<Decision>> {
        let queue = self.map.entry(Box::from(key)).or_default().clone();
        let lock = queue.turn.clone();
        // Built before the first await, so a dropped future leaves too;
        // the turn holds the queue's only clone outside the map, so the
        // last waiter to leave finds the entry's count at one.
        let mut turn = Turn {
            queues: self,
            key,
            queue: Some(queue),
            guard: None,
            waited: false,
        };
        if let Ok(guard) = lock.clone().try_lock_owned() {
            turn.guard = Some(guard);
            return Ok(turn);
        }
        counters.acquire_waits.add(1);
        turn.waited = true;
        match tokio::time::timeout_at(deadline, lock.lock_owned()).await {
            Ok(guard) => {
                turn.guard = Some(guard);
                Ok(turn)
            }
            Err(_) => {
                counters.acquire_timeouts.add(1);
                Err(turn.last_denial())
            }
        }
    }

    /// Keys with a queue (for tests: none once every waiter left).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

impl Turn<'_> {
    /// Whether it waited behind another before its turn came.
    pub(crate) fn waited(&self) -> bool {
        self.waited
    }

    /// The last denial the queue's head saw.
    pub(crate) fn last_denial(&self) -> Option<Decision> {
        let queue = self.queue.as_ref()?;
        queue.last.lock().ok().and_then(|last| last.clone())
    }

    /// Records a denial the head saw, for those whose wait runs out
    /// behind it.
    pub(crate) fn saw(&self, decision: &Decision) {
        if let Some(queue) = &self.queue {
            if let Ok(mut last) = queue.last.lock() {
                *last = Some(decision.clone());
            }
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.guard.take();
        self.queue.take();
        // Clones are made only under the map's shard lock, so a count of
        // one (the map's own) there means no waiter is left.
        self.queues
            .map
            .remove_if(self.key, |_, queue| Arc::strong_count(queue) == 1);
    }
}
