//! A limiter's quotas and the one path by which a key is decided.
//!
//! Each quota the limiter enforces is a position in [`Quotas::tiers`]: its
//! default lane and the lanes of per-key quotas (see `tiers`). One quota
//! is decided by its lane alone; several are all-or-nothing. A request is
//! admitted only if every quota admits it, and then counts against each;
//! a denial counts against none. Takes are made one quota after another
//! and undone if a later one denies:
//!
//! - Local takes (leased permits, per-process counts) are made under the
//!   key's stripe lock, and undone under it too, so no other decision of
//!   the limiter sees one quota taken and another not.
//! - A take that needed the store is undone by a refund to its window.
//!   Until the refund lands, the quota has `cost` permits fewer than it
//!   should: a brief undershoot, never an overshoot (each quota alone never
//!   admits past its limit). A refund that arrives after its window ended
//!   is ignored and counted.
//! - A future dropped between two takes undoes the first in a task of its
//!   own (`undo::Undo`, the one guard for anything half-taken, which
//!   `check_all` uses across limiters too).
//!
//! Every decision is counted here, once, whatever number of lanes it went
//! through; lanes decide and never count.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::lane::{Lane, Recipe};
use super::tiers::{LaneRef, Tiers};
use super::undo::Undo;
use crate::algorithm::{Algorithm, CheckAll};
use crate::decision::{binding_denial, Decision, Taken, TakenFrom};
use crate::error::{Error, ErrorKind};
use crate::hybrid::HybridConfig;
use crate::key::{Key, KeyEncoder};
use crate::quota::Quota;
use crate::stats::Counters;

/// One limiter's quotas, as lanes.
pub(crate) struct Quotas {
    pub(crate) recipe: Recipe,
    /// One entry per quota, in the order given (the first, then those
    /// added with [`Builder::and`](crate::Builder::and)); each has its
    /// own store keys and, with a resolver, per-key quotas.
    pub(crate) tiers: Box<[Tiers]>,
    /// Several quotas: a key's local takes are all-or-nothing under its
    /// stripe, so no decision sees one quota taken and another not.
    stripes: Box<[Mutex<()>]>,
    /// The hybrid configuration lanes built from now on start with.
    pub(crate) config: Mutex<Option<HybridConfig>>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) algorithm: Algorithm,
    /// This limiter's namespace.
    pub(crate) keys: KeyEncoder,
    /// Its name: [`Builder::name`](crate::Builder::name), else the
    /// namespace.
    pub(crate) name: Arc<str>,
    /// Callers of `acquire` waiting, per key, in arrival order.
    pub(crate) waiters: crate::queues::Queues,
    /// This limiter's identity in its decisions.
    pub(crate) id: u32,
    /// The store's circuit breaker openings before this limiter was built.
    pub(crate) trips_at_build: u64,
}

/// Identities of limiters (never 0).
pub(crate) static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

/// Stripes serialising the local takes of a limiter with several quotas.
const STRIPES: usize = 64;

/// Rounds of [`Quotas::decide_several`] at least, before it gives up
/// (more while a request may wait for a refill, up to [`MAX_ROUNDS`]:
/// a store that answers at once, or a clock that stands still, must not
/// keep a decision going round).
const ROUNDS: usize = 2;

/// The most rounds of [`Quotas::decide_several`].
const MAX_ROUNDS: usize = 16;

impl Quotas {
    /// A limiter's quotas from their lanes (the first quota first).
    pub(crate) fn new(
        recipe: Recipe,
        tiers: Vec<Tiers>,
        config: Option<HybridConfig>,
        keys: KeyEncoder,
        name: Arc<str>,
    ) -> Quotas {
        let stripes = if tiers.len() > 1 { STRIPES } else { 0 };
        Quotas {
            trips_at_build: recipe
                .store
                .as_ref()
                .map_or(0, crate::store::Store::circuit_trips),
            counters: recipe.counters.clone(),
            algorithm: recipe.algorithm,
            id: recipe.limiter,
            recipe,
            tiers: tiers.into_boxed_slice(),
            stripes: (0..stripes).map(|_| Mutex::new(())).collect(),
            config: Mutex::new(config),
            keys,
            name,
            waiters: Default::default(),
        }
    }

    fn several(&self) -> bool {
        self.tiers.len() > 1
    }

