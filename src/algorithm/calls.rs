//! The vocabulary between the limiters and the stores: what a script is
//! asked (a quota's numbers, a lease call, a give-back) and what it
//! answers. Plain values; nothing here talks to a store.

use crate::algorithm::Algorithm;
use crate::error::Error;
use crate::quota::Quota;

/// The numbers a script needs from a quota, in store units (microseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Params {
    pub(crate) algorithm: Algorithm,
    pub(crate) limit: u64,
    pub(crate) period_us: u64,
    pub(crate) burst: u64,
}

impl Params {
    pub(crate) fn new(quota: &Quota, algorithm: Algorithm) -> Self {
        Params {
            algorithm,
            limit: quota.limit(),
            period_us: quota.period_us(),
            burst: quota.burst(),
        }
    }
}

/// The reply of an exact check-and-count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AcquireReply {
    pub(crate) allowed: bool,
    pub(crate) remaining: u64,
    pub(crate) reset_after_us: u64,
    /// 0 when allowed, `None` when the cost can never be admitted.
    pub(crate) retry_after_us: Option<u64>,
    pub(crate) now_us: u64,
    /// Buckets: the level right after the decision, in thousandths,
    /// rounded up (0 for windows). With `now_us` and `given_back`, where a refund of this
    /// decision's take starts from (see [`LeaseOrigin`]).
    pub(crate) level: u64,
    /// Buckets: the key's give-back counter at the decision.
    pub(crate) given_back: u64,
}

/// Values in one check script's reply.
pub(crate) const CHECK_REPLY_LEN: usize = 7;

impl AcquireReply {
    pub(crate) fn from_values(v: &[i64]) -> Result<Self, Error> {
        if v.len() != CHECK_REPLY_LEN {
            return Err(Error::new(
                crate::error::ErrorKind::Store,
                format!(
                    "check script returned {} values, expected {CHECK_REPLY_LEN}",
                    v.len()
                ),
            ));
        }
        Ok(AcquireReply {
            allowed: v[0] == 1,
            remaining: v[1].max(0) as u64,
            reset_after_us: v[2].max(0) as u64,
            retry_after_us: (v[3] >= 0).then_some(v[3] as u64),
            now_us: v[4].max(0) as u64,
            level: v[5].max(0) as u64,
            given_back: v[6].max(0) as u64,
        })
    }
}

/// The identity of a mutating report (a give-back, a debt report, a
/// reconciliation): the store records it for a minute, so a second delivery
/// of the same report (a client retry, a pipeline resent after `NOSCRIPT`,
/// a resend after a timeout the store had already served) changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct OpId {
    /// Random per limiter instance.
    nonce: u64,
    seq: u64,
}

/// The nonce of this process's admission identities.
fn admission_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| OpIds::default().nonce ^ 0xAD41_5510)
}

/// A fresh sequence for an admission's refund identity, without a shared
/// write: this thread's tag (top bits) and its own count.
#[inline]
pub(crate) fn admission_seq() -> u64 {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};
    static THREADS: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NEXT: Cell<u64> = const { Cell::new(0) };
    }
    NEXT.try_with(|next| {
        let mut n = next.get();
        if n == 0 {
            n = THREADS.fetch_add(1, Ordering::Relaxed) << 40;
        }
        next.set(n + 1);
        n
    })
    .unwrap_or_else(|_| THREADS.fetch_add(1, Ordering::Relaxed) << 40)
}

impl OpId {
    /// The identity of this process's admission `seq` (see
    /// [`admission_seq`]).
    pub(crate) fn admission(seq: u64) -> OpId {
        OpId {
            nonce: admission_nonce(),
            seq,
        }
    }

    /// The identity key, in the same hash slot as the store key it reports on.
    pub(crate) fn key_for(&self, store_key: &str) -> String {
        format!("{store_key}:op:{:x}.{:x}", self.nonce, self.seq)
    }
}

/// Hands out [`OpId`]s: a random nonce per instance and a sequence.
#[derive(Debug)]
pub(crate) struct OpIds {
    nonce: u64,
    seq: std::sync::atomic::AtomicU64,
}

