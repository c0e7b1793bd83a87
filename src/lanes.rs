//! A limiter's lanes: its first quota (per tier) and the quotas added
//! with `and`, the stripes that make several quotas' local takes
//! all-or-nothing, and the counters every decision updates.

use std::sync::{Arc, Mutex};

use crate::algorithm::Algorithm;
use crate::decision::Decision;
use crate::decision::Taken;
use crate::error::Error;
use crate::hybrid::HybridConfig;
use crate::key::KeyEncoder;
use crate::lane::{Lane, Recipe};
use crate::quota::Quota;
use crate::stats::Counters;
use crate::tiers::{LaneRef, Tiers};

/// One limiter's quotas, as lanes.
pub(crate) struct Lanes {
    pub(crate) recipe: Recipe,
    /// The first quota: the default, or the key's own (tiers).
    pub(crate) first: Tiers,
    /// The quotas added with [`Builder::and`], each in its own store keys.
    pub(crate) also: Box<[Lane]>,
    /// Several quotas: a key's local takes are all-or-nothing under its
    /// stripe, so no decision sees one quota taken and another not.
    pub(crate) stripes: Box<[Mutex<()>]>,
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
    /// The first quota's period as built: quotas of the first position
    /// with another period (tiers, `set_quota`) count in keys of their own.
    pub(crate) period: std::time::Duration,
    /// The store's circuit breaker openings before this limiter was built.
    pub(crate) trips_at_build: u64,
}

/// Identities of limiters (never 0).
pub(crate) static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

impl Lanes {
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

    /// The lane of `key`'s first quota.
    #[inline]
    pub(crate) fn first_lane(&self, key: &str) -> LaneRef<'_> {
        self.first
            .lane_for(key, |quota| self.build_lane(quota, 0).ok())
    }

    pub(crate) fn build_lane(&self, quota: Quota, index: usize) -> Result<Lane, Error> {
        let config = self
            .config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut keys = self.keys.for_quota(index);
        if index == 0 && quota.period() != self.period {
            keys = keys.for_period(quota.period());
        }
        Lane::build(&self.recipe, quota, keys, config)
    }

    /// The lane of quota `index` (0: the first) for `key`.
    pub(crate) fn lane(&self, key: &str, index: usize) -> Option<LaneOf<'_>> {
        match index {
            0 => Some(LaneOf::First(self.first_lane(key))),
            i => self.also.get(i - 1).map(LaneOf::Also),
        }
    }

    /// The slow path of `key`: a key whose first quota changed (tiers)
    /// leaves the lanes of its other quotas before it is decided.
    pub(crate) async fn release_elsewhere(&self, key: &str, wait: bool) {
        // The lane's address only: no guard of the lane map is held
        // across the give-backs' round trips.
        let lane = &*self.first_lane(key) as *const Lane as usize;
        self.first.release_elsewhere(key, lane, wait).await;
    }

    /// How this limiter counts.
    pub(crate) fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    pub(crate) fn several(&self) -> bool {
        !self.also.is_empty()
    }

    /// The stripe lock of `key` (several quotas only).
    pub(crate) fn stripe(&self, key: &str) -> std::sync::MutexGuard<'_, ()> {
        static SEED: std::sync::OnceLock<ahash::RandomState> = std::sync::OnceLock::new();
        let h = SEED.get_or_init(ahash::RandomState::new).hash_one(key);
        let i = (h as usize) % self.stripes.len().max(1);
        self.stripes[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives `taken` back to quota `index`, counted.
    pub(crate) async fn refund_taken(&self, key: &str, index: usize, taken: Taken) -> u64 {
        if !taken.refundable() {
            self.counters.refunds_ignored.add(taken.cost);
            return 0;
        }
        let back = match self.lane(key, index) {
            Some(lane) => lane.refund(key, taken).await,
            None => 0,
        };
        self.counters.refunded.add(back);
        self.counters
            .refunds_ignored
            .add(taken.cost - back.min(taken.cost));
        back
    }
}

/// A lane of a limiter, borrowed for one decision.
pub(crate) enum LaneOf<'a> {
    First(LaneRef<'a>),
    Also(&'a Lane),
}

impl std::ops::Deref for LaneOf<'_> {
    type Target = Lane;

    #[inline]
    fn deref(&self) -> &Lane {
        match self {
            LaneOf::First(lane) => lane,
            LaneOf::Also(lane) => lane,
        }
    }
}
