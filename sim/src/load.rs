//! A Zipf-skewed open-loop load for fleets of limiters, and per-window
//! tallies attributed by the wall clock (which Redis' `TIME` also reads on
//! this machine), and Redis' clock read locally (`RedisClock`), for
//! tests that place requests in Redis' windows.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use slicelimit::Limiter;

/// The shape of a load.
#[derive(Debug, Clone, Copy)]
pub struct LoadSpec {
    pub keys: usize,
    pub limit: u64,
    pub period: Duration,
    /// Total demand per period = factor × limit × keys, split by Zipf(1).
    pub demand_factor: f64,
    pub duration: Duration,
    /// Requests are issued in bursts every `tick`.
    pub tick: Duration,
}

/// (key index, window index) → (requests that arrived, requests admitted).
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub cells: HashMap<(usize, i64), (u64, u64)>,
}

impl Tally {
    pub fn merge(&mut self, other: &Tally) {
        for (k, (d, a)) in &other.cells {
            let cell = self.cells.entry(*k).or_default();
            cell.0 += d;
            cell.1 += a;
        }
    }

    /// Windows that were entirely inside the run (the first and last are
    /// partial).
    pub fn full_windows(&self) -> Vec<i64> {
        let mut windows: Vec<i64> = self.cells.keys().map(|(_, w)| *w).collect();
        windows.sort_unstable();
        windows.dedup();
        if windows.len() <= 2 {
            return Vec::new();
        }
        windows[1..windows.len() - 1].to_vec()
    }

    /// The largest admitted count of any key in any window.
    pub fn worst(&self) -> ((usize, i64), u64) {
        self.cells
            .iter()
            .map(|(k, (_, a))| (*k, *a))
            .max_by_key(|(_, a)| *a)
            .unwrap_or(((0, 0), 0))
    }

    /// Σ admitted ÷ Σ limit over full (key, window) cells whose demand
    /// exceeded the limit; and how many such cells there were.
    pub fn utilization(&self, limit: u64) -> (f64, usize) {
        let full = self.full_windows();
        let (mut admitted, mut cells) = (0u64, 0usize);
        for ((_, w), (d, a)) in &self.cells {
            if full.contains(w) && *d > limit {
                admitted += (*a).min(limit);
                cells += 1;
            }
        }
        if cells == 0 {
            return (0.0, 0);
        }
        (admitted as f64 / (cells as u64 * limit) as f64, cells)
    }

    pub fn to_lines(&self) -> String {
        let mut out = String::new();
        for ((k, w), (d, a)) in &self.cells {
            out.push_str(&format!("cell {k} {w} {d} {a}\n"));
        }
        out
    }

    pub fn parse_line(&mut self, line: &str) {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if parts.len() == 5 && parts[0] == "cell" {
            let k: usize = parts[1].parse().unwrap();
            let w: i64 = parts[2].parse().unwrap();
            let d: u64 = parts[3].parse().unwrap();
            let a: u64 = parts[4].parse().unwrap();
            let cell = self.cells.entry((k, w)).or_default();
            cell.0 += d;
            cell.1 += a;
        }
    }
}

pub fn wall_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

pub fn key_name(index: usize) -> String {
    format!("user-{index}")
}

/// Draws key indices with Zipf(skew) frequencies (rank r has weight
/// 1/r^skew), deterministically from a seed.
pub struct ZipfKeys {
    cdf: Vec<f64>,
    state: u64,
}

impl ZipfKeys {
    pub fn new(keys: usize, skew: f64, seed: u64) -> Self {
        let weights: Vec<f64> = (1..=keys).map(|r| 1.0 / (r as f64).powf(skew)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        ZipfKeys {
            cdf,
            state: seed | 1,
        }
    }

    /// The next key index (xorshift64, then the inverse CDF).
    pub fn next_key(&mut self) -> usize {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let u = (self.state >> 11) as f64 / (1u64 << 53) as f64;
        self.cdf
            .iter()
            .position(|c| u <= *c)
            .unwrap_or(self.cdf.len() - 1)
    }
}

/// Open-loop pacing: every `tick`, as many requests as the fractional
/// `per_tick` has added up to; ticks missed under load are made up in a
/// burst, so the offered load does not drop when the system is slow.
pub struct Pacer {
    ticker: tokio::time::Interval,
    per_tick: f64,
    carry: f64,
}

impl Pacer {
    pub fn new(tick: std::time::Duration, per_tick: f64) -> Self {
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        Pacer {
            ticker,
            per_tick,
            carry: 0.0,
        }
    }

