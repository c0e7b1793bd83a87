//! The hybrid limiter: leased slices of each key's budget, decided locally.
//!
//! The fast path (`HybridEngine::fast_into`) looks the key up in a
//! `DashMap` (or the thread's cache), spends a permit with one
//! compare-and-swap and writes the decision where the caller keeps it;
//! the slow path (`HybridEngine::check`) waits, bounded by `max_wait`, for
//! the sync task, which it wakes when a holding runs low. No lock is held
//! across an await.
//!
//! Files: this one (the engine: its start, the slow path, its life),
//! `fast` (the request path's fast half), `config` (tunables and the
//! measurement switches), `policy` (the
//! lease policy as arithmetic: sizing, refill marks, timing, and its
//! constants), `shared` (what the request path and the sync task share),
//! `outbox` (what the sync task is handed, and its wake), `watchlist`
//! (what the sync task watches between rounds), `holding/` (one
//! key's state: its atomics, refill state, pre-lease and credit),
//! `thread_cache` (the per-thread holding cache), `refunds` (refunds that go
//! back locally), `sync/` (the background task: rounds, replies, peeks
//! and rides, maintenance, the last round at shutdown).

mod config;
mod fast;
mod holding;
mod outbox;
mod policy;
mod refunds;
mod shared;
mod sync;
mod thread_cache;
mod watchlist;

pub(crate) use self::config::Ablation;
pub use self::config::{Consistency, HybridConfig};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use self::holding::{Holding, Take};
use self::outbox::Outbox;
pub(crate) use self::refunds::LocalRefunds;
use self::shared::{Life, Shared, REFILL_STRIPES};
use crate::algorithm::{OpIds, Params};
use crate::clock::TimeSource;
use crate::decision::Decision;
use crate::decision::Source;
use crate::decision::{Taken, TakenFrom};
use crate::error::{Error, ErrorKind};
use crate::exact::ExactEngine;
use crate::failure::Reconciler;
use crate::key::KeyEncoder;
use crate::stats::Counters;
use crate::store::Store;

/// Stops the sync task when the last limiter clone is dropped.
struct StopGuard(Arc<Shared>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.0.life.stopping.store(true, Ordering::Release);
        self.0.outbox.wake.notify_one();
    }
}

/// What a hybrid engine is built from, besides its configuration.
pub(crate) struct Wiring {
    /// The limiter deciding through this engine (`Quotas::id`).
    pub(crate) limiter: u32,
    pub(crate) store: Store,
    pub(crate) keys: KeyEncoder,
    pub(crate) params: Params,
    /// An injected clock; `None` for the system's (coarse) clock.
    pub(crate) clock: Option<Arc<dyn crate::clock::Clock>>,
    /// A fast clock lagging `clock` by up to the duration (simulation).
    pub(crate) fast_clock: Option<(Arc<dyn crate::clock::Clock>, Duration)>,
    pub(crate) counters: Arc<Counters>,
    /// The largest cost that can ever be admitted.
    pub(crate) max_cost: u64,
    pub(crate) reconciler: Arc<Reconciler>,
    /// The fallback's clock, kept on the store's time by lease replies.
    pub(crate) store_clock: Arc<crate::clock::StoreClock>,
    /// Refunds gone back locally, shared by every lane of a limiter: a
    /// key's first quota may be decided by another lane (tiers) when the
    /// same admission is refunded again.
    pub(crate) local_refunds: Arc<Mutex<LocalRefunds>>,
}

pub(crate) struct HybridEngine {
    /// This engine's identity in the per-thread holding caches.
    id: u64,
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Admissions refunded into a local lease or into unreported credit,
    /// so a second refund of one gives nothing more back.
    local_refunds: Arc<Mutex<LocalRefunds>>,
    _guard: StopGuard,
}

/// A tag for this engine in what its leases and credit took, so a take
/// goes back only into the engine it came from (never 0).
fn engine_tag() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed).max(1)
}

