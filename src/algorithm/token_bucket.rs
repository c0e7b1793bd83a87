//! The token bucket: `burst` tokens refilled continuously at `limit /
//! period`. One hash per key (tokens, timestamp, give-back counter);
//! hybrid leases are bucket leases.

use super::bucket;
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
            include_str!("../../lua/token_bucket.lua"),
            include_str!("../../lua/check_one.lua")
        ),
    ),
    exact_all: Lua::new(
        "token_bucket_all",
        concat!(
            include_str!("../../lua/token_bucket.lua"),
            include_str!("../../lua/check_all.lua")
        ),
    ),
    lease: Lua::new(
        "lease_token_bucket",
        include_str!("../../lua/lease_token_bucket.lua"),
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

/// Refilled tokens of a bucket entry (a missing entry is a full bucket),
/// and its give-back counter.
fn bucket_tokens(
    entry: &Option<Entry>,
    p: &Params,
    now: u64,
    key: &str,
) -> Result<(f64, Option<u64>), Error> {
    let (mut tokens, ts, gb) = match entry {
        None => (p.burst as f64, now, None),
        Some(Entry {
            state: State::Bucket { tokens, ts, gb },
            ..
        }) => (*tokens, *ts, *gb),
        Some(_) => return Err(wrong_type(key)),
    };
    if now > ts {
        tokens =
            (p.burst as f64).min(tokens + (now - ts) as f64 * p.limit as f64 / p.period_us as f64);
    }
    Ok((tokens, gb))
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
    let (mut tokens, gb) = bucket_tokens(entry, p, now, key)?;
    let (allowed, retry) = if cost > p.burst {
        (false, None)
    } else if cost == 0 || cost as f64 <= tokens {
        tokens -= cost as f64;
        (true, Some(0))
    } else {
        let r = ((cost as f64 - tokens) * p.period_us as f64 / p.limit as f64).ceil();
        (false, Some(r as u64))
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
        level: tokens.ceil().max(0.0) as u64,
        given_back: gb.unwrap_or(0),
    })
}

fn lease(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &LeaseCall,
) -> Result<LeaseReply, Error> {
    let (mut tokens, gb) = bucket_tokens(entry, p, now, &call.key)?;
    let burst = p.burst as f64;
    let debt = call.debt as f64;
    let need = call.need as f64;
    let mut uncovered = 0.0;
    if debt > 0.0 {
        uncovered = (debt - tokens.max(0.0)).max(0.0);
        tokens = (tokens - debt).max(-burst);
    }
    let granted = bucket::grant(tokens.floor().max(0.0), call, burst);
    tokens -= granted;
    let reset = bucket_reset(p, tokens);
    let gb = if granted > 0.0 || debt > 0.0 {
        let gb = gb.unwrap_or(now);
        store_bucket(entry, p, now, tokens, Some(gb));
        Some(gb)
    } else {
        gb
    };
    let patience = need.max(call.patience as f64).min(burst);
    let retry = if granted == 0.0 {
        ((patience - tokens) * p.period_us as f64 / p.limit as f64)
            .ceil()
            .max(1.0)
    } else {
        0.0
    };
    Ok(LeaseReply {
        granted: granted as u64,
        remaining: tokens.floor().max(0.0) as u64,
        start_after_us: 0,
        reset_after_us: reset.max(0.0) as u64,
        retry_after_us: retry as u64,
        now_us: now,
        uncovered: uncovered.ceil() as u64,
        window: 0,
        level: tokens.ceil().max(0.0) as u64,
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

    let (tokens, gb) = bucket_tokens(entry, p, now, &call.key)?;
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
