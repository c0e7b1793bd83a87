//! One bucket as a replica serves it: the Envoys seated on it, what each
//! was assigned, and how the replica's share is divided among them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;

use crate::config::NoMatch;
use crate::table::Table;
use slicelimit::store::fair;
use slicelimit::Quota;

use super::{ASSIGNMENT_TTL, DELIVERY, RESERVE};

/// One bucket id of one domain, as this replica serves it.
pub(super) struct Bucket {
    pub(super) id: BucketId,
    /// The rule's quota, or what an unmatched bucket gets.
    pub(super) rule: Rule,
    pub(super) store_key: String,
    pub(super) envoys: HashMap<u64, Seat>,
    /// What this replica holds in the store, and until when (its clock).
    pub(super) held: u64,
    pub(super) hold_until: Option<Instant>,
    /// Until when nothing is raised: the store lost the holds, and the
    /// other replicas' Envoys may still admit under theirs.
    pub(super) frozen_until: Option<Instant>,
    pub(super) last_report: Instant,
    /// What Envoys that left (stream gone, or silent) may still admit
    /// under their last assignment, and until when: held until then.
    pub(super) departed: Vec<(u64, Instant)>,
}

#[derive(Clone)]
pub(super) enum Rule {
    Quota { quota: Quota, label: String },
    Blanket(NoMatch),
}

impl Rule {
    /// The same budget (a rule's label, its place in the file, may move
    /// without changing it).
    pub(super) fn same(&self, other: &Rule) -> bool {
        match (self, other) {
            (Rule::Quota { quota: a, .. }, Rule::Quota { quota: b, .. }) => a == b,
            (Rule::Blanket(a), Rule::Blanket(b)) => a == b,
            _ => false,
        }
    }
}

/// An assignment: a token bucket filling at `rate` per period that holds
/// at most `tokens`, so it admits at most `rate + tokens` in any period
/// (its reach). A reach of 0 is a blanket denial; a rate of 0 with one
/// token fills half a token a period (at most one in any period).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Given {
    pub(super) rate: u64,
    pub(super) tokens: u64,
}

impl Given {
    /// The assignment of `reach`: [`RESERVE`] tokens absorb the jitter
    /// of an Envoy's requests (with one, a bucket sits full between
    /// requests and its rate goes unused), the rest is rate.
    pub(super) fn of(reach: u64) -> Given {
        match reach {
            0 => Given::default(),
            1 => Given { rate: 0, tokens: 1 },
            2 => Given { rate: 1, tokens: 1 },
            _ => Given {
                rate: reach - RESERVE,
                tokens: RESERVE,
            },
        }
    }

    pub(super) fn reach(self) -> u64 {
        self.rate + self.tokens
    }
}

/// One Envoy's place in a bucket.
#[derive(Default, Clone)]
pub(super) struct Seat {
    /// Requests per period it reported (allowed and denied).
    pub(super) demand: u64,
    /// What it was last sent.
    pub(super) given: Option<Given>,
    /// What it was sent before, when each was replaced, and whether its
    /// replacement carries on from it (a token bucket replacing a token
    /// bucket in force: Envoy fills it in proportion); a replaced bucket
    /// may admit at its rate until its replacement arrives, and what its
    /// tokens admitted may share a period with what follows.
    pub(super) retired: Vec<(Given, Instant, bool)>,
    /// When its assignment was last sent.
    pub(super) sent: Option<Instant>,
    /// When it last reported.
    pub(super) reported: Option<Instant>,
    /// What its assignments allowed since it last reported (requests),
    /// counted up to `accrued_at`.
    pub(super) accrued: f64,
    pub(super) accrued_at: Option<Instant>,
    /// When its first assignment was sent.
    pub(super) first_sent: Option<Instant>,
}

impl Seat {
    /// What it claims of the bucket's rate: its demand and the reserve.
    pub(super) fn claim(&self) -> u64 {
        self.demand + RESERVE
    }

    /// What its buckets, the current one and those it replaced, may
    /// admit in a `period` that ends after `now`: the highest rate that
    /// may be in force and the most tokens of a bucket that may share
    /// such a period (a replacement starts no fuller than the bucket it
    /// replaces, in proportion to its size; see the bound).
    pub(super) fn in_use(&self, now: Instant, period: Duration) -> u64 {
        let (rate, tokens) = self.split(now, period);
        rate + tokens
    }