impl HybridEngine {
    pub(crate) fn start(config: HybridConfig, wiring: Wiring) -> Result<Self, Error> {
        config.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::new(
                ErrorKind::Unsupported,
                "the hybrid mode runs a background task: build the limiter inside a Tokio runtime",
            )
        })?;
        let Wiring {
            limiter,
            store,
            keys,
            params,
            clock,
            fast_clock,
            counters,
            max_cost,
            reconciler,
            store_clock,
            local_refunds,
        } = wiring;
        let ops = OpIds::default();
        let holder = ops.holder();
        let time = match (fast_clock, clock) {
            (Some((fast, guard)), Some(precise)) => TimeSource::split(fast, precise, guard),
            (_, clock) => TimeSource::new(clock, config.coarse_clock, store_clock.local().clone()),
        };
        let stocks = !config.ablate.off(Ablation::STOCKS);
        let shared = Arc::new(Shared {
            holdings: DashMap::with_hasher(ahash::RandomState::new()),
            config: ArcSwap::from_pointee(config),
            exact: ExactEngine::new(store.clone(), keys.clone(), params, counters.clone()),
            store,
            keys,
            params,
            leases: params.algorithm.spec().leases,
            pre_leases: params.algorithm.spec().pre_leases,
            time,
            counters,
            outbox: Outbox::new(),
            watch: watchlist::Watch::default(),
            outstanding: DashMap::with_hasher(ahash::RandomState::new()),
            ops,
            holder,
            store_clock,
            refill_waiters: (0..REFILL_STRIPES).map(|_| Notify::new()).collect(),
            life: Life {
                alive: AtomicBool::new(true),
                ..Life::default()
            },
            contended: AtomicBool::new(false),
            stocks,
            max_cost,
            tag: engine_tag(),
            limiter,
            rtt_us: AtomicU64::new(0),
            reconciler,
            early_lead_us: AtomicU64::new(0),
            window_end_hint: AtomicU64::new(0),
            #[cfg(test)]
            before_wait: Mutex::new(None),
        });
        shared.set_early_lead(&shared.config.load());
        let task = runtime.spawn(sync::task(shared.clone()));
        Ok(HybridEngine {
            id: thread_cache::engine_id(),
            _guard: StopGuard(shared.clone()),
            shared,
            task: Mutex::new(Some(task)),
            local_refunds,
        })
    }

    /// Replaces the tunables; takes effect for the next refill and the next
    /// slow-path decision.
    pub(crate) fn reconfigure(&self, config: HybridConfig) -> Result<(), Error> {
        config.validate()?;
        self.shared.set_early_lead(&config);
        self.shared.config.store(Arc::new(config));
        Ok(())
    }

    /// Keys tracked locally.
    pub(crate) fn local_keys(&self) -> usize {
        self.shared.holdings.len()
    }

    /// Restarts a sync task that vanished (its runtime was dropped, it
    /// panicked) on the caller's runtime; `false` if there is none, in
    /// which case the caller decides by one store call.
    fn ensure_sync_task(&self) -> bool {
        let s = &*self.shared;
        if s.life.alive.load(Ordering::Acquire) || s.life.stopping.load(Ordering::Acquire) {
            return true;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let mut task = self.task.lock().unwrap_or_else(|p| p.into_inner());
        // Another caller may have restarted it while this one waited.
        if s.life.alive.swap(true, Ordering::AcqRel) {
            return true;
        }
        *task = Some(runtime.spawn(sync::task(self.shared.clone())));
        s.counters.sync_restarts.add(1);
        true
    }

    /// `Err` means "the store could not decide": the caller applies the
    /// failure policy.
    pub(crate) async fn check(&self, key: &str, cost: u64) -> Result<Decision, Error> {
        let s = &*self.shared;
        if !self.ensure_sync_task() {
            return s.exact_check(key, cost).await;
        }
        if cost > s.max_cost {
            return Ok(Decision::deny(
                s.params.limit,
                0,
                Duration::ZERO,
                None,
                Source::Lease,
            ));
        }
        if s.life.closed.load(Ordering::Acquire) {
            return s.exact_check(key, cost).await;
        }
        // The slow path tries the holding's permits first: one code path for
        // everything `fast_into` did not answer.
        let Some(holding) = s.insert(key, s.time.now_us()) else {
            return s.exact_check(key, cost).await;
        };
        self.slow(holding, key, cost).await
    }

    async fn slow(
        &self,
        mut holding: Arc<Holding>,
        key: &str,
        cost: u64,
    ) -> Result<Decision, Error> {
        let s = &*self.shared;
        let config = s.config.load_full();
        let give_up_at = tokio::time::Instant::now() + config.max_wait;
        let mut retried = false;
        let mut asked_for_cost = false;
        // When this waiter last asked while its holding's lease was void.
        let mut asked_void_at: Option<u64> = None;
        loop {
            // The slow path reads the precise clock: it decides credit
            // windows and pre-lease starts, where a lagging clock would err.
            let now = s.time.precise_us();
            if holding.is_evicted() {
                holding = match s.insert(key, now) {
                    Some(holding) => holding,
                    None => return s.exact_check(key, cost).await,
                };
            }
            holding.touch(now, cost);
            // Listening starts before the permits are tried: a refill that
            // lands between the try and the wait is seen, not re-asked for.
            let notified = s.refilled(&holding).notified();
            tokio::pin!(notified);
            if let Some(replaced) = holding.promote(now) {
                s.counters.stranded.add(replaced as u64);
            }
            let mut paid = None;
            match holding.take(cost, &s.time) {
                Take::Taken { left, window, .. } => {
                    return Ok(s.spent(&holding, left, now, cost, window))
                }
                late @ Take::Late { lost, .. } => {
                    s.expired(&holding, lost as u64);
                    paid = late.paid(cost);
                }
                Take::Empty => {}
            }
            // A peek is always answered, never denied: it takes nothing.
            if cost == 0 {
                if holding.window_end() == 0 && holding.denied_until().is_none() {
                    // A cold key: nothing known of it here, so what remains
                    // is the store's to say (one call that takes nothing;
                    // later peeks answer from it).
                    let peek = s.exact_check(key, 0).await?;
                    holding.note_peek(
                        peek.remaining(),
                        now + peek.reset_after().as_micros() as u64,
                    );
                    return Ok(peek);
                }
                return Ok(s.lease_decision(&holding, 0, now, Taken::default()));
            }
            if let Some(decided) = self.across(&holding, cost, now, paid) {
                return Ok(decided);
            }
            if let Some(until) = holding.denied(now) {
                if !asked_for_cost && !s.denial_covers(&holding, until, now, cost) {
                    // The store's wait was for another cost (see
                    // `denial_covers`): asked once for this one.
                    asked_for_cost = true;
                    holding.need_at_least(cost);
                    s.request_refill(&holding, true);
                    let left = give_up_at.saturating_duration_since(tokio::time::Instant::now());
                    let _ = tokio::time::timeout(left, notified).await;
                    continue;
                }
                // Denied until the next window, whose pre-lease is held:
                // worth waiting for if it starts within the wait.
                let left = give_up_at.saturating_duration_since(tokio::time::Instant::now());
                let next_in_time = holding
                    .next_start()
                    .is_some_and(|start| start.saturating_sub(now) < left.as_micros() as u64);
                if !next_in_time {
                    return Ok(s.cached_denial(&holding, until, now, cost));
                }
                let wait = holding
                    .next_start()
                    .unwrap_or(now)
                    .saturating_sub(now)
                    .max(100);
                let _ = tokio::time::timeout(Duration::from_micros(wait), notified).await;
                continue;
            }
            holding.need_at_least(cost);
            #[cfg(test)]
            if let Some(land) = s.before_wait.lock().unwrap().take() {
                land(s, &holding);
            }
            if notified.as_mut().enable() && !retried {
                // A refill (of this holding or one sharing its stripe) was
                // applied since the try: try again before asking for more
                // (once: busy stripes must not keep a waiter from asking).
                retried = true;
                continue;
            }
            // A pre-lease of the next window held: waited for when it
            // starts sooner than a refill could land (two round trips), or
            // when the store said the current window has nothing left.
            // Otherwise the current window is asked: a key under its limit
            // whose local permits ran out (or whose pre-lease came early,
            // as a thin holder's does) is not made to wait for the next
            // window, or denied at `max_wait` before it starts.
            let next_start = holding.next_start();
            let soon = policy::soon_us(s.rtt_us.load(Ordering::Relaxed));
            // (The store's word that the holding's window is used up stands
            // only while that window is surely the current one: a holding
            // whose lease ended a window ago holds a stale one, and once
            // asked nothing, waited `max_wait` on every request and told
            // a round trip.)
            let used_up = now < holding.deadline()
                && holding
                    .window()
                    .is_some_and(|window| holding.books().used_up(window));
            // Once the holding's lease is void (past its deadline, the
            // clock margin before its window ends) a refill may be of the
            // next window only, until the store's window turns: with a
            // slice of it held, asked at most once a `soon` (two waiters
            // near a minute's end once asked on every refill, 38 slices of
            // a tenant's next minute in 7 ms, all into one process).
            let void = now >= holding.deadline() && next_start.is_some();
            let may_ask = !void || asked_void_at.is_none_or(|at| now >= at + soon);
            if may_ask && next_start.is_none_or(|start| start > now + soon && !used_up) {
                if void {
                    asked_void_at = Some(now);
                }
                s.request_refill(&holding, true);
            }
            if holding.refill_failed() {
                return Err(Error::new(
                    ErrorKind::Connection,
                    "the last refill failed and no leased permit is left",
                ));
            }
            if let Consistency::Optimistic { max_debt } = config.consistency {
                if let Some(window) = s.try_credit(&holding, cost, now, max_debt) {
                    return Ok(Decision::allow(
                        s.params.limit,
                        0,
                        s.reset_after(&holding, now),
                        Source::Credit,
                    )
                    .with_taken(Taken::new(TakenFrom::Credit, cost, Some(window)).by(s.tag)));
                }
            }
            let left = give_up_at.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                // Nothing came within the wait: permits surely exist here
                // from the start of a pre-lease held, else a refill may
                // land within a round trip.
                let rtt = s.rtt_us.load(Ordering::Relaxed).max(1_000);
                let retry = Duration::from_micros(
                    next_start
                        .map(|start| start.saturating_sub(now))
                        .filter(|&until| until > 0)
                        .unwrap_or(rtt),
                );
                return Ok(Decision::deny(
                    s.params.limit,
                    0,
                    s.reset_after(&holding, now),
                    Some(retry),
                    Source::Lease,
                ));
            }
            let wait = match next_start {
                // (Void: back within a `soon`, to ask once the store's
                // window may have turned.)
                Some(start) if void => left.min(Duration::from_micros(
                    start.saturating_sub(now).min(soon).max(100),
                )),
                Some(start) => left.min(Duration::from_micros(start.saturating_sub(now).max(100))),
                None => left,
            };
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    /// Stops serving `key` from this engine: its holding leaves the map and
    /// nothing it held can be spent any more; its unused permits go back
    /// to the store — before this returns with `wait` (so the engine that
    /// decides the key now is held to a count without them), else with
    /// the sync task's next round — and its credit is reported by the sync
    /// task. For a key now decided by another quota's engine (tiers): a
    /// lease must not outlive the quota it was granted under.
    pub(crate) async fn release(&self, key: &str, wait: bool) {
        let s = &*self.shared;
        if let Some((_, holding)) = s.holdings.remove(key) {
            s.retire(&holding, s.time.precise_us());
            s.refilled(&holding).notify_waiters();
            if wait {
                sync::give_back_all(s).await;
            }
            s.outbox.wake.notify_one();
        }
    }

    /// Takes up to `cost` of `key`'s leased permits for a charge (see
    /// `Limiter::charge`; the caller reports the rest to the store) and,
    /// if they fall short, asks for a refill, so the next decision knows
    /// what is left. Returns the permits taken, and what this process
    /// knows is left after them (what it holds and what the store last
    /// said).
    pub(crate) fn force(&self, key: &str, cost: u64) -> (u64, u64) {
        let s = &*self.shared;
        let mut covered = 0;
        let mut left = 0;
        if let Some(holding) = s.holdings.get(key).map(|h| h.value().clone()) {
            let want = cost.min(i64::MAX as u64) as i64;
            if let (Take::Taken { left: held, .. }, spare) =
                holding.take_spare(0, &s.time, |left| left.min(want))
            {
                covered = spare.permits as u64;
                left = held.max(0) as u64 + holding.store_remaining();
            }
        }
        if covered < cost {
            if let Some(holding) = s.insert(key, s.time.now_us()) {
                s.request_refill(&holding, false);
            }
        }
        (covered, left)
    }

    /// The store said `remaining` is left of `key` after a charge: what
    /// this process's next answers for it tell.
    pub(crate) fn charged(&self, key: &str, remaining: u64) {
        if let Some(holding) = self.shared.holdings.get(key) {
            holding.set_store_remaining(remaining);
        }
    }

    /// Forgets every cached denial: each key asks the store again on its
    /// next request.
    pub(crate) fn forget_denials(&self) {
        for entry in self.shared.holdings.iter() {
            entry.value().forget_denial();
        }
    }

    /// Tells the sync task to stop, which gives back what the engine
    /// holds on its own runtime (as when the engine is dropped), without
    /// waiting: for an engine no longer used, whether or not its
    /// `shutdown` runs.
    pub(crate) fn stop(&self) {
        let s = &*self.shared;
        s.life.stopping.store(true, Ordering::Release);
        s.outbox.wake.notify_one();
    }

    /// Stops the sync task and gives every unused permit back.
    pub(crate) async fn shutdown(&self) {
        let s = &*self.shared;
        s.life.closed.store(true, Ordering::Release);
        s.life.stopping.store(true, Ordering::Release);
        s.outbox.wake.notify_one();
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        sync::finish(s).await;
    }
}

#[cfg(test)]
mod tests;
