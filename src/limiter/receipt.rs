//! What an admission took, written down, so that another process (or this
//! one, later) can give part of it back: a reservation made by one replica
//! of a service and settled by the replica that saw the work end.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::Limiter;
use crate::algorithm::LeaseOrigin;
use crate::decision::{Decision, Taken, TakenFrom};
use crate::key::{local_key, Key};
use crate::Error;

/// What one admission took from the shared count, in a form that outlives
/// the [`Decision`]: a window's permits, or a bucket's tokens and where
/// the bucket stood. [`Limiter::refund_receipt`] gives part of it back
/// from any process of the fleet, to the window it came from while that
/// window lasts (a bucket: as far as it has not refilled since).
///
/// Written as text (`Display`, `FromStr`) to be kept where the later
/// settlement will find it. A receipt carries no secret and no identity a
/// store could check: keep it where clients cannot write, and refund it
/// once, in one place (the decision's own [`Limiter::refund`] and its
/// receipt's are two refunds).
///
/// ```
/// # async fn demo() -> Result<(), slicelimit::Error> {
/// use slicelimit::{nonzero, Limiter, MemoryStore, Quota, Receipt};
///
/// let store = MemoryStore::new();
/// let limiter = |store: &MemoryStore| {
///     Limiter::builder(Quota::per_minute(nonzero!(1_000)))
///         .store(store.clone())
///         .namespace("tokens")
///         .build()
/// };
/// let (here, there) = (limiter(&store)?, limiter(&store)?);
/// let decision = here.check("acme", 800).await;
/// let kept = decision.receipt().expect("a shared admission").to_string();
/// // Elsewhere, later: the work cost 300 of the 800.
/// let receipt: Receipt = kept.parse()?;
/// assert_eq!(there.refund_receipt("acme", &receipt, 500).await, 500);
/// assert_eq!(there.check("acme", 0).await.remaining(), 700);
/// # Ok(())
/// # }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Receipt {
    limit: u64,
    period_us: u64,
    cost: u64,
    at: At,
}

/// Where in time a receipt's permits lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// A window algorithm: the window's index, and how long it lasted after
    /// the admission (ms).
    Window { index: i64, lasts_ms: u64 },
    /// A bucket taken by the store: where it stood right after the take.
    Bucket(LeaseOrigin),
}

impl Receipt {
    /// The permits the admission took.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// The receipt of `decision`, if it can have one: an admission of one
    /// quota counted in the shared store (an exact limiter's, a hybrid
    /// window lease's), its period known.
    fn of(decision: &Decision) -> Option<Receipt> {
        let single = match decision.quotas() {
            [one] => one,
            _ => return None,
        };
        let taken = single.taken;
        if !single.is_allowed() || taken.cost == 0 || single.period().is_zero() {
            return None;
        }
        let at = match (taken.origin, taken.window()) {
            (TakenFrom::Store | TakenFrom::Lease, Some(index)) => At::Window {
                index,
                lasts_ms: taken.lasts().as_millis() as u64,
            },
            (TakenFrom::Store, None) => At::Bucket(taken.bucket_origin()),
            _ => return None,
        };
        Some(Receipt {
            limit: single.limit(),
            period_us: single.period().as_micros() as u64,
            cost: taken.cost,
            at,
        })
    }

    /// `n` of it (at most its cost), as the store gives permits back.
    fn taken(&self, n: u64) -> Taken {
        let cost = n.min(self.cost);
        match self.at {
            At::Window { index, lasts_ms } => Taken::new(TakenFrom::Store, cost, Some(index))
                .lasting(Duration::from_millis(lasts_ms)),
            At::Bucket(origin) => Taken::of_bucket(TakenFrom::Store, cost, origin),
        }
    }
}

impl fmt::Display for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, a, b, c) = match self.at {
            At::Window { index, lasts_ms } => ('w', index, lasts_ms, 0),
            At::Bucket(o) => ('b', o.at_us as i64, o.level, o.given_back),
        };
        write!(
            f,
            "r1.{}.{}.{}.{kind}.{a}.{b}.{c}",
            self.limit, self.period_us, self.cost
        )
    }
}

