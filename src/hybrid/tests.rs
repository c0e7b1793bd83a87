//! The hybrid engine on a fake clock and the embedded store: leases,
//! refills, rollover, debt, eviction and give-back, without sleeping.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::algorithm::Algorithm;
use crate::algorithm::{Check, GiveBack, Lease, LeaseCall};
use crate::clock::{Clock, FakeClock};
use crate::decision::Source;
use crate::hybrid::holding::{Grant, NextLease};
use crate::nonzero;
use crate::quota::Quota;
use crate::store::MemoryStore;

/// A whole second, so fixed windows start at the origin.
const ORIGIN: Duration = Duration::from_secs(1_700_000_000);

struct Rig {
    clock: FakeClock,
    store: MemoryStore,
    engine: HybridEngine,
    counters: Arc<Counters>,
    params: Params,
    keys: KeyEncoder,
}

fn rig(quota: Quota, algorithm: Algorithm, config: HybridConfig) -> Rig {
    rig_with(quota, algorithm, config, None)
}

/// A rig whose hot path reads `fast` (see `TimeSource::split`), not the
/// rig's clock.
fn rig_with(
    quota: Quota,
    algorithm: Algorithm,
    config: HybridConfig,
    fast: Option<FakeClock>,
) -> Rig {
    rig_on(quota, algorithm, config, fast, |store, _| store.into())
}

/// A rig whose engine talks to `wrap(embedded store, clock)`.
fn rig_on(
    quota: Quota,
    algorithm: Algorithm,
    config: HybridConfig,
    fast: Option<FakeClock>,
    wrap: impl FnOnce(MemoryStore, FakeClock) -> crate::store::Store,
) -> Rig {
    let clock = FakeClock::new(ORIGIN);
    let store = MemoryStore::with_clock(clock.clone());
    let counters = Arc::new(Counters::new("test"));
    let params = Params::new(&quota, algorithm);
    let keys = KeyEncoder::new("t");
    let engine = HybridEngine::start(
        config,
        Wiring {
            limiter: 1,
            store: wrap(store.clone(), clock.clone()),
            keys: keys.clone(),
            params,
            clock: Some(Arc::new(clock.clone())),
            fast_clock: fast.map(|f| {
                (
                    Arc::new(f) as Arc<dyn crate::clock::Clock>,
                    Duration::from_millis(50),
                )
            }),
            counters: counters.clone(),
            max_cost: algorithm.max_cost(&quota),
            reconciler: Arc::new(crate::failure::Reconciler::new(Arc::new(clock.clone()))),
            local_refunds: Default::default(),
            store_clock: crate::failure::FailureLayer::new(crate::failure::LayerParts {
                policy: crate::failure::FailurePolicy::FailOpen,
                algorithm,
                clock: Arc::new(clock.clone()),
                store: None,
                keys: keys.clone(),
                params,
                counters: counters.clone(),
            })
            .store_clock,
        },
    )
    .unwrap();
    Rig {
        clock,
        store,
        engine,
        counters,
        params,
        keys,
    }
}

impl Rig {
    async fn check(&self, key: &str, cost: u64) -> Decision {
        self.engine.check(key, cost).await.expect("store answers")
    }

    /// Runs the sync task's work now, as its wake-up would.
    async fn sync(&self) {
        sync::round(&self.engine.shared).await;
    }

    fn maintain(&self) {
        sync::maintain(&self.engine.shared, None);
    }

    fn round_trips(&self) -> u64 {
        self.counters.round_trips.get()
    }

    fn holding(&self, key: &str) -> Arc<Holding> {
        self.engine
            .shared
            .holdings
            .get(key)
            .expect("tracked")
            .clone()
    }

    /// What the store has counted in the current window.
    fn store_count(&self, key: &str) -> i64 {
        let now = self.clock.now().as_micros() as u64;
        let window = (now / self.params.period_us) as i64;
        self.store
            .count_in_window(&self.keys.store_key(key, Algorithm::FixedWindow), window)
            .unwrap_or(0)
    }
}

/// A lease taken directly from the store, as another process would: all
/// of `want` (share cap 1, taken whole), from window `min_window` on.
fn raw_lease(key: String, want: u64, min_window: i64) -> LeaseCall {
    LeaseCall {
        key,
        want,
        share_cap: 1.0,
        debt: 0,
        debt_window: -1,
        min_window,
        need: want,
        cost: 1,
        op: None,
        holder: None,
        ceiling: 0,
        lease_id: 0,
        ahead_cap: 0,
    }
}

fn strict() -> HybridConfig {
    HybridConfig::strict().max_wait(Duration::from_millis(200))
}

#[tokio::test]
async fn a_cold_key_waits_for_one_lease_then_decides_locally() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict().lease_bounds(10, 10),
    );
    let d = r.check("k", 1).await;
    assert!(d.is_allowed());
    assert_eq!(d.source(), Source::Lease);
    assert_eq!(r.round_trips(), 1);
    for _ in 0..4 {
        assert_eq!(r.check("k", 1).await.source(), Source::Lease);
    }
    assert_eq!(r.round_trips(), 1, "permits were local");
    assert_eq!(r.store_count("k"), 10);
}

#[tokio::test]
async fn a_refill_is_requested_at_the_low_water_mark_before_the_holding_runs_dry() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict().lease_bounds(10, 10),
    );
    r.check("k", 1).await; // 9 left, low water 5
    for _ in 0..4 {
        r.check("k", 1).await;
    }
    let holding = r.holding("k");
    assert!(!holding.refill_pending(), "5 left: not yet");
    r.check("k", 1).await; // 4 left < 5
    assert!(holding.refill_pending());
    r.sync().await;
    assert_eq!(holding.permits(), 14);
    assert_eq!(r.store_count("k"), 20);
}

