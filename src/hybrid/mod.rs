//! The hybrid limiter: leased slices of each key's budget, decided locally.
//!
//! The request path (`HybridEngine::check`) looks the key up in a
//! `DashMap`, spends a permit with one compare-and-swap and returns; it
//! touches the network only through the sync task, which it wakes when a
//! slot runs low. Waiting (strict mode) is bounded by `max_wait`; no lock
//! is held across an await.
//!
//! Files: `config` (tunables), `slot` (one key's atomics), `sizing` (how
//! big a lease), `sync` (the background task: refills, give-backs,
//! eviction, shutdown).

mod config;
mod sizing;
mod slot;
mod sync;
mod thread_cache;

pub use self::config::{Consistency, HybridConfig};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use self::slot::{Retired, Slot, Take, UNKNOWN_WINDOW};
pub(crate) use self::sync::DebtReport;
use crate::algorithm::{GiveBackCall, LeaseKind, LeaseOrigin, OpIds, Params};
use crate::clock::TimeSource;
use crate::decision::Source;
use crate::decision::{Origin, Taken};
use crate::exact::ExactEngine;
use crate::failure::Reconciler;
use crate::key::KeyEncoder;
use crate::stats::Counters;
use crate::store::Store;
use crate::{Decision, Error, ErrorKind};

/// State shared by the request path and the sync task.
pub(crate) struct Shared {
    /// User key → local state. Entries are only removed by the sync task.
    /// aHash: several times faster than SipHash on short keys, and keyed
    /// with random seeds, so user-chosen keys cannot force collisions.
    slots: DashMap<Arc<str>, Arc<Slot>, ahash::RandomState>,
    /// Replaceable at run time without locks.
    config: ArcSwap<HybridConfig>,
    store: Store,
    keys: KeyEncoder,
    params: Params,
    /// How the algorithm's leases live and end (its spec's).
    leases: LeaseKind,
    /// Whether the algorithm's next window is leased ahead (its spec's).
    pre_leases: bool,
    time: TimeSource,
    counters: Arc<Counters>,
    /// Slots waiting for a refill, those with a request waiting first.
    queue: Mutex<sync::RefillQueue>,
    /// Permits to give back in the next round.
    returns: Mutex<Vec<GiveBackCall>>,
    /// Slots whose window is peeked at with the next batch sent.
    watched: Mutex<HashMap<usize, sync::Watched>>,
    /// Slots whose refill ahead of need is soon due: sent early with a
    /// batch that goes out anyway (see [`sync::Ahead`]).
    ahead: Mutex<HashMap<usize, sync::Ahead>>,
    /// When `ahead` was last scanned for refills to send along (local µs;
    /// 0: never), so a burst of batches does not scan it once each.
    ride_scan_at: AtomicU64,
    /// Debt of evicted slots (or of failed reports) to report next round,
    /// each under the identity it was first sent with.
    reports: Mutex<Vec<DebtReport>>,
    /// Store key → credit of slots already retired: debt queued or in
    /// flight, and (fixed window) what the window saw and whether the store
    /// closed it to credit. A recreated slot counts it against `max_debt`,
    /// so eviction cannot hand a key its credit twice.
    outstanding: DashMap<String, KeyLedger, ahash::RandomState>,
    /// Identities of give-backs and debt reports.
    ops: OpIds,
    /// This process as a lease holder (the lease script's fair share).
    holder: Arc<str>,
    /// The store's clock as the last lease reply showed it.
    store_clock: Mutex<Option<StoreClock>>,
    /// Wakes the sync task.
    wake: Notify,
    /// Woken when a refill has been applied; striped by slot rather than
    /// one per slot, which keeps slots small (a waiter woken for another
    /// slot of its stripe just checks again).
    refill_waiters: Box<[Notify]>,
    /// A queued refill has a request waiting on it: no coalescing delay.
    urgent: AtomicBool,
    /// Tells the sync task to exit.
    stopping: AtomicBool,
    /// The sync task runs. Cleared by a guard inside it when it ends for
    /// any reason: its runtime was dropped, it panicked (say, in a metrics
    /// recorder), or it was told to stop.
    alive: AtomicBool,
    /// After shutdown: decide by the exact path, lease nothing.
    closed: AtomicBool,
    /// Threads got in each other's way on some key lately: the request
    /// path then looks in its per-thread slot cache first. Cleared by
    /// maintenance, set again by the next contended swap.
    contended: AtomicBool,
    /// Keys without room in the map, and decisions after shutdown.
    exact: ExactEngine,
    /// The largest cost that can ever be admitted.
    max_cost: u64,
    /// This engine's tag in what its leases and credit took.
    tag: u16,
    /// Smoothed store round trip, µs.
    rtt_us: AtomicU64,
    /// What the failure policy's fallback admitted, to report on recovery.
    reconciler: Arc<Reconciler>,
    /// The fallback's clock, kept on the store's time by lease replies.
    fallback_clock: Arc<crate::failure::StoreAligned>,
    /// How close to a lease's deadline a refill is requested early (µs):
    /// the pre-lease lead (fixed window), at most half the lease horizon
    /// (buckets); 0 turns early refills off. Kept out of the `ArcSwap`d
    /// config so the request path reads one atomic.
    early_lead_us: AtomicU64,
    /// Fixed window: the end of a window as the last lease reply showed
    /// it (local µs; 0 = none yet). Windows share their boundaries, so
    /// this places every later one.
    window_end_hint: AtomicU64,
    /// Runs once between a failed try and the wait for a refill: lets a
    /// test land a refill in exactly that gap.
    #[cfg(test)]
    before_wait: Mutex<Option<BeforeWait>>,
}

