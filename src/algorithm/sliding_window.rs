//! The sliding-window counter (two adjacent fixed windows weighted by
//! overlap): a request is admitted while the current window's count plus
//! the previous window's, weighted by the share of it the trailing period
//! still covers, stays within the limit. The fixed window's layout under
//! its own key; hybrid leases are window leases whose carry is that
//! weighted count (see `lua/carry_sliding_window.lua` for the arithmetic
//! and why it is strict).

use super::window::{self, Neighbours};
use super::{LeaseKind, Lua, Spec};

pub(super) static SPEC: Spec = Spec {
    name: "sliding-window",
    key_suffix: "sw",
    exact: Lua::new(
        "sliding_window",
        concat!(
            include_str!("../../lua/carry_sliding_window.lua"),
            include_str!("../../lua/window_check.lua"),
            include_str!("../../lua/check_one.lua")
        ),
    ),
    exact_all: Lua::new(
        "sliding_window_all",
        concat!(
            include_str!("../../lua/carry_sliding_window.lua"),
            include_str!("../../lua/window_check.lua"),
            include_str!("../../lua/check_all.lua")
        ),
    ),
    lease: Lua::new(
        "lease_sliding_window",
        concat!(
            include_str!("../../lua/carry_sliding_window.lua"),
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
    pre_leases: false,
};

const RULE: window::Rule = window::Rule {
    carry,
    wait_for,
    reset_after,
};

/// `reset_after` of `lua/carry_sliding_window.lua`: once nothing counted
/// weighs any more.
fn reset_after(used: i64, near: &Neighbours) -> u64 {
    let end = |w: i64| (w as u64 * near.period).saturating_sub(near.now);
    if used > 0 {
        end(near.target + 2)
    } else if near.before > 0 {
        end(near.target + 1)
    } else {
        0
    }
}

/// µs of the target window still ahead of `now`, at most a period: the
/// previous window's weight, times the period.
fn weight_of(near: &Neighbours) -> f64 {
    let end = (near.target + 1) as f64 * near.period as f64;
    (end - near.now as f64).clamp(0.0, near.period as f64)
}

/// `carry` of `lua/carry_sliding_window.lua`.
fn carry(near: &Neighbours) -> i64 {
    let weighted = if near.before > 0 {
        (near.before as f64 * weight_of(near) / near.period as f64).ceil() as i64
    } else {
        0
    };
    weighted.max(near.after)
}

/// `wait_for` of `lua/carry_sliding_window.lua`.
fn wait_for(n: i64, used: i64, near: &Neighbours, limit: i64) -> u64 {
    let room = limit - used - n;
    let window_end = near.until_end();
    let start = (near.target as u64 * near.period)
        .saturating_sub(near.now)
        .max(1);
    if room < 0 || room < near.after {
        return window_end;
    }
    if near.before <= room {
        return start;
    }
    let period = near.period as f64;
    let at = (near.target + 1) as f64 * period - room as f64 * period / near.before as f64;
    let wait = (at - near.now as f64).ceil();
    (wait.min(window_end as f64).max(start as f64)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;
    use crate::algorithm::{Entry, Params};
    use crate::quota::Quota;
    use std::time::Duration;

    fn fresh() -> (Option<Entry>, Params) {
        let quota = Quota::new(10, Duration::from_secs(1)).unwrap();
        (None, Params::new(&quota, Algorithm::SlidingWindow))
    }

    #[test]
    fn the_previous_window_fades_as_the_trailing_period_leaves_it() {
        let (mut e, p) = fresh();
        let t0 = 1_000_000_000; // a window start
        for _ in 0..10 {
            assert!(
                (SPEC.check)(&mut e, &p, t0 + 900_000, 1, "k")
                    .unwrap()
                    .allowed
            );
        }
        let denied = (SPEC.check)(&mut e, &p, t0 + 950_000, 1, "k").unwrap();
        assert!(!denied.allowed);
        // The next window starts with the previous count at weight 1: room
        // for one permit once a tenth of it has passed.
        assert_eq!(denied.retry_after_us, Some(50_000 + 100_000));
        assert!(
            !(SPEC.check)(&mut e, &p, t0 + 1_099_999, 1, "k")
                .unwrap()
                .allowed
        );
        assert!(
            (SPEC.check)(&mut e, &p, t0 + 1_100_000, 1, "k")
                .unwrap()
                .allowed
        );
        assert!(
            !(SPEC.check)(&mut e, &p, t0 + 1_100_000, 1, "k")
                .unwrap()
                .allowed
        );
        // Halfway through, half the old count still weighs: 5 + 1 used.
        let r = (SPEC.check)(&mut e, &p, t0 + 1_500_000, 0, "k").unwrap();
        assert_eq!(r.remaining, 4);
        // Two windows on, the first no longer counts; the second's one
        // permit weighs whole at its successor's start.
        let r = (SPEC.check)(&mut e, &p, t0 + 2_000_000, 0, "k").unwrap();
        assert_eq!(r.remaining, 9);
    }

    #[test]
    fn a_cost_above_the_limit_is_never_admissible() {
        let (mut e, p) = fresh();
        let r = (SPEC.check)(&mut e, &p, 5_000_000, 11, "k").unwrap();
        assert_eq!((r.allowed, r.retry_after_us), (false, None));
        assert!(e.is_none(), "a refused request writes nothing");
    }

    #[test]
    fn a_pre_leased_next_window_counts_against_the_current_one() {
        let near = Neighbours {
            before: 0,
            after: 7,
            target: 3,
            now: 3_500_000,
            period: 1_000_000,
        };
        assert_eq!(carry(&near), 7);
        // Leasing the next window ahead: the current count at weight 1.
        let ahead = Neighbours {
            before: 6,
            after: 0,
            target: 4,
            ..near
        };
        assert_eq!(carry(&ahead), 6);
    }
}
