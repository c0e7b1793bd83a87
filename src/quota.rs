//! Quotas and algorithms: what a key is allowed, and how it is counted.
//!
//! A [`Quota`] cannot be invalid. The convenience constructors take
//! [`NonZeroU32`] counts (write literals with [`nonzero!`](crate::nonzero),
//! checked at compile time) over fixed periods, so they cannot fail;
//! [`Quota::new`] takes any limit and period and checks them. What only an
//! algorithm requires of a quota (a bucket that fills in time) is checked
//! when a limiter is built.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::error::Error;

/// A [`NonZeroU32`] from a constant, checked at compile time: a zero does
/// not compile. For a value known only at run time, use
/// [`NonZeroU32::new`].
///
/// ```
/// use slicelimit::{nonzero, Quota};
///
/// let quota = Quota::per_minute(nonzero!(100)).with_burst(nonzero!(20));
/// assert_eq!((quota.limit(), quota.burst()), (100, 20));
/// ```
///
/// ```compile_fail
/// let zero = slicelimit::nonzero!(0);
/// ```
#[macro_export]
macro_rules! nonzero {
    ($n:expr) => {
        const {
            match ::core::num::NonZeroU32::new($n) {
                ::core::option::Option::Some(n) => n,
                ::core::option::Option::None => {
                    ::core::panic!("nonzero!(0): the count must be at least 1")
                }
            }
        }
    };
}

/// See [`Quota::MAX_LIMIT`].
pub(crate) const MAX_LIMIT: u64 = Quota::MAX_LIMIT;

/// See [`Quota::MAX_PERIOD`].
pub(crate) const MAX_PERIOD: Duration = Quota::MAX_PERIOD;

/// See [`Quota::MIN_PERIOD`].
pub(crate) const MIN_PERIOD: Duration = Quota::MIN_PERIOD;

/// `limit` permits per `period`, with an optional burst for token bucket
/// and GCRA. Every `Quota` is in range: `limit` and `burst` in
/// `1..=`[`MAX_LIMIT`](Quota::MAX_LIMIT)(Quota::MAX_LIMIT), `period` in
/// [`MIN_PERIOD`](Quota::MIN_PERIOD)`..=`[`MAX_PERIOD`](Quota::MAX_PERIOD).
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use slicelimit::{nonzero, Quota};
///
/// let api = Quota::per_second(nonzero!(50)).with_burst(nonzero!(200));
/// let from_config = NonZeroU32::new(100).map(Quota::per_minute);
/// let daily = Quota::new(10_000, Duration::from_secs(86_400))?;
/// assert!(Quota::new(0, Duration::from_secs(1)).is_err());
/// # let _ = (api, from_config, daily);
/// # Ok::<(), slicelimit::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: u64,
    period: Duration,
    burst: Option<u64>,
}

impl Quota {
    /// The largest limit or burst accepted. Scripts count in Lua numbers
    /// (doubles), which are exact to 2^53; this leaves ample headroom.
    pub const MAX_LIMIT: u64 = 1_000_000_000_000;

    /// The longest period accepted.
    pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

    /// The shortest period accepted.
    pub const MIN_PERIOD: Duration = Duration::from_millis(1);

    /// `limit` permits per `period`.
    ///
    /// # Errors
    /// An [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) error if
    /// the limit is zero or above [`MAX_LIMIT`](Quota::MAX_LIMIT), or the period is below
    /// [`MIN_PERIOD`](Quota::MIN_PERIOD) or above [`MAX_PERIOD`](Quota::MAX_PERIOD).
    pub fn new(limit: u64, period: Duration) -> Result<Quota, Error> {
        let quota = Quota {
            limit,
            period,
            burst: None,
        };
        quota.check()?;
        Ok(quota)
    }

    /// `limit` permits per second.
    pub const fn per_second(limit: NonZeroU32) -> Quota {
        Quota::unchecked(limit.get() as u64, Duration::from_secs(1))
    }

    /// `limit` permits per minute.
    pub const fn per_minute(limit: NonZeroU32) -> Quota {
        Quota::unchecked(limit.get() as u64, Duration::from_secs(60))
    }

    /// `limit` permits per hour.
    pub const fn per_hour(limit: NonZeroU32) -> Quota {
        Quota::unchecked(limit.get() as u64, Duration::from_secs(3600))
    }

