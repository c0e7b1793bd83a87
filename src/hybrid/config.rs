//! Tunables of the hybrid limiter.
//!
//! A small value type with `#[must_use]` setters; validated once, when the
//! limiter is built. It owns no state.

use std::time::Duration;

use crate::error::Error;

/// Whether a process may admit before the store has granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Consistency {
    /// Admit only against granted permits: the fleet never exceeds the limit.
    Strict,
    /// With a refill in flight, admit up to `max_debt` permits per key per
    /// process on credit; the debt is reported with the next lease.
    Optimistic {
        /// Permits one process may admit on credit for one key.
        max_debt: u64,
    },
}

/// Configuration of a hybrid limiter; see
/// [`Builder::hybrid`](crate::Builder::hybrid).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct HybridConfig {
    pub(crate) consistency: Consistency,
    pub(crate) max_wait: Duration,
    pub(crate) min_lease: u64,
    pub(crate) max_lease: u64,
    pub(crate) refill_horizon: Duration,
    pub(crate) share_cap: f64,
    pub(crate) lease_ttl: Duration,
    pub(crate) idle_ttl: Duration,
    pub(crate) max_keys: usize,
    pub(crate) batch_size: usize,
    pub(crate) prelease_lead: Duration,
    pub(crate) clock_margin: Duration,
    pub(crate) coarse_clock: bool,
    pub(crate) coalesce: Duration,
    /// Mechanisms switched off, to measure what each is worth.
    pub(crate) ablate: Ablation,
}

/// The optional mechanisms of the lease path, each of which can be
/// switched off to measure what it is worth (the table in
/// `docs/leasing.md`). Only builds with the `test-support` feature read
/// the switch, from `SLICELIMIT_ABLATE` (names separated by commas); in
/// any other build every mechanism is on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Ablation(u32);

impl Ablation {
    /// Refills of other keys sent along with a batch that goes anyway.
    pub(crate) const RIDES: u32 = 1;
    /// Peeks at windows known full, riding along in batches.
    pub(crate) const PEEKS: u32 = 1 << 1;
    /// Per-thread stocks of a contended key's permits.
    pub(crate) const STOCKS: u32 = 1 << 2;
    /// Leases of the next window sent before the boundary (and a bucket
    /// lease's renewal ahead of its horizon).
    pub(crate) const PRELEASE: u32 = 1 << 3;
    /// Pre-leases of thin holders (a few permits a window).
    pub(crate) const THIN_PRELEASE: u32 = 1 << 4;
    /// Refills ahead of need (at a low-water mark): off, a holding is
    /// refilled when it runs dry.
    pub(crate) const AHEAD: u32 = 1 << 5;
    /// The window's last lease (one that covers the rate to the window's
    /// end) refilled only when demand outruns it, not at half.
    pub(crate) const WINDOW_LAST: u32 = 1 << 6;
    /// No refill ahead of need for a contested key (the store cut the
    /// lease below half the ask).
    pub(crate) const CONTESTED: u32 = 1 << 7;
    /// No refill ahead of need for a thin holder.
    pub(crate) const THIN: u32 = 1 << 8;

    #[cfg(any(test, feature = "test-support"))]
    const NAMES: [(&'static str, u32); 9] = [
        ("rides", Self::RIDES),
        ("peeks", Self::PEEKS),
        ("stocks", Self::STOCKS),
        ("prelease", Self::PRELEASE),
        ("thin-prelease", Self::THIN_PRELEASE),
        ("ahead", Self::AHEAD),
        ("window-last", Self::WINDOW_LAST),
        ("contested", Self::CONTESTED),
        ("thin", Self::THIN),
    ];

    /// The switches `SLICELIMIT_ABLATE` names (test-support builds only).
    fn from_env() -> Ablation {
        #[cfg(feature = "test-support")]
        if let Ok(list) = std::env::var("SLICELIMIT_ABLATE") {
            return Ablation::parse(&list);
        }
        Ablation(0)
    }

    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn parse(list: &str) -> Ablation {
        let mut bits = 0;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match Self::NAMES.iter().find(|(n, _)| *n == name) {
                Some((_, bit)) => bits |= bit,
                None => eprintln!(
                    "SLICELIMIT_ABLATE: no mechanism {name:?} (known: {})",
                    Self::NAMES.map(|(n, _)| n).join(", ")
                ),
            }
        }
        Ablation(bits)
    }

