//! The replica's division on an injected clock: its own `Instant`s and a
//! [`FakeClock`] for the embedded store, moved together.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tokio::sync::mpsc;
use tonic::Status;

use super::bucket::Given;
use super::{Inner, Rlqs, ASSIGNMENT_TTL, DELIVERY, RENEW, SILENT};
use crate::config::Config;
use crate::share::{RateShare, ShareCall};
use crate::table::{Mode, Settings, Table};
use slicelimit::clock::FakeClock;
use slicelimit::FailurePolicy;
use slicelimit::MemoryStore;

type Inbox = mpsc::Receiver<Result<RateLimitQuotaResponse, Status>>;

/// The assignments for demands of 30, 90 and 180 a second on a bucket of
/// 100: claims 32, 92, 182 (demand and a reserve of 2); the first is met,
/// the others split the remaining 68, each a bucket of 2 tokens.
const FAIR_30_90_180: [Given; 3] = [
    Given {
        rate: 30,
        tokens: 2,
    },
    Given {
        rate: 32,
        tokens: 2,
    },
    Given {
        rate: 32,
        tokens: 2,
    },
];

fn rules(limit: &str) -> String {
    format!(
        "domain: api\nrlqs:\n  buckets:\n    - match: {{ name: api }}\n      \
         rate_limit: {{ {limit} }}\n  no_match: deny\n"
    )
}

struct Replica {
    rlqs: Rlqs,
    clock: FakeClock,
    start: Instant,
    at: Duration,
    settings: Settings,
}

impl Replica {
    fn new(limit: &str) -> Replica {
        let clock = FakeClock::new(Duration::from_secs(1_000));
        Replica::on(limit, MemoryStore::with_clock(clock.clone()), clock)
    }

    /// A replica sharing `store` (on `clock`) with others.
    fn on(limit: &str, store: MemoryStore, clock: FakeClock) -> Replica {
        let settings = Settings {
            store: store.into(),
            mode: Mode::Exact,
            on_store_error: FailurePolicy::FailClosed,
            merge_domains: false,
        };
        let table = table(&rules(limit), &settings);
        let rlqs = Rlqs::new(table, settings.store.clone(), FailurePolicy::FailClosed);
        let replica = Replica {
            rlqs,
            clock,
            start: Instant::now(),
            at: Duration::ZERO,
            settings,
        };
        replica.fix();
        replica
    }

    fn inner(&self) -> &Inner {
        &self.rlqs.inner
    }

    fn now(&self) -> Instant {
        self.start + self.at
    }

    fn advance(&mut self, by: Duration) {
        self.at += by;
        self.clock.advance(by);
        self.fix();
    }

    /// Sets the replica's own clock to this one's time.
    fn fix(&self) {
        *self.rlqs.inner.fixed.lock().expect("lock") = Some(self.now());
    }

    /// An Envoy's stream, with room for `queue` messages.
    fn connect(&self, queue: usize) -> (u64, Inbox) {
        let envoy = self
            .inner()
            .next_envoy
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(queue);
        self.inner().lock().envoys.insert(envoy, tx);
        (envoy, rx)
    }

    fn report(&self, envoy: u64, allowed: u64, denied: u64) {
        let message = RateLimitQuotaUsageReports {
            domain: "api".into(),
            bucket_quota_usages: vec![BucketQuotaUsage {
                bucket_id: Some(bucket()),
                time_elapsed: None,
                num_requests_allowed: allowed,
                num_requests_denied: denied,
            }],
        };
        self.inner().report(envoy, "api", &message, self.now());
    }

    async fn round(&self) {
        self.inner().round(self.now()).await;
    }

