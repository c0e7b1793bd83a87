//! A private Redis Cluster on free ports, created with `redis-cli --cluster
//! create`, torn down on drop: three primaries with a replica each, or
//! three primaries alone (a stopped primary then stays down, and the others
//! go on serving their slots).
#![allow(dead_code, unreachable_pub)]

use std::process::Command;
use std::time::{Duration, Instant};

use super::RedisServer;

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts six nodes and forms a cluster with one replica per primary;
    /// returns once every node reports the cluster up and every replica is
    /// in sync (a replica that never synced refuses to fail over).
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(1)
    }

    /// Three primaries and no replica. A primary that stops is never
    /// replaced, and the others keep serving their own slots (full
    /// coverage is not required).
    pub fn start_primaries_only() -> RedisCluster {
        RedisCluster::start_with(0)
    }

    fn start_with(replicas: usize) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-replica-validity-factor",
                    "0",
                    "--cluster-require-full-coverage",
                    "no",
                ])
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        RedisCluster::create(nodes, &addrs, replicas, &[])
    }

    /// Forms a cluster of `nodes` (reached at `addrs`) with `redis-cli
    /// --cluster create`, `cli_args` before it (TLS options), and waits
    /// until it is healthy.
    pub fn create(
        nodes: Vec<RedisServer>,
        addrs: &[String],
        replicas: usize,
        cli_args: &[String],
    ) -> RedisCluster {
        let out = Command::new("redis-cli")
            .args(cli_args)
            .arg("--cluster")
            .arg("create")
            .args(addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("{} (redis-cli: {e})", super::INSTALL_HINT));
        assert!(
            out.status.success(),
            "redis-cli {cli_args:?} --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_until_healthy(Duration::from_secs(30));
        cluster
    }

    pub fn urls(&self) -> Vec<String> {
        self.live().map(|n| n.url()).collect()
    }

    fn live(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes.iter().filter(|n| n.is_running())
    }

    /// Waits for `cluster_state:ok` on every live node and for every live
    /// replica's link to its primary.
    pub fn wait_until_healthy(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let healthy = self.live().all(|n| {
                let info: String = n.try_cmd(&["CLUSTER", "INFO"]).unwrap_or_default();
                let replication: String = n.try_cmd(&["INFO", "replication"]).unwrap_or_default();
                info.contains("cluster_state:ok")
                    && (!replication.contains("role:slave")
                        || replication.contains("master_link_status:up"))
            });
            if healthy {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node currently serving `key`'s slot as primary.
    pub fn primary_for(&self, key: &str) -> usize {
        let slot = slot(key);
        self.primaries_by_slot()[usize::from(slot)]
            .unwrap_or_else(|| panic!("no primary serves slot {slot}"))
    }

    /// For each of the 16384 slots, the node serving it as primary, as a
    /// live node sees the cluster now.
    pub fn primaries_by_slot(&self) -> Vec<Option<usize>> {
        let node = self.live().next().expect("a live node");
        let nodes: String = node.cmd(&["CLUSTER", "NODES"]);
        let mut owners = vec![None; 16_384];
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            let Some(index) = self.nodes.iter().position(|n| n.port() == port) else {
                continue;
            };
            for range in &fields[8..] {
                let (lo, hi) = match range.split_once('-') {
                    Some((lo, hi)) => (lo.parse().unwrap_or(1), hi.parse().unwrap_or(0)),
                    None => {
                        let s = range.parse().unwrap_or(usize::MAX);
                        (s, s)
                    }
                };
                for owner in owners.iter_mut().take(hi.saturating_add(1)).skip(lo) {
                    *owner = Some(index);
                }
            }
        }
        owners
    }

    /// Keys without a TTL on any live primary.
    pub fn immortal_keys(&self) -> Vec<String> {
        self.live()
            .filter(|n| {
                let role: String = n.try_cmd(&["INFO", "replication"]).unwrap_or_default();
                role.contains("role:master")
            })
            .flat_map(|n| n.immortal_keys())
            .collect()
    }
}

/// A key's hash slot: CRC16/XMODEM of its first non-empty `{…}` (or of the
/// whole key), modulo 16384, as `CLUSTER KEYSLOT` computes it.
pub fn slot(key: &str) -> u16 {
    let key = key.as_bytes();
    let tag = key.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let mut crc: u16 = 0;
    for &b in tag.unwrap_or(key) {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16_384
}