    /// Whether `mechanism` is switched off.
    #[inline]
    pub(crate) fn off(self, mechanism: u32) -> bool {
        self.0 & mechanism != 0
    }
}

impl HybridConfig {
    /// Admit only against granted permits. An empty holding waits for its
    /// refill up to `max_wait` (default 50 ms), then denies.
    pub fn strict() -> Self {
        HybridConfig {
            consistency: Consistency::Strict,
            max_wait: Duration::from_millis(50),
            min_lease: 1,
            max_lease: 1_000_000,
            refill_horizon: Duration::from_secs(1),
            share_cap: 0.5,
            lease_ttl: Duration::from_secs(1),
            idle_ttl: Duration::from_secs(30),
            max_keys: 1_000_000,
            batch_size: 512,
            prelease_lead: Duration::from_millis(100),
            clock_margin: Duration::from_millis(3),
            coarse_clock: true,
            coalesce: Duration::from_millis(2),
            ablate: Ablation::from_env(),
        }
    }

    /// Admit up to `max_debt` permits per key per process on credit while a
    /// refill is in flight; past that, wait for the refill as in strict
    /// mode. Overshoot is at most `processes × max_debt` per window, and
    /// counted.
    pub fn optimistic(max_debt: u64) -> Self {
        HybridConfig {
            consistency: Consistency::Optimistic { max_debt },
            ..HybridConfig::strict()
        }
    }

    /// The consistency mode.
    pub fn consistency(&self) -> Consistency {
        self.consistency
    }