    /// The decision if no store call is needed, counted, into `decided`
    /// (left `None`, nothing taken, if the store is needed).
    ///
    /// The decision is written where the caller keeps it: one returned up
    /// through the steps is copied whole at each, and the first copy of
    /// one just made waits for its stores to drain (on one hot key, that
    /// wait was a tenth of the decision's cost).
    #[inline(always)]
    pub(crate) fn check_now_into(
        self: &Arc<Self>,
        key: Key<'_>,
        cost: u64,
        decided: &mut Option<Decision>,
    ) {
        if self.several() {
            *decided = self.check_now_several(key, cost);
        } else {
            self.tiers[0]
                .lane_for(key, |quota| self.build_lane(quota, 0).ok())
                .check_now_into(&key, cost, decided);
        }
        if let Some(decision) = decided {
            self.count(decision);
        }
    }

    /// The decision, by the store where need be, counted; a store error
    /// becomes the failure policy's decision. (`self` is an `Arc`: what
    /// several quotas give back may go in a task of its own.)
    pub(crate) async fn decide(self: &Arc<Self>, key: Key<'_>, cost: u64) -> Decision {
        self.release_elsewhere(key, true).await;
        let mut decision = if self.several() {
            self.decide_several(key, cost, false)
                .await
                .unwrap_or_else(|_| {
                    // Only a try returns errors.
                    self.unreachable_decision(key)
                })
        } else {
            self.lane(key, 0).decide(&key, cost).await
        };
        // The key's tier changed while it was decided: the lane it was
        // decided by must not keep what it leased meanwhile. Without
        // waiting for the give-back: the decision is made, and a round
        // trip here would return it in a later window than the one its
        // permits were counted in.
        self.release_elsewhere(key, false).await;
        self.count(&mut decision);
        decision
    }

    /// [`decide`](Quotas::decide) with the first store error instead of a
    /// policy decision (what was taken before it is given back); not
    /// counted.
    pub(crate) async fn try_decide(
        self: &Arc<Self>,
        key: Key<'_>,
        cost: u64,
    ) -> Result<Decision, Error> {
        self.release_elsewhere(key, true).await;
        let mut decision = if self.several() {
            self.decide_several(key, cost, true).await?
        } else {
            self.lane(key, 0).try_decide(&key, cost).await?
        };
        decision.limiter = self.id;
        Ok(decision)
    }

    /// Counts a decision and signs it as this limiter's.
    #[inline]
    pub(crate) fn count(&self, decision: &mut Decision) {
        // Written only if not stamped already: a decision the request path
        // is about to return is copied whole, and a fresh write to it
        // stalls that copy.
        if decision.limiter != self.id {
            decision.limiter = self.id;
        }
        self.counters
            .decision(decision.is_allowed(), decision.source());
    }

