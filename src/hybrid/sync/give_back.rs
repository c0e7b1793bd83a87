//! Give-backs: unused permits returned to the store, a batch at a time
//! behind the leases somebody waits for (all of them at the last round).

use std::collections::HashSet;

use crate::algorithm::{GiveBack, GiveBackCall};
use crate::hybrid::shared::Shared;

/// Sends the queued give-backs. They go last: a waiter's lease matters
/// more than returning permits nobody is asking for yet.
pub(crate) async fn give_back_all(shared: &Shared) {
    give_back_some(shared, None).await;
}

/// Sends up to `batches` batches of the queued give-backs (all: `None`),
/// oldest first; `true` if some are left queued.
pub(super) async fn give_back_some(shared: &Shared, batches: Option<usize>) -> bool {
    let batch_size = shared.config.load().batch_size;
    let returns = {
        let mut queued = shared.outbox.returns();
        let take = batches.map_or(queued.len(), |b| queued.len().min(b * batch_size));
        queued.drain(..take).collect::<Vec<_>>()
    };
    send(shared, &returns).await;
    !shared.outbox.returns().is_empty()
}

/// Sends the queued give-backs of the keys `leased` is about to ask a
/// lease for, ahead of those leases: a key's permits that went back when
/// its lease lapsed must be in the store before it asks again, or the ask
/// is refused and its denial tells a wait those permits would not have
/// needed. (Nothing queued, the usual case: no work.)
pub(super) async fn give_back_before<'a>(shared: &Shared, leased: impl Iterator<Item = &'a str>) {
    let returns = {
        let mut queued = shared.outbox.returns();
        if queued.is_empty() {
            return;
        }
        let leased: HashSet<&str> = leased.collect();
        let (first, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut *queued)
            .into_iter()
            .partition(|call| leased.contains(call.key.as_str()));
        *queued = rest;
        first
    };
    send(shared, &returns).await;
}

/// Sends `returns`, a batch at a time, and counts what the store took
/// back and what it refused (stranded).
async fn send(shared: &Shared, returns: &[GiveBackCall]) {
    let batch_size = shared.config.load().batch_size;
    for chunk in returns.chunks(batch_size) {
        let calls: Vec<GiveBack<'_>> = chunk
            .iter()
            .map(|call| GiveBack {
                params: &shared.params,
                call,
            })
            .collect();
        let (result, _) = shared
            .store
            .run_batch_counted(&calls, 0, &shared.counters)
            .await;
        match result {
            Ok(results) => {
                for (call, result) in chunk.iter().zip(results) {
                    match result {
                        Ok(back) => {
                            // (No refund: a repeat answers as its first.)
                            let back = back.permits();
                            shared.counters.given_back.add(back);
                            shared
                                .counters
                                .stranded
                                .add(call.returned.saturating_sub(back));
                        }
                        Err(_) => shared.counters.stranded.add(call.returned),
                    }
                }
            }
            Err(_) => {
                let lost: u64 = chunk.iter().map(|c| c.returned).sum();
                shared.counters.stranded.add(lost);
            }
        }
    }
}
