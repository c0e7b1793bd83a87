//! A round: every bucket's hold renewed in the store, and its share
//! divided among its Envoys and sent.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action,
};
use futures_util::StreamExt;

use super::actions::{blanket, send, token_bucket};
use super::bucket::{period, resolve, Given, Rule};
use super::{
    tokens_ttl, Inner, State, ASSIGNMENT_TTL, CLAIMS_TTL, DELIVERY, HOLD_TTL, IDLE, ROUND_CALLS,
    SILENT,
};
use crate::config::NoMatch;
use crate::share::{RateShare, ShareCall};

type Key = (String, String);

impl Inner {
    /// Lets go of this replica's hold under `store_key`: all of it, or,
    /// with `keep` (a renewal without claims, while its Envoys may still
    /// use part of the hold), all but what is in use. The answer is not
    /// needed: a hold not let go of lapses on its own.
    async fn let_go_of(&self, store_key: &str, keep: Option<ShareCall>) {
        let call = keep.filter(|c| c.in_use > 0).unwrap_or_else(|| ShareCall {
            holder: self.holder.clone(),
            claims: Vec::new(),
            limit: 0,
            ttl_ms: 0,
            tokens_ttl_ms: 0,
            claims_ttl_ms: 0,
            in_use: 0,
            tokens: 0,
        });
        let _ = self
            .store
            .run(&RateShare {
                key: store_key,
                call: &call,
            })
            .await;
    }

    /// The call renewing the hold on bucket `key` at `now` (`claims`:
    /// with its Envoys' claims; without, it keeps only what is in use).
    fn renewal(&self, key: &Key, now: Instant, claims: bool) -> Option<ShareCall> {
        let state = self.lock();
        let bucket = state.buckets.get(key)?;
        let Rule::Quota { quota, .. } = &bucket.rule else {
            return None;
        };
        let holding = !bucket.envoys.is_empty() || !bucket.departed.is_empty();
        let in_use = bucket.in_use(now).min(bucket.held);
        Some(ShareCall {
            holder: self.holder.clone(),
            claims: if claims {
                bucket.envoys.values().map(|s| s.claim()).collect()
            } else {
                Vec::new()
            },
            limit: quota.limit(),
            ttl_ms: if holding {
                HOLD_TTL.as_millis() as u64
            } else {
                0
            },
            tokens_ttl_ms: tokens_ttl(quota.period()).as_millis() as u64,
            claims_ttl_ms: CLAIMS_TTL.as_millis() as u64,
            in_use,
            tokens: bucket.tokens_bound(now).min(in_use.max(bucket.held)),
        })
    }

    /// Renews every bucket's hold and sends what changed, at `now`.
    pub(super) async fn round(&self, now: Instant) {
        let table = self.table.load_full();
        let mut gone = Vec::new();
        let keys: Vec<Key> = {
            let mut state = self.lock();
            let State { envoys, buckets } = &mut *state;
            buckets.retain(|(domain, _), bucket| {
                let period = period(&bucket.rule);
                // An Envoy that stopped reporting (connected, but no longer
                // sending this bucket's requests) gives its seat up: its
                // assignment is not renewed and expires.
                let mut silent = Vec::new();
                bucket.envoys.retain(|_, seat| {
                    let keep = seat
                        .reported
                        .is_none_or(|at| now.duration_since(at) < SILENT);
                    if !keep {
                        silent.extend(seat.departing(now, period));
                    }
                    keep
                });
                bucket.departed.extend(silent);
                bucket.departed.retain(|(_, until)| *until > now);
                let rule = resolve(&table, domain, &bucket.id);
                if !bucket.rule.same(&rule) {
                    // A new quota: the Envoys forget the bucket and come
                    // back with its next request; what they may still
                    // admit under their assignments stays counted.
                    for (envoy, seat) in bucket.envoys.drain() {
                        send(
                            envoys,
                            envoy,
                            &bucket.id,
                            Action::AbandonAction(AbandonAction {}),
                        );
                        bucket.departed.extend(seat.departing(now, period));
                    }
                }
                // Only its name changed (a rule added above it): nothing
                // moves.
                bucket.rule = rule;
                let idle = bucket.envoys.is_empty()
                    && bucket.departed.is_empty()
                    && now.duration_since(bucket.last_report) >= IDLE;
                if idle && bucket.held > 0 {
                    gone.push(bucket.store_key.clone());
                }
                !idle
            });
            buckets.keys().cloned().collect()
        };
        for store_key in gone {
            self.let_go_of(&store_key, None).await;
        }
        let mut calls = Vec::new();
        for key in keys {
            match self.renewal(&key, now, true) {
                Some(call) => calls.push((key, call)),
                None => self.send_blanket(&key, now),
            }
        }
        let store = &self.store;
        let mut replies = futures_util::stream::iter(calls)
            .map(|(key, call)| async move {
                let store_key = self.lock().buckets.get(&key)?.store_key.clone();
                let asked = self.now();
                let reply = store
                    .run(&RateShare {
                        key: &store_key,
                        call: &call,
                    })
                    .await
                    .ok();
                Some((key, asked, reply))
            })
            .buffer_unordered(ROUND_CALLS);
        let mut sums: HashMap<Key, (u64, u64)> = HashMap::new();
        while let Some(answer) = replies.next().await {
            let Some((key, asked, reply)) = answer else {
                continue;
            };
            if let Some((label, assigned, held)) = self.assign(&key, reply, asked) {
                let sum = sums.entry((key.0.clone(), label)).or_default();
                sum.0 += assigned;
                sum.1 += held;
            }
        }
        for ((domain, label), (assigned, held)) in sums {
            crate::stats::rlqs_assigned(&domain, &label, assigned, held);
        }
    }

