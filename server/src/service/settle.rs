//! Reservations through Envoy: a descriptor carrying `slicelimit_reserve`
//! reserves its hits (the estimate) as any enforced descriptor is
//! decided, and its receipt is kept in the store under the entry's value
//! (Envoy's `x-request-id`); the same descriptor at the stream's end,
//! carrying `slicelimit_settle` with the same value and the actual cost
//! as its hits, settles it: what the work cost beyond the estimate is
//! charged, past the limit if need be; what it did not use goes back to
//! the window it was taken from, while that window lasts.

use std::time::Duration;

use super::{Counted, Decided};
use crate::reservation::{Found, Keep, Record, Take};
use slicelimit::{Decision, Store};

/// The entry that makes a descriptor a reservation.
pub const RESERVE_ENTRY: &str = "slicelimit_reserve";
/// The entry that makes a descriptor a reservation's settlement.
pub const SETTLE_ENTRY: &str = "slicelimit_settle";

/// The longest reservation identity taken (Envoy's request ids are 36).
const MAX_ID: usize = 128;

/// A descriptor's entries, name and value.
type Entries<'a> = Vec<(&'a str, &'a str)>;

/// What a descriptor's `slicelimit_*` entry made of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Role {
    /// A descriptor as any other.
    Plain,
    /// Reserves its hits, kept under this identity.
    Reserve(String),
    /// Settles the reservation of this identity at its hits.
    Settle(String),
}

impl Role {
    /// The role `entries` give, and the entries without the one that gave
    /// it (they name the counter, as the reservation's did).
    pub(super) fn of(
        entries: Entries<'_>,
        index: usize,
    ) -> Result<(Role, Entries<'_>), tonic::Status> {
        let mut role = Role::Plain;
        let mut kept = Vec::with_capacity(entries.len());
        for (name, value) in entries {
            let this = match name {
                RESERVE_ENTRY => Role::Reserve(value.to_owned()),
                SETTLE_ENTRY => Role::Settle(value.to_owned()),
                _ => {
                    kept.push((name, value));
                    continue;
                }
            };
            if role != Role::Plain {
                return Err(tonic::Status::invalid_argument(format!(
                    "descriptor {index}: at most one of {RESERVE_ENTRY} and {SETTLE_ENTRY}"
                )));
            }
            if value.is_empty() || value.len() > MAX_ID {
                return Err(tonic::Status::invalid_argument(format!(
                    "descriptor {index}: {name} needs an identity of 1 to {MAX_ID} bytes"
                )));
            }
            role = this;
        }
        Ok((role, kept))
    }
}

/// Where the reservation `id` of `p` is kept.
fn record_key(p: &Counted, id: &str) -> String {
    format!(
        "{}:reservation:{}:{}{id}",
        p.limiter.namespace(),
        p.key.len(),
        p.key
    )
}

/// How long a reservation waits for its settlement: its window and a
/// quarter of an hour (a stream that long), at most a day and that. A
/// settlement later than that charges the whole actual cost.
fn kept_for(p: &Counted) -> Duration {
    p.limiter
        .quota_of(&p.key)
        .period()
        .min(Duration::from_secs(86_400))
        + Duration::from_secs(15 * 60)
}

/// Keeps what the admitted reservation `decision` of `p` took, for its
/// settlement. A reservation that cannot be kept (the store failed) is
/// settled as if unreserved: charged its whole actual cost, its estimate
/// kept.
pub(super) async fn keep(store: &Store, p: &Counted, id: &str, decision: &Decision) {
    let record = Record {
        estimate: p.cost,
        receipt: decision.receipt(),
    };
    let key = record_key(p, id);
    let ttl_ms = kept_for(p).as_millis() as u64;
    let by = format!("{:x}", rand_id());
    let call = Keep {
        key: &key,
        by: &by,
        record: &record,
        ttl_ms,
    };
    let result = match store.run(&call).await {
        Ok(true) => "kept",
        // Another reservation of the same identity: request ids must be
        // unique (see docs/envoy.md).
        // (Both are spoilt: each of their settlements is charged whole.)
        Ok(false) => "duplicate",
        Err(_) => "failed",
    };
    metrics::counter!(crate::stats::RESERVATIONS, "result" => result).increment(1);
}

/// Settles the reservation `id` of `p` at `p.cost`, the actual cost.
pub(super) async fn settle(store: &Store, p: &Counted, id: &str) -> Decided {
    let key = record_key(p, id);
    // The taking call's identity: sent again after a lost reply, the
    // same record comes back.
    let by = format!("{:x}", rand_id());
    let mut record = store.run(&Take { key: &key, by: &by }).await;
    if record.is_err() {
        record = store.run(&Take { key: &key, by: &by }).await;
    }
    let (charge, outcome) = match record {
        Ok(Found::Kept(Record { estimate, receipt })) => {
            if p.cost > estimate {
                (p.cost - estimate, "charged")
            } else if p.cost < estimate {
                let back = match receipt {
                    Some(receipt) => {
                        p.limiter
                            .refund_receipt(&p.key, &receipt, estimate - p.cost)
                            .await
                    }
                    None => 0,
                };
                // Nothing back: its window ended (or its quota changed, or
                // a hybrid bucket lease has no receipt).
                (0, if back > 0 { "refunded" } else { "expired" })
            } else {
                (0, "exact")
            }
        }
        // A second delivery of a settlement: it counted once.
        Ok(Found::Settled) => (0, "again"),
        // None kept (none made, its request denied, or kept past its
        // time), or the store failed: the whole cost is charged.
        Ok(Found::Nothing) | Err(_) => (p.cost, "unreserved"),
    };
    metrics::counter!(crate::stats::SETTLEMENTS, "outcome" => outcome).increment(1);
    let mut decided = super::post_hoc::charged(p, charge).await;
    decided.hits = Some(charge);
    decided
}

/// A fresh identity for one settlement's take.
fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
