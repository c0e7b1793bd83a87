//! Algorithms: how permits are counted over time, one file each.
//!
//! Each algorithm's file owns everything that is particular to it: its Lua
//! scripts (`include_str!` from `lua/`, the single source of truth), the
//! typed arguments they take, the embedded store's mirror of them written
//! as state transitions over a stored value, what it requires of a quota,
//! and which kind of hybrid lease its scripts grant. [`Algorithm::spec`] is
//! the one place that names the variants; every other module reads the
//! [`Spec`] it returns and never matches on an algorithm itself.
//!
//! This is the bottom layer: it imports nothing from the stores, the
//! failure layer or the limiters above it.
//!
//! # Adding an algorithm
//!
//! Write `src/algorithm/<name>.rs` with a `pub(super) static SPEC: Spec`
//! and its scripts in `lua/`; add the variant to [`Algorithm`] and one arm
//! to [`Algorithm::spec`]. Its hybrid leases are either window leases
//! ([`LeaseKind::Window`], granted by `lua/lease_window.lua` with a carry
//! of the algorithm's own) or bucket leases ([`LeaseKind::Bucket`]).

mod bucket;
mod calls;
mod fixed_window;
mod gcra;
mod scripts;
mod sliding_window;
mod state;
mod token_bucket;
mod window;

pub(crate) use self::calls::{
    admission_seq, AcquireReply, GiveBackCall, LeaseCall, LeaseOrigin, LeaseReply, OpId, OpIds,
    Params, Refunded, CHECK_REPLY_LEN, MAX_REPORT,
};
pub(crate) use self::scripts::{count_in_window, Check, CheckAll, GiveBack, Lease};
pub(crate) use self::state::Entry;
pub(crate) use crate::store::{Arg, Lua};

use crate::error::Error;
use crate::quota::Quota;

/// How permits are counted over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// `limit` permits per epoch-aligned window of `period`; the count resets
    /// at each window boundary.
    #[default]
    FixedWindow,
    /// The sliding-window counter: a request is admitted while this
    /// window's count plus the previous window's, weighted by how much of
    /// it the trailing `period` still overlaps, stays within `limit`. No
    /// reset at the boundary (a key cannot spend twice its limit across
    /// one), at the cost of one more number of state than a fixed window.
    SlidingWindow,
    /// A bucket of `burst` tokens refilled continuously at `limit / period`.
    TokenBucket,
    /// The generic cell rate algorithm: one theoretical arrival time per key,
    /// the same admissions as a token bucket with one number of state.
    Gcra,
}

impl Algorithm {
    /// Everything particular to this algorithm. The only match on the
    /// variants in the crate.
    pub(crate) fn spec(self) -> &'static Spec {
        match self {
            Algorithm::FixedWindow => &fixed_window::SPEC,
            Algorithm::SlidingWindow => &sliding_window::SPEC,
            Algorithm::TokenBucket => &token_bucket::SPEC,
            Algorithm::Gcra => &gcra::SPEC,
        }
    }

    /// A short, stable name.
    pub fn as_str(self) -> &'static str {
        self.spec().name
    }

    /// Every algorithm, for tests and tools that try each one.
    pub fn all() -> [Algorithm; 4] {
        [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::TokenBucket,
            Algorithm::Gcra,
        ]
    }

    pub(crate) fn key_suffix(self) -> &'static str {
        self.spec().key_suffix
    }

    /// Checks what only this algorithm requires of a quota.
    ///
    /// # Errors
    /// An [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) error
    /// saying what to change.
    pub fn check_quota(self, quota: &Quota) -> Result<(), Error> {
        (self.spec().check_quota)(quota)
    }

    /// The most a single request can cost and still be admissible.
    pub(crate) fn max_cost(self, quota: &Quota) -> u64 {
        (self.spec().max_cost)(quota)
    }
}

impl std::str::FromStr for Algorithm {
    type Err = Error;

