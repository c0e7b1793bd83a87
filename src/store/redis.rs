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
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, Script, ServerErrorKind, Value};

use super::topology::{slot_of, Node, Topology};
use super::{AcquireReply, GiveBackCall, LeaseCall, LeaseReply, OpId, Params, StoreCost};
use crate::algorithm::{self, Arg};
use crate::breaker::{CircuitBreaker, CircuitConfig, CircuitState};
use crate::{Clock, Error, ErrorKind, SystemClock};

/// A script and its source, which `SCRIPT LOAD` sends to one node.
struct Lua {
    script: Script,
    source: &'static str,
}

impl Lua {
    fn new(source: &'static str) -> Self {
        Lua {
            script: Script::new(source),
            source,
        }
    }
}

/// Every script of `lua/`, by name, hashed once.
static SCRIPTS: LazyLock<std::collections::HashMap<&'static str, Lua>> = LazyLock::new(|| {
    algorithm::scripts()
        .map(|s| (s.name, Lua::new(s.source)))
        .collect()
});

fn script(lua: &algorithm::Lua) -> &'static Lua {
    &SCRIPTS[lua.name]
}

/// Appends a script's arguments to a command.
fn with_args(cmd: &mut Cmd, args: &[Arg]) {
    for arg in args {
        match arg {
            Arg::Uint(n) => cmd.arg(*n),
            Arg::Int(n) => cmd.arg(*n),
            Arg::Float(x) => cmd.arg(*x),
            Arg::Text(s) => cmd.arg(s.as_ref()),
        };
    }
}

/// Connection settings for a [`RedisStore`].
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisOptions {
    connect_timeout: Duration,
    response_timeout: Duration,
    circuit: CircuitConfig,
    /// What the circuit breakers time their windows and back-offs on.
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOptions")
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("circuit", &self.circuit)
            .finish_non_exhaustive()
    }
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_millis(500),
            response_timeout: Duration::from_millis(25),
            circuit: CircuitConfig::default(),
            clock: Arc::new(SystemClock::new()),
        }
    }
}

impl RedisOptions {
    fn validate(&self) -> Result<(), Error> {
        let day = Duration::from_secs(86_400);
        if self.response_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::invalid("Redis timeouts must be positive"));
        }
        if self.response_timeout > day || self.connect_timeout > day {
            return Err(Error::invalid(
                "Redis timeouts above a day are not timeouts",
            ));
        }
        self.circuit.validate()
    }

    /// How long establishing a connection may take (default 500 ms).
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one store call may take, reconnection included (default
    /// 25 ms, half the hybrid limiter's default `max_wait`, so a failed
    /// refill is known before a waiting request gives up). A rate limiter
    /// that waits longer than its callers' budget is worse than none.
    ///
    /// When answered calls take long (a Redis several milliseconds away,
    /// or a loaded one), the timeout in force stretches to six times their
    /// smoothed time, at most four times this: slow is not down. A Redis
    /// that stops answering adds nothing to that average.
    #[must_use]
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// When the circuit breaker opens and for how long (default: once at
    /// least 3 calls within 1 s failed and failures have gone on, most of
    /// the time, for 200 ms; open for 100 ms doubling to at most 1 s, with
    /// jitter). On a cluster each primary has a breaker of this
    /// configuration. See [`CircuitConfig`].
    #[must_use]
    pub fn circuit_breaker(mut self, config: CircuitConfig) -> Self {
        self.circuit = config;
        self
    }

    /// The clock the circuit breakers run on (default: the system clock):
    /// a test drives their windows and back-offs without sleeping. Call
    /// timeouts are real time whatever this says.
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The response timeout in force.
    pub fn get_response_timeout(&self) -> Duration {
        self.response_timeout
    }
}

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

/// How to make a fresh connection.
enum Client {
    Cluster(redis::cluster::ClusterClient),
    Single(redis::Client, ConnectionManagerConfig),
}

