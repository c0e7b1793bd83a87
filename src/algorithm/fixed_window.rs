//! The fixed window: `limit` permits per epoch-aligned window of `period`,
//! the count reset at each boundary. One hash per key (field = window
//! index); hybrid leases are window leases with no carry.

use super::calls::{AcquireReply, Params};
use super::state::{ceil_ms_to_us, count_in, incr_window, trim_and_expire, windows, Entry};
use super::window;
use super::{Arg, LeaseKind, Lua, Spec};
use crate::Error;

pub(super) static SPEC: Spec = Spec {
    name: "fixed-window",
    key_suffix: "fw",
    exact: Lua {
        name: "fixed_window",
        source: include_str!("../../lua/fixed_window.lua"),
    },
    lease: Lua {
        name: "lease_fixed_window",
        source: concat!(
            include_str!("../../lua/carry_fixed_window.lua"),
            include_str!("../../lua/lease_window.lua")
        ),
    },
    exact_args,
    lease_args: window::lease_args,
    give_back_args: window::give_back_args,
    check_quota: |_| Ok(()),
    max_cost: |q| q.limit(),
    check,
    lease_mirror: |entry, p, now, call| window::lease(entry, p, now, call, RULE),
    give_back: window::give_back,
    leases: LeaseKind::Window,
};

/// `lua/fixed_window.lua`'s ARGV.
fn exact_args(p: &Params, cost: u64, args: &mut Vec<Arg>) {
    args.extend([Arg::Uint(p.limit), Arg::Uint(p.period_us), Arg::Uint(cost)]);
}

/// Windows are independent: nothing outside one counts against it, and a
/// full window has room again when it ends (`lua/carry_fixed_window.lua`).
const RULE: window::Rule = window::Rule {
    carry: |_| 0,
    wait_for: |_, _, near, _| near.until_end(),
};

/// Every `u64` cost is compared as the scripts compare it: a cost the
/// quota can never hold is denied before any arithmetic sees it.
fn check(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    cost: u64,
    key: &str,
) -> Result<AcquireReply, Error> {
    let limit = p.limit as i64;
    let period = p.period_us;
    let w = (now / period) as i64;
    let mut used = count_in(windows(entry, key)?, w);
    let reset = (w as u64 + 1) * period - now;
    let (allowed, retry) = if cost > p.limit {
        (false, None)
    } else if cost == 0 || used + cost as i64 <= limit {
        if cost > 0 {
            used = incr_window(entry, w, cost as i64);
            trim_and_expire(entry, w, now, ceil_ms_to_us((reset + period) as f64));
        }
        (true, Some(0))
    } else {
        (false, Some(reset))
    };
    Ok(AcquireReply {
        allowed,
        remaining: (limit - used).max(0) as u64,
        reset_after_us: reset,
        retry_after_us: retry,
        now_us: now,
    })
}
