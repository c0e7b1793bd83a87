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

use super::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, Params};
use crate::clock::{micros, Clock, SystemClock};
use crate::{Algorithm, Error, ErrorKind};
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
}

/// How long a report's identity is remembered (the scripts' 60 s).
const OP_TTL_US: u64 = 60_000_000;

#[derive(Debug, Clone)]
struct Entry {
    state: State,
    /// Store time (µs) after which the entry is as good as absent.
    expires_us: u64,
    /// Fixed window: who leased the key lately (the lease script's "h…"
    /// and "p…" fields); boxed, since most entries never have any.
    holders: Option<Box<Holders>>,
}

/// The processes that leased a fixed-window key in recent windows.
#[derive(Debug, Clone, Default)]
struct Holders {
    /// Window → processes that leased in it.
    counts: Vec<(i64, u64)>,
    /// Process → the last window it leased in.
    last: Vec<(String, i64)>,
    /// Process → its last grant: (lease id, permits, window).
    grants: Vec<(String, (u64, i64, i64))>,
}

impl Holders {
    fn count(&self, window: i64) -> u64 {
        self.counts
            .iter()
            .find(|(w, _)| *w == window)
            .map_or(0, |(_, n)| *n)
    }

    fn last(&self, holder: &str) -> i64 {
        self.last
            .iter()
            .find(|(h, _)| h == holder)
            .map_or(-1, |(_, w)| *w)
    }

    fn joined(&mut self, holder: &str, window: i64) {
        match self.last.iter_mut().find(|(h, _)| h == holder) {
            Some((_, w)) => *w = window,
            None => self.last.push((holder.to_owned(), window)),
        }
        match self.counts.iter_mut().find(|(w, _)| *w == window) {
            Some((_, n)) => *n += 1,
            None => self.counts.push((window, 1)),
        }
    }

    fn forget_before(&mut self, window: i64) {
        self.counts.retain(|(w, _)| *w >= window);
        self.last.retain(|(_, w)| *w >= window);
        self.grants.retain(|(_, (_, _, w))| *w >= window);
    }

    fn grant(&self, holder: &str) -> Option<(u64, i64, i64)> {
        self.grants
            .iter()
            .find(|(h, _)| h == holder)
            .map(|(_, g)| *g)
    }

    fn granted(&mut self, holder: &str, grant: (u64, i64, i64)) {
        match self.grants.iter_mut().find(|(h, _)| h == holder) {
            Some((_, g)) => *g = grant,
            None => self.grants.push((holder.to_owned(), grant)),
        }
    }
}

#[derive(Debug, Clone)]
enum State {
    /// (window index, permits counted) for at most three windows.
    Window(Vec<(i64, i64)>),
    Bucket {
        tokens: f64,
        ts: u64,
        /// The give-back counter ("gb"): the key's creation time plus every
        /// permit given back; `None` until a lease wrote it.
        gb: Option<u64>,
    },
    Gcra {
        tat: f64,
        gb: Option<u64>,
    },
}

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

fn wrong_type(key: &str) -> Error {
    Error::new(
        ErrorKind::WrongType,
        format!("WRONGTYPE: key {key} holds a value of another algorithm"),
    )
}