#[cfg(test)]
type BeforeWait = Box<dyn FnOnce(&Shared, &Arc<Slot>) + Send>;

/// Stops the sync task when the last limiter clone is dropped.
struct StopGuard(Arc<Shared>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.0.stopping.store(true, Ordering::Release);
        self.0.wake.notify_one();
    }
}

/// What a hybrid engine is built from, besides its configuration.
pub(crate) struct Wiring {
    pub(crate) store: Store,
    pub(crate) keys: KeyEncoder,
    pub(crate) params: Params,
    /// An injected clock; `None` for the system's (coarse) clock.
    pub(crate) clock: Option<Arc<dyn crate::Clock>>,
    /// A fast clock lagging `clock` by up to the duration (simulation).
    pub(crate) fast_clock: Option<(Arc<dyn crate::Clock>, Duration)>,
    pub(crate) counters: Arc<Counters>,
    /// The largest cost that can ever be admitted.
    pub(crate) max_cost: u64,
    pub(crate) reconciler: Arc<Reconciler>,
    /// The fallback's clock, kept on the store's time by lease replies.
    pub(crate) store_clock: Arc<crate::failure::StoreAligned>,
    /// Refunds gone back locally, shared by every lane of a limiter: a
    /// key's first quota may be decided by another lane (tiers) when the
    /// same admission is refunded again.
    pub(crate) local_refunds: Arc<Mutex<LocalRefunds>>,
}

pub(crate) struct HybridEngine {
    /// This engine's identity in the per-thread slot caches.
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

/// Admissions refunded that could go back locally, and where each went,
/// each kept until the lease or credit it could go back into has surely
/// ended: a second refund of one must not go back locally again (the
/// debt or lease it would go into may hold others' permits by then).
#[derive(Default)]
pub(crate) struct LocalRefunds {
    /// Admission → (local µs after which it is forgotten, where it went).
    seen: HashMap<u64, (u64, Went)>,
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
        if self.seen.len() >= MAX_LOCAL_REFUNDS / 2 {
            self.seen.retain(|_, &mut (end, _)| end > now);
        }
        if let Some(&(_, before)) = self.seen.get(&seq) {
            return Some(before);
        }
        if self.seen.len() >= MAX_LOCAL_REFUNDS {
            return Some(Went::Local);
        }
        self.seen.insert(seq, (until, went));
        None
    }

