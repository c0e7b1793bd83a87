//! Several quotas, or several keys, in one decision: all-or-nothing.
//!
//! A request is admitted only if every quota admits it, and then counts
//! against each; a denial counts against none. Takes are made one quota
//! after another and undone if a later one denies:
//!
//! - Local takes (leased permits, per-process counts) are made under the
//!   key's stripe lock, and undone under it too, so no other decision of
//!   the limiter sees one quota taken and another not.
//! - A take that needed the store is undone by a refund to its window. Until
//!   the refund lands, the quota has `cost` permits fewer than it should:
//!   a brief undershoot, never an overshoot (each quota alone never admits
//!   past its limit). A refund that arrives after its window ended is
//!   ignored and counted.
//! - A future dropped between two takes undoes the first in a task of its
//!   own (a drop guard), so a cancelled decision leaves nothing taken.
//!
//! `check_all` (in `all`) does the same across limiters and keys (a user
//! and the user's organisation), with `binding` and `spawn_refunds` from here.

use std::sync::Arc;

use crate::decision::Decision;
use crate::decision::{binding_denial, Origin, Taken};
use crate::lanes::Lanes;

/// The binding decision of several: a denial if any denied (the one with
/// the longest wait; "never" is longest), else the admission with the
/// fewest permits left. Keeps every part for [`Decision::quotas`]. A
/// denial's parts record nothing taken: the caller gave back what the
/// admitting parts took, so nothing is left for a refund to give.
pub(crate) fn binding(parts: Vec<Decision>) -> Decision {
    binding_named(parts, Vec::new())
}

/// [`binding`], each part named (pairs of `check_all`).
pub(crate) fn binding_named(parts: Vec<Decision>, names: Vec<Arc<str>>) -> Decision {
    let chosen = match binding_denial(&parts) {
        Some(i) => &parts[i],
        None => parts
            .iter()
            .min_by_key(|d| (d.remaining(), std::cmp::Reverse(d.reset_after())))
            .expect("at least one quota"),
    };
    chosen.clone().with_parts(parts, names)
}

/// The local, all-or-nothing decision over every quota of `inner`, or
/// `None` (nothing taken) if one of them needs the store.
pub(crate) fn check_now(lanes: &Arc<Lanes>, key: &str, cost: u64) -> Option<Decision> {
    let inner = &**lanes;
    let _stripe = inner.stripe(key);
    let count = 1 + inner.also.len();
    let mut parts = Vec::with_capacity(count);
    let mut denied = false;
    for index in 0..count {
        let Some(lane) = inner.lane(key, index) else {
            undo_now(lanes, key, &parts);
            return None;
        };
        match lane.check_now(key, cost) {
            Some(decision) => {
                denied |= !decision.is_allowed();
                parts.push(decision);
            }
            // A quota this process cannot decide alone: the store decides
            // them all, so a denial's hint is the binding quota's, not the
            // first one's to say no.
            None => {
                undo_now(lanes, key, &parts);
                return None;
            }
        }
    }
    // Every quota was asked, after a denial too: the client is told the
    // longest wait of those that denied (the one that binds).
    if denied {
        undo_now(lanes, key, &parts);
    }
    Some(binding(parts))
}

/// Undoes local takes under the stripe lock. A take that can no longer go
/// back locally (its lease just expired) goes back through the store.
fn undo_now(lanes: &Arc<Lanes>, key: &str, parts: &[Decision]) {
    let taken = parts
        .iter()
        .enumerate()
        .filter(|(_, part)| part.taken.refundable())
        .map(|(index, part)| (index, part.taken))
        .collect();
    give_back(lanes, key, taken);
}

/// Gives takes back: into the local leases at once, the rest through the
/// store in a task of its own, so no decision is held up by refunds (the
/// quotas are short of those permits until they land: a brief undershoot).
fn give_back(lanes: &Arc<Lanes>, key: &str, taken: Vec<(usize, Taken)>) {
    let late: Vec<(usize, Taken)> = taken
        .into_iter()
        .filter(|&(index, taken)| {
            !lanes
                .lane(key, index)
                .is_some_and(|lane| lane.untake(key, taken))
        })
        .collect();
    if !late.is_empty() {
        spawn_refunds(lanes.clone(), key.to_owned(), late);
    }
}

/// What a decision over several quotas took so far, given back if it is
/// dropped before it completes.
struct Undo<'a> {
    lanes: &'a Arc<Lanes>,
    key: &'a str,
    /// Recorded as each take completes (takes may run concurrently).
    taken: std::sync::Mutex<Vec<(usize, Taken)>>,
}

