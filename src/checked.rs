//! What a store's check answered, for the engines that decide by one
//! check (exact, per-process): the decision, what it took, and the
//! give-back that refunds it.

use std::time::Duration;

use crate::algorithm::{AcquireReply, Params};
use crate::algorithm::{GiveBackCall, LeaseOrigin, OpIds};
use crate::decision::Decision;
use crate::decision::{Source, Taken, TakenFrom};

/// Turns a store's check reply into a decision.
pub(crate) fn decision_from(reply: &AcquireReply, limit: u64, source: Source) -> Decision {
    let reset = Duration::from_micros(reply.reset_after_us);
    if reply.allowed {
        Decision::allow(limit, reply.remaining, reset, source)
    } else {
        Decision::deny(
            limit,
            reply.remaining,
            reset,
            reply.retry_after_us.map(Duration::from_micros),
            source,
        )
    }
}

/// What a check by a store (shared or per-process) that admitted `cost`
/// took: permits of the window it counted them in, or a bucket's tokens
/// at the reply's level and time.
pub(crate) fn taken_by_check(
    params: &Params,
    reply: &AcquireReply,
    cost: u64,
    origin: TakenFrom,
) -> Taken {
    match window_of(params, reply.now_us) {
        Some(window) => {
            let period = params.period_us.max(1);
            let lasts = Duration::from_micros(period - reply.now_us % period);
            Taken::new(origin, cost, Some(window)).lasting(lasts)
        }
        None => Taken::of_bucket(origin, cost, LeaseOrigin::of_check(reply)),
    }
}

/// The give-back that refunds `taken` to `store_key`, under the
/// admission's identity.
pub(crate) fn refund_call(
    params: &Params,
    store_key: String,
    taken: &Taken,
    ops: &OpIds,
) -> GiveBackCall {
    let windowed = params.algorithm.spec().leases.windowed();
    GiveBackCall {
        key: store_key,
        returned: taken.cost,
        window: if windowed {
            taken.window().unwrap_or(0)
        } else {
            0
        },
        origin: if windowed {
            LeaseOrigin::default()
        } else {
            taken.bucket_origin()
        },
        op: taken.op().unwrap_or_else(|| ops.next()),
        remember_us: remember_refund(params),
        refund: true,
    }
}

/// How long a refund's identity is remembered: past the end of its window,
/// or past the time its bucket takes to fill from empty, after which the
/// store gives it nothing back anyway.
fn remember_refund(params: &Params) -> u64 {
    let lasts = if params.algorithm.spec().leases.windowed() {
        params.period_us
    } else {
        let fill = params.burst as f64 * params.period_us as f64 / params.limit.max(1) as f64;
        fill.min(u64::MAX as f64 / 2.0) as u64
    };
    lasts.saturating_add(1_000_000)
}

/// The window a store reading at `now_us` falls in, for window algorithms
/// (the scripts' `floor(now / period)`); `None` for buckets.
fn window_of(params: &Params, now_us: u64) -> Option<i64> {
    params
        .algorithm
        .spec()
        .leases
        .windowed()
        .then(|| (now_us / params.period_us.max(1)) as i64)
}
