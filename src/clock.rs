//! Local time, injected.
//!
//! Local clocks never decide windows (the store's clock does); they measure
//! how long a leased permit stays valid and drive the per-process limiter.
//! Tests use [`FakeClock`] so that window, lease and refill logic runs
//! without sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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

/// Where the hybrid limiter reads time: a coarse clock advanced by a
/// background thread (one atomic load per decision), or an injected clock
/// read directly (tests, custom clocks).
#[derive(Clone)]
pub(crate) enum TimeSource {
    Coarse(Arc<Ticker>),
    Precise(Arc<dyn Clock>),
}

impl TimeSource {
    pub(crate) fn new(clock: Option<Arc<dyn Clock>>, coarse: bool) -> Self {
        match clock {
            Some(clock) => TimeSource::Precise(clock),
            None => match coarse.then(Ticker::acquire).flatten() {
                Some(ticker) => TimeSource::Coarse(ticker),
                None => TimeSource::Precise(Arc::new(SystemClock::new())),
            },
        }
    }

    /// Local time in µs, possibly up to a tick behind (the hot path).
    #[inline]
    pub(crate) fn now_us(&self) -> u64 {
        match self {
            TimeSource::Coarse(t) => t.state.now.load(Ordering::Relaxed),
            TimeSource::Precise(c) => micros(&**c),
        }
    }

    /// Local time in µs, read from the underlying clock (the sync task).
    pub(crate) fn precise_us(&self) -> u64 {
        match self {
            TimeSource::Coarse(t) => {
                let now = micros(&t.state.clock);
                t.state.now.fetch_max(now, Ordering::Relaxed);
                now
            }
            TimeSource::Precise(c) => micros(&**c),
        }
    }

    /// Within this many µs of a deadline, the hot path reads the precise
    /// clock: a starved ticker thread may lag by more than its tick.
    pub(crate) fn guard_us(&self) -> u64 {
        match self {
            TimeSource::Coarse(_) => COARSE_GUARD.as_micros() as u64,
            TimeSource::Precise(_) => 0,
        }
    }

    /// How far behind the hot path's reading may be, beyond scheduling.
    pub(crate) fn tick_us(&self) -> u64 {
        match self {
            TimeSource::Coarse(_) => TICK.as_micros() as u64,
            TimeSource::Precise(_) => 0,
        }
    }
}

const TICK: Duration = Duration::from_millis(1);

/// See [`TimeSource::guard_us`].
const COARSE_GUARD: Duration = Duration::from_millis(50);

struct TickerState {
    now: AtomicU64,
    stop: std::sync::atomic::AtomicBool,
    clock: SystemClock,
}

/// A process-wide coarse clock: one thread advances an atomic every
/// millisecond while at least one hybrid limiter holds a handle.
pub(crate) struct Ticker {
    state: Arc<TickerState>,
}

static TICKER: std::sync::Mutex<std::sync::Weak<Ticker>> =
    std::sync::Mutex::new(std::sync::Weak::new());

impl Ticker {
    /// The shared ticker, started if none runs; `None` if no thread can
    /// be started (the caller then reads the OS clock directly).
    fn acquire() -> Option<Arc<Ticker>> {
        let mut slot = TICKER.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ticker) = slot.upgrade() {
            return Some(ticker);
        }
        let clock = SystemClock::new();
        let state = Arc::new(TickerState {
            now: AtomicU64::new(micros(&clock)),
            stop: std::sync::atomic::AtomicBool::new(false),
            clock,
        });
        let thread_state = state.clone();
        let spawned = std::thread::Builder::new()
            .name("slicelimit-clock".into())
            .spawn(move || {
                while !thread_state.stop.load(Ordering::Relaxed) {
                    let now = micros(&thread_state.clock);
                    thread_state.now.fetch_max(now, Ordering::Relaxed);
                    std::thread::sleep(TICK);
                }
            });
        spawned.ok()?;
        let ticker = Arc::new(Ticker { state });
        *slot = Arc::downgrade(&ticker);
        Some(ticker)
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
    }
}