#[tokio::test]
async fn no_permit_of_a_window_is_spent_after_it_ends() {
    let config = strict().lease_bounds(50, 50).max_wait(Duration::ZERO);
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        config,
    );
    let first = r.check("k", 1).await; // cold: waits for nothing, denied
    assert!(!first.is_allowed());
    r.sync().await;
    assert!(r.check("k", 1).await.is_allowed());
    let holding = r.holding("k");
    assert_eq!(holding.permits(), 49);
    let window_0 = holding.window().expect("a lease is in place");
    // 3 ms margin and 500 ppm of drift over the 1 s left: from 996.5 ms
    // on, window 0's permits are void.
    r.clock.set(ORIGIN + Duration::from_micros(996_499));
    assert_eq!(r.check("k", 1).await.source(), Source::Lease);
    r.clock.set(ORIGIN + Duration::from_micros(996_500));
    let d = r.check("k", 1).await;
    assert!(
        !d.is_allowed(),
        "48 permits held, but their window is about to end"
    );
    assert_eq!(r.counters.stranded.get(), 1, "the permit taken too late");
    // The refill that denial asked for is a pre-lease of window 1.
    r.sync().await;
    assert!(holding.has_next());
    assert_eq!(holding.next_permits(), 50);
    // Asked at 996.5 ms: the window starts 3.5 ms later, plus the margin
    // (3 ms and the drift over the 1 003.5 ms to its end). Until then the
    // store may be in either window: a request spends a permit of each,
    // so whichever it is in has paid for it.
    for at in [996_500, 1_003_499] {
        r.clock.set(ORIGIN + Duration::from_micros(at));
        let d = r.check("k", 1).await;
        assert!(d.is_allowed(), "at {at} µs");
        assert_eq!(d.source(), Source::Lease);
    }
    assert_eq!(holding.next_permits(), 48);
    assert_eq!(holding.window(), Some(window_0), "not yet in place");
    r.clock.set(ORIGIN + Duration::from_micros(1_003_502));
    let d = r.check("k", 1).await;
    assert!(d.is_allowed());
    assert_eq!(d.source(), Source::Lease);
    assert_eq!(holding.window(), Some(window_0 + 1));
    assert_eq!(holding.permits(), 47);
    // Window 0: 50 leased, 2 spent before it ended, 48 stranded (three
    // taken too late, two of them paying for admissions paired with
    // window 1's; 45 replaced at the promotion).
    assert_eq!(r.counters.stranded.get(), 48);
    assert_eq!(r.store_count("k"), 50, "window 1's count");
}

/// Across the boundary, an admission costs one permit of each window: the
/// take that found the current lease late already paid its side.
#[tokio::test]
async fn an_admission_across_the_boundary_costs_one_permit_of_each_window() {
    let config = strict().lease_bounds(50, 50).max_wait(Duration::ZERO);
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        config,
    );
    assert!(!r.check("k", 1).await.is_allowed());
    r.sync().await;
    assert!(r.check("k", 1).await.is_allowed());
    let holding = r.holding("k");
    r.clock.set(ORIGIN + Duration::from_micros(996_500));
    assert!(!r.check("k", 1).await.is_allowed(), "no pre-lease yet");
    r.sync().await;
    let (current, next) = (holding.permits(), holding.next_permits());
    r.clock.set(ORIGIN + Duration::from_micros(999_000));
    for i in 1..=10 {
        let d = r.check("k", 1).await;
        assert!(d.is_allowed());
        // Counted in window 1: it resets when window 1 ends.
        assert!(d.reset_after() > Duration::from_secs(1), "{d:?}");
        assert_eq!(holding.permits(), current - i);
        assert_eq!(holding.next_permits(), next - i);
    }
}

#[tokio::test]
async fn hot_keys_lease_the_next_window_before_the_boundary() {
    let config = strict()
        .lease_bounds(100, 100)
        .prelease_lead(Duration::from_millis(100));
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        config,
    );
    assert!(r.check("k", 1).await.is_allowed());
    r.clock.set(ORIGIN + Duration::from_millis(950));
    assert!(r.check("k", 1).await.is_allowed());
    r.sync().await;
    let holding = r.holding("k");
    assert!(holding.has_next(), "pre-leased");
    let trips = r.round_trips();
    r.clock.set(ORIGIN + Duration::from_millis(1_010));
    assert!(r.check("k", 1).await.is_allowed());
    assert_eq!(r.round_trips(), trips, "the boundary cost no round trip");
}

#[tokio::test]
async fn optimistic_credit_is_bounded_reported_and_counted_as_overshoot() {
    let quota = Quota::per_second(nonzero!(100));
    let r = rig(quota, Algorithm::FixedWindow, HybridConfig::optimistic(5));
    // Another process takes the whole window first.
    let store_key = r.keys.store_key("k", Algorithm::FixedWindow);
    r.store
        .run_now(&Check {
            key: &store_key,
            params: &r.params,
            cost: 100,
        })
        .unwrap();
    r.clock.set(ORIGIN + Duration::from_millis(100));
    assert!(r.check("warm", 1).await.is_allowed());
    for _ in 0..5 {
        assert_eq!(r.check("k", 1).await.source(), Source::Credit);
    }
    assert!(
        !r.check("k", 1).await.is_allowed(),
        "credit is capped at max_debt"
    );
    r.sync().await;
    assert_eq!(r.counters.overshoot.get(), 5);
    assert_eq!(r.store_count("k"), 105, "the store records the overshoot");
    let trips = r.round_trips();
    for _ in 0..100 {
        let d = r.check("k", 1).await;
        assert_eq!(d.source(), Source::DeniedCache);
        assert!(d.retry_after().unwrap() <= Duration::from_micros(1_003_500));
    }
    assert_eq!(r.round_trips(), trips, "denials were local");
}

#[tokio::test]
async fn no_first_touch_credit_before_the_store_clock_is_known() {
    // Debt of an unknown window would be charged to whatever window the
    // store is in when the report lands, hiding overshoot.
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        HybridConfig::optimistic(5),
    );
    assert_ne!(r.check("k", 1).await.source(), Source::Credit);
    // Near a boundary, where the store may be on either side: no credit.
    r.clock.set(ORIGIN + Duration::from_micros(1_999_999));
    assert_ne!(r.check("fresh", 1).await.source(), Source::Credit);
}

#[tokio::test]
async fn a_peek_is_answered_even_while_the_key_is_known_exhausted() {
    let r = rig(
        Quota::per_second(nonzero!(10)),
        Algorithm::FixedWindow,
        strict().lease_bounds(10, 10),
    );
    for _ in 0..10 {
        assert!(r.check("k", 1).await.is_allowed());
    }
    assert!(!r.check("k", 1).await.is_allowed());
    assert_eq!(r.check("k", 1).await.source(), Source::DeniedCache);
    let peek = r.check("k", 0).await;
    assert!(peek.is_allowed(), "a peek takes nothing: {peek:?}");
}

#[tokio::test]
async fn an_evicted_holding_cannot_take_its_credit_twice_in_a_window() {
    // max_keys 1: touching "b" evicts "a", whose debt is queued, not yet
    // reported; a recreated "a" must count it against max_debt.
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        HybridConfig::optimistic(3).max_keys(1),
    );
    let store_key = r.keys.store_key("a", Algorithm::FixedWindow);
    r.store
        .run_now(&Check {
            key: &store_key,
            params: &r.params,
            cost: 100,
        })
        .unwrap();
    r.clock.set(ORIGIN + Duration::from_millis(100));
    assert!(r.check("warm", 1).await.is_allowed());
    let warm = r.holding("warm");
    r.engine.shared.holdings.remove("warm");
    r.engine
        .shared
        .retire(&warm, r.clock.now().as_micros() as u64);
    let mut credit = 0;
    for _ in 0..10 {
        if r.check("a", 1).await.source() == Source::Credit {
            credit += 1;
        }
    }
    assert_eq!(credit, 3);
    // Evict "a" (its debt goes to the report queue), then recreate it.
    let holding = r.holding("a");
    r.engine.shared.holdings.remove("a");
    r.engine
        .shared
        .retire(&holding, r.clock.now().as_micros() as u64);
    for _ in 0..10 {
        if r.check("a", 1).await.source() == Source::Credit {
            credit += 1;
        }
    }
    assert_eq!(credit, 3, "the queued debt still counts against max_debt");
    r.sync().await;
    assert_eq!(r.counters.overshoot.get(), 3);
}