    /// The lane deciding quota `index` (0: the first) for `key`.
    pub(crate) fn lane(&self, key: Key<'_>, index: usize) -> LaneRef<'_> {
        self.tiers[index].lane_for(key, |quota| self.build_lane(quota, index).ok())
    }

    /// A lane for `quota` at position `index`, in that position's store
    /// keys (a quota of another period than the one built there counts in
    /// keys of its own: windows of different lengths cannot share one
    /// count).
    pub(crate) fn build_lane(&self, quota: Quota, index: usize) -> Result<Lane, Error> {
        let config = self
            .config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut keys = self.keys.for_quota(index);
        if quota.period() != self.tiers[index].built_period() {
            keys = keys.for_period(quota.period());
        }
        Lane::build(&self.recipe, quota, keys, config)
    }

    /// A key whose quota changed (tiers) leaves the lanes of its other
    /// quotas before it is decided (`wait`: for what they give back to
    /// reach the store, see `HybridEngine::release`).
    async fn release_elsewhere(&self, key: Key<'_>, wait: bool) {
        for (index, tiers) in self.tiers.iter().enumerate() {
            if tiers.has_resolver() {
                let current = self.lane(key, index).to_arc();
                tiers.release_elsewhere(&key, &current, wait).await;
            }
        }
    }

    /// The stripe lock of `key` (several quotas only).
    fn stripe(&self, key: &str) -> MutexGuard<'_, ()> {
        static SEED: std::sync::OnceLock<ahash::RandomState> = std::sync::OnceLock::new();
        let h = SEED.get_or_init(ahash::RandomState::new).hash_one(key);
        let i = (h as usize) % self.stripes.len().max(1);
        self.stripes[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives an admission of this limiter back, quota by quota (see
    /// `Limiter::refund`); returns the permits given back.
    pub(crate) async fn refund(&self, key: Key<'_>, decision: &Decision) -> u64 {
        let parts = decision.quotas();
        if decision.limiter != self.id || parts.len() != self.tiers.len() {
            let taken: u64 = parts.iter().map(|d| d.taken.cost).sum();
            self.counters.refunds_ignored.add(taken);
            return 0;
        }
        let mut back = 0;
        for (index, part) in parts.iter().enumerate() {
            // A key moved to a tier of another period since: its window
            // indices count other windows, so the refund has nowhere to go.
            if self.lane(key, index).quota.period() != part.period() {
                self.counters.refunds_ignored.add(part.taken.cost);
                continue;
            }
            back += self.refund_taken(key, index, part.taken).await;
        }
        back
    }

    /// Gives `taken` back to quota `index`, counted.
    pub(super) async fn refund_taken(&self, key: Key<'_>, index: usize, taken: Taken) -> u64 {
        if !taken.refundable() {
            self.counters.refunds_ignored.add(taken.cost);
            return 0;
        }
        let back = self.lane(key, index).refund(&key, taken).await;
        self.counters.refunded.add(back);
        self.counters
            .refunds_ignored
            .add(taken.cost - back.min(taken.cost));
        back
    }

    /// Gives takes of quotas of this limiter back: into the local leases
    /// at once, the rest through the store in a task of its own, so no
    /// decision is held up by refunds (the quotas are short of those
    /// permits until they land: a brief undershoot). Without a runtime
    /// they cannot be sent and are counted as ignored.
    pub(super) fn give_back(self: &Arc<Self>, key: Key<'_>, taken: Vec<(usize, Taken)>) {
        let late: Vec<(usize, Taken)> = taken
            .into_iter()
            .filter(|&(index, taken)| !self.lane(key, index).untake(&key, taken))
            .collect();
        if late.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let quotas = self.clone();
                let (given, kept) = (key.given.to_owned(), key.kept.to_owned());
                runtime.spawn(async move {
                    let key = Key {
                        given: &given,
                        kept: &kept,
                    };
                    for (index, taken) in late {
                        quotas.refund_taken(key, index, taken).await;
                    }
                });
            }
            Err(_) => {
                let lost: u64 = late.iter().map(|(_, t)| t.cost).sum();
                self.counters.refunds_ignored.add(lost);
            }
        }
    }

    /// The local, all-or-nothing decision over every quota, or `None`
    /// (nothing taken) if one of them needs the store.
    fn check_now_several(self: &Arc<Self>, key: Key<'_>, cost: u64) -> Option<Decision> {
        let _stripe = self.stripe(&key);
        let mut parts = Vec::with_capacity(self.tiers.len());
        let undo = Undo::new();
        let mut denied = false;
        for index in 0..self.tiers.len() {
            // A quota this process cannot decide alone: the store decides
            // them all, so a denial's hint is the binding quota's, not the
            // first one's to say no. (`undo` gives back what was taken.)
            let decision = self.lane(key, index).check_now(&key, cost)?;
            if decision.is_allowed() {
                undo.record(self, key, index, decision.taken);
            }
            denied |= !decision.is_allowed();
            parts.push(decision);
        }
        // Every quota was asked, after a denial too: the client is told the
        // longest wait of those that denied (the one that binds).
        if !denied {
            undo.keep();
        }
        Some(binding(parts, Vec::new()))
    }

    /// The all-or-nothing decision over every quota, by the store where
    /// need be. `try_`: a store error ends it (what was taken given back),
    /// rather than becoming that quota's policy decision.
    async fn decide_several(
        self: &Arc<Self>,
        key: Key<'_>,
        cost: u64,
        try_: bool,
    ) -> Result<Decision, Error> {
        if let Some(result) = self.decide_in_one_call(key, cost).await {
            return match result {
                Ok(decision) => Ok(decision),
                Err(e) if try_ => Err(e),
                Err(_) => Ok(self.policy_decisions(key, cost)),
            };
        }
        // A permit taken from one quota while another waits on the store
        // would count in a window that may end before the decision does.
        // So each round first lets every quota take (waiting for refills
        // where it must), puts what came from local leases back, and takes
        // it all again at one instant under the key's stripe.
        // Rounds go on while a request may wait for a refill (`max_wait`):
        // near a window's end a lease taken from may lapse while another
        // quota's round trip runs, until the next window's leases are in.
        let began = tokio::time::Instant::now();
        let patience = self
            .config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(Duration::ZERO, |c| c.max_wait);
        let mut rounds = 0;
        while rounds < ROUNDS || (rounds < MAX_ROUNDS && began.elapsed() < patience) {
            rounds += 1;
            if let Some(decision) = self.take_in_turn(key, cost, try_).await? {
                return Ok(decision);
            }
            if let Some(decision) = self.check_now_several(key, cost) {
                return Ok(decision);
            }
        }
        Ok(self.unreachable_decision(key))
    }

    /// Every quota's failure policy decision (a store error on the one
    /// call deciding them all); a fallback that admitted where another
    /// denied gives it back.
    fn policy_decisions(self: &Arc<Self>, key: Key<'_>, cost: u64) -> Decision {
        let parts: Vec<Decision> = (0..self.tiers.len())
            .map(|i| self.lane(key, i).policy_decision(&key, cost))
            .collect();
        if parts.iter().any(|d| !d.is_allowed()) {
            let taken = parts.iter().map(|d| d.taken).enumerate();
            self.give_back(key, taken.filter(|(_, t)| t.refundable()).collect());
        }
        binding(parts, Vec::new())
    }

    /// Leases keep slipping away between the rounds (a map at `max_keys`,
    /// refills failing): one more denial is the safe answer.
    fn unreachable_decision(&self, key: Key<'_>) -> Decision {
        self.lane(key, 0).denied_briefly()
    }

    /// Each quota in turn: a denial gives back what the others took; when
    /// every quota admits and all came from leases, they go back for
    /// [`check_now_several`](Quotas::check_now_several) to take at one
    /// instant (`None`). An admission decided by the store stands only
    /// while every part's window lasts; else all is given back and the
    /// round starts over.
    async fn take_in_turn(
        self: &Arc<Self>,
        key: Key<'_>,
        cost: u64,
        try_: bool,
    ) -> Result<Option<Decision>, Error> {
        let undo = Undo::new();
        // Concurrently: a round takes as long as its slowest quota, not the
        // sum. Each take is recorded the moment it completes, so a future
        // dropped mid-round gives back exactly what was taken.
        let undo_ref = &undo;
        let takes = (0..self.tiers.len()).map(|index| async move {
            let lane = self.lane(key, index).to_arc();
            // The store decides after this, so its window lasts at least
            // `reset_after` from here.
            let started = tokio::time::Instant::now();
            let decision = if try_ {
                lane.try_decide(&key, cost).await
            } else {
                Ok(lane.decide(&key, cost).await)
            };
            if let Ok(decision) = &decision {
                if decision.is_allowed() {
                    undo_ref.record(self, key, index, decision.taken);
                }
            }
            decision.map(|d| (d, started))
        });
        let results = futures_util::future::join_all(takes).await;
        // On an error, `undo` gives everything back as it drops.
        let results = results.into_iter().collect::<Result<Vec<_>, _>>()?;
        let (mut parts, decided): (Vec<Decision>, Vec<_>) = results.into_iter().unzip();
        if parts.iter().any(|d| !d.is_allowed()) {
            // A part admitted on credit while its lease call was out may
            // have heard since that its quota is spent: the client is
            // told that wait too, if it is the longer. (What the part
            // took goes back all the same, as `undo` drops.) Only credit:
            // a part that took leased permits has them back at once, and
            // a denial its holding cached before (a refill refused) is
            // not what a retry meets.
            for (index, part) in parts.iter_mut().enumerate() {
                if part.is_allowed() && part.taken.origin == TakenFrom::Credit {
                    if let Some(denied) = self.lane(key, index).cached_denial(&key, cost) {
                        *part = denied;
                    }
                }
            }
            return Ok(Some(binding(parts, Vec::new())));
        }
        if cost == 0 {
            undo.keep();
            return Ok(Some(binding(parts, Vec::new())));
        }
        if parts.iter().all(|d| d.taken.origin == TakenFrom::Lease) {
            return Ok(None);
        }
        // Some part was decided by the store (or by the failure policy): it
        // cannot be taken again locally. It stands if its window outlasts
        // the round (the store decided after `started`, so its window lasts
        // at least `taken.lasts` from then)... (Only a window's count by a
        // store can be stale: a bucket's tokens and credit do not end with
        // a window.)
        let now = tokio::time::Instant::now();
        let windowed = self.algorithm.spec().leases.windowed();
        let stale = parts.iter().zip(&decided).any(|(d, started)| {
            windowed
                && matches!(d.taken.origin, TakenFrom::Store | TakenFrom::Local)
                && now.duration_since(*started) >= d.taken.lasts()
        });
        if stale || !self.retake_leases(&undo, key, cost, &mut parts) {
            return Ok(None);
        }
        undo.keep();
        Ok(Some(binding(parts, Vec::new())))
    }

    /// ...and the parts taken from leases are put back and taken again
    /// now, under the key's stripe, so they count in the window the
    /// decision ends in. `false` if one could not be (its lease ended
    /// meanwhile).
    fn retake_leases<'a>(
        self: &'a Arc<Self>,
        undo: &Undo<'a>,
        key: Key<'a>,
        cost: u64,
        parts: &mut [Decision],
    ) -> bool {
        let _stripe = self.stripe(&key);
        for (index, part) in parts.iter_mut().enumerate() {
            if part.taken.origin != TakenFrom::Lease {
                continue;
            }
            let lane = self.lane(key, index);
            if !lane.untake(&key, part.taken) {
                return false;
            }
            undo.forget(self, index);
            match lane.check_now(&key, cost) {
                Some(again) if again.is_allowed() => {
                    undo.record(self, key, index, again.taken);
                    *part = again;
                }
                _ => return false,
            }
        }
        true
    }