impl<'a> Undo<'a> {
    fn new(lanes: &'a Arc<Lanes>, key: &'a str) -> Self {
        Undo {
            lanes,
            key,
            taken: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<(usize, Taken)>> {
        self.taken.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Quota `index` took `taken`.
    fn record(&self, index: usize, taken: Taken) {
        self.list().push((index, taken));
    }

    /// Quota `index`'s take was undone already.
    fn forget(&self, index: usize) {
        self.list().retain(|(i, _)| *i != index);
    }

    /// Gives everything taken back now (a quota denied; see
    /// [`give_back`]).
    fn run(self) {
        drop(self);
    }

    /// The decision completed: what was taken stays taken.
    fn keep(self) {
        self.list().clear();
    }
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        let taken = std::mem::take(&mut *self.list());
        if !taken.is_empty() {
            give_back(self.lanes, self.key, taken);
        }
    }
}

/// Refunds in a task of their own; without a runtime they cannot be sent
/// and are counted as ignored.
pub(crate) fn spawn_refunds(lanes: Arc<Lanes>, key: String, taken: Vec<(usize, Taken)>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                for (index, taken) in taken {
                    lanes.refund_taken(&key, index, taken).await;
                }
            });
        }
        Err(_) => {
            let lost: u64 = taken.iter().map(|(_, t)| t.cost).sum();
            lanes.counters.refunds_ignored.add(lost);
        }
    }
}

/// The all-or-nothing decision over every quota, by the store where need
/// be; a store error becomes that quota's policy decision.
pub(crate) async fn decide(lanes: &Arc<Lanes>, key: &str, cost: u64) -> Decision {
    if let Some(result) = decide_in_one_call(lanes, key, cost).await {
        let inner = &**lanes;
        return result.unwrap_or_else(|_| {
            let count = 1 + inner.also.len();
            let parts: Vec<Decision> = (0..count)
                .filter_map(|i| inner.lane(key, i))
                .map(|l| l.policy_decision(key, cost).with_period(l.quota.period()))
                .collect();
            // A fallback that admitted where another denied gives it back.
            if parts.iter().any(|d| !d.is_allowed()) {
                undo_now(lanes, key, &parts);
            }
            binding(parts)
        });
    }
    match in_rounds(lanes, key, cost, false).await {
        Ok(decision) => decision,
        // Only a try returns errors.
        Err(_) => unreachable_decision(lanes, key),
    }
}

/// A permit taken from one quota while another waits on the store would
/// count in a window that may end before the decision does. So each round
/// first lets every quota take (waiting for refills where it must), puts
/// what came from local leases back, and takes it all again at one instant
/// under the key's stripe. `try_`: a store error ends it (what was taken
/// given back), rather than becoming the policy's decision.
async fn in_rounds(
    lanes: &Arc<Lanes>,
    key: &str,
    cost: u64,
    try_: bool,
) -> Result<Decision, crate::error::Error> {
    for _ in 0..ROUNDS {
        match take_in_turn(lanes, key, cost, try_).await? {
            Turn::Done(decision) => return Ok(decision),
            Turn::Retake => {}
        }
        if let Some(decision) = check_now(lanes, key, cost) {
            return Ok(decision);
        }
    }
    Ok(unreachable_decision(lanes, key))
}

/// Leases keep slipping away between the rounds (a map at `max_keys`,
/// refills failing): one more denial is the safe answer.
fn unreachable_decision(lanes: &Arc<Lanes>, key: &str) -> Decision {
    let lane = lanes.first_lane(key);
    let retry = std::time::Duration::from_millis(1);
    Decision::deny(
        lane.quota.limit(),
        0,
        retry,
        Some(retry),
        crate::decision::Source::Lease,
    )
    .with_period(lane.quota.period())
}

/// Rounds of [`decide`] before it gives up.
const ROUNDS: usize = 2;

enum Turn {
    /// The decision: a denial, or an admission whose takes all stand.
    Done(Decision),
    /// Every quota had room; its leased permits were put back to be taken
    /// again at once.
    Retake,
}