#[tokio::test]
async fn covered_credit_is_not_overshoot() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        HybridConfig::optimistic(5),
    );
    // A reply for any key tells the process the store's window, which a
    // key's first-touch credit needs.
    r.clock.set(ORIGIN + Duration::from_millis(100));
    assert!(r.check("warm", 1).await.is_allowed());
    for _ in 0..3 {
        assert_eq!(r.check("k", 1).await.source(), Source::Credit);
    }
    r.sync().await;
    assert_eq!(r.counters.overshoot.get(), 0);
    assert!(r.store_count("k") >= 4, "debt recorded plus a lease");
}

#[tokio::test]
async fn denied_keys_cost_no_round_trip_until_their_reset() {
    let r = rig(
        Quota::per_second(nonzero!(10)),
        Algorithm::FixedWindow,
        strict().lease_bounds(10, 10),
    );
    for _ in 0..10 {
        assert!(r.check("k", 1).await.is_allowed());
    }
    let d = r.check("k", 1).await; // empty: refill, store has nothing
    assert!(!d.is_allowed());
    let trips = r.round_trips();
    for _ in 0..1000 {
        assert_eq!(r.check("k", 1).await.source(), Source::DeniedCache);
    }
    assert_eq!(r.round_trips(), trips);
    // Denied until the window has surely ended: its end plus the margin
    // (3 ms; no drift allowance, which would tell an hour's client
    // seconds too many).
    r.clock.set(ORIGIN + Duration::from_micros(1_002_999));
    assert_eq!(r.check("k", 1).await.source(), Source::DeniedCache);
    r.clock.set(ORIGIN + Duration::from_micros(1_003_000));
    assert!(r.check("k", 1).await.is_allowed());
    assert_eq!(r.round_trips(), trips + 1);
}

#[tokio::test]
async fn idle_keys_are_evicted_and_their_permits_given_back() {
    let config = strict()
        .lease_bounds(50, 50)
        .idle_ttl(Duration::from_secs(5));
    let r = rig(
        Quota::new(1000, Duration::from_secs(60)).unwrap(),
        Algorithm::FixedWindow,
        config,
    );
    for _ in 0..10 {
        r.check("k", 1).await;
    }
    assert_eq!(r.store_count("k"), 50);
    r.clock.advance(Duration::from_secs(6));
    r.maintain();
    assert_eq!(r.engine.local_keys(), 0);
    r.sync().await;
    assert_eq!(r.store_count("k"), 10, "40 unused permits went back");
    assert_eq!(r.counters.given_back.get(), 40);
}

#[tokio::test]
async fn the_map_is_bounded_by_max_keys() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict().max_keys(2),
    );
    assert_eq!(r.check("a", 1).await.source(), Source::Lease);
    assert_eq!(r.check("b", 1).await.source(), Source::Lease);
    let d = r.check("c", 1).await;
    assert!(d.is_allowed());
    assert_eq!(d.source(), Source::Store, "no room: decided by the store");
    assert_eq!(r.engine.local_keys(), 2);
    r.engine.reconfigure(strict().max_keys(1)).unwrap();
    r.clock.advance(Duration::from_millis(10));
    r.check("b", 0).await;
    r.maintain();
    assert_eq!(r.engine.local_keys(), 1);
    assert!(
        r.engine.shared.holdings.get("b").is_some(),
        "the least recently used went"
    );
}

#[tokio::test]
async fn shutdown_gives_every_unused_permit_back() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict().lease_bounds(40, 40),
    );
    for _ in 0..7 {
        r.check("k", 1).await;
    }
    assert_eq!(r.store_count("k"), 40);
    r.engine.shutdown().await;
    assert_eq!(r.store_count("k"), 7);
    let d = r.check("k", 1).await;
    assert_eq!(d.source(), Source::Store, "after shutdown, the exact path");
    assert_eq!(r.store_count("k"), 8);
}

#[tokio::test]
async fn token_bucket_leases_expire_after_their_horizon_and_go_back() {
    let config = strict()
        .lease_bounds(20, 20)
        .lease_ttl(Duration::from_secs(1))
        .prelease_lead(Duration::ZERO);
    let r = rig(
        Quota::per_second(nonzero!(10)).with_burst(nonzero!(50)),
        Algorithm::TokenBucket,
        config,
    );
    assert!(r.check("k", 1).await.is_allowed());
    assert_eq!(r.round_trips(), 1);
    r.clock.set(ORIGIN + Duration::from_micros(996_499));
    assert_eq!(r.check("k", 1).await.source(), Source::Lease);
    assert_eq!(r.round_trips(), 1, "18 permits still valid");
    // Past the horizon (minus the 3 ms margin and 0.5 ms of drift) the 18
    // are void: a new lease replaces them and they go back to the bucket.
    r.clock.set(ORIGIN + Duration::from_micros(996_500));
    assert!(r.check("k", 1).await.is_allowed());
    // The permit taken late goes back before the key's lease call (a
    // key's give-backs go first), the new lease replaces the other 17,
    // which go back after it.
    assert_eq!(r.round_trips(), 4);
    r.sync().await;
    // Had the 18 stayed in the bucket (30 + 18 = 48), the second of refill
    // (+10) would have overflowed its cap of 50 by 8: only 10 may go back,
    // the other 8 are stranded (the bounds issue's give-back rule).
    assert_eq!(r.counters.given_back.get(), 10);
    assert_eq!(r.counters.stranded.get(), 8);
}

/// A key asked for less often than its leases last: every request finds
/// its lease expired. The permit it took late and the rest of the lease go
/// back to the bucket, under the lease's own origin. Before, a new lease
/// that replaced an empty one kept the old origin's higher level, which
/// capped every later give-back to nothing: 6 of 10 were admitted.
#[tokio::test]
async fn a_token_bucket_used_less_often_than_its_leases_last_loses_nothing() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let r = rig(
            Quota::new(10, Duration::from_secs(3_600)).unwrap(),
            algorithm,
            strict(),
        );
        let mut admitted = 0;
        for i in 0..12u64 {
            r.clock.set(ORIGIN + Duration::from_millis(1_200 * i));
            if r.check("k", 1).await.is_allowed() {
                admitted += 1;
            }
            r.sync().await;
        }
        assert_eq!(admitted, 10, "{algorithm:?}");
        assert_eq!(r.counters.stranded.get(), 0, "{algorithm:?}");
    }
}