    /// Every Envoy's assignment in force (the last one sent) and, checked
    /// on the way, the replica's bound: what its Envoys may admit is
    /// within what it holds, and that within the limit.
    fn in_force(&self, limit: u64) -> HashMap<u64, Given> {
        let state = self.inner().lock();
        let mut out = HashMap::new();
        for bucket in state.buckets.values() {
            let in_use = bucket.in_use(self.now());
            assert!(in_use <= bucket.held, "{in_use} > {} held", bucket.held);
            assert!(in_use <= limit, "{in_use} may be admitted of {limit}");
            for (envoy, seat) in &bucket.envoys {
                out.extend(seat.given.map(|g| (*envoy, g)));
            }
        }
        out
    }
}

fn table(yaml: &str, settings: &Settings) -> Arc<ArcSwap<Table>> {
    let config = Config::parse("rules.yaml", yaml).expect("parses");
    let (table, _) = Table::build(vec![config], settings, None).expect("builds");
    Arc::new(ArcSwap::from_pointee(table))
}

fn bucket() -> BucketId {
    BucketId {
        bucket: [("name".to_owned(), "api".to_owned())].into(),
    }
}

/// The actions waiting in `inbox`, oldest first.
fn received(inbox: &mut Inbox) -> Vec<Action> {
    let mut out = Vec::new();
    while let Ok(message) = inbox.try_recv() {
        let message = message.expect("no error");
        for action in message.bucket_action {
            out.extend(action.bucket_action);
        }
    }
    out
}

/// A token bucket's (rate per fill, max tokens, fill seconds), or a
/// blanket rule's (0, 0, 0).
fn strategy(action: &Action) -> (u32, u32, i64) {
    let Action::QuotaAssignmentAction(assignment) = action else {
        panic!("not an assignment: {action:?}");
    };
    match assignment
        .rate_limit_strategy
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
    {
        Some(Strategy::TokenBucket(bucket)) => (
            bucket.tokens_per_fill.map_or(1, |t| t.value),
            bucket.max_tokens,
            bucket.fill_interval.as_ref().map_or(0, |d| d.seconds),
        ),
        Some(Strategy::BlanketRule(rule)) => {
            assert_eq!(*rule, BlanketRule::DenyAll as i32);
            (0, 0, 0)
        }
        other => panic!("unexpected strategy {other:?}"),
    }
}

/// Rounds every [`RENEW`] for `span`, checking the bound at each.
async fn run_for(replica: &mut Replica, span: Duration, limit: u64) {
    let mut left = span;
    while !left.is_zero() {
        replica.round().await;
        replica.in_force(limit);
        let step = RENEW.min(left);
        replica.advance(step);
        left -= step;
    }
}

#[tokio::test]
async fn envoys_get_max_min_shares_of_their_demand_within_the_limit() {
    let mut replica = Replica::new("unit: second, requests_per_unit: 100");
    let mut envoys: Vec<(u64, Inbox)> = (0..3).map(|_| replica.connect(64)).collect();
    for (envoy, _) in &envoys {
        replica.report(*envoy, 1, 0);
    }
    run_for(&mut replica, Duration::from_secs(1), 100).await;
    // A second of demand 30, 90 and 180 a second (allowed or not).
    for ((envoy, _), demand) in envoys.iter().zip([30, 90, 180]) {
        replica.report(*envoy, demand / 2, demand - demand / 2);
    }
    run_for(&mut replica, Duration::from_secs(3), 100).await;
    let given = replica.in_force(100);
    let got: Vec<Given> = envoys.iter().map(|(e, _)| given[e]).collect();
    // Claims 32, 92, 182 (demand and a reserve of 2): the first is met;
    // the others split the remaining 68, each a bucket of 2 tokens.
    assert_eq!(got, FAIR_30_90_180);
    for (_, inbox) in &mut envoys {
        let last = received(inbox).pop().expect("an assignment");
        assert!(matches!(strategy(&last), (30, 2, 1) | (32, 2, 1)));
    }
}

