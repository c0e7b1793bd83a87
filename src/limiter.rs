//! The front door: [`Limiter`], its [`Builder`], and its counters.
//!
//! Owns the choice of engine (per-process, exact, hybrid), input validation
//! and the application of the failure policy. Engines decide; this module
//! makes sure every call ends in a [`Decision`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::decision::Source;
use crate::exact::ExactEngine;
use crate::failure::{FailureLayer, LayerParts};
use crate::hybrid::{HybridConfig, HybridEngine, Wiring};
use crate::key::{local_key, KeyEncoder};
use crate::local::LocalEngine;
use crate::stats::{Counters, Stats};
use crate::store::{MemoryStore, Params, Store};
use crate::{Algorithm, Clock, Decision, Error, ErrorKind, FailurePolicy, Quota, SystemClock};

/// The longest namespace accepted.
const MAX_NAMESPACE_LEN: usize = 256;

/// A rate limiter. Cheap to clone; clones share one limit.
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Engine,
    failure: FailureLayer,
    quota: Quota,
    algorithm: Algorithm,
    counters: Arc<Counters>,
    /// The shared store, whose breaker state the metrics follow.
    store: Option<Store>,
    /// This limiter's namespace.
    keys: KeyEncoder,
}

enum Engine {
    Local(LocalEngine),
    Exact(ExactEngine),
    Hybrid(HybridEngine),
}

/// How decisions are made.
#[derive(Debug, Clone, PartialEq)]
enum Mode {
    Exact,
    Local,
    Hybrid(HybridConfig),
}

impl Inner {
    #[inline]
    fn count(&self, decision: &Decision) {
        self.counters
            .decision(decision.is_allowed(), decision.source());
    }
}

/// The future returned by [`Limiter::check`]: already resolved when the
/// decision was local, else the store call in flight.
#[must_use = "a Check does nothing unless awaited"]
pub struct Check<'a> {
    state: CheckState<'a>,
}

enum CheckState<'a> {
    Ready(Option<Decision>),
    Pending(Pin<Box<dyn Future<Output = Decision> + Send + 'a>>),
}

impl Future for Check<'_> {
    type Output = Decision;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Decision> {
        match &mut self.state {
            CheckState::Ready(decision) => match decision.take() {
                Some(decision) => Poll::Ready(decision),
                None => panic!("Check polled after completion"),
            },
            CheckState::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for Check<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            CheckState::Ready(d) => f.debug_tuple("Check::Ready").field(d).finish(),
            CheckState::Pending(_) => f.write_str("Check::Pending"),
        }
    }
}

impl fmt::Debug for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.inner.engine {
            Engine::Local(_) => "local",
            Engine::Exact(_) => "exact",
            Engine::Hybrid(_) => "hybrid",
        };
        f.debug_struct("Limiter")
            .field("quota", &self.inner.quota)
            .field("algorithm", &self.inner.algorithm)
            .field("mode", &mode)
            .field("on_store_error", &self.inner.failure.policy())
            .finish()
    }
}

impl Limiter {
    /// Starts building a limiter for `quota`.
    pub fn builder(quota: Quota) -> Builder {
        Builder {
            quota,
            store: None,
            algorithm: Algorithm::default(),
            mode: Mode::Exact,
            namespace: None,
            policy: FailurePolicy::default(),
            clock: None,
            fast_clock: None,
            name: None,
        }
    }

    /// Decides whether a request of `cost` permits for `key` may proceed.
    ///
    /// Never fails: a store error becomes a decision by the failure policy.
    /// `cost` 0 asks without consuming; a cost above the limit (burst for
    /// token bucket and GCRA) is denied with no `retry_after`.
    ///
    /// A key longer than 64 bytes is replaced by its SHA-256 before it
    /// reaches any per-process map or the store, so a client-chosen key
    /// costs this process a bounded number of bytes.
    ///
    /// A hybrid key holding local permits (and every `local()` decision) is
    /// decided right here, before the returned future is first polled; only
    /// a decision that needs the store builds a (boxed) future.
    pub fn check<'a>(&'a self, key: &'a str, cost: u64) -> Check<'a> {
        let key = local_key(key);
        match self.check_local_key(&key, cost) {
            Some(decision) => Check {
                state: CheckState::Ready(Some(decision)),
            },
            None => Check {
                state: CheckState::Pending(Box::pin(
                    async move { self.check_slow(&key, cost).await },
                )),
            },
        }
    }