#[tokio::test]
async fn a_request_costing_more_than_a_lease_still_gets_one_large_enough() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict().lease_bounds(1, 5),
    );
    let d = r.check("k", 30).await;
    assert!(d.is_allowed());
    assert_eq!(r.store_count("k"), 30);
    assert!(!r.check("k", 101).await.is_allowed());
    assert_eq!(r.check("k", 101).await.retry_after(), None);
}

#[tokio::test]
async fn the_lease_script_shape_is_what_the_engine_expects() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict(),
    );
    let reply = r
        .store
        .run_now(&Lease {
            params: &r.params,
            call: &raw_lease("x".into(), 10, i64::MAX),
        })
        .unwrap();
    assert_eq!(reply.granted, 10);
    assert_eq!(reply.start_after_us, 1_000_000);
    assert_eq!(
        reply.window,
        (ORIGIN.as_micros() as u64 / 1_000_000) as i64 + 1
    );
}

#[tokio::test]
async fn a_round_ends_after_its_batches_so_maintenance_and_stop_get_a_turn() {
    let r = rig(
        Quota::per_second(nonzero!(1_000)),
        Algorithm::FixedWindow,
        strict().batch_size(1),
    );
    let s = &r.engine.shared;
    for i in 0..40 {
        let holding = s.insert(&format!("k{i}"), 0).expect("room");
        s.request_refill(&holding, false);
    }
    // 40 one-call batches: 16, 16, then the last 8.
    assert!(sync::round(s).await, "work is left after 16 batches");
    assert_eq!(r.round_trips(), 16);
    assert!(sync::round(s).await);
    assert_eq!(r.round_trips(), 32);
    assert!(!sync::round(s).await, "the queue is empty");
    assert_eq!(r.round_trips(), 40);
    assert!(r.holding("k39").permits() > 0);
}

#[tokio::test]
async fn an_active_key_is_preleased_by_the_sweep_before_its_window_ends() {
    let r = rig(
        Quota::new(100, Duration::from_secs(10)).unwrap(),
        Algorithm::FixedWindow,
        strict().lease_bounds(10, 10),
    );
    assert!(r.check("k", 1).await.is_allowed());
    // "idle" is used forty times at once (a thick holder: a thin one,
    // seen a few times a window, stays pre-leased for several windows).
    for _ in 0..40 {
        assert!(r.check("idle", 1).await.is_allowed());
        r.sync().await;
    }
    assert_eq!(r.round_trips(), 6, "a lease, and five for idle");
    // "k" is used again late in the window, thirty times (a thick holder,
    // with a rate that spends a share of the next window); "idle" is not.
    // Neither is near enough to the end for a request to pre-lease.
    r.clock.set(ORIGIN + Duration::from_secs(5));
    for _ in 0..30 {
        assert_eq!(r.check("k", 1).await.source(), Source::Lease);
        r.sync().await;
    }
    // Too early for the boundary's pre-leases. (Idle since, both keys
    // give back what they hold above a sixteenth of the limit: that
    // round trip is not a pre-lease.)
    r.clock.set(ORIGIN + Duration::from_millis(8_950));
    r.maintain();
    r.sync().await;
    assert!(!r.holding("k").has_next(), "too early for a pre-lease");
    let before = r.round_trips();
    // A tick, the pre-lease lead and 50 ms before the end: every active
    // key goes out at once.
    r.clock.set(ORIGIN + Duration::from_millis(9_880));
    r.maintain();
    r.sync().await;
    assert_eq!(
        r.round_trips(),
        before + 1,
        "one pre-lease, for the active key only"
    );
    assert!(r.holding("k").has_next());
    assert!(!r.holding("idle").has_next());
    // After the boundary the active key decides at once from its pre-lease.
    r.clock.set(ORIGIN + Duration::from_millis(10_050));
    let d = r.check("k", 1).await;
    assert!(d.is_allowed());
    assert_eq!(d.source(), Source::Lease);
    assert_eq!(r.round_trips(), before + 1, "no wait at the boundary");
}

/// A waiter whose window is over locally while the store is still in it,
/// and whose key has nothing left in the next window (another process
/// pre-leased all of it): denied until that window begins, not asking the
/// store again and again meanwhile.
#[tokio::test]
async fn an_exhausted_next_window_is_waited_for_not_asked_for_in_a_loop() {
    let r = rig(
        Quota::per_second(nonzero!(3)),
        Algorithm::FixedWindow,
        strict()
            .lease_bounds(1, 1)
            .prelease_lead(Duration::ZERO)
            .max_wait(Duration::from_millis(100)),
    );
    assert!(r.check("k", 1).await.is_allowed());
    assert_eq!(r.round_trips(), 1);
    // Another process takes all of the next window ahead of the boundary.
    let next = (ORIGIN.as_micros() as u64 / r.params.period_us) as i64 + 1;
    let taken = r
        .store
        .run_now(&Lease {
            params: &r.params,
            call: &raw_lease(r.keys.store_key("k", Algorithm::FixedWindow), 3, next),
        })
        .unwrap();
    assert_eq!((taken.granted, taken.window), (3, next));
    // 1.5 ms before the boundary: this holding's window is over locally (its
    // deadline is the end minus the margin), the store's is not.
    r.clock.set(ORIGIN + Duration::from_micros(998_500));
    let d = r.check("k", 1).await;
    assert!(!d.is_allowed());
    let asked = r.round_trips() - 1;
    assert!(asked <= 2, "{asked} lease calls for one denied request");
}

#[tokio::test]
async fn a_refill_landing_between_the_try_and_the_wait_is_used_not_asked_for_again() {
    let r = rig(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict().lease_bounds(10, 10),
    );
    let period = r.params.period_us;
    // Another request's refill lands after this one found the holding empty
    // and before it started waiting.
    *r.engine.shared.before_wait.lock().unwrap() = Some(Box::new(move |s, holding| {
        let now = s.time.precise_us();
        let window = (now / period) as i64;
        let end = (window as u64 + 1) * period;
        let grant = Grant {
            permits: 5,
            window,
            deadline: end,
            window_end: end,
            renew: false,
        };
        holding.install(grant, now);
        s.refilled(holding).notify_waiters();
    }));
    let d = r.check("k", 1).await;
    assert!(d.is_allowed());
    assert_eq!(d.source(), Source::Lease);
    assert_eq!(r.holding("k").permits(), 4);
    assert_eq!(r.round_trips(), 0, "the landed refill was asked for again");
}

