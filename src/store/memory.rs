//! The embedded, in-process store.
//!
//! It runs each script's Rust mirror (see [`Call::mirror`]) where Redis
//! would run its Lua, on an injected clock, so the exact and hybrid
//! limiters run without Redis in one process and their logic is tested
//! without sleeping. Keys live in shards by hash tag: a script locks its
//! keys' shard for the whole call, as Redis runs a script alone (a call's
//! keys share a hash tag, as Redis Cluster requires). Expired values are
//! forgotten lazily and swept now and then; nothing lives forever. It
//! owns no policy and performs no I/O.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::script::{Call, Script};
use super::{Backend, Ran, StoreCost};
use crate::clock::{micros, Clock, SystemClock};
use crate::error::Error;

/// Sweep expired values at most once per this many calls.
const SWEEP_EVERY: u64 = 4096;

/// Shards of the key space; a power of two.
const SHARDS: usize = 32;

/// An in-process store with the same semantics as the Redis scripts.
///
/// Clones share one set of values, like connections to one Redis server.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    /// Store key → value, in shards by hash tag.
    shards: Box<[Mutex<HashMap<String, Held>>]>,
    /// The store's own clock: plays the part of Redis `TIME`.
    clock: Arc<dyn Clock>,
    /// Calls since creation, to pace sweeps.
    calls: AtomicU64,
}

/// One key's value and when it expires.
struct Held {
    /// An `Option<T>` for the value's type `T`, boxed once: a key that is
    /// written again reuses the box.
    value: Box<dyn Any + Send>,
    /// Store time (µs) from which the value is as good as absent.
    expires_us: u64,
}

/// The keys of one hash tag, locked for one script call: what a mirror
/// reads and writes. Values are typed (a key holds one type, as a Redis
/// key holds a hash or a string) and each has an expiry. A value of
/// another type reads as absent and is replaced by [`set`](Memory::set):
/// a mirror that must answer as Redis' `WRONGTYPE` does keeps one type
/// per key and checks inside it.
pub struct Memory<'a> {
    map: &'a mut HashMap<String, Held>,
    now_us: u64,
}

impl fmt::Debug for Memory<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Memory")
            .field("keys", &self.map.len())
            .field("now_us", &self.now_us)
            .finish()
    }
}

impl Memory<'_> {
    /// The store's time, µs since the Unix epoch (the script's `TIME`).
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    fn live<T: Any + Send>(&mut self, key: &str) -> Option<&mut Option<T>> {
        let now = self.now_us;
        let held = self.map.get_mut(key)?;
        let value = held.value.downcast_mut::<Option<T>>()?;
        if held.expires_us <= now {
            *value = None;
        }
        value.as_mut()?;
        Some(value)
    }

    /// The live value of `key`, if it holds one of type `T`.
    pub fn get<T: Any + Send>(&mut self, key: &str) -> Option<&mut T> {
        self.live::<T>(key).and_then(Option::as_mut)
    }

    /// Takes the live value of `key` out, leaving the key empty.
    pub fn take<T: Any + Send>(&mut self, key: &str) -> Option<T> {
        self.live::<T>(key).and_then(Option::take)
    }

    /// Sets `key` to `value` until store time `expires_us` (µs; a time
    /// not after [`now_us`](Self::now_us) leaves it absent). Every value
    /// has an expiry: nothing lives forever.
    pub fn set<T: Any + Send>(&mut self, key: &str, value: T, expires_us: u64) {
        if let Some(held) = self.map.get_mut(key) {
            if let Some(slot) = held.value.downcast_mut::<Option<T>>() {
                *slot = Some(value);
                held.expires_us = expires_us;
                return;
            }
        }
        self.map.insert(
            key.to_owned(),
            Held {
                value: Box::new(Some(value)),
                expires_us,
            },
        );
    }

    /// When the live value of `key` expires, if there is one.
    pub fn expires_us(&self, key: &str) -> Option<u64> {
        let held = self.map.get(key)?;
        (held.expires_us > self.now_us).then_some(held.expires_us)
    }

    /// Sets when the value of `key` expires, if it has one (`PEXPIREAT`).
    pub fn expire_at(&mut self, key: &str, expires_us: u64) {
        if let Some(held) = self.map.get_mut(key) {
            if held.expires_us > self.now_us {
                held.expires_us = expires_us;
            }
        }
    }

    /// Forgets `key` (`DEL`).
    pub fn remove(&mut self, key: &str) {
        self.map.remove(key);
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.len())
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

/// The part of `key` that picks its shard: its hash tag, as Redis
/// Cluster picks a slot.
fn shard_of(key: &str) -> usize {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    // FNV-1a: cheap, and any spread will do.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in tagged.unwrap_or(bytes) {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    (hash as usize) & (SHARDS - 1)
}

