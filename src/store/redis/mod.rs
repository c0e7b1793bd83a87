//! The Redis store: typed wrappers around the scripts in `lua/`.
//!
//! Owns the connection (single node: reconnecting; cluster: slot-aware,
//! following `MOVED` / `ASK`), script loading and `NOSCRIPT` recovery, and
//! pipelining of batched lease calls (on a cluster, one pipeline per hash
//! slot, sent concurrently). Every call is bounded by the response timeout;
//! nothing here waits longer. Calls pass a circuit breaker: the store's on a
//! single node, their primary's on a cluster (see [`topology`](super::topology)),
//! so one unavailable shard refuses only its own keys. It makes no decisions
//! and applies no failure policy: errors go back to the caller classified.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, ServerErrorKind, Value};

use super::topology::{Node, Topology};
use super::Backend;
use crate::breaker::{CircuitBreaker, CircuitState};
use crate::error::{Error, ErrorKind};

mod calls;
mod connect;
mod options;
#[cfg(feature = "sentinel")]
mod sentinel;
mod url;

use connect::Client;
pub use options::RedisOptions;
#[cfg(feature = "tls")]
pub use options::TlsOptions;
#[cfg(feature = "sentinel")]
pub use sentinel::Sentinel;

/// A Redis server holding the shared budgets.
///
/// Cheap to clone: clones share one reconnecting connection. Give each
/// simulated server its own [`RedisStore::connect`] to model separate
/// processes.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

/// A single node or a cluster; both are cheap to clone and shareable.
#[derive(Clone)]
enum Conn {
    /// Reconnects in the background after a failure; the call that hit the
    /// broken connection still fails, and the failure policy handles it.
    Single(ConnectionManager),
    /// Routes each call by its key's slot and follows redirections.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

struct Inner {
    /// Swapped whole when a cluster connection is rebuilt.
    conn: ArcSwap<Conn>,
    /// Cluster only: how to build a fresh connection after a failover,
    /// when the old one keeps timing out.
    rebuild: Option<Rebuild>,
    options: RedisOptions,
    /// Where it connects, for messages; never holds a password.
    url: String,
    /// Stops calls to a store that keeps failing: every call on a single
    /// node; on a cluster, calls on slots whose primary is not known yet.
    breaker: CircuitBreaker,
    /// Cluster only: each slot's primary and each primary's breaker.
    topology: Option<Topology>,
    /// Calls sent to Redis (pipelines count once).
    calls: AtomicU64,
    /// Script calls in pipelines now in flight on this store (all its
    /// clones: they share the connection). Redis runs them one after the
    /// other, so a pipeline's timeout allows for every call queued with it.
    queued: AtomicU64,
    /// What a call that was answered took, smoothed (µs; 0: none yet):
    /// the timeout stretches to a few of these (see `response_timeout`).
    answered_us: AtomicU64,
}

/// A pipeline's calls, counted in `Inner::queued` while it is in flight.
struct Queued<'a> {
    counter: &'a AtomicU64,
    calls: u64,
}

impl<'a> Queued<'a> {
    /// Counts `calls` in; returns the guard and the calls now in flight.
    fn enter(counter: &'a AtomicU64, calls: usize) -> (Queued<'a>, u64) {
        let calls = calls as u64;
        let total = counter.fetch_add(calls, Ordering::AcqRel) + calls;
        (Queued { counter, calls }, total)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.calls, Ordering::AcqRel);
    }
}

/// Clears the topology's refresh flag when the refresh task ends, however
/// it ends.
struct Refreshing(RedisStore);

impl Drop for Refreshing {
    fn drop(&mut self) {
        if let Some(topology) = &self.0.inner.topology {
            topology.end_refresh();
        }
    }
}

/// Whether a failed call says the cluster's layout changed under the
/// client: a redirection it could not follow, a slot being migrated or
/// without a primary, a node it has no connection to.
fn is_layout_change(e: &redis::RedisError) -> bool {
    e.is_cluster_error()
        || e.redirect_node().is_some()
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
}

/// Whether a reply says the server cannot serve: a demoted primary, a
/// restart loading its data, a cluster without a quorum.
fn refuses(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if matches!(
        e.kind(),
        Some(
            ServerErrorKind::ReadOnly
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::TryAgain
        )
    ))
}

fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript))
}

