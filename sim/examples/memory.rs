//! Bytes per key tracked in the hybrid limiter's local map, counted by a
//! global allocator wrapper.
//!
//! ```text
//! cargo run --release --example memory -- 200000
//! ```
//!
//! The hybrid limiter runs on the embedded store, which keeps state per
//! key too; that part is measured separately (the same keys through an
//! exact limiter on a fresh embedded store) and subtracted, so the figure
//! is what a process pays per key when the store is Redis.

use std::alloc::System;
use std::time::Duration;

use slicelimit::{HybridConfig, Limiter, MemoryStore, Quota};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes allocated and not freed since the region began.
fn live(region: &Region<'_, System>) -> isize {
    let c = region.change();
    c.bytes_allocated as isize - c.bytes_deallocated as isize + c.bytes_reallocated
}

async fn fill(limiter: &Limiter, keys: &[String]) {
    for key in keys {
        limiter.check(key, 1).await;
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let keys: Vec<String> = (0..n).map(|i| format!("user-{i:08}")).collect();
    let quota = Quota::new(1_000_000, Duration::from_secs(3600)).unwrap();

    let region = Region::new(GLOBAL);
    let exact = Limiter::builder(quota)
        .store(MemoryStore::new())
        .build()
        .unwrap();
    fill(&exact, &keys).await;
    let store_only = live(&region);
    drop(exact);

    let region = Region::new(GLOBAL);
    let hybrid = Limiter::builder(quota)
        .store(MemoryStore::new())
        // Keep every key for the count, however long filling takes.
        .hybrid(HybridConfig::strict().idle_ttl(Duration::from_secs(3600)))
        .build()
        .unwrap();
    fill(&hybrid, &keys).await;
    let with_map = live(&region);
    assert_eq!(hybrid.local_keys(), n);

    // The map's own bytes: what shutdown frees (it empties the map; the
    // store keeps its entries, holder fields included).
    hybrid.shutdown().await;
    let after = live(&region);
    let key_bytes = keys.iter().map(|k| k.len()).sum::<usize>() as f64 / n as f64;
    let per_key = (with_map - after) as f64 / n as f64;
    let store_hybrid = after as f64 / n as f64;
    println!("{n} keys of {key_bytes:.0} bytes each");
    println!(
        "embedded store:        {:>7.0} bytes per key",
        store_only as f64 / n as f64
    );
    println!("embedded store, hybrid: {store_hybrid:>6.0} bytes per key (with lease holders)");
    println!("hybrid local map:      {per_key:>7.0} bytes per key (store excluded)");
}
