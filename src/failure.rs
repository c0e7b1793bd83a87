//! What a limiter does when its store cannot answer.
//!
//! The policy turns "could not decide" into a [`Decision`]; this module owns
//! that mapping, the per-process fallback limiter, the record of what the
//! fallback admitted (reported to the store when it returns) and the
//! circuit breaker. It never talks to the store itself.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::micros;
use crate::decision::Source;
use crate::local::LocalEngine;
use crate::store::{OpId, OpIds};
use crate::{Algorithm, Clock, Decision, Error, ErrorKind, Quota};

/// What to decide while the store is unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit every request. The usual choice for general traffic: the
    /// limiter must not become the outage. The default.
    #[default]
    FailOpen,
    /// Deny every request. For routes where over-admission is worse than
    /// unavailability (logins, payments, expensive jobs).
    FailClosed,
    /// Decide with a per-process limiter of this quota. Choose about
    /// `limit / expected_instances`, so the fleet together stays near the
    /// real limit.
    LocalFallback(Quota),
}

/// How long a fail-closed denial tells the caller to wait, when nothing
/// better is known.
pub(crate) const FAIL_CLOSED_RETRY: Duration = Duration::from_secs(1);

/// Applies a [`FailurePolicy`].
pub(crate) struct FailureHandler {
    policy: FailurePolicy,
    /// The per-process limiter behind `LocalFallback`.
    fallback: Option<LocalEngine>,
    /// What the fallback admitted, to be reported when the store returns.
    pub(crate) reconciler: Arc<Reconciler>,
    /// The store's clock as last seen, which the fallback counts windows
    /// on (application clocks never decide windows).
    pub(crate) store_clock: Arc<StoreAligned>,
    limit: u64,
}

/// A clock that reads the store's time: the local clock plus the offset
/// of the store's clock seen in its last reply (0 before any). The
/// fallback counts its windows on it, so one store window does not
/// straddle two fallback windows of a process whose clock is off.
pub(crate) struct StoreAligned {
    local: Arc<dyn Clock>,
    /// Store µs minus local µs.
    offset_us: std::sync::atomic::AtomicI64,
}

impl StoreAligned {
    /// The local clock's reading, µs.
    pub(crate) fn local_us(&self) -> u64 {
        micros(&*self.local)
    }

    /// A store reply read `store_us` while the local clock read `local_us`
    /// (the middle of the round trip).
    pub(crate) fn observe(&self, local_us: u64, store_us: u64) {
        self.offset_us
            .store(store_us as i64 - local_us as i64, Ordering::Relaxed);
    }
}

impl Clock for StoreAligned {
    fn now(&self) -> Duration {
        let local = micros(&*self.local);
        let offset = self.offset_us.load(Ordering::Relaxed);
        Duration::from_micros(local.saturating_add_signed(offset))
    }
}

/// Lets the fallback engine hold the shared aligned clock.
struct SharedAligned(Arc<StoreAligned>);

impl Clock for SharedAligned {
    fn now(&self) -> Duration {
        self.0.now()
    }
}

/// Permits admitted by the fallback while the store was away, per user key.
/// Reported to the store as debt when it answers again, so the fleet does
/// not get a second full budget right after an outage.
///
/// Each report carries an identity ([`OpId`]) fixed when it is first sent:
/// a report that timed out is resent under the same identity, so the store
/// counts it once even if it had applied the first delivery.
pub(crate) struct Reconciler {
    pending: Mutex<Ledger>,
    has_pending: AtomicBool,
    ops: OpIds,
    /// Times resends (see `RESEND_FOR`).
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciler")
            .field("has_pending", &self.has_pending())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Ledger {
    /// Admitted and never sent.
    fresh: HashMap<String, u64>,
    /// Sent, not known to have applied: resent as they were.
    resend: Vec<Report>,
}

/// One reconciliation report: `permits` admitted for `key` while the store
/// was away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    pub(crate) key: String,
    pub(crate) permits: u64,
    pub(crate) op: OpId,
    /// When it was first handed out for sending (the limiter's clock, µs).
    pub(crate) first_sent: Option<u64>,
}

/// How long a report is resent. The store remembers a report's identity
/// for 60 s; a resend after that could apply twice, so a report still
/// unsent by then is dropped and counted instead (`Stats::reports_dropped`).
pub(crate) const RESEND_FOR: Duration = Duration::from_secs(50);

