//! Local time, injected.
//!
//! Local clocks never decide windows (the store's clock does); they measure
//! how long a leased permit stays valid and drive the per-process limiter.
//! Tests use [`FakeClock`] so that window, lease and refill logic runs
//! without sleeping: it moves only when the test moves it. (The
//! repository's simulations run on the test harness's virtual clock
//! instead, which follows Tokio's paused time, so timers and the clock
//! move together.)

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A monotonic source of time.
pub trait Clock: Send + Sync + 'static {
    /// Time elapsed since an origin fixed for the clock's lifetime. Never
    /// goes backwards.
    fn now(&self) -> Duration;
}

/// The real clock: monotonic, with its origin at the Unix epoch (read once at
/// construction), so the embedded store's windows line up with wall-clock
/// windows the way Redis' do.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    base: Instant,
    base_since_epoch: Duration,
}

impl SystemClock {
    /// A clock anchored at the current wall-clock time.
    pub fn new() -> Self {
        SystemClock {
            base: Instant::now(),
            base_since_epoch: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.base_since_epoch + self.base.elapsed()
    }
}

/// A clock that moves only when told to. Clones share one time.
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    micros: Arc<AtomicU64>,
}

impl FakeClock {
    /// A fake clock reading `start`.
    pub fn new(start: Duration) -> Self {
        FakeClock {
            micros: Arc::new(AtomicU64::new(start.as_micros() as u64)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.micros
            .fetch_add(by.as_micros() as u64, Ordering::SeqCst);
    }

    /// Sets the clock; a value earlier than the current reading is ignored,
    /// so the clock stays monotonic.
    pub fn set(&self, to: Duration) {
        self.micros
            .fetch_max(to.as_micros() as u64, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::SeqCst))
    }
}

pub(crate) fn micros(clock: &dyn Clock) -> u64 {
    clock.now().as_micros() as u64
}

/// The store's clock against the local one, as the last reply that read
/// it saw; the one record of it per quota of a limiter. The failure policy's
/// fallback counts its windows on it (read as a [`Clock`]: local time plus
/// the offset, so a store window does not straddle two fallback windows
/// of a process whose clock is off); the hybrid engine tells from it which
/// window the store is in before a key's first lease.
pub(crate) struct StoreClock {
    local: Arc<dyn Clock>,
    /// Store µs minus local µs (0 before any reading).
    offset_us: AtomicI64,
    reading: Mutex<Option<StoreReading>>,
}

/// One reading of the store's clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoreReading {
    /// Store µs minus local µs.
    pub(crate) offset_us: i64,
    /// Half the round trip it was read over: the reading's uncertainty.
    pub(crate) error_us: u64,
    /// Local µs when the reply came.
    pub(crate) at_us: u64,
}

impl StoreClock {
    pub(crate) fn new(local: Arc<dyn Clock>) -> StoreClock {
        StoreClock {
            local,
            offset_us: AtomicI64::new(0),
            reading: Mutex::new(None),
        }
    }

    /// The local clock it is read against.
    pub(crate) fn local(&self) -> &Arc<dyn Clock> {
        &self.local
    }

    /// The local clock's reading, µs.
    pub(crate) fn local_us(&self) -> u64 {
        micros(&*self.local)
    }

    /// A call sent at local µs `sent` and answered at `answered` read the
    /// store's clock as `store_us`: somewhere in between, so the middle,
    /// give or take half the round trip.
    pub(crate) fn observe(&self, sent: u64, answered: u64, store_us: u64) {
        let answered = answered.max(sent);
        let mid = sent + (answered - sent) / 2;
        let offset_us = store_us as i64 - mid as i64;
        self.offset_us.store(offset_us, Ordering::Relaxed);
        *self.reading.lock().unwrap_or_else(|p| p.into_inner()) = Some(StoreReading {
            offset_us,
            error_us: (answered - sent) / 2 + 1,
            at_us: answered,
        });
    }

