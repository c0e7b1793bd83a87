//! Per-key quotas (tiers) and live quota changes.
//!
//! Each of a limiter's quotas may depend on the key: a resolver maps a key
//! to its quota (`None`: the default). Every quota in use gets a lane of its
//! own, built on first use, and every lane counts in the limiter's one
//! namespace (its position's keys): a key that changes tier keeps what its window already
//! counted, and the new limit applies to it. (A quota of another period
//! than the limiter's first counts in keys of its own: windows of
//! different lengths cannot share one count.) Resolvers and the default
//! quota are replaced at run time; the lanes they no longer pick are shut
//! down, which gives their unused leased permits back, so the key's new
//! lane can lease them within one refill.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, ArcSwapOption};

use super::lane::Lane;
use crate::key::Key;
use crate::quota::Quota;

/// A key's quota, or `None` for the default.
pub(crate) type Resolver = dyn Fn(&str) -> Option<Quota> + Send + Sync;

/// The most distinct per-key quotas in use at once. Each is a lane (with,
/// in the hybrid mode, its own background task); a resolver handing out
/// more gets the default quota for the rest.
pub(crate) const MAX_TIERS: usize = 64;

/// One of a limiter's quotas: its default lane and, with a resolver,
/// the lanes of per-key quotas.
pub(crate) struct Tiers {
    /// The quota of keys the resolver leaves alone, and its lane.
    default: ArcSwap<Lane>,
    /// The default lane the limiter was built with, read without the
    /// `ArcSwap` until the default is first replaced: its load and the
    /// drop of its guard cost a hot key a tenth of its decision.
    built: Arc<Lane>,
    replaced: AtomicBool,
    resolver: ArcSwapOption<Box<Resolver>>,
    /// Whether a resolver is set (one load on the request path when not).
    on: AtomicBool,
    /// Lanes of the quotas the resolver handed out (read without a lock;
    /// replaced whole under `building`).
    lanes: ArcSwap<Vec<Arc<Lane>>>,
    building: Mutex<()>,
}

/// The lane a key is decided by.
pub(crate) enum LaneRef<'a> {
    Built(&'a Arc<Lane>),
    Default(arc_swap::Guard<Arc<Lane>>),
    Tier(Arc<Lane>),
}

impl std::ops::Deref for LaneRef<'_> {
    type Target = Lane;

    #[inline]
    fn deref(&self) -> &Lane {
        match self {
            LaneRef::Built(lane) => lane,
            LaneRef::Default(lane) => lane,
            LaneRef::Tier(lane) => lane,
        }
    }
}

impl LaneRef<'_> {
    /// The lane, held without borrowing its map (for a decision that
    /// waits on the store).
    pub(crate) fn to_arc(&self) -> Arc<Lane> {
        match self {
            LaneRef::Built(lane) => Arc::clone(lane),
            LaneRef::Default(lane) => Arc::clone(lane),
            LaneRef::Tier(lane) => Arc::clone(lane),
        }
    }
}

impl Tiers {
    pub(crate) fn new(default: Lane, resolver: Option<Box<Resolver>>) -> Self {
        let built = Arc::new(default);
        Tiers {
            default: ArcSwap::new(built.clone()),
            built,
            replaced: AtomicBool::new(false),
            on: AtomicBool::new(resolver.is_some()),
            resolver: ArcSwapOption::new(resolver.map(Arc::new)),
            lanes: ArcSwap::from_pointee(Vec::new()),
            building: Mutex::new(()),
        }
    }

    /// The period of the quota this position was built with: its store
    /// keys count windows of this length.
    pub(crate) fn built_period(&self) -> std::time::Duration {
        self.built.quota.period()
    }

    /// Whether keys may have quotas of their own here.
    pub(crate) fn has_resolver(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// The default quota.
    pub(crate) fn default_quota(&self) -> Quota {
        self.default.load().quota
    }

    /// The default lane (for whatever every lane does alike).
    #[inline]
    pub(crate) fn default_lane(&self) -> LaneRef<'_> {
        if self.replaced.load(Ordering::Acquire) {
            LaneRef::Default(self.default.load())
        } else {
            LaneRef::Built(&self.built)
        }
    }