    /// The rate and the tokens of [`in_use`](Self::in_use): a bucket
    /// that carries on from the one before starts no fuller than it was,
    /// so their tokens overlap; one that starts afresh (after a blanket
    /// rule, or an assignment that may have lapsed) starts full, so its
    /// tokens add to what the ones before admitted.
    fn split(&self, now: Instant, period: Duration) -> (u64, u64) {
        let current = self.given.unwrap_or_default();
        let (mut rate, mut chain, mut tokens) = (current.rate, current.tokens, 0);
        for (before, at, carried) in self.retired.iter().rev() {
            if now < *at + DELIVERY {
                rate = rate.max(before.rate);
            }
            if now < *at + DELIVERY + period {
                if *carried {
                    chain = chain.max(before.tokens);
                } else {
                    tokens += chain;
                    chain = before.tokens;
                }
            }
        }
        (rate, tokens + chain)
    }

    /// The most its buckets' tokens may admit in a period ending after
    /// `now` (with the reserve of a bucket it may yet be sent).
    pub(super) fn tokens(&self, now: Instant, period: Duration) -> u64 {
        self.split(now, period).1.max(RESERVE)
    }

    /// What it may still admit once it is gone, as (amount, until):
    /// its rate until its last assignment lapses (it may arrive
    /// [`DELIVERY`] after it was sent), its buckets' tokens a period
    /// longer.
    pub(super) fn departing(&self, now: Instant, period: Duration) -> Vec<(u64, Instant)> {
        let Some(sent) = self.sent else {
            return Vec::new();
        };
        // Envoy counts its time to live from when the message arrives.
        let lapses = sent + DELIVERY + ASSIGNMENT_TTL;
        let (rate, tokens) = self.split(now, period);
        [(rate, lapses), (tokens, lapses + period)]
            .into_iter()
            .filter(|(n, _)| *n > 0)
            .collect()
    }

    /// Counts what its assignment allowed up to `now`.
    fn accrue(&mut self, now: Instant, period: Duration) {
        if let (Some(given), Some(at)) = (self.given, self.accrued_at) {
            let span = now.saturating_duration_since(at).as_secs_f64();
            self.accrued += given.reach() as f64 * span / period.as_secs_f64();
        }
        self.accrued_at = Some(now);
    }

    /// What its assignments allowed since its last report at `now` and
    /// the most tokens a bucket holds, when one was in force all along;
    /// starts counting afresh.
    pub(super) fn allowance(&mut self, now: Instant, period: Duration) -> Option<(f64, u64)> {
        self.accrue(now, period);
        let whole = matches!(
            (self.first_sent, self.reported),
            (Some(first), Some(last)) if first <= last
        );
        let allowance = std::mem::take(&mut self.accrued);
        whole.then_some((allowance, RESERVE))
    }

    /// How much more its buckets may admit in a period once `given`
    /// is sent at `now`.
    fn cost(&self, given: Given, now: Instant, period: Duration) -> u64 {
        let mut after = self.clone();
        after.record(given, now, period);
        after
            .in_use(now, period)
            .saturating_sub(self.in_use(now, period))
    }

    /// Notes that `given` was sent at `now`.
    pub(super) fn record(&mut self, given: Given, now: Instant, period: Duration) {
        self.accrue(now, period);
        self.first_sent.get_or_insert(now);
        self.retired
            .retain(|(_, at, _)| now < *at + DELIVERY + period);
        // Unrenewed this long, the assignment in force may have lapsed:
        // what is sent now starts afresh.
        let lapsed = self
            .sent
            .is_some_and(|at| now.duration_since(at) >= ASSIGNMENT_TTL);
        if let Some(before) = self.given.filter(|before| *before != given || lapsed) {
            let carried = before.reach() > 0 && given.reach() > 0 && !lapsed;
            self.retired.push((before, now, carried));
        }
        self.given = Some(given);
        self.sent = Some(now);
    }
}

