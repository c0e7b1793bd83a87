//! Concurrency limits: at most `max` requests in flight per key across a
//! fleet, on slots leased under an expiry that a crashed process cannot
//! leak.
//!
//! A key's slots live in the store as *leases* (`lua/slots.lua`): each
//! holds some slots until an expiry, renewed while its holder is alive.
//! A holder that stops renewing (killed, partitioned, its runtime gone)
//! loses its slots when its lease expires, and they are free again.
//!
//! - **exact**: every permit is a lease of one slot: one script call to
//!   take it, one to release it, and the background task renews every
//!   live permit's lease of a key in one call; a release Redis has not
//!   answered for rides again in the next call on the key, ahead of its
//!   take, so a slot dropped here is free here at once;
//! - **hybrid**: the process holds one lease per key and hands its slots
//!   to requests from memory; it asks for more when they run out (a batch
//!   sized by how many it uses), renews the lease in the background, and
//!   gives back slots it does not use, or holds beyond its fair share of
//!   `max` by every holder's demand.
//!
//! **The bound.** In flight per key ≤ `max` at every instant across the
//! fleet, in both modes, given that every holder renews its lease before
//! it expires (renewals every [`ConcurrencyBuilder::lease`]`/3` by
//! default, reaching the store within the expiry) and that the holders'
//! and the store's clocks run at the same rate (a holder counts its
//! lease from when it sent the call, before the store started it). A
//! holder that cannot renew in time stops handing out slots when its
//! lease lapses on its own clock; requests already running keep going
//! (a request cannot be stopped) and are outside the bound. When the
//! store cannot answer, the failure policy decides: `FailClosed` admits
//! nothing new; any other policy admits at most `max` per process.

mod builder;
mod permit;
mod renew;
mod slots;
mod state;
#[cfg(test)]
mod tests;

pub use self::builder::ConcurrencyBuilder;
pub use self::permit::SlotPermit;

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::{mpsc, Notify};

use self::slots::{Slots, SlotsCall, SlotsReply};
use crate::clock::Clock;
use crate::error::Error;
use crate::failure::FailurePolicy;
use crate::key::KeyEncoder;
use crate::store::Store;

use self::permit::Held;
use self::state::KeySlots;

/// Why no slot was given.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AcquireError {
    /// All `max` slots of the key are in flight (for as long as the call
    /// was willing to wait). `retry_after`: a hint for a `Retry-After`.
    Full {
        /// When trying again may find a slot.
        retry_after: Duration,
    },
    /// The store cannot answer and the failure policy is `FailClosed`.
    Unavailable {
        /// When the store will be tried again.
        retry_after: Duration,
    },
    /// The limiter was shut down.
    Closed,
}

impl AcquireError {
    /// The `Retry-After` hint, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            AcquireError::Full { retry_after } | AcquireError::Unavailable { retry_after } => {
                Some(*retry_after)
            }
            AcquireError::Closed => None,
        }
    }
}

impl std::fmt::Display for AcquireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AcquireError::Full { .. } => write!(f, "every slot of the key is in flight"),
            AcquireError::Unavailable { .. } => write!(f, "the store cannot answer"),
            AcquireError::Closed => write!(f, "the concurrency limiter was shut down"),
        }
    }
}

impl std::error::Error for AcquireError {}

/// Longest lease a holder may take: how long a crashed process's slots
/// stay taken at most.
pub const MAX_LEASE: Duration = Duration::from_secs(300);
/// Shortest lease: renewals must fit well inside it.
pub const MIN_LEASE: Duration = Duration::from_millis(300);

/// At most `max` requests in flight per key across every process that
/// shares the store. Clones share one limiter.
#[derive(Clone, Debug)]
pub struct ConcurrencyLimiter {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) max: u64,
    pub(crate) store: Store,
    keys: KeyEncoder,
    pub(crate) hybrid: bool,
    policy: FailurePolicy,
    pub(crate) lease: Duration,
    pub(crate) renew: Duration,
    pub(crate) clock: Arc<dyn Clock>,
    /// This process's lease name (hybrid) and the prefix of its permits'
    /// (exact).
    pub(crate) holder: String,
    pub(crate) slots: DashMap<String, Arc<KeySlots>>,
    next_lease: AtomicU64,
    closed: AtomicBool,
    /// Wakes the background task: hybrid leases in `dirty` to sync at
    /// once.
    pub(crate) wake: Arc<Notify>,
    dirty: std::sync::Mutex<Vec<String>>,
    /// Exact permits to release, by the background task.
    releases: mpsc::UnboundedSender<Release>,
    pub(crate) metrics: stats::Handles,
    /// The background task.
    pub(crate) task: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
    /// Calls sent to the store.
    pub(crate) calls: AtomicU64,
}

