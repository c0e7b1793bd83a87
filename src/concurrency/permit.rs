//! The permit: a slot held until it drops, on every path (a panic in the
//! request unwinds through it; a dropped future drops it).

use std::sync::Arc;

use super::state::KeySlots;
use super::Inner;

/// What a permit holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    /// An exact permit's own lease.
    Exact(u64),
    /// An exact lease asked for, not known to be granted: released
    /// (idempotently) without having counted as in flight.
    Asked(u64),
    /// One of this process's leased slots (hybrid).
    Leased,
    /// Admitted by the failure policy while the store could not answer.
    Fallback,
    /// Nothing (released already).
    Nothing,
}

/// A slot of a key's in-flight budget: released when dropped.
#[must_use = "the slot is released as soon as the permit is dropped"]
pub struct SlotPermit {
    inner: Arc<Inner>,
    key: String,
    slots: Arc<KeySlots>,
    held: Held,
}

impl std::fmt::Debug for SlotPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotPermit")
            .field("key", &self.key)
            .field("held", &self.held)
            .finish()
    }
}

impl SlotPermit {
    pub(crate) fn new(inner: Arc<Inner>, key: &str, slots: Arc<KeySlots>, held: Held) -> Self {
        SlotPermit {
            inner,
            key: key.to_owned(),
            slots,
            held,
        }
    }

    /// Marks what it holds: `Asked` becomes `Exact` once granted.
    pub(crate) fn set(&mut self, held: Held) {
        self.held = held;
    }

    /// The key it holds a slot of.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether the failure policy admitted it (the store could not
    /// answer): it counts against this process only.
    pub fn is_fallback(&self) -> bool {
        self.held == Held::Fallback
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        let held = std::mem::replace(&mut self.held, Held::Nothing);
        self.inner.release(&self.key, &self.slots, held);
    }
}