impl MemoryStore {
    /// A store on the system clock.
    pub fn new() -> Self {
        MemoryStore::with_clock(SystemClock::new())
    }

    /// A store on the given clock (a [`FakeClock`](crate::clock::FakeClock) in tests).
    pub fn with_clock(clock: impl Clock) -> Self {
        MemoryStore::with_shared_clock(Arc::new(clock))
    }

    pub(crate) fn with_shared_clock(clock: Arc<dyn Clock>) -> Self {
        MemoryStore {
            shared: Arc::new(Shared {
                shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
                clock,
                calls: AtomicU64::new(0),
            }),
        }
    }

    fn shard(&self, i: usize) -> MutexGuard<'_, HashMap<String, Held>> {
        self.shared.shards[i]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Keys held, expired ones included until the next sweep.
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|i| self.shard(i).len()).sum()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The store's time for the next call; sweeps now and then.
    fn now(&self) -> u64 {
        let calls = self.shared.calls.fetch_add(1, Ordering::Relaxed);
        let now = micros(&*self.shared.clock);
        if calls % SWEEP_EVERY == SWEEP_EVERY - 1 {
            for i in 0..SHARDS {
                self.shard(i).retain(|_, held| held.expires_us > now);
            }
        }
        now
    }

    /// Runs one call's mirror, its keys locked.
    pub(crate) fn run_call(&self, call: &dyn Call) -> Result<Vec<i64>, Error> {
        let now_us = self.now();
        let shard = shard_of(call.key());
        // Every key of the call is read and written in KEYS[1]'s shard,
        // whatever its own tag: a call's keys are always reached through
        // the same first key, so they stay together.
        let mut map = self.shard(shard);
        call.mirror(&mut Memory {
            map: &mut map,
            now_us,
        })
    }

    /// Runs `script` now, in this thread: what [`Store::run`](super::Store::run)
    /// does with a memory store, without a future.
    ///
    /// # Errors
    /// As the script's mirror and parser raise them.
    pub fn run_now<S: Script>(&self, script: &S) -> Result<S::Reply, Error> {
        script.parse(self.run_call(script)?)
    }

    /// Reads the live value of `key` without a script (a test looks at
    /// what a script left, as it would `HGETALL` a Redis key).
    pub fn inspect<T: Any + Send, R>(&self, key: &str, read: impl FnOnce(Option<&T>) -> R) -> R {
        let now_us = micros(&*self.shared.clock);
        let mut map = self.shard(shard_of(key));
        let mut memory = Memory {
            map: &mut map,
            now_us,
        };
        read(memory.get::<T>(key).map(|v| &*v))
    }

    /// The longest time to live of any value; `None` if some value would
    /// never expire (a simulation checks this the way tests check Redis
    /// keys for a TTL).
    pub fn longest_ttl(&self) -> Option<std::time::Duration> {
        let now = micros(&*self.shared.clock);
        let mut longest = 0u64;
        for i in 0..SHARDS {
            for held in self.shard(i).values() {
                if held.expires_us == u64::MAX {
                    return None;
                }
                longest = longest.max(held.expires_us.saturating_sub(now));
            }
        }
        Some(std::time::Duration::from_micros(longest))
    }

    /// Forgets everything, like a Redis server restarted without
    /// persistence.
    pub fn flush(&self) {
        for i in 0..SHARDS {
            self.shard(i).clear();
        }
    }
}

impl Backend for MemoryStore {
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        _ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
        let replies = calls.iter().map(|call| self.run_call(*call)).collect();
        Box::pin(std::future::ready(Ran {
            replies: Ok(replies),
            cost: StoreCost::one_trip(calls.len()),
        }))
    }
}

/// What a window algorithm has counted, read the way an operator reads a
/// Redis store (`HGET sl:{<namespace>:<key>}:fw <window>`, see
/// `docs/operations.md`): to check, in a test of your own service on the
/// embedded store, what its limiters took from the budget.
impl MemoryStore {
    /// Permits the limiter of `namespace` (its first quota) counted for
    /// `key` in window `window` (store time since the Unix epoch divided by
    /// the quota's period) with a window algorithm (fixed or sliding
    /// window); `None` if the key holds no count for that window (never
    /// used, expired, or another algorithm). A hybrid limiter's count is
    /// what it leased, spent or not.
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
    /// at `index` (0: the first; see
    /// [`Builder::and`](crate::Builder::and)).
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

