//! Nanoseconds per decision: the hybrid hot path, the denied-until path,
//! per-process limiting, governor's keyed limiter, and the exact limiter on
//! a private Redis — one, two and four threads each (and every core, on a
//! machine with more than four).
//!
//! `cargo bench --bench limiters` (needs `redis-server` on PATH for the
//! exact and `hybrid_defaults_redis` groups). Two-thread figures are wall time per decision across both
//! threads, i.e. the inverse of aggregate throughput.

use slicelimit_sim as support;

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use slicelimit::{Algorithm, HybridConfig, Limiter, MemoryStore, Quota, RedisStore};

const MANY_KEYS: usize = 10_000;

/// What a caller does with an answer it reads in place: it exists in
/// memory, whole, and is not copied. The same for every limiter here, so
/// an answer's size costs what its making costs, not a harness's moves.
#[inline(always)]
fn consume<T>(answer: &T) {
    black_box(answer);
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("user-{i:05}")).collect()
}

/// 2 and 4 threads, and every core where that is more.
fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut counts = vec![2, 4];
    if cores > 4 {
        counts.push(cores);
    }
    counts
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `per_thread` decisions on each of `threads` threads, each with its
/// own current-thread runtime; returns the wall time.
fn on_threads(limiter: &Limiter, keys: &Arc<Vec<String>>, threads: usize, total: u64) -> Duration {
    let per_thread = total / threads as u64;
    let barrier = Arc::new(std::sync::Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let limiter = limiter.clone();
            let keys = keys.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                barrier.wait();
                rt.block_on(async {
                    let mut i = t * 7919;
                    for _ in 0..per_thread {
                        i = (i + 1) % keys.len();
                        black_box(limiter.check(&keys[i], 1).await);
                    }
                });
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    started.elapsed()
}

fn bench_limiter(c: &mut Criterion, group: &str, limiter: &Limiter, key_counts: &[usize]) {
    let rt = runtime();
    let mut g = c.benchmark_group(group);
    for &n in key_counts {
        let ks = Arc::new(keys(n));
        // Warm every key (first lease, first window).
        rt.block_on(async {
            for k in ks.iter() {
                limiter.check(k, 1).await;
            }
        });
        g.bench_function(format!("{n}_keys/1_thread"), |b| {
            let mut i = 0usize;
            b.to_async(&rt).iter(|| {
                i = (i + 1) % ks.len();
                limiter.check(&ks[i], 1)
            })
        });
        for threads in thread_counts() {
            g.bench_function(format!("{n}_keys/{threads}_threads"), |b| {
                b.iter_custom(|iters| on_threads(limiter, &ks, threads, iters.max(threads as u64)))
            });
        }
    }
    g.finish();
}

/// A strict hybrid limiter whose leases last the whole run.
fn hybrid_limiter(rt: &tokio::runtime::Runtime) -> Limiter {
    rt.block_on(async {
        Limiter::builder(Quota::new(1_000_000_000_000, Duration::from_secs(3600)).unwrap())
            .store(MemoryStore::new())
            .hybrid(HybridConfig::strict().lease_bounds(1_000_000, 100_000_000))
            .build()
            .unwrap()
    })
}

fn hybrid(c: &mut Criterion) {
    let rt = runtime();
    // First, on a limiter of its own: one key in its map, as in governor's
    // 1-key map, and no other limiter's sync task (the 10 000-key one
    // below, its maintenance and its shutdown) running beside it.
    let limiter = hybrid_limiter(&rt);
    rt.block_on(limiter.check(&keys(1)[0], 1));
    bench_check_now(c, &limiter);
    drop(limiter);
    bench_limiter(c, "hybrid_hot_path", &hybrid_limiter(&rt), &[1, MANY_KEYS]);
    // Keep the runtime (and the sync task) alive until the group is done.
    drop(rt);
}

/// `check_now`, the synchronous decision, on one hot key: the same shape
/// as governor's `check_key` below (no future to poll), one, two and four
/// threads.
fn bench_check_now(c: &mut Criterion, limiter: &Limiter) {
    let mut g = c.benchmark_group("hybrid_check_now");
    let ks = Arc::new(keys(1));
    g.bench_function("1_keys/1_thread", |b| {
        b.iter(|| consume(&limiter.check_now(&ks[0], 1)))
    });
    for threads in thread_counts().into_iter().map(|t| t as u64) {
        g.bench_function(format!("1_keys/{threads}_threads"), |b| {
            b.iter_custom(|iters| {
                let per = iters.max(threads) / threads;
                let started = Instant::now();
                std::thread::scope(|s| {
                    for _ in 0..threads {
                        let ks = ks.clone();
                        s.spawn(move || {
                            for _ in 0..per {
                                consume(&limiter.check_now(&ks[0], 1));
                            }
                        });
                    }
                });
                started.elapsed()
            })
        });
    }
    g.finish();
}

/// The hot key at the defaults a user gets: `HybridConfig::strict()` as
/// it is, a private Redis, the answer returned by value (as a caller
/// that keeps it does), and governor's keyed limiter in the same shape,
/// in one group so the two are read side by side from one run. Printed
/// after the group: how many `check_now` calls were left to the store
/// (`None`: a slot run dry), which would otherwise pass for fast answers.
fn hybrid_defaults_redis(c: &mut Criterion) {
    use governor::{Quota as GQuota, RateLimiter};
    use std::sync::atomic::{AtomicU64, Ordering};
    let server = support::RedisServer::start();
    let rt = runtime();
    let limiter = rt.block_on(async {
        Limiter::builder(Quota::new(1_000_000_000_000, Duration::from_secs(3600)).unwrap())
            .store(
                RedisStore::connect_with(&server.url(), support::test_options())
                    .await
                    .unwrap(),
            )
            .hybrid(HybridConfig::strict())
            .build()
            .unwrap()
    });
    let governor = RateLimiter::keyed(GQuota::per_second(NonZeroU32::MAX));
    let key = keys(1).remove(0);
    rt.block_on(limiter.check(&key, 1));
    let _ = governor.check_key(&key);
    let (calls, unanswered) = (AtomicU64::new(0), AtomicU64::new(0));
    let mut g = c.benchmark_group("hybrid_defaults_redis");
    for threads in [1u64, 2] {
        let name = if threads == 1 {
            "1_thread".to_string()
        } else {
            format!("{threads}_threads")
        };
        g.bench_function(format!("check_now/{name}"), |b| {
            b.iter_custom(|iters| {
                on_scoped_threads(threads, iters, |per| {
                    let mut none = 0;
                    for _ in 0..per {
                        none += u64::from(black_box(limiter.check_now(&key, 1)).is_none());
                    }
                    calls.fetch_add(per, Ordering::Relaxed);
                    unanswered.fetch_add(none, Ordering::Relaxed);
                })
            })
        });
        g.bench_function(format!("governor/{name}"), |b| {
            b.iter_custom(|iters| {
                on_scoped_threads(threads, iters, |per| {
                    let mut denied = 0;
                    for _ in 0..per {
                        denied += u64::from(black_box(governor.check_key(&key)).is_err());
                    }
                    black_box(denied);
                })
            })
        });
    }
    g.finish();
    let stats = limiter.stats();
    eprintln!(
        "hybrid_defaults_redis: check_now left {} of {} calls to the store; {} leases",
        unanswered.into_inner(),
        calls.into_inner(),
        stats.leases
    );
    drop(limiter);
    drop(rt);
}

/// Runs `decide(per)` on each of `threads` threads (the calling one
/// alone for one), `iters` decisions in all; returns the wall time.
fn on_scoped_threads(threads: u64, iters: u64, decide: impl Fn(u64) + Sync) -> Duration {
    let per = iters.max(threads) / threads;
    let started = Instant::now();
    if threads == 1 {
        decide(per);
    } else {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| decide(per));
            }
        });
    }
    started.elapsed()
}

