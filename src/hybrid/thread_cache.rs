//! A per-thread cache of slots: the request path's way to a hot key
//! without touching the shared map.
//!
//! A `DashMap` lookup takes its shard's read lock, two atomic writes to a
//! cache line every thread shares: on a hot key across cores, that line
//! bounces between them on every decision. Each thread keeps a small
//! direct-mapped table of the slots it used last, looked up with no shared
//! write at all. An entry is a hint, never the truth: an evicted slot is
//! skipped (and its permits were already taken from it), so a stale entry
//! costs one map lookup, never a wrong decision.
//!
//! Used only while threads contend for keys (see `Shared::contended`).
//! Bounded: `WAYS` entries per thread, each holding one `Arc<Slot>` (an
//! evicted slot's memory is freed once its entry is replaced).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::slot::Slot;

/// Entries per thread (a power of two).
const WAYS: usize = 256;

struct Entry {
    /// The engine the slot belongs to (engines share threads).
    owner: u64,
    slot: Arc<Slot>,
}

thread_local! {
    static CACHE: RefCell<[Option<Entry>; WAYS]> = const { RefCell::new([const { None }; WAYS]) };
    /// Misses since the last slot was cached.
    static MISSES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Caching a slot costs two reference-count updates (one to hold it, one
/// to drop what it replaces): worth it for a hot key, a loss for a thread
/// cycling through more keys than the cache holds. Every sixteenth miss
/// caches, so a hot key is cached within sixteen decisions and a cold
/// stream pays for one insert in sixteen.
const CACHE_EVERY: u32 = 16;

/// Whether this miss should cache its slot.
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

/// FNV-1a: a few nanoseconds on short keys, and an entry is only a hint,
/// so collisions cost a map lookup, never a wrong answer.
#[inline]
fn way(owner: u64, key: &str) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ owner;
    for &b in key.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h as usize ^ (h >> 32) as usize) & (WAYS - 1)
}

/// Runs `f` on this thread's cached slot for `key`, if there is a live one.
#[inline]
pub(crate) fn with<R>(owner: u64, key: &str, f: impl FnOnce(&Arc<Slot>) -> R) -> Option<R> {
    let i = way(owner, key);
    CACHE
        .try_with(|cache| {
            let cache = cache.try_borrow().ok()?;
            let entry = cache[i].as_ref()?;
            if entry.owner != owner
                || *entry.slot.key != *key
                || entry.slot.evicted.load(Ordering::Acquire)
            {
                return None;
            }
            Some(f(&entry.slot))
        })
        .ok()
        .flatten()
}

/// Remembers `slot` for this thread.
pub(crate) fn put(owner: u64, slot: Arc<Slot>) {
    let i = way(owner, &slot.key);
    let _ = CACHE.try_with(|cache| {
        if let Ok(mut cache) = cache.try_borrow_mut() {
            cache[i] = Some(Entry { owner, slot });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_misses_and_evicted_slots() {
        let owner = engine_id();
        let slot = Arc::new(Slot::new("k".into(), 0));
        assert!(with(owner, "k", |_| ()).is_none());
        put(owner, slot.clone());
        assert!(with(owner, "k", |_| ()).is_some());
        assert!(with(owner + 1, "k", |_| ()).is_none(), "another engine's");
        assert!(with(owner, "other", |_| ()).is_none());
        slot.evicted.store(true, Ordering::Release);
        assert!(with(owner, "k", |_| ()).is_none(), "evicted: a miss");
    }
}
