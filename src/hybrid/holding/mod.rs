//! One key's local state: atomics the request path reads and writes.
//!
//! The request path touches only atomics here (no allocation), except at
//! a window's boundary (a promotion, a take across it) and when a
//! thread's stock goes back, which take the `next` lock; the two mutexes
//! are otherwise for the slow path and the sync task, are taken `next`
//! before `books` where both are held, and are never held across an
//! await. A holding never talks to the store.

use std::sync::Arc;

use self::atomics::{
    AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Mutex, MutexGuard, Ordering,
};
use self::denial::DenialCell;
use crate::algorithm::LeaseOrigin;
use crate::hybrid::policy::Sizing;

mod books;
mod credit;
mod denial;
mod install;
mod next;
mod refill;
mod take;

pub(crate) use self::books::Books;
pub(crate) use self::credit::Credit;
pub(crate) use self::denial::RetryHint;
pub(crate) use self::install::{Grant, Installed, Trimmed, WindowAt};
#[cfg(test)]
use self::next::Across;
pub(crate) use self::next::NextLease;
pub(crate) use self::take::{Spare, Take};

/// The holding's atomics and locks: loom's under `--cfg loom` (see the
/// `model` tests below), so every interleaving of its methods can be
/// explored; the standard library's otherwise.
mod atomics {
    #[cfg(loom)]
    pub(super) use loom::sync::atomic::{
        AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering,
    };
    #[cfg(loom)]
    pub(super) use loom::sync::{Mutex, MutexGuard};
    #[cfg(not(loom))]
    pub(super) use std::sync::atomic::{
        AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering,
    };
    #[cfg(not(loom))]
    pub(super) use std::sync::{Mutex, MutexGuard};
}

/// The `last_used` word: milliseconds `ms`, and `cost` (clamped to a
/// `u32`).
fn used_word(ms: u32, cost: u64) -> u64 {
    (u64::from(ms) << 32) | cost.clamp(1, u64::from(u32::MAX))
}

/// Local µs as wrapping milliseconds (idle times are far below 49 days).
fn millis(us: u64) -> u32 {
    (us / 1_000) as u32
}

/// A window index, or none, in one word: what the holding's window cell
/// holds (one atomic load on the request path) and its books' window
/// closed to credit (a holding's size is part of the bytes-per-key budget,
/// and an `Option<i64>` takes two words). Window indices are never
/// negative (`floor(store µs / period)`; buckets use 0), so a negative
/// word is none; it is made and read here alone, through
/// [`of`](MaybeWindow::of) and [`get`](MaybeWindow::get).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MaybeWindow(i64);

impl MaybeWindow {
    const NONE: MaybeWindow = MaybeWindow(-1);

    /// `window` (a negative one is none).
    fn of(window: i64) -> MaybeWindow {
        MaybeWindow(window.max(Self::NONE.0))
    }

    /// The window, if any.
    #[inline]
    fn get(self) -> Option<i64> {
        (self.0 >= 0).then_some(self.0)
    }
}

/// The window the holding's permits belong to (see [`MaybeWindow`]).
#[derive(Debug)]
struct WindowCell(AtomicI64);

impl WindowCell {
    fn new() -> Self {
        WindowCell(AtomicI64::new(MaybeWindow::NONE.0))
    }

    /// The word as read: compared as such (an install published in
    /// between changes it), decoded by [`MaybeWindow::get`].
    #[inline]
    fn load(&self, order: Ordering) -> MaybeWindow {
        MaybeWindow(self.0.load(order))
    }

    fn store(&self, window: i64, order: Ordering) {
        self.0.store(MaybeWindow::of(window).0, order);
    }
}