#[tokio::test]
async fn a_raise_waits_until_the_lower_assignment_it_comes_from_is_delivered() {
    let mut replica = Replica::new("unit: second, requests_per_unit: 100");
    let (a, mut inbox_a) = replica.connect(64);
    replica.report(a, 1, 0);
    run_for(&mut replica, RENEW, 100).await;
    assert_eq!(replica.in_force(100)[&a].reach(), 100);
    let (b, mut inbox_b) = replica.connect(64);
    replica.report(b, 1, 0);
    replica.round().await;
    // A is told 50, but may admit 100 until that arrives: B waits.
    assert_eq!(strategy(received(&mut inbox_a).last().unwrap()), (48, 2, 1));
    assert_eq!(strategy(received(&mut inbox_b).last().unwrap()), (0, 0, 0));
    replica.in_force(100);
    run_for(&mut replica, DELIVERY + RENEW, 100).await;
    assert_eq!(strategy(received(&mut inbox_b).last().unwrap()), (48, 2, 1));
}

#[tokio::test]
async fn a_departed_envoys_assignment_counts_until_it_lapses() {
    let mut replica = Replica::new("unit: second, requests_per_unit: 100");
    let (a, _inbox_a) = replica.connect(64);
    let (b, mut inbox_b) = replica.connect(64);
    replica.report(a, 1, 0);
    replica.report(b, 1, 0);
    run_for(&mut replica, Duration::from_secs(2), 100).await;
    let sent_a = replica
        .inner()
        .lock()
        .buckets
        .values()
        .next()
        .unwrap()
        .envoys[&a]
        .sent;
    replica.inner().leave(a, replica.now());
    received(&mut inbox_b);
    // Until A's last assignment lapses, B stays at its half.
    let lapses = sent_a.unwrap() + DELIVERY + ASSIGNMENT_TTL;
    while replica.now() < lapses {
        replica.round().await;
        assert_eq!(replica.in_force(100)[&b].reach(), 50);
        replica.advance(RENEW);
    }
    // Its rate is B's once it lapsed, its tokens a period later (what
    // they admitted may share a second with B's).
    run_for(&mut replica, RENEW, 100).await;
    assert_eq!(replica.in_force(100)[&b].reach(), 98);
    run_for(&mut replica, Duration::from_secs(1), 100).await;
    assert_eq!(replica.in_force(100)[&b].reach(), 100);
}

#[tokio::test]
async fn a_silent_envoy_gives_its_seat_up() {
    let mut replica = Replica::new("unit: second, requests_per_unit: 100");
    let (a, _inbox_a) = replica.connect(64);
    let (b, _inbox_b) = replica.connect(64);
    replica.report(a, 1, 0);
    replica.report(b, 1, 0);
    // B keeps reporting, A says nothing more.
    let mut waited = Duration::ZERO;
    while waited < SILENT + ASSIGNMENT_TTL + DELIVERY {
        run_for(&mut replica, Duration::from_secs(1), 100).await;
        replica.report(b, 100, 0);
        waited += Duration::from_secs(1);
    }
    run_for(&mut replica, Duration::from_secs(2), 100).await;
    let given = replica.in_force(100);
    assert!(!given.contains_key(&a), "A still seated");
    assert_eq!(given[&b].reach(), 100);
}