/// A rig whose key "k" holds a lease of `lease` permits (one spent) and
/// is cached in this thread, the engine marked contended.
async fn stocked_rig(lease: u64) -> Rig {
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        strict().lease_bounds(lease, lease),
    );
    assert!(r.check("k", 1).await.is_allowed());
    cache_in_this_thread(&r, "k");
    r
}

/// Caches `key`'s holding in this thread (a miss caches every sixteenth time)
/// with the engine marked contended, as racing threads leave it.
fn cache_in_this_thread(r: &Rig, key: &str) {
    r.engine.shared.contended.store(true, Ordering::Relaxed);
    let mut cached = false;
    for _ in 0..16 {
        cached |= thread_cache::with(r.engine.id, key, |_, _| ()).is_some();
        if !cached {
            let entry = r.engine.shared.holdings.get(key).expect("tracked");
            if thread_cache::worth_caching() {
                thread_cache::put(r.engine.id, entry.value().clone(), 0);
            }
        }
    }
    assert!(thread_cache::with(r.engine.id, key, |_, _| ()).is_some());
}

#[tokio::test]
async fn a_contended_thread_spends_a_stock_of_its_own_and_the_holding_only_per_stock() {
    let r = stocked_rig(160).await;
    let holding = r.holding("k");
    assert_eq!(holding.permits(), 159);
    // One take: the cost and a sixteenth of what is left.
    let d = r.engine.try_fast("k", 1).expect("local");
    assert!(d.is_allowed());
    let stock = thread_cache::stock_for(158);
    assert_eq!(stock, 9);
    assert_eq!(holding.permits(), 158 - stock);
    // The stock is spent without touching the holding.
    for _ in 0..stock {
        assert!(r.engine.try_fast("k", 1).expect("local").is_allowed());
    }
    assert_eq!(holding.permits(), 158 - stock);
    // Then the next take; low down, no stock at all: every permit is
    // spent by whoever asks, none held back.
    let mut admitted = 1 + 1 + stock;
    while let Some(d) = r.engine.try_fast("k", 1) {
        if !d.is_allowed() {
            break;
        }
        admitted += 1;
    }
    assert_eq!(admitted, 160, "every leased permit, once");
    assert_eq!(holding.permits(), 0);
    assert_eq!(r.counters.stranded.get(), 0);
}

#[tokio::test]
async fn a_thread_stock_dies_with_its_lease_and_counts_as_stranded() {
    let r = stocked_rig(320).await;
    assert!(r.engine.try_fast("k", 1).expect("local").is_allowed());
    let holding = r.holding("k");
    let stock = thread_cache::stock_for(318);
    assert_eq!(holding.permits(), 318 - stock);
    // Past the window's end the stock is void: no decision from it.
    r.clock.advance(Duration::from_secs(1));
    assert!(r.engine.try_fast("k", 1).is_none(), "the slow path decides");
    assert!(
        r.counters.stranded.get() >= stock as u64,
        "{} stranded, {stock} in stock",
        r.counters.stranded.get()
    );
}

#[tokio::test]
async fn a_stock_too_small_for_a_cost_goes_back_to_its_holding() {
    let r = stocked_rig(320).await;
    assert!(r.engine.try_fast("k", 1).expect("local").is_allowed());
    let holding = r.holding("k");
    let stock = thread_cache::stock_for(318);
    // A cost above the stock: the stock goes back, the cost comes from
    // the holding (with a new stock of what is left).
    let cost = stock as u64 + 1;
    assert!(r.engine.try_fast("k", cost).expect("local").is_allowed());
    let left = 318 - cost as i64;
    assert_eq!(holding.permits(), left - thread_cache::stock_for(left));
    assert_eq!(r.counters.stranded.get(), 0);
}

#[tokio::test]
async fn a_fast_clock_running_ahead_never_starts_a_pre_lease_early() {
    // The kernel's coarse clock, anchored once, can read up to a tick
    // ahead of the precise one: a pre-lease must start by the precise one.
    let fast = FakeClock::new(ORIGIN);
    let r = rig_with(
        Quota::per_second(nonzero!(100)),
        Algorithm::FixedWindow,
        strict().lease_bounds(10, 10),
        Some(fast.clone()),
    );
    assert!(r.check("k", 1).await.is_allowed());
    let holding = r.holding("k");
    // Spend the window's lease, then hold a slice of the next window.
    while holding.permits() > 0 {
        assert!(r.engine.try_fast("k", 1).expect("local").is_allowed());
    }
    let start = (ORIGIN + Duration::from_secs(1)).as_micros() as u64;
    holding.hold_next(NextLease {
        permits: 10,
        window: (start / 1_000_000) as i64,
        start,
        deadline: start + 900_000,
        window_end: start + 1_000_000,
        low_water: 0,
    });
    // 1 ms before the boundary by the precise clock, 3 ms after it by the
    // fast one: nothing of the next window is spent.
    r.clock.set(ORIGIN + Duration::from_micros(999_000));
    fast.set(ORIGIN + Duration::from_micros(1_003_000));
    let early = r.engine.try_fast("k", 1);
    assert!(
        early.as_ref().is_none_or(|d| !d.is_allowed()),
        "spent from the next window before it began: {early:?}"
    );
    assert!(holding.has_next(), "still held for its window");
    // From the boundary on, it is promoted and spent.
    r.clock.set(ORIGIN + Duration::from_secs(1));
    assert!(r.engine.try_fast("k", 1).expect("local").is_allowed());
    assert!(!holding.has_next());
}
#[tokio::test]
async fn holders_asking_again_get_what_they_are_short_of_their_share_not_a_trickle() {
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        strict(),
    );
    let key = r.keys.store_key("k", Algorithm::FixedWindow);
    // Another process's lease, counted among the key's holders.
    let ask = |holder: &str, want: u64, id: u64| {
        let call = LeaseCall {
            holder: Some(holder.into()),
            share_cap: 0.5,
            ceiling: want,
            need: 1,
            lease_id: id,
            ..raw_lease(key.clone(), want, -1)
        };
        r.store
            .run_now(&Lease {
                params: &r.params,
                call: &call,
            })
            .unwrap()
    };
    // A window nobody held before: four holders' first leases of 10.
    for h in ["a", "b", "c", "d"] {
        assert_eq!(ask(h, 10, 1).granted, 10);
    }
    // Then each asks for far more: each is short of a quarter by 240, and
    // gets it, whatever its turn (a quarter of what was left each time
    // gave 240, 180, 135 and 101, and more rounds of asks after them).
    let second: Vec<u64> = ["c", "a", "d", "b"]
        .iter()
        .map(|h| ask(h, 900, 2).granted)
        .collect();
    assert_eq!(second, [240, 240, 240, 240]);
    assert_eq!(r.store_count("k"), 1000);
}

