//! What the sync task watches, between rounds: holdings whose window is to
//! be peeked at, and holdings whose refill ahead of need may ride along with
//! a batch (the rules are in `sync::watch`, the timing in `policy`).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, Weak};

use super::holding::Holding;

/// The sync task's watch on holdings: windows to peek at, refills ahead of
/// need to send along. Read and written by the sync task alone.
#[derive(Default)]
pub(crate) struct Watch {
    /// Holdings whose window is peeked at with the next batch sent.
    pub(crate) watched: Mutex<HashMap<usize, Watched>>,
    /// Holdings whose refill ahead of need is soon due: sent early with a
    /// batch that goes out anyway (see [`Ahead`]).
    pub(crate) ahead: Mutex<HashMap<usize, Ahead>>,
    /// When `ahead` was last scanned for refills to send along (local µs;
    /// 0: never), so a burst of batches does not scan it once each.
    pub(crate) ride_scan_at: AtomicU64,
}

/// A holding whose window lease runs out before its window ends, granted
/// while the store still had room in that window. The other holders of a
/// key over its limit usually lease that room within milliseconds (a
/// pre-lease round, a ramp's second asks), and then each of them, its
/// share spent, would ask once more only to find nothing: one round trip
/// per holder and key, each on its own. Instead, shortly before the holding
/// runs out (by its rate), the window is peeked at (a call that takes
/// nothing) in a batch that goes out anyway, with whatever lease the
/// process asks for next. A holder that finds it fully leased spends what
/// it holds and, if it runs out within [`peek_trust_us`](super::policy::peek_trust_us) of the peek, is
/// denied here until the window ends, as after an ask that got nothing;
/// later, it asks as before (permits given back meanwhile are found). One
/// peek per grant; none on a cluster, where a batch goes out as a pipeline
/// per hash slot and a peek would cost a round trip of its own.
pub(crate) struct Watched {
    pub(crate) holding: Weak<Holding>,
    /// The window the lease is for (a pre-lease's: the next one, peeked
    /// only once it is the holding's current window).
    pub(crate) window: i64,
    /// Not peeked before this local µs: the other holders' leases of the
    /// same round land in the meantime.
    pub(crate) after: u64,
    /// The window's lease deadline (local µs): no peek after it.
    pub(crate) until: u64,
    /// The holding's rate when the lease was granted (permits per µs).
    pub(crate) rate_per_us: f64,
}

/// A holding that, by its rate, falls to its low-water mark shortly, before
/// its window's lease ends: a refill ahead of need that would go out on
/// its own. Keys that ramp up together (past their first refill) or run
/// down leases refilled at half would each send theirs alone, a round
/// trip apiece a few milliseconds apart. Instead, a batch that goes out
/// anyway takes along the refills of watched holdings (only those whose rate
/// was known at the grant, see `sync::watch::expect_refill`) due within
/// [`ride_horizon_us`](super::policy::ride_horizon_us): sized by the same rule (what the rate spends until
/// the window ends, less what is held), only sent a little earlier. None
/// on a cluster (a pipeline per hash slot: riding saves nothing there).
pub(crate) struct Ahead {
    pub(crate) holding: Weak<Holding>,
    /// The window of the lease the mark belongs to.
    pub(crate) window: i64,
    /// When the lease was installed (local µs), and what the holding held
    /// then: the rate since is what it spends now.
    pub(crate) since: u64,
    pub(crate) held: i64,
    /// The rate known at the grant (permits per µs, above 0).
    pub(crate) rate_per_us: f64,
}