    /// How long a request that finds no local permit (and, in optimistic
    /// mode, no credit left) may wait for a refill before it is denied.
    /// Default 50 ms; zero never waits.
    #[must_use]
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.max_wait = wait;
        self
    }

    /// Bounds on one lease's size (default 1 and 1 000 000). Within them
    /// a lease covers `refill_horizon` of the key's observed demand; a
    /// smaller `max` caps a hot key's lease below that, and a key that
    /// spends a lease faster than a refill comes back (a round trip and
    /// `coalesce`) runs dry and waits on the store.
    #[must_use]
    pub fn lease_bounds(mut self, min: u64, max: u64) -> Self {
        self.min_lease = min;
        self.max_lease = max;
        self
    }

    /// A lease is sized to cover this much of the key's observed demand
    /// (default 1 s).
    #[must_use]
    pub fn refill_horizon(mut self, horizon: Duration) -> Self {
        self.refill_horizon = horizon;
        self
    }

    /// The largest fraction of what remains in the store that one lease
    /// may take (default 0.5), so leases shrink as the budget runs out.
    #[must_use]
    pub fn share_cap(mut self, share: f64) -> Self {
        self.share_cap = share;
        self
    }

    /// Token bucket and GCRA: how long leased permits stay usable (the
    /// horizon *h* of the bound `burst + rate·(T + h)`; default 1 s).
    #[must_use]
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Keys unused this long are forgotten and their permits given back
    /// (default 30 s).
    #[must_use]
    pub fn idle_ttl(mut self, ttl: Duration) -> Self {
        self.idle_ttl = ttl;
        self
    }

    /// The most keys tracked locally (default 1 000 000). Past it, the
    /// least recently used are evicted; a key that finds no room is decided
    /// by one store call.
    #[must_use]
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.max_keys = keys;
        self
    }

    /// The most lease calls pipelined in one round trip (default 512).
    #[must_use]
    pub fn batch_size(mut self, size: usize) -> Self {
        self.batch_size = size;
        self
    }

    /// Fixed window: a key in use this close to its window's end leases
    /// the next window's first slice ahead of the boundary (default 100 ms;
    /// zero turns pre-leasing off). The sliding window does not lease ahead
    /// (the next window's permits would count against the current one),
    /// except for a request within a round trip of the boundary, whose
    /// lease of the window ending would arrive void: it takes the next
    /// window's first permits, which count against the ending one;
    /// token bucket and GCRA renew a lease this close to its horizon, at
    /// most half-way through it.
    #[must_use]
    pub fn prelease_lead(mut self, lead: Duration) -> Self {
        self.prelease_lead = lead;
        self
    }

    /// Subtracted from every lease deadline to absorb local clock
    /// granularity and scheduling delays (default 3 ms).
    #[must_use]
    pub fn clock_margin(mut self, margin: Duration) -> Self {
        self.clock_margin = margin;
        self
    }

    /// Read the kernel's coarse monotonic clock on the request path (one
    /// vDSO read, lagging by at most a timer tick; the precise clock is read
    /// within 50 ms of a deadline) rather than the precise clock on every
    /// decision (default on; only used with the system clock).
    #[must_use]
    pub fn coarse_clock(mut self, on: bool) -> Self {
        self.coarse_clock = on;
        self
    }

    /// How long a refill nobody waits for yet (the holding fell below its
    /// low-water mark) may wait for other keys' refills to share its round
    /// trip (default 2 ms; a waiting request always goes at once).
    #[must_use]
    pub fn coalesce(mut self, delay: Duration) -> Self {
        self.coalesce = delay;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if !(self.share_cap > 0.0 && self.share_cap <= 1.0) {
            return Err(Error::invalid(format!(
                "share_cap must be in (0, 1], got {}",
                self.share_cap
            )));
        }
        if self.min_lease == 0 || self.max_lease < self.min_lease {
            return Err(Error::invalid(format!(
                "lease bounds must satisfy 1 <= min <= max, got {}..={}",
                self.min_lease, self.max_lease
            )));
        }
        if self.max_lease > crate::quota::MAX_LIMIT {
            return Err(Error::invalid("max_lease is absurdly large"));
        }
        if self.max_keys == 0 || self.batch_size == 0 {
            return Err(Error::invalid("max_keys and batch_size must be at least 1"));
        }
        if self.refill_horizon.is_zero() || self.lease_ttl.is_zero() || self.idle_ttl.is_zero() {
            return Err(Error::invalid(
                "refill_horizon, lease_ttl and idle_ttl must be positive",
            ));
        }
        let day = Duration::from_secs(86_400);
        for (name, value, max) in [
            ("lease_ttl", self.lease_ttl, day),
            ("refill_horizon", self.refill_horizon, day),
            ("prelease_lead", self.prelease_lead, day),
            ("clock_margin", self.clock_margin, Duration::from_secs(60)),
            ("idle_ttl", self.idle_ttl, crate::quota::MAX_PERIOD),
        ] {
            if value > max {
                return Err(Error::invalid(format!(
                    "{name} {value:?} is above the maximum {max:?}"
                )));
            }
        }
        if self.coalesce > self.refill_horizon / 4 {
            return Err(Error::invalid(
                "coalesce must be at most a quarter of refill_horizon, or holdings run dry waiting",
            ));
        }
        if self.max_wait > Duration::from_secs(60) {
            return Err(Error::invalid(
                "max_wait above 60 s is not a rate limit but a queue",
            ));
        }
        if let Consistency::Optimistic { max_debt } = self.consistency {
            if max_debt > u64::from(u32::MAX) {
                return Err(Error::invalid(format!(
                    "max_debt {max_debt} is absurdly large (at most {})",
                    u32::MAX
                )));
            }
        }
        Ok(())
    }
}

impl Default for HybridConfig {
    fn default() -> Self {
        HybridConfig::strict()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonsense_is_rejected() {
        assert!(HybridConfig::strict()
            .share_cap(f64::NAN)
            .validate()
            .is_err());
        assert!(HybridConfig::strict().share_cap(0.0).validate().is_err());
        assert!(HybridConfig::strict().share_cap(1.5).validate().is_err());
        assert!(HybridConfig::strict()
            .lease_bounds(0, 5)
            .validate()
            .is_err());
        assert!(HybridConfig::strict()
            .lease_bounds(6, 5)
            .validate()
            .is_err());
        assert!(HybridConfig::strict().max_keys(0).validate().is_err());
        assert!(HybridConfig::optimistic(u64::MAX).validate().is_err());
        assert!(HybridConfig::optimistic(5).validate().is_ok());
        for huge in [
            HybridConfig::strict().lease_ttl(Duration::MAX),
            HybridConfig::strict().prelease_lead(Duration::MAX),
            HybridConfig::strict().refill_horizon(Duration::MAX),
            HybridConfig::strict().idle_ttl(Duration::MAX),
            HybridConfig::strict().clock_margin(Duration::MAX),
        ] {
            assert!(huge.validate().is_err(), "{huge:?}");
        }
    }
}
