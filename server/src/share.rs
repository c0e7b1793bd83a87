//! Shares of a rate, held under an expiry: how the replicas of
//! slicelimit-server divide an RLQS bucket's rate among themselves (in
//! the store, `lua/rate_share.lua`), and how each divides its share among
//! the Envoys connected to it. Pure arithmetic; the store applies
//! [`ShareCall`] atomically, as the [`RateShare`] script. The max-min
//! level itself, in Lua and in Rust, is the library's
//! [`slicelimit::store::fair`].

use std::collections::HashMap;

use slicelimit::store::fair;
use slicelimit::store::{bad_reply, Arg, Call, Lua, Memory, Script};
use slicelimit::Error;

/// The script (see its header), with the library's fair level in front
/// of it.
pub static RATE_SHARE: Lua = Lua::joined(
    "rate_share",
    &[fair::LUA, include_str!("../lua/rate_share.lua")],
);

/// One holder's call on the shares of the bucket under `key`.
#[derive(Debug)]
pub struct RateShare<'a> {
    /// The bucket's store key.
    pub key: &'a str,
    /// The holder's call.
    pub call: &'a ShareCall,
}

impl Call for RateShare<'_> {
    fn lua(&self) -> &'static Lua {
        &RATE_SHARE
    }

    fn key(&self) -> &str {
        self.key
    }

    fn args(&self, args: &mut Vec<Arg>) {
        let c = self.call;
        args.push(Arg::Text(c.holder.clone().into()));
        args.push(Arg::Text(c.claims_arg().into()));
        for n in [
            c.limit,
            c.ttl_ms,
            c.in_use,
            c.tokens_ttl_ms,
            c.claims_ttl_ms,
            c.tokens,
        ] {
            args.push(Arg::Uint(n));
        }
    }

    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        let now_ms = memory.now_us() / 1_000;
        let expires = memory.expires_us(self.key).unwrap_or(0);
        let mut holders = memory
            .take::<HashMap<String, Hold>>(self.key)
            .unwrap_or_default();
        let reply = apply(&mut holders, self.call, now_ms);
        if holders.is_empty() {
            memory.remove(self.key);
        } else {
            // The hash's TTL only grows (the script's PEXPIRE when
            // shorter); letting go leaves it as it was.
            let at_least = if self.call.ttl_ms == 0 {
                expires
            } else {
                (now_ms + self.call.tokens_ttl_ms) * 1_000
            };
            memory.set(self.key, holders, expires.max(at_least));
        }
        Ok(vec![
            reply.grant as i64,
            reply.held as i64,
            reply.others as i64,
            i64::from(reply.had),
        ])
    }
}

impl Script for RateShare<'_> {
    type Reply = ShareReply;

    fn parse(&self, values: Vec<i64>) -> Result<ShareReply, Error> {
        match values.as_slice() {
            &[grant, held, others, had] => Ok(ShareReply {
                grant: grant.max(0) as u64,
                held: held.max(0) as u64,
                others: others.max(0) as u64,
                had: had == 1,
            }),
            _ => Err(bad_reply(&RATE_SHARE, &values)),
        }
    }
}

/// One holder's call on a bucket's shares (the script's arguments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareCall {
    /// The holder (a server replica).
    pub holder: String,
    /// What each of its clients claims, requests per period: the
    /// bucket's rate is shared max-min fair among every holder's clients.
    pub claims: Vec<u64>,
    /// The bucket's limit, requests per period.
    pub limit: u64,
    /// How long the hold lasts; 0 lets go (with nothing in use).
    pub ttl_ms: u64,
    /// How long the part of the hold that is tokens lasts (at least
    /// `ttl_ms`): what a bucket's tokens admitted may share a period with
    /// what comes after it.
    pub tokens_ttl_ms: u64,
    /// How long its claims count without renewal (at most `ttl_ms`): a
    /// holder gone quiet stops shaping the others' shares sooner than
    /// its hold lapses.
    pub claims_ttl_ms: u64,
    /// What its clients may still be using: kept until it says otherwise.
    pub in_use: u64,
    /// Of the hold, the most that is tokens.
    pub tokens: u64,
}

impl ShareCall {
    /// The claims as the script takes them: comma-separated.
    pub fn claims_arg(&self) -> String {
        let claims: Vec<String> = self.claims.iter().map(u64::to_string).collect();
        claims.join(",")
    }
}

