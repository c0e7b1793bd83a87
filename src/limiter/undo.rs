//! The undo guard: what a decision took so far, given back if the
//! decision does not stand. The one guard for anything half-taken: a
//! limiter's several quotas (`quotas`) and several limiters' pairs
//! (`check_all`, in `all`). It decides nothing; it only remembers and
//! gives back.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard};

use super::quotas::Quotas;
use crate::decision::{Decision, Taken};
use crate::key::Key;

/// What a decision took so far, of one limiter's quotas or of several
/// limiters' (`check_all`), given back when the guard drops: a quota
/// denied, a store error, or the future dropped midway. [`keep`] when the
/// decision stands.
///
/// [`keep`]: Undo::keep
pub(crate) struct Undo<'a> {
    /// Recorded as each take completes (takes may run concurrently).
    taken: Mutex<Vec<Took<'a>>>,
}

/// One take: quota `index` of `quotas` took `taken` for a key.
struct Took<'a> {
    quotas: &'a Arc<Quotas>,
    /// The key as given (for a per-key quota's resolver) and as kept.
    given: &'a str,
    kept: Cow<'a, str>,
    index: usize,
    taken: Taken,
}

impl<'a> Undo<'a> {
    pub(crate) fn new() -> Self {
        Undo {
            taken: Mutex::new(Vec::new()),
        }
    }

    fn list(&self) -> MutexGuard<'_, Vec<Took<'a>>> {
        self.taken.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Quota `index` of `quotas` took `taken` for `key`.
    pub(super) fn record(&self, quotas: &'a Arc<Quotas>, key: Key<'a>, index: usize, taken: Taken) {
        self.push(quotas, key.given, Cow::Borrowed(key.kept), index, taken);
    }

    fn push(
        &self,
        quotas: &'a Arc<Quotas>,
        given: &'a str,
        kept: Cow<'a, str>,
        index: usize,
        taken: Taken,
    ) {
        if taken.refundable() {
            self.list().push(Took {
                quotas,
                given,
                kept,
                index,
                taken,
            });
        }
    }

    /// Every part of `decision`, an admission of `quotas` for `key` (as
    /// the user gave it).
    pub(crate) fn record_all(&self, quotas: &'a Arc<Quotas>, key: &'a str, decision: &Decision) {
        let kept = crate::key::local_key(key);
        for (index, part) in decision.quotas().iter().enumerate() {
            self.push(quotas, key, kept.clone(), index, part.taken);
        }
    }

    /// Quota `index` of `quotas`' take was undone already.
    pub(super) fn forget(&self, quotas: &Arc<Quotas>, index: usize) {
        self.list()
            .retain(|t| !(Arc::ptr_eq(t.quotas, quotas) && t.index == index));
    }

    /// The decision stands: what was taken stays taken.
    pub(crate) fn keep(self) {
        self.list().clear();
    }
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        let taken = std::mem::take(&mut *self.list());
        // Grouped by limiter and key, so each gives back in one task.
        let mut rest = taken;
        while let Some(first) = rest.pop() {
            let (same, other): (Vec<Took<'_>>, Vec<Took<'_>>) = rest
                .into_iter()
                .partition(|t| Arc::ptr_eq(t.quotas, first.quotas) && t.kept == first.kept);
            rest = other;
            let mut parts: Vec<(usize, Taken)> = same.iter().map(|t| (t.index, t.taken)).collect();
            parts.push((first.index, first.taken));
            let key = Key {
                given: first.given,
                kept: &first.kept,
            };
            first.quotas.give_back(key, parts);
        }
    }
}
