//! State the request path and the sync task share, and the operations
//! on it both use.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use tokio::sync::Notify;

use super::config::{Ablation, HybridConfig};
use super::holding::{Holding, Retired, RetryHint, WindowAt};
use super::outbox::Outbox;
use super::watchlist::Watch;
use crate::algorithm::{GiveBackCall, LeaseKind, LeaseOrigin, OpIds, Params};
use crate::clock::{StoreClock, TimeSource};
use crate::decision::{Decision, Source, Taken, TakenFrom};
use crate::error::Error;
use crate::exact::ExactEngine;
use crate::failure::Reconciler;
use crate::failure::Report;
use crate::key::KeyEncoder;
use crate::stats::Counters;
use crate::store::Store;

/// State shared by the request path and the sync task.
pub(crate) struct Shared {
    /// Whether contended keys get per-thread stocks (see `thread_cache`).
    pub(super) stocks: bool,
    /// User key → local state. Entries are removed by the sync task
    /// (eviction), by `release` (a key that moved to another tier) and
    /// by `sync::finish` (shutdown).
    /// aHash: several times faster than SipHash on short keys, and keyed
    /// with random seeds, so user-chosen keys cannot force collisions.
    pub(super) holdings: DashMap<Arc<str>, Arc<Holding>, ahash::RandomState>,
    /// Replaceable at run time without locks.
    pub(super) config: ArcSwap<HybridConfig>,
    pub(super) store: Store,
    pub(super) keys: KeyEncoder,
    pub(super) params: Params,
    /// How the algorithm's leases live and end (its spec's).
    pub(super) leases: LeaseKind,
    /// Whether the algorithm's next window is leased ahead (its spec's).
    pub(super) pre_leases: bool,
    pub(super) time: TimeSource,
    pub(super) counters: Arc<Counters>,
    /// What the sync task is handed to do (refills, give-backs, reports),
    /// and how it is woken.
    pub(super) outbox: Outbox,
    /// The sync task's own watch on holdings: peeks and rides (its part,
    /// read and written by `sync` alone; see `watchlist`).
    pub(super) watch: Watch,
    /// Store key → credit of holdings already retired: debt queued or in
    /// flight, and (fixed window) what the window saw and whether the store
    /// closed it to credit. A recreated holding counts it against `max_debt`,
    /// so eviction cannot hand a key its credit twice.
    pub(super) outstanding: DashMap<String, KeyLedger, ahash::RandomState>,
    /// Identities of give-backs and debt reports.
    pub(super) ops: OpIds,
    /// This process as a lease holder (the lease script's fair share).
    pub(super) holder: Arc<str>,
    /// The store's clock as the last reply showed it (lease replies and
    /// the exact calls of the limiter's failure layer), shared with the
    /// failure policy's fallback, which counts its windows on it.
    pub(super) store_clock: Arc<StoreClock>,
    /// Woken when a refill has been applied; striped by holding rather than
    /// one per holding, which keeps holdings small (a waiter woken for another
    /// holding of its stripe just checks again).
    pub(super) refill_waiters: Box<[Notify]>,
    /// Whether the sync task runs, is told to stop, and the engine is
    /// closed.
    pub(super) life: Life,
    /// Threads got in each other's way on some key lately: the request
    /// path then looks in its per-thread holding cache first. Cleared by
    /// maintenance, set again by the next contended swap.
    pub(super) contended: AtomicBool,
    /// Keys without room in the map, and decisions after shutdown.
    pub(super) exact: ExactEngine,
    /// The largest cost that can ever be admitted.
    pub(super) max_cost: u64,
    /// This engine's tag in what its leases and credit took.
    pub(super) tag: u16,
    /// The limiter deciding through this engine, stamped on a decision
    /// when it is made: a stamp added later costs the request path a
    /// stalled copy of the whole decision.
    pub(super) limiter: u32,
    /// Smoothed store round trip, µs.
    pub(super) rtt_us: AtomicU64,
    /// What the failure policy's fallback admitted, to report on recovery.
    pub(super) reconciler: Arc<Reconciler>,
    /// How close to a lease's deadline a refill is requested early (µs):
    /// the pre-lease lead (fixed window), at most half the lease horizon
    /// (buckets); 0 turns early refills off. Kept out of the `ArcSwap`d
    /// config so the request path reads one atomic.
    pub(super) early_lead_us: AtomicU64,
    /// Fixed window: the end of a window as the last lease reply showed
    /// it (local µs; 0 = none yet). Windows share their boundaries, so
    /// this places every later one.
    pub(super) window_end_hint: AtomicU64,
    /// Runs once between a failed try and the wait for a refill: lets a
    /// test land a refill in exactly that gap.
    #[cfg(test)]
    pub(super) before_wait: std::sync::Mutex<Option<BeforeWait>>,
}

