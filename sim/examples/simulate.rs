//! The hybrid protocol at fleet scale, simulated: N = 1 … 1 000 processes,
//! each a real hybrid `Limiter` (the crate's own code, not a model of it),
//! sharing one embedded store with a simulated round trip, all on a
//! virtual clock (Tokio's paused time) so a run is repeatable and takes
//! seconds, whatever N.
//!
//! ```text
//! cargo run --release --example simulate
//! cargo run --release --example simulate -- --rtt-us 500 --skew 1.2 --plot sim.svg
//! ```
//!
//! Flags: `--keys N` (50), `--limit N` per key per period (1000),
//! `--period-ms N` (1000), `--demand X` × the limit (2.0), `--skew S`
//! (Zipf exponent, 1.0), `--rtt-us N` store round trip (1000),
//! `--seconds N` simulated (6), `--mode strict|optimistic` (strict),
//! `--processes 1,4,…` (1,4,16,64,256,1000), `--plot PATH`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use slicelimit_sim as support;

use slicelimit::{clock::Clock, HybridConfig, Limiter, MemoryStore, Quota};
use support::load::ZipfKeys;
use support::VirtualClock;
use support::{Faults, FaultyStore};

#[derive(Clone)]
struct Args {
    keys: usize,
    limit: u64,
    period: Duration,
    demand: f64,
    skew: f64,
    rtt: Duration,
    seconds: u64,
    optimistic: bool,
    processes: Vec<usize>,
    plot: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        keys: 50,
        limit: 1000,
        period: Duration::from_millis(1000),
        demand: 2.0,
        skew: 1.0,
        rtt: Duration::from_micros(1000),
        seconds: 6,
        optimistic: false,
        processes: vec![1, 4, 16, 64, 256, 1000],
        plot: None,
    };
    for (flag, v) in support::load::flag_pairs() {
        let n = || support::load::number(&flag, &v);
        match flag.as_str() {
            "--keys" => a.keys = n() as usize,
            "--limit" => a.limit = n(),
            "--period-ms" => a.period = Duration::from_millis(n()),
            "--demand" => a.demand = v.parse().expect("a number"),
            "--skew" => a.skew = v.parse().expect("a number"),
            "--rtt-us" => a.rtt = Duration::from_micros(n()),
            "--seconds" => a.seconds = n(),
            "--mode" => a.optimistic = v == "optimistic",
            "--processes" => {
                a.processes = v.split(',').map(|p| p.parse().expect("a number")).collect()
            }
            "--plot" => a.plot = Some(v),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

struct Row {
    processes: usize,
    decisions: u64,
    utilization: f64,
    worst_overshoot: u64,
    calls_per_1000: f64,
    stranded_share: f64,
}

const MAX_DEBT: u64 = 5;

/// One simulated fleet of `n` processes, in its own paused runtime.
fn simulate(args: &Args, n: usize) -> Row {
    let runtime = support::seeds::paused_runtime();
    runtime.block_on(async {
        let clock = VirtualClock::new(Duration::from_secs(1_700_000_000));
        // The embedded store behind a simulated round trip, and nothing else
        // injected (the harness's fault-injecting wrapper).
        let store = FaultyStore::new(
            MemoryStore::with_clock(clock.clone()),
            Faults::default(),
            1,
            clock.clone(),
        )
        .with_latency(args.rtt);
        let quota = Quota::new(args.limit, args.period).expect("quota");
        let config = if args.optimistic {
            HybridConfig::optimistic(MAX_DEBT)
        } else {
            HybridConfig::strict()
        };
        let limiters: Vec<Limiter> = (0..n)
            .map(|_| {
                Limiter::builder(quota)
                    .store(store.clone())
                    .clock(clock.clone())
                    .hybrid(config.clone())
                    .build()
                    .expect("limiter")
            })
            .collect();
        // Zipf(skew) over the keys; total demand = factor × limit × keys.
        let names: Arc<Vec<String>> =
            Arc::new((0..args.keys).map(|k| format!("key-{k}")).collect());
        let tick = Duration::from_millis(1);
        let per_tick = args.demand * args.limit as f64 * args.keys as f64 * tick.as_secs_f64()
            / args.period.as_secs_f64()
            / n as f64;
        let period_us = args.period.as_micros() as u64;
        let ticks = args.seconds * 1000;
        let mut tasks = Vec::new();
        for (p, limiter) in limiters.iter().enumerate() {
            let (limiter, names, clock) = (limiter.clone(), names.clone(), clock.clone());
            let (keys, skew) = (args.keys, args.skew);
            tasks.push(tokio::spawn(async move {
                let mut zipf = ZipfKeys::new(
                    keys,
                    skew,
                    0x2545_F491_4F6C_DD1Du64 ^ ((p as u64 + 1) * 0x9E37_79B9_7F4A_7C15),
                );
                let mut carry = (p as f64 * 0.618_033_988_75).fract();
                let mut cells: HashMap<(usize, i64), (u64, u64)> = HashMap::new();
                let mut decisions = 0u64;
                let mut interval = tokio::time::interval(tick);
                for _ in 0..ticks {
                    interval.tick().await;
                    carry += per_tick;
                    while carry >= 1.0 {
                        carry -= 1.0;
                        let key = zipf.next_key();
                        let arrived = (clock.now().as_micros() as u64 / period_us) as i64;
                        let d = limiter.check(&names[key], 1).await;
                        decisions += 1;
                        cells.entry((key, arrived)).or_default().0 += 1;
                        if d.is_allowed() {
                            let at = (clock.now().as_micros() as u64 / period_us) as i64;
                            cells.entry((key, at)).or_default().1 += 1;
                        }
                    }
                }
                (cells, decisions)
            }));
        }
        let mut cells: HashMap<(usize, i64), (u64, u64)> = HashMap::new();
        let mut decisions = 0;
        for t in tasks {
            let (c, d) = t.await.expect("driver");
            decisions += d;
            for (k, (dem, adm)) in c {
                let cell = cells.entry(k).or_default();
                cell.0 += dem;
                cell.1 += adm;
            }
        }
        let stats: Vec<_> = limiters.iter().map(|l| l.stats()).collect();
        for l in &limiters {
            l.shutdown().await;
        }
        let mut windows: Vec<i64> = cells.keys().map(|(_, w)| *w).collect();
        windows.sort_unstable();
        windows.dedup();
        let full = if windows.len() > 2 {
            windows[1..windows.len() - 1].to_vec()
        } else {
            Vec::new()
        };
        let (mut used, mut saturated) = (0u64, 0u64);
        for ((_, w), (dem, adm)) in &cells {
            if full.contains(w) && *dem > args.limit {
                used += (*adm).min(args.limit);
                saturated += 1;
            }
        }
        let leased: u64 = stats.iter().map(|s| s.permits_leased).sum();
        let stranded: u64 = stats.iter().map(|s| s.stranded).sum();
        Row {
            processes: n,
            decisions,
            utilization: used as f64 / (saturated.max(1) * args.limit) as f64,
            worst_overshoot: cells
                .values()
                .map(|(_, a)| a.saturating_sub(args.limit))
                .max()
                .unwrap_or(0),
            calls_per_1000: stats.iter().map(|s| s.round_trips).sum::<u64>() as f64 * 1000.0
                / decisions.max(1) as f64,
            stranded_share: stranded as f64 / leased.max(1) as f64,
        }
    })
}

fn plot(path: &str, rows: &[Row]) {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 380)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let (left, right) = root.split_horizontally(450);
    let max_n = rows.iter().map(|r| r.processes).max().unwrap_or(1) as f64;
    let mut chart = ChartBuilder::on(&left)
        .caption("utilization of saturated keys", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(44)
        .build_cartesian_2d((1f64..max_n * 1.5).log_scale(), 0f64..1.05f64)
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("processes (log)")
        .y_desc("admitted ÷ limit")
        .draw()
        .unwrap();
    chart
        .draw_series(LineSeries::new(
            rows.iter().map(|r| (r.processes as f64, r.utilization)),
            BLUE.stroke_width(2),
        ))
        .unwrap();
    chart
        .draw_series(
            rows.iter()
                .map(|r| Circle::new((r.processes as f64, r.utilization), 3, BLUE.filled())),
        )
        .unwrap();
    let max_calls = rows.iter().map(|r| r.calls_per_1000).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&right)
        .caption("store calls per 1000 decisions", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(44)
        .build_cartesian_2d((1f64..max_n * 1.5).log_scale(), 0f64..max_calls * 1.15)
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("processes (log)")
        .y_desc("round trips")
        .draw()
        .unwrap();
    chart
        .draw_series(LineSeries::new(
            rows.iter().map(|r| (r.processes as f64, r.calls_per_1000)),
            RED.stroke_width(2),
        ))
        .unwrap();
    chart
        .draw_series(
            rows.iter()
                .map(|r| Circle::new((r.processes as f64, r.calls_per_1000), 3, RED.filled())),
        )
        .unwrap();
    root.present().expect("write the SVG");
}

fn main() {
    let args = parse_args();
    println!(
        "simulated: {} keys, {} per key per {:?}, Zipf({}) demand at {}× the limit, store round trip {:?}, {} s, hybrid {}",
        args.keys,
        args.limit,
        args.period,
        args.skew,
        args.demand,
        args.rtt,
        args.seconds,
        if args.optimistic { "optimistic (max_debt 5)" } else { "strict" }
    );
    println!(
        "\n{:>10} {:>12} {:>12} {:>16} {:>20} {:>10}",
        "processes",
        "decisions",
        "utilization",
        "worst overshoot",
        "store calls per 1000",
        "stranded"
    );
    let mut rows = Vec::new();
    for &n in &args.processes {
        let r = simulate(&args, n);
        println!(
            "{:>10} {:>12} {:>11.1}% {:>16} {:>20.2} {:>9.1}%",
            r.processes,
            r.decisions,
            r.utilization * 100.0,
            r.worst_overshoot,
            r.calls_per_1000,
            r.stranded_share * 100.0
        );
        rows.push(r);
    }
    if let Some(path) = &args.plot {
        plot(path, &rows);
        println!("\nwrote {path}");
    }
}
