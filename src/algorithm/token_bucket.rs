//! The token bucket: `burst` tokens refilled continuously at `limit /
//! period`. One hash per key (tokens, timestamp, give-back counter);
//! hybrid leases are bucket leases.

use super::bucket::{self, LEVEL_SCALE};
use super::calls::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, Params};
use super::state::{ceil_ms_to_us, wrong_type, Entry, State};
use super::{LeaseKind, Lua, Spec};
use crate::error::Error;

pub(super) static SPEC: Spec = Spec {
    name: "token-bucket",
    key_suffix: "tb",
    exact: Lua::new(
        "token_bucket",
        concat!(
            include_str!("../../lua/bucket.lua"),
            include_str!("../../lua/token_bucket.lua"),
            include_str!("../../lua/check_one.lua")
        ),
    ),
    exact_all: Lua::new(
        "token_bucket_all",
        concat!(
            include_str!("../../lua/bucket.lua"),
            include_str!("../../lua/token_bucket.lua"),
            include_str!("../../lua/check_all.lua")
        ),
    ),
    lease: Lua::new(
        "lease_token_bucket",
        concat!(
            include_str!("../../lua/bucket.lua"),
            include_str!("../../lua/lease_token_bucket.lua")
        ),
    ),
    exact_args: bucket::exact_args,
    lease_args: bucket::lease_args,
    give_back_args: |p, c, args| bucket::give_back_args("tb", p, c, args),
    check_quota: |q| bucket::check_quota("token-bucket", q),
    max_cost: |q| q.burst(),
    check,
    lease_mirror: lease,
    give_back,
    leases: LeaseKind::Bucket,
    pre_leases: false,
};

/// A bucket entry as stored (a missing entry is a full bucket, now) and
/// refilled to now.
struct Bucket {
    /// The tokens stored at `ts`.
    kept: f64,
    ts: u64,
    /// `kept` refilled to now, at most the burst.
    tokens: f64,
    /// The give-back counter.
    gb: Option<u64>,
}

fn bucket_tokens(entry: &Option<Entry>, p: &Params, now: u64, key: &str) -> Result<Bucket, Error> {
    let (kept, ts, gb) = match entry {
        None => (p.burst as f64, now, None),
        Some(Entry {
            state: State::Bucket { tokens, ts, gb },
            ..
        }) => (*tokens, *ts, *gb),
        Some(_) => return Err(wrong_type(key)),
    };
    let mut tokens = kept;
    if now > ts {
        tokens =
            (p.burst as f64).min(kept + (now - ts) as f64 * p.limit as f64 / p.period_us as f64);
    }
    Ok(Bucket {
        kept,
        ts,
        tokens,
        gb,
    })
}

/// How long from `now` until a bucket holding `tokens` at `ts` holds
/// `need`, in whole microseconds: the rounded-up quotient, grown by 1, 2,
/// 4 ... µs until the sum a later call computes reaches `need` (floating
/// point can leave it a hair short). Mirrors `refill_wait` in `lua/bucket.lua`.
fn refill_wait(tokens: f64, ts: u64, now: u64, need: f64, p: &Params) -> u64 {
    let (limit, period) = (p.limit as f64, p.period_us as f64);
    let mut at = ts + ((need - tokens) * period / limit).ceil().max(0.0) as u64;
    let mut step = 1;
    while tokens + (at - ts) as f64 * limit / period < need {
        at += step;
        step *= 2;
    }
    at.saturating_sub(now)
}

fn bucket_reset(p: &Params, tokens: f64) -> f64 {
    ((p.burst as f64 - tokens) * p.period_us as f64 / p.limit as f64).ceil()
}

fn store_bucket(entry: &mut Option<Entry>, p: &Params, now: u64, tokens: f64, gb: Option<u64>) {
    let reset = bucket_reset(p, tokens);
    *entry = Some(Entry {
        state: State::Bucket {
            tokens,
            ts: now,
            gb,
        },
        expires_us: now + ceil_ms_to_us(reset) + 1000,
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
    let Bucket {
        kept,
        ts,
        mut tokens,
        gb,
    } = bucket_tokens(entry, p, now, key)?;
    let (allowed, retry) = if cost > p.burst {
        (false, None)
    } else if cost == 0 || cost as f64 <= tokens {
        tokens -= cost as f64;
        (true, Some(0))
    } else {
        // A denial writes nothing: the key keeps `kept` at `ts`.
        (false, Some(refill_wait(kept, ts, now, cost as f64, p)))
    };
    if allowed && cost > 0 {
        store_bucket(entry, p, now, tokens, gb);
    }
    Ok(AcquireReply {
        allowed,
        remaining: tokens.floor().max(0.0) as u64,
        reset_after_us: bucket_reset(p, tokens).max(0.0) as u64,
        retry_after_us: retry,
        now_us: now,
        level: (tokens * LEVEL_SCALE).ceil().max(0.0) as u64,
        given_back: gb.unwrap_or(0),
    })
}

fn lease(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &LeaseCall,
) -> Result<LeaseReply, Error> {
    let Bucket {
        kept,
        ts,
        mut tokens,
        gb,
    } = bucket_tokens(entry, p, now, &call.key)?;
    let burst = p.burst as f64;
    let debt = call.debt as f64;
    // (The script is sent at least 1.)
    let need = (call.need.max(1) as f64).min(burst);
    let mut uncovered = 0.0;
    if debt > 0.0 {
        uncovered = (debt - tokens.max(0.0)).max(0.0);
        tokens = (tokens - debt).max(-burst);
    }
    let granted = bucket::grant(tokens.floor().max(0.0), call, burst);
    tokens -= granted;
    let reset = bucket_reset(p, tokens);
    let written = granted > 0.0 || debt > 0.0;
    let gb = if written {
        let gb = gb.unwrap_or(now);
        store_bucket(entry, p, now, tokens, Some(gb));
        Some(gb)
    } else {
        gb
    };
    // From the state the key keeps: what was written now, else as it was.
    let retry = match (granted == 0.0, written) {
        (false, _) => 0,
        (true, true) => refill_wait(tokens, now, now, need, p).max(1),
        (true, false) => refill_wait(kept, ts, now, need, p).max(1),
    };
    Ok(LeaseReply {
        granted: granted as u64,
        remaining: tokens.floor().max(0.0) as u64,
        start_after_us: 0,
        reset_after_us: reset.max(0.0) as u64,
        retry_after_us: retry,
        now_us: now,
        uncovered: uncovered.ceil() as u64,
        window: 0,
        level: (tokens * LEVEL_SCALE).ceil().max(0.0) as u64,
        given_back: gb.unwrap_or(0),
    })
}

/// The bucket branch of `give_back.lua`.
fn give_back(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &GiveBackCall,
) -> Result<u64, Error> {
    let returned = call.returned as f64;
    let burst = p.burst as f64;

    let Bucket { tokens, gb, .. } = bucket_tokens(entry, p, now, &call.key)?;
    let Some(peak) = bucket::peak(p, call.origin, gb, now) else {
        return Ok(0);
    };
    let back = returned
        .min(burst - tokens)
        .min(burst - peak)
        .max(0.0)
        .floor();
    if back <= 0.0 {
        return Ok(0);
    }
    if let Some(e) = entry {
        e.state = State::Bucket {
            tokens: tokens + back,
            ts: now,
            gb: Some(gb.unwrap_or(0) + back as u64),
        };
    }
    Ok(back as u64)
}