/// An engine's life: its sync task running, told to stop, the engine
/// closed.
#[derive(Default)]
pub(crate) struct Life {
    /// Tells the sync task to exit.
    pub(super) stopping: AtomicBool,
    /// The sync task runs. Cleared by a guard inside it when it ends for
    /// any reason: its runtime was dropped, it panicked (say, in a metrics
    /// recorder), or it was told to stop.
    pub(super) alive: AtomicBool,
    /// After shutdown: decide by the exact path, lease nothing.
    pub(super) closed: AtomicBool,
}

#[cfg(test)]
pub(super) type BeforeWait = Box<dyn FnOnce(&Shared, &Arc<Holding>) + Send>;

/// Credit of a key's retired holdings; see `Shared::outstanding`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeyLedger {
    /// Debt queued for reporting or in flight.
    pub(super) pending: u64,
    /// Fixed window: the window `used` counts (`None`: none yet).
    pub(super) window: Option<i64>,
    /// Fixed window: credit retired holdings took in `window`.
    pub(super) used: u64,
    /// Fixed window: no credit in this window or earlier (`None`: none
    /// closed).
    pub(super) closed_through: Option<i64>,
    /// Local µs of the last retirement.
    pub(super) at_us: u64,
}

/// How long a store clock reading is trusted for first-touch credit.
pub(super) const STORE_CLOCK_FRESH_US: u64 = 10_000_000;

/// Stripes of refill notifications.
/// Many: every waiter of a stripe wakes when any of its holdings is
/// refilled, so a storm of N new keys costs about N² / stripes wake-ups
/// (100,000 keys: 10 million with 1,024 stripes, 150 million with 64).
/// About 32 KiB per limiter.
pub(super) const REFILL_STRIPES: usize = 1_024;

impl Shared {
    #[inline]
    pub(super) fn early_lead(&self) -> u64 {
        self.early_lead_us.load(Ordering::Relaxed)
    }

    /// How long before a window ends its next one is leased ahead (zero:
    /// never, also for an algorithm whose next window is not leased ahead).
    pub(super) fn prelease_lead(&self, config: &HybridConfig) -> Duration {
        match self.leases {
            LeaseKind::Window if self.pre_leases => config.prelease_lead,
            _ => Duration::ZERO,
        }
    }

    pub(super) fn set_early_lead(&self, config: &HybridConfig) {
        // A bucket lease is renewed ahead of its horizon, at most half-way.
        let lead = if config.ablate.off(Ablation::PRELEASE) {
            0
        } else if self.leases.windowed() {
            self.prelease_lead(config).as_micros() as u64
        } else {
            (config.prelease_lead.as_micros() as u64).min(config.lease_ttl.as_micros() as u64 / 2)
        };
        self.early_lead_us.store(lead, Ordering::Relaxed);
    }

