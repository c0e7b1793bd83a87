//! What a replica sends its Envoys: quota assignments (a token bucket or a
//! blanket rule, with a time to live) and abandons.

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaResponse};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};
use tokio::sync::mpsc;
use tonic::Status;

use super::bucket::Given;
use super::ASSIGNMENT_TTL;

pub(super) fn send(
    envoys: &mut HashMap<u64, mpsc::Sender<Result<RateLimitQuotaResponse, Status>>>,
    envoy: u64,
    id: &BucketId,
    action: Action,
) -> bool {
    let Some(tx) = envoys.get(&envoy) else {
        return false;
    };
    let message = RateLimitQuotaResponse {
        bucket_action: vec![BucketAction {
            bucket_id: Some(id.clone()),
            bucket_action: Some(action),
        }],
    };
    // A full queue means an Envoy not reading: the next round sends again.
    let sent = tx.try_send(Ok(message)).is_ok();
    if sent {
        crate::stats::rlqs_message("sent");
    }
    sent
}

fn ttl(d: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: d.as_secs() as i64,
        nanos: 0,
    }
}

pub(super) fn blanket(rule: BlanketRule, lasts: Option<Duration>) -> Action {
    Action::QuotaAssignmentAction(QuotaAssignmentAction {
        assignment_time_to_live: lasts.map(ttl),
        rate_limit_strategy: Some(RateLimitStrategy {
            strategy: Some(Strategy::BlanketRule(rule as i32)),
        }),
    })
}

/// A token bucket of `given.tokens` tokens filling at `given.rate` per
/// `period` (whole seconds, as Envoy reads them). A rate of 0 fills 2
/// tokens every 4 periods: Envoy's buckets fill continuously, so a bucket
/// of one admits at most one in any period; and Envoy 1.40 takes two
/// buckets that differ only in the seconds of their fill interval for the
/// same, so the tokens per fill tell it apart from a rate of 1.
pub(super) fn token_bucket(given: Given, period: Duration) -> Action {
    let (per_fill, fill) = match given.rate {
        0 => (2, period * 4),
        rate => (rate, period),
    };
    Action::QuotaAssignmentAction(QuotaAssignmentAction {
        assignment_time_to_live: Some(ttl(ASSIGNMENT_TTL)),
        rate_limit_strategy: Some(RateLimitStrategy {
            strategy: Some(Strategy::TokenBucket(TokenBucket {
                max_tokens: u32::try_from(given.tokens).unwrap_or(u32::MAX),
                tokens_per_fill: Some(UInt32Value {
                    value: u32::try_from(per_fill).unwrap_or(u32::MAX),
                }),
                fill_interval: Some(ttl(fill)),
            })),
        }),
    })
}
