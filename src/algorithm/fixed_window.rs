//! The fixed window: `limit` permits per epoch-aligned window of `period`,
//! the count reset at each boundary. The window scripts and mirrors
//! (`window`) with nothing carried between windows; hybrid leases are
//! window leases.

use super::window;
use super::{LeaseKind, Lua, Spec};

pub(super) static SPEC: Spec = Spec {
    name: "fixed-window",
    key_suffix: "fw",
    exact: Lua::new(
        "fixed_window",
        concat!(
            include_str!("../../lua/carry_fixed_window.lua"),
            include_str!("../../lua/window_check.lua"),
            include_str!("../../lua/check_one.lua")
        ),
    ),
    exact_all: Lua::new(
        "fixed_window_all",
        concat!(
            include_str!("../../lua/carry_fixed_window.lua"),
            include_str!("../../lua/window_check.lua"),
            include_str!("../../lua/check_all.lua")
        ),
    ),
    lease: Lua::new(
        "lease_fixed_window",
        concat!(
            include_str!("../../lua/carry_fixed_window.lua"),
            include_str!("../../lua/lease_window.lua")
        ),
    ),
    exact_args: window::exact_args,
    lease_args: window::lease_args,
    give_back_args: window::give_back_args,
    check_quota: |_| Ok(()),
    max_cost: |q| q.limit(),
    check: |entry, p, now, cost, key| window::check(entry, p, now, cost, key, RULE),
    lease_mirror: |entry, p, now, call| window::lease(entry, p, now, call, RULE),
    give_back: window::give_back,
    leases: LeaseKind::Window,
    pre_leases: true,
};

/// Windows are independent: nothing outside one counts against it, a full
/// window has room again when it ends, a window not begun has room from
/// its start, and the whole limit is free when the current window ends
/// (`lua/carry_fixed_window.lua`).
const RULE: window::Rule = window::Rule {
    carry: |_| 0,
    wait_for: |n, used, near, limit| {
        let start = near.target as u64 * near.period;
        if limit - used - n >= 0 && start > near.now {
            start - near.now
        } else {
            near.until_end()
        }
    },
    reset_after: |_, near| near.until_end(),
};
