//! What the two window algorithms (fixed and sliding) share: a budget
//! counted per epoch-aligned window in one hash (field = window index),
//! leases that belong to one window and end with it, and give-backs to
//! the window they came from.
//!
//! The lease script (`lua/lease_window.lua`) and its mirror here differ
//! between the two only by the *carry*: permits outside the target
//! window that count against it (none for the fixed window; the previous
//! window's weighted count, or the next window's pre-leases, for the
//! sliding one). Nothing here knows which algorithm it serves.

use super::calls::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, Params};
use super::state::{ceil_ms_to_us, count_in, incr_window, trim_and_expire, windows, Entry, State};
use super::{Arg, LeaseTarget, LeaseView};
use crate::error::Error;

/// What a carry is computed from: the counts next to the target window.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Neighbours {
    /// Permits counted in the window before the target.
    pub(crate) before: i64,
    /// Permits counted in the window after the target.
    pub(crate) after: i64,
    /// The target window's index.
    pub(crate) target: i64,
    /// Store time (µs).
    pub(crate) now: u64,
    pub(crate) period: u64,
}

/// What makes one window algorithm differ from another (the carry file
/// in front of `lua/lease_window.lua`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rule {
    /// Permits outside the target window that count against it.
    pub(crate) carry: fn(&Neighbours) -> i64,
    /// µs from now until `n` more permits fit in the target window, whose
    /// own count is `used`, with the limit `limit`, all else equal.
    pub(crate) wait_for: fn(n: i64, used: i64, near: &Neighbours, limit: i64) -> u64,
    /// µs from now until the whole limit is free again, the current window
    /// (`near.target`) having counted `used`.
    pub(crate) reset_after: fn(used: i64, near: &Neighbours) -> u64,
}

impl Rule {
    /// µs from now until `n` more permits fit in the target window (whose
    /// own count is `used`): if its own count (with the next window's)
    /// leaves no room, from the next window on, where its count is the
    /// one that fades and what that window holds already (pre-leased) is
    /// its own count; else within it.
    fn wait(&self, n: i64, used: i64, near: &Neighbours, limit: i64) -> u64 {
        if used + n + near.after > limit {
            let next = Neighbours {
                before: used,
                after: 0,
                target: near.target + 1,
                ..*near
            };
            (self.wait_for)(n, near.after, &next, limit)
        } else {
            (self.wait_for)(n, used, near, limit)
        }
    }
}

impl Neighbours {
    /// µs from now until the target window ends.
    pub(crate) fn until_end(&self) -> u64 {
        ((self.target + 1) as u64 * self.period).saturating_sub(self.now)
    }
}

/// The lease script's arguments after KEYS (see its header).
pub(crate) fn lease_args(p: &Params, c: &LeaseCall, args: &mut Vec<Arg>) {
    args.extend([
        Arg::Uint(p.limit),
        Arg::Uint(p.period_us),
        Arg::Uint(c.want),
        Arg::Float(c.share_cap),
        Arg::Uint(c.debt),
        Arg::Int(c.debt_window),
        Arg::Int(c.min_window),
        Arg::Uint(c.need.max(1)),
        Arg::Text(c.holder.as_deref().unwrap_or("").to_owned().into()),
        Arg::Uint(c.ceiling),
        Arg::Uint(c.lease_id),
        Arg::Uint(c.ahead_cap),
        Arg::Uint(c.cost.max(1)),
    ]);
}

/// `lua/window_check.lua`'s arguments after KEYS.
pub(crate) fn exact_args(p: &Params, cost: u64, args: &mut Vec<Arg>) {
    args.extend([Arg::Uint(p.limit), Arg::Uint(p.period_us), Arg::Uint(cost)]);
}