pub(crate) struct Holding {
    /// The user key, shared with the map's key (no second copy).
    key: Arc<str>,
    /// Permits held locally, all granted by the store.
    permits: AtomicI64,
    /// Local µs at which the permits become void (window end or lease
    /// horizon, minus the margin).
    deadline: AtomicU64,
    /// The window index the permits belong to (buckets: 0), or none
    /// before the first lease.
    window: WindowCell,
    /// Fixed window: local µs by which `window` has surely ended (its
    /// latest possible end plus the margin). Token bucket and GCRA: local
    /// µs at which the bucket is full again, per the store. Either way,
    /// when the quota is whole again (`Decision::reset_after`).
    window_end: AtomicU64,
    /// Below this many permits, a refill is requested.
    low_water: AtomicU32,
    /// Within the limiter's early-refill lead of the deadline, a refill
    /// (fixed window: a pre-lease of the next window; bucket: a renewal)
    /// is requested even above the low-water mark. Off after the store
    /// had nothing to give, until the next lease.
    early_refill: AtomicBool,
    /// The store said the key is exhausted until this local µs, by an
    /// ask's answer (definitive) or a peek's (see `peek_trust`).
    denied_until: DenialCell,
    /// How much later (ms) than `denied_until` (a re-check, never a hint)
    /// the request can succeed as far as the store said: what a denial
    /// tells the client (see [`Holding::deny_for`]).
    retry_later_ms: AtomicU32,
    /// The cost the store's answer behind the hint was for: a bucket's
    /// hint for a larger cost is later by the larger cost's refill.
    hint_cost: AtomicU32,
    /// When `denied_until` is a peek's (the window was found fully
    /// leased while the holding still held permits of it), it is believed
    /// only if the holding runs out before this local µs and within the
    /// window's lease; then it stands as an ask's would (made even).
    peek_trust: AtomicU64,
    /// Where the holding's one refill is: a [`refill::Refill`] (see
    /// `refill.rs`, which owns every transition).
    refill: AtomicU8,
    /// Fixed window: maintenance found the key active near its window's
    /// end and queued a pre-lease of the next window.
    swept_ahead: AtomicBool,
    /// The last refill failed: the failure policy applies once local
    /// permits are gone.
    refill_failed: AtomicBool,
    /// Removed from the map; whoever still holds it must look the key up again.
    evicted: AtomicBool,
    /// Asked (and denied from what it knows) since maintenance last
    /// looked: in use, so not evicted, though idle for trims.
    asked: AtomicBool,
    /// Largest cost a waiting request needs (so the next lease covers it).
    need: AtomicU32,
    /// Last use, local milliseconds (wrapping), for idle eviction (the
    /// high half), and the cost of the request that used it then (the low
    /// half: the rate in permits says how often requests come only with
    /// it). One word: written together, and the holding stays its size.
    last_used: AtomicU64,
    /// What the store last said remains unleased.
    /// (Saturating: a header value, not an accounting one.)
    store_remaining: AtomicU32,
    /// Whether `next` holds a lease (checked without the lock). Set and
    /// cleared only under the `next` lock, by the methods below.
    has_next: AtomicBool,
    /// A hash of the key, fixed at creation: where maintenance's sweep
    /// and a boundary's spread place the holding (see [`Holding::place`]).
    place: u16,
    /// A pre-leased slice of the next window. Boxed: most holdings never
    /// hold one, and a box is one word.
    next: Mutex<Option<Box<NextLease>>>,
    /// Credit and sizing: the slow path's and the sync task's, behind one
    /// lock to keep the holding small.
    books: Mutex<Books>,
}

/// What a retired holding leaves behind: its unreported credit, the last
/// window closed to credit, and the origin of its bucket lease.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retired {
    pub(crate) credit: Credit,
    /// The last window closed to credit, if any.
    pub(crate) closed: Option<i64>,
    pub(crate) origin: LeaseOrigin,
    /// The permits held, their window (if any) and deadline.
    pub(crate) permits: i64,
    pub(crate) window: Option<i64>,
    pub(crate) deadline: u64,
    /// A pre-leased slice of the next window, if any.
    pub(crate) next: Option<NextLease>,
}

/// FNV-1a over the key, folded to 32 bits. From the key, not the
/// holding's address: the sweep then visits a key at the same point of
/// every run, so a seeded simulation replays the same way whatever else
/// the thread allocated before. (Keys chosen to share one place only make
/// one slice of the sweep as long as a full walk.)
fn place_of(key: &str) -> u16 {
    let h = key.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    });
    let h = h ^ h >> 32;
    (h ^ h >> 16) as u16
}

impl Holding {
    /// A number fixed for the key (see `place_of`), spread evenly over
    /// `u16` (two bytes the holding had as padding): maintenance's sweep
    /// slice and a boundary's spread derive from it.
    #[inline]
    pub(crate) fn place(&self) -> u16 {
        self.place
    }

    pub(crate) fn new(key: Arc<str>, now: u64) -> Self {
        Holding {
            place: place_of(&key),
            key,
            permits: AtomicI64::new(0),
            deadline: AtomicU64::new(0),
            window: WindowCell::new(),
            window_end: AtomicU64::new(0),
            low_water: AtomicU32::new(0),
            early_refill: AtomicBool::new(false),
            denied_until: DenialCell::new(),
            retry_later_ms: AtomicU32::new(0),
            hint_cost: AtomicU32::new(1),
            peek_trust: AtomicU64::new(0),
            refill: AtomicU8::new(refill::Refill::Idle as u8),
            swept_ahead: AtomicBool::new(false),
            refill_failed: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            asked: AtomicBool::new(false),
            need: AtomicU32::new(0),
            last_used: AtomicU64::new(used_word(millis(now), 1)),
            store_remaining: AtomicU32::new(0),
            has_next: AtomicBool::new(false),
            next: Mutex::new(None),
            books: Mutex::new(Books {
                credit: Credit::default(),
                credit_closed: MaybeWindow::NONE,
                sizing: Sizing::default(),
                origin: LeaseOrigin::default(),
                newest: LeaseOrigin::default(),
                newest_granted: 0,
                granted_at: 0,
                lost_lease: 0,
                ahead_asked: 0,
                used_up: u32::MAX,
            }),
        }
    }