/// Rebuilding a connection from scratch. Cluster: after a primary dies, the
/// client's own topology refresh can stall behind the dead node; a fresh
/// connection asks a live node for the slot map. Single node: a connection
/// that silently stopped answering (a half-open TCP connection, a backend
/// gone behind a proxy or load balancer) only ever times out, and the
/// connection manager reconnects on errors, never on timeouts; a demoted
/// primary answers `READONLY` on a connection that works.
struct Rebuild {
    client: Client,
    /// A rebuild is under way.
    running: AtomicBool,
    /// When the last one started (µs since the store was built), so
    /// failures rebuild at most every `REBUILD_EVERY`.
    last_us: AtomicU64,
    born: std::time::Instant,
}

/// Clears `Rebuild::running` when the rebuild task ends, however it ends.
struct Rebuilding(RedisStore);

impl Drop for Rebuilding {
    fn drop(&mut self) {
        if let Some(rebuild) = &self.0.inner.rebuild {
            rebuild.running.store(false, Ordering::Release);
        }
    }
}

const REBUILD_EVERY: Duration = Duration::from_millis(500);

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.inner.url)
            .field("options", &self.inner.options)
            .finish()
    }
}

fn timeout_error(what: &str, after: Duration) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!("{what} did not finish within {after:?}"),
    )
}

fn parse_error(err: impl fmt::Display) -> Error {
    Error::new(ErrorKind::Store, format!("unexpected reply: {err}"))
}

impl RedisStore {
    /// Reads the slot map again in the background (at most one refresh at
    /// a time, one per 250 ms).
    fn refresh_topology(&self) {
        let Some(topology) = &self.inner.topology else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !topology.begin_refresh() {
            return;
        }
        let guard = Refreshing(self.clone());
        runtime.spawn(async move {
            let store = &guard.0;
            let limit = store.inner.options.connect_timeout;
            let _ = tokio::time::timeout(limit, store.read_topology()).await;
        });
    }