/// `give_back.lua`'s arguments for a window's permits.
pub(crate) fn give_back_args(p: &Params, c: &GiveBackCall, args: &mut Vec<Arg>) {
    args.extend([
        Arg::Text("w".into()),
        Arg::Uint(p.limit),
        Arg::Uint(p.period_us),
        Arg::Uint(p.burst),
        Arg::Uint(c.returned),
        Arg::Int(c.window),
        Arg::Uint(c.remember_us / 1000),
        Arg::Text(if c.refund { "1".into() } else { "0".into() }),
    ]);
}

fn neighbours(
    entry: &mut Option<Entry>,
    key: &str,
    target: i64,
    now: u64,
    period: u64,
) -> Result<Neighbours, Error> {
    Ok(Neighbours {
        before: count_in(windows(entry, key)?, target - 1),
        after: count_in(windows(entry, key)?, target + 1),
        target,
        now,
        period,
    })
}

/// The mirror of `lua/window_check.lua`, step for step.
pub(crate) fn check(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    cost: u64,
    key: &str,
    rule: Rule,
) -> Result<AcquireReply, Error> {
    let limit = p.limit as i64;
    let period = p.period_us;
    let w = (now / period) as i64;
    let near = Neighbours {
        before: count_in(windows(entry, key)?, w - 1),
        after: count_in(windows(entry, key)?, w + 1),
        target: w,
        now,
        period,
    };
    let mut used = count_in(windows(entry, key)?, w);
    let extra = (rule.carry)(&near);
    let (allowed, retry) = if cost > p.limit {
        (false, None)
    } else if cost == 0 || used + extra + cost as i64 <= limit {
        if cost > 0 {
            used = incr_window(entry, w, cost as i64);
            let ttl = ((w as u64 + 2) * period - now) as f64;
            trim_and_expire(entry, w, now, ceil_ms_to_us(ttl));
        }
        (true, Some(0))
    } else {
        (false, Some(rule.wait(cost as i64, used, &near, limit)))
    };
    let reset = (rule.reset_after)(used, &near);
    Ok(AcquireReply {
        allowed,
        remaining: (limit - used - extra).max(0) as u64,
        reset_after_us: reset,
        retry_after_us: retry,
        now_us: now,
        level: 0,
        given_back: 0,
    })
}

/// A holder's standing in the window it leases from, for its fair share
/// (see [`share_of`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Standing {
    /// Its first ask in the window.
    pub(crate) joined: bool,
    /// Holders that asked in the window, and the most expected in it.
    pub(crate) here: i64,
    pub(crate) expected: i64,
    /// What it was granted of the window so far.
    pub(crate) mine: i64,
}

/// `share_of` of `lua/lease_window.lua`: what one lease is granted of the
/// `available` permits of its window. At most `share_cap` of them, or the
/// last `need` whole; with a holder's standing, at least its fair share
/// among the holders expected (and, asking again short of its share of
/// the whole window where no carry counts, what it is short of), at most
/// its ceiling.
pub(crate) fn share_of(
    available: i64,
    extra: i64,
    limit: i64,
    call: &LeaseCall,
    standing: Option<Standing>,
) -> i64 {
    let tail = call.need.max(1) as i64;
    let ceiling = call.ceiling.min(i64::MAX as u64) as i64;
    let cap = ((available as f64 * call.share_cap).floor() as i64)
        .max(1)
        .max(available.min(tail));
    let granted = (call.want as i64).min(available).min(cap);
    let Some(s) = standing else {
        return granted;
    };
    let fair = if s.joined {
        available / (s.expected - s.here).max(1)
    } else {
        available / s.expected.max(1)
    };
    let entitled = if !s.joined && extra == 0 {
        (limit / s.expected.max(1) - s.mine).max(0)
    } else {
        0
    };
    let whole = if available <= tail {
        available.min(ceiling)
    } else {
        0
    };
    let granted = granted.min(fair.max(1).max(whole));
    // The last holder expected takes what is left, not share_cap of it.
    let capped = if s.joined && s.expected - s.here == 1 {
        fair
    } else {
        fair.min((available as f64 * call.share_cap).floor() as i64)
    };
    let fair = capped.max(entitled.min(available)).min(ceiling);
    if fair > granted {
        fair.min(available)
    } else {
        granted
    }
}

