//! The calls: scripts loaded and sent (one at a time or pipelined), each
//! bounded by a timeout and judged by a breaker, replies parsed.

use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, Value};

use super::{
    is_layout_change, is_noscript, parse_error, refuses, timeout_error, Conn, Queued, RedisStore,
};
use crate::error::{Error, ErrorKind};
use crate::store::topology::{slot_of, Node};
use crate::store::StoreCost;

use crate::store::{Arg, Call, Lua, Ran};

/// Appends a script's arguments to a command.
pub(super) fn with_args(cmd: &mut Cmd, args: &[Arg]) {
    for arg in args {
        match arg {
            Arg::Uint(n) => cmd.arg(*n),
            Arg::Int(n) => cmd.arg(*n),
            Arg::Float(x) => cmd.arg(*x),
            Arg::Text(s) => cmd.arg(s.as_ref()),
        };
    }
}

impl RedisStore {
    /// A call answered after `took`: folded into the smoothed answer time.
    pub(super) fn answered(&self, took: Duration) {
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
    pub(super) fn response_timeout(&self) -> Duration {
        let configured = self.inner.options.response_timeout;
        let answered = Duration::from_micros(self.inner.answered_us.load(Ordering::Relaxed));
        (answered * TIMEOUT_PER_ANSWER)
            .min(configured * MAX_TIMEOUT_STRETCH)
            .max(configured)
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
    pub(super) async fn bounded_judged<T>(
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

    /// One script call through `node`'s breaker (the store's when there is
    /// none); on `NOSCRIPT`, loads the script where the call went (that
    /// primary alone on a cluster) and sends the call once more, all within
    /// one response timeout. Returns the round trips it took.
    pub(super) async fn script_call(
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
    pub(super) async fn load_script(
        &self,
        lua: &Lua,
        node: Option<&Node>,
        limit: Duration,
    ) -> Result<(), Error> {
        let conn = (**self.inner.conn.load()).clone();
        match (conn, node) {
            (Conn::Cluster(mut conn), Some(node)) => {
                let mut cmd = redis::cmd("SCRIPT");
                cmd.arg("LOAD").arg(lua.source());
                let fut = conn.route_command(cmd, node.route());
                let reply = self
                    .bounded_judged("SCRIPT LOAD", Some(node), limit, fut, |_| false)
                    .await?;
                reply.extract_error().map(drop).map_err(Error::from_redis)
            }
            (mut conn, _) => {
                let mut cmd = redis::cmd("SCRIPT");
                cmd.arg("LOAD").arg(lua.source());
                let fut = async move { conn.req_packed_command(&cmd).await };
                let reply = self
                    .bounded_judged("SCRIPT LOAD", node, limit, fut, |_| false)
                    .await?;
                reply.extract_error().map(drop).map_err(Error::from_redis)
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
    pub(super) async fn pipelined(
        &self,
        cmds: Vec<Pending>,
        ahead: usize,
    ) -> (Result<Vec<Result<Value, Error>>, Error>, StoreCost) {
        if !self.is_cluster() {
            let count = cmds.len() as u64;
            let (result, round_trips) = self.pipeline_once(cmds, None, ahead).await;
            let cost = StoreCost::sent(round_trips, count);
            return (
                result.map(|values| values.into_iter().map(Ok).collect()),
                cost,
            );
        }
        let mut groups: Vec<(u16, Vec<usize>, Vec<Pending>)> = Vec::new();
        let mut by_slot: std::collections::HashMap<u16, usize> = std::collections::HashMap::new();
        for (i, cmd) in cmds.into_iter().enumerate() {
            let slot = slot_of(cmd.key.as_bytes());
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
                let (result, trips) = store.pipeline_once(group, node.as_deref(), ahead).await;
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
    pub(super) async fn pipeline_once(
        &self,
        cmds: Vec<Pending>,
        node: Option<&Node>,
        ahead: usize,
    ) -> (Result<Vec<Value>, Error>, u64) {
        let mut trips = 0;
        let mut loaded = false;
        loop {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for pending in &cmds {
                pipe.add_command(pending.cmd.clone());
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
            // Load each script a call found missing, once.
            let mut missing: Vec<&'static Lua> = Vec::new();
            for (pending, value) in cmds.iter().zip(&values) {
                if is_noscript(value) && !missing.iter().any(|l| std::ptr::eq(*l, pending.lua)) {
                    missing.push(pending.lua);
                }
            }
            for lua in missing {
                let load = self.load_script(lua, node, self.response_timeout()).await;
                if !matches!(&load, Err(e) if e.is_circuit_open()) {
                    trips += 1;
                }
                if let Err(e) = load {
                    return (Err(e), trips);
                }
            }
        }
    }

    /// The `EVALSHA` command of a call: its script's hash, its keys, its
    /// arguments.
    pub(super) fn evalsha(call: &dyn Call, keys: &mut Vec<String>, args: &mut Vec<Arg>) -> Cmd {
        keys.clear();
        args.clear();
        call.more_keys(keys);
        call.args(args);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(call.lua().sha())
            .arg(1 + keys.len())
            .arg(call.key());
        for key in keys.iter() {
            cmd.arg(key);
        }
        with_args(&mut cmd, args);
        cmd
    }

    /// Runs a batch of calls: one alone as one command through its key's
    /// breaker, more as pipelines (see [`pipelined`](Self::pipelined)).
    pub(super) async fn run_calls(&self, calls: &[&dyn Call], ahead: usize) -> Ran {
        let mut keys = Vec::new();
        let mut args = Vec::with_capacity(16);
        if let ([call], 0) = (calls, ahead) {
            let cmd = Self::evalsha(*call, &mut keys, &mut args);
            let node = self.node_for(call.key());
            let (reply, round_trips) = self.script_call(call.lua(), node.as_deref(), cmd).await;
            return Ran {
                replies: Ok(vec![reply.and_then(value_to_ints)]),
                cost: StoreCost::sent(round_trips, 1),
            };
        }
        let cmds = calls
            .iter()
            .map(|call| Pending {
                key: call.key().to_owned(),
                lua: call.lua(),
                cmd: Self::evalsha(*call, &mut keys, &mut args),
            })
            .collect();
        let (values, cost) = self.pipelined(cmds, ahead).await;
        let replies = values.map(|values| {
            values
                .into_iter()
                .map(|v| v.and_then(value_to_ints))
                .collect()
        });
        Ran { replies, cost }
    }
}

/// One call of a pipeline: where it goes, its script (loaded again if the
/// server lost it), its command.
pub(super) struct Pending {
    key: String,
    lua: &'static Lua,
    cmd: Cmd,
}

/// A call may take this many times what answered calls take lately
/// before it times out (when that is longer than the configured timeout).
/// Measured: at a 3–7 ms round trip on a loaded 2-core machine a few calls
/// a minute took over 25 ms and each timeout sent a batch of decisions to
/// the failure policy.
pub(super) const TIMEOUT_PER_ANSWER: u32 = 6;

/// The most the response timeout stretches, in times the configured one.
pub(super) const MAX_TIMEOUT_STRETCH: u32 = 4;

/// How long a pipeline may take with `calls` scripts queued up to its own
/// (those in flight before it, on this store, and its own): the response
/// timeout, plus a quarter of it per 128 calls, at most eight times it.
pub(super) fn batch_timeout(response: Duration, calls: usize) -> Duration {
    response + (response / 4) * (calls / 128).min(28) as u32
}

/// A script's reply as integers (one integer is a list of one).
pub(super) fn value_to_ints(v: Value) -> Result<Vec<i64>, Error> {
    match v {
        Value::ServerError(e) => Err(Error::from_redis(redis::RedisError::from(e))),
        Value::Int(n) => Ok(vec![n]),
        v => redis::from_redis_value::<Vec<i64>>(v).map_err(parse_error),
    }
}
