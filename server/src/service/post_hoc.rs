//! A post-hoc rule's hit (`slicelimit: { post_hoc: true }`): the cost of
//! work already done, counted whatever is left.

use super::{Counted, Decided};

/// A post-hoc rule's hit (see `Rule::post_hoc`): its cost charged
/// whatever is left, then what is left looked at.
pub(super) async fn post_hoc(p: &Counted) -> Decided {
    charged(p, p.cost).await
}

/// `cost` of `p` charged whatever is left, then what is left looked at. A
/// charge is over when part of it went past the limit (a charge that uses
/// the budget up exactly is not, as the reference counts it); an ask (a
/// hit of 0) when nothing is left.
pub(super) async fn charged(p: &Counted, cost: u64) -> Decided {
    let past = if cost > 0 {
        let charge = p.limiter.charge(&p.key, cost).await;
        Some(charge.past_limit().unwrap_or(u64::from(charge.exhausted())))
    } else {
        None
    };
    let decision = p.limiter.check(&p.key, 0).await;
    let over = match past {
        Some(past) => past > 0,
        None => decision.remaining() == 0,
    };
    Decided {
        decision,
        over,
        peeked: false,
        past,
        hits: None,
    }
}