/// The mirror of `lua/lease_window.lua`, step for step.
pub(crate) fn lease(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &LeaseCall,
    rule: Rule,
) -> Result<LeaseReply, Error> {
    let limit = p.limit as i64;
    let period = p.period_us;
    let w = (now / period) as i64;
    windows(entry, &call.key)?;
    let mut newest = w;
    let mut uncovered = 0i64;
    let debt = call.debt as i64;
    let debt_window = if call.debt_window < 0 {
        w
    } else {
        call.debt_window
    };
    // A window's count was created: the key's TTL may need to grow.
    let mut created = false;
    if debt > 0 {
        if debt_window >= w - 1 && debt_window <= w + 1 {
            let extra = (rule.carry)(&neighbours(entry, &call.key, debt_window, now, period)?);
            let counted = count_in(windows(entry, &call.key)?, debt_window);
            created = counted == 0;
            let before = counted + extra;
            let after = incr_window(entry, debt_window, debt) + extra;
            uncovered = (after - limit).max(0) - (before - limit).max(0);
            newest = newest.max(debt_window);
        } else {
            uncovered = debt;
        }
    }
    let mut tw = w.max(call.min_window).min(w + 1);
    let recorded = call.want > 0 && call.lease_id != 0 && call.holder.is_some();
    // A second delivery of a lease whose reply was lost: its grant again.
    let last_grant = call
        .holder
        .as_deref()
        .and_then(|h| entry.as_ref()?.holders.as_deref()?.grant(h));
    let replay = last_grant
        .filter(|_| recorded)
        .filter(|&(id, _, _, window)| id == call.lease_id && window >= w);
    if let Some((_, _, _, window)) = replay {
        tw = window;
    }
    // All the holder was granted in the target window.
    let mine = |tw: i64| last_grant.filter(|g| g.3 == tw).map_or(0, |g| g.2);
    let near = neighbours(entry, &call.key, tw, now, period)?;
    let extra = (rule.carry)(&near);
    let mut used = count_in(windows(entry, &call.key)?, tw) + extra;
    let available = (limit - used).max(0);
    // Asked with nothing left, the key exists (and has its TTL): the asker
    // is counted all the same, so holders reflect demand.
    let mut joined = false;
    let mut granted = if let Some((_, permits, _, _)) = replay {
        permits
    } else {
        let standing = match (&call.holder, call.want > 0) {
            (Some(holder), true) => {
                let holders = entry.as_ref().and_then(|e| e.holders.as_deref());
                let here = holders.map_or(0, |h| h.count(tw)) as i64;
                let before = holders.map_or(0, |h| h.count(tw - 1)) as i64;
                joined = holders.map_or(-1, |h| h.last(holder)) < tw;
                Some(Standing {
                    joined,
                    here,
                    expected: here.max(before),
                    mine: mine(tw),
                })
            }
            _ => None,
        };
        share_of(available, extra, limit, call, standing)
    };
    // A thin holder's pre-lease, only while the key is far under its
    // limit: the current window's count, and every holder's ask, within
    // the cap (as the script).
    let ahead_cap = call.ahead_cap.min(i64::MAX as u64) as i64;
    if replay.is_none() && ahead_cap > 0 && tw > w {
        let busy = i128::from(near.before) > i128::from(ahead_cap);
        let holders = entry
            .as_ref()
            .and_then(|e| e.holders.as_deref())
            .map_or(0, |h| h.count(tw).max(h.count(tw - 1)))
            .max(1) as i128;
        let crowded = holders * i128::from(call.want) > i128::from(ahead_cap);
        granted = if busy || crowded {
            0
        } else {
            granted.min(ahead_cap - used).max(0)
        };
        // Refused, the ask is not a holder of the next window.
        if granted == 0 {
            joined = false;
        }
    }
    if joined {
        if let Some(holder) = &call.holder {
            // Counted when it asks, granted or not (as the script does);
            // the holders live in the entry, created here if need be.
            let e = entry.get_or_insert(Entry {
                state: State::Window(Vec::new()),
                expires_us: 0,
                holders: None,
            });
            e.holders
                .get_or_insert_with(Default::default)
                .joined(holder, tw);
        }
    }
    let fresh = granted > 0 && replay.is_none();
    let mut first_grant = false;
    if fresh {
        let count = incr_window(entry, tw, granted);
        first_grant = count == granted;
        if first_grant {
            if let Some(h) = entry.as_mut().and_then(|e| e.holders.as_mut()) {
                h.forget_before(w - 1);
            }
        }
        used = count + extra;
        newest = newest.max(tw);
    }
    if let (true, true, Some(holder)) = (fresh, recorded, &call.holder) {
        if let Some(e) = entry.as_mut() {
            e.holders
                .get_or_insert_with(Default::default)
                .granted(holder, (call.lease_id, granted, mine(tw) + granted, tw));
        }
    }
    // As the script: the TTL outlives the newest window counted by one
    // period, and grows only when a window's count was created (a holder's
    // first ask in a window it got nothing from leaves it as it was).
    if created || (fresh && first_grant) {
        let ttl = ((newest as u64 + 2) * period - now) as f64;
        trim_and_expire(entry, w, now, ceil_ms_to_us(ttl));
    }
    let start_after = (tw as u64 * period).saturating_sub(now);
    let reset = (tw as u64 + 1) * period - now;
    Ok(LeaseReply {
        granted: granted as u64,
        remaining: (limit - used).max(0) as u64,
        start_after_us: start_after,
        reset_after_us: reset,
        retry_after_us: if granted == 0 {
            rule.wait(call.cost.max(1) as i64, used - extra, &near, limit)
        } else {
            0
        },
        now_us: now,
        uncovered: uncovered as u64,
        window: tw,
        level: 0,
        given_back: 0,
    })
}