    /// The key this holding holds permits of.
    pub(crate) fn key(&self) -> &Arc<str> {
        &self.key
    }

    /// Permits held now (void once the deadline has passed).
    #[inline]
    pub(crate) fn permits(&self) -> i64 {
        self.permits.load(Ordering::Acquire)
    }

    /// The local time the permits held stop being spendable alone (0:
    /// none held).
    pub(crate) fn deadline(&self) -> u64 {
        self.deadline.load(Ordering::Acquire)
    }

    /// The window the permits held belong to (buckets: 0), if a lease
    /// was ever installed.
    pub(crate) fn window(&self) -> Option<i64> {
        self.window.load(Ordering::Acquire).get()
    }

    /// The local time the current window ends, as the last reply placed it.
    #[inline]
    pub(crate) fn window_end(&self) -> u64 {
        self.window_end.load(Ordering::Relaxed)
    }

    /// Buckets have no window: the time their bucket is full again (local
    /// µs), kept where a window's end is, for `reset_after`.
    pub(crate) fn set_bucket_full_at(&self, at: u64) {
        self.window_end.store(at, Ordering::Relaxed);
    }

    /// Below this many permits a take asks for a refill.
    pub(crate) fn low_water(&self) -> i64 {
        i64::from(self.low_water.load(Ordering::Relaxed))
    }

    /// Sets the refill mark of the permits in place.
    pub(crate) fn set_low_water(&self, low_water: u32) {
        self.low_water.store(low_water, Ordering::Relaxed);
    }

    /// No refill ahead of need: neither at a mark nor near the lease's
    /// end (the store has nothing more to give, or no one to give it to).
    pub(crate) fn no_early_refill(&self) {
        self.early_refill.store(false, Ordering::Relaxed);
    }

    /// Whether the holding has left the map: nothing may be installed in it.
    #[inline]
    pub(crate) fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// The holding leaves the map (see [`retire`](Holding::retire)).
    #[cfg(test)]
    pub(crate) fn mark_evicted(&self) {
        self.evicted.store(true, Ordering::Release);
    }

    /// The last refill failed: waiters decide by the failure policy.
    pub(crate) fn refill_failed(&self) -> bool {
        self.refill_failed.load(Ordering::Acquire)
    }

    /// Records whether the last refill failed.
    pub(crate) fn set_refill_failed(&self, failed: bool) {
        self.refill_failed.store(failed, Ordering::Release);
    }

    /// What the store last said it had not leased, for `remaining`.
    #[inline]
    pub(crate) fn store_remaining(&self) -> u64 {
        u64::from(self.store_remaining.load(Ordering::Relaxed))
    }

    /// A cold key's peek answered by the store: what remains, and when
    /// the quota is whole again (local µs). Later peeks answer from these
    /// (as a lease's would), without a store call each.
    pub(crate) fn note_peek(&self, remaining: u64, whole_at: u64) {
        self.set_store_remaining(remaining);
        self.window_end.store(whole_at.max(1), Ordering::Relaxed);
    }

    /// Records what the store last said it had not leased.
    pub(crate) fn set_store_remaining(&self, remaining: u64) {
        self.store_remaining
            .store(remaining.min(u64::from(u32::MAX)) as u32, Ordering::Relaxed);
    }

    /// A waiting request needs at least `cost` from the next refill.
    pub(crate) fn need_at_least(&self, cost: u64) {
        self.need
            .fetch_max(cost.min(u64::from(u32::MAX)) as u32, Ordering::AcqRel);
    }

    /// What waiting requests need from the refill being sent, cleared.
    pub(crate) fn take_need(&self) -> u64 {
        u64::from(self.need.swap(0, Ordering::AcqRel))
    }

    /// A sweep leased the next window ahead for this holding.
    pub(crate) fn mark_swept_ahead(&self) {
        self.swept_ahead.store(true, Ordering::Release);
    }

    /// Whether a sweep leased ahead since the last refill was sent, cleared.
    pub(crate) fn take_swept_ahead(&self) -> bool {
        self.swept_ahead.swap(false, Ordering::AcqRel)
    }