#[tokio::test]
async fn a_changed_rule_abandons_its_bucket() {
    let mut replica = Replica::new("unit: second, requests_per_unit: 100");
    let (a, mut inbox) = replica.connect(64);
    replica.report(a, 1, 0);
    run_for(&mut replica, RENEW, 100).await;
    received(&mut inbox);
    // A rule added above it moves its name, not its budget: nothing
    // happens.
    let moved = format!(
        "domain: api\nrlqs:\n  buckets:\n    - match: {{ name: x }}\n      \
         rate_limit: {{ unit: second, requests_per_unit: 1 }}\n{}",
        rules("unit: second, requests_per_unit: 100")
            .trim_start_matches("domain: api\nrlqs:\n  buckets:\n")
    );
    let moved = table(&moved, &replica.settings);
    replica.inner().table.store(moved.load_full());
    run_for(&mut replica, RENEW, 100).await;
    assert!(received(&mut inbox)
        .iter()
        .all(|a| !matches!(a, Action::AbandonAction(_))));
    // A new quota: the Envoy is told to forget the bucket.
    let changed = table(
        &rules("unit: second, requests_per_unit: 10"),
        &replica.settings,
    );
    replica.inner().table.store(changed.load_full());
    replica.round().await;
    assert!(matches!(
        received(&mut inbox).as_slice(),
        [Action::AbandonAction(_)]
    ));
    // Its next request brings it back under the new rule, but what its
    // old assignment may still admit (100 a second) counts until it
    // lapses: denied until then, then the new share.
    replica.report(a, 1, 0);
    run_for(&mut replica, RENEW, 100).await;
    assert_eq!(strategy(received(&mut inbox).last().unwrap()), (0, 0, 0));
    run_for(
        &mut replica,
        DELIVERY + ASSIGNMENT_TTL + Duration::from_secs(1),
        100,
    )
    .await;
    assert_eq!(strategy(received(&mut inbox).last().unwrap()), (8, 2, 1));
}

#[tokio::test]
async fn an_assignment_that_cannot_be_queued_is_not_counted_as_sent() {
    let mut replica = Replica::new("unit: second, requests_per_unit: 100");
    let (a, mut inbox) = replica.connect(1);
    replica.report(a, 1, 0);
    replica.inner().lock().envoys[&a]
        .try_send(Err(Status::unavailable("filler")))
        .expect("room for one");
    run_for(&mut replica, RENEW, 100).await;
    assert!(replica.in_force(100).is_empty());
    assert!(inbox.try_recv().is_ok());
    run_for(&mut replica, RENEW, 100).await;
    assert_eq!(replica.in_force(100)[&a].reach(), 100);
}

#[tokio::test]
async fn limits_under_two_a_seat_still_admit_within_the_limit() {
    // 1 a minute for one Envoy: one token every other minute.
    let mut replica = Replica::new("unit: minute, requests_per_unit: 1");
    let (a, mut inbox) = replica.connect(64);
    replica.report(a, 1, 0);
    run_for(&mut replica, RENEW, 1).await;
    assert_eq!(strategy(received(&mut inbox).last().unwrap()), (2, 1, 240));
    // 3 a second over three Envoys: one each, half a token a second.
    let mut replica = Replica::new("unit: second, requests_per_unit: 3");
    let mut envoys: Vec<(u64, Inbox)> = (0..3).map(|_| replica.connect(64)).collect();
    for (envoy, _) in &envoys {
        replica.report(*envoy, 1, 0);
    }
    run_for(&mut replica, RENEW, 3).await;
    for (_, inbox) in &mut envoys {
        assert_eq!(strategy(received(inbox).last().unwrap()), (2, 1, 4));
    }
}

#[tokio::test]
async fn envoys_on_two_replicas_get_the_fleets_max_min_shares() {
    let clock = FakeClock::new(Duration::from_secs(1_000));
    let store = MemoryStore::with_clock(clock.clone());
    let limit = "unit: second, requests_per_unit: 100";
    let mut first = Replica::on(limit, store.clone(), clock.clone());
    let mut second = Replica::on(limit, store, FakeClock::new(Duration::ZERO));
    // Envoys 0 and 2 on the first replica, Envoy 1 on the second.
    let (e0, _i0) = first.connect(64);
    let (e1, _i1) = second.connect(64);
    let (e2, _i2) = first.connect(64);
    first.report(e0, 1, 0);
    second.report(e1, 1, 0);
    first.report(e2, 1, 0);
    let demand = [30, 90, 180];
    for tick in 0..40 {
        if tick % 10 == 9 {
            first.report(e0, demand[0] * 5, 0);
            second.report(e1, demand[1] * 5, 0);
            first.report(e2, demand[2] * 5, 0);
        }
        first.round().await;
        second.round().await;
        let a = first.in_force(100);
        let b = second.in_force(100);
        let total: u64 = a.values().chain(b.values()).map(|g| g.reach()).sum();
        assert!(total <= 100, "tick {tick}: {a:?} {b:?}");
        first.advance(RENEW);
        second.at += RENEW;
        second.fix();
    }
    let (a, b) = (first.in_force(100), second.in_force(100));
    assert_eq!([a[&e0], b[&e1], a[&e2]], FAIR_30_90_180,);
}