impl Bucket {
    /// What the tokens of its Envoys' buckets, and departed Envoys'
    /// assignments, may admit in a period ending after `now`.
    pub(super) fn tokens_bound(&self, now: Instant) -> u64 {
        let period = period(&self.rule);
        self.envoys
            .values()
            .map(|s| s.tokens(now, period))
            .sum::<u64>()
            + self.departed.iter().map(|(n, _)| n).sum::<u64>()
    }

    /// What the Envoys' assignments and departed Envoys' last ones may
    /// admit in a period, at `now`.
    pub(super) fn in_use(&self, now: Instant) -> u64 {
        let period = period(&self.rule);
        self.envoys
            .values()
            .map(|s| s.in_use(now, period))
            .sum::<u64>()
            + self.departed.iter().map(|(n, _)| n).sum::<u64>()
    }

    /// The assignments to send at `now` when the replica may hand out
    /// `give`: each Envoy's max-min fair share by claim, sent when it
    /// changed or half its time to live has passed.
    ///
    /// What an Envoy may still admit cannot be taken back at once: a
    /// lower assignment counts the higher one until it is delivered,
    /// and departed Envoys count until theirs lapse. So raises come out
    /// of what `give` leaves over all of that (the smallest first, the
    /// rest in later rounds); a lowering never waits.
    pub(super) fn plan(&self, give: u64, now: Instant) -> Vec<(u64, Given)> {
        let period = period(&self.rule);
        let mut seats: Vec<(&u64, &Seat)> = self.envoys.iter().collect();
        seats.sort_by_key(|(envoy, _)| **envoy);
        let claims: Vec<u64> = seats.iter().map(|(_, s)| s.claim()).collect();
        let mut room = give.saturating_sub(self.in_use(now));
        let mut raises = Vec::new();
        let mut out = Vec::new();
        for ((&envoy, seat), reach) in seats.iter().zip(fair::shares(give, &claims)) {
            let cost = seat.cost(Given::of(reach), now, period);
            // A raise waits for room below; meanwhile what it has is
            // renewed.
            let given = if cost == 0 {
                Given::of(reach)
            } else {
                raises.push((cost, envoy, reach));
                seat.given.unwrap_or_default()
            };
            let due = seat
                .sent
                .is_none_or(|at| now.duration_since(at) >= ASSIGNMENT_TTL / 2);
            if seat.given != Some(given) || due {
                out.push((envoy, given));
            }
        }
        raises.sort_unstable();
        for (cost, envoy, reach) in raises {
            let seat = &self.envoys[&envoy];
            // As much of the raise as the room covers.
            let mut reach = reach - cost.saturating_sub(room);
            let mut given = Given::of(reach);
            while reach > 0 && seat.cost(given, now, period) > room {
                reach -= 1;
                given = Given::of(reach);
            }
            if reach > seat.given.unwrap_or_default().reach() {
                room -= seat.cost(given, now, period);
                out.retain(|(e, _)| *e != envoy);
                out.push((envoy, given));
            }
        }
        out
    }
}

/// The rule `table` gives bucket `id` of `domain`.
pub(super) fn resolve(table: &Table, domain: &str, id: &BucketId) -> Rule {
    let Some(config) = table.domain(domain).and_then(|d| d.config.rlqs()) else {
        return Rule::Blanket(NoMatch::Allow);
    };
    let entries: Vec<(&str, &str)> = id
        .bucket
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    match config.rule(&entries) {
        Some(rule) => Rule::Quota {
            quota: rule.quota,
            label: rule.label(),
        },
        None => Rule::Blanket(config.no_match),
    }
}

/// A bucket id as one string, the same whatever order its entries came in.
pub(super) fn canonical(id: &BucketId) -> String {
    let mut entries: Vec<(&String, &String)> = id.bucket.iter().collect();
    entries.sort();
    let mut out = String::new();
    for (k, v) in entries {
        out.push_str(&format!("{}:{k}={}:{v};", k.len(), v.len()));
    }
    out
}

/// How long a period of `rule` is (a blanket rule's: a second).
pub(super) fn period(rule: &Rule) -> Duration {
    match rule {
        Rule::Quota { quota, .. } => quota.period(),
        Rule::Blanket(_) => Duration::from_secs(1),
    }
}
