//! GCRA: one theoretical arrival time per key, the same admissions as a
//! token bucket with one number of state; hybrid leases are bucket leases.

use super::bucket::{self, LEVEL_SCALE};
use super::calls::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, Params};
use super::state::{ceil_ms_to_us, wrong_type, Entry, State};
use super::{LeaseKind, Lua, Spec};
use crate::error::Error;

pub(super) static SPEC: Spec = Spec {
    name: "gcra",
    key_suffix: "gc",
    exact: Lua::new(
        "gcra",
        concat!(
            include_str!("../../lua/gcra.lua"),
            include_str!("../../lua/check_one.lua")
        ),
    ),
    exact_all: Lua::new(
        "gcra_all",
        concat!(
            include_str!("../../lua/gcra.lua"),
            include_str!("../../lua/check_all.lua")
        ),
    ),
    lease: Lua::new("lease_gcra", include_str!("../../lua/lease_gcra.lua")),
    exact_args: bucket::exact_args,
    lease_args: bucket::lease_args,
    give_back_args: |p, c, args| bucket::give_back_args("gc", p, c, args),
    check_quota: |q| bucket::check_quota("gcra", q),
    max_cost: |q| q.burst(),
    check,
    lease_mirror: lease,
    give_back,
    leases: LeaseKind::Bucket,
    pre_leases: false,
};

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

fn check(
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
        level: ((g.level(tat, nowf) - 1e-9) * LEVEL_SCALE).ceil().max(0.0) as u64,
        given_back: gb.unwrap_or(0),
    })
}

fn lease(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &LeaseCall,
) -> Result<LeaseReply, Error> {
    let g = GcraShape::new(p);
    let nowf = now as f64;
    let (mut tat, gb) = gcra_tat(entry, now, &call.key)?;
    let debt = call.debt as f64;
    let need = (call.need.max(1) as f64).min(p.burst as f64);
    let mut uncovered = 0.0;
    if debt > 0.0 {
        uncovered = (debt - g.available(tat, nowf).max(0.0)).max(0.0);
        tat = (tat + debt * g.interval).min(nowf + 2.0 * g.tolerance);
    }
    let granted = bucket::grant(g.available(tat, nowf).max(0.0), call, p.burst as f64);
    tat += granted * g.interval;
    let gb = if granted > 0.0 || debt > 0.0 {
        let gb = gb.unwrap_or(now);
        store_gcra(entry, now, tat, Some(gb));
        Some(gb)
    } else {
        gb
    };
    let retry = if granted == 0.0 {
        (tat + need * g.interval - g.tolerance - nowf)
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
        level: ((g.level(tat, nowf) - 1e-9) * LEVEL_SCALE).ceil().max(0.0) as u64,
        given_back: gb.unwrap_or(0),
    })
}

/// The GCRA branch of `give_back.lua`.
fn give_back(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &GiveBackCall,
) -> Result<u64, Error> {
    let returned = call.returned as f64;
    let burst = p.burst as f64;

    let g = GcraShape::new(p);
    let nowf = now as f64;
    let (tat, gb) = gcra_tat(entry, now, &call.key)?;
    let Some(peak) = bucket::peak(p, call.origin, gb, now) else {
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
            gb: Some(gb.unwrap_or(0) + back as u64),
        };
    }
    Ok(back as u64)
}
