//! A seeded simulation of the in-flight bound: processes sharing one
//! store (delayed, duplicated and lost replies), each running requests
//! that take a slot, hold it a while (sometimes longer than the lease)
//! and release it; waits given up half way; processes killed without
//! releasing anything and started again. The oracle counts requests where
//! they run: never more than the maximum at once.
//!
//! Calls that never reach the store are not injected: a renewal must
//! reach it before the lease expires (the bound's assumption).
//!
//! `SIM_SEEDS=N` runs N seeds (default 200).

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::ConcurrencyLimiter;
use crate::clock::Clock;
use crate::failure::FailurePolicy;
use crate::store::{Faults, FaultyStore, MemoryStore, Store};

/// The store's and the limiters' clock: Tokio's (paused) time.
#[derive(Clone)]
struct TokioClock(tokio::time::Instant);

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        Duration::from_secs(1_000) + self.0.elapsed()
    }
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Requests running now for the key, and the most ever seen.
#[derive(Default)]
struct Running {
    now: AtomicU64,
    most: AtomicU64,
}

/// A running request: counted while alive (a killed process's requests
/// die with it).
struct Request<'a>(&'a Running);

impl<'a> Request<'a> {
    fn start(running: &'a Running) -> Self {
        let now = running.now.fetch_add(1, Ordering::SeqCst) + 1;
        running.most.fetch_max(now, Ordering::SeqCst);
        Request(running)
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Process {
    limiter: ConcurrencyLimiter,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn start(
    store: &Store,
    clock: &TokioClock,
    max: u32,
    hybrid: bool,
    tasks: u64,
    seed: u64,
    running: &Arc<Running>,
) -> Process {
    let builder = ConcurrencyLimiter::builder(NonZeroU32::new(max).expect("not zero"))
        .store(store.clone())
        .clock(clock.clone())
        .on_store_error(FailurePolicy::FailClosed)
        .lease(Duration::from_millis(900))
        .renew_every(Duration::from_millis(300));
    let limiter = if hybrid {
        builder.hybrid()
    } else {
        builder.exact()
    }
    .build()
    .expect("builds");
    let tasks = (0..tasks)
        .map(|t| {
            let limiter = limiter.clone();
            let running = running.clone();
            tokio::spawn(async move {
                let mut rng = Rng(seed.wrapping_mul(31).wrapping_add(t) | 1);
                loop {
                    let wait = Duration::from_millis(rng.below(100));
                    let give_up = Duration::from_millis(1 + rng.below(150));
                    let attempt = tokio::time::timeout(give_up, limiter.acquire("k", wait));
                    if let Ok(Ok(permit)) = attempt.await {
                        let request = Request::start(&running);
                        let hold = if rng.below(50) == 0 {
                            // Longer than the lease: renewed meanwhile.
                            Duration::from_millis(1_000 + rng.below(1_500))
                        } else {
                            Duration::from_millis(1 + rng.below(60))
                        };
                        tokio::time::sleep(hold).await;
                        drop(request);
                        drop(permit);
                    }
                    tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
                }
            })
        })
        .collect();
    Process { limiter, tasks }
}

impl Process {
    /// Killed: its requests die, its background task stops, nothing is
    /// released (its leases expire).
    fn kill(self) {
        for task in &self.tasks {
            task.abort();
        }
        if let Some(renewer) = self.limiter.inner.task.lock().expect("lock").take() {
            renewer.abort();
        }
    }
}

async fn run(seed: u64) -> (u64, u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let clock = TokioClock(tokio::time::Instant::now());
    let faults = Faults {
        max_delay: Duration::from_millis(rng.below(30)),
        timeout: Duration::from_millis(50),
        lost_after: rng.below(5) as f64 / 100.0,
        lost_before: 0.0,
        duplicated: rng.below(5) as f64 / 100.0,
    };
    let memory = MemoryStore::with_clock(clock.clone());
    let store: Store = FaultyStore::new(memory, faults, seed | 1, clock.clone()).into();
    let max = 1 + rng.below(6) as u32;
    let hybrid = rng.below(2) == 0;
    let running = Arc::new(Running::default());
    let mut processes: Vec<Process> = (0..2 + rng.below(2))
        .map(|p| {
            let tasks = 2 + rng.below(5);
            start(&store, &clock, max, hybrid, tasks, seed + p, &running)
        })
        .collect();
    for step in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if rng.below(12) == 0 {
            let p = rng.below(processes.len() as u64) as usize;
            let tasks = 2 + rng.below(5);
            let fresh = start(
                &store,
                &clock,
                max,
                hybrid,
                tasks,
                seed + 100 + step,
                &running,
            );
            std::mem::replace(&mut processes[p], fresh).kill();
        }
    }
    for process in processes {
        process.kill();
    }
    (running.most.load(Ordering::SeqCst), u64::from(max))
}

#[test]
fn requests_in_flight_never_pass_the_maximum() {
    let seeds = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200u64);
    for seed in 0..seeds {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime");
        let (most, max) = runtime.block_on(run(seed));
        assert!(most <= max, "seed {seed}: {most} in flight of {max}");
    }
}