    /// Parses a name [`Algorithm::as_str`] gives (`fixed-window`,
    /// `sliding-window`, `token-bucket`, `gcra`).
    fn from_str(name: &str) -> Result<Self, Error> {
        Algorithm::all()
            .into_iter()
            .find(|a| a.as_str() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Algorithm::all().iter().map(|a| a.as_str()).collect();
                Error::invalid(format!(
                    "unknown algorithm {name:?}; one of {}",
                    names.join(", ")
                ))
            })
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stored value read as the algorithm expects it: the embedded store's
/// mirror of a script is a function over it.
pub(crate) type Stored<'a> = &'a mut Option<Entry>;

/// Everything particular to one algorithm (see the module docs).
pub(crate) struct Spec {
    /// [`Algorithm::as_str`].
    pub(crate) name: &'static str,
    /// Ends every store key of this algorithm, so two algorithms never
    /// read each other's state.
    pub(crate) key_suffix: &'static str,
    /// The exact check-and-count.
    pub(crate) exact: Lua,
    /// The exact check of several quotas of one key, all-or-nothing.
    pub(crate) exact_all: Lua,
    /// The hybrid lease.
    pub(crate) lease: Lua,
    /// The exact script's ARGV for a request of `cost`.
    pub(crate) exact_args: fn(&Params, u64, &mut Vec<Arg>),
    /// The lease script's ARGV.
    pub(crate) lease_args: fn(&Params, &LeaseCall, &mut Vec<Arg>),
    /// `lua/give_back.lua`'s ARGV (one script serves every layout).
    pub(crate) give_back_args: fn(&Params, &GiveBackCall, &mut Vec<Arg>),
    /// What a quota must satisfy beyond [`Quota::new`]'s checks.
    pub(crate) check_quota: fn(&Quota) -> Result<(), Error>,
    /// The most one request may cost.
    pub(crate) max_cost: fn(&Quota) -> u64,
    /// Mirror of the exact script: (state, now, cost) → (state, reply).
    pub(crate) check: fn(Stored<'_>, &Params, u64, u64, &str) -> Result<AcquireReply, Error>,
    /// Mirror of the lease script.
    pub(crate) lease_mirror: fn(Stored<'_>, &Params, u64, &LeaseCall) -> Result<LeaseReply, Error>,
    /// Mirror of the give-back script's branch for this layout, on a key
    /// that exists (the script answers 0 for a missing one before it
    /// branches, and so does the embedded store).
    pub(crate) give_back: fn(Stored<'_>, &Params, u64, &GiveBackCall) -> Result<u64, Error>,
    /// Which kind of lease the lease script grants.
    pub(crate) leases: LeaseKind,
    /// Whether leasing the next window ahead of its start pays (window
    /// leases): yes where windows are independent and the budget renews
    /// whole at the boundary (the fixed window); no where the next
    /// window's permits count against the current one (the sliding
    /// window: a pre-lease would take them from the window still running,
    /// and at its boundary nothing renews at once).
    pub(crate) pre_leases: bool,
}

impl std::fmt::Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spec").field("name", &self.name).finish()
    }
}

/// Returns unused permits of any layout (see its header).
pub(crate) static GIVE_BACK: Lua = Lua::new("give_back", include_str!("../../lua/give_back.lua"));

/// How a hybrid lease lives and ends: the two lease mechanisms the hybrid
/// limiter implements. An algorithm declares which one its lease script
/// grants; the hybrid never asks which algorithm it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseKind {
    /// Permits belong to one window of the store's clock and are void at
    /// its end; the next window can be leased ahead (a pre-lease); a lease
    /// has an identity, so a resend after a lost reply gets the same
    /// grant; credit is counted per window; expired permits are stranded
    /// (the window they belong to is over).
    Window,
    /// Permits are drawn from a refilling bucket, valid for the lease
    /// horizon; a lease near its end is renewed (the unspent permits go
    /// back in the same call); expired permits are given back, capped by
    /// what the bucket could have held meanwhile (the lease's origin).
    Bucket,
}

/// What a lease call asks for, from the holding's state (see
/// [`LeaseKind::target`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseView {
    /// The window the holding's permits belong to (window leases), or `None`.
    pub(crate) window: Option<i64>,
    /// Whether the holding's permits are still spendable.
    pub(crate) valid: bool,
    /// Whether they end within the early-refill lead.
    pub(crate) near_end: bool,
    /// Whether a reply sent now would arrive after they end.
    pub(crate) ending: bool,
    /// Whether this call should take the next window ahead.
    pub(crate) prelease: bool,
    /// Whether the next window is already held.
    pub(crate) has_next: bool,
    /// Local µs until the holding's permits end (0 once they have).
    pub(crate) left_us: u64,
    /// Local µs since they ended (0 while they have not).
    pub(crate) since_us: u64,
    pub(crate) period_us: u64,
}

/// The answer of [`LeaseKind::target`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LeaseTarget {
    /// The lease script's `min_window` (-1: the current window).
    pub(crate) min_window: i64,
    /// A bucket lease renewed in place (its unspent permits returned).
    pub(crate) renew: bool,
    /// How long the granted permits can be spent, if known.
    pub(crate) time_left_us: Option<u64>,
}

impl LeaseKind {
    /// Whether leases belong to windows.
    pub(crate) fn windowed(self) -> bool {
        self == LeaseKind::Window
    }

    /// Which window (if any) a lease call asks for, and for how long its
    /// permits will be spendable.
    pub(crate) fn target(self, v: &LeaseView) -> LeaseTarget {
        match self {
            LeaseKind::Window => window::target(v),
            LeaseKind::Bucket => bucket::target(v),
        }
    }

    /// The `need` a lease call sends for a request needing `need` permits.
    pub(crate) fn need(self, need: u64, limit: u64) -> u64 {
        match self {
            LeaseKind::Window => window::need(need, limit),
            LeaseKind::Bucket => need.max(1),
        }
    }

    /// Whether a lease carries an identity (see [`LeaseCall::lease_id`]).
    pub(crate) fn identified(self) -> bool {
        self.windowed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for a in Algorithm::all() {
            assert_eq!(a.as_str().parse::<Algorithm>().unwrap(), a);
        }
        let e = "leaky".parse::<Algorithm>().unwrap_err();
        assert!(e.is_invalid_input() && e.to_string().contains("sliding-window"));
    }

    #[test]
    fn names_and_key_suffixes_are_unique() {
        let all = Algorithm::all();
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a.as_str(), b.as_str());
                assert_ne!(a.key_suffix(), b.key_suffix());
            }
        }
        let names: Vec<&str> = Algorithm::all()
            .into_iter()
            .flat_map(|a| [&a.spec().exact, &a.spec().exact_all, &a.spec().lease])
            .chain([&GIVE_BACK])
            .map(|s| s.name())
            .collect();
        for (i, n) in names.iter().enumerate() {
            assert!(!names[i + 1..].contains(n), "{n} twice");
        }
    }
}
