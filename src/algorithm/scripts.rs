//! The algorithms' scripts as [`Script`]s: an exact check, a check of
//! several quotas at once, a hybrid lease and a give-back. Each names its
//! Lua (by the algorithm's [`Spec`](super::Spec)), its arguments, its
//! reply and its mirror over the memory store's [`Entry`] values; the
//! arithmetic of each mirror lives in the algorithm's own file.

use super::calls::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, Params, Refunded};
use super::state::{Entry, State};
use super::{Arg, GIVE_BACK};
use crate::error::Error;
use crate::store::{bad_reply, Call, Lua, Memory, Script};

/// How long a report's identity is remembered (the scripts' 60 s).
const OP_TTL_US: u64 = 60_000_000;

/// Runs `f` on the live entry of `key` (None if absent or expired) and
/// writes back what it leaves.
fn with_entry<R>(memory: &mut Memory<'_>, key: &str, f: impl FnOnce(&mut Option<Entry>) -> R) -> R {
    let mut live = memory.take::<Entry>(key);
    let out = f(&mut live);
    if let Some(entry) = live {
        let expires = entry.expires_us;
        memory.set(key, entry, expires);
    }
    out
}

/// A copy of `key`'s live entry, to decide on without writing.
fn peek_entry(memory: &mut Memory<'_>, key: &str) -> Option<Entry> {
    memory.get::<Entry>(key).map(|e| e.clone())
}

/// Runs a report under its identity key, as the scripts do: `f` learns
/// the first answer if this is a second delivery, and returns what to
/// remember (if anything) for `keep_us` µs.
fn once<R>(
    memory: &mut Memory<'_>,
    op: Option<String>,
    keep_us: u64,
    f: impl FnOnce(&mut Memory<'_>, Option<u64>) -> Result<(R, Option<u64>), Error>,
) -> Result<R, Error> {
    let Some(op) = op else {
        return f(memory, None).map(|(r, _)| r);
    };
    let seen = memory.get::<u64>(&op).copied();
    let (reply, remember) = f(memory, seen)?;
    if let Some(value) = remember {
        let until = memory.now_us() + keep_us;
        memory.set(&op, value, until);
    }
    Ok(reply)
}

impl AcquireReply {
    /// The integers the check script replies.
    pub(crate) fn to_values(self) -> Vec<i64> {
        vec![
            i64::from(self.allowed),
            self.remaining as i64,
            self.reset_after_us as i64,
            self.retry_after_us.map_or(-1, |r| r as i64),
            self.now_us as i64,
            self.level as i64,
            self.given_back as i64,
        ]
    }
}

impl LeaseReply {
    /// The integers the lease script replies.
    pub(crate) fn to_values(self) -> Vec<i64> {
        vec![
            self.granted as i64,
            self.remaining as i64,
            self.start_after_us as i64,
            self.reset_after_us as i64,
            self.retry_after_us as i64,
            self.now_us as i64,
            self.uncovered as i64,
            self.window,
            self.level as i64,
            self.given_back as i64,
        ]
    }
}

/// One exact check-and-count of a request of `cost` on `key`.
#[derive(Debug)]
pub(crate) struct Check<'a> {
    pub(crate) key: &'a str,
    pub(crate) params: &'a Params,
    pub(crate) cost: u64,
}

impl Call for Check<'_> {
    fn lua(&self) -> &'static Lua {
        &self.params.algorithm.spec().exact
    }

    fn key(&self) -> &str {
        self.key
    }

    fn args(&self, args: &mut Vec<Arg>) {
        (self.params.algorithm.spec().exact_args)(self.params, self.cost, args);
    }

    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        let check = self.params.algorithm.spec().check;
        let now = memory.now_us();
        with_entry(memory, self.key, |entry| {
            check(entry, self.params, now, self.cost, self.key)
        })
        .map(AcquireReply::to_values)
    }
}

impl Script for Check<'_> {
    type Reply = AcquireReply;

    fn parse(&self, values: Vec<i64>) -> Result<AcquireReply, Error> {
        AcquireReply::from_values(&values)
    }
}

/// Several quotas of one key, all-or-nothing, in one call (see
/// `lua/check_all.lua`). Every key shares one hash tag.
#[derive(Debug)]
pub(crate) struct CheckAll<'a> {
    pub(crate) keys: &'a [String],
    pub(crate) params: &'a [Params],
    pub(crate) cost: u64,
}

