//! Which primary of a Redis Cluster serves each hash slot, and one circuit
//! breaker per primary, so an unavailable shard refuses only its own keys.
//!
//! Owns the slot map (read from `CLUSTER SLOTS` and replaced whole when a
//! reply shows it may be stale: a redirection, a connection error, a node's
//! breaker opening) and the breakers, which outlive a refresh: a node keeps
//! its state when the map is read again. It sends nothing itself; the Redis
//! store queries the cluster and hands the reply over.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::Value;

use crate::breaker::{CircuitBreaker, CircuitConfig, CircuitState};
use crate::clock::micros;
use crate::clock::Clock;
use crate::error::{Error, ErrorKind};

/// Hash slots in a Redis Cluster.
pub(crate) const SLOTS: usize = 16_384;

/// The hash slot of `key`: CRC16 (XMODEM) of the text inside its first
/// non-empty `{…}`, or of the whole key, modulo 16384.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let mut crc: u16 = 0;
    for &byte in tagged.unwrap_or(key) {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % SLOTS as u16
}

/// One primary and its breaker.
pub(crate) struct Node {
    host: String,
    port: u16,
    /// Refuses calls to this node alone while it keeps failing.
    pub(crate) breaker: CircuitBreaker,
}

impl Node {
    /// `host:port`, as the cluster announces it.
    pub(crate) fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// Routes a command to this node and no other.
    pub(crate) fn route(&self) -> RoutingInfo {
        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: self.host.clone(),
            port: self.port,
        })
    }
}

/// A range of slots and the primary serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotRange {
    pub(crate) first: u16,
    pub(crate) last: u16,
    pub(crate) host: String,
    pub(crate) port: u16,
}

/// No primary is known for the slot.
const UNKNOWN: u16 = u16::MAX;

struct SlotMap {
    /// Per slot, an index into `nodes`, or `UNKNOWN`.
    owners: Box<[u16]>,
    /// The primaries serving at least one slot.
    nodes: Vec<Arc<Node>>,
}

/// The slot map and the per-node breakers of one cluster store.
pub(crate) struct Topology {
    map: ArcSwap<SlotMap>,
    /// Every primary seen, by address, so a node keeps its breaker (and
    /// its count of trips) across refreshes.
    known: Mutex<HashMap<(String, u16), Arc<Node>>>,
    config: CircuitConfig,
    clock: Arc<dyn Clock>,
    /// A refresh is under way.
    refreshing: AtomicBool,
    /// When the last refresh started (the clock's µs), so evidence arriving
    /// from many calls at once refreshes once per `REFRESH_EVERY`.
    last_refresh_us: AtomicU64,
    /// The host of the first seed URL, for nodes that announce none.
    seed_host: String,
}

/// How often the slot map may be read again.
const REFRESH_EVERY: Duration = Duration::from_millis(250);

impl Topology {
    pub(crate) fn new(config: CircuitConfig, clock: Arc<dyn Clock>, seed_host: &str) -> Self {
        Topology {
            map: ArcSwap::from_pointee(SlotMap {
                owners: vec![UNKNOWN; SLOTS].into_boxed_slice(),
                nodes: Vec::new(),
            }),
            known: Mutex::new(HashMap::new()),
            config,
            clock,
            refreshing: AtomicBool::new(false),
            last_refresh_us: AtomicU64::new(0),
            seed_host: seed_host.to_owned(),
        }
    }

    /// The primary serving `key`'s slot, if known.
    pub(crate) fn node_for(&self, key: &str) -> Option<Arc<Node>> {
        self.node_for_slot(slot_of(key.as_bytes()))
    }

    pub(crate) fn node_for_slot(&self, slot: u16) -> Option<Arc<Node>> {
        let map = self.map.load();
        let i = *map.owners.get(usize::from(slot))?;
        map.nodes.get(usize::from(i)).cloned()
    }