impl FromStr for Receipt {
    type Err = Error;

    fn from_str(s: &str) -> Result<Receipt, Error> {
        let bad = || Error::invalid(format!("not a receipt: {:?}", truncated(s)));
        let fields: Vec<&str> = s.split('.').collect();
        let [version, limit, period_us, cost, kind, a, b, c] = fields.as_slice() else {
            return Err(bad());
        };
        if *version != "r1" {
            return Err(bad());
        }
        let int = |f: &str| f.parse::<u64>().map_err(|_| bad());
        let (limit, period_us, cost) = (int(limit)?, int(period_us)?, int(cost)?);
        let a: i64 = a.parse().map_err(|_| bad())?;
        let (b, c) = (int(b)?, int(c)?);
        let at = match *kind {
            "w" if a >= 0 && c == 0 => At::Window {
                index: a,
                lasts_ms: b,
            },
            "b" if a >= 0 => At::Bucket(LeaseOrigin {
                at_us: a as u64,
                level: b,
                given_back: c,
            }),
            _ => return Err(bad()),
        };
        if limit == 0 || period_us == 0 {
            return Err(bad());
        }
        Ok(Receipt {
            limit,
            period_us,
            cost,
            at,
        })
    }
}

/// The start of `s`, for an error message.
fn truncated(s: &str) -> &str {
    match s.char_indices().nth(64) {
        Some((end, _)) => &s[..end],
        None => s,
    }
}

impl Decision {
    /// What this admission took, for a refund by another process (see
    /// [`Receipt`]); `None` for a denial, a decision of several quotas, or
    /// an admission not counted in the shared store (a per-process count,
    /// a bucket lease, credit, a failure policy's).
    pub fn receipt(&self) -> Option<Receipt> {
        Receipt::of(self)
    }
}

impl Limiter {
    /// Gives `n` of what `receipt` took from `key` back (at most what it
    /// took), to the window it came from while that window lasts; returns
    /// the permits given back. A limiter of one quota only, the quota the
    /// receipt was written under (else nothing goes back: a receipt of
    /// another limit or period counts other windows). Refund a receipt
    /// once (see [`Receipt`]).
    pub async fn refund_receipt(&self, key: &str, receipt: &Receipt, n: u64) -> u64 {
        if self.inner.tiers.len() != 1 {
            return 0;
        }
        let quota = self.quota_of(key);
        if n == 0
            || quota.limit() != receipt.limit
            || quota.period().as_micros() as u64 != receipt.period_us
        {
            return 0;
        }
        let kept = local_key(key);
        let key = Key {
            given: key,
            kept: &kept,
        };
        self.inner.refund_taken(key, 0, receipt.taken(n)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receipt_reads_back_what_it_wrote() {
        for at in [
            At::Window {
                index: 28_333_334,
                lasts_ms: 41_250,
            },
            At::Bucket(LeaseOrigin {
                at_us: 1_700_000_000_123_456,
                level: 2_500_000,
                given_back: 7,
            }),
        ] {
            let receipt = Receipt {
                limit: 1_000_000,
                period_us: 60_000_000,
                cost: 2_048,
                at,
            };
            assert_eq!(receipt.to_string().parse::<Receipt>().unwrap(), receipt);
        }
    }

    #[test]
    fn anything_else_is_refused_with_a_reason() {
        for text in [
            "",
            "r1",
            "r2.10.60000000.5.w.1.0.0",
            "r1.0.60000000.5.w.1.0.0",
            "r1.10.0.5.w.1.0.0",
            "r1.10.60000000.5.x.1.0.0",
            "r1.10.60000000.5.w.-1.0.0",
            "r1.10.60000000.-5.w.1.0.0",
            "r1.10.60000000.5.w.1.0.0.9",
            &"9".repeat(10_000),
        ] {
            let err = text.parse::<Receipt>().unwrap_err();
            assert!(err.to_string().contains("not a receipt"), "{err}");
            assert!(err.to_string().len() < 200, "{err}");
        }
    }
}
