//! A private Redis Sentinel deployment: a primary, a replica and three
//! Sentinels (quorum 2) on free ports, torn down on drop.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, server_binary, RedisServer, INSTALL_HINT};

pub const SERVICE: &str = "limits";

/// One `redis-server --sentinel` process.
pub struct SentinelProcess {
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

impl SentinelProcess {
    fn start(primary_port: u16) -> SentinelProcess {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("slicelimit-sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n\
                 sentinel down-after-milliseconds {SERVICE} 1000\n\
                 sentinel failover-timeout {SERVICE} 5000\n\
                 sentinel parallel-syncs {SERVICE} 1\n",
                dir.display()
            ),
        )
        .expect("write sentinel.conf");
        let child = Command::new(server_binary())
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{INSTALL_HINT} (starting a Sentinel: {e})"));
        let sentinel = SentinelProcess { port, dir, child };
        let deadline = Instant::now() + Duration::from_secs(10);
        while sentinel.query::<String>(&["PING"]).is_none() {
            assert!(Instant::now() < deadline, "a Sentinel did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        sentinel
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn query<T: redis::FromRedisValue>(&self, args: &[&str]) -> Option<T> {
        super::try_query(&self.url(), args)
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub struct SentinelSetup {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<SentinelProcess>,
}

impl SentinelSetup {
    /// Returns once the replica is in sync and every Sentinel sees the
    /// replica and the other two Sentinels (a failover can be agreed).
    pub fn start() -> SentinelSetup {
        let primary = RedisServer::start();
        let replica =
            RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.port().to_string()]);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let info: String = replica
                .try_cmd(&["INFO", "replication"])
                .unwrap_or_default();
            if info.contains("master_link_status:up") {
                break;
            }
            assert!(Instant::now() < deadline, "the replica did not sync");
            std::thread::sleep(Duration::from_millis(50));
        }
        let sentinels: Vec<SentinelProcess> = (0..3)
            .map(|_| SentinelProcess::start(primary.port()))
            .collect();
        loop {
            let ready = sentinels.iter().all(|s| {
                let replicas: Vec<redis::Value> = s
                    .query(&["SENTINEL", "REPLICAS", SERVICE])
                    .unwrap_or_default();
                let others: Vec<redis::Value> = s
                    .query(&["SENTINEL", "SENTINELS", SERVICE])
                    .unwrap_or_default();
                replicas.len() == 1 && others.len() == 2
            });
            if ready {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the Sentinels did not find the replica and each other"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        SentinelSetup {
            primary,
            replica,
            sentinels,
        }
    }

    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(SentinelProcess::url).collect()
    }

    /// The port of the primary the Sentinels name now.
    pub fn named_primary(&self) -> Option<u16> {
        let addr: Vec<String> =
            self.sentinels[0].query(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE])?;
        addr.get(1)?.parse().ok()
    }
}