    /// Asks the primaries, those whose breaker is closed first, for the
    /// slot map, and installs the first answer.
    async fn read_topology(&self) {
        let Some(topology) = &self.inner.topology else {
            return;
        };
        let Conn::Cluster(conn) = &**self.inner.conn.load() else {
            return;
        };
        let mut nodes = topology.nodes();
        nodes.sort_by_key(|n| n.breaker.state() != CircuitState::Closed);
        let routes = nodes
            .iter()
            .map(|n| n.route())
            .chain([RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)]);
        let each = (self.inner.options.response_timeout * 4).max(Duration::from_millis(100));
        for route in routes {
            let mut conn = conn.clone();
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            let Ok(Ok(reply)) = tokio::time::timeout(each, conn.route_command(cmd, route)).await
            else {
                continue;
            };
            if let Ok(ranges) = topology.parse_slots(reply) {
                if !ranges.is_empty() {
                    topology.install(&ranges);
                    return;
                }
            }
        }
    }

    /// After an unavailability error, replaces the connection in the
    /// background (at most every 500 ms); calls go on over the old one
    /// until the new one is ready.
    fn maybe_rebuild(&self) {
        let Some(rebuild) = &self.inner.rebuild else {
            return;
        };
        let now = rebuild.born.elapsed().as_micros() as u64;
        let last = rebuild.last_us.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < REBUILD_EVERY.as_micros() as u64 {
            return;
        }
        if rebuild.running.swap(true, Ordering::AcqRel) {
            return;
        }
        rebuild.last_us.store(now.max(1), Ordering::Relaxed);
        let store = self.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            rebuild.running.store(false, Ordering::Release);
            return;
        };
        // The flag is cleared by a guard the task owns, so a task dropped
        // unfinished (its runtime shut down, even before its first poll)
        // does not leave the store unable to rebuild ever again.
        let guard = Rebuilding(store);
        runtime.spawn(async move {
            let store = &guard.0;
            let Some(rebuild) = &store.inner.rebuild else {
                return;
            };
            let limit = rebuild
                .client
                .connect_limit(store.inner.options.connect_timeout);
            if let Ok(Some(conn)) = tokio::time::timeout(limit, rebuild.client.connect()).await {
                store.inner.conn.store(Arc::new(conn));
            }
        });
    }

    /// Whether this store is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(**self.inner.conn.load(), Conn::Cluster(_))
    }

    fn from_parts(conn: Conn, options: RedisOptions, url: &str) -> RedisStore {
        let breaker = CircuitBreaker::new(options.circuit, options.clock.clone());
        RedisStore {
            inner: Arc::new(Inner {
                conn: ArcSwap::from_pointee(conn),
                rebuild: None,
                options,
                url: url.to_owned(),
                breaker,
                topology: None,
                calls: AtomicU64::new(0),
                answered_us: AtomicU64::new(0),
                queued: AtomicU64::new(0),
            }),
        }
    }

    /// The circuit breaker's state. On a cluster, where each primary has
    /// its own breaker: `Open` when every primary's breaker is open,
    /// `Closed` when every one is closed, `HalfOpen` otherwise (calls on
    /// some slots are refused, the others go through); see
    /// [`circuit_states`](Self::circuit_states) for each primary's.
    pub fn circuit_state(&self) -> CircuitState {
        self.inner
            .topology
            .as_ref()
            .and_then(Topology::state)
            .unwrap_or_else(|| self.inner.breaker.state())
    }

    /// Each primary's address and breaker state (a cluster; empty for a
    /// single node).
    pub fn circuit_states(&self) -> Vec<(String, CircuitState)> {
        self.inner
            .topology
            .as_ref()
            .map(Topology::states)
            .unwrap_or_default()
    }

    /// Times a circuit breaker has opened (on a cluster, summed over its
    /// primaries).
    pub fn circuit_trips(&self) -> u64 {
        let nodes = self.inner.topology.as_ref().map_or(0, |t| t.totals().0);
        self.inner.breaker.trips() + nodes
    }

    /// Calls refused by an open circuit breaker (never sent).
    pub fn calls_refused(&self) -> u64 {
        let nodes = self.inner.topology.as_ref().map_or(0, |t| t.totals().1);
        self.inner.breaker.refused() + nodes
    }

    /// Calls sent to Redis; a pipeline counts once.
    pub fn calls_sent(&self) -> u64 {
        self.inner.calls.load(Ordering::Relaxed)
    }

    /// While the breaker is open, the time until it next lets a call
    /// through. On a cluster, the soonest probe of any open primary, and
    /// only while every primary is open.
    pub(crate) fn retry_hint(&self) -> Option<Duration> {
        match &self.inner.topology {
            Some(t) if t.is_known() => t.nodes().iter().try_fold(None, |soonest, n| {
                let hint = n.breaker.retry_hint()?;
                Some(Some(soonest.map_or(hint, |s: Duration| s.min(hint))))
            })?,
            _ => self.inner.breaker.retry_hint(),
        }
    }

    /// While the breaker guarding `store_key` is open, the time until it
    /// next lets a call through.
    pub(crate) fn retry_hint_for(&self, store_key: &str) -> Option<Duration> {
        match self.node_for(store_key) {
            Some(node) => node.breaker.retry_hint(),
            None => self.retry_hint(),
        }
    }

    /// The primary serving `key`'s slot, on a cluster whose map is known;
    /// asks for the map when it is not.
    fn node_for(&self, key: &str) -> Option<Arc<Node>> {
        let topology = self.inner.topology.as_ref()?;
        let node = topology.node_for(key);
        if node.is_none() {
            self.refresh_topology();
        }
        node
    }

    fn node_for_slot(&self, slot: u16) -> Option<Arc<Node>> {
        let topology = self.inner.topology.as_ref()?;
        let node = topology.node_for_slot(slot);
        if node.is_none() {
            self.refresh_topology();
        }
        node
    }

    /// The options this store was connected with.
    pub fn options(&self) -> &RedisOptions {
        &self.inner.options
    }
}

impl Backend for RedisStore {
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn super::Call],
        ahead: usize,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = super::Ran> + Send + 'a>> {
        Box::pin(self.run_calls(calls, ahead))
    }

    fn retry_hint(&self, key: Option<&str>) -> Option<Duration> {
        match key {
            Some(key) => self.retry_hint_for(key),
            None => RedisStore::retry_hint(self),
        }
    }

    fn is_sharded(&self) -> bool {
        self.is_cluster()
    }

    fn circuit_state(&self) -> CircuitState {
        RedisStore::circuit_state(self)
    }

    fn circuit_trips(&self) -> u64 {
        RedisStore::circuit_trips(self)
    }
}