    /// The decision, if it can be made without waiting: a hybrid key with
    /// local permits (or known exhausted), or any `local()` decision.
    /// `None` means [`check`](Limiter::check) would need the store; nothing
    /// was counted or consumed then.
    #[inline]
    pub fn check_now(&self, key: &str, cost: u64) -> Option<Decision> {
        self.check_local_key(&local_key(key), cost)
    }

    /// [`check_now`](Limiter::check_now) for a key already through
    /// [`local_key`].
    #[inline]
    fn check_local_key(&self, key: &str, cost: u64) -> Option<Decision> {
        let inner = &*self.inner;
        let decision = match &inner.engine {
            Engine::Local(local) => Some(local.check(key, cost)),
            Engine::Hybrid(hybrid) => hybrid.try_fast(key, cost),
            Engine::Exact(_) => None,
        }?;
        inner.count(&decision);
        Some(decision)
    }

    async fn check_slow(&self, key: &str, cost: u64) -> Decision {
        let inner = &*self.inner;
        let decision = match &inner.engine {
            Engine::Local(local) => local.check(key, cost),
            Engine::Exact(exact) => {
                // After an outage, what the fallback admitted is reported
                // before anything new is decided.
                if inner.failure.reconciler.has_pending() && !inner.failure.reconcile().await {
                    let decision = inner.failure.decide(key, cost);
                    inner.count(&decision);
                    return decision;
                }
                let began = std::time::Instant::now();
                let local_before = inner.failure.store_clock.local_us();
                let result = exact.check_timed(key, cost).await;
                let took = began.elapsed().as_micros() as u64;
                if let Some(store) = &inner.store {
                    inner.counters.circuit(store.circuit_state());
                }
                match result {
                    Ok((decision, store_us)) => {
                        inner
                            .failure
                            .store_clock
                            .observe(local_before + took / 2, store_us);
                        decision
                    }
                    Err(_) => inner.failure.decide(key, cost),
                }
            }
            Engine::Hybrid(hybrid) => match hybrid.check(key, cost).await {
                Ok(decision) => decision,
                Err(_) => inner.failure.decide(key, cost),
            },
        };
        inner.count(&decision);
        decision
    }

    /// Like [`check`](Limiter::check), but returns the store's error instead
    /// of applying the failure policy. For tests and diagnostics.
    ///
    /// # Errors
    /// The store's error, classified (see [`Error::kind`]).
    pub async fn try_check(&self, key: &str, cost: u64) -> Result<Decision, Error> {
        let key = &*local_key(key);
        match &self.inner.engine {
            Engine::Local(local) => Ok(local.check(key, cost)),
            Engine::Exact(exact) => exact.check(key, cost).await,
            Engine::Hybrid(hybrid) => hybrid.check(key, cost).await,
        }
    }

    /// Stops background work and gives unused leased permits back to the
    /// store (hybrid). Decisions after shutdown are still answered, by one
    /// store call each.
    pub async fn shutdown(&self) {
        if let Engine::Hybrid(hybrid) = &self.inner.engine {
            hybrid.shutdown().await;
        }
    }