    /// Takes the holding out of service: marks it evicted, then collects its
    /// unreported credit (see [`take_credit`](Holding::take_credit)).
    ///
    /// The permits, their window and deadline and the pre-lease are taken
    /// under the `next` lock, which serialises installs and promotions: a
    /// pre-lease promoted at the same moment cannot make this window's
    /// leftovers look like the next window's.
    pub(crate) fn retire(&self) -> Retired {
        self.evicted.store(true, Ordering::Release);
        let (permits, window, deadline, next) = {
            let mut next = self.next_lock();
            let permits = self.permits.swap(0, Ordering::AcqRel).max(0);
            let window = self.window.load(Ordering::Acquire).get();
            let deadline = self.deadline.load(Ordering::Acquire);
            self.has_next.store(false, Ordering::Release);
            (permits, window, deadline, next.take().map(|n| *n))
        };
        let mut books = self.books();
        let debt = std::mem::take(&mut books.credit.debt);
        Retired {
            credit: Credit {
                debt,
                window: books.credit.window,
                in_flight: books.credit.in_flight,
                recalled: books.credit.recalled,
            },
            closed: books.credit_closed.get(),
            origin: books.origin,
            permits,
            window,
            deadline,
            next,
        }
    }

    /// Records use by a request of `cost` for idle eviction, without
    /// writing the shared line on every decision.
    #[inline]
    pub(crate) fn touch(&self, now: u64, cost: u64) {
        let ms = millis(now);
        if (self.last_used.load(Ordering::Relaxed) >> 32) as u32 != ms {
            self.last_used.store(used_word(ms, cost), Ordering::Relaxed);
        }
    }