/// Each quota in turn: a denial gives back what the others took; when
/// every quota admits and all came from leases, they go back for
/// [`check_now`] to take at one instant. An admission decided by the store
/// stands only while every part's window lasts; else all is given back and
/// the round starts over.
async fn take_in_turn(
    lanes: &Arc<Lanes>,
    key: &str,
    cost: u64,
    try_: bool,
) -> Result<Turn, crate::error::Error> {
    let inner = &**lanes;
    let count = 1 + inner.also.len();
    let undo = Undo::new(lanes, key);
    // Concurrently: a round takes as long as its slowest quota, not the
    // sum. Each take is recorded the moment it completes, so a future
    // dropped mid-round gives back exactly what was taken.
    let undo_ref = &undo;
    let takes = (0..count).map(|index| async move {
        let lane = inner.lane(key, index)?;
        // The store decides after this, so its window lasts at least
        // `reset_after` from here.
        let started = tokio::time::Instant::now();
        let decision = if try_ {
            lane.try_decide(key, cost).await
        } else {
            Ok(lane.decide(key, cost).await)
        };
        if let Ok(decision) = &decision {
            if decision.is_allowed() {
                undo_ref.record(index, decision.taken);
            }
        }
        Some(decision.map(|d| (d, started)))
    });
    let results: Vec<_> = futures_util::future::join_all(takes)
        .await
        .into_iter()
        .flatten()
        .collect();
    let results = match results.into_iter().collect::<Result<Vec<_>, _>>() {
        Ok(results) => results,
        Err(e) => {
            undo.run();
            return Err(e);
        }
    };
    let (mut parts, decided): (Vec<Decision>, Vec<_>) = results.into_iter().unzip();
    if parts.iter().any(|d| !d.is_allowed()) {
        undo.run();
        return Ok(Turn::Done(binding(parts)));
    }
    if cost == 0 {
        undo.keep();
        return Ok(Turn::Done(binding(parts)));
    }
    if parts.iter().all(|d| d.taken.origin == Origin::Lease) {
        undo.run();
        return Ok(Turn::Retake);
    }
    // Some part was decided by the store (or by the failure policy): it
    // cannot be taken again locally. It stands if its window outlasts the
    // round (the store decided after `started`, so its window lasts at
    // least `taken.lasts` from then)...
    // (Only a window's count by a store can be stale: a bucket's tokens
    // and credit do not end with a window.)
    let now = tokio::time::Instant::now();
    let windowed = inner.algorithm().spec().leases.windowed();
    let stale = parts.iter().zip(&decided).any(|(d, started)| {
        windowed
            && matches!(d.taken.origin, Origin::Store | Origin::Local)
            && now.duration_since(*started) >= d.taken.lasts()
    });
    if stale || !retake_leases(inner, &undo, key, cost, &mut parts) {
        undo.run();
        return Ok(Turn::Retake);
    }
    undo.keep();
    Ok(Turn::Done(binding(parts)))
}

/// ...and the parts taken from leases are put back and taken again now,
/// under the key's stripe, so they count in the window the decision ends
/// in. `false` if one could not be (its lease ended meanwhile).
fn retake_leases(
    inner: &Lanes,
    undo: &Undo<'_>,
    key: &str,
    cost: u64,
    parts: &mut [Decision],
) -> bool {
    let _stripe = inner.stripe(key);
    for (index, part) in parts.iter_mut().enumerate() {
        if part.taken.origin != Origin::Lease {
            continue;
        }
        let Some(lane) = inner.lane(key, index) else {
            return false;
        };
        if !lane.untake(key, part.taken) {
            return false;
        }
        undo.forget(index);
        match lane.check_now(key, cost) {
            Some(again) if again.is_allowed() => {
                undo.record(index, again.taken);
                *part = again;
            }
            _ => return false,
        }
    }
    true
}

/// Every quota exact: one script decides them all, atomically (their keys
/// share a hash tag, so one slot). `None` when a quota is not exact.
async fn decide_in_one_call(
    lanes: &Arc<Lanes>,
    key: &str,
    cost: u64,
) -> Option<Result<Decision, crate::error::Error>> {
    let inner = &**lanes;
    let count = 1 + inner.also.len();
    let lanes: Vec<_> = (0..count).filter_map(|i| inner.lane(key, i)).collect();
    let engines: Vec<_> = lanes.iter().filter_map(|l| l.exact()).collect();
    if engines.len() != count {
        return None;
    }
    for lane in &lanes {
        if !lane.reconciled().await {
            return Some(Err(crate::error::Error::new(
                crate::error::ErrorKind::Connection,
                "what the fallback admitted is not reported yet",
            )));
        }
    }
    let (keys, params): (Vec<String>, Vec<_>) = engines.iter().map(|e| e.call_for(key)).unzip();
    let store = engines[0].store();
    let check = crate::algorithm::CheckAll {
        keys: &keys,
        params: &params,
        cost,
    };
    let (replies, _) = store.run_counted(&check, &inner.counters).await;
    inner.counters.circuit(store.circuit_state());
    let replies = match replies {
        Ok(replies) => replies,
        Err(e) => return Some(Err(e)),
    };
    let applied = replies.iter().all(|r| r.allowed);
    let parts = engines
        .iter()
        .zip(&lanes)
        .zip(&replies)
        .map(|((engine, lane), reply)| {
            engine
                .decision(reply, cost, applied)
                .with_period(lane.quota.period())
        })
        .collect();
    Some(Ok(binding(parts)))
}

/// [`decide`] with the first store error instead of a policy decision
/// (what was taken before it is given back).
pub(crate) async fn try_decide(
    lanes: &Arc<Lanes>,
    key: &str,
    cost: u64,
) -> Result<Decision, crate::error::Error> {
    if let Some(result) = decide_in_one_call(lanes, key, cost).await {
        return result;
    }
    in_rounds(lanes, key, cost, true).await
}
