//! Fault injection on private Redis servers: kill, freeze, pause, restart,
//! flush and corrupt them under load, and check that every decision follows
//! the failure policy within the configured time bound.

use slicelimit_sim as support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use slicelimit::{
    clock::FakeClock, nonzero, store::CircuitConfig, store::CircuitState, store::RedisOptions,
    FailurePolicy, HybridConfig, Limiter, Quota, RedisStore, Source,
};
use support::RedisServer;

/// The production defaults: 25 ms response timeout, 50 ms `max_wait`.
fn options() -> RedisOptions {
    RedisOptions::default().connect_timeout(Duration::from_millis(500))
}

/// What a loaded 2-core CI machine may add to a bound.
const MARGIN: Duration = Duration::from_millis(250);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Exact,
    Hybrid,
}

async fn limiter(
    server: &RedisServer,
    mode: Mode,
    policy: FailurePolicy,
    quota: Quota,
    ns: &str,
) -> (Limiter, RedisStore) {
    limiter_with(server, mode, policy, quota, ns, options()).await
}

async fn limiter_with(
    server: &RedisServer,
    mode: Mode,
    policy: FailurePolicy,
    quota: Quota,
    ns: &str,
    options: RedisOptions,
) -> (Limiter, RedisStore) {
    let store = RedisStore::connect_with(&server.url(), options)
        .await
        .unwrap();
    let builder = Limiter::builder(quota)
        .store(store.clone())
        .namespace(ns)
        .on_store_error(policy);
    let builder = match mode {
        Mode::Exact => builder.exact(),
        // Small leases: these tests watch what the limiter does when the
        // store must be asked, which big headroom leases would put off.
        Mode::Hybrid => builder.hybrid(HybridConfig::strict().lease_bounds(1, 8)),
    };
    (builder.build().unwrap(), store)
}

fn bound(mode: Mode) -> Duration {
    match mode {
        Mode::Exact => options().get_response_timeout(),
        Mode::Hybrid => Duration::from_millis(50),
    }
}

struct Observed {
    /// (seconds since start when the check began, source, allowed, latency)
    decisions: Vec<(f64, Source, bool, Duration)>,
}

