//! Several limiters and keys in one decision: [`check_all`] (or
//! [`check_each`], a cost per pair) and [`refund_all`], all-or-nothing
//! across limiters whose keys may live in different Redis slots or nodes.

use std::sync::Arc;

use super::quotas::binding;
use super::undo::Undo;
use super::Limiter;
use crate::decision::{Decision, Source};

/// Decides `cost` for every `(limiter, key)` pair, all-or-nothing: a
/// user **and** the user's organisation, a route **and** the whole API.
///
/// Each pair is decided in turn (with all of its limiter's quotas); when
/// one denies, the later pairs are still asked (so the decision tells the
/// longest wait of those that deny), everything the admitting pairs took
/// (window permits, bucket tokens, credit) is given back where it came
/// from, and the decision is the binding denial, which takes nothing and
/// is not refundable. The keys may live in
/// different Redis slots, or nodes of a cluster, so there is no one atomic
/// script: no pair ever admits past its own limit (no overshoot), and
/// while a refund is in flight the earlier pairs hold `cost` permits fewer
/// than they should (a brief undershoot). A refund that arrives after its
/// window ended is ignored and counted in that limiter's
/// [`Stats::refunds_ignored`](crate::Stats::refunds_ignored). Dropping the
/// future midway gives back what was taken, in a task of its own.
///
/// The decision is the binding one (see the rules on
/// [`Decision::quotas`]): each pair's decision is one of its parts, in
/// order, and each is counted by its own limiter. An empty list admits.
///
/// ```
/// # async fn demo() -> Result<(), slicelimit::Error> {
/// use slicelimit::{check_all, nonzero, Limiter, Quota, RedisStore};
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let users = Limiter::builder(Quota::per_minute(nonzero!(60)))
///     .store(store.clone())
///     .namespace("user")
///     .build()?;
/// let orgs = Limiter::builder(Quota::per_minute(nonzero!(600)))
///     .store(store)
///     .namespace("org")
///     .build()?;
/// let decision = check_all(&[(&users, "alice"), (&orgs, "acme")], 1).await;
/// assert!(decision.is_allowed());
/// # Ok(())
/// # }
/// ```
pub async fn check_all(pairs: &[(&Limiter, &str)], cost: u64) -> Decision {
    let items: Vec<(&Limiter, &str, u64)> = pairs.iter().map(|&(l, k)| (l, k, cost)).collect();
    check_each(&items).await
}

/// [`check_all`] with a cost of its own for each `(limiter, key, cost)`:
/// all-or-nothing in the same way, in order. Envoy's rate limit
/// requests carry a cost per descriptor.
pub async fn check_each(items: &[(&Limiter, &str, u64)]) -> Decision {
    let mut decisions: Vec<Decision> = Vec::with_capacity(items.len());
    // What the admitting pairs took goes back, in a task of its own, if a
    // pair denies or this future is dropped midway.
    let undo = Undo::new();
    for (limiter, key, cost) in items {
        let decision = limiter.check(key, *cost).await;
        // After a denial the later pairs are still asked (what they admit
        // goes back with the rest): the client is told the longest wait
        // of those that deny, the binding one, not the first one's.
        if decision.is_allowed() {
            undo.record_all(&limiter.inner, key, &decision);
        }
        decisions.push(decision);
    }
    if decisions.is_empty() {
        return Decision::allow(0, 0, std::time::Duration::ZERO, Source::Local);
    }
    if decisions.iter().all(Decision::is_allowed) {
        undo.keep();
    }
    binding_of_pairs(items, decisions)
}

/// The binding decision over pairs, each of which may itself hold parts.
/// Parts are named after their limiters.
fn binding_of_pairs(items: &[(&Limiter, &str, u64)], parts: Vec<Decision>) -> Decision {
    let flat: Vec<Decision> = parts
        .iter()
        .flat_map(|d| d.quotas().iter().cloned())
        .collect();
    let mut decision = binding(flat, Vec::new());
    decision.parts = None;
    let names: Vec<Arc<str>> = items
        .iter()
        .take(parts.len())
        .map(|(limiter, _, _)| limiter.inner.name.clone())
        .collect();
    decision.with_parts(parts, names)
}

/// Gives a [`check_all`] admission back, pair by pair (see
/// [`Limiter::refund`]); `pairs` must be the list it was decided for.
/// Returns the permits given back, summed.
pub async fn refund_all(pairs: &[(&Limiter, &str)], decision: &Decision) -> u64 {
    // A denial took nothing: what the pairs before the denying one took
    // went back when it was decided (as `Limiter::refund` says for its
    // own denials).
    if !decision.is_allowed() {
        return 0;
    }
    let parts = decision.quotas();
    if parts.len() != pairs.len() {
        return 0;
    }
    let mut back = 0;
    for ((limiter, key), part) in pairs.iter().zip(parts) {
        back += limiter.refund(key, part).await;
    }
    back
}