fn ceil_ms_to_us(us: f64) -> u64 {
    ((us / 1000.0).ceil().max(0.0) as u64) * 1000
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
            }),
        }
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
        self.with_entry(key, now, |entry| match p.algorithm {
            Algorithm::FixedWindow => fixed_window(entry, p, now, cost, key),
            Algorithm::TokenBucket => token_bucket(entry, p, now, cost, key),
            Algorithm::Gcra => gcra(entry, p, now, cost, key),
        })
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
            let mut reply = self.with_entry(&call.key, now, |entry| match p.algorithm {
                Algorithm::FixedWindow => lease_fixed_window(entry, p, now, &call),
                Algorithm::TokenBucket => lease_token_bucket(entry, p, now, &call),
                Algorithm::Gcra => lease_gcra(entry, p, now, &call),
            })?;
            if let Some(uncovered) = seen {
                reply.uncovered = uncovered;
            }
            Ok((reply, (call.debt > 0).then_some(reply.uncovered)))
        })
    }

    pub(crate) fn give_back(&self, p: &Params, call: &GiveBackCall) -> Result<u64, Error> {
        let now = self.now();
        self.once(Some(call.op.key_for(&call.key)), now, |seen| match seen {
            Some(back) => Ok((back, None)),
            None => {
                let back =
                    self.with_entry(&call.key, now, |entry| give_back(entry, p, now, call))?;
                Ok((back, Some(back)))
            }
        })
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
            ops.insert(op, (value, now + OP_TTL_US));
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

    /// Permits counted in fixed window `window` for `key` under
    /// `namespace`, as a test would `HGET` the Redis key.
    #[cfg(feature = "test-support")]
    pub fn fixed_window_count(&self, namespace: &str, key: &str, window: i64) -> Option<i64> {
        let store_key =
            crate::key::KeyEncoder::new(namespace).store_key(key, Algorithm::FixedWindow);
        self.window_count(&store_key, window)
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
    pub(crate) fn window_count(&self, key: &str, window: i64) -> Option<i64> {
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
fn windows<'a>(
    entry: &'a mut Option<Entry>,
    key: &str,
) -> Result<Option<&'a mut Vec<(i64, i64)>>, Error> {
    match entry {
        None => Ok(None),
        Some(Entry {
            state: State::Window(w),
            ..
        }) => Ok(Some(w)),
        Some(_) => Err(wrong_type(key)),
    }
}

fn count_in(w: Option<&mut Vec<(i64, i64)>>, window: i64) -> i64 {
    w.and_then(|w| w.iter().find(|(i, _)| *i == window).map(|(_, c)| *c))
        .unwrap_or(0)
}

/// HINCRBY on a window field, creating the entry if needed; returns the new count.
fn incr_window(entry: &mut Option<Entry>, window: i64, by: i64) -> i64 {
    let e = entry.get_or_insert(Entry {
        state: State::Window(Vec::new()),
        expires_us: 0,
        holders: None,
    });
    let State::Window(w) = &mut e.state else {
        unreachable!("checked by windows()")
    };
    match w.iter_mut().find(|(i, _)| *i == window) {
        Some((_, c)) => {
            *c += by;
            *c
        }
        None => {
            w.push((window, by));
            by
        }
    }
}

/// Drops windows older than the previous one and lengthens the TTL to `ttl_us`.
fn trim_and_expire(entry: &mut Option<Entry>, current: i64, now: u64, ttl_us: u64) {
    if let Some(e) = entry {
        if let State::Window(w) = &mut e.state {
            if w.len() > 2 {
                w.retain(|(i, _)| *i >= current - 1);
            }
        }
        e.expires_us = e.expires_us.max(now + ttl_us);
    }
}

/// Every `u64` cost is compared as the scripts compare it: a cost the
/// quota can never hold is denied before any arithmetic sees it.
fn fixed_window(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    cost: u64,
    key: &str,
) -> Result<AcquireReply, Error> {
    let limit = p.limit as i64;
    let period = p.period_us;
    let w = (now / period) as i64;
    let mut used = count_in(windows(entry, key)?, w);
    let reset = (w as u64 + 1) * period - now;
    let (allowed, retry) = if cost > p.limit {
        (false, None)
    } else if cost == 0 || used + cost as i64 <= limit {
        if cost > 0 {
            used = incr_window(entry, w, cost as i64);
            trim_and_expire(entry, w, now, ceil_ms_to_us((reset + period) as f64));
        }
        (true, Some(0))
    } else {
        (false, Some(reset))
    };
    Ok(AcquireReply {
        allowed,
        remaining: (limit - used).max(0) as u64,
        reset_after_us: reset,
        retry_after_us: retry,
        now_us: now,
    })
}

/// Refilled tokens of a bucket entry (a missing entry is a full bucket),
/// and its give-back counter.
fn bucket_tokens(
    entry: &Option<Entry>,
    p: &Params,
    now: u64,
    key: &str,
) -> Result<(f64, Option<u64>), Error> {
    let (mut tokens, ts, gb) = match entry {
        None => (p.burst as f64, now, None),
        Some(Entry {
            state: State::Bucket { tokens, ts, gb },
            ..
        }) => (*tokens, *ts, *gb),
        Some(_) => return Err(wrong_type(key)),
    };
    if now > ts {
        tokens =
            (p.burst as f64).min(tokens + (now - ts) as f64 * p.limit as f64 / p.period_us as f64);
    }
    Ok((tokens, gb))
}

fn bucket_reset(p: &Params, tokens: f64) -> f64 {
    ((p.burst as f64 - tokens) * p.period_us as f64 / p.limit as f64).ceil()
}

fn store_bucket(entry: &mut Option<Entry>, p: &Params, now: u64, tokens: f64, gb: Option<u64>) {
    let reset = bucket_reset(p, tokens);
    *entry = Some(Entry {
        state: State::Bucket {
            tokens,
            ts: now,
            gb,
        },
        expires_us: now + ceil_ms_to_us(reset) + 1000,
        holders: None,
    });
}

fn token_bucket(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    cost: u64,
    key: &str,
) -> Result<AcquireReply, Error> {
    let (mut tokens, gb) = bucket_tokens(entry, p, now, key)?;
    let (allowed, retry) = if cost > p.burst {
        (false, None)
    } else if cost == 0 || cost as f64 <= tokens {
        tokens -= cost as f64;
        (true, Some(0))
    } else {
        let r = ((cost as f64 - tokens) * p.period_us as f64 / p.limit as f64).ceil();
        (false, Some(r as u64))
    };
    if allowed && cost > 0 {
        store_bucket(entry, p, now, tokens, gb);
    }
    Ok(AcquireReply {
        allowed,
        remaining: tokens.floor().max(0.0) as u64,
        reset_after_us: bucket_reset(p, tokens).max(0.0) as u64,
        retry_after_us: retry,
        now_us: now,
    })
}

struct GcraShape {
    interval: f64,
    tolerance: f64,
}

impl GcraShape {
    fn new(p: &Params) -> Self {
        let interval = p.period_us as f64 / p.limit as f64;
        GcraShape {
            interval,
            tolerance: p.burst as f64 * interval,
        }
    }

    fn level(&self, tat: f64, now: f64) -> f64 {
        (self.tolerance - (tat - now)) / self.interval
    }

    fn available(&self, tat: f64, now: f64) -> f64 {
        (self.level(tat, now) + 1e-9).floor()
    }
}

fn gcra_tat(entry: &Option<Entry>, now: u64, key: &str) -> Result<(f64, Option<u64>), Error> {
    let (tat, gb) = match entry {
        None => (0.0, None),
        Some(Entry {
            state: State::Gcra { tat, gb },
            ..
        }) => (*tat, *gb),
        Some(_) => return Err(wrong_type(key)),
    };
    Ok((tat.max(now as f64), gb))
}

fn store_gcra(entry: &mut Option<Entry>, now: u64, tat: f64, gb: Option<u64>) {
    let stored = tat.ceil();
    let ttl = ceil_ms_to_us(tat - now as f64) + 1000;
    // A TTL is only lengthened by writes that set one, as PEXPIRE does;
    // a give-back (HSET alone) keeps the key's TTL.
    *entry = Some(Entry {
        state: State::Gcra { tat: stored, gb },
        expires_us: now + ttl,
        holders: None,
    });
}

fn gcra(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    cost: u64,
    key: &str,
) -> Result<AcquireReply, Error> {
    let g = GcraShape::new(p);
    let nowf = now as f64;
    let (mut tat, gb) = gcra_tat(entry, now, key)?;
    let (allowed, retry) = if cost > p.burst {
        (false, None)
    } else {
        let new_tat = tat + cost as f64 * g.interval;
        if cost == 0 || new_tat - nowf <= g.tolerance {
            if cost > 0 {
                tat = new_tat;
                store_gcra(entry, now, tat, gb);
            }
            (true, Some(0))
        } else {
            (false, Some((new_tat - nowf - g.tolerance).ceil() as u64))
        }
    };
    Ok(AcquireReply {
        allowed,
        remaining: g.available(tat, nowf).max(0.0) as u64,
        reset_after_us: (tat - nowf).ceil().max(0.0) as u64,
        retry_after_us: retry,
        now_us: now,
    })
}

fn lease_fixed_window(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &LeaseCall,
) -> Result<LeaseReply, Error> {
    let limit = p.limit as i64;
    let period = p.period_us;
    let w = (now / period) as i64;
    windows(entry, &call.key)?;
    let mut newest = w;
    let mut uncovered = 0i64;
    let debt = call.debt as i64;
    let debt_window = if call.debt_window < 0 {
        w
    } else {
        call.debt_window
    };
    if debt > 0 {
        if debt_window >= w - 1 && debt_window <= w + 1 {
            let before = count_in(windows(entry, &call.key)?, debt_window);
            let after = incr_window(entry, debt_window, debt);
            uncovered = (after - limit).max(0) - (before - limit).max(0);
            newest = newest.max(debt_window);
        } else {
            uncovered = debt;
        }
    }
    let mut tw = w.max(call.min_window).min(w + 1);
    let recorded = call.want > 0 && call.lease_id != 0 && call.holder.is_some();
    // A second delivery of a lease whose reply was lost: its grant again.
    let replay = call
        .holder
        .as_deref()
        .filter(|_| recorded)
        .and_then(|h| entry.as_ref()?.holders.as_deref()?.grant(h))
        .filter(|&(id, _, window)| id == call.lease_id && window >= w);
    if let Some((_, _, window)) = replay {
        tw = window;
    }
    let mut used = count_in(windows(entry, &call.key)?, tw);
    let available = (limit - used).max(0);
    let cap = ((available as f64 * call.share_cap).floor() as i64)
        .max(1)
        .max(available.min(call.need.max(1) as i64));
    let mut granted = (call.want as i64).min(available).min(cap);
    // The fair share of what remains, as the script computes it.
    let mut joined = false;
    // Asked with nothing left, the key exists (and has its TTL): the asker
    // is counted all the same, so holders reflect demand.
    if let Some((_, permits, _)) = replay {
        granted = permits;
    } else if let (Some(holder), true) = (&call.holder, call.want > 0) {
        let holders = entry.as_ref().and_then(|e| e.holders.as_deref());
        let last = holders.map_or(-1, |h| h.last(holder));
        let here = holders.map_or(0, |h| h.count(tw)) as i64;
        let before = holders.map_or(0, |h| h.count(tw - 1)) as i64;
        let expected = here.max(before);
        joined = last < tw;
        let fair = if joined {
            available / (expected - here).max(1)
        } else {
            available / expected.max(1)
        };
        // Many holders: the rate's lease is cut to one holder's share.
        // (The last `need` permits still go whole to a process whose
        // ceiling says it can use them.)
        let whole = if available <= call.need.max(1) as i64 {
            available.min(call.ceiling.min(i64::MAX as u64) as i64)
        } else {
            0
        };
        granted = granted.min(fair.max(1).max(whole));
        // The last holder expected takes what is left, not share_cap of it.
        let capped = if joined && expected - here == 1 {
            fair
        } else {
            fair.min((available as f64 * call.share_cap).floor() as i64)
        };
        let fair = capped.min(call.ceiling.min(i64::MAX as u64) as i64);
        if fair > granted {
            granted = fair.min(available);
        }
    }
    if joined {
        if let Some(holder) = &call.holder {
            // Counted when it asks, granted or not (as the script does);
            // the holders live in the entry, created here if need be.
            let e = entry.get_or_insert(Entry {
                state: State::Window(Vec::new()),
                expires_us: 0,
                holders: None,
            });
            e.holders
                .get_or_insert_with(Default::default)
                .joined(holder, tw);
        }
    }
    let fresh = granted > 0 && replay.is_none();
    if fresh {
        used = incr_window(entry, tw, granted);
        newest = newest.max(tw);
    }
    if fresh && used == granted {
        if let Some(h) = entry.as_mut().and_then(|e| e.holders.as_mut()) {
            h.forget_before(w - 1);
        }
    }
    if let (true, true, Some(holder)) = (fresh, recorded, &call.holder) {
        if let Some(e) = entry.as_mut() {
            e.holders
                .get_or_insert_with(Default::default)
                .granted(holder, (call.lease_id, granted, tw));
        }
    }
    if fresh || debt > 0 {
        let ttl = ((newest as u64 + 2) * period - now) as f64;
        trim_and_expire(entry, w, now, ceil_ms_to_us(ttl));
    }
    let start_after = (tw as u64 * period).saturating_sub(now);
    let reset = (tw as u64 + 1) * period - now;
    Ok(LeaseReply {
        granted: granted as u64,
        remaining: (limit - used).max(0) as u64,
        start_after_us: start_after,
        reset_after_us: reset,
        retry_after_us: if granted == 0 { reset } else { 0 },
        now_us: now,
        uncovered: uncovered as u64,
        window: tw,
        level: 0,
        given_back: 0,
    })
}

fn lease_token_bucket(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &LeaseCall,
) -> Result<LeaseReply, Error> {
    let (mut tokens, gb) = bucket_tokens(entry, p, now, &call.key)?;
    let burst = p.burst as f64;
    let debt = call.debt as f64;
    let need = call.need as f64;
    let mut uncovered = 0.0;
    if debt > 0.0 {
        uncovered = (debt - tokens.max(0.0)).max(0.0);
        tokens = (tokens - debt).max(-burst);
    }
    let granted = bucket_grant(tokens.floor().max(0.0), call, burst);
    tokens -= granted;
    let reset = bucket_reset(p, tokens);
    let gb = if granted > 0.0 || debt > 0.0 {
        let gb = gb.unwrap_or(now);
        store_bucket(entry, p, now, tokens, Some(gb));
        Some(gb)
    } else {
        gb
    };
    let patience = need.max(call.patience as f64).min(burst);
    let retry = if granted == 0.0 {
        ((patience - tokens) * p.period_us as f64 / p.limit as f64)
            .ceil()
            .max(1.0)
    } else {
        0.0
    };
    Ok(LeaseReply {
        granted: granted as u64,
        remaining: tokens.floor().max(0.0) as u64,
        start_after_us: 0,
        reset_after_us: reset.max(0.0) as u64,
        retry_after_us: retry as u64,
        now_us: now,
        uncovered: uncovered.ceil() as u64,
        window: 0,
        level: tokens.ceil().max(0.0) as u64,
        given_back: gb.unwrap_or(0),
    })
}

/// The grant rule of the token-bucket and GCRA lease scripts: nothing
/// below the waiting request's need, else `min(want, available, max(need,
/// share_cap × available))`.
fn bucket_grant(available: f64, call: &LeaseCall, burst: f64) -> f64 {
    let need = call.need as f64;
    if available < need.min(burst) {
        return 0.0;
    }
    let cap = need.max((available * call.share_cap).floor());
    let by_rate = (call.want as f64).min(available).min(cap);
    let roomy = (call.ceiling as f64).min((available * call.share_cap).floor());
    by_rate.max(roomy.min(available))
}

fn lease_gcra(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &LeaseCall,
) -> Result<LeaseReply, Error> {
    let g = GcraShape::new(p);
    let nowf = now as f64;
    let (mut tat, gb) = gcra_tat(entry, now, &call.key)?;
    let debt = call.debt as f64;
    let need = (call.need as f64).min(p.burst as f64);
    let mut uncovered = 0.0;
    if debt > 0.0 {
        uncovered = (debt - g.available(tat, nowf).max(0.0)).max(0.0);
        tat = (tat + debt * g.interval).min(nowf + 2.0 * g.tolerance);
    }
    let granted = bucket_grant(g.available(tat, nowf).max(0.0), call, p.burst as f64);
    tat += granted * g.interval;
    let gb = if granted > 0.0 || debt > 0.0 {
        let gb = gb.unwrap_or(now);
        store_gcra(entry, now, tat, Some(gb));
        Some(gb)
    } else {
        gb
    };
    let patience = need.max(call.patience as f64).min(p.burst as f64);
    let retry = if granted == 0.0 {
        (tat + patience * g.interval - g.tolerance - nowf)
            .ceil()
            .max(1.0)
    } else {
        0.0
    };
    Ok(LeaseReply {
        granted: granted as u64,
        remaining: g.available(tat, nowf).max(0.0) as u64,
        start_after_us: 0,
        reset_after_us: (tat - nowf).ceil().max(0.0) as u64,
        retry_after_us: retry as u64,
        now_us: now,
        uncovered: uncovered as u64,
        window: 0,
        level: (g.level(tat, nowf) - 1e-9).ceil().max(0.0) as u64,
        given_back: gb.unwrap_or(0),
    })
}

/// The give-back rule of `give_back.lua`; see its header for why a bucket
/// gets back at most `burst` minus how full it may have been meanwhile.
fn give_back(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &GiveBackCall,
) -> Result<u64, Error> {
    if entry.is_none() {
        return Ok(0);
    }
    let origin = call.origin;
    let peak = |gb: Option<u64>| -> Option<f64> {
        let gb = gb?;
        if gb < origin.given_back || origin.at_us > now {
            return None;
        }
        let rate = p.limit as f64 / p.period_us as f64;
        Some(
            origin.level as f64
                + (now - origin.at_us) as f64 * rate
                + (gb - origin.given_back) as f64,
        )
    };
    let returned = call.returned as f64;
    let burst = p.burst as f64;
    match p.algorithm {
        Algorithm::FixedWindow => {
            let w = windows(entry, &call.key)?;
            if call.window < (now / p.period_us) as i64 {
                return Ok(0);
            }
            let used = count_in(w, call.window);
            let back = used.min(call.returned.min(i64::MAX as u64) as i64);
            if back > 0 {
                incr_window(entry, call.window, -back);
            }
            Ok(back.max(0) as u64)
        }
        Algorithm::TokenBucket => {
            let (tokens, gb) = bucket_tokens(entry, p, now, &call.key)?;
            let Some(peak) = peak(gb) else {
                return Ok(0);
            };
            let back = returned
                .min(burst - tokens)
                .min(burst - peak)
                .max(0.0)
                .floor();
            if back <= 0.0 {
                return Ok(0);
            }
            if let Some(e) = entry {
                e.state = State::Bucket {
                    tokens: tokens + back,
                    ts: now,
                    gb: gb.map(|g| g + back as u64),
                };
            }
            Ok(back as u64)
        }
        Algorithm::Gcra => {
            let g = GcraShape::new(p);
            let nowf = now as f64;
            let (tat, gb) = gcra_tat(entry, now, &call.key)?;
            let Some(peak) = peak(gb) else {
                return Ok(0);
            };
            if tat <= nowf {
                return Ok(0);
            }
            let back = returned
                .min((tat - nowf) / g.interval)
                .min(burst - peak)
                .max(0.0)
                .floor();
            if back <= 0.0 {
                return Ok(0);
            }
            if let Some(e) = entry {
                e.state = State::Gcra {
                    tat: (tat - back * g.interval).ceil(),
                    gb: gb.map(|g| g + back as u64),
                };
            }
            Ok(back as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{nonzero, FakeClock, Quota};
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
            key: "k".into(),
            want: 1000,
            share_cap: 0.5,
            debt: 0,
            debt_window: 0,
            min_window: -1,
            need: 1,
            patience: 1,
            op: None,
            holder: None,
            ceiling: 0,
            lease_id: 0,
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
}