/// A lease to end.
#[derive(Debug)]
pub(crate) struct Release {
    pub(crate) store_key: String,
    pub(crate) lease: String,
}

/// The limiter's last handle and permit are gone: its hybrid leases go
/// back (the background task sends them before it stops).
impl Drop for Inner {
    fn drop(&mut self) {
        for entry in self.slots.iter() {
            if entry.value().lock().stored > 0 {
                let _ = self
                    .releases
                    .send(self.release_of(entry.key(), &self.holder));
            }
        }
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyLimiter")
            .field("max", &self.max)
            .field("hybrid", &self.hybrid)
            .field("namespace", &self.keys.namespace())
            .finish_non_exhaustive()
    }
}

impl ConcurrencyLimiter {
    /// A builder for at most `max` in flight per key.
    pub fn builder(max: NonZeroU32) -> ConcurrencyBuilder {
        ConcurrencyBuilder::new(max)
    }

    /// A slot for `key` now, or why not. Asks the store when this process
    /// holds no free slot of the key (exact mode: always); when a call on
    /// the key's hybrid lease is already in flight, waits for its answer
    /// (at most a second).
    ///
    /// # Errors
    /// [`AcquireError::Full`] when every slot is in flight.
    pub async fn try_acquire(&self, key: &str) -> Result<SlotPermit, AcquireError> {
        // "Now": at most the time another call on the key takes to answer.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        self.inner.clone().try_once(key, deadline).await
    }

    /// A slot for `key`, waiting up to `wait` for one: a slot released in
    /// this process is handed on at once, others are asked for again with
    /// a growing pause. Cancel-safe: a dropped call leaves no slot taken.
    ///
    /// # Errors
    /// [`AcquireError::Full`] when none came free within `wait`.
    pub async fn acquire(&self, key: &str, wait: Duration) -> Result<SlotPermit, AcquireError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut pause = Duration::from_millis(2);
        let mut waited = false;
        // Counted as waiting while it waits, however it ends (dropped too).
        let mut waiting: Option<state::Waiting> = None;
        loop {
            let slots = self.inner.key_slots(key);
            let freed = slots.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.inner.clone().try_once(key, deadline).await {
                Ok(permit) => {
                    if waited {
                        self.inner.metrics.waited.increment(1);
                    }
                    return Ok(permit);
                }
                Err(AcquireError::Full { .. }) => {}
                Err(other) => return Err(other),
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                self.inner.metrics.timeouts.increment(1);
                return Err(AcquireError::Full {
                    retry_after: pause.max(Duration::from_millis(10)),
                });
            }
            if waiting.is_none() {
                waiting = Some(state::Waiting::new(slots.clone()));
            }
            waited = true;
            let sleep = pause.min(deadline - now);
            let _ = tokio::time::timeout(sleep, freed).await;
            tokio::task::yield_now().await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Permits of `key` this process holds now.
    pub fn in_flight(&self, key: &str) -> u64 {
        self.inner
            .slots
            .get(key)
            .map_or(0, |s| s.lock().in_flight())
    }

    /// The most in flight per key.
    pub fn max(&self) -> u64 {
        self.inner.max
    }

    /// Calls this limiter sent to the store so far (takes, releases and
    /// renewals).
    pub fn store_calls(&self) -> u64 {
        self.inner.calls.load(Ordering::Relaxed)
    }

    /// Stops handing out slots and gives back every lease this process
    /// holds with nothing in flight. Permits still alive release as they
    /// drop; leases left behind expire.
    pub async fn shutdown(&self) {
        self.inner.closed.store(true, Ordering::Release);
        renew::sweep(&self.inner, true).await;
    }
}

impl Inner {
    /// What releasing lease `lease` of `key` takes, for the background
    /// task (which sends it even once the limiter is gone).
    fn release_of(&self, key: &str, lease: &str) -> Release {
        Release {
            store_key: self.store_key(key),
            lease: lease.to_owned(),
        }
    }