    /// The last reading, if any.
    pub(crate) fn reading(&self) -> Option<StoreReading> {
        *self.reading.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Clock for StoreClock {
    fn now(&self) -> Duration {
        let local = micros(&*self.local);
        let offset = self.offset_us.load(Ordering::Relaxed);
        Duration::from_micros(local.saturating_add_signed(offset))
    }
}

/// Where the hybrid limiter reads time: the kernel's coarse monotonic
/// clock on the request path (a vDSO read, no syscall, no writes, updated
/// by the kernel on every timer tick, so it lags by at most one tick
/// whatever the process's threads are doing), or an injected clock read
/// directly (tests, custom clocks).
#[derive(Clone)]
pub(crate) enum TimeSource {
    /// `coarse + offset` is local time; the offset anchors the kernel clock
    /// to the system clock once.
    Coarse {
        offset: i64,
        precise: Arc<dyn Clock>,
    },
    Precise(Arc<dyn Clock>),
    /// A fast clock that may lag the precise one by up to `guard_us` (the
    /// simulation's way of starving the coarse clock).
    Split {
        fast: Arc<dyn Clock>,
        precise: Arc<dyn Clock>,
        guard_us: u64,
    },
}

/// The kernel's coarse monotonic clock, in µs.
#[inline]
fn kernel_coarse_us() -> u64 {
    let ticks = coarsetime::Instant::now_without_cache_update().as_ticks();
    // 32.32 fixed-point seconds.
    (ticks >> 32) * 1_000_000 + (((ticks & 0xffff_ffff) * 1_000_000) >> 32)
}

impl TimeSource {
    /// An injected clock read directly; else `local` (the limiter's system
    /// clock), through the kernel's coarse clock if `coarse`. Precise
    /// readings are `local`'s, so they compare with every other reading of
    /// it in the limiter.
    pub(crate) fn new(
        injected: Option<Arc<dyn Clock>>,
        coarse: bool,
        local: Arc<dyn Clock>,
    ) -> Self {
        match injected {
            Some(clock) => TimeSource::Precise(clock),
            None if coarse => {
                let offset = micros(&*local) as i64 - kernel_coarse_us() as i64;
                TimeSource::Coarse {
                    offset,
                    precise: local,
                }
            }
            None => TimeSource::Precise(local),
        }
    }

    /// A fast clock that may lag `precise` by up to `guard`.
    pub(crate) fn split(fast: Arc<dyn Clock>, precise: Arc<dyn Clock>, guard: Duration) -> Self {
        TimeSource::Split {
            fast,
            precise,
            guard_us: guard.as_micros() as u64,
        }
    }

    /// Local time in µs, possibly up to [`guard_us`](Self::guard_us) behind
    /// (the hot path). The kernel's coarse clock can also read up to one
    /// tick *ahead* (its anchoring to the system clock is off by up to a
    /// tick): fine against a deadline, where ahead only ends permits
    /// sooner, but a start (a pre-lease's) is read on
    /// [`precise_us`](Self::precise_us).
    #[inline]
    pub(crate) fn now_us(&self) -> u64 {
        match self {
            TimeSource::Coarse { offset, .. } => kernel_coarse_us().saturating_add_signed(*offset),
            TimeSource::Precise(c) => micros(&**c),
            TimeSource::Split { fast, .. } => micros(&**fast),
        }
    }

    /// Local time in µs, read from the underlying precise clock.
    pub(crate) fn precise_us(&self) -> u64 {
        match self {
            TimeSource::Coarse { precise, .. } => micros(&**precise),
            TimeSource::Precise(c) => micros(&**c),
            TimeSource::Split { precise, .. } => micros(&**precise),
        }
    }

    /// How far `now_us` may lag `precise_us`: within this many µs of a
    /// deadline, the hot path reads the precise clock. For the kernel's
    /// coarse clock: one timer tick (at most 10 ms at HZ=100) plus the
    /// anchoring error (another tick), with a wide margin.
    pub(crate) fn guard_us(&self) -> u64 {
        match self {
            TimeSource::Coarse { .. } => COARSE_GUARD.as_micros() as u64,
            TimeSource::Precise(_) => 0,
            TimeSource::Split { guard_us, .. } => *guard_us,
        }
    }

    /// The time now (as [`now_us`](Self::now_us) reads it) if a permit
    /// whose deadline is `deadline` is still valid, else `None`.
    #[inline]
    pub(crate) fn valid_until(&self, deadline: u64) -> Option<u64> {
        let now = self.now_us();
        (now < deadline && (now + self.guard_us() < deadline || self.precise_us() < deadline))
            .then_some(now)
    }

    /// Granularity subtracted from lease deadlines besides the margin.
    pub(crate) fn tick_us(&self) -> u64 {
        match self {
            TimeSource::Coarse { .. } => TICK.as_micros() as u64,
            TimeSource::Precise(_) | TimeSource::Split { .. } => 0,
        }
    }
}

const TICK: Duration = Duration::from_millis(1);

/// See [`TimeSource::guard_us`].
const COARSE_GUARD: Duration = Duration::from_millis(50);
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
