//! Slots of a key's in-flight budget held in leases under an expiry:
//! `lua/slots.lua` as a [`Script`], and its arithmetic, which the
//! embedded store applies and a parity test holds to the script.

use std::collections::HashMap;

use crate::error::Error;
use crate::store::fair;
use crate::store::{bad_reply, Arg, Call, Lua, Memory, Script};

/// The script (see its header), with the fair level in front of it.
pub(crate) static SLOTS: Lua = Lua::new(
    "slots",
    concat!(
        include_str!("../../lua/fair_level.lua"),
        include_str!("../../lua/slots.lua")
    ),
);

/// One call of [`SLOTS`] on the leases under `key`.
#[derive(Debug)]
pub(crate) struct Slots<'a> {
    pub(crate) key: &'a str,
    pub(crate) call: &'a SlotsCall,
}

impl Call for Slots<'_> {
    fn lua(&self) -> &'static Lua {
        &SLOTS
    }

    fn key(&self) -> &str {
        self.key
    }

    fn args(&self, args: &mut Vec<Arg>) {
        args.push(Arg::Uint(self.call.max));
        args.push(Arg::Uint(self.call.ttl_ms));
        args.push(Arg::Uint(u64::from(self.call.waiting)));
        for (lease, want) in &self.call.leases {
            args.push(Arg::Text(lease.clone().into()));
            args.push(Arg::Uint(*want));
        }
    }

    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        let now_ms = memory.now_us() / 1_000;
        let mut leases = memory
            .take::<HashMap<String, SlotLease>>(self.key)
            .unwrap_or_default();
        let expires = memory.expires_us(self.key).unwrap_or(0);
        let (replies, expired) = apply(&mut leases, self.call, now_ms);
        if !leases.is_empty() {
            // The hash's TTL only grows (the script's PEXPIRE when shorter).
            let expires = expires.max((now_ms + self.call.ttl_ms) * 1_000);
            memory.set(self.key, leases, expires);
        } else {
            memory.remove(self.key);
        }
        let mut values: Vec<i64> = replies
            .iter()
            .flat_map(|r| [r.held as i64, r.fair as i64])
            .collect();
        values.push(expired as i64);
        Ok(values)
    }
}

impl Script for Slots<'_> {
    /// Each lease's reply, and the slots of expired leases dropped.
    type Reply = (Vec<SlotsReply>, u64);

    fn parse(&self, values: Vec<i64>) -> Result<Self::Reply, Error> {
        let Some((expired, pairs)) = values.split_last() else {
            return Err(bad_reply(&SLOTS, &values));
        };
        if pairs.len() != self.call.leases.len() * 2 {
            return Err(bad_reply(&SLOTS, &values));
        }
        let replies = pairs
            .chunks(2)
            .map(|pair| SlotsReply {
                held: pair[0].max(0) as u64,
                fair: pair[1].max(0) as u64,
            })
            .collect();
        Ok((replies, (*expired).max(0) as u64))
    }
}

/// How long a lease that got nothing counts its want, ms: the holders
/// above their fair share give slots back meanwhile.
pub(crate) const WAITING_MS: u64 = 1_000;

/// One call on a key's leases (the script's arguments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotsCall {
    /// The most slots in flight across every lease.
    pub(crate) max: u64,
    /// How long a lease lasts from this call, ms.
    pub(crate) ttl_ms: u64,
    /// Whether a lease that gets nothing still counts its want for
    /// [`WAITING_MS`] (one lease per process; not one per request).
    pub(crate) waiting: bool,
    /// Leases and the slots each wants to hold (absolute; 0 ends it).
    pub(crate) leases: Vec<(String, u64)>,
}

/// What one lease of a [`SlotsCall`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct SlotsReply {
    /// The slots it holds now.
    pub(crate) held: u64,
    /// Its max-min fair share of the maximum by every live lease's want.
    pub(crate) fair: u64,
}

/// A live lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotLease {
    pub(crate) held: u64,
    pub(crate) want: u64,
    pub(crate) expires_ms: u64,
}