    /// Waits for the next tick; returns how many requests to send now.
    pub async fn next_batch(&mut self) -> usize {
        self.ticker.tick().await;
        self.carry += self.per_tick;
        let n = self.carry.floor() as usize;
        self.carry -= n as f64;
        n
    }
}

/// Demand per period for the key of rank `index` (0-based).
pub fn key_demand(spec: &LoadSpec, index: usize) -> f64 {
    let total: f64 = (1..=spec.keys).map(|r| 1.0 / r as f64).sum();
    spec.demand_factor * spec.limit as f64 * spec.keys as f64 / (index + 1) as f64 / total
}

/// Drives one limiter with `share` of the total demand until `stop_at_us`
/// (wall clock), issuing requests in bursts every tick.
pub async fn drive(
    limiter: Limiter,
    spec: LoadSpec,
    share: f64,
    seed: u64,
    stop_at_us: u64,
) -> Tally {
    let mut zipf = ZipfKeys::new(spec.keys, 1.0, seed);
    let names: Vec<String> = (0..spec.keys).map(key_name).collect();
    let per_period = spec.demand_factor * spec.limit as f64 * spec.keys as f64 * share;
    let per_tick = per_period * spec.tick.as_secs_f64() / spec.period.as_secs_f64();
    let period_us = spec.period.as_micros() as u64;
    let mut tally = Tally::default();
    let mut pacer = Pacer::new(spec.tick, per_tick);
    while wall_us() < stop_at_us {
        for _ in 0..pacer.next_batch().await {
            let key = zipf.next_key();
            let arrived = (wall_us() / period_us) as i64;
            let decision = limiter.check(&names[key], 1).await;
            tally.cells.entry((key, arrived)).or_default().0 += 1;
            if decision.is_allowed() {
                let admitted = (wall_us() / period_us) as i64;
                tally.cells.entry((key, admitted)).or_default().1 += 1;
            }
        }
    }
    tally
}

/// The command line's `--flag value` pairs, for the examples.
pub fn flag_pairs() -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        pairs.push((flag, value));
    }
    pairs
}

/// A flag's value as a whole number, or a panic naming the flag.
pub fn number(flag: &str, value: &str) -> u64 {
    value
        .parse()
        .unwrap_or_else(|_| panic!("{flag}: not a number: {value}"))
}

/// Redis' clock, µs, by `TIME`.
pub fn redis_now_us(server: &crate::RedisServer) -> u64 {
    let t: Vec<String> = server.cmd(&["TIME"]);
    t[0].parse::<u64>().unwrap() * 1_000_000 + t[1].parse::<u64>().unwrap()
}

/// Redis' clock read locally: its offset from the wall clock is measured
/// once by `TIME` (the smallest of a few round trips), then the wall clock
/// plus that offset tells Redis' time without a round trip.
#[derive(Clone, Copy)]
pub struct RedisClock {
    offset_us: i64,
}

impl RedisClock {
    pub fn of(server: &crate::RedisServer) -> RedisClock {
        let mut best: Option<(u64, i64)> = None;
        for _ in 0..5 {
            let before = wall_us();
            let redis = redis_now_us(server);
            let after = wall_us();
            let offset = redis as i64 - ((before + after) / 2) as i64;
            if best.is_none_or(|(span, _)| after - before < span) {
                best = Some((after - before, offset));
            }
        }
        RedisClock {
            offset_us: best.unwrap().1,
        }
    }

    pub fn now_us(&self) -> u64 {
        (wall_us() as i64 + self.offset_us) as u64
    }

    pub async fn sleep_until(&self, at_us: u64) {
        loop {
            let now = self.now_us();
            if now >= at_us {
                return;
            }
            tokio::time::sleep(Duration::from_micros(at_us - now)).await;
        }
    }

    /// Waits until `into` past the start of a window of `period` and
    /// returns that window's start (µs): the current window if it is not
    /// `into` old yet, else the next one.
    pub async fn enter_window(&self, period: Duration, into: Duration) -> u64 {
        let p = period.as_micros() as u64;
        let into = into.as_micros() as u64;
        let now = self.now_us();
        let mut start = now / p * p;
        if now > start + into {
            start += p;
        }
        self.sleep_until(start + into).await;
        start
    }

    /// Returns at once if the current window of `period` has at least
    /// `need` left (and is 50 ms old), else waits until 50 ms into the
    /// next one. Returns the window's start (µs).
    pub async fn clear_of_boundary(&self, period: Duration, need: Duration) -> u64 {
        let p = period.as_micros() as u64;
        let now = self.now_us();
        let start = now / p * p;
        if now >= start + 50_000 && start + p - now >= need.as_micros() as u64 {
            return start;
        }
        self.enter_window(period, Duration::from_millis(50)).await
    }
}

/// How late this machine ran a thread that asked to sleep 1 ms, at worst,
/// while it was watched: a test whose timeouts are tight reads from it
/// whether the machine (other work on its cores) held its threads back
/// for longer than the network it measures could have.
pub struct StallWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    worst_us: std::sync::Arc<std::sync::atomic::AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StallWatch {
    pub fn start() -> StallWatch {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let worst_us = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (s, w) = (stop.clone(), worst_us.clone());
        let thread = std::thread::spawn(move || {
            let tick = Duration::from_millis(1);
            while !s.load(Ordering::Relaxed) {
                let before = std::time::Instant::now();
                std::thread::sleep(tick);
                let late = before.elapsed().saturating_sub(tick);
                w.fetch_max(late.as_micros() as u64, Ordering::Relaxed);
            }
        });
        StallWatch {
            stop,
            worst_us,
            thread: Some(thread),
        }
    }

    /// The longest stall seen so far.
    pub fn worst(&self) -> Duration {
        Duration::from_micros(self.worst_us.load(std::sync::atomic::Ordering::Relaxed))
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
