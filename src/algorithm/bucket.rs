//! What the two bucket algorithms (token bucket and GCRA) share: hybrid
//! leases drawn from a refilling bucket, valid for the lease horizon, and
//! given back capped by how full the bucket may have been meanwhile.

use super::calls::{GiveBackCall, LeaseCall, LeaseOrigin, Params};
use super::{Arg, LeaseTarget, LeaseView};
use crate::error::Error;
use crate::quota::{Quota, MAX_PERIOD};

/// The bucket lease scripts' ARGV (both take the same).
pub(crate) fn lease_args(p: &Params, c: &LeaseCall, args: &mut Vec<Arg>) {
    args.extend([
        Arg::Uint(p.limit),
        Arg::Uint(p.period_us),
        Arg::Uint(p.burst),
        Arg::Uint(c.want),
        Arg::Float(c.share_cap),
        Arg::Uint(c.debt),
        Arg::Uint(c.need.max(1)),
        Arg::Uint(c.ceiling),
    ]);
}

/// `give_back.lua`'s ARGV for a bucket of `layout` ("tb", "gc").
pub(crate) fn give_back_args(
    layout: &'static str,
    p: &Params,
    c: &GiveBackCall,
    args: &mut Vec<Arg>,
) {
    args.extend([
        Arg::Text(layout.into()),
        Arg::Uint(p.limit),
        Arg::Uint(p.period_us),
        Arg::Uint(p.burst),
        Arg::Uint(c.returned),
        Arg::Uint(c.origin.at_us),
        Arg::Uint(c.origin.level),
        Arg::Uint(c.origin.given_back),
        Arg::Uint(u64::from(c.refund)),
        Arg::Uint(c.remember_us / 1000),
    ]);
}

/// The exact scripts' ARGV (both take the same).
pub(crate) fn exact_args(p: &Params, cost: u64, args: &mut Vec<Arg>) {
    args.extend([
        Arg::Uint(p.limit),
        Arg::Uint(p.period_us),
        Arg::Uint(p.burst),
        Arg::Uint(cost),
    ]);
}

/// A bucket must refill from empty within [`MAX_PERIOD`], so every time
/// and TTL its scripts compute stays an exact integer (far below 2^53 µs)
/// and no key is ever written without a TTL.
pub(crate) fn check_quota(name: &str, quota: &Quota) -> Result<(), Error> {
    let fill_us = u128::from(quota.burst()) * u128::from(quota.period_us())
        / u128::from(quota.limit().max(1));
    if fill_us > MAX_PERIOD.as_micros() {
        return Err(Error::invalid(format!(
            "a {name} bucket of burst {} refilled at {} per {:?} takes {:?} to fill; \
             the maximum is {MAX_PERIOD:?} (lower the burst or raise the rate)",
            quota.burst(),
            quota.limit(),
            quota.period(),
            std::time::Duration::from_micros(fill_us.min(u128::from(u64::MAX)) as u64),
        )));
    }
    Ok(())
}

/// A bucket lease asks no window; one near its horizon is renewed.
pub(crate) fn target(v: &LeaseView) -> LeaseTarget {
    LeaseTarget {
        min_window: -1,
        renew: v.valid && v.near_end,
        time_left_us: None,
    }
}

/// How full the bucket may have been since the lease of `origin`: its
/// level then, plus the refill since, plus what others gave back since
/// (`gb`, the key's give-back counter). `None`: the give-back is refused
/// (the key was recreated, or the origin is in the future).
pub(crate) fn peak(p: &Params, origin: LeaseOrigin, gb: Option<u64>, now: u64) -> Option<f64> {
    // A key no lease has written has no counter: nothing was given back
    // to it (an exact check's origin then says 0).
    let gb = gb.unwrap_or(0);
    if gb < origin.given_back || origin.at_us > now {
        return None;
    }
    let rate = p.limit as f64 / p.period_us as f64;
    let level = origin.level as f64 / LEVEL_SCALE;
    Some(level + (now - origin.at_us) as f64 * rate + (gb - origin.given_back) as f64)
}

/// A bucket's level travels in thousandths of a permit, rounded up (the
/// scripts' `level`, [`LeaseOrigin::level`]): rounded up to whole permits,
/// a lease that left 0.00001 in the bucket said 1, and a give-back capped
/// by that level plus the refill since refused the one permit it returned.
/// (A burst is at most `Quota::MAX_LIMIT`, 10^12: 10^15 thousandths, an
/// exact Lua number.)
pub(crate) const LEVEL_SCALE: f64 = 1000.0;

/// The grant rule of the token-bucket and GCRA lease scripts: nothing
/// below the waiting request's need, else `min(want, available, max(need,
/// share_cap × available))`.
pub(crate) fn grant(available: f64, call: &LeaseCall, burst: f64) -> f64 {
    let need = call.need as f64;
    if available < need.min(burst) {
        return 0.0;
    }
    let cap = need.max((available * call.share_cap).floor());
    let by_rate = (call.want as f64).min(available).min(cap);
    let roomy = (call.ceiling as f64).min((available * call.share_cap).floor());
    by_rate.max(roomy.min(available))
}