impl Default for OpIds {
    fn default() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        OpIds {
            nonce: h.finish(),
            seq: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl OpIds {
    /// This instance's identity as a lease holder.
    pub(crate) fn holder(&self) -> std::sync::Arc<str> {
        format!("{:x}", self.nonce).into()
    }

    pub(crate) fn next(&self) -> OpId {
        OpId {
            nonce: self.nonce,
            seq: self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// A lease's identity among this holder's leases (never 0).
    pub(crate) fn next_lease(&self) -> u64 {
        self.next().seq + 1
    }
}

/// The most debt one report carries: far above any real debt (at most
/// `max_debt` per process, or what a fallback admitted), far below what
/// the scripts' integer arithmetic can hold.
pub(crate) const MAX_REPORT: u64 = 1 << 50;

/// One lease: take up to `want` permits, and record `debt` permits admitted
/// on credit.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LeaseCall {
    pub(crate) key: String,
    pub(crate) want: u64,
    pub(crate) share_cap: f64,
    pub(crate) debt: u64,
    /// Fixed window: the window index the debt was admitted in.
    pub(crate) debt_window: i64,
    /// Fixed window: lease from window max(current, min_window), at most
    /// the next one; -1 for the current window.
    pub(crate) min_window: i64,
    /// Token bucket, GCRA: the fewest permits the waiting request needs.
    /// Fixed window: remainders up to this size are granted whole.
    pub(crate) need: u64,
    /// Fixed and sliding window: the waiting request's cost; a lease that
    /// grants nothing says when it fits. (A bucket's is `need`.)
    pub(crate) cost: u64,
    /// Set when `debt > 0`: the debt report's identity.
    pub(crate) op: Option<OpId>,
    /// Fixed window: the asking process, for the fair share of headroom.
    pub(crate) holder: Option<std::sync::Arc<str>>,
    /// The most this process takes in one lease; leases are at least a
    /// fair share of what remains, up to this (0: by rate only).
    pub(crate) ceiling: u64,
    /// Fixed window, with a holder: this lease's identity (0: none). The
    /// store keeps the holder's last grant under it; a lease call sent
    /// again under the same identity (its reply was lost to a timeout)
    /// gets that grant back instead of a second one, while its window
    /// lasts.
    pub(crate) lease_id: u64,
    /// Fixed window: a thin holder's lease of the next window, taken ahead
    /// of need, is granted only while the current window and the next
    /// each hold at most this many permits (0: no such cap).
    pub(crate) ahead_cap: u64,
}

impl LeaseCall {
    /// Asks for nothing and records nothing, in the store's current window:
    /// the base the other calls are built on, changing what they ask.
    pub(crate) fn nothing(key: String) -> Self {
        LeaseCall {
            key,
            want: 0,
            share_cap: 1.0,
            debt: 0,
            debt_window: -1,
            min_window: -1,
            need: 1,
            cost: 1,
            op: None,
            holder: None,
            ceiling: 0,
            lease_id: 0,
            ahead_cap: 0,
        }
    }

    /// Grants nothing; only records `debt` permits (against the store's
    /// current window when `window` is unknown).
    pub(crate) fn report(key: String, debt: u64, op: OpId) -> Self {
        LeaseCall {
            debt: debt.min(MAX_REPORT),
            op: Some(op),
            ..LeaseCall::nothing(key)
        }
    }

    /// Takes and records nothing: what the store has left of `window` (if
    /// it is the store's current one, else of the current one).
    pub(crate) fn peek(key: String, window: i64) -> Self {
        LeaseCall {
            min_window: window,
            ..LeaseCall::nothing(key)
        }
    }
}

/// What a lease granted, and what the store knows about the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct LeaseReply {
    pub(crate) granted: u64,
    /// Permits still unleased in the store after this grant.
    pub(crate) remaining: u64,
    /// Fixed window: time until the target window starts (pre-lease).
    pub(crate) start_after_us: u64,
    /// Time until the window ends (fixed window) or the bucket is full.
    pub(crate) reset_after_us: u64,
    /// When nothing was granted: time until a lease can succeed.
    pub(crate) retry_after_us: u64,
    pub(crate) now_us: u64,
    /// Debt permits the store could not cover: overshoot.
    pub(crate) uncovered: u64,
    /// Fixed window: the index of the window the grant belongs to.
    pub(crate) window: i64,
    /// Token bucket, GCRA: the bucket's level right after this grant, in
    /// thousandths, rounded up (part of the lease's origin, see
    /// [`LeaseOrigin`]).
    pub(crate) level: u64,
    /// Token bucket, GCRA: the key's give-back counter at this grant.
    pub(crate) given_back: u64,
}

/// Where a bucket lease came from: what a give-back of its permits must
/// send, so the store can refuse to return what the bucket's cap would
/// have dropped while the lease was out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct LeaseOrigin {
    /// Store time of the grant (µs).
    pub(crate) at_us: u64,
    /// The bucket's level right after it, in thousandths of a permit,
    /// rounded up (`bucket::LEVEL_SCALE`).
    pub(crate) level: u64,
    /// The key's give-back counter then.
    pub(crate) given_back: u64,
}

impl LeaseOrigin {
    /// Where an exact check's take of a bucket starts from.
    pub(crate) fn of_check(reply: &AcquireReply) -> LeaseOrigin {
        LeaseOrigin {
            at_us: reply.now_us,
            level: reply.level,
            given_back: reply.given_back,
        }
    }

