//! A per-thread cache of holdings: the request path's way to a hot key
//! without touching the shared map.
//!
//! A `DashMap` lookup takes its shard's read lock, two atomic writes to a
//! cache line every thread shares: on a hot key across cores, that line
//! bounces between them on every decision. Each thread keeps a small
//! direct-mapped table of the holdings it used last, looked up with no shared
//! write at all. An entry is a hint, never the truth: an evicted holding is
//! skipped (and its permits were already taken from it), so a stale entry
//! costs one map lookup, never a wrong decision.
//!
//! Used only while threads contend for keys (see `Shared::contended`).
//! Bounded: `WAYS` entries per thread, each holding one `Arc<Holding>` (an
//! evicted holding's memory is freed once its entry is replaced).
//!
//! A cached holding also keeps the thread's own stock of its permits. The
//! holding's permit count is one cache line every thread writes; a thread
//! that takes a few permits more than it needs, and spends them before
//! it takes again, writes that line once per stock instead of once per
//! decision. A stock is permits taken from the holding like any other: each
//! is spent at most once, before the deadline of the lease it came from,
//! so the bounds are those of the holding. What a stock still holds when its
//! lease ends, or when its thread moves on, is stranded (a refill asks
//! the store again), so a stock is small: a sixteenth of what the holding
//! holds, at most [`STOCK_MAX`], and nothing once the holding runs low.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::holding::Holding;

/// Entries per thread (a power of two).
const WAYS: usize = 256;

/// The largest stock a thread takes of one key.
pub(crate) const STOCK_MAX: i64 = 64;

/// A thread's stock takes this share of what the holding holds.
const STOCK_SHARE: i64 = 16;

/// The spare permits a thread takes besides its cost, when `left` remain.
#[inline]
pub(crate) fn stock_for(left: i64) -> i64 {
    (left / STOCK_SHARE).min(STOCK_MAX)
}

/// Permits a thread took from a holding and has not spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stock {
    pub(crate) permits: i64,
    /// The lease's window, if known (see `Take::Taken`).
    pub(crate) window: Option<i64>,
    /// Local µs at which they become void: the lease's deadline.
    pub(crate) deadline: u64,
}

impl Stock {
    pub(crate) const NONE: Stock = Stock {
        permits: 0,
        window: None,
        deadline: 0,
    };
}

struct Entry {
    /// The engine the holding belongs to (engines share threads).
    owner: u64,
    holding: Arc<Holding>,
    stock: Cell<Stock>,
}