/// Applies `call` at `now_ms` to a key's leases, as the script does;
/// returns each lease's reply and the slots of the expired leases it
/// dropped.
pub(crate) fn apply(
    leases: &mut HashMap<String, SlotLease>,
    call: &SlotsCall,
    now_ms: u64,
) -> (Vec<SlotsReply>, u64) {
    let mut expired = 0;
    leases.retain(|_, lease| {
        let live = lease.expires_ms > now_ms;
        if !live {
            expired += lease.held;
        }
        live
    });
    let mut held_now = Vec::with_capacity(call.leases.len());
    for (name, want) in &call.leases {
        let held = leases.get(name).map_or(0, |l| l.held);
        let others = leases.values().map(|l| l.held).sum::<u64>() - held;
        let new = if *want > held {
            held.max((*want).min(call.max.saturating_sub(others)))
        } else {
            *want
        };
        if *want == 0 || (new == 0 && !call.waiting) {
            leases.remove(name);
        } else {
            let lasts = if new == 0 {
                call.ttl_ms.min(WAITING_MS)
            } else {
                call.ttl_ms
            };
            leases.insert(
                name.clone(),
                SlotLease {
                    held: new,
                    want: *want,
                    expires_ms: now_ms + lasts,
                },
            );
        }
        held_now.push(new);
    }
    let wants: Vec<u64> = leases.values().map(|l| l.want).collect();
    let level = fair::level(call.max, &wants);
    let replies = call
        .leases
        .iter()
        .zip(held_now)
        .map(|((name, _), held)| SlotsReply {
            held,
            fair: leases.get(name).map_or(0, |l| l.want.min(level)),
        })
        .collect();
    (replies, expired)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `lua/slots.lua` and [`apply`] (the embedded store's) hold and
    /// share the same slots for the same sequence of calls.
    #[tokio::test]
    async fn the_script_and_the_embedded_store_agree() {
        let (_server, redis, memory) = crate::store::parity::both_stores().await;
        let call = |leases: &[(&str, u64)]| SlotsCall {
            max: 20,
            ttl_ms: 5_000,
            waiting: leases.len() == 1,
            leases: leases.iter().map(|(n, w)| ((*n).to_owned(), *w)).collect(),
        };
        let calls = [
            call(&[("a", 15)]),
            call(&[("b", 15)]),
            call(&[("b", 15)]),
            call(&[("c:1", 1), ("c:2", 1), ("c:3", 1)]),
            call(&[("a", 9)]),
            call(&[("b", 30)]),
            call(&[("c:2", 0), ("c:2", 0)]),
            call(&[("a", 0), ("d", 4)]),
            call(&[("b", 0), ("c:1", 0), ("c:3", 0), ("d", 0)]),
        ];
        let slots: Vec<Slots<'_>> = calls
            .iter()
            .map(|call| Slots {
                key: "slots:parity",
                call,
            })
            .collect();
        crate::store::parity::assert_agree(&redis, &memory, &slots).await;
    }

    fn call(max: u64, leases: &[(&str, u64)]) -> SlotsCall {
        SlotsCall {
            max,
            ttl_ms: 1_000,
            waiting: true,
            leases: leases.iter().map(|(n, w)| ((*n).to_owned(), *w)).collect(),
        }
    }

    #[test]
    fn leases_never_hold_more_than_the_maximum_and_expire() {
        let mut leases = HashMap::new();
        let (a, _) = apply(&mut leases, &call(20, &[("a", 15)]), 0);
        assert_eq!(a[0].held, 15);
        let (b, _) = apply(&mut leases, &call(20, &[("b", 15)]), 10);
        assert_eq!(b[0], SlotsReply { held: 5, fair: 10 });
        // A second delivery of the same call changes nothing.
        assert_eq!(apply(&mut leases, &call(20, &[("b", 15)]), 20).0[0].held, 5);
        // A is above its fair share of 10; giving back 5 lets B have them.
        apply(&mut leases, &call(20, &[("a", 10)]), 30);
        assert_eq!(
            apply(&mut leases, &call(20, &[("b", 15)]), 40).0[0].held,
            10
        );
        // A stops renewing: past its expiry, its slots are free.
        let (b, expired) = apply(&mut leases, &call(20, &[("b", 20)]), 1_031);
        assert_eq!((b[0].held, expired), (20, 10));
        // Released twice: released once.
        apply(&mut leases, &call(20, &[("b", 0)]), 1_040);
        apply(&mut leases, &call(20, &[("b", 0)]), 1_041);
        assert!(leases.is_empty());
    }

    proptest::proptest! {
        /// Whatever the calls, the live leases hold at most the maximum
        /// (the maximum never changes here), and no lease loses slots it
        /// did not give back while it is live.
        #[test]
        fn live_leases_hold_at_most_the_maximum(
            max in 1u64..40,
            calls in proptest::collection::vec(
                (proptest::collection::vec((0usize..5, 0u64..50), 1..4), 0u64..700),
                1..60,
            ),
        ) {
            let mut leases = HashMap::new();
            let mut now = 0;
            for (pairs, step) in calls {
                now += step;
                let before: HashMap<String, u64> = leases
                    .iter()
                    .filter(|(_, l): &(&String, &SlotLease)| l.expires_ms > now)
                    .map(|(n, l)| (n.clone(), l.held))
                    .collect();
                let mut seen = std::collections::HashSet::new();
                let pairs: Vec<(String, u64)> = pairs
                    .into_iter()
                    .filter(|(n, _)| seen.insert(*n))
                    .map(|(n, w)| (format!("l{n}"), w))
                    .collect();
                let c = SlotsCall { max, ttl_ms: 1_000, waiting: step % 2 == 0, leases: pairs.clone() };
                let (replies, _) = apply(&mut leases, &c, now);
                for ((name, want), reply) in pairs.iter().zip(&replies) {
                    let had = before.get(name).copied().unwrap_or(0);
                    if *want >= had {
                        proptest::prop_assert!(reply.held >= had.min(*want));
                    }
                }
                let live: u64 = leases.values().map(|l| l.held).sum();
                proptest::prop_assert!(live <= max, "{} held of {}", live, max);
            }
        }
    }
}
