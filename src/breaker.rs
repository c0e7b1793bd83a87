//! The circuit breaker: stops calls to a store (a node, a cluster
//! primary) that keeps failing, probes it after a back-off, and says when
//! a connection looks wedged.
//!
//! It runs on an injected [`Clock`], so its windows and back-offs are
//! tested without sleeping. It knows nothing of stores, policies or
//! decisions: the Redis store holds one per node and asks it before every
//! call; the failure layer above only reads its state.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::micros;
use crate::clock::Clock;
use crate::error::{Error, ErrorKind};

/// The state of a store's circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CircuitState {
    /// Calls go to the store.
    Closed,
    /// Calls fail at once without reaching the store, until the back-off
    /// ends.
    Open,
    /// One probe call is in flight; the others fail at once.
    HalfOpen,
}

impl CircuitState {
    /// A short, stable name, usable as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }
}

/// When the breaker opens and for how long.
///
/// The breaker opens on *sustained* unavailability (timeouts, connection
/// errors, a server that says it cannot serve), never on a burst: one short
/// stall of a busy server can time out thousands of queued calls at the same
/// instant while the server is healthy, and a rule that counts consecutive
/// failures would open on it. So failures are counted by time, not only by
/// number. The last [`window`](CircuitConfig::window) is cut into 20
/// slices; a slice is *failing* when at least
/// [`failure_rate`](CircuitConfig::failure_rate) of its calls failed. A
/// failure opens the breaker when
///
/// - the calls of its slice and the one before are failing by that rate
///   (a stray timeout among answers is noise);
/// - at least [`min_failures`](CircuitConfig::min_failures) calls failed
///   within the window;
/// - at least `failure_rate` of the slices with calls, from the earliest
///   failing one on, are failing;
/// - and the first failure of that earliest failing slice is at least
///   [`min_span`](CircuitConfig::min_span) ago: failures went on for that
///   long, not in one clump.
///
/// With the defaults (3 failures, rate 0.5, span 200 ms, window 1 s) a dead
/// server opens the breaker about 200 ms after its first failure whether it
/// is asked a thousand times a second or once every 100 ms (failures at 0,
/// 100 and 200 ms), while a stall that times out calls for less than 200 ms
/// leaves it closed. Below about three calls per window the breaker never
/// opens: each call then costs one timeout, which does not hammer anything.
///
/// Built with setters from [`CircuitConfig::default`]; checked once, when
/// the store is built.
///
/// ```
/// use std::time::Duration;
/// use slicelimit::{store::CircuitConfig, store::RedisOptions};
///
/// let options = RedisOptions::default().circuit_breaker(
///     CircuitConfig::default()
///         .min_span(Duration::from_millis(300))
///         .backoff(Duration::from_millis(50), Duration::from_secs(2)),
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct CircuitConfig {
    /// The fewest failures in the window that can open it.
    min_failures: u32,
    /// The share of failed calls, since the window's earliest failure, that
    /// opens it.
    failure_rate: f64,
    /// How long failures must have gone on (earliest to latest).
    min_span: Duration,
    /// How far back failures and successes are remembered.
    window: Duration,
    /// The first back-off; it doubles on each failed probe.
    base_backoff: Duration,
    /// The longest back-off.
    max_backoff: Duration,
}

/// The longest back-off accepted: a breaker that stays open longer is an
/// outage of its own.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);

/// The longest window accepted: evidence older than this says nothing about
/// the store now.
const MAX_WINDOW: Duration = Duration::from_secs(3600);

impl CircuitConfig {
    /// The fewest failures within the window that can open the breaker
    /// (default 3, at least 1).
    #[must_use]
    pub fn min_failures(mut self, failures: u32) -> Self {
        self.min_failures = failures;
        self
    }

    /// The share of calls completed since the window's earliest failure
    /// that must have failed (default 0.5, in `(0, 1]`): a store that
    /// answers most calls is not opened on.
    #[must_use]
    pub fn failure_rate(mut self, rate: f64) -> Self {
        self.failure_rate = rate;
        self
    }