impl Reconciler {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Reconciler {
            pending: Mutex::new(Ledger::default()),
            has_pending: AtomicBool::new(false),
            ops: OpIds::default(),
            clock,
        }
    }

    fn record(&self, key: &str, cost: u64) {
        if cost == 0 {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let n = pending.fresh.entry(key.to_owned()).or_insert(0);
        *n = n.saturating_add(cost);
        self.has_pending.store(true, Ordering::Release);
    }

    pub(crate) fn has_pending(&self) -> bool {
        self.has_pending.load(Ordering::Acquire)
    }

    /// Takes everything pending, each with its identity.
    pub(crate) fn drain(&self) -> Vec<Report> {
        if !self.has_pending() {
            return Vec::new();
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.has_pending.store(false, Ordering::Release);
        let now = micros(&*self.clock);
        let mut out = std::mem::take(&mut pending.resend);
        out.extend(pending.fresh.drain().map(|(key, permits)| Report {
            key,
            permits,
            op: self.ops.next(),
            first_sent: None,
        }));
        for r in &mut out {
            r.first_sent.get_or_insert(now);
        }
        out
    }

    /// Puts back reports that could not be delivered, to be resent as they
    /// are; returns the permits of those resent for too long, dropped.
    pub(crate) fn restore(&self, reports: impl IntoIterator<Item = Report>) -> u64 {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut dropped = 0;
        for r in reports {
            let now = micros(&*self.clock);
            if r.first_sent
                .is_some_and(|t| now.saturating_sub(t) > RESEND_FOR.as_micros() as u64)
            {
                dropped += r.permits;
            } else {
                pending.resend.push(r);
            }
        }
        if !pending.resend.is_empty() {
            self.has_pending.store(true, Ordering::Release);
        }
        dropped
    }
}

impl FailureHandler {
    pub(crate) fn new(
        policy: FailurePolicy,
        algorithm: Algorithm,
        limit: u64,
        clock: std::sync::Arc<dyn Clock>,
    ) -> Result<Self, Error> {
        let store_clock = Arc::new(StoreAligned {
            local: clock,
            offset_us: std::sync::atomic::AtomicI64::new(0),
        });
        let fallback = match policy {
            FailurePolicy::LocalFallback(quota) => {
                quota
                    .validate()
                    .map_err(|e| Error::invalid(format!("LocalFallback quota: {e}")))?;
                Some(LocalEngine::new(
                    quota,
                    algorithm,
                    Arc::new(SharedAligned(store_clock.clone())),
                    Source::Fallback,
                ))
            }
            _ => None,
        };
        Ok(FailureHandler {
            policy,
            fallback,
            reconciler: Arc::new(Reconciler::new(store_clock.local.clone())),
            store_clock,
            limit,
        })
    }

    pub(crate) fn policy(&self) -> FailurePolicy {
        self.policy
    }

    /// The decision for a request the store could not decide.
    /// `retry_hint` is when the store will next be tried, if known.
    pub(crate) fn decide(&self, key: &str, cost: u64, retry_hint: Option<Duration>) -> Decision {
        if cost == 0 && !matches!(self.policy, FailurePolicy::LocalFallback(_)) {
            // A peek takes nothing: it is answered under every policy.
            // (Fail-open's remaining is not known; fail-closed's is 0.)
            let remaining = match self.policy {
                FailurePolicy::FailOpen => self.limit,
                _ => 0,
            };
            let source = match self.policy {
                FailurePolicy::FailOpen => Source::FailOpen,
                _ => Source::FailClosed,
            };
            return Decision::allow(self.limit, remaining, Duration::ZERO, source);
        }
        match (&self.policy, &self.fallback) {
            (FailurePolicy::LocalFallback(_), Some(local)) => {
                let decision = local.check(key, cost);
                if decision.is_allowed() {
                    self.reconciler.record(key, cost);
                }
                decision
            }
            (FailurePolicy::FailClosed, _) => Decision::deny(
                self.limit,
                0,
                retry_hint.unwrap_or(FAIL_CLOSED_RETRY),
                Some(retry_hint.unwrap_or(FAIL_CLOSED_RETRY)),
                Source::FailClosed,
            ),
            _ => Decision::allow(
                self.limit,
                self.limit.saturating_sub(cost),
                Duration::ZERO,
                Source::FailOpen,
            ),
        }
    }
}

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitConfig {
    /// Consecutive failures (timeouts, connection errors) that open it.
    pub failures: u32,
    /// The first back-off; it doubles on each failed probe.
    pub base_backoff: Duration,
    /// The longest back-off.
    pub max_backoff: Duration,
}

/// The longest back-off accepted: a breaker that stays open longer is an
/// outage of its own.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);

impl CircuitConfig {
    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.failures == 0 {
            return Err(Error::invalid(
                "circuit breaker failures must be at least 1",
            ));
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
}

impl Default for CircuitConfig {
    fn default() -> Self {
        CircuitConfig {
            failures: 5,
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        }
    }
}

/// A circuit breaker: after `failures` consecutive failures it opens for a
/// capped exponential back-off with jitter, then lets one probe through.
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
    consecutive: u32,
    open_until_us: u64,
    backoff_us: u64,
    rng: u64,
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
                consecutive: 0,
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
    pub(crate) fn record(&self, mut admission: Admission<'_>, failed: bool) {
        let probe = std::mem::replace(&mut admission.probe, false);
        drop(admission);
        if !failed && !probe && !self.tripped.load(Ordering::Acquire) {
            let mut b = self.lock();
            b.consecutive = 0;
            return;
        }
        let mut b = self.lock();
        let now = micros(&*self.clock);
        if !failed {
            b.state = CircuitState::Closed;
            b.consecutive = 0;
            b.backoff_us = self.config.base_backoff.as_micros() as u64;
            self.tripped.store(false, Ordering::Release);
            return;
        }
        b.consecutive = b.consecutive.saturating_add(1);
        let trip =
            probe || (b.state == CircuitState::Closed && b.consecutive >= self.config.failures);
        if !trip {
            return;
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
        self.tripped.store(true, Ordering::Release);
        self.trips.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FakeClock;

    fn breaker() -> (CircuitBreaker, FakeClock) {
        let clock = FakeClock::new(Duration::from_secs(100));
        let config = CircuitConfig {
            failures: 3,
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(400),
        };
        (CircuitBreaker::new(config, Arc::new(clock.clone())), clock)
    }

    #[test]
    fn opens_after_consecutive_failures_and_probes_once_after_the_back_off() {
        let (b, clock) = breaker();
        for _ in 0..2 {
            let a = b.admit().unwrap();
            b.record(a, true);
        }
        let a = b.admit().unwrap();
        b.record(a, false); // a success resets the count
        for _ in 0..3 {
            let a = b.admit().unwrap();
            b.record(a, true);
        }
        assert_eq!(b.state(), CircuitState::Open);
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
    }

    #[test]
    fn a_dropped_probe_does_not_wedge_the_breaker_half_open() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            let a = b.admit().unwrap();
            b.record(a, true);
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
            let a = b.admit().unwrap();
            b.record(a, true);
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