impl Call for CheckAll<'_> {
    fn lua(&self) -> &'static Lua {
        &self.params[0].algorithm.spec().exact_all
    }

    fn key(&self) -> &str {
        &self.keys[0]
    }

    fn more_keys(&self, keys: &mut Vec<String>) {
        keys.extend(self.keys[1..].iter().cloned());
    }

    fn args(&self, args: &mut Vec<Arg>) {
        let spec = self.params[0].algorithm.spec();
        let mut each = Vec::with_capacity(4 * self.params.len());
        let mut width = 0;
        for p in self.params {
            let before = each.len();
            (spec.exact_args)(p, self.cost, &mut each);
            width = each.len() - before;
        }
        args.push(Arg::Uint(self.keys.len() as u64));
        args.push(Arg::Uint(width as u64));
        args.extend(each);
    }

    /// Each quota is decided without writing, then counted only if every
    /// one admits.
    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        let now = memory.now_us();
        let mut replies = Vec::with_capacity(self.keys.len());
        for (key, p) in self.keys.iter().zip(self.params) {
            let check = p.algorithm.spec().check;
            replies.push(check(&mut peek_entry(memory, key), p, now, self.cost, key)?);
        }
        let admitted = replies.iter().all(|r| r.allowed);
        for (i, (key, p)) in self.keys.iter().zip(self.params).enumerate() {
            let check = p.algorithm.spec().check;
            if admitted {
                replies[i] = with_entry(memory, key, |entry| check(entry, p, now, self.cost, key))?;
            } else if replies[i].allowed {
                // Nothing is taken: a quota with room reports it untouched,
                // as a peek would.
                replies[i] = check(&mut peek_entry(memory, key), p, now, 0, key)?;
            }
        }
        Ok(replies
            .into_iter()
            .flat_map(AcquireReply::to_values)
            .collect())
    }
}

impl Script for CheckAll<'_> {
    type Reply = Vec<AcquireReply>;

    fn parse(&self, values: Vec<i64>) -> Result<Vec<AcquireReply>, Error> {
        if values.len() != super::CHECK_REPLY_LEN * self.keys.len() {
            return Err(bad_reply(self.lua(), &values));
        }
        values
            .chunks(super::CHECK_REPLY_LEN)
            .map(AcquireReply::from_values)
            .collect()
    }
}

/// A hybrid lease (and debt report) on a key.
#[derive(Debug)]
pub(crate) struct Lease<'a> {
    pub(crate) params: &'a Params,
    pub(crate) call: &'a LeaseCall,
}

impl Lease<'_> {
    /// The debt report's identity key, when the call reports debt.
    fn op_key(&self) -> Option<String> {
        self.call
            .op
            .filter(|_| self.call.debt > 0)
            .map(|op| op.key_for(&self.call.key))
    }
}

impl Call for Lease<'_> {
    fn lua(&self) -> &'static Lua {
        &self.params.algorithm.spec().lease
    }

    fn key(&self) -> &str {
        &self.call.key
    }

    fn more_keys(&self, keys: &mut Vec<String>) {
        keys.extend(self.op_key());
    }

    fn args(&self, args: &mut Vec<Arg>) {
        (self.params.algorithm.spec().lease_args)(self.params, self.call, args);
    }

    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        let now = memory.now_us();
        let lease = self.params.algorithm.spec().lease_mirror;
        let reply = once(memory, self.op_key(), OP_TTL_US, |memory, seen| {
            let mut call = self.call.clone();
            if seen.is_some() {
                call.debt = 0;
            }
            let mut reply = with_entry(memory, &call.key, |entry| {
                lease(entry, self.params, now, &call)
            })?;
            if let Some(uncovered) = seen {
                reply.uncovered = uncovered;
            }
            Ok((reply, (call.debt > 0).then_some(reply.uncovered)))
        })?;
        Ok(reply.to_values())
    }
}

impl Script for Lease<'_> {
    type Reply = LeaseReply;

    fn parse(&self, values: Vec<i64>) -> Result<LeaseReply, Error> {
        LeaseReply::from_values(&values)
    }
}

/// Added by `lua/give_back.lua` to the first answer when a refund's
/// identity was seen before; decoded by [`GiveBack`]'s `parse` alone.
const REPEAT: i64 = 1 << 52;

/// Unused permits given back (`lua/give_back.lua`, one script for every
/// layout); replies the permits the store took back.
#[derive(Debug)]
pub(crate) struct GiveBack<'a> {
    pub(crate) params: &'a Params,
    pub(crate) call: &'a GiveBackCall,
}

impl Call for GiveBack<'_> {
    fn lua(&self) -> &'static Lua {
        &GIVE_BACK
    }

    fn key(&self) -> &str {
        &self.call.key
    }

    fn more_keys(&self, keys: &mut Vec<String>) {
        keys.push(self.call.op.key_for(&self.call.key));
    }

    fn args(&self, args: &mut Vec<Arg>) {
        (self.params.algorithm.spec().give_back_args)(self.params, self.call, args);
    }

    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        let now = memory.now_us();
        let call = self.call;
        let remember = call.remember_us.max(OP_TTL_US);
        let repeat = if call.refund { REPEAT } else { 0 };
        let op = Some(call.op.key_for(&call.key));
        let back = once(memory, op, remember, |memory, seen| match seen {
            Some(back) => Ok((back + repeat as u64, None)),
            None => {
                let give_back = self.params.algorithm.spec().give_back;
                let back = with_entry(memory, &call.key, |entry| {
                    // A key that does not exist gets nothing back,
                    // whatever its layout (`give_back.lua`'s EXISTS).
                    if entry.is_none() {
                        return Ok(0);
                    }
                    give_back(entry, self.params, now, call)
                })?;
                Ok((back, Some(back)))
            }
        })?;
        Ok(vec![back as i64])
    }
}

