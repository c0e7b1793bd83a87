//! [`Builder`]: a limiter's quotas, store, algorithm, mode and policy,
//! checked once at `build`.

use std::sync::Arc;

use super::lane::{Lane, Mode, Recipe};
use super::quotas::{Quotas, NEXT_ID};
use super::tiers::{Resolver, Tiers};
use super::{Limiter, MAX_QUOTAS};
use crate::algorithm::Algorithm;
use crate::clock::{Clock, SystemClock};
use crate::error::Error;
use crate::failure::FailurePolicy;
use crate::hybrid::HybridConfig;
use crate::key::KeyEncoder;
use crate::quota::Quota;
use crate::stats::Counters;
use crate::store::Store;

/// The longest namespace accepted.
const MAX_NAMESPACE_LEN: usize = 256;

/// Configures a [`Limiter`]; see [`Limiter::builder`].
#[must_use]
pub struct Builder {
    quota: Quota,
    /// Those added with `and` or `and_for`, each with its resolver.
    also: Vec<(Quota, Option<Box<Resolver>>)>,
    tiers: Option<Box<Resolver>>,
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
    /// What [`Limiter::builder`] starts from: exact mode, no store yet,
    /// the default algorithm and failure policy.
    pub(super) fn new(quota: Quota) -> Self {
        Builder {
            quota,
            also: Vec::new(),
            tiers: None,
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

    /// One more quota on the same key, all-or-nothing: a request is
    /// admitted only if every quota admits it, and then counts against
    /// each; a denial counts against none. For example 10 a second **and**
    /// 10,000 a day:
    ///
    /// ```
    /// # async fn demo() -> Result<(), slicelimit::Error> {
    /// use std::time::Duration;
    /// use slicelimit::{nonzero, Limiter, MemoryStore, Quota};
    ///
    /// let limiter = Limiter::builder(Quota::per_second(nonzero!(10)))
    ///     .store(MemoryStore::new())
    ///     .and(Quota::new(10_000, Duration::from_secs(86_400))?)
    ///     .build()?;
    /// let decision = limiter.check("user-1", 1).await;
    /// assert_eq!(decision.quotas().len(), 2);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Every quota of a key lives in the same Redis hash slot. At most
    /// [`MAX_QUOTAS`] in all.
    pub fn and(mut self, quota: Quota) -> Self {
        self.also.push((quota, None));
        self
    }

    /// One more quota, as [`and`](Builder::and), whose quota for a key
    /// `resolver` gives (`None`: `quota`), as
    /// [`quota_for`](Builder::quota_for) does for the first: 10 a second
    /// for everyone **and** a daily quota by plan.
    ///
    /// ```
    /// # async fn demo() -> Result<(), slicelimit::Error> {
    /// use std::time::Duration;
    /// use slicelimit::{nonzero, Limiter, MemoryStore, Quota};
    ///
    /// let day = Duration::from_secs(86_400);
    /// let limiter = Limiter::builder(Quota::per_second(nonzero!(10)))
    ///     .store(MemoryStore::new())
    ///     .and_for(Quota::new(1_000, day)?, move |key| {
    ///         key.starts_with("paid:").then(|| Quota::new(100_000, day).unwrap())
    ///     })
    ///     .build()?;
    /// let decision = limiter.check("paid:7", 1).await;
    /// assert_eq!(decision.quotas()[1].limit(), 100_000);
    /// # Ok(())
    /// # }
    /// ```
    pub fn and_for(
        mut self,
        quota: Quota,
        resolver: impl Fn(&str) -> Option<Quota> + Send + Sync + 'static,
    ) -> Self {
        self.also.push((quota, Some(Box::new(resolver))));
        self
    }

    /// Per-key quotas (tiers): `resolver` gives a key's own first quota,
    /// or `None` for the default. Premium keys get a bigger quota on the
    /// same limiter, in every mode:
    ///
    /// ```
    /// # async fn demo() -> Result<(), slicelimit::Error> {
    /// use slicelimit::{nonzero, Limiter, MemoryStore, Quota};
    ///
    /// let limiter = Limiter::builder(Quota::per_minute(nonzero!(100)))
    ///     .store(MemoryStore::new())
    ///     .quota_for(|key| key.starts_with("paid:").then(|| Quota::per_minute(nonzero!(10_000))))
    ///     .build()?;
    /// assert_eq!(limiter.quota_of("paid:42").limit(), 10_000);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// The resolver runs on every decision, so keep it cheap (a map
    /// lookup). Quotas of the first quota's period count in the same
    /// keys, so a key that changes tier keeps its count; a quota of
    /// another period counts in keys of its own (windows of different
    /// lengths cannot share a count), so a key moving between periods has
    /// a count per period, each kept. At most 64 distinct quotas
    /// are in use at once; past that, and for a quota the algorithm
    /// refuses, the default applies. Replace it at run time with
    /// [`Limiter::set_quota_for`].
    pub fn quota_for(
        mut self,
        resolver: impl Fn(&str) -> Option<Quota> + Send + Sync + 'static,
    ) -> Self {
        self.tiers = Some(Box::new(resolver));
        self
    }

    /// The `limiter` label of this limiter's metrics (default: the
    /// namespace). Give each limiter of a process its own.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Where budgets are shared: a [`RedisStore`](crate::RedisStore) for a
    /// fleet, or a [`MemoryStore`](crate::MemoryStore) for one process. Required in exact and
    /// hybrid mode: there is no default, so a limiter meant for a fleet
    /// cannot silently count per process. A limiter on an injected
    /// [`clock`](Builder::clock) wants a `MemoryStore` on the same clock
    /// ([`MemoryStore::with_clock`](crate::MemoryStore::with_clock)).
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
    /// requests or reset each other's windows. With several quotas, the
    /// default is derived from all of them.
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

    /// Hybrid only, with a clock set with [`clock`](Builder::clock)
    /// (ignored without one): the request path reads `fast`, a clock
    /// cheaper to read that may lag the precise one by up to `max_lag` (as
    /// the kernel's coarse clock, which a hybrid limiter on the system
    /// clock reads, lags by a timer tick), and reads the precise clock
    /// within `max_lag` of a lease's deadline. Without it, an injected
    /// clock is read on every request. A `fast` clock that lags by more
    /// than `max_lag` can spend a permit after its window ended.
    pub fn lagging_clock(mut self, fast: impl Clock, max_lag: std::time::Duration) -> Self {
        self.fast_clock = Some((Arc::new(fast), max_lag));
        self
    }

    /// Validates the configuration and builds the limiter.
    ///
    /// # Errors
    /// An [`InvalidInput`](crate::ErrorKind::InvalidInput) error for exact
    /// or hybrid mode without a [`store`](Builder::store), an invalid
    /// hybrid configuration or namespace, more than [`MAX_QUOTAS`]
    /// quotas, or a bucket quota (or fallback quota) that would take more
    /// than [`MAX_PERIOD`](crate::Quota::MAX_PERIOD) to fill; an
    /// [`Unsupported`](crate::ErrorKind::Unsupported) error for a hybrid limiter
    /// built outside a Tokio runtime.
    pub fn build(self) -> Result<Limiter, Error> {
        if 1 + self.also.len() > MAX_QUOTAS {
            return Err(Error::invalid(format!(
                "{} quotas on one limiter; the most is {MAX_QUOTAS}",
                1 + self.also.len()
            )));
        }
        self.algorithm.check_quota(&self.quota)?;
        for (quota, _) in &self.also {
            self.algorithm.check_quota(quota)?;
        }
        if let FailurePolicy::LocalFallback(fallback) = &self.policy {
            self.algorithm
                .check_quota(fallback)
                .map_err(|e| Error::invalid(format!("LocalFallback quota: {e}")))?;
        }
        let namespace = self
            .namespace
            .unwrap_or_else(|| default_namespace(&self.quota, &self.also));
        if namespace.len() > MAX_NAMESPACE_LEN {
            return Err(Error::invalid(format!(
                "namespace is {} bytes; the maximum is {MAX_NAMESPACE_LEN}",
                namespace.len()
            )));
        }
        let clock = self
            .clock
            .clone()
            .unwrap_or_else(|| Arc::new(SystemClock::new()));
        let name: Arc<str> = Arc::from(self.name.as_deref().unwrap_or(&namespace));
        let counters = Arc::new(Counters::new(&name));
        let store: Option<Store> = match self.mode {
            Mode::Local => None,
            _ => Some(self.store.ok_or_else(|| {
                Error::invalid(
                    "no store chosen: call .store(..) with a RedisStore to share budgets \
                     across processes, or with MemoryStore::new() to limit this process \
                     alone (or use .local())",
                )
            })?),
        };
        let config = match &self.mode {
            Mode::Hybrid(config) => Some(config.clone()),
            _ => None,
        };
        let id = NEXT_ID
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .max(1);
        let recipe = Recipe {
            limiter: id,
            mode: self.mode,
            store,
            algorithm: self.algorithm,
            policy: self.policy,
            clock,
            injected: self.clock,
            fast_clock: self.fast_clock,
            counters: counters.clone(),
            local_refunds: Default::default(),
        };
        let keys = KeyEncoder::new(&namespace);
        let first = std::iter::once((self.quota, self.tiers));
        let tiers = first
            .chain(self.also)
            .enumerate()
            .map(|(i, (quota, resolver))| {
                let lane = Lane::build(&recipe, quota, keys.for_quota(i), config.clone())?;
                Ok(Tiers::new(lane, resolver))
            })
            .collect::<Result<Vec<Tiers>, Error>>()?;
        Ok(Limiter {
            inner: Arc::new(Quotas::new(recipe, tiers, config, keys, name)),
        })
    }
}

fn default_namespace(quota: &Quota, also: &[(Quota, Option<Box<Resolver>>)]) -> String {
    let one = |q: &Quota| format!("q{}.{}ms.b{}", q.limit(), q.period().as_millis(), q.burst());
    let mut namespace = one(quota);
    for (q, _) in also {
        namespace.push('+');
        namespace.push_str(&one(q));
    }
    namespace
}
