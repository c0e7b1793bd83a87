//! The embedded, in-process store.
//!
//! It mirrors the Lua scripts step for step (the differential tests hold it
//! to that), on an injected clock, so the exact and hybrid limiters run
//! without Redis in one process and their logic is tested without sleeping.
//! Expired entries are forgotten lazily and swept now and then; nothing
//! lives forever. It owns no policy and performs no I/O.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dashmap::DashMap;

use crate::algorithm::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, Params};
use crate::algorithm::{Entry, State};
use crate::clock::{micros, Clock, SystemClock};
use crate::error::Error;
use std::collections::HashMap;
use std::sync::Mutex;

/// Sweep expired entries at most once per this many operations.
const SWEEP_EVERY: u64 = 4096;

/// An in-process store with the same semantics as the Redis scripts.
///
/// Clones share one set of counters, like connections to one Redis server.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    /// Store key → state; the same keys the Redis scripts would write.
    entries: DashMap<String, Entry>,
    /// The store's own clock: plays the part of Redis `TIME`.
    clock: Arc<dyn Clock>,
    /// Operations since creation, to pace sweeps.
    ops: AtomicU64,
    /// Identities of reports already applied (op key → first answer,
    /// expiry), as the scripts' identity keys. Held across the report it
    /// guards, so a duplicate cannot slip in between check and record.
    ops_seen: Mutex<HashMap<String, (u64, u64)>>,
    /// Serialises checks of several quotas, as one script would be.
    several: Mutex<()>,
    /// Rate shares by bucket key (`share.rs`).
    #[cfg(feature = "server")]
    shares: Mutex<HashMap<String, HashMap<String, crate::share::Hold>>>,
    /// In-flight slot leases by key (the concurrency limiter's).
    slots: Mutex<HashMap<String, HashMap<String, crate::slots::SlotLease>>>,
}

/// Runs `apply` on the holders of `key` in `keys` (none if the key is
/// new) and forgets the key once it has none left, as Redis forgets a
/// hash whose last field is deleted.
fn with_holders<T, R>(
    keys: &Mutex<HashMap<String, HashMap<String, T>>>,
    key: &str,
    apply: impl FnOnce(&mut HashMap<String, T>) -> R,
) -> R {
    let mut keys = keys.lock().unwrap_or_else(|e| e.into_inner());
    let holders = keys.entry(key.to_owned()).or_default();
    let out = apply(holders);
    if holders.is_empty() {
        keys.remove(key);
    }
    out
}