    /// The notification a waiter on `holding` listens to.
    pub(super) fn refilled(&self, holding: &Holding) -> &Notify {
        let address = holding as *const Holding as usize;
        &self.refill_waiters[(address as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize >> 20
            & (REFILL_STRIPES - 1)]
    }

    pub(super) fn insert(&self, key: &str, now: u64) -> Option<Arc<Holding>> {
        if let Some(holding) = self.holdings.get(key) {
            return Some(holding.clone());
        }
        // After shutdown nothing is leased again: a waiter that wakes to an
        // evicted holding decides by one store call instead.
        if self.life.closed.load(Ordering::Acquire) {
            return None;
        }
        let max_keys = self.config.load().max_keys;
        if self.holdings.len() >= max_keys {
            return None;
        }
        let key: Arc<str> = Arc::from(key);
        Some(
            self.holdings
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Holding::new(key, now)))
                .clone(),
        )
    }

    pub(super) async fn exact_check(&self, key: &str, cost: u64) -> Result<Decision, Error> {
        self.exact.check(key, cost).await
    }

    /// Queues a refill for the holding (at most one per holding at a time).
    /// `urgent`: a request is waiting for it, so the sync task sends at
    /// once; otherwise it may wait `coalesce` for more keys to batch.
    pub(super) fn request_refill(&self, holding: &Arc<Holding>, urgent: bool) {
        if urgent {
            self.outbox.urgent.store(true, Ordering::Release);
        }
        if holding.enqueue(urgent) {
            self.outbox
                .refills
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(holding.clone(), urgent);
            self.outbox.wake.notify_one();
        } else if urgent {
            self.outbox.wake.notify_one();
        }
    }

    pub(super) fn reset_after(&self, holding: &Holding, now: u64) -> Duration {
        Duration::from_micros(self.reset_after_us(holding, now))
    }

    /// µs until the holding's quota is whole again, as told to a client. A
    /// window lease's end carries the clock-drift allowance its deadline
    /// needs (500 ppm of the window: 43 s of a day), which is no part of
    /// what a client should wait; what the allowance of the time still
    /// left comes to is taken off (no more than was added, so the answer
    /// never comes early: the allowance of what is left without the
    /// allowance itself; of all of it, it was 500 ppm of 43 s too much, and
    /// a day's reset was told 20 ms early, a second early once rounded).
    #[inline(always)]
    fn reset_after_us(&self, holding: &Holding, now: u64) -> u64 {
        let left = holding.window_end().saturating_sub(now);
        if self.leases.windowed() {
            let drift = crate::clock::drift_us;
            left - drift(left - drift(left))
        } else {
            left
        }
    }

    /// Whether a cached denial (until `until`, local µs) can answer a
    /// request of `cost` at `now`. A sliding window's wait depends on the
    /// cost (its carry fades over time): a larger cost than the store's
    /// answer was for asks the store. A bucket's smaller cost fits sooner
    /// (it refills at `limit` per `period`): once that time has come, it
    /// asks the store rather than wait for the larger cost's tokens.
    pub(super) fn denial_covers(&self, holding: &Holding, until: u64, now: u64, cost: u64) -> bool {
        let hint = holding.retry_hint(until);
        match self.params.algorithm {
            crate::algorithm::Algorithm::SlidingWindow => cost <= hint.cost,
            _ if self.leases.windowed() => true,
            _ => now < hint.at.saturating_sub(self.refill_us(cost, hint.cost)),
        }
    }

    /// How long a bucket takes to refill `more - fewer` tokens (rounded
    /// down), 0 for a window or when `fewer >= more`.
    fn refill_us(&self, fewer: u64, more: u64) -> u64 {
        if self.leases.windowed() || fewer >= more {
            return 0;
        }
        ((more - fewer) as u128 * self.params.period_us as u128 / self.params.limit.max(1) as u128)
            .min(u64::MAX as u128) as u64
    }

    /// A denial from the holding's cache (denied until `until`, local µs):
    /// its hint is when the store said the request can succeed, not when
    /// the cache is re-checked.
    pub(super) fn cached_denial(
        &self,
        holding: &Holding,
        until: u64,
        now: u64,
        cost: u64,
    ) -> Decision {
        let RetryHint {
            at: retry_at,
            cost: for_cost,
        } = holding.retry_hint(until);
        // A bucket refills at `limit` per `period`: a larger cost than the
        // answer was for waits for its extra tokens too, a smaller one
        // less. (A window's end serves any cost the limit can hold.)
        let at = retry_at
            .saturating_add(self.refill_us(for_cost, cost))
            .saturating_sub(self.refill_us(cost, for_cost));
        let mut wait = Duration::from_micros(at.saturating_sub(now));
        let reset = self.reset_after(holding, now);
        // A fixed window the store found full admits nothing more before
        // it ends: the cache may be re-checked sooner (for permits an idle
        // holder gives back), but the client is told the window's end.
        if self.params.algorithm == crate::algorithm::Algorithm::FixedWindow
            && holding.window().is_some()
        {
            wait = wait.max(reset);
        }
        let reset = reset.max(wait);
        Decision::deny(self.params.limit, 0, reset, Some(wait), Source::DeniedCache)
    }

    /// Permits were just taken, `left` remain: a refill if one is due,
    /// and the decision.
    #[inline(always)]
    pub(super) fn spent(
        &self,
        holding: &Arc<Holding>,
        left: i64,
        now: u64,
        cost: u64,
        window: Option<i64>,
    ) -> Decision {
        if holding.wants_refill(left, now, self.early_lead()) {
            self.request_refill(holding, false);
        }
        // A bucket lease has no window: its take records when it was
        // made (local µs), so it goes back only into a lease in place by
        // then (see `untake`).
        let taken = match window {
            Some(_) if !self.leases.windowed() => Taken::leased_at(cost, now),
            _ => Taken::new(TakenFrom::Lease, cost, window),
        };
        self.lease_decision(holding, left, now, taken.by(self.tag))
    }

    /// What a lease decision reports as remaining: what the holding holds
    /// after it, and what the store last said it had not leased.
    #[inline(always)]
    fn lease_remaining(&self, holding: &Holding, left: i64) -> u64 {
        let remaining = left.max(0) as u64 + holding.store_remaining();
        remaining.min(self.params.limit.max(self.params.burst))
    }

    /// An admission from `holding`'s lease that took `taken`, `left` permits
    /// remaining, made whole in one literal (see `Decision::leased`).
    #[inline(always)]
    pub(super) fn lease_decision(
        &self,
        holding: &Holding,
        left: i64,
        now: u64,
        taken: Taken,
    ) -> Decision {
        Decision::leased(
            self.params.limit,
            self.lease_remaining(holding, left),
            self.reset_after_us(holding, now),
            self.params.period_us,
            taken,
            self.limiter,
        )
    }

    /// The fixed window the store is in at local time `now`, from the last
    /// reply's clock reading, or `None` when the reading is stale or `now`
    /// is too close to a boundary to tell.
    pub(super) fn store_window(&self, now: u64) -> Option<i64> {
        let reading = self.store_clock.reading()?;
        let age = now.checked_sub(reading.at_us)?;
        if age > STORE_CLOCK_FRESH_US {
            return None;
        }
        let config = self.config.load();
        let err = reading.error_us
            + config.clock_margin.as_micros() as u64
            + self.time.tick_us()
            + crate::clock::drift_us(age);
        let store_now = now.checked_add_signed(reading.offset_us)?;
        let period = self.params.period_us;
        let early = store_now.saturating_sub(err) / period;
        let late = (store_now + err) / period;
        (early == late).then_some(early as i64)
    }

    /// Optimistic mode: admit on credit if this process's unreported debt
    /// for the key stays within `max_debt` and belongs to one window; the
    /// window it is charged to (0 for a bucket).
    pub(super) fn try_credit(
        &self,
        holding: &Holding,
        cost: u64,
        now: u64,
        max_debt: u64,
    ) -> Option<i64> {
        // Window leases: near a boundary the debt could land in either
        // window, so no credit there, and each window's overshoot stays
        // attributable. Before the key's first lease, the window comes
        // from the store's clock as the last reply of any key showed it;
        // with no reply yet, no credit (debt charged to whatever window
        // the store is in when the report lands would hide overshoot).
        let windowed = self.leases.windowed();
        let window = if windowed {
            match holding.window_at(now, self.params.period_us) {
                WindowAt::Unknown => self.store_window(now)?,
                WindowAt::In(window) => window,
                WindowAt::Boundary => return None,
            }
        } else {
            0
        };
        // Credit is taken only where the store's last word on this window
        // leaves room for it beyond the refill in flight: past that it
        // would be overshoot for certain, and the request waits for the
        // refill's answer instead.
        let mut room = max_debt;
        if windowed && Some(window) == holding.window() {
            let left = holding.store_remaining();
            let asked = holding.books().sizing.last_want();
            room = room.min(left.saturating_sub(asked));
        }
        let queued = if self.outstanding.is_empty() {
            0
        } else {
            match self.outstanding.get(&self.store_key(holding)) {
                None => 0,
                Some(ledger) if !windowed => ledger.pending,
                Some(ledger) if ledger.closed_through.is_some_and(|c| window <= c) => return None,
                Some(ledger) if Some(window) == ledger.window => ledger.used,
                Some(_) => 0,
            }
        };
        if !holding.take_credit(window, cost, room.saturating_sub(queued)) {
            return None;
        }
        self.counters.credit_admitted.add(cost);
        Some(window)
    }

    /// Takes a holding out of service: valid permits go back to the store,
    /// debt is queued for reporting, expired permits count as stranded.
    pub(super) fn retire(&self, holding: &Holding, now: u64) {
        let Retired {
            credit,
            closed,
            origin,
            permits,
            window,
            deadline,
            next,
        } = holding.retire();
        let valid = now < deadline;
        let permits = permits as u64;
        let store_key = self.store_key(holding);
        if credit.debt > 0 || credit.in_flight > 0 || closed.is_some() {
            let mut ledger = self.outstanding.entry(store_key.clone()).or_default();
            if Some(credit.window) > ledger.window {
                ledger.window = Some(credit.window);
                ledger.used = 0;
            }
            // Queued debt is added by `queue_report` below.
            if Some(credit.window) == ledger.window {
                ledger.used += u64::from(credit.in_flight);
            }
            ledger.closed_through = ledger.closed_through.max(closed);
            ledger.at_us = now;
        }
        if permits > 0 {
            if valid {
                self.give_back(&store_key, permits, window, origin);
            } else {
                self.counters.stranded.add(permits);
            }
        }
        if let Some(next) = next {
            let permits = next.permits.max(0) as u64;
            self.give_back(&store_key, permits, Some(next.window), origin);
        }
        if credit.debt > 0 {
            let op = self.ops.next();
            let debt = u64::from(credit.debt);
            self.queue_report(Report::new(store_key, debt, Some(credit.window), op));
        }
    }

    /// Credit the store will never hear of (its report was dropped): the
    /// store could not cover it, so it counts as overshoot, besides being
    /// counted dropped. Without it, a report lost to an outage hid
    /// overshoot: another process was granted the permits the credit had
    /// used, and `Stats::overshoot` read less than the actual excess.
    pub(super) fn debt_dropped(&self, permits: u64) {
        self.counters.reports_dropped.add(permits);
        self.counters.overshoot.add(permits);
    }

    /// Queues debt for reporting under its identity, and counts it against
    /// the key's credit until the store has it.
    pub(super) fn queue_report(&self, report: Report) {
        {
            let mut ledger = self.outstanding.entry(report.key.clone()).or_default();
            ledger.pending += report.permits;
            if self.leases.windowed() {
                if report.window > ledger.window {
                    ledger.window = report.window;
                    ledger.used = 0;
                }
                if report.window == ledger.window {
                    ledger.used += report.permits;
                }
                ledger.at_us = self.time.precise_us();
            }
        }
        self.outbox
            .reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(report);
    }

    /// The store has a queued report (or refused it for good).
    pub(super) fn report_settled(&self, key: &str, permits: u64) {
        if let Some(mut ledger) = self.outstanding.get_mut(key) {
            ledger.pending = ledger.pending.saturating_sub(permits);
        }
        // Buckets have no window to remember: a settled ledger is done.
        // Window ledgers are pruned once their window has passed.
        let bucket = !self.leases.windowed();
        self.outstanding
            .remove_if(key, |_, l| l.pending == 0 && bucket);
    }

    /// Forgets fixed-window ledgers whose window has surely ended.
    pub(super) fn prune_ledgers(&self, now: u64) {
        if self.outstanding.is_empty() {
            return;
        }
        let stale = 2 * self.params.period_us + self.config.load().clock_margin.as_micros() as u64;
        self.outstanding
            .retain(|_, l| l.pending > 0 || now.saturating_sub(l.at_us) < stale);
    }

    /// The holding's store key, encoded when the sync task needs it rather
    /// than kept in every holding.
    pub(super) fn store_key(&self, holding: &Holding) -> String {
        self.keys.store_key(holding.key(), self.params.algorithm)
    }

    /// Permits of `holding`'s lease that ran out unspent: stranded under a
    /// window lease (their window is over), given back under a bucket
    /// lease (capped by what the bucket could have held since the lease's
    /// origin), so a key used less often than its leases last does not
    /// lose a token at every expiry.
    pub(super) fn expired(&self, holding: &Holding, permits: u64) {
        if permits == 0 {
            return;
        }
        match self.leases {
            LeaseKind::Window => self.counters.stranded.add(permits),
            LeaseKind::Bucket => {
                let origin = holding.books().origin_for(permits);
                self.give_back(&self.store_key(holding), permits, None, origin);
                // The store will hold them again (the give-back goes before
                // the key's next lease call): a denial it answered while
                // they were out no longer says when the key can pass.
                holding.forget_denial();
            }
        }
    }

    /// Queues a give-back of `permits` to `store_key`: of `window` (window
    /// algorithms; `None`: none known, so nothing goes back), or of the
    /// bucket lease from `origin` (buckets, which have no window).
    pub(super) fn give_back(
        &self,
        store_key: &str,
        permits: u64,
        window: Option<i64>,
        origin: LeaseOrigin,
    ) {
        let window = match window {
            Some(window) => window,
            None if self.leases.windowed() => return,
            None => 0,
        };
        if permits == 0 {
            return;
        }
        let call = GiveBackCall {
            key: store_key.to_owned(),
            returned: permits,
            window,
            origin,
            op: self.ops.next(),
            remember_us: 0,
            refund: false,
        };
        self.outbox.returns().push(call);
    }
}