/// The window branch of `give_back.lua`: permits count back only to the
/// current window or the next (an ended window's are worthless).
pub(crate) fn give_back(
    entry: &mut Option<Entry>,
    p: &Params,
    now: u64,
    call: &GiveBackCall,
) -> Result<u64, Error> {
    let w = windows(entry, &call.key)?;
    if call.window < (now / p.period_us) as i64 {
        return Ok(0);
    }
    let used = count_in(w, call.window);
    let back = used.min(call.returned.min(i64::MAX as u64) as i64);
    if back > 0 {
        incr_window(entry, call.window, -back);
    }
    Ok(back.max(0) as u64)
}

/// Which window a lease call asks for: the slot's own while it lasts; the
/// next one ahead of the boundary (a pre-lease), unless it is held
/// already; once the slot's window is over (or about to be), the first
/// one that can still be current when the reply arrives.
pub(crate) fn target(v: &LeaseView) -> LeaseTarget {
    let at = |min_window, time_left_us| LeaseTarget {
        min_window,
        renew: false,
        time_left_us,
    };
    let Some(window) = v.window else {
        return at(-1, None);
    };
    if v.valid && !v.ending && !v.prelease {
        at(window, Some(v.left_us))
    } else if v.valid {
        if v.has_next {
            at(window, Some(v.left_us))
        } else {
            at(window + 1, Some(v.period_us))
        }
    } else {
        // The lease ended `since_us` ago: the store is in the window after
        // it, or later; a pre-lease asks for the one after that.
        let current = window + 1 + (v.since_us / v.period_us) as i64;
        at(current + i64::from(v.prelease), Some(v.period_us))
    }
}

/// The `need` a window lease sends (the script's `tail`): the last
/// sixteenth of a window's limit goes in one lease rather than a trickle
/// of ever smaller ones.
pub(crate) fn need(need: u64, limit: u64) -> u64 {
    need.max(limit / 16).max(1)
}