    /// The more conservative of two origins for permits merged into one
    /// lease: the earlier grant (the longer a lease is out, the more its
    /// bucket may have refilled), the higher level and the lower counter.
    pub(crate) fn merge(self, other: LeaseOrigin) -> LeaseOrigin {
        LeaseOrigin {
            at_us: self.at_us.min(other.at_us),
            level: self.level.max(other.level),
            given_back: self.given_back.min(other.given_back),
        }
    }
}

impl LeaseReply {
    pub(crate) fn from_values(v: &[i64]) -> Result<Self, Error> {
        if v.len() != 10 {
            return Err(Error::new(
                crate::error::ErrorKind::Store,
                format!("lease script returned {} values, expected 10", v.len()),
            ));
        }
        let u = |i: usize| v[i].max(0) as u64;
        Ok(LeaseReply {
            granted: u(0),
            remaining: u(1),
            start_after_us: u(2),
            reset_after_us: u(3),
            retry_after_us: u(4),
            now_us: u(5),
            uncovered: u(6),
            window: v[7],
            level: u(8),
            given_back: u(9),
        })
    }
}

/// Permits to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GiveBackCall {
    pub(crate) key: String,
    pub(crate) returned: u64,
    /// Fixed window: the window index the permits were leased from.
    pub(crate) window: i64,
    /// Token bucket, GCRA: the lease the permits came from.
    pub(crate) origin: LeaseOrigin,
    pub(crate) op: OpId,
    /// How long the store remembers the identity (µs; 0: a minute). A
    /// refund's lasts its window, so it is given back once however often
    /// it is sent.
    pub(crate) remember_us: u64,
    /// A refund: a repeat answers [`Refunded::Already`], not the first
    /// answer again.
    pub(crate) refund: bool,
}

/// What the store did with a give-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refunded {
    /// This many permits were taken back by this delivery (or, for a
    /// give-back that is no refund, whose repeats are not told apart, by
    /// its first).
    Now(u64),
    /// A refund whose identity the store had seen: nothing taken back
    /// now; its first delivery took back this many.
    Already(u64),
}

impl Refunded {
    /// Permits taken back by whichever delivery landed first.
    pub(crate) fn permits(self) -> u64 {
        match self {
            Refunded::Now(n) | Refunded::Already(n) => n,
        }
    }

    /// Permits taken back by this delivery (none for a repeat).
    pub(crate) fn now(self) -> u64 {
        match self {
            Refunded::Now(n) => n,
            Refunded::Already(_) => 0,
        }
    }
}