    fn set(&mut self, seq: u64, went: Went) {
        if let Some(entry) = self.seen.get_mut(&seq) {
            entry.1 = went;
        }
    }
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
            store,
            keys,
            params,
            clock,
            fast_clock,
            counters,
            max_cost,
            reconciler,
            store_clock: fallback_clock,
            local_refunds,
        } = wiring;
        let ops = OpIds::default();
        let holder = ops.holder();
        let time = match (fast_clock, clock) {
            (Some((fast, guard)), Some(precise)) => TimeSource::split(fast, precise, guard),
            (_, clock) => TimeSource::new(clock, config.coarse_clock),
        };
        let shared = Arc::new(Shared {
            slots: DashMap::with_hasher(ahash::RandomState::new()),
            config: ArcSwap::from_pointee(config),
            exact: ExactEngine::new(store.clone(), keys.clone(), params, counters.clone()),
            store,
            keys,
            params,
            leases: params.algorithm.spec().leases,
            pre_leases: params.algorithm.spec().pre_leases,
            time,
            counters,
            queue: Mutex::new(sync::RefillQueue::default()),
            returns: Mutex::new(Vec::new()),
            watched: Mutex::new(HashMap::new()),
            ahead: Mutex::new(HashMap::new()),
            ride_scan_at: AtomicU64::new(0),
            reports: Mutex::new(Vec::new()),
            outstanding: DashMap::with_hasher(ahash::RandomState::new()),
            ops,
            holder,
            store_clock: Mutex::new(None),
            wake: Notify::new(),
            refill_waiters: (0..REFILL_STRIPES).map(|_| Notify::new()).collect(),
            urgent: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            alive: AtomicBool::new(true),
            closed: AtomicBool::new(false),
            contended: AtomicBool::new(false),
            max_cost,
            tag: engine_tag(),
            rtt_us: AtomicU64::new(0),
            reconciler,
            fallback_clock,
            early_lead_us: AtomicU64::new(0),
            window_end_hint: AtomicU64::new(0),
            #[cfg(test)]
            before_wait: Mutex::new(None),
        });
        shared.set_early_lead(&shared.config.load());
        let task = runtime.spawn(sync::run(shared.clone()));
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
        self.shared.slots.len()
    }

    /// The request path's common case, without a future: a known key with
    /// valid local permits. `None` means "take the slow path".
    #[inline(always)]
    pub(crate) fn try_fast(&self, key: &str, cost: u64) -> Option<Decision> {
        let s = &*self.shared;
        if cost > s.max_cost || s.closed.load(Ordering::Relaxed) {
            return None;
        }
        // The per-thread cache pays off only when threads contend for a
        // key; uncontended, the map's lock is cheaper than the probe.
        let contended = s.contended.load(Ordering::Relaxed);
        if contended {
            if let Some(decided) = thread_cache::with(self.id, key, |slot, stock| {
                self.fast_stocked(slot, stock, cost)
            }) {
                return decided;
            }
        }
        let entry = s.slots.get(key)?;
        let decided = self.fast_on(entry.value(), cost);
        if contended && thread_cache::worth_caching() {
            let now = s.time.now_us();
            let lost = thread_cache::put(self.id, entry.value().clone(), now);
            s.counters.stranded.add(lost as u64);
        }
        decided
    }

    /// The fast path on a slot this thread cached: spends from the
    /// thread's stock of its permits while the stock's lease is valid, and
    /// refills the stock when it takes from the slot (see `thread_cache`).
    #[inline(always)]
    fn fast_stocked(
        &self,
        slot: &Arc<Slot>,
        stock: &std::cell::Cell<thread_cache::Stock>,
        cost: u64,
    ) -> Option<Decision> {
        let s = &*self.shared;
        if cost == 0 {
            return self.fast_on(slot, cost);
        }
        let mut held = stock.get();
        if held.permits > 0 {
            match s.time.valid_until(held.deadline) {
                Some(now) if held.permits as u64 >= cost => {
                    held.permits -= cost as i64;
                    stock.set(held);
                    slot.touch(now);
                    let left = slot.permits.load(Ordering::Relaxed);
                    return Some(s.spent(slot, left + held.permits, now, cost, held.window));
                }
                // Too few for this cost: back to the slot, if its lease
                // is still the one they came from.
                Some(now) => {
                    if !slot.restore(held.window, held.deadline, held.permits, now) {
                        s.counters.stranded.add(held.permits as u64);
                    }
                }
                None => s.counters.stranded.add(held.permits as u64),
            }
            stock.set(thread_cache::Stock::NONE);
        }
        match slot.take_spare(cost, &s.time, thread_cache::stock_for) {
            (Take::Taken(left, now, contended, window), spare, deadline) => {
                if contended && !s.contended.load(Ordering::Relaxed) {
                    s.contended.store(true, Ordering::Relaxed);
                }
                stock.set(thread_cache::Stock {
                    permits: spare,
                    window,
                    deadline,
                });
                slot.touch(now);
                Some(s.spent(slot, left + spare, now, cost, window))
            }
            (Take::Late(lost), ..) => {
                s.counters.stranded.add(lost as u64);
                None
            }
            // A pre-lease to promote, or a denial to answer: the common way.
            (Take::Empty, ..) => self.fast_on(slot, cost),
        }
    }

    /// The fast path on a slot found: one clock read, after the permit
    /// was taken (see [`Slot::take`]).
    #[inline]
    fn fast_on(&self, slot: &Arc<Slot>, cost: u64) -> Option<Decision> {
        let s = &*self.shared;
        match slot.take(cost, &s.time) {
            Take::Taken(left, now, contended, window) => {
                if contended && !s.contended.load(Ordering::Relaxed) {
                    s.contended.store(true, Ordering::Relaxed);
                }
                slot.touch(now);
                Some(s.spent(slot, left, now, cost, window))
            }
            Take::Empty => {
                if let Some(decided) = self.promoted(slot, cost) {
                    return Some(decided);
                }
                // Known exhausted: answer from the denied-until time. The
                // coarse clock may lag, which only lengthens the denial.
                if cost == 0 || slot.denied_until.load(Ordering::Relaxed) == 0 {
                    return None;
                }
                let now = s.time.now_us();
                slot.denied(now)
                    .map(|until| s.cached_denial(slot, until, now))
            }
            // The lease ended (its permits are void): the next window's
            // may be held already.
            Take::Late(lost) => {
                s.counters.stranded.add(lost as u64);
                self.promoted(slot, cost)
            }
        }
    }

    /// A pre-lease of the window that has just begun, put in place and
    /// spent from. Its start is read on the precise clock: the coarse one,
    /// anchored to it once, may read up to a kernel tick ahead, and a
    /// pre-lease must never start early.
    fn promoted(&self, slot: &Arc<Slot>, cost: u64) -> Option<Decision> {
        let s = &*self.shared;
        if !slot.has_next() {
            return None;
        }
        let replaced = slot.promote(s.time.precise_us())?;
        s.counters.stranded.add(replaced as u64);
        match slot.take(cost, &s.time) {
            Take::Taken(left, now, _, window) => {
                slot.touch(now);
                Some(s.spent(slot, left, now, cost, window))
            }
            _ => None,
        }
    }

    /// Restarts a sync task that vanished (its runtime was dropped, it
    /// panicked) on the caller's runtime; `false` if there is none, in
    /// which case the caller decides by one store call.
    fn ensure_sync_task(&self) -> bool {
        let s = &*self.shared;
        if s.alive.load(Ordering::Acquire) || s.stopping.load(Ordering::Acquire) {
            return true;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let mut task = self.task.lock().unwrap_or_else(|p| p.into_inner());
        // Another caller may have restarted it while this one waited.
        if s.alive.swap(true, Ordering::AcqRel) {
            return true;
        }
        *task = Some(runtime.spawn(sync::run(self.shared.clone())));
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
        if s.closed.load(Ordering::Acquire) {
            return s.exact_check(key, cost).await;
        }
        // The slow path tries the slot's permits first: one code path for
        // everything `try_fast` did not answer.
        let Some(slot) = s.insert(key, s.time.now_us()) else {
            return s.exact_check(key, cost).await;
        };
        self.slow(slot, key, cost).await
    }

    async fn slow(&self, mut slot: Arc<Slot>, key: &str, cost: u64) -> Result<Decision, Error> {
        let s = &*self.shared;
        let config = s.config.load_full();
        let give_up_at = tokio::time::Instant::now() + config.max_wait;
        let mut retried = false;
        loop {
            // The slow path reads the precise clock: it decides credit
            // windows and pre-lease starts, where a lagging clock would err.
            let now = s.time.precise_us();
            if slot.evicted.load(Ordering::Acquire) {
                slot = match s.insert(key, now) {
                    Some(slot) => slot,
                    None => return s.exact_check(key, cost).await,
                };
            }
            slot.touch(now);
            // Listening starts before the permits are tried: a refill that
            // lands between the try and the wait is seen, not re-asked for.
            let notified = s.refilled(&slot).notified();
            tokio::pin!(notified);
            if let Some(replaced) = slot.promote(now) {
                s.counters.stranded.add(replaced as u64);
            }
            match slot.take(cost, &s.time) {
                Take::Taken(left, _, _, window) => {
                    return Ok(s.spent(&slot, left, now, cost, window))
                }
                Take::Late(lost) => s.counters.stranded.add(lost as u64),
                Take::Empty => {}
            }
            // A peek is always answered, never denied: it takes nothing.
            if cost == 0 {
                return Ok(s.lease_decision(&slot, 0, now));
            }
            if let Some(until) = slot.denied(now) {
                // Denied until the next window, whose pre-lease is held:
                // worth waiting for if it starts within the wait.
                let left = give_up_at.saturating_duration_since(tokio::time::Instant::now());
                let next_in_time = slot
                    .next_start()
                    .is_some_and(|start| start.saturating_sub(now) < left.as_micros() as u64);
                if !next_in_time {
                    return Ok(s.cached_denial(&slot, until, now));
                }
                let wait = slot
                    .next_start()
                    .unwrap_or(now)
                    .saturating_sub(now)
                    .max(100);
                let _ = tokio::time::timeout(Duration::from_micros(wait), notified).await;
                continue;
            }
            slot.need
                .fetch_max(cost.min(u64::from(u32::MAX)) as u32, Ordering::AcqRel);
            #[cfg(test)]
            if let Some(land) = s.before_wait.lock().unwrap().take() {
                land(s, &slot);
            }
            if notified.as_mut().enable() && !retried {
                // A refill (of this slot or one sharing its stripe) was
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
            let next_start = slot.next_start();
            let soon = 2 * s.rtt_us.load(Ordering::Relaxed) + 1_000;
            if next_start.is_none_or(|start| {
                start > now + soon
                    && slot.books().used_up != slot.window.load(Ordering::Acquire) as u32
            }) {
                s.request_refill(&slot, true);
            }
            if slot.refill_failed.load(Ordering::Acquire) {
                return Err(Error::new(
                    ErrorKind::Connection,
                    "the last refill failed and no leased permit is left",
                ));
            }
            if let Consistency::Optimistic { max_debt } = config.consistency {
                if let Some(window) = s.try_credit(&slot, cost, now, max_debt) {
                    return Ok(Decision::allow(
                        s.params.limit,
                        0,
                        s.reset_after(&slot, now),
                        Source::Credit,
                    )
                    .with_taken(Taken::new(Origin::Credit, cost, Some(window)).by(s.tag)));
                }
            }
            let left = give_up_at.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                let retry = Duration::from_micros(s.rtt_us.load(Ordering::Relaxed).max(1_000));
                return Ok(Decision::deny(
                    s.params.limit,
                    0,
                    s.reset_after(&slot, now),
                    Some(retry),
                    Source::Lease,
                ));
            }
            let wait = match next_start {
                Some(start) => left.min(Duration::from_micros(start.saturating_sub(now).max(100))),
                None => left,
            };
            let _ = tokio::time::timeout(wait, notified).await;
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
        let Some(slot) = s.slots.get(key).map(|e| e.value().clone()) else {
            return false;
        };
        match taken.origin {
            Origin::Lease if s.leases.windowed() => {
                slot.untake(taken.window, taken.cost, s.time.precise_us())
            }
            // A bucket's permits go back only into the lease they were
            // taken from: one applied after the take was granted with the
            // bucket's level then, and a take from an earlier lease going
            // into it would be a permit the bucket never had.
            Origin::Lease => {
                let taken_at = taken.window.max(0) as u64;
                slot.books().sizing.applied_at() <= taken_at
                    && slot.untake(0, taken.cost, s.time.precise_us())
            }
            Origin::Credit => slot.untake_credit(taken.window, taken.cost),
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
    /// taken back (`REPEAT` or more: refunded before).
    pub(crate) async fn refund(&self, key: &str, taken: Taken) -> Result<u64, Error> {
        let s = &*self.shared;
        let windowed = s.leases.windowed();
        let local = match taken.origin {
            Origin::Lease => !windowed,
            Origin::Credit => true,
            _ => false,
        };
        // Taken by another engine (a lane of another tier): nothing of it
        // is here to go back into.
        if local && taken.engine != s.tag && (taken.origin != Origin::Credit || !windowed) {
            return Ok(0);
        }
        if local {
            let now = s.time.precise_us();
            let config = s.config.load();
            let until =
                now + config.lease_ttl.as_micros() as u64 + 2 * s.params.period_us + 1_000_000;
            let mut refunds = self.local_refunds.lock().unwrap_or_else(|p| p.into_inner());
            match refunds.route(taken.seq, now, until, Went::Local) {
                Some(Went::Local) => return Ok(crate::algorithm::REPEAT),
                Some(Went::Store) => {}
                None => {
                    if self.untake(key, taken) {
                        return Ok(taken.cost);
                    }
                    // Credit already reported counts in its window; the
                    // rest has nowhere to go.
                    if taken.origin != Origin::Credit || !windowed {
                        return Ok(0);
                    }
                    refunds.set(taken.seq, Went::Store);
                }
            }
        }
        let back = s.exact.refund(key, taken).await?;
        if back > 0 && back < crate::algorithm::REPEAT {
            // The store has room again: a key known exhausted asks anew.
            if let Some(slot) = self.shared.slots.get(key) {
                slot.deny_until(0);
            }
        }
        Ok(back)
    }

    /// Stops serving `key` from this engine: its slot leaves the map, its
    /// unused permits are back in the store when this returns (so the
    /// engine that decides the key now is held to a count without them),
    /// and its credit is reported by the sync task. For a key now decided
    /// by another quota's engine (tiers): a lease must not outlive the
    /// quota it was granted under.
    pub(crate) async fn release(&self, key: &str) {
        let s = &*self.shared;
        if let Some((_, slot)) = s.slots.remove(key) {
            s.retire(&slot, s.time.precise_us());
            s.refilled(&slot).notify_waiters();
            sync::give_back_all(s).await;
            s.wake.notify_one();
        }
    }

    /// Forgets every cached denial: each key asks the store again on its
    /// next request.
    pub(crate) fn forget_denials(&self) {
        for entry in self.shared.slots.iter() {
            entry.value().deny_until(0);
        }
    }

    /// Stops the sync task and gives every unused permit back.
    pub(crate) async fn shutdown(&self) {
        let s = &*self.shared;
        s.closed.store(true, Ordering::Release);
        s.stopping.store(true, Ordering::Release);
        s.wake.notify_one();
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        s.finish().await;
    }
}

/// Credit of a key's retired slots; see `Shared::outstanding`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyLedger {
    /// Debt queued for reporting or in flight.
    pending: u64,
    /// Fixed window: the window `used` counts.
    window: i64,
    /// Fixed window: credit retired slots took in `window`.
    used: u64,
    /// Fixed window: no credit in this window or earlier.
    closed_through: i64,
    /// Local µs of the last retirement.
    at_us: u64,
}

impl Default for KeyLedger {
    fn default() -> Self {
        KeyLedger {
            pending: 0,
            window: i64::MIN,
            used: 0,
            closed_through: i64::MIN,
            at_us: 0,
        }
    }
}

/// The store's clock against the local one, from a lease reply.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoreClock {
    /// Store µs minus local µs.
    pub(crate) offset_us: i64,
    /// Half the round trip it was read over: the reading's uncertainty.
    pub(crate) error_us: u64,
    /// Local µs of the reading.
    pub(crate) at_us: u64,
}

/// How long a store clock reading is trusted for first-touch credit.
const STORE_CLOCK_FRESH_US: u64 = 10_000_000;

/// Stripes of refill notifications.
/// Many: every waiter of a stripe wakes when any of its slots is
/// refilled, so a storm of N new keys costs about N² / stripes wake-ups
/// (100,000 keys: 10 million with 1,024 stripes, 150 million with 64).
/// About 32 KiB per limiter.
const REFILL_STRIPES: usize = 1_024;

impl Shared {
    /// The last work of a limiter: every slot retired (unused permits given
    /// back, debt reported), waiters woken to decide by one store call,
    /// one last round. Bounded: each batch by the store's timeout, and the
    /// breaker refuses the rest once it opens. What the store cannot take
    /// even now is counted as dropped, not lost silently.
    async fn finish(&self) {
        self.closed.store(true, Ordering::Release);
        let now = self.time.precise_us();
        let keys: Vec<Arc<str>> = self.slots.iter().map(|e| e.key().clone()).collect();
        for key in keys {
            if let Some((_, slot)) = self.slots.remove(&key) {
                self.retire(&slot, now);
            }
        }
        for stripe in self.refill_waiters.iter() {
            stripe.notify_waiters();
        }
        sync::round(self).await;
        let lost: u64 =
            std::mem::take(&mut *self.reports.lock().unwrap_or_else(|p| p.into_inner()))
                .iter()
                .map(|r| r.debt)
                .sum::<u64>()
                + self
                    .reconciler
                    .drain()
                    .iter()
                    .map(|r| r.permits)
                    .sum::<u64>();
        self.counters.reports_dropped.add(lost);
        self.counters.meters.local_keys.set(0.0);
    }

    #[inline]
    fn early_lead(&self) -> u64 {
        self.early_lead_us.load(Ordering::Relaxed)
    }

    /// How long before a window ends its next one is leased ahead (zero:
    /// never, also for an algorithm whose next window is not leased ahead).
    fn prelease_lead(&self, config: &HybridConfig) -> Duration {
        match self.leases {
            LeaseKind::Window if self.pre_leases => config.prelease_lead,
            _ => Duration::ZERO,
        }
    }

    fn set_early_lead(&self, config: &HybridConfig) {
        // A bucket lease is renewed ahead of its horizon, at most half-way.
        let lead = if self.leases.windowed() {
            self.prelease_lead(config).as_micros() as u64
        } else {
            (config.prelease_lead.as_micros() as u64).min(config.lease_ttl.as_micros() as u64 / 2)
        };
        self.early_lead_us.store(lead, Ordering::Relaxed);
    }

    /// The notification a waiter on `slot` listens to.
    fn refilled(&self, slot: &Slot) -> &Notify {
        let address = slot as *const Slot as usize;
        &self.refill_waiters[(address as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize >> 20
            & (REFILL_STRIPES - 1)]
    }

    fn insert(&self, key: &str, now: u64) -> Option<Arc<Slot>> {
        if let Some(slot) = self.slots.get(key) {
            return Some(slot.clone());
        }
        // After shutdown nothing is leased again: a waiter that wakes to an
        // evicted slot decides by one store call instead.
        if self.closed.load(Ordering::Acquire) {
            return None;
        }
        let max_keys = self.config.load().max_keys;
        if self.slots.len() >= max_keys {
            return None;
        }
        let key: Arc<str> = Arc::from(key);
        Some(
            self.slots
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Slot::new(key, now)))
                .clone(),
        )
    }

    async fn exact_check(&self, key: &str, cost: u64) -> Result<Decision, Error> {
        self.exact.check(key, cost).await
    }

    /// Queues a refill for the slot (at most one per slot at a time).
    /// `urgent`: a request is waiting for it, so the sync task sends at
    /// once; otherwise it may wait `coalesce` for more keys to batch.
    fn request_refill(&self, slot: &Arc<Slot>, urgent: bool) {
        if urgent {
            self.urgent.store(true, Ordering::Release);
        }
        if slot.enqueue(urgent) {
            self.queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot.clone(), urgent);
            self.wake.notify_one();
        } else if urgent {
            self.wake.notify_one();
        }
    }

    fn reset_after(&self, slot: &Slot, now: u64) -> Duration {
        Duration::from_micros(slot.window_end.load(Ordering::Relaxed).saturating_sub(now))
    }

    fn cached_denial(&self, slot: &Slot, until: u64, now: u64) -> Decision {
        let wait = Duration::from_micros(until - now);
        let reset = self.reset_after(slot, now).max(wait);
        Decision::deny(self.params.limit, 0, reset, Some(wait), Source::DeniedCache)
    }

    /// Permits were just taken, `left` remain: a refill if one is due,
    /// and the decision.
    #[inline(always)]
    fn spent(
        &self,
        slot: &Arc<Slot>,
        left: i64,
        now: u64,
        cost: u64,
        window: Option<i64>,
    ) -> Decision {
        if slot.wants_refill(left, now, self.early_lead()) {
            self.request_refill(slot, false);
        }
        // A bucket lease has no window: its take records when it was
        // made (local µs), so it goes back only into a lease in place by
        // then (see `untake`).
        let window = if self.leases.windowed() {
            window
        } else {
            window.map(|_| now as i64)
        };
        self.lease_decision(slot, left, now)
            .with_taken(Taken::new(Origin::Lease, cost, window).by(self.tag))
    }

    #[inline(always)]
    fn lease_decision(&self, slot: &Slot, left: i64, now: u64) -> Decision {
        let remaining =
            left.max(0) as u64 + u64::from(slot.store_remaining.load(Ordering::Relaxed));
        Decision::allow(
            self.params.limit,
            remaining.min(self.params.limit.max(self.params.burst)),
            self.reset_after(slot, now),
            Source::Lease,
        )
    }

    /// The fixed window the store is in at local time `now`, from the last
    /// reply's clock reading, or `None` when the reading is stale or `now`
    /// is too close to a boundary to tell.
    fn store_window(&self, now: u64) -> Option<i64> {
        let reading = (*self.store_clock.lock().unwrap_or_else(|p| p.into_inner()))?;
        let age = now.checked_sub(reading.at_us)?;
        if age > STORE_CLOCK_FRESH_US {
            return None;
        }
        let config = self.config.load();
        let err = reading.error_us
            + config.clock_margin.as_micros() as u64
            + self.time.tick_us()
            + sync::drift_us(age);
        let store_now = now.checked_add_signed(reading.offset_us)?;
        let period = self.params.period_us;
        let early = store_now.saturating_sub(err) / period;
        let late = (store_now + err) / period;
        (early == late).then_some(early as i64)
    }

    /// Optimistic mode: admit on credit if this process's unreported debt
    /// for the key stays within `max_debt` and belongs to one window; the
    /// window it is charged to (0 for a bucket).
    fn try_credit(&self, slot: &Slot, cost: u64, now: u64, max_debt: u64) -> Option<i64> {
        // Window leases: near a boundary the debt could land in either
        // window, so no credit there, and each window's overshoot stays
        // attributable. Before the key's first lease, the window comes
        // from the store's clock as the last reply of any key showed it;
        // with no reply yet, no credit (debt charged to whatever window
        // the store is in when the report lands would hide overshoot).
        let windowed = self.leases.windowed();
        let window = if windowed {
            match slot.window_at(now, self.params.period_us) {
                Some(UNKNOWN_WINDOW) => self.store_window(now)?,
                Some(window) => window,
                None => return None,
            }
        } else {
            0
        };
        // Credit is taken only where the store's last word on this window
        // leaves room for it beyond the refill in flight: past that it
        // would be overshoot for certain, and the request waits for the
        // refill's answer instead.
        let mut room = max_debt;
        if windowed && window == slot.window.load(Ordering::Acquire) {
            let left = u64::from(slot.store_remaining.load(Ordering::Relaxed));
            let asked = slot.books().sizing.last_want();
            room = room.min(left.saturating_sub(asked));
        }
        let queued = if self.outstanding.is_empty() {
            0
        } else {
            match self.outstanding.get(&self.store_key(slot)) {
                None => 0,
                Some(ledger) if !windowed => ledger.pending,
                Some(ledger) if window <= ledger.closed_through => return None,
                Some(ledger) if window == ledger.window => ledger.used,
                Some(_) => 0,
            }
        };
        if !slot.take_credit(window, cost, room.saturating_sub(queued)) {
            return None;
        }
        self.counters.credit_admitted.add(cost);
        Some(window)
    }

    /// Takes a slot out of service: valid permits go back to the store,
    /// debt is queued for reporting, expired permits count as stranded.
    fn retire(&self, slot: &Slot, now: u64) {
        let Retired {
            credit,
            closed,
            origin,
            permits,
            window,
            deadline,
            next,
        } = slot.retire();
        let valid = now < deadline;
        let permits = permits as u64;
        let store_key = self.store_key(slot);
        if credit.debt > 0 || credit.in_flight > 0 || closed != i64::MIN {
            let mut ledger = self.outstanding.entry(store_key.clone()).or_default();
            if credit.window > ledger.window {
                ledger.window = credit.window;
                ledger.used = 0;
            }
            // Queued debt is added by `queue_report` below.
            if credit.window == ledger.window {
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
            self.give_back(&store_key, next.permits.max(0) as u64, next.window, origin);
        }
        if credit.debt > 0 {
            let op = self.ops.next();
            self.queue_report(DebtReport {
                key: store_key,
                debt: u64::from(credit.debt),
                window: credit.window,
                op,
                attempts: 0,
                not_before: 0,
                first_sent: None,
            });
        }
    }

    /// Queues debt for reporting under its identity, and counts it against
    /// the key's credit until the store has it.
    fn queue_report(&self, report: DebtReport) {
        {
            let mut ledger = self.outstanding.entry(report.key.clone()).or_default();
            ledger.pending += report.debt;
            if self.leases.windowed() {
                if report.window > ledger.window {
                    ledger.window = report.window;
                    ledger.used = 0;
                }
                if report.window == ledger.window {
                    ledger.used += report.debt;
                }
                ledger.at_us = self.time.precise_us();
            }
        }
        self.reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(report);
    }

    /// The store has a queued report (or refused it for good).
    fn report_settled(&self, report: &DebtReport) {
        if let Some(mut ledger) = self.outstanding.get_mut(&report.key) {
            ledger.pending = ledger.pending.saturating_sub(report.debt);
        }
        // Buckets have no window to remember: a settled ledger is done.
        // Window ledgers are pruned once their window has passed.
        let bucket = !self.leases.windowed();
        self.outstanding
            .remove_if(&report.key, |_, l| l.pending == 0 && bucket);
    }

    /// Forgets fixed-window ledgers whose window has surely ended.
    fn prune_ledgers(&self, now: u64) {
        if self.outstanding.is_empty() {
            return;
        }
        let stale = 2 * self.params.period_us + self.config.load().clock_margin.as_micros() as u64;
        self.outstanding
            .retain(|_, l| l.pending > 0 || now.saturating_sub(l.at_us) < stale);
    }

    /// The slot's store key, encoded when the sync task needs it rather
    /// than kept in every slot.
    fn store_key(&self, slot: &Slot) -> String {
        self.keys.store_key(&slot.key, self.params.algorithm)
    }

    fn give_back(&self, store_key: &str, permits: u64, window: i64, origin: LeaseOrigin) {
        if permits == 0 || (window == UNKNOWN_WINDOW && self.leases.windowed()) {
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
        self.returns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(call);
    }
}

#[cfg(test)]
mod tests;