    pub(crate) fn store_key(&self, key: &str) -> String {
        format!("{}:{{{}}}:inflight", crate::key::PREFIX, self.keys.tag(key))
    }

    pub(crate) fn dirty(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.dirty.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn key_slots(&self, key: &str) -> Arc<KeySlots> {
        self.slots
            .entry(key.to_owned())
            .or_insert_with(|| Arc::new(KeySlots::default()))
            .clone()
    }

    /// The name of exact permit `id`'s lease.
    pub(crate) fn lease_name(&self, id: u64) -> String {
        format!("{}:{id}", self.holder)
    }

    pub(crate) async fn call(
        &self,
        key: &str,
        leases: Vec<(String, u64)>,
    ) -> Result<Vec<SlotsReply>, Error> {
        let call = SlotsCall {
            max: self.max,
            ttl_ms: self.lease.as_millis() as u64,
            waiting: self.hybrid,
            leases,
        };
        self.metrics.store_calls.increment(1);
        self.calls.fetch_add(1, Ordering::Relaxed);
        let store_key = self.store_key(key);
        let slots = Slots {
            key: &store_key,
            call: &call,
        };
        let replies = self.store.run(&slots).await;
        if let Ok((_, expired)) = &replies {
            self.metrics.expired.increment(*expired);
        }
        replies.map(|(replies, _)| replies)
    }

    async fn try_once(
        self: Arc<Self>,
        key: &str,
        deadline: tokio::time::Instant,
    ) -> Result<SlotPermit, AcquireError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(AcquireError::Closed);
        }
        let slots = self.key_slots(key);
        // Never more than `max` here, whatever admitted them (permits the
        // failure policy gave during an outage count too).
        if slots.lock().in_flight() >= self.max {
            self.metrics.denied.increment(1);
            return Err(AcquireError::Full {
                retry_after: Duration::from_millis(10),
            });
        }
        let result = if self.hybrid {
            self.try_hybrid(key, &slots, deadline).await
        } else {
            self.try_exact(key, &slots).await
        };
        if result.is_err() {
            self.metrics.denied.increment(1);
        }
        result
    }

    async fn try_exact(
        self: &Arc<Self>,
        key: &str,
        slots: &Arc<KeySlots>,
    ) -> Result<SlotPermit, AcquireError> {
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        // The guard exists before the call: dropped mid-call, it releases
        // whatever the call may have taken.
        let mut permit = SlotPermit::new(self.clone(), key, slots.clone(), Held::Asked(id));
        // Leases of permits dropped here whose release may still be on
        // its way are released first, in the same script call: a slot
        // given up in this process is free to the next request here at
        // once, and the store never counts both.
        let carried = slots.lock().releases_to_carry(self.clock.now(), self.lease);
        let mut leases: Vec<(String, u64)> = carried
            .iter()
            .map(|&gone| (self.lease_name(gone), 0))
            .collect();
        leases.push((self.lease_name(id), 1));
        let reply = self.call(key, leases).await;
        if reply.is_ok() {
            slots.lock().released_applied(&carried);
        }
        match reply {
            Ok(replies) if replies.last().is_some_and(|r| r.held == 1) => {
                slots.lock().exact.insert(id);
                permit.set(Held::Exact(id));
                self.metrics.in_flight.increment(1.0);
                Ok(permit)
            }
            Ok(_) => {
                permit.set(Held::Nothing);
                Err(AcquireError::Full {
                    retry_after: self.renew.min(Duration::from_millis(100)),
                })
            }
            // Released as it drops, in case the store took it.
            Err(error) => self.fallback(key, slots, &error),
        }
    }