impl Client {
    async fn connect(&self) -> Option<Conn> {
        match self {
            Client::Cluster(c) => c.get_async_connection().await.ok().map(Conn::Cluster),
            Client::Single(c, config) => c
                .get_connection_manager_with_config(config.clone())
                .await
                .ok()
                .map(Conn::Single),
        }
    }
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
            .field("url", &self.inner.url)
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
    /// Connects to a single Redis node with the default options.
    ///
    /// # Errors
    /// A [`Connection`](crate::ErrorKind::Connection) or
    /// [`Timeout`](crate::ErrorKind::Timeout) error if the server cannot be
    /// reached within the connect timeout; an
    /// [`InvalidInput`](crate::ErrorKind::InvalidInput) error for a bad URL.
    pub async fn connect(url: &str) -> Result<RedisStore, Error> {
        RedisStore::connect_with(url, RedisOptions::default()).await
    }

    /// Connects to a single Redis node.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<RedisStore, Error> {
        options.validate()?;
        let client = Self::client(url)?;
        let config = Self::manager_config(&options);
        let conn = tokio::time::timeout(
            options.connect_timeout,
            client.get_connection_manager_with_config(config.clone()),
        )
        .await
        .map_err(|_| timeout_error(&format!("connecting to {url}"), options.connect_timeout))?
        .map_err(|e| {
            let kind = if e.is_timeout() {
                ErrorKind::Timeout
            } else {
                ErrorKind::Connection
            };
            Error::new(kind, format!("cannot connect to {url}: {e}")).caused_by(e)
        })?;
        Ok(Self::with_rebuild(
            Self::from_parts(Conn::Single(conn), options, url),
            Client::Single(client, config),
        ))
    }

    fn with_rebuild(mut store: RedisStore, client: Client) -> RedisStore {
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            inner.rebuild = Some(Rebuild {
                client,
                running: AtomicBool::new(false),
                last_us: AtomicU64::new(0),
                born: std::time::Instant::now(),
            });
        }
        store
    }

    /// Connects to a Redis Cluster through any of its nodes, with the
    /// default options.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_cluster(urls: &[&str]) -> Result<RedisStore, Error> {
        RedisStore::connect_cluster_with(urls, RedisOptions::default()).await
    }

    /// Connects to a Redis Cluster through any of its nodes. Each script
    /// call goes to the primary of its key's hash slot.
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_cluster_with(
        urls: &[&str],
        options: RedisOptions,
    ) -> Result<RedisStore, Error> {
        options.validate()?;
        // The client's own timeouts also bound its topology refreshes after
        // a failover, which must be allowed to finish in the background;
        // each call is still bounded by `response_timeout` here.
        let client = redis::cluster::ClusterClientBuilder::new(urls.iter().copied())
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.connect_timeout.max(options.response_timeout))
            .retries(2)
            .min_retry_wait(5)
            .max_retry_wait(50)
            .build()
            .map_err(|e| {
                Error::invalid(format!("bad Redis Cluster URLs {urls:?}: {e}")).caused_by(e)
            })?;
        let conn = tokio::time::timeout(options.connect_timeout, client.get_async_connection())
            .await
            .map_err(|_| {
                timeout_error(
                    &format!("connecting to the cluster at {urls:?}"),
                    options.connect_timeout,
                )
            })?
            .map_err(|e| {
                Error::new(
                    ErrorKind::Connection,
                    format!("cannot connect to the cluster at {urls:?}: {e}"),
                )
                .caused_by(e)
            })?;
        let mut store = Self::from_parts(Conn::Cluster(conn), options, &urls.join(","));
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            let seed_host = urls
                .first()
                .and_then(|u| redis::Client::open(*u).ok())
                .map(|c| match &c.get_connection_info().addr() {
                    redis::ConnectionAddr::Tcp(host, _) => host.clone(),
                    redis::ConnectionAddr::TcpTls { host, .. } => host.clone(),
                    _ => String::new(),
                })
                .unwrap_or_default();
            inner.topology = Some(Topology::new(
                inner.options.circuit,
                inner.options.clock.clone(),
                &seed_host,
            ));
        }
        let store = Self::with_rebuild(store, Client::Cluster(client));
        // The slot map; without it every call uses the store-wide breaker
        // until the first refresh.
        let _ =
            tokio::time::timeout(store.inner.options.connect_timeout, store.read_topology()).await;
        Ok(store)
    }

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
            let limit = store.inner.options.connect_timeout;
            if let Ok(Some(conn)) = tokio::time::timeout(limit, rebuild.client.connect()).await {
                store.inner.conn.store(Arc::new(conn));
            }
        });
    }

    /// Whether this store is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(**self.inner.conn.load(), Conn::Cluster(_))
    }

    /// Builds a store without connecting: the first call connects. A
    /// limiter built on it starts even while Redis is unreachable and
    /// applies its failure policy until Redis answers.
    ///
    /// # Errors
    /// An [`InvalidInput`](crate::ErrorKind::InvalidInput) error for a bad URL.
    pub fn connect_lazy(url: &str, options: RedisOptions) -> Result<RedisStore, Error> {
        options.validate()?;
        let client = Self::client(url)?;
        let config = Self::manager_config(&options);
        let conn = client
            .get_connection_manager_lazy(config.clone())
            .map_err(|e| {
                Error::invalid(format!("bad Redis configuration for {url}: {e}")).caused_by(e)
            })?;
        Ok(Self::with_rebuild(
            Self::from_parts(Conn::Single(conn), options, url),
            Client::Single(client, config),
        ))
    }

    fn client(url: &str) -> Result<redis::Client, Error> {
        redis::Client::open(url)
            .map_err(|e| Error::invalid(format!("bad Redis URL {url:?}: {e}")).caused_by(e))
    }

    fn manager_config(options: &RedisOptions) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            // Each call is bounded here, by `batch_timeout`; the manager's
            // own limit only backs that up for the largest batch.
            .set_response_timeout(Some(batch_timeout(options.response_timeout, usize::MAX)))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500))
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

    /// Sends one call (a command or a pipeline) through the breaker of
    /// `node`, or the store's when there is none, for at most `limit` (see
    /// [`batch_timeout`]). `refused` tells a reply that arrived but says
    /// the server cannot serve (a pipeline whose calls answered `READONLY`,
    /// `LOADING`, …): that is unavailability, not success.
    ///
    /// The connection is rebuilt, and a cluster's slot map read again, only
    /// on evidence that it is wrong: a connection error, a redirection, a
    /// server refusing to serve, a breaker opening (timeouts that went on
    /// long enough), or a node that answered nothing for a while (see
    /// [`CircuitBreaker::record`]). One timeout, or a stall that timed out
    /// many calls at once, is not such evidence.
    /// A call answered after `took`: folded into the smoothed answer time.
    fn answered(&self, took: Duration) {
        let took = took.as_micros().min(u128::from(u64::MAX)) as u64;
        let old = self.inner.answered_us.load(Ordering::Relaxed);
        let new = if old == 0 { took } else { (old * 7 + took) / 8 };
        self.inner.answered_us.store(new, Ordering::Relaxed);
    }

    /// The response timeout in force: the configured one, or a few times
    /// what answered calls take now if that is longer (a Redis several
    /// milliseconds away, or a loaded one, is slow, not down), at most
    /// `MAX_TIMEOUT_STRETCH` times the configured one. A Redis that stops
    /// answering adds nothing to the average, so it times out as soon.
    fn response_timeout(&self) -> Duration {
        let configured = self.inner.options.response_timeout;
        let answered = Duration::from_micros(self.inner.answered_us.load(Ordering::Relaxed));
        (answered * TIMEOUT_PER_ANSWER)
            .min(configured * MAX_TIMEOUT_STRETCH)
            .max(configured)
    }

    async fn bounded_judged<T>(
        &self,
        what: &str,
        node: Option<&Node>,
        limit: Duration,
        fut: impl std::future::Future<Output = Result<T, redis::RedisError>>,
        refused: impl Fn(&T) -> bool,
    ) -> Result<T, Error> {
        let breaker = node.map_or(&self.inner.breaker, |n| &n.breaker);
        let admission = breaker.admit()?;
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        let mut moved = false;
        let began = tokio::time::Instant::now();
        let result = match tokio::time::timeout(limit, fut).await {
            Ok(Ok(reply)) => {
                self.answered(began.elapsed());
                Ok(reply)
            }
            Ok(result) => result.map_err(|e| {
                moved = is_layout_change(&e);
                Error::from_redis(e)
            }),
            Err(_) => Err(timeout_error(what, limit)),
        };
        let (unavailable, evidence) = match &result {
            Err(e) => (
                e.is_timeout() || e.is_connection(),
                e.is_connection() || moved,
            ),
            Ok(reply) => (refused(reply), refused(reply)),
        };
        let suspect = breaker.record(admission, unavailable);
        if suspect || evidence {
            self.maybe_rebuild();
            self.refresh_topology();
        }
        result
    }

    /// One exact check-and-count through the breaker of the key's primary
    /// (the store's on a single node); returns what it cost.
    pub(crate) async fn acquire(
        &self,
        key: &str,
        p: &Params,
        cost: u64,
    ) -> (Result<AcquireReply, Error>, StoreCost) {
        let spec = p.algorithm.spec();
        let lua = script(&spec.exact);
        let (_, mut cmd) = Self::evalsha(&lua.script, key, None);
        let mut args = Vec::with_capacity(4);
        (spec.exact_args)(p, cost, &mut args);
        with_args(&mut cmd, &args);
        let node = self.node_for(key);
        let (reply, round_trips) = self.script_call(lua, node.as_deref(), cmd).await;
        let reply = reply.and_then(|reply| {
            let values = reply.extract_error().map_err(Error::from_redis)?;
            let values = redis::from_redis_value::<Vec<i64>>(values).map_err(parse_error)?;
            AcquireReply::from_values(&values)
        });
        let cost = StoreCost {
            round_trips,
            calls: u64::from(round_trips > 0),
        };
        (reply, cost)
    }

    /// Several quotas of one key in one script call, all-or-nothing (see
    /// `lua/check_all.lua`). Every key shares one hash tag, so one slot.
    pub(crate) async fn acquire_all(
        &self,
        keys: &[String],
        ps: &[Params],
        cost: u64,
    ) -> (Result<Vec<AcquireReply>, Error>, StoreCost) {
        let spec = ps[0].algorithm.spec();
        let lua = script(&spec.exact_all);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(lua.script.get_hash()).arg(keys.len());
        for key in keys {
            cmd.arg(key);
        }
        let mut args = Vec::with_capacity(4 * ps.len());
        let mut width = 0;
        for p in ps {
            let before = args.len();
            (spec.exact_args)(p, cost, &mut args);
            width = args.len() - before;
        }
        cmd.arg(keys.len()).arg(width);
        with_args(&mut cmd, &args);
        let node = self.node_for(&keys[0]);
        let (reply, round_trips) = self.script_call(lua, node.as_deref(), cmd).await;
        let reply = reply.and_then(|reply| {
            let values = reply.extract_error().map_err(Error::from_redis)?;
            let values = redis::from_redis_value::<Vec<i64>>(values).map_err(parse_error)?;
            if values.len() != crate::algorithm::CHECK_REPLY_LEN * keys.len() {
                return Err(Error::new(
                    ErrorKind::Store,
                    format!(
                        "check_all returned {} values for {} quotas",
                        values.len(),
                        keys.len()
                    ),
                ));
            }
            values
                .chunks(crate::algorithm::CHECK_REPLY_LEN)
                .map(AcquireReply::from_values)
                .collect()
        });
        let cost = StoreCost {
            round_trips,
            calls: u64::from(round_trips > 0),
        };
        (reply, cost)
    }

    /// One script call through `node`'s breaker (the store's when there is
    /// none); on `NOSCRIPT`, loads the script where the call went (that
    /// primary alone on a cluster) and sends the call once more, all within
    /// one response timeout. Returns the round trips it took.
    async fn script_call(
        &self,
        lua: &Lua,
        node: Option<&Node>,
        cmd: Cmd,
    ) -> (Result<Value, Error>, u64) {
        let budget = self.response_timeout();
        let deadline = tokio::time::Instant::now() + budget;
        let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
        let mut trips = 0;
        let mut loaded = false;
        loop {
            if left().is_zero() {
                // The reload took the whole budget: not the store's fault.
                return (Err(timeout_error("check script", budget)), trips);
            }
            let mut conn = (**self.inner.conn.load()).clone();
            let sent = self
                .bounded_judged(
                    "check script",
                    node,
                    left(),
                    conn.req_packed_command(&cmd),
                    refuses,
                )
                .await;
            if !matches!(&sent, Err(e) if e.is_circuit_open()) {
                trips += 1;
            }
            match sent {
                Ok(reply) if is_noscript(&reply) && !loaded => {}
                other => return (other, trips),
            }
            loaded = true;
            let load = self.load_script(lua, node, left()).await;
            if !matches!(&load, Err(e) if e.is_circuit_open()) {
                trips += 1;
            }
            if let Err(e) = load {
                return (Err(e), trips);
            }
        }
    }

    /// Loads a script where a call answered `NOSCRIPT`: the single node, or
    /// on a cluster the primary serving the call's slot (every primary when
    /// it is not known). A cluster-wide `SCRIPT LOAD` would fail while any
    /// one primary is down.
    async fn load_script(
        &self,
        lua: &Lua,
        node: Option<&Node>,
        limit: Duration,
    ) -> Result<(), Error> {
        let conn = (**self.inner.conn.load()).clone();
        match (conn, node) {
            (Conn::Cluster(mut conn), Some(node)) => {
                let mut cmd = redis::cmd("SCRIPT");
                cmd.arg("LOAD").arg(lua.source);
                let fut = conn.route_command(cmd, node.route());
                let reply = self
                    .bounded_judged("SCRIPT LOAD", Some(node), limit, fut, |_| false)
                    .await?;
                reply.extract_error().map(drop).map_err(Error::from_redis)
            }
            (mut conn, _) => {
                let fut = lua.script.load_async(&mut conn);
                self.bounded_judged("SCRIPT LOAD", node, limit, fut, |_| false)
                    .await
                    .map(drop)
            }
        }
    }

    /// Sends EVALSHA commands (with their keys) as pipelines: one on a
    /// single node, one per hash slot (concurrently) on a cluster, since a
    /// pipeline cannot cross slots (the cluster client redirects a pipeline
    /// whole). Each slot's pipeline passes its primary's breaker, so a
    /// batch spanning a dead primary fails only that primary's calls.
    /// Replies come back in call order, with what the batch cost.
    ///
    /// `ahead`: calls the caller has in flight before these on the same
    /// connection (concurrent pipelines); they count toward the timeout.
    async fn pipelined(
        &self,
        lua: &'static Lua,
        cmds: Vec<(String, Cmd)>,
        ahead: usize,
    ) -> (Result<Vec<Result<Value, Error>>, Error>, StoreCost) {
        if !self.is_cluster() {
            let count = cmds.len() as u64;
            let cmds: Vec<Cmd> = cmds.into_iter().map(|(_, c)| c).collect();
            let (result, round_trips) = self.pipeline_once(lua, cmds, None, ahead).await;
            let cost = StoreCost {
                round_trips,
                calls: if round_trips > 0 { count } else { 0 },
            };
            return (
                result.map(|values| values.into_iter().map(Ok).collect()),
                cost,
            );
        }
        let mut groups: Vec<(u16, Vec<usize>, Vec<Cmd>)> = Vec::new();
        let mut by_slot: std::collections::HashMap<u16, usize> = std::collections::HashMap::new();
        for (i, (key, cmd)) in cmds.into_iter().enumerate() {
            let slot = slot_of(key.as_bytes());
            let g = *by_slot.entry(slot).or_insert_with(|| {
                groups.push((slot, Vec::new(), Vec::new()));
                groups.len() - 1
            });
            groups[g].1.push(i);
            groups[g].2.push(cmd);
        }
        let total: usize = groups.iter().map(|(_, idx, _)| idx.len()).sum();
        let mut tasks = tokio::task::JoinSet::new();
        for (slot, idx, group) in groups {
            let store = self.clone();
            tasks.spawn(async move {
                let node = store.node_for_slot(slot);
                let (result, trips) = store
                    .pipeline_once(lua, group, node.as_deref(), ahead)
                    .await;
                (idx, result, trips)
            });
        }
        let mut out: Vec<Result<Value, Error>> = (0..total).map(|_| Ok(Value::Nil)).collect();
        let mut cost = StoreCost::default();
        let mut first_error = None;
        while let Some(joined) = tasks.join_next().await {
            let (idx, result, trips) = match joined {
                Ok(done) => done,
                Err(e) => {
                    let e =
                        Error::new(ErrorKind::Store, format!("pipeline task: {e}")).caused_by(e);
                    return (Err(e), cost);
                }
            };
            cost.round_trips += trips;
            if trips > 0 {
                cost.calls += idx.len() as u64;
            }
            match result {
                Ok(values) => {
                    for (i, v) in idx.into_iter().zip(values) {
                        out[i] = Ok(v);
                    }
                }
                Err(e) => {
                    // Other slots may have answered: fail only these calls.
                    for i in idx {
                        out[i] = Err(e.clone());
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        let result = match first_error {
            Some(e) if out.iter().all(Result::is_err) => Err(e),
            _ => Ok(out),
        };
        (result, cost)
    }

    /// One pipeline through `node`'s breaker; on `NOSCRIPT` (restart,
    /// failover, `SCRIPT FLUSH`) loads the script where it is missing and
    /// resends once. Returns the round trips it took (pipelines and script
    /// loads sent; 0 if the breaker refused it).
    async fn pipeline_once(
        &self,
        lua: &Lua,
        cmds: Vec<Cmd>,
        node: Option<&Node>,
        ahead: usize,
    ) -> (Result<Vec<Value>, Error>, u64) {
        let mut trips = 0;
        let mut loaded = false;
        loop {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for cmd in &cmds {
                pipe.add_command(cmd.clone());
            }
            let mut conn = (**self.inner.conn.load()).clone();
            let (_queued, in_flight) = Queued::enter(&self.inner.queued, cmds.len());
            let calls = (cmds.len() + ahead).max(in_flight as usize);
            let sent = self
                .bounded_judged(
                    "pipelined scripts",
                    node,
                    batch_timeout(self.response_timeout(), calls),
                    pipe.query_async(&mut conn),
                    |values: &Vec<Value>| values.iter().any(refuses),
                )
                .await;
            if !matches!(&sent, Err(e) if e.is_circuit_open()) {
                trips += 1;
            }
            let values = match sent {
                Ok(values) => values,
                Err(e) => return (Err(e), trips),
            };
            if !values.iter().any(is_noscript) {
                return (Ok(values), trips);
            }
            if loaded {
                // Still missing where it was loaded: the slot map is stale.
                self.refresh_topology();
                return (Ok(values), trips);
            }
            loaded = true;
            let load = self.load_script(lua, node, self.response_timeout()).await;
            if !matches!(&load, Err(e) if e.is_circuit_open()) {
                trips += 1;
            }
            if let Err(e) = load {
                return (Err(e), trips);
            }
        }
    }

    /// An EVALSHA of `script` on `key`, with a report's identity key as
    /// KEYS[2] when it has one (same hash slot: it extends the store key).
    fn evalsha(script: &Script, key: &str, op: Option<OpId>) -> (String, Cmd) {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash());
        match op {
            Some(op) => cmd.arg(2).arg(key).arg(op.key_for(key)),
            None => cmd.arg(1).arg(key),
        };
        (key.to_owned(), cmd)
    }

    pub(crate) async fn lease_batch(
        &self,
        p: &Params,
        calls: &[LeaseCall],
        ahead: usize,
    ) -> (Result<Vec<Result<LeaseReply, Error>>, Error>, StoreCost) {
        let spec = p.algorithm.spec();
        let lua = script(&spec.lease);
        let script = &lua.script;
        let mut args = Vec::with_capacity(12);
        let cmds = calls
            .iter()
            .map(|c| {
                let op = c.op.filter(|_| c.debt > 0);
                let (key, mut cmd) = Self::evalsha(script, &c.key, op);
                args.clear();
                (spec.lease_args)(p, c, &mut args);
                with_args(&mut cmd, &args);
                (key, cmd)
            })
            .collect();
        let (values, cost) = self.pipelined(lua, cmds, ahead).await;
        let replies = values.map(|values| {
            values
                .into_iter()
                .map(|v| {
                    v.and_then(value_to_ints)
                        .and_then(|ints| LeaseReply::from_values(&ints))
                })
                .collect()
        });
        (replies, cost)
    }

    pub(crate) async fn give_back_batch(
        &self,
        p: &Params,
        calls: &[GiveBackCall],
    ) -> (Result<Vec<Result<u64, Error>>, Error>, StoreCost) {
        let give_back_args = p.algorithm.spec().give_back_args;
        let lua = script(&algorithm::GIVE_BACK);
        let script = &lua.script;
        let mut args = Vec::with_capacity(8);
        let cmds = calls
            .iter()
            .map(|c| {
                let (key, mut cmd) = Self::evalsha(script, &c.key, Some(c.op));
                args.clear();
                give_back_args(p, c, &mut args);
                with_args(&mut cmd, &args);
                (key, cmd)
            })
            .collect();
        let (values, cost) = self.pipelined(lua, cmds, 0).await;
        let replies = values.map(|values| {
            values
                .into_iter()
                .map(|v| match v? {
                    Value::ServerError(e) => Err(Error::from_redis(redis::RedisError::from(e))),
                    v => redis::from_redis_value::<i64>(v)
                        .map(|n| n.max(0) as u64)
                        .map_err(parse_error),
                })
                .collect()
        });
        (replies, cost)
    }
}

/// A call may take this many times what answered calls take lately
/// before it times out (when that is longer than the configured timeout).
/// Measured: at a 3–7 ms round trip on a loaded 2-core machine a few calls
/// a minute took over 25 ms and each timeout sent a batch of decisions to
/// the failure policy.
const TIMEOUT_PER_ANSWER: u32 = 6;

/// The most the response timeout stretches, in times the configured one.
const MAX_TIMEOUT_STRETCH: u32 = 4;

/// How long a pipeline may take with `calls` scripts queued up to its own
/// (those in flight before it, on this store, and its own): the response
/// timeout, plus a quarter of it per 128 calls, at most eight times it.
fn batch_timeout(response: Duration, calls: usize) -> Duration {
    response + (response / 4) * (calls / 128).min(28) as u32
}

fn value_to_ints(v: Value) -> Result<Vec<i64>, Error> {
    match v {
        Value::ServerError(e) => Err(Error::from_redis(redis::RedisError::from(e))),
        v => redis::from_redis_value::<Vec<i64>>(v).map_err(parse_error),
    }
}