fn denied(c: &mut Criterion) {
    let rt = runtime();
    let limiter = rt.block_on(async {
        Limiter::builder(Quota::new(1, Duration::from_secs(3600)).unwrap())
            .store(MemoryStore::new())
            .hybrid(HybridConfig::strict())
            .build()
            .unwrap()
    });
    bench_limiter(c, "hybrid_denied_until", &limiter, &[1]);
    drop(rt);
}

fn local(c: &mut Criterion) {
    let limiter =
        Limiter::builder(Quota::new(1_000_000_000_000, Duration::from_secs(3600)).unwrap())
            .local()
            .build()
            .unwrap();
    bench_limiter(c, "local", &limiter, &[1, MANY_KEYS]);
}

fn governor_keyed(c: &mut Criterion) {
    use governor::{Quota as GQuota, RateLimiter};
    let limiter = Arc::new(RateLimiter::keyed(GQuota::per_second(NonZeroU32::MAX)));
    let mut g = c.benchmark_group("governor_keyed");
    for n in [1, MANY_KEYS] {
        let ks = Arc::new(keys(n));
        for k in ks.iter() {
            let _ = limiter.check_key(k);
        }
        g.bench_function(format!("{n}_keys/1_thread"), |b| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) % ks.len();
                consume(&limiter.check_key(&ks[i]))
            })
        });
        for threads in thread_counts().into_iter().map(|t| t as u64) {
            g.bench_function(format!("{n}_keys/{threads}_threads"), |b| {
                b.iter_custom(|iters| {
                    let per = iters.max(threads) / threads;
                    let started = Instant::now();
                    std::thread::scope(|s| {
                        for t in 0..threads as usize {
                            let limiter = limiter.clone();
                            let ks = ks.clone();
                            s.spawn(move || {
                                let mut i = t * 7919;
                                for _ in 0..per {
                                    i = (i + 1) % ks.len();
                                    consume(&limiter.check_key(&ks[i]));
                                }
                            });
                        }
                    });
                    started.elapsed()
                })
            });
        }
    }
    g.finish();
}

fn exact(c: &mut Criterion) {
    let server = support::RedisServer::start();
    let rt = runtime();
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let limiter = rt.block_on(async {
            Limiter::builder(Quota::new(1_000_000_000_000, Duration::from_secs(3600)).unwrap())
                .store(
                    RedisStore::connect_with(&server.url(), support::test_options())
                        .await
                        .unwrap(),
                )
                .algorithm(algorithm)
                .exact()
                .build()
                .unwrap()
        });
        let mut g = c.benchmark_group(format!("exact_{}", algorithm.as_str()));
        g.sample_size(20);
        let ks = Arc::new(keys(1));
        g.bench_function("1_keys/1_thread", |b| {
            b.to_async(&rt).iter(|| limiter.check(&ks[0], 1))
        });
        g.bench_function("1_keys/2_threads", |b| {
            b.iter_custom(|iters| on_threads(&limiter, &ks, 2, iters.max(2)))
        });
        g.finish();
    }
}

criterion_group!(
    benches,
    hybrid,
    hybrid_defaults_redis,
    denied,
    local,
    governor_keyed,
    exact
);
criterion_main!(benches);
