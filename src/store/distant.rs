//! A store a round trip away, for the crate's own unit tests (built only
//! with them): every call takes the round trip set on it, half before the
//! wrapped store acts and half after, on Tokio's clock. It injects no
//! faults; the fault-injecting wrapper is the simulation harness's
//! (`slicelimit-sim`), which the crate's unit tests cannot name.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{Backend, Call, Ran, Store};

/// See the module docs. Clones share one round trip.
#[derive(Debug, Clone)]
pub(crate) struct Distant {
    store: Store,
    /// Nanoseconds; 0: in-process speed.
    round_trip_ns: Arc<AtomicU64>,
}

impl Distant {
    pub(crate) fn new(store: impl Into<Store>) -> Self {
        Distant {
            store: store.into(),
            round_trip_ns: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Every call from now on takes `round_trip`.
    pub(crate) fn set_round_trip(&self, round_trip: Duration) {
        let ns = u64::try_from(round_trip.as_nanos()).unwrap_or(u64::MAX);
        self.round_trip_ns.store(ns, Ordering::Relaxed);
    }
}

impl From<Distant> for Store {
    fn from(store: Distant) -> Self {
        Store::new(store)
    }
}

impl Backend for Distant {
    fn run<'a>(
        &'a self,
        calls: &'a [&'a dyn Call],
        ahead: usize,
    ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'a>> {
        Box::pin(async move {
            let round_trip = Duration::from_nanos(self.round_trip_ns.load(Ordering::Relaxed));
            tokio::time::sleep(round_trip / 2).await;
            let ran = Backend::run(&self.store, calls, ahead).await;
            tokio::time::sleep(round_trip - round_trip / 2).await;
            ran
        })
    }

    fn is_sharded(&self) -> bool {
        self.store.is_sharded()
    }
}