/// 6 tasks hammer 50 keys until `stop`; every decision is recorded.
async fn hammer(limiter: &Limiter, start: Instant, stop: Arc<AtomicBool>) -> Observed {
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for t in 0..6u64 {
        let limiter = limiter.clone();
        let stop = stop.clone();
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = t;
            while !stop.load(Ordering::Acquire) {
                i = (i * 31 + 7) % 50;
                let key = format!("k{i}");
                // Stamped when the check starts: one already in flight at
                // the kill may still have been answered by Redis.
                let at = start.elapsed().as_secs_f64();
                let began = Instant::now();
                let d = limiter.check(&key, 1).await;
                let took = began.elapsed();
                log.lock()
                    .unwrap()
                    .push((at, d.source(), d.is_allowed(), took));
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("no panic in a checking task");
    }
    let decisions = std::mem::take(&mut *log.lock().unwrap());
    Observed { decisions }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_every_decision_follows_the_policy_within_the_bound() {
    let policies = [
        FailurePolicy::FailOpen,
        FailurePolicy::FailClosed,
        FailurePolicy::LocalFallback(Quota::per_minute(nonzero!(50))),
    ];
    let mut report = Vec::new();
    for mode in [Mode::Exact, Mode::Hybrid] {
        for policy in policies {
            let mut server = RedisServer::start();
            let (limiter, _) = limiter(
                &server,
                mode,
                policy,
                Quota::per_minute(nonzero!(1_000_000)),
                "kill",
            )
            .await;
            let stop = Arc::new(AtomicBool::new(false));
            let start = Instant::now();
            let run = tokio::spawn({
                let limiter = limiter.clone();
                let stop = stop.clone();
                async move { hammer(&limiter, start, stop).await }
            });
            tokio::time::sleep(Duration::from_millis(600)).await;
            server.kill();
            let killed_at = start.elapsed().as_secs_f64();
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            stop.store(true, Ordering::Release);
            let observed = run.await.unwrap();
            let during: Vec<_> = observed
                .decisions
                .iter()
                .filter(|d| d.0 > killed_at)
                .collect();
            assert!(
                during.len() > 100,
                "{mode:?} {policy:?}: {} decisions",
                during.len()
            );
            for (at, source, allowed, _) in &during {
                let d = (*source, *allowed);
                assert!(
                    match d.0 {
                        Source::Store => false,
                        Source::FailOpen => policy == FailurePolicy::FailOpen && d.1,
                        Source::FailClosed => policy == FailurePolicy::FailClosed && !d.1,
                        Source::Fallback => matches!(policy, FailurePolicy::LocalFallback(_)),
                        Source::Lease | Source::DeniedCache => mode == Mode::Hybrid,
                        _ => false,
                    },
                    "{mode:?} {policy:?}: at {at:.3}s a {source:?} decision (allowed {allowed})"
                );
            }
            let by_policy = during
                .iter()
                .filter(|d| {
                    matches!(
                        d.1,
                        Source::FailOpen | Source::FailClosed | Source::Fallback
                    )
                })
                .count();
            assert!(
                by_policy > during.len() / 2,
                "{mode:?} {policy:?}: the policy decided {by_policy}"
            );
            let slowest = during.iter().map(|d| d.3).max().unwrap();
            // Checks in flight at the kill end within the bound too.
            let slowest_any = observed
                .decisions
                .iter()
                .filter(|d| d.0 + d.3.as_secs_f64() > killed_at)
                .map(|d| d.3)
                .max()
                .unwrap();
            report.push(format!(
                "{mode:?} {policy:?}: slowest check begun during the outage {slowest:?}, \
                 slowest finishing after the kill {slowest_any:?}"
            ));
            assert!(
                slowest_any <= bound(mode) + MARGIN,
                "{mode:?} {policy:?}: a check took {slowest_any:?}"
            );
        }
    }
    println!("{}", report.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_decisions_come_from_redis_again_within_two_seconds() {
    for mode in [Mode::Exact, Mode::Hybrid] {
        let mut server = RedisServer::start();
        let (limiter, _) = limiter(
            &server,
            mode,
            FailurePolicy::FailOpen,
            Quota::per_minute(nonzero!(1_000_000)),
            "restart",
        )
        .await;
        assert!(limiter.check("warm", 1).await.is_allowed());
        server.kill();
        let outage = Instant::now();
        while outage.elapsed() < Duration::from_secs(2) {
            limiter.check("during", 1).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        server.restart();
        let restarted = Instant::now();
        let mut i = 0u64;
        let back_after = loop {
            // A fresh key each time: a hybrid decision from Redis is one
            // whose slot got a lease after the restart.
            let d = limiter.check(&format!("after-{i}"), 1).await;
            i += 1;
            if matches!(d.source(), Source::Store | Source::Lease) {
                break restarted.elapsed();
            }
            assert!(
                restarted.elapsed() < Duration::from_secs(10),
                "{mode:?}: never came back"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        println!("{mode:?}: back on Redis {back_after:?} after the restart");
        assert!(
            back_after <= Duration::from_secs(2),
            "{mode:?}: {back_after:?}"
        );
        assert_eq!(server.immortal_keys(), Vec::<String>::new());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_pause_exact_times_out_within_the_bound_while_leased_keys_stay_local() {
    let server = RedisServer::start();
    let (exact, _) = limiter(
        &server,
        Mode::Exact,
        FailurePolicy::FailOpen,
        Quota::per_minute(nonzero!(1_000_000)),
        "pause",
    )
    .await;
    let hybrid = Limiter::builder(Quota::per_minute(nonzero!(1_000_000)))
        .store(
            RedisStore::connect_with(&server.url(), options())
                .await
                .unwrap(),
        )
        .namespace("pause-h")
        .on_store_error(FailurePolicy::FailClosed)
        .hybrid(HybridConfig::strict().lease_bounds(10_000, 10_000))
        .build()
        .unwrap();
    // The hybrid key holds a lease of 10 000 before the pause.
    for _ in 0..100 {
        hybrid.check("leased", 1).await;
    }
    let _: String = server.cmd(&["CLIENT", "PAUSE", "2000", "ALL"]);
    let paused = Instant::now();
    let mut exact_slowest = Duration::ZERO;
    let mut hybrid_slowest = Duration::ZERO;
    let mut local = 0;
    while paused.elapsed() < Duration::from_millis(1_500) {
        let began = Instant::now();
        let d = exact.check("k", 1).await;
        exact_slowest = exact_slowest.max(began.elapsed());
        assert_eq!(d.source(), Source::FailOpen);
        // Well within the lease (an open circuit makes the loop fast).
        for _ in 0..(if local < 5_000 { 10 } else { 0 }) {
            let began = Instant::now();
            let d = hybrid.check("leased", 1).await;
            hybrid_slowest = hybrid_slowest.max(began.elapsed());
            assert!(
                d.is_allowed(),
                "{d:?} after {local} local decisions; {:?}",
                hybrid.stats()
            );
            assert_eq!(d.source(), Source::Lease);
            local += 1;
        }
    }
    println!("CLIENT PAUSE: exact slowest {exact_slowest:?}, hybrid slowest {hybrid_slowest:?} over {local} local decisions");
    assert!(
        exact_slowest <= bound(Mode::Exact) + MARGIN,
        "{exact_slowest:?}"
    );
    // Counted, not timed: all 5 000 leased decisions (each checked above
    // to be a local lease decision) fit in the pause, so none waited on
    // the paused store.
    assert_eq!(local, 5_000, "leased decisions made while Redis was paused");
    assert_eq!(hybrid.stats().policy_decisions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_circuit_sends_nothing_and_probes_once_per_back_off() {
    let server = RedisServer::start();
    // Opens on 3 failures however close together, so three sequential
    // timeouts open it.
    let circuit = CircuitConfig::default()
        .min_failures(3)
        .min_span(Duration::ZERO)
        .backoff(Duration::from_millis(300), Duration::from_millis(600));
    let store = RedisStore::connect_with(
        &server.url(),
        options()
            .circuit_breaker(circuit)
            .response_timeout(Duration::from_millis(20)),
    )
    .await
    .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000)))
        .store(store.clone())
        .namespace("circuit")
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    assert_eq!(limiter.check("k", 1).await.source(), Source::Store);
    let evalsha_before = server.command_calls("evalsha");
    let sent_before = store.calls_sent();
    server.freeze();
    for _ in 0..3 {
        let d = limiter.check("k", 1).await;
        assert_eq!(d.source(), Source::FailClosed);
    }
    assert_eq!(store.circuit_state(), CircuitState::Open);
    let opened = store.calls_sent();
    assert_eq!(opened - sent_before, 3);
    // While open: nothing is sent, and denials say when the probe comes.
    let began = Instant::now();
    while began.elapsed() < Duration::from_millis(120) {
        let d = limiter.check("k", 1).await;
        assert_eq!(d.source(), Source::FailClosed);
        let retry = d.retry_after().unwrap();
        assert!(retry <= Duration::from_millis(300), "{retry:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(
        store.calls_sent(),
        opened,
        "the open circuit sent a command"
    );
    assert!(store.calls_refused() > 10);
    // After the back-off (at most 300 ms), one probe, which fails (frozen)
    // and reopens the circuit for a longer back-off.
    tokio::time::sleep(Duration::from_millis(320)).await;
    for _ in 0..20 {
        limiter.check("k", 1).await;
    }
    assert_eq!(store.calls_sent(), opened + 1, "exactly one probe");
    assert_eq!(store.circuit_trips(), 2);
    server.thaw();
    // The frozen server ran what was sent to it once it woke: nothing else.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let executed = server.command_calls("evalsha") - evalsha_before;
    assert_eq!(
        executed,
        store.calls_sent() - sent_before,
        "INFO commandstats agrees"
    );
    // Recovery: the next probe succeeds and closes the circuit.
    let deadline = Instant::now() + Duration::from_secs(3);
    while limiter.check("k", 1).await.source() != Source::Store {
        assert!(Instant::now() < deadline, "the circuit never closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(store.circuit_state(), CircuitState::Closed);
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Outage {
    /// SIGKILL, then a restart: Redis comes back empty.
    Restart,
    /// SIGSTOP, then SIGCONT: Redis comes back with its data.
    Freeze,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_admissions_are_reconciled_so_no_second_budget_is_granted() {
    let limit = 100u64;
    let fleet = 4u64;
    let fallback_limit = limit / fleet;
    for outage in [Outage::Restart, Outage::Freeze] {
        for mode in [Mode::Exact, Mode::Hybrid] {
            let mut server = RedisServer::start();
            let quota = Quota::new(limit, Duration::from_secs(3600)).unwrap();
            let policy = FailurePolicy::LocalFallback(
                Quota::new(fallback_limit, Duration::from_secs(3600)).unwrap(),
            );
            let mut limiters = Vec::new();
            for _ in 0..fleet {
                limiters.push(limiter(&server, mode, policy, quota, "reconcile").await.0);
            }
            let (mut before, mut in_fallback, mut after) = (0u64, 0u64, 0u64);
            for i in 0..40 {
                before += u64::from(limiters[i % 4].check("key", 1).await.is_allowed());
            }
            match outage {
                Outage::Restart => server.kill(),
                Outage::Freeze => server.freeze(),
            }
            for i in 0..200 {
                let d = limiters[i % 4].check("key", 1).await;
                match (d.source(), d.is_allowed()) {
                    (Source::Fallback, true) => in_fallback += 1,
                    (_, true) => before += 1, // a hybrid lease still held
                    _ => {}
                }
            }
            match outage {
                Outage::Restart => server.restart(),
                Outage::Freeze => server.thaw(),
            }
            let back = Instant::now();
            while back.elapsed() < Duration::from_secs(3) {
                for l in &limiters {
                    let d = l.check("key", 1).await;
                    match (d.source(), d.is_allowed()) {
                        (Source::Fallback, true) => in_fallback += 1,
                        (_, true) => after += 1,
                        _ => {}
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            for l in &limiters {
                l.shutdown().await;
            }
            let reconciled: u64 = limiters.iter().map(|l| l.stats().reconciled).sum();
            let probe = Limiter::builder(quota)
                .store(
                    RedisStore::connect_with(&server.url(), options())
                        .await
                        .unwrap(),
                )
                .namespace("reconcile")
                .build()
                .unwrap();
            let in_redis = limit - probe.try_check("key", 0).await.unwrap().remaining();
            let total = before + in_fallback + after;
            println!(
                "{outage:?} {mode:?}: before {before}, fallback {in_fallback} (reconciled {reconciled}), after recovery {after}, total {total}, Redis counts {in_redis}"
            );
            assert_eq!(in_fallback, limit, "each of 4 fallbacks admitted limit/4");
            assert_eq!(
                reconciled, in_fallback,
                "every fallback admission was reported"
            );
            assert_eq!(
                in_redis, limit,
                "Redis' window includes the fallback admissions"
            );
            // Each process reports what its fallback admitted before it
            // leases anew, so the window never hands out a second full budget.
            assert!(
                after < limit,
                "{outage:?} {mode:?}: a second budget: {after} after recovery; {:#?}",
                limiters.iter().map(|l| l.stats()).collect::<Vec<_>>()
            );
            // The documented bounds per window.
            let bound = match outage {
                Outage::Freeze => limit + fleet * fallback_limit,
                Outage::Restart => 2 * limit + fleet * fallback_limit,
            };
            assert!(total <= bound, "{outage:?} {mode:?}: {total} > {bound}");
            assert_eq!(server.immortal_keys(), Vec::<String>::new());
        }
    }
}

#[tokio::test]
async fn script_flush_and_wrong_type_mid_run_are_handled_and_counted() {
    let server = RedisServer::start();
    for mode in [Mode::Exact, Mode::Hybrid] {
        let ns = format!("flush-{mode:?}");
        // Every call must be answered by the store: a response timeout a
        // loaded machine's reload and resend fit in (what is tested is
        // the recovery, not the timeout).
        let (limiter, _) = limiter_with(
            &server,
            mode,
            FailurePolicy::FailClosed,
            Quota::per_minute(nonzero!(100_000)),
            &ns,
            options().response_timeout(Duration::from_millis(500)),
        )
        .await;
        for i in 0..300 {
            if i == 100 {
                let _: String = server.cmd(&["SCRIPT", "FLUSH"]);
            }
            let d = limiter.check(&format!("k{}", i % 10), 1).await;
            assert!(d.is_allowed(), "{mode:?} {i}: {d:?}");
            assert!(
                matches!(d.source(), Source::Store | Source::Lease),
                "{mode:?}"
            );
        }
        // Someone writes a string where the limiter keeps a hash.
        let victim = server.keys().into_iter().find(|k| k.contains(&ns)).unwrap();
        let tag = victim
            .split('{')
            .nth(1)
            .unwrap()
            .split('}')
            .next()
            .unwrap()
            .to_owned();
        let _: i64 = server.cmd(&["DEL", &victim]);
        let _: String = server.cmd(&["SET", &victim, "oops"]);
        let user_key = tag.rsplit(':').next().unwrap().to_owned();
        let errors_before = limiter.stats().store_errors;
        let mut denied = 0;
        for _ in 0..2_000 {
            let d = limiter.check(&user_key, 1).await;
            if d.source() == Source::FailClosed {
                denied += 1;
            }
        }
        assert!(
            denied > 0,
            "{mode:?}: the corrupted key was decided by the policy"
        );
        assert!(
            limiter.stats().store_errors > errors_before,
            "{mode:?}: counted"
        );
        let other = limiter.check("k-fine", 1).await;
        assert!(other.is_allowed(), "{mode:?}: other keys unaffected");
    }
}

#[tokio::test]
async fn connecting_to_nothing_fails_fast_and_a_lazy_store_applies_the_policy() {
    // A port nobody listens on: refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let began = Instant::now();
    let err = RedisStore::connect_with(&format!("redis://127.0.0.1:{port}"), options())
        .await
        .unwrap_err();
    assert!(err.is_connection() || err.is_timeout(), "{err}");
    assert!(began.elapsed() < Duration::from_millis(500) + MARGIN);
    // A listener that never answers: the connect timeout ends it.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let began = Instant::now();
    let err = RedisStore::connect_with(&url, options().connect_timeout(Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert!(err.is_timeout() || err.is_connection(), "{err}");
    assert!(
        began.elapsed() < Duration::from_millis(200) + MARGIN,
        "{:?}",
        began.elapsed()
    );
    // Lazy: builds now, decides by policy until Redis answers.
    let store = RedisStore::connect_lazy(&url, options()).unwrap();
    let limiter = Limiter::builder(Quota::per_second(nonzero!(10)))
        .store(store)
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let began = Instant::now();
    let d = limiter.check("k", 1).await;
    assert_eq!(d.source(), Source::FailClosed);
    assert!(
        began.elapsed() < Duration::from_millis(500) + MARGIN,
        "{:?}",
        began.elapsed()
    );
}

/// One stall of a busy server (a 60 ms `DEBUG SLEEP` under 2,048
/// concurrent callers) times out hundreds of queued calls at once; with
/// the default breaker that is not an outage: the breaker stays closed and
/// decisions after the stall come from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stall_under_two_thousand_callers_does_not_open_the_breaker() {
    let server = RedisServer::start();
    let store = RedisStore::connect_with(&server.url(), options())
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000_000_000)))
        .store(store.clone())
        .namespace("stall")
        .on_store_error(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    assert_eq!(limiter.check("warm", 1).await.source(), Source::Store);
    const CALLERS: u64 = 2_048;
    // Each caller checks every 500 ms (about 4,000 checks a second in
    // all), starting spread over the first period.
    let stop = Arc::new(AtomicBool::new(false));
    let stalled = Arc::new(AtomicBool::new(false));
    let resumed = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..CALLERS {
        let limiter = limiter.clone();
        let (stop, stalled, resumed) = (stop.clone(), stalled.clone(), resumed.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_micros(c * 500_000 / CALLERS)).await;
            // (decided before the stall, during it, after it) by the store,
            // and by the policy.
            let mut seen = [[0u64; 2]; 3];
            while !stop.load(Ordering::Acquire) {
                let phase = if resumed.load(Ordering::Acquire) {
                    2
                } else if stalled.load(Ordering::Acquire) {
                    1
                } else {
                    0
                };
                let d = limiter.check(&format!("k{}", c % 64), 1).await;
                seen[phase][usize::from(d.source() != Source::Store)] += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            seen
        }));
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let url = server.url();
    stalled.store(true, Ordering::Release);
    tokio::task::spawn_blocking(move || {
        let mut conn = redis::Client::open(url)
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap();
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("0.06")
            .query(&mut conn)
            .unwrap();
    })
    .await
    .unwrap();
    // Calls queued behind the stall drain within a few hundred ms; count
    // what follows as after the stall.
    tokio::time::sleep(Duration::from_millis(400)).await;
    resumed.store(true, Ordering::Release);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    stop.store(true, Ordering::Release);
    let mut seen = [[0u64; 2]; 3];
    for t in tasks {
        let s = t.await.unwrap();
        for (phase, counts) in s.iter().enumerate() {
            seen[phase][0] += counts[0];
            seen[phase][1] += counts[1];
        }
    }
    println!("(store, policy) before / around / after the stall: {seen:?}");
    let timed_out = seen[0][1] + seen[1][1];
    assert!(
        timed_out >= 20,
        "the stall timed out {timed_out} calls: too few to test the breaker (a consecutive-failure rule opens on 5)"
    );
    assert_eq!(store.circuit_trips(), 0, "the breaker opened on one stall");
    assert_eq!(store.circuit_state(), CircuitState::Closed);
    // An open breaker would have answered everything by the policy for
    // at least its back-off; a debug build on a loaded machine times out a
    // few calls at any time.
    assert!(seen[2][0] >= CALLERS, "{seen:?}");
    assert!(
        seen[2][1] * 10 <= seen[2][0],
        "after the stall, decisions come from Redis: {seen:?}"
    );
}

/// A killed server still opens the default breaker, even at one call per
/// 100 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_opens_the_default_breaker_at_low_traffic() {
    let mut server = RedisServer::start();
    // The default breaker, but a response timeout a loaded machine's
    // first calls (a script load among them) fit in: a killed server's
    // calls fail on the refused connection, not by timing out.
    let store = RedisStore::connect_with(
        &server.url(),
        options().response_timeout(Duration::from_millis(500)),
    )
    .await
    .unwrap();
    let limiter = Limiter::builder(Quota::per_minute(nonzero!(1_000)))
        .store(store.clone())
        .namespace("dead")
        .on_store_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    for _ in 0..5 {
        assert_eq!(limiter.check("k", 1).await.source(), Source::Store);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.kill();
    let mut calls = 0;
    loop {
        let d = limiter.check("k", 1).await;
        assert_eq!(d.source(), Source::FailClosed);
        calls += 1;
        if store.circuit_trips() > 0 {
            break;
        }
        assert!(calls < 8, "still closed after {calls} failed calls");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(calls >= 3, "opened after {calls} calls");
    assert_eq!(store.circuit_state(), CircuitState::Open);
    let d = limiter.check("k", 1).await;
    assert_eq!(d.source(), Source::FailClosed);
    assert!(
        store.calls_refused() >= 1,
        "the open breaker refused the call"
    );
}

/// The breakers run on the clock `RedisOptions::clock` injects: while it
/// stands still, no amount of real time of failures opens them; moved on
/// past the sustained-failure span, they open.
#[tokio::test]
async fn the_circuit_breaker_runs_on_the_injected_clock() {
    let mut server = RedisServer::start();
    let clock = FakeClock::new(Duration::from_secs(1_000));
    let store = RedisStore::connect_with(&server.url(), options().clock(clock.clone()))
        .await
        .unwrap();
    let limiter = Limiter::builder(Quota::per_second(nonzero!(10)))
        .store(store.clone())
        .namespace("clocked")
        .exact()
        .build()
        .unwrap();
    assert!(limiter.try_check("k", 1).await.is_ok());
    server.kill();
    // Three times the 200 ms the default configuration needs, in real time.
    let began = Instant::now();
    let mut failed = 0;
    while began.elapsed() < Duration::from_millis(600) {
        if limiter.try_check("k", 1).await.is_err() {
            failed += 1;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(failed >= 10, "{failed} failed calls");
    assert_eq!(
        store.circuit_state(),
        CircuitState::Closed,
        "its clock stood still"
    );
    clock.advance(Duration::from_millis(300));
    for _ in 0..5 {
        let _ = limiter.try_check("k", 1).await;
    }
    assert_eq!(store.circuit_state(), CircuitState::Open);
    let refused = limiter.try_check("k", 1).await.unwrap_err();
    assert!(refused.is_circuit_open(), "{refused}");
}