    /// Every quota exact: one script decides them all, atomically (their
    /// keys share a hash tag, so one slot). `None` when a quota is not
    /// exact.
    async fn decide_in_one_call(&self, key: Key<'_>, cost: u64) -> Option<Result<Decision, Error>> {
        let lanes: Vec<Arc<Lane>> = (0..self.tiers.len())
            .map(|i| self.lane(key, i).to_arc())
            .collect();
        let engines: Vec<_> = lanes.iter().filter_map(|l| l.exact()).collect();
        if engines.len() != lanes.len() {
            return None;
        }
        for lane in &lanes {
            if !lane.reconciled().await {
                return Some(Err(Error::new(
                    ErrorKind::Connection,
                    "what the fallback admitted is not reported yet",
                )));
            }
        }
        let (keys, params): (Vec<String>, Vec<_>) =
            engines.iter().map(|e| e.call_for(&key)).unzip();
        let store = engines[0].store();
        let check = CheckAll {
            keys: &keys,
            params: &params,
            cost,
        };
        let (replies, _) = store.run_counted(&check, &self.counters).await;
        self.counters.circuit(store.circuit_state());
        let replies = match replies {
            Ok(replies) => replies,
            Err(e) => return Some(Err(e)),
        };
        let applied = replies.iter().all(|r| r.allowed);
        let parts = engines
            .iter()
            .zip(&lanes)
            .zip(&replies)
            .map(|((engine, lane), reply)| lane.replied(engine, reply, cost, applied))
            .collect();
        Some(Ok(binding(parts, Vec::new())))
    }
}

/// The decision that binds over `parts` (named by `names`, or unnamed:
/// empty): a denial if any denied (the longest wait, see
/// `binding_denial`), else the admission with the fewest permits left.
/// Keeps every part for `Decision::quotas`. A denial's parts record
/// nothing taken: the caller gave back what the admitting parts took.
pub(super) fn binding(parts: Vec<Decision>, names: Vec<Arc<str>>) -> Decision {
    let chosen = match binding_denial(&parts) {
        Some(i) => &parts[i],
        None => parts
            .iter()
            .min_by_key(|d| (d.remaining(), std::cmp::Reverse(d.reset_after())))
            .expect("at least one part"),
    };
    chosen.clone().with_parts(parts, names)
}