    /// How long failures must have gone on, from the earliest in the
    /// window to the latest, before the breaker opens (default 200 ms,
    /// shorter than the window). Stalls shorter than this never open it;
    /// a dead store is refused this long after its first failure. Zero
    /// opens on `min_failures` failures however close together.
    #[must_use]
    pub fn min_span(mut self, span: Duration) -> Self {
        self.min_span = span;
        self
    }

    /// How far back outcomes are remembered (default 1 s, at most an hour;
    /// kept in 20 buckets, so outcomes expire a twentieth at a time).
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How long the breaker stays open: `base` after it opens, doubling on
    /// each failed probe up to `max`, each wait with jitter between half
    /// and all of it (default 100 ms to 1 s; `0 < base <= max <= 1 h`).
    #[must_use]
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base_backoff = base;
        self.max_backoff = max;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.min_failures == 0 {
            return Err(Error::invalid(
                "circuit breaker min_failures must be at least 1",
            ));
        }
        if !(self.failure_rate > 0.0 && self.failure_rate <= 1.0) {
            return Err(Error::invalid(format!(
                "circuit breaker failure_rate must be in (0, 1], got {}",
                self.failure_rate
            )));
        }
        if self.window.is_zero() || self.window > MAX_WINDOW {
            return Err(Error::invalid(format!(
                "circuit breaker window must be in (0, {MAX_WINDOW:?}], got {:?}",
                self.window
            )));
        }
        if self.min_span >= self.window {
            return Err(Error::invalid(format!(
                "circuit breaker min_span {:?} must be shorter than its window {:?}",
                self.min_span, self.window
            )));
        }
        if self.base_backoff.is_zero() || self.max_backoff < self.base_backoff {
            return Err(Error::invalid(format!(
                "circuit breaker back-off must satisfy 0 < base <= max, got {:?}..={:?}",
                self.base_backoff, self.max_backoff
            )));
        }
        if self.max_backoff > MAX_BACKOFF {
            return Err(Error::invalid(format!(
                "circuit breaker back-off {:?} is above the maximum {MAX_BACKOFF:?}",
                self.max_backoff
            )));
        }
        Ok(())
    }

    /// Width of one bucket of the window, µs.
    fn bucket_us(&self) -> u64 {
        (self.window.as_micros() as u64 / BUCKETS as u64).max(1)
    }
}

impl Default for CircuitConfig {
    fn default() -> Self {
        CircuitConfig {
            min_failures: 3,
            failure_rate: 0.5,
            min_span: Duration::from_millis(200),
            window: Duration::from_secs(1),
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        }
    }
}

/// Buckets per window.
const BUCKETS: usize = 20;

/// Outcomes within one slice of the window.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Which slice of time (µs / bucket width) the counts belong to; a
    /// bucket holding an older index is stale and counts nothing.
    index: u64,
    ok: u64,
    failed: u64,
    /// When the first failure of this slice was recorded, µs.
    first_failure_us: u64,
}

/// A circuit breaker: opens on sustained failure (see [`CircuitConfig`])
/// for a capped exponential back-off with jitter, then lets one probe
/// through.
///
/// Owns no I/O; the store asks [`admit`](CircuitBreaker::admit) before a
/// call and reports the outcome with [`record`](CircuitBreaker::record).
pub(crate) struct CircuitBreaker {
    config: CircuitConfig,
    clock: Arc<dyn Clock>,
    state: Mutex<Breaker>,
    /// Mirrors `state.state != Closed` for a lock-free check.
    tripped: AtomicBool,
    /// Times the breaker opened.
    trips: AtomicU64,
    /// Calls refused while open.
    refused: AtomicU64,
}

#[derive(Debug)]
struct Breaker {
    state: CircuitState,
    /// Recent outcomes while closed; cleared when the state changes, so
    /// failures from before an outage never count towards the next one.
    buckets: [Bucket; BUCKETS],
    /// When the first failure since the last answer was recorded, and how
    /// many failures followed it: a store that answers nothing for a while
    /// is suspect even when too few calls reach it to open the breaker.
    silent_since_us: Option<u64>,
    silent_failures: u32,
    open_until_us: u64,
    backoff_us: u64,
    rng: u64,
}