    /// The primaries of the current map.
    pub(crate) fn nodes(&self) -> Vec<Arc<Node>> {
        self.map.load().nodes.clone()
    }

    /// Installs a map read from the cluster. Slots no range covers stay
    /// unknown (their calls use the store-wide breaker).
    pub(crate) fn install(&self, ranges: &[SlotRange]) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let mut owners = vec![UNKNOWN; SLOTS].into_boxed_slice();
        let mut nodes: Vec<Arc<Node>> = Vec::new();
        for r in ranges {
            let key = (r.host.clone(), r.port);
            let node = known
                .entry(key)
                .or_insert_with(|| {
                    Arc::new(Node {
                        host: r.host.clone(),
                        port: r.port,
                        breaker: CircuitBreaker::new(self.config, self.clock.clone()),
                    })
                })
                .clone();
            let i = match nodes.iter().position(|n| Arc::ptr_eq(n, &node)) {
                Some(i) => i,
                None => {
                    nodes.push(node);
                    nodes.len() - 1
                }
            };
            let last = usize::from(r.last).min(SLOTS - 1);
            for owner in &mut owners[usize::from(r.first)..=last] {
                *owner = i as u16;
            }
        }
        self.map.store(Arc::new(SlotMap { owners, nodes }));
    }

    /// Permission to read the map again: at most one refresh at a time and
    /// one per `REFRESH_EVERY`. Whoever gets it calls
    /// [`end_refresh`](Self::end_refresh) however the refresh ends.
    pub(crate) fn begin_refresh(&self) -> bool {
        let now = micros(&*self.clock).max(1);
        let last = self.last_refresh_us.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < REFRESH_EVERY.as_micros() as u64 {
            return false;
        }
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.last_refresh_us.store(now, Ordering::Relaxed);
        true
    }

    pub(crate) fn end_refresh(&self) {
        self.refreshing.store(false, Ordering::Release);
    }

    /// Whether any primary is known yet.
    pub(crate) fn is_known(&self) -> bool {
        !self.map.load().nodes.is_empty()
    }

    /// The store's state from its nodes': `Open` when every node's breaker
    /// is open, `Closed` when every one is closed, `HalfOpen` otherwise
    /// (some calls are refused, others go through). `None` before the map
    /// is known.
    pub(crate) fn state(&self) -> Option<CircuitState> {
        let map = self.map.load();
        let mut states = map.nodes.iter().map(|n| n.breaker.state());
        let first = states.next()?;
        Some(states.fold(first, |all, s| {
            if s == all {
                all
            } else {
                CircuitState::HalfOpen
            }
        }))
    }

    /// Every node's address and breaker state.
    pub(crate) fn states(&self) -> Vec<(String, CircuitState)> {
        self.map
            .load()
            .nodes
            .iter()
            .map(|n| (n.address(), n.breaker.state()))
            .collect()
    }

    /// Trips and refusals summed over every node ever seen.
    pub(crate) fn totals(&self) -> (u64, u64) {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.values().fold((0, 0), |(t, r), n| {
            (t + n.breaker.trips(), r + n.breaker.refused())
        })
    }

    /// Reads a `CLUSTER SLOTS` reply: the primary of each range (replicas
    /// are ignored: calls never go to them). A node announcing no host is
    /// reached at the seed's host; one announced as `?` is skipped.
    pub(crate) fn parse_slots(&self, reply: Value) -> Result<Vec<SlotRange>, Error> {
        let bad = |what: &str| {
            Error::new(
                ErrorKind::Store,
                format!("unexpected CLUSTER SLOTS reply: {what}"),
            )
        };
        let Value::Array(entries) = reply else {
            return Err(bad("not an array"));
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Array(fields) = entry else {
                return Err(bad("an entry is not an array"));
            };
            let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(bad("an entry lacks its range or primary"));
            };
            let host = match primary.first() {
                Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
                Some(Value::SimpleString(h)) => h.clone(),
                _ => String::new(),
            };
            let host = match host.as_str() {
                "?" => continue,
                "" | "0.0.0.0" | "::" => self.seed_host.clone(),
                _ => host,
            };
            let Some(Value::Int(port)) = primary.get(1) else {
                return Err(bad("a primary without a port"));
            };
            let in_range = |n: i64| (0..SLOTS as i64).contains(&n);
            if !in_range(*first) || !in_range(*last) || first > last {
                return Err(bad("a slot range out of bounds"));
            }
            ranges.push(SlotRange {
                first: *first as u16,
                last: *last as u16,
                host,
                port: u16::try_from(*port).map_err(|_| bad("a port out of range"))?,
            });
        }
        Ok(ranges)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use redis::cluster_routing::Slot;

    fn topology() -> Topology {
        Topology::new(
            CircuitConfig::default().min_span(Duration::ZERO),
            Arc::new(FakeClock::new(Duration::from_secs(10))),
            "seed.host",
        )
    }

    fn entry(first: i64, last: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(first),
            Value::Int(last),
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
            Value::Array(vec![Value::BulkString(b"replica".to_vec()), Value::Int(1)]),
        ])
    }

    #[test]
    fn slots_agree_with_the_redis_client() {
        for key in [
            "",
            "a",
            "{user1000}.following",
            "foo{}{bar}",
            "foo{{bar}}zap",
            "{sl:k\u{e9}y}:fw",
            "x{y",
            "123456789",
        ] {
            assert_eq!(
                Slot::new(slot_of(key.as_bytes())),
                Some(Slot::for_key(key.as_bytes())),
                "{key:?}"
            );
        }
        // The CRC16 check value of the XMODEM variant.
        assert_eq!(slot_of(b"123456789"), 0x31C3);
    }

    #[test]
    fn a_refreshed_map_keeps_each_nodes_breaker() {
        let t = topology();
        assert!(t.node_for("k").is_none());
        assert_eq!(t.state(), None);
        let reply = Value::Array(vec![
            entry(0, 8_000, "10.0.0.1", 7000),
            entry(8_001, 16_383, "", 7001),
            entry(5, 5, "?", 7002),
        ]);
        let ranges = t.parse_slots(reply).unwrap();
        assert_eq!(ranges.len(), 2);
        assert_eq!(ranges[1].host, "seed.host");
        t.install(&ranges);
        let slot = slot_of(b"k");
        let node = t.node_for("k").unwrap();
        let expected = if slot <= 8_000 { 7000 } else { 7001 };
        assert!(node.address().ends_with(&expected.to_string()));
        for _ in 0..3 {
            let a = node.breaker.admit().unwrap();
            node.breaker.record(a, true);
        }
        assert_eq!(t.state(), Some(CircuitState::HalfOpen), "one of two open");
        // The slots move; the node keeps its open breaker.
        t.install(&[
            SlotRange {
                first: 0,
                last: 16_383,
                host: node.host.clone(),
                port: node.port,
            },
            SlotRange {
                first: 0,
                last: 0,
                host: "other".into(),
                port: 1,
            },
        ]);
        assert_eq!(t.node_for("k").unwrap().breaker.state(), CircuitState::Open);
        assert_eq!(t.totals().0, 1);
        assert!(t.parse_slots(Value::Int(1)).is_err());
        assert!(t
            .parse_slots(Value::Array(vec![entry(0, 20_000, "h", 1)]))
            .is_err());
    }

    #[test]
    fn refreshes_are_spaced() {
        let clock = FakeClock::new(Duration::from_secs(10));
        let t = Topology::new(CircuitConfig::default(), Arc::new(clock.clone()), "h");
        assert!(t.begin_refresh(), "the first refresh");
        assert!(!t.begin_refresh(), "one at a time");
        t.end_refresh();
        assert!(!t.begin_refresh(), "not again so soon");
        clock.advance(REFRESH_EVERY);
        assert!(t.begin_refresh());
    }
}
