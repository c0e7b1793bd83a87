//! Max-min fair division of a capacity among claimants by their wants: a
//! building block for scripts that share a capacity (the concurrency
//! limiter's slots among leases, slicelimit-server's RLQS rate among
//! Envoys), once in Lua ([`LUA`]) and once in Rust ([`level`], its
//! mirror).
//!
//! It owns the arithmetic and nothing else: what a claimant wants, what
//! it holds and when its claim lapses are its script's business.

/// `lua/fair_level.lua`: defines the local function
/// `fair_level(capacity, wants)`, the Lua twin of [`level`] (`math.huge`
/// where [`level`] answers `u64::MAX`). Send it in front of a script's
/// own text, which may then call it:
///
/// ```
/// use slicelimit::store::{fair, Lua};
/// static SHARE: Lua = Lua::joined(
///     "share",
///     &[fair::LUA, "return math.min(tonumber(ARGV[2]), fair_level(tonumber(ARGV[1]), {1, 9}))"],
/// );
/// assert!(SHARE.source().starts_with(fair::LUA));
/// ```
///
/// Exact for capacities and wants up to 2^53 (Lua numbers are doubles).
pub const LUA: &str = include_str!("../../lua/fair_level.lua");

/// The max-min fair level of `capacity` among `wants`: the largest `L`
/// with `sum(min(want, L)) <= capacity`, so `u64::MAX` when every want
/// fits (`sum(wants) <= capacity`, no wants included).
///
/// A claimant's fair share is `want.min(L)` (see [`shares`]): wants at or
/// under the level are met in full, the others get the level, which is
/// what they leave shared equally, rounded down to whole units. The
/// shares never sum past `capacity`, and none can grow without a smaller
/// or equal one shrinking. Never overflows, whatever the values.
pub fn level(capacity: u64, wants: &[u64]) -> u64 {
    let mut sorted = wants.to_vec();
    sorted.sort_unstable();
    let mut left = capacity;
    for (i, &want) in sorted.iter().enumerate() {
        let share = left / (sorted.len() - i) as u64;
        if want > share {
            return share;
        }
        // want <= share <= left: no underflow.
        left -= want;
    }
    u64::MAX
}

/// Each want's max-min fair share of `capacity`, in the order of `wants`
/// (`want.min(level(capacity, wants))`).
pub fn shares(capacity: u64, wants: &[u64]) -> Vec<u64> {
    let level = level(capacity, wants);
    wants.iter().map(|&want| want.min(level)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::error::Error;
    use crate::store::{bad_reply, Arg, Call, Lua, Memory, Script};

    #[test]
    fn small_wants_are_met_and_the_rest_split_equally() {
        assert_eq!(shares(100, &[30, 90, 180]), [30, 35, 35]);
        assert_eq!(shares(100, &[90, 30, 180]), [35, 30, 35]);
        assert_eq!(shares(10, &[5, 5, 5]), [3, 3, 3]);
        assert_eq!(level(10, &[5, 5, 5]), 3);
        // Ties at the level: each gets it whole.
        assert_eq!(shares(9, &[3, 3, 3]), [3, 3, 3]);
        assert_eq!(level(9, &[3, 3, 4]), 3);
    }

    #[test]
    fn edges_zero_empty_satisfied_and_huge() {
        assert_eq!(level(0, &[5]), 0);
        assert_eq!(shares(0, &[0, 5, 7]), [0, 0, 0]);
        // Nothing wanted, or every want fits: no level binds.
        assert_eq!(level(0, &[]), u64::MAX);
        assert_eq!(level(0, &[0, 0]), u64::MAX);
        assert_eq!(level(100, &[10, 20]), u64::MAX);
        assert_eq!(level(30, &[10, 20]), u64::MAX);
        assert_eq!(shares(100, &[10, 20]), [10, 20]);
        assert!(shares(7, &[]).is_empty());
        // Values whose sum overflows u64.
        let max = u64::MAX;
        assert_eq!(level(max, &[max, max]), max / 2);
        assert_eq!(level(max, &[1, max]), max - 1);
        assert_eq!(level(max - 1, &[max]), max - 1);
        assert_eq!(
            shares(max, &[max, 3, max]),
            [(max - 3) / 2, 3, (max - 3) / 2]
        );
    }

    /// The definition, by search: the largest `L` up to past every want
    /// with `sum(min(want, L)) <= capacity`.
    fn by_definition(capacity: u64, wants: &[u64]) -> u64 {
        let fits = |l: u64| wants.iter().map(|&w| w.min(l)).sum::<u64>() <= capacity;
        let top = wants.iter().copied().max().unwrap_or(0);
        if fits(top) {
            return u64::MAX;
        }
        (0..top).rev().find(|&l| fits(l)).expect("0 fits")
    }

    proptest::proptest! {
        #[test]
        fn the_level_is_the_largest_that_fits(
            capacity in 0u64..200,
            wants in proptest::collection::vec(0u64..120, 0..7),
        ) {
            proptest::prop_assert_eq!(level(capacity, &wants), by_definition(capacity, &wants));
            let shares = shares(capacity, &wants);
            proptest::prop_assert!(shares.iter().sum::<u64>() <= capacity);
        }
    }

    /// A script that replies `fair_level` of its arguments (-1 for
    /// `math.huge`), to hold the Lua to [`level`].
    static LEVEL: Lua = Lua::joined(
        "fair_level_test",
        &[
            LUA,
            "local wants = {}\n\
             for i = 2, #ARGV do wants[#wants + 1] = tonumber(ARGV[i]) end\n\
             local l = fair_level(tonumber(ARGV[1]), wants)\n\
             if l == math.huge then return -1 end\n\
             return l\n",
        ],
    );

    #[derive(Debug)]
    struct Level(u64, Vec<u64>);

    impl Call for Level {
        fn lua(&self) -> &'static Lua {
            &LEVEL
        }

        fn key(&self) -> &str {
            "fair:parity"
        }

        fn args(&self, args: &mut Vec<Arg>) {
            args.push(Arg::Uint(self.0));
            args.extend(self.1.iter().map(|&w| Arg::Uint(w)));
        }

        fn mirror(&self, _: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
            let l = level(self.0, &self.1);
            Ok(vec![if l == u64::MAX { -1 } else { l as i64 }])
        }
    }

    impl Script for Level {
        type Reply = i64;

        fn parse(&self, values: Vec<i64>) -> Result<i64, Error> {
            match values.as_slice() {
                &[l] => Ok(l),
                _ => Err(bad_reply(&LEVEL, &values)),
            }
        }
    }

    /// `lua/fair_level.lua`, sent joined in front of a script (loaded on
    /// `NOSCRIPT`), and [`level`] agree, up to 2^53.
    #[tokio::test]
    async fn the_lua_and_the_rust_agree() {
        let (_server, redis, memory) = crate::store::parity::both_stores().await;
        let big = 1u64 << 53;
        let calls = [
            Level(0, vec![]),
            Level(0, vec![5]),
            Level(0, vec![0, 0]),
            Level(100, vec![30, 90, 180]),
            Level(100, vec![10, 20]),
            Level(10, vec![5, 5, 5]),
            Level(9, vec![3, 3, 4]),
            Level(7, vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
            Level(1_000, vec![999, 1, 2, 3, 500, 0]),
            Level(big, vec![big, big, 3]),
            Level(big - 1, vec![big / 3, big, big - 7]),
        ];
        crate::store::parity::assert_agree(&redis, &memory, &calls).await;
    }
}