#[tokio::test]
async fn a_window_others_leased_in_full_is_learned_from_a_peek_in_a_batch_not_an_ask() {
    let r = peek_rig();
    a_full_peek(&r).await;
    let trips = r.round_trips();
    // What k holds is spent, then it is denied here without asking.
    let mut allowed = 0;
    loop {
        let d = r.check("k", 1).await;
        if !d.is_allowed() {
            assert_eq!(d.source(), Source::DeniedCache);
            break;
        }
        allowed += 1;
    }
    assert_eq!(allowed, 40 - 12);
    assert_eq!(r.round_trips(), trips, "no ask of the full window");
    assert_eq!(r.store_count("k"), 1000, "the peek took nothing");
}

#[tokio::test]
async fn a_peek_that_finds_room_leaves_the_key_asking_as_before() {
    let r = peek_rig();
    assert!(r.check("k", 1).await.is_allowed());
    // About 100 a second: k's next refill is not due soon enough to ride
    // with another key's lease (see `sync::Ahead`).
    for _ in 0..11 {
        r.clock.advance(Duration::from_millis(10));
        assert!(r.check("k", 1).await.is_allowed());
    }
    r.sync().await;
    r.clock.advance(Duration::from_millis(20));
    assert!(r.check("other", 1).await.is_allowed());
    assert_eq!(
        (r.counters.peeks.get(), r.counters.peeks_full.get()),
        (1, 0)
    );
    // Spent, k asks again and is served.
    let trips = r.round_trips();
    for _ in 0..40 {
        assert!(r.check("k", 1).await.is_allowed());
    }
    assert_eq!(r.round_trips(), trips + 1);
    assert_eq!(r.store_count("k"), 60, "a third lease of 20");
}

/// A busy key `k` holding 40 of the current window (12 spent), the other
/// 960 leased by another process, and a peek sent with another key's
/// first lease that finds the window full. Returns k's store key.
async fn a_full_peek(r: &Rig) -> String {
    assert!(r.check("k", 1).await.is_allowed());
    // About 100 a second: k's next refill is not due soon enough to ride
    // with another key's lease (see `sync::Ahead`).
    for _ in 0..11 {
        r.clock.advance(Duration::from_millis(10));
        assert!(r.check("k", 1).await.is_allowed());
    }
    r.sync().await;
    let key = r.keys.store_key("k", Algorithm::FixedWindow);
    assert_eq!(
        r.store
            .run_now(&Lease {
                params: &r.params,
                call: &raw_lease(key.clone(), 960, -1)
            })
            .unwrap()
            .granted,
        960
    );
    r.clock.advance(Duration::from_millis(20));
    // The peek goes with another key's first lease: one round trip.
    let trips = r.round_trips();
    assert!(r.check("other", 1).await.is_allowed());
    assert_eq!(r.round_trips(), trips + 1);
    assert_eq!(
        (r.counters.peeks.get(), r.counters.peeks_full.get()),
        (1, 1)
    );
    key
}

/// 1 000 per 10 s: k's rate (about 100 a second) needs more of the window
/// than the others leave it, yet its refill is not due within a ride's
/// horizon (100 ms), so what it learns comes from a peek.
fn peek_rig() -> Rig {
    peek_rig_of(Quota::new(1000, Duration::from_secs(10)).unwrap())
}

fn peek_rig_of(quota: Quota) -> Rig {
    rig(
        quota,
        Algorithm::FixedWindow,
        strict().lease_bounds(20, 20).prelease_lead(Duration::ZERO),
    )
}

#[tokio::test]
async fn a_peek_is_believed_only_for_a_while_so_permits_given_back_later_are_found() {
    // 1 000 per 10 s: a window long enough to outlast a peek's word.
    let r = peek_rig();
    let key = a_full_peek(&r).await;
    // The other process gives 500 back; k runs out after the peek's trust
    // (a second here): it asks, and finds them.
    let window = (r.clock.now().as_micros() as u64 / r.params.period_us) as i64;
    let back = crate::algorithm::GiveBackCall {
        key,
        returned: 500,
        window,
        origin: Default::default(),
        op: crate::algorithm::OpId::admission(u64::MAX - 7),
        remember_us: 0,
        refund: false,
    };
    assert_eq!(
        r.store
            .run_now(&GiveBack {
                params: &r.params,
                call: &back
            })
            .unwrap(),
        crate::algorithm::Refunded::Now(500)
    );
    r.clock.advance(Duration::from_millis(1_010));
    for _ in 0..28 {
        assert!(r.check("k", 1).await.is_allowed());
    }
    let trips = r.round_trips();
    assert!(
        r.check("k", 1).await.is_allowed(),
        "asked, not denied on the old peek"
    );
    assert_eq!(r.round_trips(), trips + 1);
}

#[tokio::test]
async fn a_full_peek_of_a_window_the_holding_never_ran_out_in_denies_nothing_after_it() {
    let r = peek_rig();
    a_full_peek(&r).await;
    // k's demand stops; its window ends with 28 unspent. 1 ms into the
    // next (empty) window it is served.
    let now = r.clock.now().as_micros() as u64;
    let period = r.params.period_us;
    r.clock
        .advance(Duration::from_micros(period - now % period + 1_000));
    let d = r.check("k", 1).await;
    assert!(d.is_allowed(), "{:?}", d.source());
}

#[tokio::test]
async fn a_watched_holding_is_not_kept_alive_once_evicted() {
    let r = rig(
        Quota::new(1000, Duration::from_secs(10)).unwrap(),
        Algorithm::FixedWindow,
        strict()
            .lease_bounds(20, 20)
            .prelease_lead(Duration::ZERO)
            .idle_ttl(Duration::from_secs(1)),
    );
    assert!(r.check("k", 1).await.is_allowed());
    // About 100 a second: k's next refill is not due soon enough to ride
    // with another key's lease (see `sync::Ahead`).
    for _ in 0..11 {
        r.clock.advance(Duration::from_millis(10));
        assert!(r.check("k", 1).await.is_allowed());
    }
    r.sync().await;
    assert_eq!(r.engine.shared.watch.watched.lock().unwrap().len(), 1);
    let weak = Arc::downgrade(&r.holding("k"));
    for _ in 0..60 {
        r.clock.advance(Duration::from_secs(5));
        r.maintain();
    }
    assert!(r.engine.shared.holdings.get("k").is_none(), "evicted");
    *r.engine.shared.outbox.refills.lock().unwrap() = Default::default();
    assert!(weak.upgrade().is_none(), "the watch keeps no holding alive");
}