    /// Permits counted in a fixed window for a store key, if the key lives.
    pub(crate) fn count_in_window(&self, key: &str, window: i64) -> Option<i64> {
        let now_us = micros(&*self.shared.clock);
        let mut map = self.shard(shard_of(key));
        crate::algorithm::count_in_window(
            &mut Memory {
                map: &mut map,
                now_us,
            },
            key,
            window,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{AcquireReply, Algorithm, Check, Lease, LeaseCall, Params};
    use crate::clock::FakeClock;
    use crate::nonzero;
    use crate::quota::Quota;
    use std::time::Duration;

    fn store() -> (MemoryStore, FakeClock) {
        let clock = FakeClock::new(Duration::from_secs(1_700_000_000));
        (MemoryStore::with_clock(clock.clone()), clock)
    }

    /// One check of `cost` on key `k`.
    fn check(s: &MemoryStore, p: &Params, cost: u64) -> AcquireReply {
        s.run_now(&Check {
            key: "k",
            params: p,
            cost,
        })
        .unwrap()
    }

    #[test]
    fn fixed_window_counts_and_resets_at_the_boundary() {
        let (s, clock) = store();
        let p = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::FixedWindow);
        for i in 0..3 {
            let r = check(&s, &p, 1);
            assert!(r.allowed);
            assert_eq!(r.remaining, 2 - i);
        }
        let r = check(&s, &p, 1);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_us, Some(1_000_000));
        clock.advance(Duration::from_secs(1));
        assert!(check(&s, &p, 1).allowed);
        assert_eq!(check(&s, &p, 4).retry_after_us, None);
    }

    #[test]
    fn token_bucket_refills_continuously() {
        let (s, clock) = store();
        let p = Params::new(&Quota::per_second(nonzero!(10)), Algorithm::TokenBucket);
        assert!(check(&s, &p, 10).allowed);
        let r = check(&s, &p, 1);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_us, Some(100_000));
        clock.advance(Duration::from_millis(100));
        assert!(check(&s, &p, 1).allowed);
    }

    #[test]
    fn gcra_admits_the_burst_then_one_per_interval() {
        let (s, clock) = store();
        let p = Params::new(
            &Quota::per_second(nonzero!(10)).with_burst(nonzero!(5)),
            Algorithm::Gcra,
        );
        for _ in 0..5 {
            assert!(check(&s, &p, 1).allowed);
        }
        let r = check(&s, &p, 1);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_us, Some(100_000));
        clock.advance(Duration::from_millis(100));
        assert!(check(&s, &p, 1).allowed);
        assert!(!check(&s, &p, 1).allowed);
    }

    #[test]
    fn entries_expire_and_are_swept() {
        let (s, clock) = store();
        let p = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::FixedWindow);
        for i in 0..100 {
            s.run_now(&Check {
                key: &format!("k{i}"),
                params: &p,
                cost: 1,
            })
            .unwrap();
        }
        clock.advance(Duration::from_secs(5));
        for _ in 0..SWEEP_EVERY {
            s.run_now(&Check {
                key: "other",
                params: &p,
                cost: 0,
            })
            .unwrap();
        }
        assert!(s.len() <= 1, "{}", s.len());
    }

    #[test]
    fn wrong_type_is_an_error_not_a_panic() {
        let (s, _) = store();
        let fw = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::FixedWindow);
        let tb = Params::new(&Quota::per_second(nonzero!(3)), Algorithm::TokenBucket);
        s.run_now(&Check {
            key: "k",
            params: &fw,
            cost: 1,
        })
        .unwrap();
        assert!(s
            .run_now(&Check {
                key: "k",
                params: &tb,
                cost: 1
            })
            .unwrap_err()
            .is_wrong_type());
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
        let r = s
            .run_now(&Lease {
                params: &p,
                call: &call,
            })
            .unwrap();
        assert_eq!((r.granted, r.remaining), (50, 50));
        let r = s
            .run_now(&Lease {
                params: &p,
                call: &call,
            })
            .unwrap();
        assert_eq!((r.granted, r.remaining), (25, 25));
        call.want = 0;
        call.debt = 40;
        call.debt_window = r.window;
        let r = s
            .run_now(&Lease {
                params: &p,
                call: &call,
            })
            .unwrap();
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
        assert!(check(&s, &p, 3).allowed);
        // W+1: full from W's weight alone; the ask gets nothing.
        clock.advance(period);
        let ask = LeaseCall {
            want: 1,
            holder: Some("c".into()),
            ceiling: 1,
            lease_id: 1,
            ..LeaseCall::nothing("k".into())
        };
        assert_eq!(
            s.run_now(&Lease {
                params: &p,
                call: &ask
            })
            .unwrap()
            .granted,
            0
        );
        // Late debt into W, whose count exists.
        let ops = crate::algorithm::OpIds::default();
        let report = LeaseCall {
            debt_window: w,
            ..LeaseCall::report("k".into(), 1, ops.next())
        };
        s.run_now(&Lease {
            params: &p,
            call: &report,
        })
        .unwrap();
        assert_eq!(s.count_in_window("k", w), Some(4));
        // (W+2)·P: gone, as in Redis.
        clock.advance(Duration::from_micros(p_us - 1_000));
        assert_eq!(s.count_in_window("k", w), None);
    }
}
