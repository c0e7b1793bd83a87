//! The background task: renews every live lease before it expires, syncs
//! hybrid leases that should shrink, and releases exact permits' leases.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use tokio::sync::mpsc;

use super::state::Asking;
use super::{Inner, Release};

/// Runs until the limiter is dropped.
pub(super) async fn run(
    inner: Weak<Inner>,
    mut released: mpsc::UnboundedReceiver<Release>,
    releaser: Releaser,
) {
    // Taken before the first poll, which may come after the limiter is
    // gone: releases queued by then are still sent.
    let Some((renew, wake)) = inner.upgrade().map(|i| (i.renew, i.wake.clone())) else {
        while let Some(last) = released.recv().await {
            releaser.release(vec![last]).await;
        }
        return;
    };
    let mut next = tokio::time::Instant::now() + renew;
    loop {
        let mut batch = Vec::new();
        // `biased`: polled in order, so a paused-clock run replays the
        // same way; the renewal first, so releases cannot starve it.
        let woken = tokio::select! {
            biased;
            () = tokio::time::sleep_until(next) => false,
            () = wake.notified() => true,
            first = released.recv() => match first {
                Some(first) => {
                    batch.push(first);
                    false
                }
                None => return,
            },
        };
        while let Ok(more) = released.try_recv() {
            batch.push(more);
        }
        releaser.release(batch).await;
        let Some(inner) = inner.upgrade() else {
            // Gone: what its drop queued is sent, then nothing is left.
            while let Some(last) = released.recv().await {
                releaser.release(vec![last]).await;
            }
            return;
        };
        if woken {
            let mut dirty: Vec<String> = std::mem::take(&mut *inner.dirty());
            dirty.sort_unstable();
            dirty.dedup();
            for key in dirty {
                sync_hybrid(&inner, &key, false).await;
            }
        }
        if tokio::time::Instant::now() >= next {
            sweep(&inner, false).await;
            next = tokio::time::Instant::now() + renew;
        }
    }
}

/// Ends leases, without the limiter: a limiter dropped with permits still
/// alive releases them as they drop, after it is gone.
pub(super) struct Releaser {
    pub(super) store: crate::store::Store,
    pub(super) max: u64,
    pub(super) ttl_ms: u64,
}

impl Releaser {
    /// Ends `batch`'s leases, one call per key.
    async fn release(&self, batch: Vec<Release>) {
        let mut by_key: HashMap<String, Vec<(String, u64)>> = HashMap::new();
        for Release { store_key, lease } in batch {
            by_key.entry(store_key).or_default().push((lease, 0));
        }
        for (store_key, leases) in by_key {
            let call = super::slots::SlotsCall {
                max: self.max,
                ttl_ms: self.ttl_ms,
                waiting: false,
                leases,
            };
            // Not answered: the leases expire instead.
            let slots = super::slots::Slots {
                key: &store_key,
                call: &call,
            };
            let _ = self.store.run(&slots).await;
        }
    }
}

/// Renews every lease of every key (`closing`: gives back every slot not
/// in use), and forgets keys with nothing left.
pub(super) async fn sweep(inner: &Arc<Inner>, closing: bool) {
    let keys: Vec<String> = inner.slots.iter().map(|e| e.key().clone()).collect();
    for key in keys {
        renew_exact(inner, &key).await;
        sync_hybrid(inner, &key, closing).await;
        forget_if_idle(inner, &key);
    }
}

/// Renews the key's live exact leases, and sends again the releases the
/// store may not have applied yet (idempotent), so they are forgotten.
async fn renew_exact(inner: &Inner, key: &str) {
    let Some(slots) = inner.slots.get(key).map(|s| s.clone()) else {
        return;
    };
    let (ids, carried) = {
        let mut held = slots.lock();
        let ids: Vec<u64> = held.exact.iter().copied().collect();
        (ids, held.releases_to_carry(inner.clock.now(), inner.lease))
    };
    if ids.is_empty() && carried.is_empty() {
        return;
    }
    let leases = ids
        .iter()
        .map(|id| (inner.lease_name(*id), 1))
        .chain(carried.iter().map(|id| (inner.lease_name(*id), 0)))
        .collect();
    if let Ok(replies) = inner.call(key, leases).await {
        let mut still = slots.lock();
        still.released_applied(&carried);
        let lost = ids
            .iter()
            .zip(&replies)
            .filter(|(id, reply)| reply.held == 0 && still.exact.contains(id))
            .count();
        inner.metrics.lost.increment(lost as u64);
    }
}

/// Sets the hybrid lease of `key` to what it should hold now.
pub(super) async fn sync_hybrid(inner: &Inner, key: &str, closing: bool) {
    let Some(slots) = inner.slots.get(key).map(|s| s.clone()) else {
        return;
    };
    let now = inner.clock.now();
    let want = {
        let mut held = slots.lock();
        // The store's view decides: a slot given back here is still in
        // the store's lease until this call.
        if held.asking || (held.stored == 0 && held.in_use == 0) {
            return;
        }
        let want = held.desired(closing);
        held.sending(want)
    };
    let asking = Asking::new(slots.clone());
    let reply = inner.call(key, vec![(inner.holder.clone(), want)]).await;
    let mut held = slots.lock();
    held.failed = reply.is_err();
    asking.done(&mut held);
    if let Ok(replies) = reply {
        let reply = replies.first().copied().unwrap_or_default();
        if reply.held < held.in_use {
            inner.metrics.lost.increment(held.in_use - reply.held);
        }
        let change = held.granted(reply.held, reply.fair, now, inner.lease);
        inner.metrics.leased.increment(change as f64);
    }
}

fn forget_if_idle(inner: &Inner, key: &str) {
    inner.slots.remove_if(key, |_, slots| {
        Arc::strong_count(slots) == 1 && slots.lock().idle()
    });
}