/// A rig where `b`, leased at most 40 at a time, spends a permit a
/// millisecond: its first lease (31), then its own refill at its mark
/// (which seeds its rate), after which it holds 46 with a mark of 20.
async fn b_with_a_known_rate(config: HybridConfig) -> Rig {
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        config.prelease_lead(Duration::ZERO).lease_bounds(1, 40),
    );
    assert!(r.check("b", 1).await.is_allowed());
    while r.round_trips() < 2 {
        r.clock.advance(Duration::from_millis(1));
        assert!(r.check("b", 1).await.is_allowed());
        r.sync().await;
    }
    let b = r.holding("b");
    assert_eq!(b.low_water(), 20);
    assert_eq!(b.permits(), 46);
    r
}

/// `b` (see [`b_with_a_known_rate`]) spends `spent` more over `spent` ms;
/// then `a`'s first request goes out.
async fn b_spending_then_a_asks(spent: u32) -> Rig {
    let r = b_with_a_known_rate(strict()).await;
    for _ in 0..spent {
        r.clock.advance(Duration::from_millis(1));
        assert!(r.check("b", 1).await.is_allowed());
    }
    r.clock.advance(Duration::from_millis(1));
    assert!(r.check("a", 1).await.is_allowed());
    r
}

#[tokio::test]
async fn a_refill_due_soon_rides_with_another_keys_lease() {
    // b spends a permit a millisecond: 21 more and it is at its mark.
    let r = b_spending_then_a_asks(5).await;
    assert_eq!(r.round_trips(), 3, "b's refill went with a's first lease");
    assert_eq!(r.counters.rides.get(), 1);
    let b = r.holding("b");
    assert!(!b.refill_pending());
    assert!(!b.refill_in_flight());
    let held = b.permits();
    assert!(held > 60, "a lease sized by b's rate, not a permit: {held}");
    // b spends well past its old mark without a round trip of its own.
    for _ in 0..30 {
        r.clock.advance(Duration::from_millis(1));
        assert!(r.check("b", 1).await.is_allowed());
    }
    assert_eq!(r.round_trips(), 3);
}

/// `b` takes its first lease (31 of 1 000, a mark of 7; its rate not
/// known yet) and spends `spent` more, a permit a millisecond.
async fn b_first_lease_spent(spent: u32) -> Rig {
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        strict().prelease_lead(Duration::ZERO),
    );
    assert!(r.check("b", 1).await.is_allowed());
    for _ in 0..spent {
        r.clock.advance(Duration::from_millis(1));
        assert!(r.check("b", 1).await.is_allowed());
    }
    r
}

/// After `b`'s first lease and a burst (see [`b_first_lease_spent`]),
/// `a`'s first lease goes out: b's refill does not ride along, b keeps
/// its first lease, and another process gets the rest of the window.
async fn a_first_lease_does_not_ride(r: Rig, held: i64) {
    r.clock.advance(Duration::from_millis(2));
    assert!(r.check("a", 1).await.is_allowed());
    r.sync().await;
    assert_eq!(r.counters.rides.get(), 0);
    assert_eq!(r.holding("b").permits(), held);
    assert_eq!(r.store_count("b"), 31);
    let key = r.keys.store_key("b", Algorithm::FixedWindow);
    let other = r
        .store
        .run_now(&Lease {
            params: &r.params,
            call: &raw_lease(key, 1000, -1),
        })
        .unwrap();
    assert_eq!(other.granted, 969, "another process gets the rest");
}

#[tokio::test]
async fn a_first_lease_never_rides_so_a_short_burst_does_not_size_the_window() {
    // b's rate is not known at its first grant. A ride would seed it from
    // the burst and lease b the rest of the window (it did: eight requests
    // 1 ms apart, then silence, left b 991 of 1 000; twelve, 987).
    a_first_lease_does_not_ride(b_first_lease_spent(8).await, 22).await;
    a_first_lease_does_not_ride(b_first_lease_spent(12).await, 18).await;
    // One request of cost 12 did the same.
    let r = b_first_lease_spent(0).await;
    r.clock.advance(Duration::from_millis(1));
    assert!(r.check("b", 12).await.is_allowed());
    a_first_lease_does_not_ride(r, 18).await;
}

#[tokio::test]
async fn a_ride_dropped_before_it_is_answered_leaves_its_holding_free_to_ask() {
    use crate::store::distant::Distant;
    use std::future::Future;
    // A store a second away: a round is still waiting when it is dropped.
    let faulty = std::sync::Mutex::new(None);
    let r = rig_on(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        strict().prelease_lead(Duration::ZERO).lease_bounds(1, 40),
        None,
        |store, _| {
            let store = Distant::new(store);
            *faulty.lock().unwrap() = Some(store.clone());
            store.into()
        },
    );
    let faulty = faulty.into_inner().unwrap().unwrap();
    // b's first lease, then its own refill at its mark: its rate is known.
    assert!(r.check("b", 1).await.is_allowed());
    while r.round_trips() < 2 {
        r.clock.advance(Duration::from_millis(1));
        assert!(r.check("b", 1).await.is_allowed());
        r.sync().await;
    }
    for _ in 0..5 {
        r.clock.advance(Duration::from_millis(1));
        assert!(r.check("b", 1).await.is_allowed());
    }
    let leased = r.store_count("b");
    // a's first lease is queued; the round that would carry it and b's
    // ride is dropped before the store answers.
    r.engine.shared.request_refill(
        &r.engine
            .shared
            .insert("a", r.clock.now().as_micros() as u64)
            .unwrap(),
        true,
    );
    faulty.set_round_trip(Duration::from_secs(1));
    {
        let round = sync::round(&r.engine.shared);
        tokio::pin!(round);
        let waiting =
            std::future::poll_fn(|cx| std::task::Poll::Ready(round.as_mut().poll(cx).is_pending()));
        assert!(waiting.await, "the round waits on the store");
        assert_eq!(r.counters.rides.get(), 1);
    }
    let b = r.holding("b");
    assert!(!b.refill_pending());
    assert!(!b.refill_in_flight());
    assert_eq!(r.store_count("b"), leased, "nothing of the ride was leased");
    // b spends down to its mark and asks for itself.
    let mark = b.low_water();
    while b.permits() > mark {
        r.clock.advance(Duration::from_millis(1));
        assert!(r.check("b", 1).await.is_allowed());
    }
    assert!(!b.refill_pending(), "at its mark");
    r.clock.advance(Duration::from_millis(1));
    assert!(r.check("b", 1).await.is_allowed());
    assert!(b.refill_pending(), "asked");
}