thread_local! {
    static CACHE: RefCell<[Option<Entry>; WAYS]> = const { RefCell::new([const { None }; WAYS]) };
    /// Misses since the last holding was cached.
    static MISSES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Caching a holding costs two reference-count updates (one to hold it, one
/// to drop what it replaces): worth it for a hot key, a loss for a thread
/// cycling through more keys than the cache holds. Every sixteenth miss
/// caches, so a hot key is cached within sixteen decisions and a cold
/// stream pays for one insert in sixteen.
const CACHE_EVERY: u32 = 16;

/// Whether this miss should cache its holding.
#[inline]
pub(crate) fn worth_caching() -> bool {
    MISSES
        .try_with(|m| {
            let n = m.get().wrapping_add(1);
            m.set(n);
            n % CACHE_EVERY == 0
        })
        .unwrap_or(false)
}

/// A fresh identity for an engine.
pub(crate) fn engine_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A multiply-xor hash over the key's 8-byte words (a key on the request
/// path is at most 64 bytes, see `local_key`): a byte at a time cost a
/// dependent multiply per byte, the slowest step of a cached decision. An
/// entry is only a hint, so a collision costs a map lookup, never a wrong
/// answer.
#[inline]
fn way(owner: u64, key: &str) -> usize {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let bytes = key.as_bytes();
    let n = bytes.len();
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let mut h = (owner ^ n as u64).wrapping_mul(K);
    if n >= 8 {
        let mut at = 0;
        while at + 8 < n {
            h = (h ^ word(at)).wrapping_mul(K);
            at += 8;
        }
        // The last word ends at the key's end (it may overlap the one
        // before): no partial word to assemble.
        h = (h ^ word(n - 8)).wrapping_mul(K);
    } else {
        let w = bytes
            .iter()
            .enumerate()
            .fold(0u64, |w, (i, &b)| w | u64::from(b) << (8 * i));
        h = (h ^ w).wrapping_mul(K);
    }
    // The high bits mix every word; the low ones only the last.
    (h >> (64 - WAYS.trailing_zeros())) as usize
}

/// Runs `f` on this thread's cached holding for `key` and its stock, if
/// there is a live one.
#[inline(always)]
pub(crate) fn with<R>(
    owner: u64,
    key: &str,
    f: impl FnOnce(&Arc<Holding>, &Cell<Stock>) -> R,
) -> Option<R> {
    let i = way(owner, key);
    CACHE
        .try_with(|cache| {
            let cache = cache.try_borrow().ok()?;
            let entry = cache[i].as_ref()?;
            if entry.owner != owner || **entry.holding.key() != *key || entry.holding.is_evicted() {
                return None;
            }
            Some(f(&entry.holding, &entry.stock))
        })
        .ok()
        .flatten()
}

/// Remembers `holding` for this thread. The stock of the entry it replaces
/// goes back to its holding if that holding still holds the lease it came from
/// (local time `now`); otherwise its permits are returned as stranded.
pub(crate) fn put(owner: u64, holding: Arc<Holding>, now: u64) -> i64 {
    let i = way(owner, holding.key());
    CACHE
        .try_with(|cache| {
            let Ok(mut cache) = cache.try_borrow_mut() else {
                return 0;
            };
            let old = cache[i].replace(Entry {
                owner,
                holding,
                stock: Cell::new(Stock::NONE),
            });
            match old {
                Some(old) => {
                    let stock = old.stock.get();
                    if old
                        .holding
                        .restore(stock.window, stock.deadline, stock.permits, now)
                    {
                        0
                    } else {
                        stock.permits.max(0)
                    }
                }
                None => 0,
            }
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ways_spread_keys_of_every_length_and_owner() {
        // Keys differing anywhere (first word, middle, the overlapping
        // last word, a short key's last byte) and owners alike.
        for len in [1usize, 5, 7, 8, 9, 15, 16, 17, 40, 64] {
            for at in [0, len / 2, len - 1] {
                let mut ways = std::collections::HashSet::new();
                for c in 0..=255u8 {
                    let mut key = vec![b'k'; len];
                    key[at] = c;
                    // Only valid UTF-8 keys are asked for.
                    if let Ok(key) = std::str::from_utf8(&key) {
                        ways.insert(way(1, key));
                    }
                }
                assert!(
                    ways.len() >= 64,
                    "len {len}, byte {at}: {} ways",
                    ways.len()
                );
            }
        }
        let owners: std::collections::HashSet<usize> = (0..256).map(|o| way(o, "user-1")).collect();
        assert!(owners.len() >= 128, "{} ways for 256 owners", owners.len());
    }

    #[test]
    fn hits_misses_and_evicted_holdings() {
        let owner = engine_id();
        let holding = Arc::new(Holding::new("k".into(), 0));
        assert!(with(owner, "k", |_, _| ()).is_none());
        assert_eq!(put(owner, holding.clone(), 0), 0);
        assert!(with(owner, "k", |_, _| ()).is_some());
        assert!(
            with(owner + 1, "k", |_, _| ()).is_none(),
            "another engine's"
        );
        assert!(with(owner, "other", |_, _| ()).is_none());
        holding.mark_evicted();
        assert!(with(owner, "k", |_, _| ()).is_none(), "evicted: a miss");
    }
}