    async fn try_hybrid(
        self: &Arc<Self>,
        key: &str,
        slots: &Arc<KeySlots>,
        deadline: tokio::time::Instant,
    ) -> Result<SlotPermit, AcquireError> {
        let mut now = self.clock.now();
        let mut waited = false;
        let want = loop {
            let answered = slots.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            {
                let mut held = slots.lock();
                if held.take(now) {
                    self.metrics.in_flight.increment(1.0);
                    return Ok(SlotPermit::new(
                        self.clone(),
                        key,
                        slots.clone(),
                        Held::Leased,
                    ));
                }
                match held.ask(now) {
                    state::Ask::Send(want) => break want,
                    state::Ask::Busy => {}
                    state::Ask::Quiet => {
                        return Err(AcquireError::Full {
                            retry_after: state::QUIET,
                        })
                    }
                }
            }
            // Another call on the lease is in flight: its answer decides
            // (within the store's timeout, and this call's deadline).
            if waited {
                return Err(AcquireError::Full {
                    retry_after: Duration::from_millis(10),
                });
            }
            waited = true;
            let timed_out = tokio::time::timeout_at(deadline, answered).await.is_err();
            if slots.lock().failed {
                // The last call could not reach the store (and the one in
                // flight has not answered by this call's deadline, or
                // failed too): neither could this one.
                let error = Error::new(crate::error::ErrorKind::Store, "the store did not answer");
                return self.fallback(key, slots, &error);
            }
            if timed_out {
                return Err(AcquireError::Full {
                    retry_after: Duration::from_millis(10),
                });
            }
            now = self.clock.now();
        };
        let asking = state::Asking::new(slots.clone());
        let reply = self.call(key, vec![(self.holder.clone(), want)]).await;
        let mut held = slots.lock();
        held.failed = reply.is_err();
        asking.done(&mut held);
        match reply {
            Ok(replies) => {
                let reply = replies.first().copied().unwrap_or_default();
                let change = held.granted(reply.held, reply.fair, now, self.lease);
                self.metrics.leased.increment(change as f64);
                if change > 1 {
                    // More than this call takes: others may have one.
                    slots.freed.notify_waiters();
                }
                if change <= 0 {
                    held.quiet_until = now + state::QUIET;
                }
                if held.take(self.clock.now()) {
                    drop(held);
                    self.metrics.in_flight.increment(1.0);
                    Ok(SlotPermit::new(
                        self.clone(),
                        key,
                        slots.clone(),
                        Held::Leased,
                    ))
                } else {
                    Err(AcquireError::Full {
                        retry_after: Duration::from_millis(10),
                    })
                }
            }
            Err(error) => {
                drop(held);
                self.fallback(key, slots, &error)
            }
        }
    }

    /// The failure policy's answer when the store could not.
    fn fallback(
        self: &Arc<Self>,
        key: &str,
        slots: &Arc<KeySlots>,
        error: &Error,
    ) -> Result<SlotPermit, AcquireError> {
        let retry_after = self.store.retry_hint().unwrap_or(Duration::from_secs(1));
        if matches!(self.policy, FailurePolicy::FailClosed) {
            let _ = error;
            return Err(AcquireError::Unavailable { retry_after });
        }
        let mut held = slots.lock();
        if held.in_flight() >= self.max {
            return Err(AcquireError::Full { retry_after });
        }
        held.fallback += 1;
        drop(held);
        self.metrics.fallback.increment(1);
        self.metrics.in_flight.increment(1.0);
        Ok(SlotPermit::new(
            self.clone(),
            key,
            slots.clone(),
            Held::Fallback,
        ))
    }

    /// Gives a permit's slot back (from its drop).
    pub(crate) fn release(&self, key: &str, slots: &KeySlots, held: Held) {
        match held {
            Held::Exact(id) => {
                {
                    let mut held = slots.lock();
                    held.exact.remove(&id);
                    held.released.push((id, self.clock.now()));
                }
                let _ = self
                    .releases
                    .send(self.release_of(key, &self.lease_name(id)));
            }
            Held::Asked(id) => {
                let _ = self
                    .releases
                    .send(self.release_of(key, &self.lease_name(id)));
                return;
            }
            Held::Leased => {
                if slots.lock().put_back(self.clock.now()) {
                    self.dirty().push(key.to_owned());
                    self.wake.notify_one();
                }
            }
            Held::Fallback => {
                let mut held = slots.lock();
                held.fallback = held.fallback.saturating_sub(1);
            }
            Held::Nothing => return,
        }
        self.metrics.in_flight.decrement(1.0);
        slots.freed.notify_one();
    }
}

pub mod stats;
