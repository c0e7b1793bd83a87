//! A script's Lua on a private `redis-server` and its mirror on the
//! embedded store answer the same calls alike: the harness each script's
//! own parity test uses beside it.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{MemoryStore, RedisStore, Store};

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