impl Breaker {
    /// Counts an outcome at `now_us` in its bucket.
    fn count(&mut self, bucket_us: u64, now_us: u64, failed: bool) {
        let index = now_us / bucket_us;
        let b = &mut self.buckets[index as usize % BUCKETS];
        if b.index != index {
            *b = Bucket {
                index,
                ..Bucket::default()
            };
        }
        if failed {
            if b.failed == 0 {
                b.first_failure_us = now_us;
            }
            b.failed += 1;
        } else {
            b.ok += 1;
        }
    }

    /// Whether the failures in the window are sustained enough to open
    /// (see [`CircuitConfig`]); asked on a failure at `now_us`.
    fn sustained(&self, config: &CircuitConfig, now_us: u64) -> bool {
        let current = now_us / config.bucket_us();
        let failing = |b: &Bucket| {
            b.failed > 0 && b.failed as f64 >= config.failure_rate * (b.failed + b.ok) as f64
        };
        let mut live: Vec<&Bucket> = self
            .buckets
            .iter()
            .filter(|b| b.index + (BUCKETS as u64) > current && b.index <= current)
            .filter(|b| b.ok + b.failed > 0)
            .collect();
        live.sort_unstable_by_key(|b| b.index);
        // A stray failure among successes is noise, however many came
        // before it. The slice just begun is judged with the one before
        // it, so its first call alone does not make it failing.
        let recent = live
            .iter()
            .rev()
            .take_while(|b| b.index + 1 >= current)
            .fold(Bucket::default(), |sum, b| Bucket {
                ok: sum.ok + b.ok,
                failed: sum.failed + b.failed,
                ..sum
            });
        if !failing(&recent) {
            return false;
        }
        let failed: u64 = live.iter().map(|b| b.failed).sum();
        let Some(first) = live.iter().position(|b| failing(b)) else {
            return false;
        };
        let since = &live[first..];
        let failing_slices = since.iter().filter(|b| failing(b)).count();
        let span = now_us.saturating_sub(since[0].first_failure_us);
        failed >= u64::from(config.min_failures)
            && failing_slices as f64 >= config.failure_rate * since.len() as f64
            && span >= config.min_span.as_micros() as u64
    }

    fn forget(&mut self) {
        self.buckets = [Bucket::default(); BUCKETS];
    }
}

/// Permission to call the store; `probe` if it is the half-open probe.
///
/// A drop guard: a caller that drops its future between `admit` and
/// `record` (a client hung up, a `select!`, a timeout around `check`) must
/// not leave the breaker half-open for good. An abandoned probe reopens
/// the circuit with no back-off left, so the next call probes again.
#[must_use = "report the outcome with CircuitBreaker::record"]
pub(crate) struct Admission<'a> {
    breaker: &'a CircuitBreaker,
    probe: bool,
}

impl fmt::Debug for Admission<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admission")
            .field("probe", &self.probe)
            .finish()
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if self.probe {
            self.breaker.abandon_probe();
        }
    }
}

