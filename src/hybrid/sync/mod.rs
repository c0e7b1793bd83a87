//! The sync task: where the hybrid limiter leases, reports and gives back.
//! (The request path calls the store itself only to decide a key by one
//! exact call when it cannot hold a holding, and to refund what no lease
//! takes back.)
//!
//! Woken when a holding runs low, it drains the refill queue, sizes each
//! lease, and sends many keys' leases in one pipelined round trip; it also
//! gives back unused permits, reports debt, expires and evicts holdings. It
//! never blocks the request path: holdings are updated with atomics and the
//! few locks are held only between awaits.

mod give_back;
mod maintain;
mod reply;
mod send;
mod watch;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;

pub(crate) use give_back::give_back_all;
pub(crate) use maintain::{maintain, SWEEP_SLICES};
pub(crate) use send::round;
#[cfg(test)]
pub(crate) use watch::{note_ahead, RIDE_SCAN_ALWAYS};

/// The last work of a limiter: every holding retired (unused permits given
/// back, debt reported), waiters woken to decide by one store call,
/// one last round. Bounded: each batch by the store's timeout, and the
/// breaker refuses the rest once it opens. What the store cannot take
/// even now is counted as dropped, not lost silently.
pub(crate) async fn finish(shared: &Shared) {
    shared.life.closed.store(true, Ordering::Release);
    let now = shared.time.precise_us();
    let keys: Vec<Arc<str>> = shared.holdings.iter().map(|e| e.key().clone()).collect();
    for key in keys {
        if let Some((_, holding)) = shared.holdings.remove(&key) {
            shared.retire(&holding, now);
        }
    }
    for stripe in shared.refill_waiters.iter() {
        stripe.notify_waiters();
    }
    round(shared).await;
    let debt: u64 = std::mem::take(
        &mut *shared
            .outbox
            .reports
            .lock()
            .unwrap_or_else(|p| p.into_inner()),
    )
    .iter()
    .map(|r| r.permits)
    .sum();
    shared.debt_dropped(debt);
    let fallback: u64 = shared.reconciler.drain().iter().map(|r| r.permits).sum();
    shared.counters.reports_dropped.add(fallback);
    shared.counters.meters.local_keys.set(0.0);
}

/// How often expiry, idle eviction and `max_keys` are enforced.
pub(crate) const MAINTENANCE: Duration = Duration::from_millis(100);

/// Clears `Life::alive` however the sync task ends: returning, a panic
/// unwinding through it, or its runtime dropping it — also before it
/// was first polled (a runtime dropped right after the spawn), which is
/// why it is made before the task's future and moved into it.
struct Alive(Arc<Shared>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.life.alive.store(false, Ordering::Release);
    }
}

/// The sync task of `shared`, to spawn.
pub(crate) fn task(shared: Arc<Shared>) -> impl std::future::Future<Output = ()> + Send {
    run(Alive(shared))
}

async fn run(alive: Alive) {
    let shared = &alive.0;
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
                _ = maintenance.tick() => sweep = tick(shared, sweep),
                _ = tokio::task::yield_now() => {}
            }
            false
        } else {
            // `biased`: the branches are polled in order, so a run on a
            // paused clock replays the same way (see the seeded searches).
            tokio::select! {
                biased;
                _ = shared.outbox.wake.notified() => true,
                _ = maintenance.tick() => {
                    sweep = tick(shared, sweep);
                    false
                }
            }
        };
        if woken && !shared.outbox.urgent.load(Ordering::Acquire) {
            // Nobody waits yet: let refills of other keys join this batch.
            let until = tokio::time::Instant::now() + shared.config.load().coalesce;
            loop {
                tokio::select! {
                    biased;
                    _ = tokio::time::sleep_until(until) => break,
                    _ = shared.outbox.wake.notified() => {
                        if shared.outbox.urgent.load(Ordering::Acquire) || shared.life.stopping.load(Ordering::Acquire) {
                            break;
                        }
                    }
                }
            }
        }
        if shared.life.stopping.load(Ordering::Acquire) {
            // Dropped without `shutdown`: do its work here, so unused
            // permits go back and debt is reported all the same.
            // (`shutdown` closes the limiter first and finishes itself.)
            if !shared.life.closed.load(Ordering::Acquire) {
                finish(shared).await;
            }
            return;
        }
        more = round(shared).await;
    }
}

/// One maintenance tick: the next slice of the sweep.
fn tick(shared: &Shared, sweep: usize) -> usize {
    maintain(shared, Some(sweep % SWEEP_SLICES));
    sweep.wrapping_add(1)
}

#[cfg(test)]
mod tests {
    use super::maintain::next_boundary;

    #[test]
    fn the_next_boundary_is_found_from_any_known_window_end() {
        assert_eq!(next_boundary(0, 5, 10), None);
        for known in [3, 13, 23, 103] {
            assert_eq!(next_boundary(known, 5, 10), Some(13), "{known}");
            assert_eq!(next_boundary(known, 13, 10), Some(23), "{known}");
            assert_eq!(next_boundary(known, 12, 10), Some(13), "{known}");
        }
    }
}