impl Script for GiveBack<'_> {
    type Reply = Refunded;

    fn parse(&self, values: Vec<i64>) -> Result<Refunded, Error> {
        match values.as_slice() {
            [n] if self.call.refund && *n >= REPEAT => Ok(Refunded::Already((n - REPEAT) as u64)),
            [n] => Ok(Refunded::Now((*n).max(0) as u64)),
            _ => Err(bad_reply(self.lua(), &values)),
        }
    }
}

/// Permits counted in window `window` of a window algorithm's `key`, if
/// the key lives (what a test would `HGET` of the Redis hash).
pub(crate) fn count_in_window(memory: &mut Memory<'_>, key: &str, window: i64) -> Option<i64> {
    match &memory.get::<Entry>(key)?.state {
        State::Window(w) => w.iter().find(|(i, _)| *i == window).map(|(_, c)| *c),
        _ => None,
    }
}

#[cfg(test)]
mod parity {
    //! The lease script (grants, what remains, the window leased) on a
    //! private `redis-server` and its mirror on the embedded store.

    use std::sync::Arc;
    use std::time::Duration;

    use super::Lease;
    use crate::algorithm::{Algorithm, LeaseCall, LeaseReply, Params};
    use crate::quota::Quota;
    use crate::stats::Counters;

    fn call(holder: &str, want: u64, ceiling: u64, next: bool, lease_id: u64) -> LeaseCall {
        LeaseCall {
            want,
            share_cap: 0.5,
            min_window: if next { i64::MAX } else { -1 },
            holder: Some(Arc::from(holder)),
            ceiling,
            lease_id,
            ..LeaseCall::nothing("sl:{parity}:fw".to_owned())
        }
    }

    /// The fields that do not depend on where in its window the clock reads.
    fn shape(r: &LeaseReply, first_window: i64) -> (u64, u64, u64, i64) {
        (r.granted, r.remaining, r.uncovered, r.window - first_window)
    }

    #[tokio::test]
    async fn the_lease_script_and_the_embedded_store_agree_on_shares() {
        // A window of 30 days: both stores are in the same one, whatever the
        // milliseconds between their clocks.
        let (_server, redis, memory) = crate::store::parity::both_stores().await;
        let quota = Quota::new(1_000, Duration::from_secs(30 * 86_400)).unwrap();
        let params = Params::new(&quota, Algorithm::FixedWindow);
        let counters = Counters::new("parity");
        // Four holders' first leases in a window nobody held before, their
        // second asks (short of a quarter each), a lost reply sent again, the
        // next window leased ahead, and asks of a window fully leased.
        // Peeks in between take and record nothing: the calls after them are
        // answered as if they had not been made.
        let peek = |next: bool| {
            let c = call("", 0, 0, next, 0);
            LeaseCall::peek(c.key, c.min_window)
        };
        // A thin holder's lease of the next window ahead of need: granted up
        // to the cap while the key is far under its limit, nothing once the
        // current window holds more than the cap.
        let thin = |holder: &str, want: u64, cap: u64| LeaseCall {
            ahead_cap: cap,
            ..call(holder, want, want, true, 1)
        };
        let mut calls = vec![peek(false), thin("t", 3, 500), thin("u", 5, 4)];
        for (i, h) in ["a", "b", "c", "d"].iter().enumerate() {
            calls.push(call(h, 1, 31 + i as u64, false, 1));
        }
        calls.push(peek(false));
        for h in ["a", "b", "c", "d"] {
            calls.push(call(h, 900, 900, false, 2));
        }
        calls.push(peek(false));
        calls.push(peek(true));
        calls.push(call("b", 900, 900, false, 2));
        for (i, h) in ["c", "a", "b", "d"].iter().enumerate() {
            calls.push(call(h, 600 - 100 * i as u64, 900, true, 3));
        }
        calls.push(call("a", 50, 900, false, 4));
        calls.push(call("e", 10, 10, true, 1));
        calls.push(peek(true));
        calls.push(thin("v", 3, 500));
        let mut first_window = None;
        for (n, c) in calls.iter().enumerate() {
            let mut replies = Vec::new();
            for store in [&redis, &memory] {
                let lease = Lease {
                    params: &params,
                    call: c,
                };
                let (result, _) = store
                    .run_batch_counted(std::slice::from_ref(&lease), 1, &counters)
                    .await;
                let reply = result.expect("answered").remove(0).expect("leased");
                let w = *first_window.get_or_insert(reply.window);
                replies.push(shape(&reply, w));
            }
            assert_eq!(
                replies[0], replies[1],
                "call {n} ({c:?}): Redis (left) and the embedded store disagree"
            );
        }
    }
}
