//! Building a [`ConcurrencyLimiter`]: its bounds are checked here, and its
//! background task started.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::{mpsc, Notify};

use super::{renew, stats, ConcurrencyLimiter, Inner, MAX_LEASE, MIN_LEASE};
use crate::clock::{Clock, SystemClock};
use crate::error::{Error, ErrorKind};
use crate::failure::FailurePolicy;
use crate::key::KeyEncoder;
use crate::store::Store;

/// Builds a [`ConcurrencyLimiter`].
#[derive(Clone)]
#[must_use]
pub struct ConcurrencyBuilder {
    max: NonZeroU32,
    store: Option<Store>,
    namespace: String,
    name: String,
    hybrid: bool,
    policy: FailurePolicy,
    lease: Duration,
    renew: Option<Duration>,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for ConcurrencyBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyBuilder")
            .field("max", &self.max)
            .field("namespace", &self.namespace)
            .field("hybrid", &self.hybrid)
            .field("policy", &self.policy)
            .field("lease", &self.lease)
            .field("renew", &self.renew)
            .finish_non_exhaustive()
    }
}

impl ConcurrencyBuilder {
    pub(super) fn new(max: NonZeroU32) -> Self {
        ConcurrencyBuilder {
            max,
            store: None,
            namespace: "inflight".to_owned(),
            name: String::new(),
            hybrid: false,
            policy: FailurePolicy::FailOpen,
            lease: Duration::from_secs(10),
            renew: None,
            clock: None,
        }
    }

    /// Where the leases live: a [`RedisStore`](crate::RedisStore) to
    /// share the limit across a fleet, or a
    /// [`MemoryStore`](crate::MemoryStore) for one process. Required:
    /// there is no default, so a limit meant for a fleet cannot silently
    /// become a limit per process. A limiter on an injected
    /// [`clock`](ConcurrencyBuilder::clock) wants a `MemoryStore` on the
    /// same clock ([`MemoryStore::with_clock`](crate::MemoryStore::with_clock)).
    pub fn store(mut self, store: impl Into<Store>) -> Self {
        self.store = Some(store.into());
        self
    }

    /// The namespace of the store keys (default `"inflight"`).
    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.to_owned();
        self
    }

    /// The name in metrics (default: the namespace).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// One lease per permit (the default): a script call to take a slot
    /// and one to release it.
    pub fn exact(mut self) -> Self {
        self.hybrid = false;
        self
    }

    /// One lease per key and process, its slots handed out from memory.
    pub fn hybrid(mut self) -> Self {
        self.hybrid = true;
        self
    }

    /// What to do when the store cannot answer (default `FailOpen`: at
    /// most `max` per process).
    pub fn on_store_error(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// How long a lease lasts unrenewed (default 10 s; between
    /// [`MIN_LEASE`] and [`MAX_LEASE`]): a crashed holder's slots are
    /// free again after at most this.
    pub fn lease(mut self, expiry: Duration) -> Self {
        self.lease = expiry;
        self
    }

    /// How often leases are renewed (default a third of the lease; at
    /// most half of it, so one late renewal does not lose the lease).
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew = Some(every);
        self
    }

    /// The local clock leases are timed on (tests use a
    /// [`FakeClock`](crate::clock::FakeClock)).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the limiter and starts its background task.
    ///
    /// # Errors
    /// An [`InvalidInput`](crate::ErrorKind::InvalidInput) error without a
    /// [`store`](ConcurrencyBuilder::store), or for a lease or renewal
    /// interval out of bounds; an
    /// [`Unsupported`](crate::ErrorKind::Unsupported) error outside a
    /// Tokio runtime.
    pub fn build(self) -> Result<ConcurrencyLimiter, Error> {
        let store = self.store.ok_or_else(|| {
            Error::invalid(
                "no store chosen: call .store(..) with a RedisStore to share the limit \
                 across processes, or with MemoryStore::new() to limit this process alone",
            )
        })?;
        if !(MIN_LEASE..=MAX_LEASE).contains(&self.lease) {
            return Err(Error::invalid(format!(
                "a lease of {:?} is outside {MIN_LEASE:?}..={MAX_LEASE:?}",
                self.lease
            )));
        }
        let renew = self.renew.unwrap_or(self.lease / 3);
        if renew.is_zero() || renew > self.lease / 2 {
            return Err(Error::invalid(format!(
                "renewing every {renew:?} does not fit twice in a lease of {:?}",
                self.lease
            )));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::new(
                ErrorKind::Unsupported,
                "a concurrency limiter renews its leases in a background task: \
                 build it inside a Tokio runtime",
            )
        })?;
        let clock = self.clock.unwrap_or_else(|| Arc::new(SystemClock::new()));
        let name = if self.name.is_empty() {
            self.namespace.clone()
        } else {
            self.name
        };
        let (releases, released) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            max: u64::from(self.max.get()),
            store,
            keys: KeyEncoder::new(&self.namespace),
            hybrid: self.hybrid,
            policy: self.policy,
            lease: self.lease,
            renew,
            clock,
            holder: holder_name(),
            slots: DashMap::new(),
            next_lease: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            wake: Arc::new(Notify::new()),
            dirty: std::sync::Mutex::default(),
            releases,
            metrics: stats::Handles::new(&name),
            task: std::sync::Mutex::default(),
            calls: AtomicU64::new(0),
        });
        let releaser = renew::Releaser {
            store: inner.store.clone(),
            max: inner.max,
            ttl_ms: inner.lease.as_millis() as u64,
        };
        let task = runtime.spawn(renew::run(Arc::downgrade(&inner), released, releaser));
        *inner.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
        Ok(ConcurrencyLimiter { inner })
    }
}

/// This process's name as a lease holder: unique per limiter instance.
fn holder_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}.{}.{nanos:x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