    /// Divides what the hold got (asked for at `asked`) among the
    /// bucket's Envoys and sends each its new assignment, stamped with
    /// the time it is sent; returns the rule's label, the reach assigned
    /// and the rate held.
    fn assign(
        &self,
        key: &Key,
        reply: Option<crate::share::ShareReply>,
        asked: Instant,
    ) -> Option<(String, u64, u64)> {
        let now = self.now();
        let fallback = self.fallback();
        let mut state = self.lock();
        let State { envoys, buckets } = &mut *state;
        let bucket = buckets.get_mut(key)?;
        let Rule::Quota { quota, label } = bucket.rule.clone() else {
            return None;
        };
        let period = quota.period();
        let give = match reply {
            Some(reply) => {
                if !reply.had && bucket.held > 0 {
                    // The store lost the holds, others' too: until theirs
                    // would have lapsed, nothing is raised.
                    bucket.frozen_until = Some(asked + tokens_ttl(period));
                }
                bucket.held = reply.held;
                bucket.hold_until = Some(asked + HOLD_TTL);
                match bucket.frozen_until {
                    Some(until) if until > now => reply.grant.min(bucket.in_use(now)),
                    _ => reply.grant,
                }
            }
            // The store did not answer: the hold stands until it expires,
            // and what it holds may be divided again; after that, the
            // failure policy.
            None => match bucket.hold_until {
                Some(until) if now + DELIVERY + ASSIGNMENT_TTL <= until => bucket.held,
                _ => {
                    for (envoy, seat) in bucket.envoys.iter_mut() {
                        let action = blanket(fallback, Some(ASSIGNMENT_TTL));
                        if send(envoys, *envoy, &bucket.id, action) {
                            seat.record(Given::default(), now, period);
                        }
                    }
                    return Some((label, 0, bucket.held));
                }
            },
        };
        for (envoy, given) in bucket.plan(give, now) {
            let action = if given.reach() == 0 {
                blanket(BlanketRule::DenyAll, Some(ASSIGNMENT_TTL))
            } else {
                token_bucket(given, period)
            };
            // Not sent (its queue is full): the next round tries again,
            // and what it had stays counted meanwhile.
            if send(envoys, envoy, &bucket.id, action) {
                if let Some(seat) = bucket.envoys.get_mut(&envoy) {
                    seat.record(given, now, period);
                }
            }
        }
        let assigned = bucket
            .envoys
            .values()
            .map(|s| s.given.map_or(0, Given::reach))
            .sum();
        Some((label, assigned, bucket.held))
    }

    fn send_blanket(&self, key: &Key, now: Instant) {
        let mut state = self.lock();
        let State { envoys, buckets } = &mut *state;
        let Some(bucket) = buckets.get_mut(key) else {
            return;
        };
        let Rule::Blanket(no_match) = bucket.rule else {
            return;
        };
        let rule = match no_match {
            NoMatch::Allow => BlanketRule::AllowAll,
            NoMatch::Deny => BlanketRule::DenyAll,
        };
        for (envoy, seat) in bucket.envoys.iter_mut() {
            if seat.given.is_none() && send(envoys, *envoy, &bucket.id, blanket(rule, None)) {
                seat.record(Given::default(), now, Duration::from_secs(1));
            }
        }
    }

    /// Lets go of every claim, and of every hold beyond what is in use
    /// (at shutdown).
    pub(super) async fn let_go(&self, now: Instant) {
        let keys: Vec<Key> = self.lock().buckets.keys().cloned().collect();
        for key in keys {
            let Some(call) = self.renewal(&key, now, false) else {
                continue;
            };
            let Some(store_key) = self.lock().buckets.get(&key).map(|b| b.store_key.clone()) else {
                continue;
            };
            self.let_go_of(&store_key, Some(call)).await;
        }
    }
}