    /// Records a request denied from what the holding knows: the key is in
    /// use (see [`Holding::take_asked`]).
    #[inline]
    pub(crate) fn mark_asked(&self) {
        if !self.asked.load(Ordering::Relaxed) {
            self.asked.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the key was asked since the last call (which forgets it).
    pub(crate) fn take_asked(&self) -> bool {
        self.asked.load(Ordering::Relaxed) && self.asked.swap(false, Ordering::Relaxed)
    }

    /// The usual time between requests, µs, by `rate` (permits per µs)
    /// and the cost of a recent request; `None` without a rate.
    pub(crate) fn request_gap_us(&self, rate: f64) -> Option<f64> {
        let cost = self.last_used.load(Ordering::Relaxed) as u32;
        (rate > 0.0).then(|| f64::from(cost.max(1)) / rate)
    }

    /// Milliseconds since last use.
    ///
    /// A holding touched after `now` was read (a request racing the
    /// maintenance walk) has a `last_used` ahead of `now`: that is no idle
    /// time at all, not 49 days of it.
    pub(crate) fn idle_ms(&self, now: u64) -> u64 {
        let used = (self.last_used.load(Ordering::Relaxed) >> 32) as u32;
        let since = millis(now).wrapping_sub(used);
        if since > u32::MAX / 2 {
            0
        } else {
            u64::from(since)
        }
    }

    pub(crate) fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Within `lead` of the current lease's deadline, with early refills on.
    #[inline]
    pub(crate) fn near_end(&self, now: u64, lead: u64) -> bool {
        lead > 0
            && self.early_refill.load(Ordering::Relaxed)
            && now + lead >= self.deadline.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::TimeSource;

    /// A grant of `permits` of `window`, void at `deadline`, the window
    /// surely ended at `window_end`.
    pub(super) fn lease(permits: i64, window: i64, deadline: u64, window_end: u64) -> Grant {
        Grant {
            permits,
            window,
            deadline,
            window_end,
            renew: false,
        }
    }

    #[test]
    fn a_give_back_answers_to_the_newest_grant_while_it_has_room() {
        use crate::algorithm::LeaseOrigin;
        let holding = Holding::new(Arc::from("k"), 0);
        let old = LeaseOrigin {
            at_us: 100,
            level: 1_000,
            given_back: 100,
        };
        let new = LeaseOrigin {
            at_us: 200,
            level: 1,
            given_back: 100,
        };
        let mut books = holding.books();
        books.set_origin(old, 3, false, 1);
        books.set_origin(new, 2, true, 2);
        // The two of the newest grant, then the merged (cautious) origin.
        assert_eq!(books.origin_for(1), new);
        assert_eq!(books.origin_for(1), new);
        let merged = books.origin_for(1);
        assert_eq!((merged.at_us, merged.level), (100, 1_000));
        // More than the newest grant at once: the merged origin.
        books.set_origin(new, 2, false, 3);
        assert_eq!(books.origin_for(3), new.merge(new));
    }

    /// The same, as a renewal: it replaces what is held.
    pub(super) fn renewal(permits: i64, window: i64, deadline: u64, window_end: u64) -> Grant {
        Grant {
            renew: true,
            ..lease(permits, window, deadline, window_end)
        }
    }

    use crate::clock::FakeClock;
    use std::sync::Arc;
    use std::time::Duration;

    fn at(us: u64) -> TimeSource {
        TimeSource::Precise(Arc::new(FakeClock::new(Duration::from_micros(us))))
    }

    #[test]
    fn a_refill_is_asked_sent_and_settled_once() {
        let holding = Holding::new("k".into(), 0);
        assert!(holding.enqueue(false), "an idle holding queues its ask");
        assert!(!holding.enqueue(false), "asked already");
        assert!(holding.enqueue(true), "a waiter adds an entry to its queue");
        assert!(!holding.enqueue(true), "one waiters' entry");
        assert!(holding.send_queued(), "the first entry taken is sent");
        assert!(!holding.send_queued(), "the other is a duplicate");
        assert!(holding.refill_in_flight() && !holding.enqueue(true));
        assert!(!holding.send_unasked(), "no ride while one is on its way");
        holding.refill_done();
        assert!(
            !holding.refill_pending() && !holding.send_queued(),
            "a stale entry"
        );
        assert!(holding.send_unasked(), "a ride when none is asked for");
        assert!(!holding.enqueue(false) && holding.refill_in_flight());
        holding.refill_done();
        assert!(!holding.refill_pending());
    }

    #[test]
    fn a_peeks_denial_is_believed_only_while_fresh_and_never_erases_an_asks() {
        let holding = Holding::new("k".into(), 0);
        holding.install(lease(5, 7, 100, 103), 10);
        // Fresh (before the trust and the deadline): it stands, and from
        // then on as an ask's would.
        holding.deny_on_peek(1_000, 50);
        assert_eq!(holding.denied(40), Some(1_002));
        assert_eq!(holding.denied(60), Some(1_002), "latched");
        // Stale: forgotten, so the holding asks.
        holding.deny_on_peek(1_000, 50);
        assert_eq!(holding.denied(60), None);
        assert_eq!(holding.denied_until(), None);
        // Past the window's lease: forgotten too.
        holding.deny_on_peek(1_000, 500);
        assert_eq!(holding.denied(100), None);
        // An ask's answer stored over a peek's, even to the same µs, is
        // not the value a stale peek's forgetting may clear.
        holding.deny_on_peek(1_000, 50);
        holding.deny_until(1_000);
        assert_eq!(holding.denied(60), Some(1_000));
        assert_eq!(holding.denied(60), Some(1_000));
    }

    #[test]
    fn permits_are_spent_only_before_the_deadline() {
        let holding = Holding::new("k".into(), 0);
        assert!(matches!(holding.take(1, &at(10)), Take::Empty));
        holding.install(lease(3, 7, 100, 103), 10);
        assert!(matches!(
            holding.take(2, &at(50)),
            Take::Taken { left: 1, .. }
        ));
        assert!(matches!(holding.take(2, &at(50)), Take::Empty));
        // Past the deadline the last permit is void: taken and lost.
        assert!(
            matches!(holding.take(1, &at(100)), Take::Late { lost: 1, .. }),
            "deadline passed"
        );
        assert_eq!(holding.expire(100), 0);
    }

    #[test]
    fn a_lagging_fast_clock_never_spends_past_the_deadline() {
        // The fast clock reads 40 µs behind the precise one, within the
        // 50 µs guard: near the deadline the precise clock decides.
        let holding = Holding::new("k".into(), 0);
        holding.install(lease(3, 7, 100, 103), 10);
        let fast = Arc::new(FakeClock::new(Duration::from_micros(70)));
        let precise = Arc::new(FakeClock::new(Duration::from_micros(110)));
        let time = TimeSource::split(fast, precise, Duration::from_micros(50));
        assert!(!matches!(holding.take(1, &time), Take::Taken { .. }));
    }

    #[test]
    fn a_thread_preempted_across_the_deadline_gets_nothing() {
        // The clock passes the deadline between the check and the swap:
        // modelled by a clock that moves on every read.
        #[derive(Clone)]
        struct Ticking(Arc<std::sync::atomic::AtomicU64>);
        impl crate::clock::Clock for Ticking {
            fn now(&self) -> Duration {
                Duration::from_micros(self.0.fetch_add(60, Ordering::SeqCst))
            }
        }
        let holding = Holding::new("k".into(), 0);
        holding.install(lease(3, 7, 100, 103), 10);
        // The clock is read after the swap: the thread decides at 110 µs,
        // past the 100 µs deadline it read before being preempted.
        let time = TimeSource::Precise(Arc::new(Ticking(Arc::new(110.into()))));
        assert!(matches!(holding.take(1, &time), Take::Late { lost: 1, .. }));
        assert_eq!(
            holding.permits.load(Ordering::Acquire),
            2,
            "the permit is void"
        );
    }

    #[test]
    fn a_holding_touched_after_the_walk_read_the_clock_is_not_idle() {
        let holding = Holding::new("k".into(), 0);
        holding.touch(5_000_000, 1);
        assert_eq!(holding.idle_ms(4_999_000), 0, "touched 1 ms after now");
        assert_eq!(holding.idle_ms(7_000_000), 2_000);
    }

    #[test]
    fn a_grant_for_the_same_window_adds_and_a_new_window_replaces() {
        let holding = Holding::new("k".into(), 0);
        holding.install(lease(3, 7, 100, 103), 10);
        assert_eq!(holding.install(lease(2, 7, 200, 203), 20), Installed::Added);
        assert!(matches!(
            holding.take(5, &at(30)),
            Take::Taken { left: 0, .. }
        ));
        holding.install(lease(3, 7, 100, 103), 40);
        // window 8 replaces window 7's leftovers, which are handed back
        assert_eq!(
            holding.install(lease(4, 8, 200, 203), 150),
            Installed::Replaced(3)
        );
        assert!(matches!(
            holding.take(4, &at(160)),
            Take::Taken { left: 0, .. }
        ));
    }

    #[test]
    fn a_late_reply_for_an_ended_window_does_not_replace_the_next_one() {
        // Window 8 is promoted; a reply for window 7 (asked before the
        // promotion) lands afterwards: refused, window 8 untouched.
        let holding = Holding::new("k".into(), 0);
        holding.install(renewal(5, 8, 200, 203), 110);
        assert_eq!(
            holding.install(lease(4, 7, 100, 103), 120),
            Installed::Stale(4)
        );
        assert_eq!(holding.window(), Some(8));
        assert_eq!(holding.deadline.load(Ordering::Acquire), 200);
        assert!(matches!(
            holding.take(5, &at(130)),
            Take::Taken { left: 0, .. }
        ));
    }

    fn with_next(current: i64, next: i64) -> Holding {
        // Window 7 surely runs until 100 and has surely ended at 103;
        // window 8's slice may be spent alone from 106.
        let holding = Holding::new("k".into(), 0);
        holding.install(lease(current, 7, 100, 103), 10);
        holding.hold_next(NextLease {
            permits: next,
            window: 8,
            start: 106,
            deadline: 200,
            window_end: 203,
            low_water: 0,
        });
        holding
    }

    /// `take_across` at `now`, the clock reading `now` again after.
    fn across(holding: &Holding, cost: i64, now: u64, paid: Option<i64>) -> Across {
        holding.take_across(cost, now, paid, || now)
    }

    #[test]
    fn across_a_boundary_both_windows_pay() {
        let holding = with_next(3, 5);
        // Before the deadline the current window's permits are the ones
        // to spend: nothing is taken across.
        assert_eq!(across(&holding, 1, 99, None).left, None);
        // Between the deadline and the sure end: one of each.
        let a = across(&holding, 2, 100, None);
        assert_eq!(
            (a.left, a.window, a.stranded),
            (Some(3), 8, 2),
            "two of window 8 left, two of window 7 stranded"
        );
        assert_eq!(holding.permits.load(Ordering::Acquire), 1);
        // The current window has too few for the cost: nothing is taken.
        assert_eq!(across(&holding, 2, 102, None).left, None);
        assert_eq!(holding.next_permits(), 3);
        assert_eq!(holding.permits.load(Ordering::Acquire), 1);
        // Window 7 has surely ended: window 8's slice alone pays, before
        // its (later) start.
        let a = across(&holding, 2, 103, None);
        assert_eq!((a.left, a.stranded), (Some(1), 0));
        assert_eq!(holding.permits.load(Ordering::Acquire), 1);
        // The next window's slice has too few.
        assert_eq!(across(&holding, 2, 104, None).left, None);
    }

    #[test]
    fn a_late_take_of_the_current_window_pays_its_side() {
        let holding = with_next(3, 5);
        // A late take of window 7 took the cost already: only window 8's
        // slice pays now.
        let a = across(&holding, 1, 101, Some(7));
        assert_eq!((a.left, a.stranded), (Some(4), 0));
        assert_eq!(holding.permits.load(Ordering::Acquire), 3);
        // A late take of another window pays nothing here.
        let a = across(&holding, 1, 101, Some(6));
        assert_eq!((a.left, a.stranded), (Some(3), 1));
        assert_eq!(holding.permits.load(Ordering::Acquire), 2);
    }

    #[test]
    fn a_thread_preempted_past_the_slices_deadline_spends_nothing_across() {
        let holding = with_next(3, 5);
        // The clock read after the take is past window 8's deadline: what
        // was taken is stranded, nothing admitted.
        let a = holding.take_across(1, 101, None, || 200);
        assert_eq!((a.left, a.stranded), (None, 2));
        assert_eq!(holding.permits.load(Ordering::Acquire), 2);
        assert_eq!(holding.next_permits(), 4);
    }

    #[test]
    fn nothing_is_taken_across_unless_the_next_window_follows_the_current() {
        // A slice of window 9 with window 7's permits in place: window 8
        // lies between, unpaid.
        let holding = Holding::new("k".into(), 0);
        holding.install(lease(3, 7, 100, 103), 10);
        holding.hold_next(NextLease {
            permits: 5,
            window: 9,
            start: 206,
            deadline: 300,
            window_end: 303,
            low_water: 0,
        });
        assert_eq!(across(&holding, 1, 101, None).left, None);
        assert_eq!(across(&holding, 1, 150, None).left, None);
        // No lease in place at all.
        let holding = Holding::new("k".into(), 0);
        assert_eq!(across(&holding, 1, 101, None).left, None);
        // Past the slice's own deadline.
        let holding = with_next(3, 5);
        assert_eq!(across(&holding, 1, 200, None).left, None);
        assert_eq!(holding.permits.load(Ordering::Acquire), 3);
        assert_eq!(holding.next_permits(), 5);
    }

    #[test]
    fn a_pre_lease_is_usable_only_from_its_start() {
        let holding = Holding::new("k".into(), 0);
        holding.install(lease(1, 7, 100, 103), 10);
        holding.hold_next(NextLease {
            permits: 5,
            window: 8,
            start: 106,
            deadline: 200,
            window_end: 203,
            low_water: 0,
        });
        assert_eq!(holding.promote(105), None);
        assert_eq!(holding.promote(106), Some(1));
        assert!(matches!(
            holding.take(5, &at(106)),
            Take::Taken { left: 0, .. }
        ));
        assert_eq!(holding.window_at(150, 100), WindowAt::In(8));
        assert_eq!(
            holding.window_at(200, 100),
            WindowAt::Boundary,
            "between deadline and sure end"
        );
        assert_eq!(holding.window_at(202, 100), WindowAt::Boundary);
        assert_eq!(holding.window_at(203, 100), WindowAt::In(9));
        assert_eq!(holding.window_at(299, 100), WindowAt::In(9));
        assert_eq!(holding.window_at(301, 100), WindowAt::Boundary);
        assert_eq!(holding.window_at(303, 100), WindowAt::In(10));
    }
}

/// Model checking of the request path against the sync task and the slow
/// path, with loom. `.ci/run` builds the library's tests with
/// `cargo rustc --lib --profile test -- --cfg loom`, which passes the cfg
/// to this crate alone (a global `RUSTFLAGS` would rebuild tokio for loom
/// too), then runs `hybrid::holding::model`.
#[cfg(all(test, loom))]
mod model {
    use super::tests::{lease, renewal};
    use super::*;
    use crate::clock::FakeClock;
    use crate::clock::TimeSource;
    use std::time::Duration;

    fn at(us: u64) -> TimeSource {
        TimeSource::Precise(Arc::new(FakeClock::new(Duration::from_micros(us))))
    }

    fn before_deadline() -> TimeSource {
        at(50)
    }

    /// Two requests spend while the sync task renews the lease: every
    /// permit is spent once or handed back as replaced, never both, never
    /// neither.
    /// Exhaustive up to three preemptions: enough for every interleaving
    /// of two spenders' load/compare-and-swap pairs against one install.
    fn explore(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(f);
    }

    #[test]
    fn take_against_a_renewal_conserves_permits() {
        explore(|| {
            let holding = loom::sync::Arc::new(Holding::new("k".into(), 0));
            holding.install(lease(2, 7, 100, 103), 10);
            let spenders: Vec<_> = (0..2)
                .map(|_| {
                    let holding = holding.clone();
                    loom::thread::spawn(move || {
                        matches!(holding.take(1, &before_deadline()), Take::Taken { .. }) as i64
                    })
                })
                .collect();
            let replaced = match holding.install(renewal(3, 8, 200, 203), 20) {
                Installed::Replaced(n) => n,
                Installed::Added | Installed::Stale(_) => {
                    unreachable!("a renewal replaces")
                }
            };
            let taken: i64 = spenders.into_iter().map(|t| t.join().unwrap()).sum();
            let left = holding.permits.load(Ordering::Acquire);
            assert_eq!(taken + replaced + left, 2 + 3, "{taken} {replaced} {left}");
            assert_eq!(holding.window(), Some(8));
        });
    }

    /// A pre-lease promoted by a request while a late reply for the
    /// ending window arrives: the newer window always wins.
    #[test]
    fn a_late_reply_never_replaces_a_promoted_window() {
        explore(|| {
            let holding = loom::sync::Arc::new(Holding::new("k".into(), 0));
            holding.install(lease(1, 7, 100, 103), 10);
            holding.hold_next(NextLease {
                permits: 5,
                window: 8,
                start: 60,
                deadline: 200,
                window_end: 203,
                low_water: 0,
            });
            let promoter = {
                let holding = holding.clone();
                loom::thread::spawn(move || holding.promote(70))
            };
            let late = holding.install(lease(4, 7, 100, 103), 70);
            promoter.join().unwrap();
            assert_eq!(holding.window(), Some(8));
            let permits = holding.permits.load(Ordering::Acquire);
            match late {
                // Landed first, on window 7's permits, then replaced.
                Installed::Added => assert_eq!(permits, 5),
                Installed::Stale(4) => assert_eq!(permits, 5),
                other => panic!("{other:?}"),
            }
        });
    }

    /// Across a boundary, a take across and a late take race for the
    /// current window's permits, and a promotion for the next window's:
    /// every permit is spent once, and every admission across was paid
    /// by both windows.
    #[test]
    fn a_take_across_races_a_late_take_and_a_promotion() {
        explore(|| {
            let holding = loom::sync::Arc::new(Holding::new("k".into(), 0));
            holding.install(lease(2, 7, 100, 103), 10);
            holding.hold_next(NextLease {
                permits: 3,
                window: 8,
                start: 103,
                deadline: 200,
                window_end: 203,
                low_water: 0,
            });
            let late = {
                let holding = holding.clone();
                loom::thread::spawn(move || match holding.take(1, &at(101)) {
                    Take::Late { lost, .. } => lost,
                    Take::Taken { .. } => 1,
                    Take::Empty => 0,
                })
            };
            let promoter = {
                let holding = holding.clone();
                loom::thread::spawn(move || holding.promote(104))
            };
            let across = holding.take_across(1, 101, None, || 101);
            let spent_late = late.join().unwrap();
            let replaced = promoter.join().unwrap().unwrap_or(0);
            let admitted = i64::from(across.left.is_some());
            // Every permit of both windows is accounted for once: spent or
            // lost by the late take, taken across (admitted or stranded),
            // replaced at the promotion, or still held.
            let held = holding.permits.load(Ordering::Acquire) + holding.next_permits();
            assert_eq!(
                spent_late + across.stranded + admitted + replaced + held,
                2 + 3
            );
            // An admission across (before window 7 surely ended) paid a
            // permit of each window.
            assert!(admitted == 0 || across.stranded == 1, "{across:?}");
        });
    }

    /// A request asking for a refill (then waiting on it) races the sync
    /// task taking the holding's queue entries: one refill is sent per ask,
    /// never two, and an ask no send took stays asked for.
    #[test]
    fn an_ask_and_a_wait_race_the_sends_of_their_entries() {
        explore(|| {
            let holding = loom::sync::Arc::new(Holding::new("k".into(), 0));
            let asker = {
                let holding = holding.clone();
                loom::thread::spawn(move || {
                    let first = holding.enqueue(false);
                    let second = holding.enqueue(true);
                    (first, second)
                })
            };
            let sent = [holding.send_queued(), holding.send_queued()];
            let (first, _) = asker.join().unwrap();
            assert!(first, "the first ask of an idle holding is queued");
            assert!(!(sent[0] && sent[1]), "one send per ask");
            if !sent.contains(&true) {
                assert!(
                    holding.refill_pending(),
                    "an ask no send took stays asked for"
                );
            }
        });
    }

    /// Credit taken while the holding is retired is either collected by the
    /// retirement (and reported) or refused: never lost.
    #[test]
    fn credit_is_collected_by_retire_or_refused() {
        explore(|| {
            let holding = loom::sync::Arc::new(Holding::new("k".into(), 0));
            let taker = {
                let holding = holding.clone();
                loom::thread::spawn(move || holding.take_credit(3, 1, 5))
            };
            let retired = holding.retire();
            let took = taker.join().unwrap();
            let after = holding.books().credit.debt;
            assert_eq!(u32::from(took), retired.credit.debt + after);
            assert_eq!(after, 0, "nothing taken after the holding was retired");
        });
    }
}

#[cfg(all(test, not(loom)))]
mod size {
    /// The holding's size is part of the bytes-per-key budget (docs/performance.md,
    /// Memory): growing it should be a decision, not an accident.
    #[test]
    fn a_holding_stays_within_its_budget() {
        let size = std::mem::size_of::<super::Holding>();
        // 152 + 24 for the origin of bucket leases (bounded give-backs)
        // + 8 for a lost lease's identity (its grant is claimed back)
        // + 8 for how long a peek's word is taken (no ask per holder of
        // a window others leased in full)
        // + 16 for what the key spent in this window and the last (a
        // window lease is earned by use)
        // + 8 for credit recalled from a lease call in flight (a denial
        // of another quota gives its credit back)
        // + 8 for the boundary a thin holder's pre-lease was asked for
        // (asked once a window, not on every maintenance tick)
        // + 8 (4 and padding) for the hint a cached denial tells, which a
        // re-check of the store may come before
        // + 32 for the newest bucket grant's origin and size (a give-back
        // answers to it alone: a permit undone into a lease that lapsed
        // was capped to nothing under the merged origin)
        // + 8 for when the last bucket grant was put in place (a permit
        // undone goes back into the lease it came from; a reply that
        // granted nothing no longer counts as one)
        // + 8 (4 and padding) for the cost of a recent request beside the
        // last use (an idle trim waits for several request gaps, not
        // permit gaps: a key of requests of 2,000 tokens gave its lease
        // back at every pause of a few milliseconds).
        assert!(size <= 280, "Holding grew to {size} bytes");
    }
}
