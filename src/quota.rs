//! Quotas and algorithms: what a key is allowed, and how it is counted.
//!
//! A [`Quota`] is a plain value. The convenience constructors cannot fail, so
//! a zero limit is carried as such and rejected once, with a clear message,
//! when a limiter is built ([`Quota::validate`]); [`Quota::new`] validates
//! immediately.

use std::time::Duration;

use crate::Error;

/// The largest limit or burst accepted. Scripts count in Lua numbers
/// (doubles), which are exact to 2^53; this leaves ample headroom.
pub const MAX_LIMIT: u64 = 1_000_000_000_000;

/// The longest period accepted.
pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

/// The shortest period accepted.
pub const MIN_PERIOD: Duration = Duration::from_millis(1);

/// `limit` permits per `period`, with an optional burst for token bucket
/// and GCRA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: u64,
    period: Duration,
    burst: Option<u64>,
}

impl Quota {
    /// `limit` permits per `period`.
    ///
    /// # Errors
    /// An [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) error if
    /// the limit is zero or above [`MAX_LIMIT`], or the period is below
    /// [`MIN_PERIOD`] or above [`MAX_PERIOD`].
    pub fn new(limit: u64, period: Duration) -> Result<Quota, Error> {
        let quota = Quota {
            limit,
            period,
            burst: None,
        };
        quota.validate()?;
        Ok(quota)
    }

    /// `limit` permits per second.
    pub const fn per_second(limit: u32) -> Quota {
        Quota::unchecked(limit as u64, Duration::from_secs(1))
    }

    /// `limit` permits per minute.
    pub const fn per_minute(limit: u32) -> Quota {
        Quota::unchecked(limit as u64, Duration::from_secs(60))
    }

    /// `limit` permits per hour.
    pub const fn per_hour(limit: u32) -> Quota {
        Quota::unchecked(limit as u64, Duration::from_secs(3600))
    }

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
    pub const fn with_burst(mut self, burst: u32) -> Quota {
        self.burst = Some(burst as u64);
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

    /// Checks every field.
    ///
    /// # Errors
    /// An [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) error
    /// naming the offending field.
    pub fn validate(&self) -> Result<(), Error> {
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
        match self.burst {
            Some(0) => Err(Error::invalid("quota burst must be at least 1")),
            Some(b) if b > MAX_LIMIT => Err(Error::invalid(format!(
                "quota burst {b} is above the maximum {MAX_LIMIT}"
            ))),
            _ => Ok(()),
        }
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
        let e = Quota::new(1, Duration::from_secs(400 * 24 * 3600)).unwrap_err();
        assert!(e.to_string().contains("period"));
        let e = Quota::new(MAX_LIMIT + 1, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("limit"));
        let e = Quota::per_second(5).with_burst(0).validate().unwrap_err();
        assert!(e.to_string().contains("burst"));
        assert!(Quota::per_minute(0).validate().is_err());
        assert!(Quota::per_hour(10).with_burst(20).validate().is_ok());
    }

    use crate::Algorithm;

    #[test]
    fn buckets_that_would_take_longer_than_the_longest_period_to_fill_are_refused() {
        let year = Duration::from_secs(366 * 24 * 3600);
        let q = Quota::new(1, year).unwrap().with_burst(1_000_000);
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
        assert_eq!(Quota::per_second(7).burst(), 7);
        assert_eq!(Quota::per_second(7).with_burst(3).burst(), 3);
        assert_eq!(
            Algorithm::FixedWindow.max_cost(&Quota::per_second(7).with_burst(3)),
            7
        );
        assert_eq!(
            Algorithm::Gcra.max_cost(&Quota::per_second(7).with_burst(3)),
            3
        );
    }
}
