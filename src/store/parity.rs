//! A script's Lua on a private `redis-server` and its mirror on the
//! embedded store answer the same calls alike. Here the lease script
//! (grants, what remains and the window leased), and the harness each
//! script's own parity test uses beside it.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{MemoryStore, RedisStore, Store};
use crate::algorithm::Algorithm;
use crate::algorithm::{Lease, LeaseCall};
use crate::algorithm::{LeaseReply, Params};
use crate::clock::FakeClock;
use crate::quota::Quota;
use crate::stats::Counters;

/// A `redis-server` of this test's own, on a free port; killed on drop.
pub(crate) struct Server(Child, u16);

impl Server {
    pub(crate) fn start() -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        // The server CI's second pass points at (Valkey), else Redis.
        let binary =
            std::env::var("SLICELIMIT_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned());
        let child = Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "redis-server (>= 7) is required and could not be started ({e}); \
                     install it (Debian/Ubuntu: `sudo apt-get install -y redis-server`; \
                     macOS: `brew install redis`)"
                )
            });
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Server(child, port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

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
    let server = Server::start();
    let redis: Store = RedisStore::connect(&format!("redis://127.0.0.1:{}/", server.1))
        .await
        .expect("connect")
        .into();
    // A window of 30 days: both stores are in the same one, whatever the
    // milliseconds between their clocks.
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let memory: Store = MemoryStore::with_clock(FakeClock::new(now)).into();
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

/// A private Redis (kept alive by the first value) and an embedded store.
pub(crate) async fn both_stores() -> (Server, Store, Store) {
    let server = Server::start();
    let redis: Store = RedisStore::connect(&format!("redis://127.0.0.1:{}", server.1))
        .await
        .expect("connect")
        .into();
    (server, redis, MemoryStore::new().into())
}

/// Runs each call on both stores; fails at the first whose replies differ.
pub(crate) async fn assert_agree<S>(redis: &Store, memory: &Store, calls: &[S])
where
    S: super::Script + std::fmt::Debug,
    S::Reply: PartialEq + std::fmt::Debug,
{
    for (i, c) in calls.iter().enumerate() {
        let from_redis = redis.run(c).await.expect("redis");
        let from_memory = memory.run(c).await.expect("memory");
        assert_eq!(
            from_redis, from_memory,
            "call {i} ({c:?}): Redis (left) and the embedded store disagree"
        );
    }
}