#[tokio::test]
async fn a_pre_leased_window_stays_watched_while_the_current_one_is_denied() {
    // k's leases are 20 at most; another process takes what k leaves of
    // every window.
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        strict().lease_bounds(20, 20),
    );
    let key = r.keys.store_key("k", Algorithm::FixedWindow);
    let period = r.params.period_us;
    let now_us = |r: &Rig| r.clock.now().as_micros() as u64;
    let window = |r: &Rig| (now_us(r) / period) as i64;
    assert!(r.check("k", 1).await.is_allowed());
    // About 100 a second: k's next refill is not due soon enough to ride
    // with another key's lease (see `sync::Ahead`).
    for _ in 0..11 {
        r.clock.advance(Duration::from_millis(10));
        assert!(r.check("k", 1).await.is_allowed());
    }
    r.sync().await;
    let rest = |r: &Rig, min_window: i64| {
        r.store
            .run_now(&Lease {
                params: &r.params,
                call: &raw_lease(key.clone(), 1000, min_window),
            })
            .unwrap()
            .granted
    };
    assert!(rest(&r, -1) > 900);
    // k spends what it holds, asks, gets nothing: denied for the window.
    let mut denied = false;
    for _ in 0..60 {
        if !r.check("k", 1).await.is_allowed() {
            denied = true;
            break;
        }
    }
    assert!(denied);
    // Near the window's end k is pre-leased the next one, of which the
    // other process has already taken 950, and watched (what is left
    // falls short of k's rate); the other takes the rest.
    let w = window(&r);
    r.clock
        .advance(Duration::from_micros(period - now_us(&r) % period - 60_000));
    assert_eq!(
        r.store
            .run_now(&Lease {
                params: &r.params,
                call: &raw_lease(key.clone(), 950, w + 1)
            })
            .unwrap()
            .granted,
        950
    );
    r.maintain();
    r.sync().await;
    let held = r.holding("k").next_permits();
    assert!(held > 0, "pre-leased");
    assert_eq!(rest(&r, w + 1), 50 - held as u64, "the rest taken");
    // A batch goes out (another key's first lease) while k is still
    // denied in the current window: the watch of the next one stays.
    r.clock.advance(Duration::from_millis(20));
    assert!(r.check("other", 1).await.is_allowed());
    assert_eq!(r.counters.peeks.get(), 0, "not due before its window");
    // The next window: k spends from its pre-lease; a batch goes out with
    // the peek, which finds the window full.
    r.clock
        .advance(Duration::from_micros(period - now_us(&r) % period + 5_000));
    assert_eq!(window(&r), w + 1);
    assert!(r.check("k", 1).await.is_allowed());
    assert!(r.check("other2", 1).await.is_allowed());
    assert_eq!(
        (r.counters.peeks.get(), r.counters.peeks_full.get()),
        (1, 1)
    );
    // k spends the rest of its 20 and is denied here, without an ask.
    let trips = r.round_trips();
    let mut allowed = 1;
    loop {
        let d = r.check("k", 1).await;
        if !d.is_allowed() {
            assert_eq!(d.source(), Source::DeniedCache);
            break;
        }
        allowed += 1;
    }
    assert_eq!(allowed, held);
    assert_eq!(r.round_trips(), trips, "no ask of the full window");
}

#[tokio::test]
async fn a_burst_of_new_keys_scans_the_refills_due_soon_once_per_pace_not_per_batch() {
    let r = rig(
        Quota::per_second(nonzero!(1000)),
        Algorithm::FixedWindow,
        strict().prelease_lead(Duration::ZERO),
    );
    // Each new key's first lease is a batch of its own; each key is noted
    // as one whose refill may ride along later.
    let now = r.clock.now().as_micros() as u64;
    let window = (now / r.params.period_us) as i64;
    for i in 0..300 {
        let key = format!("k{i}");
        assert!(r.check(&key, 1).await.is_allowed());
        sync::note_ahead(&r.engine.shared, &r.holding(&key), window, now);
    }
    let entries = r.engine.shared.watch.ahead.lock().unwrap().len();
    assert!(entries > sync::RIDE_SCAN_ALWAYS, "{entries} entries");
    let scanned = || r.engine.shared.watch.ride_scan_at.load(Ordering::Relaxed);
    let first = scanned();
    // Another batch a millisecond later: not scanned again (the pace for
    // a 1 s period is 12.5 ms).
    r.clock.advance(Duration::from_millis(1));
    assert!(r.check("late", 1).await.is_allowed());
    assert_eq!(scanned(), first);
    // Once the pace has passed, the next batch scans.
    r.clock.advance(Duration::from_millis(13));
    assert!(r.check("later", 1).await.is_allowed());
    assert!(scanned() > first);
}

/// A key asked about once a window, far under its limit, finds its next
/// window's permits in place: a thin holder is pre-leased (a few permits,
/// at a time of its own in the window's second half), and the first
/// request after the boundary costs no round trip.
#[tokio::test]
async fn a_thin_key_far_under_its_limit_is_preleased() {
    let r = rig(
        Quota::new(100, Duration::from_secs(1)).unwrap(),
        Algorithm::FixedWindow,
        strict(),
    );
    let at = |window: u64, ms: u64| ORIGIN + Duration::from_millis(window * 1_000 + ms);
    let mut waits = Vec::new();
    for window in 0..8 {
        for tick in 0..10 {
            r.clock.set(at(window, tick * 100 + 50));
            if tick == 2 {
                let trips = r.round_trips();
                assert!(r.check("thin", 1).await.is_allowed());
                if r.round_trips() > trips {
                    waits.push(window);
                }
            }
            r.maintain();
            r.sync().await;
        }
    }
    // The first windows, until the key's rate is known, ask; then none.
    assert!(
        waits.iter().all(|&w| w < 3),
        "requests waited on the store in windows {waits:?}"
    );
    assert!(
        r.holding("thin").has_next(),
        "the next window is pre-leased"
    );
}

/// A thin holder whose permits run out late in a window, its next
/// window's pre-lease already held, is served from the current window
/// (far under its limit), not made to wait for the next one past
/// `max_wait` and denied.
#[tokio::test]
async fn a_thin_holder_out_of_permits_before_its_pre_lease_asks_the_current_window() {
    let quota = Quota::per_second(nonzero!(100));
    let r = rig(quota, Algorithm::FixedWindow, strict());
    // Three requests a window for a few windows: a thin holder, pre-leased.
    for window in 0..6u64 {
        for ms in (0..1_000u64).step_by(10) {
            r.clock
                .set(ORIGIN + Duration::from_millis(window * 1_000 + ms + 5));
            if ms == 300 || ms == 600 || ms == 900 {
                assert!(r.check("k", 1).await.is_allowed());
            }
            r.maintain();
            r.sync().await;
        }
    }
    // Late in window 6, the next window's pre-lease held: spend every
    // local permit, then ask once more.
    r.clock.set(ORIGIN + Duration::from_millis(6_950));
    r.maintain();
    r.sync().await;
    let holding = r.holding("k");
    assert!(holding.has_next(), "window 7 is pre-leased");
    while r.engine.try_fast("k", 1).is_some() {}
    let trips = r.round_trips();
    let d = r.check("k", 1).await;
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.source(), Source::Lease);
    assert!(r.round_trips() > trips, "asked the current window");
    assert!(r.store_count("k") < 100);
}
