//! The concurrency limiter on the embedded store behind the
//! fault-injecting wrapper: the seeded simulation of the in-flight bound,
//! and an outage under `FailClosed`.
//!
//! The simulation: processes sharing one store (delayed, duplicated and
//! lost replies), each running requests that take a slot, hold it a while
//! (sometimes longer than the lease) and release it; waits given up half
//! way; processes killed without releasing anything and started again.
//! The oracle counts requests where they run: never more than the
//! maximum at once. Calls that never reach the store are not injected
//! while a process lives: a renewal must reach it before the lease
//! expires (the bound's assumption).
//!
//! `SIM_SEEDS=N` runs N seeds (default 200), `SIM_SEED=S` one.

use slicelimit_sim as support;

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slicelimit::{
    clock::FakeClock, concurrency::AcquireError, ConcurrencyLimiter, FailurePolicy, MemoryStore,
};
use support::{Faults, FaultyStore, VirtualClock};

fn max(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("not zero")
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

/// One process of the fleet: its limiter reaches the shared store through
/// a wrapper of its own, so that it can be cut off alone.
struct Process {
    store: FaultyStore,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// What a process's store calls meet.
struct Network {
    memory: MemoryStore,
    faults: Faults,
    clock: VirtualClock,
}

fn start(
    network: &Network,
    max: u32,
    hybrid: bool,
    tasks: u64,
    seed: u64,
    running: &Arc<Running>,
) -> Process {
    let store = FaultyStore::new(
        network.memory.clone(),
        network.faults,
        seed | 1,
        network.clock.clone(),
    );
    let builder = ConcurrencyLimiter::builder(NonZeroU32::new(max).expect("not zero"))
        .store(store.clone())
        .clock(network.clock.clone())
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
    Process { store, tasks }
}

impl Process {
    /// Killed: its requests die, and from now on nothing it sends reaches
    /// the store (no release, no renewal), so its leases expire, as a
    /// killed process's do.
    fn kill(self) {
        self.store.set_faults(Faults {
            lost_before: 1.0,
            ..Faults::default()
        });
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn simulate(seed: u64) -> (u64, u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let clock = VirtualClock::new(Duration::from_secs(1_000));
    let network = Network {
        memory: MemoryStore::with_clock(clock.clone()),
        faults: Faults {
            max_delay: Duration::from_millis(rng.below(30)),
            timeout: Duration::from_millis(50),
            lost_after: rng.below(5) as f64 / 100.0,
            lost_before: 0.0,
            duplicated: rng.below(5) as f64 / 100.0,
        },
        clock,
    };
    let max = 1 + rng.below(6) as u32;
    let hybrid = rng.below(2) == 0;
    let running = Arc::new(Running::default());
    let mut processes: Vec<Process> = (0..2 + rng.below(2))
        .map(|p| {
            let tasks = 2 + rng.below(5);
            start(&network, max, hybrid, tasks, seed + p, &running)
        })
        .collect();
    for step in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if rng.below(12) == 0 {
            let p = rng.below(processes.len() as u64) as usize;
            let tasks = 2 + rng.below(5);
            let fresh = start(&network, max, hybrid, tasks, seed + 100 + step, &running);
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
    let seeds = support::seeds::seeds(200, &[], 0);
    let ran = support::seeds::run(
        &seeds,
        "cargo test --test concurrency -- requests_in_flight --nocapture",
        |seed| {
            let (most, max) = support::seeds::paused_runtime().block_on(simulate(seed));
            if most > max {
                return Err(format!("{most} in flight of {max}"));
            }
            Ok(format!("at most {most} in flight of {max}"))
        },
    );
    println!("{ran} seeds, never more in flight than the maximum");
}

/// Moves the store's and the limiter's clock and Tokio's together, in
/// steps the background tasks see.
async fn advance(clock: &FakeClock, by: Duration) {
    let step = Duration::from_millis(100);
    let mut left = by;
    while !left.is_zero() {
        let d = step.min(left);
        clock.advance(d);
        tokio::time::advance(d).await;
        tokio::task::yield_now().await;
        left -= d;
    }
}

/// An outage under `FailClosed`, in both modes: the process holds no
/// permit, so every attempt while the store cannot answer is
/// `Unavailable` (a 503), never `Full` (a 429 saying the key is busy).
/// The hybrid race made deterministic: the renewal that gives idle slots
/// back fails, leaving the lease's local count below the store's; asking
/// was then held off as "giving slots back" for the whole outage.
#[tokio::test(start_paused = true)]
async fn an_outage_under_fail_closed_is_unavailable_never_full() {
    for hybrid in [false, true] {
        let clock = FakeClock::new(Duration::from_secs(1_000));
        let store = FaultyStore::new(
            MemoryStore::with_clock(clock.clone()),
            Faults::default(),
            7,
            clock.clone(),
        );
        let builder = ConcurrencyLimiter::builder(max(4))
            .store(store.clone())
            .clock(clock.clone())
            .on_store_error(FailurePolicy::FailClosed)
            .lease(Duration::from_secs(3))
            .renew_every(Duration::from_secs(1));
        let limiter = if hybrid {
            builder.hybrid()
        } else {
            builder.exact()
        }
        .build()
        .expect("builds");
        let held = [
            limiter.try_acquire("k").await.expect("a slot"),
            limiter.try_acquire("k").await.expect("a slot"),
        ];
        store.set_faults(Faults {
            lost_before: 1.0,
            ..Faults::default()
        });
        drop(held);
        // The next renewal gives the idle slots back, and fails.
        advance(&clock, Duration::from_millis(1_100)).await;
        for attempt in 0..50 {
            let answer = limiter.try_acquire("k").await;
            assert!(
                matches!(answer, Err(AcquireError::Unavailable { .. })),
                "hybrid {hybrid}, attempt {attempt}: {answer:?}"
            );
            advance(&clock, Duration::from_millis(100)).await;
        }
        if hybrid {
            // A call that hangs (400 ms, then fails) is in flight when a
            // wait of 50 ms runs out behind it: the last call failed, so
            // the store cannot answer, not "every slot is busy".
            let slow = store.clone().with_latency(Duration::from_millis(400));
            // Past the breaker's backoff: the next call is let through
            // as its probe.
            clock.advance(Duration::from_secs(1));
            let first = tokio::spawn({
                let limiter = limiter.clone();
                async move { limiter.try_acquire("k").await }
            });
            tokio::task::yield_now().await;
            let behind = limiter.acquire("k", Duration::from_millis(50)).await;
            assert!(
                matches!(behind, Err(AcquireError::Unavailable { .. })),
                "{behind:?}"
            );
            let first = first.await.expect("joins");
            assert!(
                matches!(first, Err(AcquireError::Unavailable { .. })),
                "{first:?}"
            );
            let _ = slow.with_latency(Duration::ZERO);
        }
        // The store is back: the first attempt asks it, and gets a slot.
        store.set_faults(Faults::default());
        advance(&clock, Duration::from_secs(1)).await;
        let _back = limiter.try_acquire("k").await.expect("a slot again");
    }
}