    /// A quota from values already known to be in range.
    const fn unchecked(limit: u64, period: Duration) -> Quota {
        Quota {
            limit,
            period,
            burst: None,
        }
    }

    /// The most permits a token bucket or GCRA key can hold at once
    /// (default: the limit). Ignored by the fixed window.
    #[must_use]
    pub const fn with_burst(mut self, burst: NonZeroU32) -> Quota {
        self.burst = Some(burst.get() as u64);
        self
    }

    /// Permits per period.
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// The period over which `limit` permits are granted.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The bucket capacity (token bucket, GCRA): the burst, or the limit.
    pub const fn burst(&self) -> u64 {
        match self.burst {
            Some(b) => b,
            None => self.limit,
        }
    }

    /// Checks the limit and the period (a burst, a `NonZeroU32`, is always
    /// in range).
    fn check(&self) -> Result<(), Error> {
        if self.limit == 0 {
            return Err(Error::invalid("quota limit must be at least 1"));
        }
        if self.limit > MAX_LIMIT {
            return Err(Error::invalid(format!(
                "quota limit {} is above the maximum {MAX_LIMIT}",
                self.limit
            )));
        }
        if self.period < MIN_PERIOD {
            return Err(Error::invalid(format!(
                "quota period {:?} is below the minimum {MIN_PERIOD:?}",
                self.period
            )));
        }
        if self.period > MAX_PERIOD {
            return Err(Error::invalid(format!(
                "quota period {:?} is above the maximum {MAX_PERIOD:?}",
                self.period
            )));
        }
        Ok(())
    }

    pub(crate) fn period_us(&self) -> u64 {
        self.period.as_micros() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_absurd_quotas_are_rejected_with_a_reason() {
        let e = Quota::new(0, Duration::from_secs(1)).unwrap_err();
        assert!(e.is_invalid_input() && e.to_string().contains("limit"));
        let e = Quota::new(1, Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("period"));
        let e = Quota::new(1, MIN_PERIOD - Duration::from_nanos(1)).unwrap_err();
        assert!(e.to_string().contains("period"));
        let e = Quota::new(1, Duration::from_secs(400 * 24 * 3600)).unwrap_err();
        assert!(e.to_string().contains("period"));
        let e = Quota::new(MAX_LIMIT + 1, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("limit"));
        assert!(Quota::new(MAX_LIMIT, MAX_PERIOD).is_ok());
        assert!(Quota::new(1, MIN_PERIOD).is_ok());
    }

    #[test]
    fn the_infallible_constructors_are_in_range() {
        const MOST: Quota = Quota::per_hour(NonZeroU32::MAX).with_burst(NonZeroU32::MAX);
        assert!(MOST.check().is_ok() && MOST.burst() <= MAX_LIMIT);
        for q in [
            Quota::per_second(nonzero!(1)),
            Quota::per_minute(nonzero!(1)).with_burst(nonzero!(1)),
            Quota::per_hour(NonZeroU32::MAX),
        ] {
            assert!(q.check().is_ok(), "{q:?}");
        }
        assert_eq!(
            Quota::per_minute(nonzero!(100)),
            Quota::new(100, Duration::from_secs(60)).unwrap()
        );
    }

    use crate::algorithm::Algorithm;

    #[test]
    fn buckets_that_would_take_longer_than_the_longest_period_to_fill_are_refused() {
        let year = Duration::from_secs(366 * 24 * 3600);
        let q = Quota::new(1, year).unwrap().with_burst(nonzero!(1_000_000));
        for a in [Algorithm::TokenBucket, Algorithm::Gcra] {
            let e = a.check_quota(&q).unwrap_err();
            assert!(
                e.is_invalid_input() && e.to_string().contains("fill"),
                "{e}"
            );
        }
        assert!(Algorithm::FixedWindow.check_quota(&q).is_ok());
        assert!(Algorithm::Gcra
            .check_quota(&Quota::new(1, year).unwrap())
            .is_ok());
    }

    #[test]
    fn burst_defaults_to_limit() {
        let seven = Quota::per_second(nonzero!(7));
        assert_eq!(seven.burst(), 7);
        assert_eq!(seven.with_burst(nonzero!(3)).burst(), 3);
        assert_eq!(
            Algorithm::FixedWindow.max_cost(&seven.with_burst(nonzero!(3))),
            7
        );
        assert_eq!(Algorithm::Gcra.max_cost(&seven.with_burst(nonzero!(3))), 3);
    }
}