/// What a [`ShareCall`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShareReply {
    /// The rate it may hand out now.
    pub grant: u64,
    /// The rate it holds (at least what its clients may still use).
    pub held: u64,
    /// Other live holders.
    pub others: u64,
    /// Whether the store still had this holder's hold: a holder that
    /// held something and finds it gone knows the store lost the holds
    /// (a restart, a flush, an eviction), others' included.
    pub had: bool,
}

/// One holder's entry (times in ms of the store's clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hold {
    pub(crate) held: u64,
    /// Of `held`, what lasts until `tokens_expires_ms`; the rest until
    /// `expires_ms`.
    pub(crate) tokens: u64,
    pub(crate) expires_ms: u64,
    pub(crate) tokens_expires_ms: u64,
    pub(crate) claims_until_ms: u64,
    pub(crate) claims: Vec<u64>,
}

impl Hold {
    /// What it holds at `now_ms`.
    fn live(&self, now_ms: u64) -> u64 {
        let rate = if self.expires_ms > now_ms {
            self.held - self.tokens
        } else {
            0
        };
        let tokens = if self.tokens_expires_ms > now_ms {
            self.tokens
        } else {
            0
        };
        rate + tokens
    }
}

/// Applies `call` at `now_ms` to a bucket's holders, as the script does.
pub(crate) fn apply(
    holders: &mut std::collections::HashMap<String, Hold>,
    call: &ShareCall,
    now_ms: u64,
) -> ShareReply {
    holders.retain(|_, hold| hold.tokens_expires_ms > now_ms);
    let had = holders.contains_key(&call.holder);
    let others = holders.keys().filter(|name| **name != call.holder).count() as u64;
    if call.ttl_ms == 0 {
        holders.remove(&call.holder);
        return ShareReply {
            others,
            had,
            ..ShareReply::default()
        };
    }
    let mut others_held = 0;
    let mut claims = call.claims.clone();
    for (_, hold) in holders.iter().filter(|(name, _)| **name != call.holder) {
        others_held += hold.live(now_ms);
        if hold.claims_until_ms > now_ms {
            claims.extend(&hold.claims);
        }
    }
    let level = fair::level(call.limit, &claims);
    let target: u64 = call.claims.iter().map(|&c| c.min(level)).sum();
    let grant = target.min(call.limit.saturating_sub(others_held));
    let held = grant.max(call.in_use);
    holders.insert(
        call.holder.clone(),
        Hold {
            held,
            tokens: call.tokens.min(held),
            expires_ms: now_ms + call.ttl_ms,
            tokens_expires_ms: now_ms + call.tokens_ttl_ms.max(call.ttl_ms),
            claims_until_ms: now_ms + call.claims_ttl_ms.min(call.ttl_ms),
            claims: call.claims.clone(),
        },
    );
    ShareReply {
        grant,
        held,
        others,
        had,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::HashMap;

    fn call(holder: &str, demand: u64, in_use: u64) -> ShareCall {
        ShareCall {
            holder: holder.into(),
            claims: vec![demand],
            limit: 100,
            ttl_ms: 3_000,
            tokens_ttl_ms: 3_000,
            claims_ttl_ms: 3_000,
            in_use,
            tokens: 0,
        }
    }

    #[test]
    fn holds_never_sum_past_the_limit_and_converge_to_fair_shares() {
        let mut holders = HashMap::new();
        // A alone takes what it asks for.
        assert_eq!(apply(&mut holders, &call("a", 90, 0), 0).grant, 90);
        // B arrives: only 10 are free, though its fair share is more.
        let b = apply(&mut holders, &call("b", 90, 0), 10);
        assert_eq!((b.grant, b.others), (10, 1));
        // A renews at its fair share (its clients still use 90 until told).
        let a = apply(&mut holders, &call("a", 90, 90), 20);
        assert_eq!((a.grant, a.held), (50, 90));
        let a = apply(&mut holders, &call("a", 90, 50), 30);
        assert_eq!((a.grant, a.held), (50, 50));
        // Now B gets its fair share.
        let b = apply(&mut holders, &call("b", 90, 10), 40);
        assert_eq!((b.grant, b.held), (50, 50));
        let sum: u64 = holders.values().map(|h| h.held).sum();
        assert!(sum <= 100);
    }

    #[test]
    fn clients_are_shared_fairly_whichever_holder_they_reach() {
        let mut holders = HashMap::new();
        let on = |holder: &str, claims: &[u64]| ShareCall {
            claims: claims.to_vec(),
            ..call(holder, 0, 0)
        };
        // A small and a large client on one holder, a large one on the
        // other: the large ones get the same, not the holders.
        apply(&mut holders, &on("a", &[32, 102]), 0);
        apply(&mut holders, &on("b", &[92]), 1);
        let a = apply(&mut holders, &on("a", &[32, 102]), 2);
        let b = apply(&mut holders, &on("b", &[92]), 3);
        assert_eq!((a.grant, b.grant), (66, 34));
    }

    #[test]
    fn a_quiet_holders_claims_lapse_before_its_hold_and_its_rate_before_its_tokens() {
        let mut holders = HashMap::new();
        let long = |holder: &str, demand: u64, in_use: u64, tokens: u64| ShareCall {
            ttl_ms: 3_000,
            tokens_ttl_ms: 60_000,
            claims_ttl_ms: 1_000,
            tokens,
            ..call(holder, demand, in_use)
        };
        apply(&mut holders, &long("a", 100, 0, 0), 0);
        apply(&mut holders, &long("a", 100, 100, 4), 10);
        // A goes quiet. At 1.5 s its claims no longer count, its hold does.
        let b = apply(&mut holders, &long("b", 100, 0, 0), 1_500);
        assert_eq!((b.grant, b.had), (0, false));
        // At 3.5 s its rate has lapsed, its 4 tokens have not.
        assert_eq!(apply(&mut holders, &long("b", 100, 0, 2), 3_500).grant, 96);
        assert_eq!(
            apply(&mut holders, &long("b", 100, 96, 2), 60_011).grant,
            100
        );
        // A comes back: its hold is gone, and it is told so.
        assert!(!apply(&mut holders, &long("a", 100, 0, 0), 60_020).had);
    }

    #[test]
    fn an_expired_holder_frees_its_share_and_ttl_zero_lets_go() {
        let mut holders = HashMap::new();
        apply(&mut holders, &call("a", 100, 0), 0);
        assert_eq!(apply(&mut holders, &call("b", 100, 0), 1_000).grant, 0);
        // A stops renewing: past its expiry, B may have everything.
        assert_eq!(apply(&mut holders, &call("b", 100, 0), 3_001).grant, 100);
        let gone = ShareCall {
            ttl_ms: 0,
            ..call("b", 0, 0)
        };
        apply(&mut holders, &gone, 3_002);
        assert!(holders.is_empty());
    }

    proptest::proptest! {
        /// Any sequence of calls by holders that never claim more in use
        /// than they last held keeps the live holds within the limit, and
        /// a holder alone with enough demand gets all of it back within
        /// one expiry.
        #[test]
        fn live_holds_never_sum_past_the_limit(
            limit in 1u64..500,
            calls in proptest::collection::vec(
                (
                    0usize..4,
                    proptest::collection::vec(0u64..300, 0..4),
                    0u64..=100,
                    0u64..3_000,
                    0u64..1_500,
                ),
                1..80,
            ),
        ) {
            let mut holders = HashMap::new();
            let mut last: HashMap<String, u64> = HashMap::new();
            let mut now = 0;
            for (who, claims, in_use_pct, ttl_ms, step) in calls {
                now += step;
                let holder = format!("h{who}");
                let held_before = holders
                    .get(&holder)
                    .map_or(0, |h: &Hold| h.live(now));
                // A holder lets go (ttl 0) only once nothing is in use.
                let in_use = if ttl_ms == 0 { 0 } else { held_before * in_use_pct / 100 };
                let demand: u64 = claims.iter().sum();
                let call = ShareCall {
                    holder: holder.clone(),
                    claims,
                    limit,
                    ttl_ms,
                    tokens_ttl_ms: ttl_ms + in_use_pct * 10,
                    claims_ttl_ms: ttl_ms / 2,
                    in_use,
                    tokens: in_use / 3,
                };
                let reply = apply(&mut holders, &call, now);
                proptest::prop_assert!(reply.grant <= demand.min(limit));
                proptest::prop_assert!(reply.held >= in_use);
                last.insert(holder, reply.held);
                let live: u64 = holders.values().map(|h| h.live(now)).sum();
                proptest::prop_assert!(live <= limit, "{} held of {}", live, limit);
            }
            // Everyone else expires: a lone holder gets what it asks for.
            now += 5_001;
            let alone = apply(
                &mut holders,
                &ShareCall {
                    holder: "z".into(),
                    claims: vec![limit],
                    limit,
                    ttl_ms: 1,
                    tokens_ttl_ms: 1,
                    claims_ttl_ms: 1,
                    in_use: 0,
                    tokens: 0,
                },
                now,
            );
            proptest::prop_assert_eq!(alone.grant, limit);
        }
    }
}