    /// Replaces a hybrid limiter's tunables while it runs; the consistency
    /// mode, lease sizes and timeouts take effect with the next refill.
    ///
    /// # Errors
    /// [`InvalidInput`](ErrorKind::InvalidInput) for an invalid
    /// configuration, [`Unsupported`](ErrorKind::Unsupported) if this
    /// limiter is not hybrid.
    pub fn reconfigure(&self, config: HybridConfig) -> Result<(), Error> {
        match &self.inner.engine {
            Engine::Hybrid(hybrid) => hybrid.reconfigure(config),
            _ => Err(Error::new(
                ErrorKind::Unsupported,
                "only a hybrid limiter has a HybridConfig",
            )),
        }
    }

    /// Keys this process tracks locally (hybrid); 0 for other modes.
    pub fn local_keys(&self) -> usize {
        match &self.inner.engine {
            Engine::Hybrid(hybrid) => hybrid.local_keys(),
            _ => 0,
        }
    }

    /// The quota this limiter enforces.
    pub fn quota(&self) -> Quota {
        self.inner.quota
    }

    /// How this limiter counts.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// The namespace of this limiter's store keys (see
    /// [`Builder::namespace`]).
    pub fn namespace(&self) -> &str {
        self.inner.keys.namespace()
    }

    /// Whether `other` is this limiter or a clone of it (one budget).
    pub fn same_as(&self, other: &Limiter) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether this limiter and `other`, built separately, would count in
    /// the same store keys: same namespace and algorithm.
    pub fn shares_keys_with(&self, other: &Limiter) -> bool {
        self.namespace() == other.namespace() && self.algorithm() == other.algorithm()
    }

    /// A denial the HTTP layer let through in shadow mode, counted with
    /// this limiter's other counters.
    #[cfg(feature = "tower")]
    pub(crate) fn shadow_denial(&self) {
        self.inner.counters.shadow_denials.add(1);
    }

    /// Counters since the limiter was built.
    pub fn stats(&self) -> Stats {
        self.inner.counters.snapshot()
    }
}

/// Configures a [`Limiter`]; see [`Limiter::builder`].
#[must_use]
pub struct Builder {
    quota: Quota,
    store: Option<Store>,
    algorithm: Algorithm,
    mode: Mode,
    /// `None`: derived from the quota (see [`Builder::namespace`]).
    namespace: Option<String>,
    policy: FailurePolicy,
    clock: Option<Arc<dyn Clock>>,
    /// A fast clock lagging `clock` by up to the duration (simulation).
    fast_clock: Option<(Arc<dyn Clock>, std::time::Duration)>,
    name: Option<String>,
}

impl Builder {
    /// The `limiter` label of this limiter's metrics (default: the
    /// namespace). Give each limiter of a process its own.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Where budgets are shared: a [`RedisStore`](crate::RedisStore) or a
    /// [`MemoryStore`]. Default: a private embedded `MemoryStore`.
    pub fn store(mut self, store: impl Into<Store>) -> Self {
        self.store = Some(store.into());
        self
    }

    /// How permits are counted (default: fixed window).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// One store call per decision (the default).
    pub fn exact(mut self) -> Self {
        self.mode = Mode::Exact;
        self
    }

    /// Per-process counting only; the store is not used.
    pub fn local(mut self) -> Self {
        self.mode = Mode::Local;
        self
    }

    /// Leased slices of each key's budget, decided locally; see
    /// [`HybridConfig::strict`] and [`HybridConfig::optimistic`].
    pub fn hybrid(mut self, config: HybridConfig) -> Self {
        self.mode = Mode::Hybrid(config);
        self
    }