    /// Every lane in use, the default first.
    pub(crate) fn all(&self) -> Vec<Arc<Lane>> {
        let mut all = vec![self.default.load_full()];
        all.extend(self.lanes.load().iter().cloned());
        all
    }

    fn building(&self) -> std::sync::MutexGuard<'_, ()> {
        self.building.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lane deciding `key`.
    #[inline]
    pub(crate) fn lane_for(
        &self,
        key: Key<'_>,
        build: impl FnOnce(Quota) -> Option<Lane>,
    ) -> LaneRef<'_> {
        if !self.on.load(Ordering::Relaxed) {
            return self.default_lane();
        }
        let quota = match &*self.resolver.load() {
            Some(resolver) => resolver(key.given),
            None => None,
        };
        let default = self.default.load();
        match quota {
            Some(quota) if quota != default.quota => match self.tier(quota, build) {
                Some(lane) => LaneRef::Tier(lane),
                None => LaneRef::Default(default),
            },
            _ => LaneRef::Default(default),
        }
    }

    /// The lane of a per-key quota, built on first use; `None` (the
    /// default applies) for a quota the algorithm refuses, or past
    /// [`MAX_TIERS`].
    fn tier(&self, quota: Quota, build: impl FnOnce(Quota) -> Option<Lane>) -> Option<Arc<Lane>> {
        if let Some(lane) = self.lanes.load().iter().find(|l| l.quota == quota) {
            return Some(lane.clone());
        }
        let _building = self.building();
        let lanes = self.lanes.load_full();
        if let Some(lane) = lanes.iter().find(|l| l.quota == quota) {
            return Some(lane.clone());
        }
        if lanes.len() >= MAX_TIERS {
            return None;
        }
        let lane = Arc::new(build(quota)?);
        let mut next = Vec::clone(&lanes);
        next.push(lane.clone());
        self.lanes.store(Arc::new(next));
        Some(lane)
    }

    /// `key` is decided by `current` now: every other lane gives up what
    /// it holds for the key, so a key moved to a lower tier does not spend
    /// a lease granted under a higher one (and the count it left behind
    /// in the store is what the new limit is held against). (`wait`: for
    /// what they give back to reach the store, see `HybridEngine::release`.)
    pub(crate) async fn release_elsewhere(&self, key: &str, current: &Arc<Lane>, wait: bool) {
        for other in self.all() {
            if !Arc::ptr_eq(&other, current) {
                other.release(key, wait).await;
            }
        }
    }

    /// Replaces the default quota; the old lane is shut down. Once its
    /// unused permits are back in the store, the new lane forgets the
    /// denials it cached meanwhile: a key it found exhausted while they
    /// were still out (a lower limit set mid-window) asks again, rather
    /// than stay denied with room in the store until the window ends.
    pub(crate) fn set_default(&self, lane: Lane) {
        let new = Arc::new(lane);
        let old = self.default.swap(new.clone());
        // After the swap: a request that sees the flag reads the new lane.
        self.replaced.store(true, Ordering::Release);
        // Stopped now, not only by the shutdown below: the built lane is
        // never dropped (`built` keeps it), and the shutdown runs only if
        // this runtime lives long enough to run it.
        old.stop();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                old.shutdown().await;
                new.forget_denials();
            });
        }
    }

    /// Replaces the resolver (`None`: every key gets the default); the
    /// per-key lanes are shut down and rebuilt on demand.
    pub(crate) fn set_resolver(&self, resolver: Option<Box<Resolver>>) {
        let _building = self.building();
        self.on.store(resolver.is_some(), Ordering::Release);
        self.resolver.store(resolver.map(Arc::new));
        let old = self.lanes.swap(Arc::new(Vec::new()));
        retire(Vec::clone(&old));
    }
}

/// Shuts lanes down in the background, where a runtime runs (a hybrid
/// lane gives its unused permits back); elsewhere they just stop when
/// the last decision holding them is done.
fn retire(lanes: Vec<Arc<Lane>>) {
    if lanes.is_empty() {
        return;
    }
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            for lane in lanes {
                lane.shutdown().await;
            }
        });
    }
}