impl CircuitBreaker {
    pub(crate) fn new(config: CircuitConfig, clock: Arc<dyn Clock>) -> Self {
        let seed = micros(&*clock) ^ (&config as *const _ as u64).rotate_left(17) | 1;
        CircuitBreaker {
            config,
            clock,
            state: Mutex::new(Breaker {
                state: CircuitState::Closed,
                buckets: [Bucket::default(); BUCKETS],
                silent_since_us: None,
                silent_failures: 0,
                open_until_us: 0,
                backoff_us: config.base_backoff.as_micros() as u64,
                rng: seed,
            }),
            tripped: AtomicBool::new(false),
            trips: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    pub(crate) fn state(&self) -> CircuitState {
        self.lock().state
    }

    pub(crate) fn trips(&self) -> u64 {
        self.trips.load(Ordering::Relaxed)
    }

    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Time until the next probe, while open.
    pub(crate) fn retry_hint(&self) -> Option<Duration> {
        if !self.tripped.load(Ordering::Acquire) {
            return None;
        }
        let b = self.lock();
        let now = micros(&*self.clock);
        (b.state != CircuitState::Closed)
            .then(|| Duration::from_micros(b.open_until_us.saturating_sub(now).max(1_000)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The probe's caller went away without an outcome: open again, with
    /// the back-off already served, so the next call is the probe.
    fn abandon_probe(&self) {
        let mut b = self.lock();
        if b.state == CircuitState::HalfOpen {
            b.state = CircuitState::Open;
            b.open_until_us = micros(&*self.clock);
        }
    }

    /// May a call go to the store now?
    ///
    /// # Errors
    /// A [`CircuitOpen`](crate::ErrorKind::CircuitOpen) error while open,
    /// or while another call is the half-open probe.
    pub(crate) fn admit(&self) -> Result<Admission<'_>, Error> {
        let plain = Admission {
            breaker: self,
            probe: false,
        };
        if !self.tripped.load(Ordering::Acquire) {
            return Ok(plain);
        }
        let mut b = self.lock();
        let now = micros(&*self.clock);
        match b.state {
            CircuitState::Closed => Ok(plain),
            CircuitState::Open if now >= b.open_until_us => {
                b.state = CircuitState::HalfOpen;
                Ok(Admission {
                    breaker: self,
                    probe: true,
                })
            }
            _ => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(Error::new(
                    ErrorKind::CircuitOpen,
                    format!(
                        "circuit open: the store is not asked for another {:?}",
                        Duration::from_micros(b.open_until_us.saturating_sub(now))
                    ),
                ))
            }
        }
    }

    /// Reports a call's outcome. Only unavailability counts as failure: a
    /// store that answers with an error is up.
    ///
    /// Returns whether the connection is now suspect: this outcome opened
    /// the breaker (a failed probe reopens it), or nothing has answered for
    /// at least `min_span` while two calls or more failed. The second case
    /// catches a connection that silently stopped answering under traffic
    /// too light to open the breaker; one stall, which some answers end,
    /// never makes it suspect.
    pub(crate) fn record(&self, mut admission: Admission<'_>, failed: bool) -> bool {
        let probe = std::mem::replace(&mut admission.probe, false);
        drop(admission);
        let mut b = self.lock();
        let now = micros(&*self.clock);
        if !failed {
            b.silent_since_us = None;
            b.silent_failures = 0;
            if b.state != CircuitState::Closed || probe {
                // Any answer is evidence the store is back.
                b.state = CircuitState::Closed;
                b.backoff_us = self.config.base_backoff.as_micros() as u64;
                b.forget();
                self.tripped.store(false, Ordering::Release);
            } else {
                b.count(self.config.bucket_us(), now, false);
            }
            return false;
        }
        let since = *b.silent_since_us.get_or_insert(now);
        b.silent_failures = b.silent_failures.saturating_add(1);
        let silent = b.silent_failures >= 2
            && now.saturating_sub(since) >= self.config.min_span.as_micros() as u64;
        if silent {
            // Suspect once per stretch of silence: the next starts here.
            b.silent_since_us = Some(now);
            b.silent_failures = 1;
        }
        let trip = if probe {
            true
        } else if b.state == CircuitState::Closed {
            b.count(self.config.bucket_us(), now, true);
            b.sustained(&self.config, now)
        } else {
            // Already open: a late failure of a call admitted before.
            false
        };
        if !trip {
            return silent;
        }
        if probe {
            let max = self.config.max_backoff.as_micros() as u64;
            b.backoff_us = (b.backoff_us.saturating_mul(2)).min(max).max(1);
        }
        // Jitter: between half and all of the back-off, so a fleet's
        // probes do not arrive together.
        b.rng ^= b.rng << 13;
        b.rng ^= b.rng >> 7;
        b.rng ^= b.rng << 17;
        let half = b.backoff_us / 2;
        let wait = half + b.rng % (b.backoff_us - half + 1);
        b.open_until_us = now.saturating_add(wait);
        b.state = CircuitState::Open;
        b.forget();
        self.tripped.store(true, Ordering::Release);
        self.trips.fetch_add(1, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;

    /// Opens on 3 failures however close together: the old consecutive
    /// rule, for the tests about probes and back-off.
    fn breaker() -> (CircuitBreaker, FakeClock) {
        let config = CircuitConfig::default()
            .min_span(Duration::ZERO)
            .backoff(Duration::from_millis(100), Duration::from_millis(400));
        with(config)
    }

    fn with(config: CircuitConfig) -> (CircuitBreaker, FakeClock) {
        config.validate().expect("a valid config");
        let clock = FakeClock::new(Duration::from_secs(100));
        (CircuitBreaker::new(config, Arc::new(clock.clone())), clock)
    }

    /// Whether the outcome made the connection suspect.
    fn outcome(b: &CircuitBreaker, failed: bool) -> bool {
        let a = b.admit().expect("admitted");
        b.record(a, failed)
    }

    #[test]
    fn opens_after_failures_and_probes_once_after_the_back_off() {
        let (b, clock) = breaker();
        for _ in 0..2 {
            outcome(&b, true);
        }
        for _ in 0..4 {
            outcome(&b, false);
        }
        outcome(&b, true);
        assert_eq!(b.state(), CircuitState::Closed, "3 of 7 failed");
        outcome(&b, true);
        assert_eq!(b.state(), CircuitState::Open, "4 of 8 failed");
        assert!(b.admit().unwrap_err().is_circuit_open());
        let hint = b.retry_hint().unwrap();
        assert!(
            hint >= Duration::from_millis(50) && hint <= Duration::from_millis(100),
            "{hint:?}"
        );
        clock.advance(Duration::from_millis(101));
        let probe = b.admit().expect("one probe");
        assert!(b.admit().is_err(), "only one probe at a time");
        assert_eq!(b.state(), CircuitState::HalfOpen);
        b.record(probe, false);
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(b.admit().is_ok());
        assert_eq!(b.trips(), 1);
        // Closing forgot the failures before the outage.
        outcome(&b, true);
        outcome(&b, true);
        assert_eq!(b.state(), CircuitState::Closed);
    }

    #[test]
    fn a_dead_store_at_one_call_per_100_ms_opens_within_a_few_hundred_ms() {
        let (b, clock) = with(CircuitConfig::default());
        // A second of healthy traffic first: its successes must not hide
        // the outage.
        for _ in 0..10 {
            outcome(&b, false);
            clock.advance(Duration::from_millis(100));
        }
        let mut failures = 0;
        while b.state() == CircuitState::Closed {
            // Each call times out 25 ms after it was sent.
            clock.advance(Duration::from_millis(25));
            outcome(&b, true);
            failures += 1;
            clock.advance(Duration::from_millis(75));
            assert!(failures < 10, "still closed after {failures} failures");
        }
        assert_eq!(
            failures, 3,
            "open at the third failure, 200 ms after the first"
        );
        assert_eq!(b.trips(), 1);
    }

    #[test]
    fn a_dead_store_under_heavy_traffic_opens_after_the_span() {
        let (b, clock) = with(CircuitConfig::default());
        for _ in 0..50 {
            for _ in 0..100 {
                outcome(&b, false);
            }
            clock.advance(Duration::from_millis(10));
        }
        let mut elapsed = Duration::ZERO;
        while b.state() == CircuitState::Closed {
            for _ in 0..100 {
                if b.state() == CircuitState::Closed {
                    outcome(&b, true);
                }
            }
            clock.advance(Duration::from_millis(10));
            elapsed += Duration::from_millis(10);
            assert!(elapsed <= Duration::from_millis(300), "still closed");
        }
        assert!(elapsed >= Duration::from_millis(200), "{elapsed:?}");
    }

    #[test]
    fn one_stall_that_times_out_thousands_of_calls_at_once_does_not_open() {
        let (b, clock) = with(CircuitConfig::default());
        for round in 0..3 {
            // Healthy: 20 calls a millisecond for a second.
            for _ in 0..1_000 {
                for _ in 0..20 {
                    outcome(&b, false);
                }
                clock.advance(Duration::from_millis(1));
            }
            // A 60 ms stall: everything queued behind it times out, over
            // 150 ms (just under the 200 ms span), and nothing succeeds.
            for _ in 0..150 {
                for _ in 0..20 {
                    assert!(!outcome(&b, true), "a stall makes no connection suspect");
                }
                clock.advance(Duration::from_millis(1));
            }
            assert_eq!(b.state(), CircuitState::Closed, "stall {round}");
        }
        // Odd timeouts after the stalls, among successes, do not open it.
        for _ in 0..200 {
            outcome(&b, true);
            for _ in 0..20 {
                outcome(&b, false);
            }
            clock.advance(Duration::from_millis(1));
        }
        assert_eq!(b.state(), CircuitState::Closed);
        assert_eq!(b.trips(), 0);
    }

    #[test]
    fn a_silent_store_at_one_call_a_second_is_suspect_though_it_stays_closed() {
        let (b, clock) = with(CircuitConfig::default());
        assert!(!outcome(&b, false));
        clock.advance(Duration::from_secs(1));
        assert!(!outcome(&b, true), "one timeout is not evidence");
        clock.advance(Duration::from_secs(1));
        assert!(outcome(&b, true), "nothing answered for a second");
        assert_eq!(b.state(), CircuitState::Closed, "too few calls to open");
        clock.advance(Duration::from_millis(100));
        assert!(!outcome(&b, true), "suspect once per stretch of silence");
        clock.advance(Duration::from_secs(1));
        assert!(outcome(&b, true));
        assert!(!outcome(&b, false));
        clock.advance(Duration::from_secs(1));
        assert!(!outcome(&b, true), "an answer ended the silence");
    }

    #[test]
    fn a_store_failing_most_calls_opens_though_some_answer() {
        let (b, clock) = with(CircuitConfig::default());
        for _ in 0..300 {
            for failed in [true, true, false] {
                if b.state() == CircuitState::Closed {
                    outcome(&b, failed);
                }
            }
            clock.advance(Duration::from_millis(1));
        }
        assert_eq!(b.state(), CircuitState::Open, "two in three failed");
    }

    #[test]
    fn config_is_checked() {
        let ok = CircuitConfig::default();
        assert!(ok.validate().is_ok());
        for bad in [
            ok.min_failures(0),
            ok.failure_rate(0.0),
            ok.failure_rate(1.5),
            ok.failure_rate(f64::NAN),
            ok.window(Duration::ZERO),
            ok.window(Duration::from_secs(7200)),
            ok.min_span(Duration::from_secs(1)),
            ok.backoff(Duration::ZERO, Duration::from_secs(1)),
            ok.backoff(Duration::from_secs(2), Duration::from_secs(1)),
            ok.backoff(Duration::from_secs(1), Duration::from_secs(7200)),
        ] {
            assert!(bad.validate().unwrap_err().is_invalid_input(), "{bad:?}");
        }
    }

    #[test]
    fn a_dropped_probe_does_not_wedge_the_breaker_half_open() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            outcome(&b, true);
        }
        clock.advance(Duration::from_millis(101));
        let probe = b.admit().expect("the probe");
        assert_eq!(b.state(), CircuitState::HalfOpen);
        drop(probe); // its caller's future was dropped mid-call
        assert_eq!(b.state(), CircuitState::Open);
        let probe = b.admit().expect("the next call probes at once");
        b.record(probe, false);
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(b.admit().is_ok());
    }

    #[test]
    fn failed_probes_double_the_back_off_up_to_the_cap() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            outcome(&b, true);
        }
        let mut waits = Vec::new();
        for _ in 0..5 {
            let hint = b.retry_hint().unwrap();
            waits.push(hint);
            clock.advance(hint + Duration::from_millis(1));
            let probe = b.admit().unwrap();
            b.record(probe, true);
        }
        assert!(waits[2] > Duration::from_millis(100), "{waits:?}");
        assert!(
            waits.iter().all(|w| *w <= Duration::from_millis(400)),
            "{waits:?}"
        );
        assert_eq!(b.trips(), 6);
    }
}