/// How long a report's identity is remembered (the scripts' 60 s).
const OP_TTL_US: u64 = 60_000_000;

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("entries", &self.shared.entries.len())
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// A store on the system clock.
    pub fn new() -> Self {
        MemoryStore::with_clock(SystemClock::new())
    }

    /// A store on the given clock (a [`FakeClock`](crate::FakeClock) in tests).
    pub fn with_clock(clock: impl Clock) -> Self {
        MemoryStore::with_shared_clock(Arc::new(clock))
    }

    pub(crate) fn with_shared_clock(clock: Arc<dyn Clock>) -> Self {
        MemoryStore {
            shared: Arc::new(Shared {
                entries: DashMap::new(),
                clock,
                ops: AtomicU64::new(0),
                ops_seen: Mutex::new(HashMap::new()),
                several: Mutex::new(()),
                #[cfg(feature = "server")]
                shares: Mutex::new(HashMap::new()),
                slots: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Sets leases on a key's in-flight slots, as `lua/slots.lua` does.
    pub(crate) fn slots(
        &self,
        key: &str,
        call: &crate::slots::SlotsCall,
    ) -> (Vec<crate::slots::SlotsReply>, u64) {
        let now_ms = self.now() / 1_000;
        with_holders(&self.shared.slots, key, |leases| {
            crate::slots::apply(leases, call, now_ms)
        })
    }

    /// Slots the leases of `key` hold (expired ones included until a
    /// call drops them).
    #[cfg(test)]
    pub(crate) fn slots_held(&self, key: &str) -> u64 {
        let slots = self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots
            .get(key)
            .map_or(0, |l| l.values().map(|l| l.held).sum())
    }

    /// Forgets every rate share, as a Redis restarted empty would.
    #[cfg(all(test, feature = "server"))]
    pub(crate) fn forget_shares(&self) {
        self.shared
            .shares
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// A holder's share of a rate, as `lua/rate_share.lua` does it.
    #[cfg(feature = "server")]
    pub(crate) fn share(
        &self,
        key: &str,
        call: &crate::share::ShareCall,
    ) -> crate::share::ShareReply {
        let now_ms = self.now() / 1_000;
        with_holders(&self.shared.shares, key, |holders| {
            crate::share::apply(holders, call, now_ms)
        })
    }

    /// Entries currently held, expired ones included until the next sweep.
    pub fn len(&self) -> usize {
        self.shared.entries.len()
    }

    /// Whether the store holds no entry.
    pub fn is_empty(&self) -> bool {
        self.shared.entries.is_empty()
    }

    fn now(&self) -> u64 {
        let ops = self.shared.ops.fetch_add(1, Ordering::Relaxed);
        let now = micros(&*self.shared.clock);
        if ops % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.shared.entries.retain(|_, e| e.expires_us > now);
        }
        now
    }

    /// Runs `f` on the live entry for `key` (None if absent or expired).
    fn with_entry<R>(&self, key: &str, now: u64, f: impl FnOnce(&mut Option<Entry>) -> R) -> R {
        // get_mut first: a known key costs no allocation.
        let mut slot = match self.shared.entries.get_mut(key) {
            Some(slot) => slot,
            None => self.shared.entries.entry(key.to_owned()).or_insert(Entry {
                state: State::Window(Vec::new()),
                expires_us: 0,
                holders: None,
            }),
        };
        let mut live = (slot.expires_us > now).then(|| slot.clone());
        let out = f(&mut live);
        match live {
            Some(entry) => *slot = entry,
            None => slot.expires_us = 0,
        }
        drop(slot);
        out
    }

    pub(crate) fn acquire(&self, key: &str, p: &Params, cost: u64) -> Result<AcquireReply, Error> {
        let now = self.now();
        let check = p.algorithm.spec().check;
        self.with_entry(key, now, |entry| check(entry, p, now, cost, key))
    }

    /// A copy of `key`'s live entry, to decide on without writing.
    fn peek_entry(&self, key: &str, now: u64) -> Option<Entry> {
        self.shared
            .entries
            .get(key)
            .filter(|e| e.expires_us > now)
            .map(|e| e.clone())
    }

    /// Several quotas of one key, all-or-nothing at one instant, as
    /// `lua/check_all.lua`: each is decided without writing, then counted
    /// only if every one admits.
    pub(crate) fn acquire_all(
        &self,
        keys: &[String],
        ps: &[Params],
        cost: u64,
    ) -> Result<Vec<AcquireReply>, Error> {
        let _several = self
            .shared
            .several
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let now = self.now();
        let mut replies = Vec::with_capacity(keys.len());
        for (key, p) in keys.iter().zip(ps) {
            let check = p.algorithm.spec().check;
            replies.push(check(&mut self.peek_entry(key, now), p, now, cost, key)?);
        }
        let admitted = replies.iter().all(|r| r.allowed);
        for (i, (key, p)) in keys.iter().zip(ps).enumerate() {
            let check = p.algorithm.spec().check;
            if admitted {
                replies[i] = self.with_entry(key, now, |entry| check(entry, p, now, cost, key))?;
            } else if replies[i].allowed {
                // Nothing is taken: a quota with room reports it untouched,
                // as a peek would.
                replies[i] = check(&mut self.peek_entry(key, now), p, now, 0, key)?;
            }
        }
        Ok(replies)
    }

    pub(crate) fn lease(&self, p: &Params, call: &LeaseCall) -> Result<LeaseReply, Error> {
        let now = self.now();
        let op = call
            .op
            .filter(|_| call.debt > 0)
            .map(|op| op.key_for(&call.key));
        self.once(op, now, |seen| {
            let mut call = call.clone();
            if seen.is_some() {
                call.debt = 0;
            }
            let lease = p.algorithm.spec().lease_mirror;
            let mut reply = self.with_entry(&call.key, now, |entry| lease(entry, p, now, &call))?;
            if let Some(uncovered) = seen {
                reply.uncovered = uncovered;
            }
            Ok((reply, (call.debt > 0).then_some(reply.uncovered)))
        })
    }

    pub(crate) fn give_back(&self, p: &Params, call: &GiveBackCall) -> Result<u64, Error> {
        let now = self.now();
        let remember = call.remember_us.max(OP_TTL_US);
        let repeat = if call.refund {
            crate::algorithm::REPEAT
        } else {
            0
        };
        self.once_for(
            Some(call.op.key_for(&call.key)),
            now,
            remember,
            |seen| match seen {
                Some(back) => Ok((back + repeat, None)),
                None => {
                    let give_back = p.algorithm.spec().give_back;
                    let back = self.with_entry(&call.key, now, |entry| {
                        // A key that does not exist gets nothing back,
                        // whatever its layout (`give_back.lua`'s EXISTS).
                        if entry.is_none() {
                            return Ok(0);
                        }
                        give_back(entry, p, now, call)
                    })?;
                    Ok((back, Some(back)))
                }
            },
        )
    }

    /// Runs a report under its identity, as the scripts do with their
    /// identity key: `f` learns the first answer if this is a second
    /// delivery, and returns what to remember (if anything).
    fn once<R>(
        &self,
        op: Option<String>,
        now: u64,
        f: impl FnOnce(Option<u64>) -> Result<(R, Option<u64>), Error>,
    ) -> Result<R, Error> {
        self.once_for(op, now, OP_TTL_US, f)
    }

    /// [`once`](Self::once), remembering the identity for `keep_us` µs.
    fn once_for<R>(
        &self,
        op: Option<String>,
        now: u64,
        keep_us: u64,
        f: impl FnOnce(Option<u64>) -> Result<(R, Option<u64>), Error>,
    ) -> Result<R, Error> {
        let Some(op) = op else {
            return f(None).map(|(r, _)| r);
        };
        let mut ops = self
            .shared
            .ops_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Swept each time it reaches a new power of two: amortised O(1).
        if ops.len() >= SWEEP_EVERY as usize && ops.len().is_power_of_two() {
            ops.retain(|_, (_, expires)| *expires > now);
        }
        let seen = ops.get(&op).filter(|(_, e)| *e > now).map(|(v, _)| *v);
        let (reply, remember) = f(seen)?;
        if let Some(value) = remember {
            ops.insert(op, (value, now + keep_us));
        }
        Ok(reply)
    }

    /// The longest time to live of any entry, including report identities;
    /// `None` if some entry would never expire (the simulation checks this
    /// the way tests check Redis keys for a TTL).
    #[cfg(feature = "test-support")]
    pub fn longest_ttl(&self) -> Option<std::time::Duration> {
        self.longest_ttl_us().map(std::time::Duration::from_micros)
    }

    /// Permits counted in window `window` for `key` under `namespace` by
    /// a window algorithm, as a test would `HGET` the Redis key.
    #[cfg(feature = "test-support")]
    pub fn window_count(
        &self,
        namespace: &str,
        key: &str,
        algorithm: crate::algorithm::Algorithm,
        window: i64,
    ) -> Option<i64> {
        self.quota_window_count(namespace, key, algorithm, 0, window)
    }

    /// [`window_count`](MemoryStore::window_count) for a limiter's quota
    /// at `index` (0: the first; see `Builder::and`).
    #[cfg(feature = "test-support")]
    pub fn quota_window_count(
        &self,
        namespace: &str,
        key: &str,
        algorithm: crate::algorithm::Algorithm,
        index: usize,
        window: i64,
    ) -> Option<i64> {
        let store_key = crate::key::KeyEncoder::new(namespace)
            .for_quota(index)
            .store_key(key, algorithm);
        self.count_in_window(&store_key, window)
    }

    #[cfg(feature = "test-support")]
    fn longest_ttl_us(&self) -> Option<u64> {
        let now = micros(&*self.shared.clock);
        let mut longest = 0u64;
        for e in self.shared.entries.iter() {
            if e.expires_us == u64::MAX {
                return None;
            }
            longest = longest.max(e.expires_us.saturating_sub(now));
        }
        let ops = self
            .shared
            .ops_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (_, expires) in ops.values() {
            longest = longest.max(expires.saturating_sub(now));
        }
        Some(longest)
    }

    /// Forgets everything, like a Redis server restarted without
    /// persistence.
    #[cfg(feature = "test-support")]
    pub(crate) fn clear(&self) {
        self.shared.entries.clear();
        self.shared
            .ops_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Permits counted in a fixed window for a store key, if the key lives.
    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn count_in_window(&self, key: &str, window: i64) -> Option<i64> {
        let now = micros(&*self.shared.clock);
        let entry = self.shared.entries.get(key)?;
        if entry.expires_us <= now {
            return None;
        }
        match &entry.state {
            State::Window(w) => w.iter().find(|(i, _)| *i == window).map(|(_, c)| *c),
            _ => None,
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;
    use crate::clock::FakeClock;
    use crate::nonzero;
    use crate::quota::Quota;
    use std::time::Duration;

    fn store() -> (MemoryStore, FakeClock) {
        let clock = FakeClock::new(Duration::from_secs(1_700_000_000));
        (MemoryStore::with_clock(clock.clone()), clock)
    }

    #[test]
    fn fixed_window_counts_and_resets_at_the_boundary() {
        let (s, clock) = store();
        let p = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::FixedWindow);
        for i in 0..3 {
            let r = s.acquire("k", &p, 1).unwrap();
            assert!(r.allowed);
            assert_eq!(r.remaining, 2 - i);
        }
        let r = s.acquire("k", &p, 1).unwrap();
        assert!(!r.allowed);
        assert_eq!(r.retry_after_us, Some(1_000_000));
        clock.advance(Duration::from_secs(1));
        assert!(s.acquire("k", &p, 1).unwrap().allowed);
        assert_eq!(s.acquire("k", &p, 4).unwrap().retry_after_us, None);
    }

    #[test]
    fn token_bucket_refills_continuously() {
        let (s, clock) = store();
        let p = Params::new(&Quota::per_second(nonzero!(10)), Algorithm::TokenBucket);
        assert!(s.acquire("k", &p, 10).unwrap().allowed);
        let r = s.acquire("k", &p, 1).unwrap();
        assert!(!r.allowed);
        assert_eq!(r.retry_after_us, Some(100_000));
        clock.advance(Duration::from_millis(100));
        assert!(s.acquire("k", &p, 1).unwrap().allowed);
    }

    #[test]
    fn gcra_admits_the_burst_then_one_per_interval() {
        let (s, clock) = store();
        let p = Params::new(
            &Quota::per_second(nonzero!(10)).with_burst(nonzero!(5)),
            Algorithm::Gcra,
        );
        for _ in 0..5 {
            assert!(s.acquire("k", &p, 1).unwrap().allowed);
        }
        let r = s.acquire("k", &p, 1).unwrap();
        assert!(!r.allowed);
        assert_eq!(r.retry_after_us, Some(100_000));
        clock.advance(Duration::from_millis(100));
        assert!(s.acquire("k", &p, 1).unwrap().allowed);
        assert!(!s.acquire("k", &p, 1).unwrap().allowed);
    }

    #[test]
    fn entries_expire_and_are_swept() {
        let (s, clock) = store();
        let p = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::FixedWindow);
        for i in 0..100 {
            s.acquire(&format!("k{i}"), &p, 1).unwrap();
        }
        clock.advance(Duration::from_secs(5));
        for _ in 0..SWEEP_EVERY {
            s.acquire("other", &p, 0).unwrap();
        }
        assert!(s.len() <= 1, "{}", s.len());
    }

    #[test]
    fn wrong_type_is_an_error_not_a_panic() {
        let (s, _) = store();
        let fw = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::FixedWindow);
        let tb = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::TokenBucket);
        s.acquire("k", &fw, 1).unwrap();
        assert!(s.acquire("k", &tb, 1).unwrap_err().is_wrong_type());
    }

    #[test]
    fn fixed_window_lease_honours_share_cap_and_records_debt() {
        let (s, _) = store();
        let p = Params::new(&Quota::per_second(nonzero!(100)), Algorithm::FixedWindow);
        let mut call = LeaseCall {
            want: 1000,
            share_cap: 0.5,
            debt_window: 0,
            ..LeaseCall::nothing("k".into())
        };
        let r = s.lease(&p, &call).unwrap();
        assert_eq!((r.granted, r.remaining), (50, 50));
        let r = s.lease(&p, &call).unwrap();
        assert_eq!((r.granted, r.remaining), (25, 25));
        call.want = 0;
        call.debt = 40;
        call.debt_window = r.window;
        let r = s.lease(&p, &call).unwrap();
        assert_eq!((r.granted, r.uncovered, r.remaining), (0, 15, 0));
    }

    /// As the lease script: a holder's ask that gets nothing, and debt
    /// reported into a window already counted, leave the key's TTL as it
    /// was (it outlives the newest counted window by one period), so the
    /// embedded store forgets the key when Redis does.
    #[test]
    fn a_window_lease_lengthens_the_ttl_only_when_a_window_count_is_created() {
        let (s, clock) = store();
        let period = Duration::from_secs(60);
        let p = Params::new(&Quota::new(3, period).unwrap(), Algorithm::SlidingWindow);
        let p_us = period.as_micros() as u64;
        let now = |c: &FakeClock| c.now().as_micros() as u64;
        // Into a window: W's count is created, the key lives to (W+2)·P.
        let into = p_us - now(&clock) % p_us + 1_000;
        clock.advance(Duration::from_micros(into));
        let w = (now(&clock) / p_us) as i64;
        assert!(s.acquire("k", &p, 3).unwrap().allowed);
        // W+1: full from W's weight alone; the ask gets nothing.
        clock.advance(period);
        let ask = LeaseCall {
            want: 1,
            holder: Some("c".into()),
            ceiling: 1,
            lease_id: 1,
            ..LeaseCall::nothing("k".into())
        };
        assert_eq!(s.lease(&p, &ask).unwrap().granted, 0);
        // Late debt into W, whose count exists.
        let ops = crate::algorithm::OpIds::default();
        let report = LeaseCall {
            debt_window: w,
            ..LeaseCall::report("k".into(), 1, ops.next())
        };
        s.lease(&p, &report).unwrap();
        assert_eq!(s.count_in_window("k", w), Some(4));
        // (W+2)·P: gone, as in Redis.
        clock.advance(Duration::from_micros(p_us - 1_000));
        assert_eq!(s.count_in_window("k", w), None);
    }
}