#[tokio::test]
async fn a_bucket_id_too_big_to_serve_gets_a_blanket_and_no_state() {
    let replica = Replica::new("unit: second, requests_per_unit: 100");
    let (a, mut inbox) = replica.connect(64);
    let id = BucketId {
        bucket: (0..super::MAX_ID_ENTRIES + 1)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect(),
    };
    let message = RateLimitQuotaUsageReports {
        domain: "api".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(id),
            time_elapsed: None,
            num_requests_allowed: 1,
            num_requests_denied: 0,
        }],
    };
    replica.inner().report(a, "api", &message, replica.now());
    assert!(replica.inner().lock().buckets.is_empty());
    // The failure policy's answer (closed here): a blanket denial.
    assert_eq!(strategy(received(&mut inbox).last().unwrap()), (0, 0, 0));
}

/// What another holder of the bucket under `key` is granted of a limit
/// of 100 when it claims all of it.
async fn left_for_another(replica: &Replica, key: &str) -> u64 {
    let call = ShareCall {
        holder: "another".into(),
        claims: vec![100],
        limit: 100,
        ttl_ms: 1,
        tokens_ttl_ms: 1,
        claims_ttl_ms: 1,
        in_use: 0,
        tokens: 0,
    };
    let share = RateShare { key, call: &call };
    replica
        .settings
        .store
        .run(&share)
        .await
        .expect("runs")
        .grant
}

#[tokio::test]
async fn letting_go_keeps_of_the_hold_only_what_its_envoys_may_use() {
    let limit = "unit: second, requests_per_unit: 100";
    let mut replica = Replica::new(limit);
    let (envoy, _inbox) = replica.connect(64);
    replica.report(envoy, 1, 0);
    replica.round().await;
    // Its Envoy wants less: the hold shrinks at the next renewal, once
    // the lower assignment is delivered. Letting go (at shutdown) before
    // that keeps only what is in use.
    replica.advance(Duration::from_secs(1));
    replica.report(envoy, 30, 0);
    replica.round().await;
    replica.advance(DELIVERY + RENEW);
    let (key, held, in_use) = {
        let state = replica.inner().lock();
        let bucket = state.buckets.values().next().expect("a bucket");
        (
            bucket.store_key.clone(),
            bucket.held,
            bucket.in_use(replica.now()),
        )
    };
    assert!(in_use > 0 && in_use < held, "{in_use} of {held}");
    assert_eq!(left_for_another(&replica, &key).await, 100 - held);
    replica.inner().let_go(replica.now()).await;
    assert_eq!(left_for_another(&replica, &key).await, 100 - in_use);

    // Its Envoy was sent nothing (its queue full): nothing is in use,
    // and letting go frees all of it, before the hold would expire.
    let replica = Replica::new(limit);
    let (envoy, _inbox) = replica.connect(1);
    replica.report(envoy, 1, 0);
    replica.inner().lock().envoys[&envoy]
        .try_send(Err(Status::unavailable("filler")))
        .expect("room for one");
    replica.round().await;
    let key = {
        let state = replica.inner().lock();
        let bucket = state.buckets.values().next().expect("a bucket");
        assert_eq!((bucket.held, bucket.in_use(replica.now())), (100, 0));
        bucket.store_key.clone()
    };
    assert_eq!(left_for_another(&replica, &key).await, 0);
    replica.inner().let_go(replica.now()).await;
    assert_eq!(left_for_another(&replica, &key).await, 100);
}
