//! A report of permits to the store under an identity, and how it is
//! resent: the one shape of "tell the store what was admitted without
//! it" for the fallback's ledger (`ledger`) and the hybrid engine's debt
//! (credit an evicted holding spent, debt a lost lease call carried).
//!
//! A report's identity ([`OpId`]) is fixed when it is made, so a resend
//! after a lost reply is counted once by the store, which remembers an
//! identity for 60 s. A report is therefore resent for [`RESEND_FOR`] at
//! most, backing off from 100 ms, doubling, to 5 s between tries; after that the store
//! may have forgotten it, a resend could count twice, and it is dropped
//! (the caller counts it).

use std::time::Duration;

use crate::algorithm::{LeaseCall, OpId};

/// How long a report is resent. The store remembers a report's identity
/// for 60 s; a resend after that could apply twice, so a report still
/// unsent by then is dropped and counted instead (`Stats::reports_dropped`).
pub(crate) const RESEND_FOR: Duration = Duration::from_secs(50);

/// Permits admitted for `key` without the store, to be counted there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    /// The key it is reported for: a user key in the fallback's ledger
    /// (which holds no key encoder), a store key in the hybrid engine.
    pub(crate) key: String,
    pub(crate) permits: u64,
    /// Fixed window: the window they were admitted in; `None`: the
    /// store's current window (or bucket).
    pub(crate) window: Option<i64>,
    pub(crate) op: OpId,
    /// Tries that found the store unavailable, for the back-off.
    attempts: u32,
    /// Local µs before which it is not resent.
    not_before: u64,
    /// When it was first sent (local µs; see [`RESEND_FOR`]).
    first_sent: Option<u64>,
}

/// What becomes of a report the store could not take.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Resend {
    /// To be sent again, as it was, once due.
    Later(Report),
    /// Resent for too long: `permits` dropped (the caller counts them).
    Dropped(u64),
}

impl Report {
    /// A report not sent yet.
    pub(crate) fn new(key: String, permits: u64, window: Option<i64>, op: OpId) -> Report {
        Report {
            key,
            permits,
            window,
            op,
            attempts: 0,
            not_before: 0,
            first_sent: None,
        }
    }

    /// The same report, already sent once at `at` (local µs): inside a
    /// lease call whose reply was lost, say.
    pub(crate) fn sent_at(mut self, at: u64) -> Report {
        self.first_sent = Some(at);
        self
    }

    /// It goes out now (local µs): the resend window counts from the
    /// first time.
    pub(crate) fn sending(&mut self, now: u64) {
        self.first_sent.get_or_insert(now);
    }

    /// Whether its back-off is over at `now` (local µs).
    pub(crate) fn due(&self, now: u64) -> bool {
        self.not_before <= now
    }

    /// The store call that reports it for `store_key`: its permits as
    /// consumption of its window (or the current one), under its identity.
    pub(crate) fn call(&self, store_key: String) -> LeaseCall {
        let call = LeaseCall::report(store_key, self.permits, self.op);
        match self.window {
            Some(window) => LeaseCall {
                debt_window: window,
                ..call
            },
            None => call,
        }
    }

    /// The store was unavailable at `now` (local µs): resent under the
    /// same identity after a back-off, or dropped if it was first sent
    /// more than [`RESEND_FOR`] ago.
    pub(crate) fn unavailable(mut self, now: u64) -> Resend {
        let expired = self
            .first_sent
            .is_some_and(|t| now.saturating_sub(t) > RESEND_FOR.as_micros() as u64);
        if expired {
            return Resend::Dropped(self.permits);
        }
        self.attempts += 1;
        self.not_before = now + backoff_us(self.attempts);
        Resend::Later(self)
    }
}

/// The back-off after `attempts` tries (1 and up): 100 ms, doubling to at
/// most 5 s.
fn backoff_us(attempts: u32) -> u64 {
    (50_000u64 << attempts.min(7)).min(5_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::OpIds;

    #[test]
    fn a_report_backs_off_under_its_identity_and_is_dropped_after_the_resend_window() {
        let op = OpIds::default().next();
        let mut report = Report::new("k".into(), 3, Some(7), op);
        assert!(report.due(0));
        report.sending(1_000);
        let Resend::Later(report) = report.unavailable(2_000) else {
            panic!("resent within the window");
        };
        assert_eq!(report.op, op);
        assert!(!report.due(2_000 + 99_999));
        assert!(report.due(2_000 + 100_000));
        assert_eq!(report.call("sl:k".into()).debt_window, 7);
        let mut late = report.clone();
        for _ in 0..20 {
            match late.unavailable(3_000) {
                Resend::Later(r) => late = r,
                Resend::Dropped(_) => panic!("not yet expired"),
            }
        }
        assert!(!late.due(3_000 + 4_999_999), "capped at 5 s");
        assert!(late.due(3_000 + 5_000_000));
        let past = 1_000 + RESEND_FOR.as_micros() as u64 + 1;
        assert_eq!(report.unavailable(past), Resend::Dropped(3));
    }
}
