//! One way to run a seeded simulation, shared by every package's: which
//! seeds a run asks for (`SIM_SEEDS`, `SIM_SEED`, `SIM_REPEAT`), a runtime
//! of its own on paused time for each, worker threads that share the
//! seeds out, and one report of every seed that failed with the command
//! that replays it.
//!
//! What a seed draws and what its oracle checks stay with each
//! simulation; this module owns only the knobs and the loop, so that
//! `SIM_SEEDS=N` means the same in every one.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// An unsigned number from the environment, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The seeds a run asks for: `SIM_SEED=S` replays `S` alone
/// (`SIM_REPEAT=N` times); else seeds `0..SIM_SEEDS` (`default` of them
/// when unset), then each of `found` (seeds that once failed) `replays`
/// times.
pub fn seeds(default: u64, found: &[u64], replays: usize) -> Vec<u64> {
    if let Some(seed) = std::env::var("SIM_SEED").ok().and_then(|v| v.parse().ok()) {
        return vec![seed; env_u64("SIM_REPEAT", 1) as usize];
    }
    (0..env_u64("SIM_SEEDS", default))
        .chain(
            found
                .iter()
                .flat_map(|&seed| std::iter::repeat_n(seed, replays)),
        )
        .collect()
}

/// A runtime for one seed: one thread, Tokio's clock paused, so virtual
/// time (a [`VirtualClock`](crate::VirtualClock) made inside it) moves
/// only when every task waits, and a run takes no wall time to sleep.
pub fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime")
}

/// Runs `simulate` once per seed of `seeds`, on `SIM_THREADS` worker
/// threads (default 2), and panics listing every seed whose run returned
/// an error or panicked, each with `SIM_SEED=<seed> <replay>`, the
/// command that replays it. A run's `Ok` summary is printed when there is
/// one seed (a replay). Returns how many seeds ran.
pub fn run<F>(seeds: &[u64], replay: &str, simulate: F) -> usize
where
    F: Fn(u64) -> Result<String, String> + Sync,
{
    let verbose = seeds.len() == 1;
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let threads = env_u64("SIM_THREADS", 2).max(1);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let Some(&seed) = seeds.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                let failure = match std::panic::catch_unwind(AssertUnwindSafe(|| simulate(seed))) {
                    Ok(Ok(summary)) => {
                        if verbose {
                            println!("seed {seed}: {summary}");
                        }
                        continue;
                    }
                    Ok(Err(e)) => format!("seed {seed}: {e}"),
                    Err(_) => format!("seed {seed} panicked"),
                };
                let failure = format!("{failure}\n  replay: SIM_SEED={seed} {replay}");
                failures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(failure);
            });
        }
    });
    let failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    assert!(
        failures.is_empty(),
        "{} of {} seeds failed:\n{}",
        failures.len(),
        seeds.len(),
        failures.join("\n")
    );
    seeds.len()
}