    /// Prefix separating this limiter's keys from others'. Two limiters
    /// with the same namespace and algorithm share budgets, so give each
    /// route or policy its own.
    ///
    /// The default is derived from the quota (`q{limit}.{period}ms.b{burst}`):
    /// limiters of the same quota share budgets (the processes of one
    /// fleet), limiters of different quotas never do, so a 5-per-minute
    /// login limit and a 100-per-minute default cannot count the same
    /// requests or reset each other's windows.
    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = Some(namespace.to_owned());
        self
    }

    /// What to decide when the store cannot answer (default: fail open).
    pub fn on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The local clock (default: the system clock). It measures lease
    /// lifetimes and drives per-process limiting; it never decides windows
    /// against a shared store.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Hybrid only, for simulations: the request path reads `fast`, which
    /// may lag the clock set with [`clock`](Builder::clock) by up to
    /// `guard` (as the kernel's coarse clock lags by a timer tick), and
    /// reads the precise clock within `guard` of a deadline.
    #[cfg(feature = "test-support")]
    pub fn lagging_clock(mut self, fast: impl Clock, guard: std::time::Duration) -> Self {
        self.fast_clock = Some((Arc::new(fast), guard));
        self
    }

    /// Validates the configuration and builds the limiter.
    ///
    /// # Errors
    /// An [`InvalidInput`](ErrorKind::InvalidInput) error for an invalid
    /// hybrid configuration or namespace, or a bucket quota (or fallback
    /// quota) that would take more than [`MAX_PERIOD`](crate::MAX_PERIOD)
    /// to fill; an
    /// [`Unsupported`](ErrorKind::Unsupported) error for a hybrid limiter
    /// built outside a Tokio runtime.
    pub fn build(self) -> Result<Limiter, Error> {
        self.algorithm.check_quota(&self.quota)?;
        if let FailurePolicy::LocalFallback(fallback) = &self.policy {
            self.algorithm
                .check_quota(fallback)
                .map_err(|e| Error::invalid(format!("LocalFallback quota: {e}")))?;
        }
        let namespace = self
            .namespace
            .unwrap_or_else(|| default_namespace(&self.quota));
        if namespace.len() > MAX_NAMESPACE_LEN {
            return Err(Error::invalid(format!(
                "namespace is {} bytes; the maximum is {MAX_NAMESPACE_LEN}",
                namespace.len()
            )));
        }
        let injected = self.clock.clone();
        let clock = self.clock.unwrap_or_else(|| Arc::new(SystemClock::new()));
        let counters = Arc::new(Counters::new(self.name.as_deref().unwrap_or(&namespace)));
        let params = Params::new(&self.quota, self.algorithm);
        let keys = KeyEncoder::new(&namespace);
        let store: Option<Store> = match self.mode {
            Mode::Local => None,
            _ => Some(
                self.store
                    .unwrap_or_else(|| MemoryStore::with_shared_clock(clock.clone()).into()),
            ),
        };
        let own_keys = keys.clone();
        let failure = FailureLayer::new(LayerParts {
            policy: self.policy,
            algorithm: self.algorithm,
            clock: clock.clone(),
            store: store.clone(),
            keys: keys.clone(),
            params,
            counters: counters.clone(),
        });
        let engine = match (self.mode, store.clone()) {
            (Mode::Hybrid(config), Some(store)) => Engine::Hybrid(HybridEngine::start(
                config,
                Wiring {
                    store,
                    keys,
                    params,
                    clock: injected,
                    fast_clock: self.fast_clock,
                    counters: counters.clone(),
                    max_cost: self.algorithm.max_cost(&self.quota),
                    reconciler: failure.reconciler.clone(),
                    store_clock: failure.store_clock.clone(),
                },
            )?),
            (Mode::Exact, Some(store)) => {
                Engine::Exact(ExactEngine::new(store, keys, params, counters.clone()))
            }
            _ => Engine::Local(LocalEngine::new(
                self.quota,
                self.algorithm,
                clock.clone(),
                Source::Local,
            )),
        };
        Ok(Limiter {
            inner: Arc::new(Inner {
                engine,
                failure,
                quota: self.quota,
                algorithm: self.algorithm,
                counters,
                store,
                keys: own_keys,
            }),
        })
    }
}

/// The namespace of a limiter built without one: distinct for distinct
/// quotas, so differently limited routes never share a counter.
fn default_namespace(quota: &Quota) -> String {
    format!(
        "q{}.{}ms.b{}",
        quota.limit(),
        quota.period().as_millis(),
        quota.burst()
    )
}
