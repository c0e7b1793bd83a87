//! The background task: renews every live lease before it expires, syncs
//! hybrid leases that should shrink, and releases exact permits' leases.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use tokio::sync::mpsc;

use super::state::Asking;
use super::Inner;

/// Runs until the limiter is dropped.
pub(super) async fn run(inner: Weak<Inner>, mut released: mpsc::UnboundedReceiver<(String, u64)>) {
    let Some(strong) = inner.upgrade() else {
        return;
    };
    let renew = strong.renew;
    let wake = strong.wake.clone();
    drop(strong);
    let mut next = tokio::time::Instant::now() + renew;
    loop {
        let mut batch = Vec::new();
        let woken = tokio::select! {
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
        let Some(inner) = inner.upgrade() else {
            return;
        };
        while let Ok(more) = released.try_recv() {
            batch.push(more);
        }
        release(&inner, batch).await;
        if woken {
            let dirty: Vec<String> = std::mem::take(&mut *inner.dirty());
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

/// Releases exact permits' leases, one call per key.
async fn release(inner: &Inner, batch: Vec<(String, u64)>) {
    let mut by_key: HashMap<String, Vec<(String, u64)>> = HashMap::new();
    for (key, id) in batch {
        by_key
            .entry(key)
            .or_default()
            .push((inner.lease_name(id), 0));
    }
    for (key, leases) in by_key {
        // Not answered: the leases expire instead.
        let _ = inner.call(&key, leases).await;
        forget_if_idle(inner, &key);
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

async fn renew_exact(inner: &Inner, key: &str) {
    let Some(slots) = inner.slots.get(key).map(|s| s.clone()) else {
        return;
    };
    let ids: Vec<u64> = slots.lock().exact.iter().copied().collect();
    if ids.is_empty() {
        return;
    }
    let leases = ids.iter().map(|id| (inner.lease_name(*id), 1)).collect();
    if let Ok(replies) = inner.call(key, leases).await {
        let still = slots.lock();
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
        if held.asking || (held.held == 0 && held.in_use == 0) {
            return;
        }
        let want = held.desired(closing);
        held.sending(want)
    };
    let asking = Asking::new(slots.clone());
    let reply = inner.call(key, vec![(inner.holder.clone(), want)]).await;
    let mut held = slots.lock();
    asking.done(&mut held);
    if let Ok(replies) = reply {
        let reply = replies.first().copied().unwrap_or_default();
        if reply.held < held.in_use {
            inner.metrics.lost.increment(held.in_use - reply.held);
        }
        let change = held.granted(reply.held, reply.fair, now + inner.lease);
        inner.metrics.leased.increment(change as f64);
    }
}

fn forget_if_idle(inner: &Inner, key: &str) {
    inner.slots.remove_if(key, |_, slots| {
        Arc::strong_count(slots) == 1 && slots.lock().idle()
    });
}
