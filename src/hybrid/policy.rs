//! The lease policy: how many permits to ask for, when to refill, when to
//! lease the next window ahead, when an idle holder gives back, how long
//! a peek is believed. Every rule is arithmetic on numbers the sync task
//! hands in (rate, held, remaining, time left, round trip), with its
//! tuning constants; no atomics, no I/O. (Limits on the engine's own work
//! — holdings watched, pipelines per round, report back-off — stay where
//! that work is done.) (The store's side of the
//! policy, the fair share of what remains, is `lease_window.lua`'s
//! `share_of`, mirrored in `algorithm::window::share_of`.)
//!
//! Sizing: the rate is an exponentially weighted moving average of
//! permits consumed per microsecond (time constant [`TAU_US`]); a lease that was used up
//! quickly doubles the next one, so hot keys reach their size in a few
//! round trips instead of a full time constant.

use super::config::Ablation;

/// The EWMA time constant: one second.
pub(crate) const TAU_US: f64 = 1_000_000.0;

/// A first measure of at least this many permits seeds the rate.
pub(crate) const SEED_PERMITS: f64 = 8.0;

/// A window lease holds at most what the process spent in this window
/// and the one before, or this fraction of the limit (1 / 16), whichever
/// is more: a process that bursts and goes quiet holds at most a
/// sixteenth of the limit (plus what its previous lease left) where
/// others may be asking, however fast its burst looked (a rate seeded by
/// 25 requests a millisecond apart asked for the whole window).
pub(crate) const EARNED_FLOOR_DIVISOR: u64 = 16;

/// Permits a window from which a holder counts as using a share of it
/// (a thin holder spends fewer).
pub(crate) const THICK_PER_WINDOW: u64 = 8;

/// A window lease covers its window when it holds this much more than the
/// rate spends until the window ends (the rate is an average; demand runs
/// ahead of it).
pub(crate) const COVER_MARGIN: f64 = 1.2;

/// A thin holder's pre-leases are refused once the key's current window,
/// its next window, or every holder's ask together would pass this share
/// of the limit (the lease script decides).
pub(crate) const THIN_AHEAD_CAP_DIVISOR: u64 = 2;

/// What one lease costs Redis, about (a fixed-window lease script on this
/// crate's reference machine: 17–20 µs), for spreading pre-leases of many
/// keys ahead of a boundary.
pub(crate) const LEASE_COST_US: u64 = 25;

/// Round trips a pre-lease round allows for, besides its fixed lead: the
/// round's pipelines, a reply that waits behind them, and a lease sent
/// again after a lost reply.
pub(crate) const PRELEASE_ROUND_TRIPS: u64 = 4;

/// The longest a thin holder's pre-lease goes out before the round: a
/// full sweep of the maintenance, enough to spread a thousand keys' leases.
/// (Spread over half an hour-long window, they would go out half an hour
/// early, and a key's requests wait on a pre-lease instead of its window.)
pub(crate) const MAX_SPREAD_US: u64 = 1_000_000;

/// A window lease idle for this share of its period gives back what it
/// holds above the earned floor (`policy::EARNED_FLOOR_DIVISOR`).
pub(crate) const IDLE_TRIM_DIVISOR: u64 = 16;

/// The longest an idle holder's surplus takes to go back: its idle time,
/// then a full sweep of the maintenance (`sweep_us`, a tick included).
pub(crate) fn trim_delay_us(period_us: u64, sweep_us: u64) -> u64 {
    period_us / IDLE_TRIM_DIVISOR + sweep_us
}

/// When the first denial after a calm spell asks the store once more:
/// once an idle holder's surplus could have gone back
/// ([`trim_delay_us`]), or, sooner, once a holder asked and denied has
/// given its surplus back at maintenance's next look and a holder idle
/// for `idle_ttl` has been evicted (its permits returned), a sweep after.
pub(crate) fn recheck_delay_us(period_us: u64, idle_ttl_us: u64, sweep_us: u64) -> u64 {
    trim_delay_us(period_us, sweep_us).min(idle_ttl_us.saturating_add(sweep_us))
}

/// A thin holder counts as active, and is pre-leased, until it has been
/// idle this many periods (its rate, sampled at its few lease calls, is
/// biased upward: four of its gaps by the rate were one or two windows,
/// and a key seen once a window per process skips windows often enough
/// that its first request after a skip waited a round trip: 1.7 % of
/// all requests at per-second windows, at a 5 ms round trip).
pub(crate) const THIN_ACTIVE_PERIODS: u64 = 6;

/// Idle for this many of its usual gaps between requests (by its rate and
/// the cost of a recent request: `Holding::request_gap_us`), a key's rate
/// no longer says what it will spend. (Counted in permits, a gap was the
/// time one permit takes: a few milliseconds for requests of 2,000 tokens,
/// so a key seen about once a second per process gave its lease back at
/// most pauses and leased again seconds later. Four request gaps pass by
/// chance alone in most windows of such a key; eight in about one in
/// forty.)
pub(crate) const IDLE_TRIM_GAPS: f64 = 8.0;

/// How long a peek that found the window full is believed: a period, at
/// most a second. The holding is peeked at when, by its rate, it runs out
/// within this time, and denied on the peek's word only if it does; a
/// permit given back longer before it runs out is found by its ask.
pub(crate) fn peek_trust_us(period_us: u64) -> u64 {
    period_us.min(1_000_000)
}

/// How long after a grant its window is peeked at the earliest (at least
/// two round trips): a round of pre-leases over a fleet lands well within
/// it.
pub(crate) const PEEK_AFTER_US: u64 = 10_000;

/// How far ahead of its mark a refill rides along: an eighth of a period,
/// at most 100 ms (a fraction of the window's permits fetched early, by
/// processes that spend them).
pub(crate) fn ride_horizon_us(period_us: u64) -> u64 {
    (period_us / 8).min(100_000)
}

/// How often a large `ahead` is scanned at most (see `sync::watch::add_rides`).
pub(crate) fn ride_scan_every_us(horizon_us: u64) -> u64 {
    horizon_us / 8
}

/// What a refill's round trip takes, with room to spare: two round
/// trips and a millisecond. A lease that covers its window refills when
/// what is left would be spent within it; a waiter holding the next
/// window's pre-lease waits for it when it starts within it.
pub(crate) fn soon_us(rtt_us: u64) -> u64 {
    2 * rtt_us + 1_000
}

/// Besides a tick, the pre-lease lead and the round trips, how early the
/// next window's pre-leases go out: slack for the tick's own lateness.
pub(crate) const PRELEASE_SLACK_US: u64 = 50_000;

/// How long before a window ends its keys are pre-leased for the next:
/// a maintenance tick, the configured `lead`, [`PRELEASE_SLACK_US`],
/// [`PRELEASE_ROUND_TRIPS`] round trips and what leasing `keys` keys
/// takes Redis ([`LEASE_COST_US`] each); at most half a window.
pub(crate) fn prelease_lead_us(
    tick_us: u64,
    lead_us: u64,
    rtt_us: u64,
    keys: u64,
    period_us: u64,
) -> u64 {
    // (Twice a lease's cost: the sync task rests after each batch of
    // pre-leases; see `rest_after_ahead`.)
    (tick_us
        + lead_us
        + PRELEASE_SLACK_US
        + PRELEASE_ROUND_TRIPS * rtt_us
        + keys * 2 * LEASE_COST_US)
        .min(period_us / 2)
}

/// A lease reply, as the numbers that set its holding's refill mark.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Granted {
    /// A window lease (fixed or sliding window), not a bucket's.
    pub(crate) windowed: bool,
    /// What the call asked for, and what the store granted.
    pub(crate) want: u64,
    pub(crate) granted: u64,
    /// The holder spends under [`THICK_PER_WINDOW`] permits a window.
    pub(crate) thin: bool,
    /// The key's rate here, permits per µs (0: not known yet).
    pub(crate) rate_per_us: f64,
    /// How long the lease serves: from its window's start (or now) to its
    /// end, µs.
    pub(crate) serves_us: u64,
    /// What the holding holds of that window once the grant is in.
    pub(crate) holds: i64,
    /// The lease was sized to last until its window ends.
    pub(crate) to_the_end: bool,
    /// The store's round trip, µs.
    pub(crate) rtt_us: u64,
}

/// A holding's refill mark after a grant, and whether its key is contested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark {
    /// Below this many permits a take asks for a refill.
    pub(crate) low_water: u32,
    /// The store cut the lease below half the ask: many holders, little
    /// left. No refill or pre-lease ahead of need then.
    pub(crate) contested: bool,
}

/// When a holding refills after a grant. At half of what the rate asked for,
/// or a quarter of a headroom grant; not at all ahead of need for a
/// contested key (a permit fetched ahead would wait idle in every holder,
/// and at the window's end a thousand holders' one permit each is a
/// thousand stranded) or a thin holder (what it fetched ahead would wait
/// for its next request, and with many such holders a window's budget
/// with it). A window lease that, with what is held, covers what the rate
/// spends until its window ends is that window's last: refilled only if
/// demand outruns it, when what is left would be spent within two round
/// trips and a millisecond (a refill at half would ask a window often
/// fully leased by then).
pub(crate) fn low_water(g: &Granted, ablate: Ablation) -> Mark {
    let contested = g.windowed && !ablate.off(Ablation::CONTESTED) && g.granted < g.want / 2;
    let thin = g.windowed && !ablate.off(Ablation::THIN) && g.thin;
    let covers = g.windowed
        && !ablate.off(Ablation::WINDOW_LAST)
        && g.rate_per_us > 0.0
        && g.holds.max(0) as f64 >= g.rate_per_us * g.serves_us as f64 * COVER_MARGIN;
    let low_water = if contested || thin || ablate.off(Ablation::AHEAD) {
        0
    } else if (g.to_the_end && !ablate.off(Ablation::WINDOW_LAST)) || covers {
        (g.rate_per_us * soon_us(g.rtt_us) as f64).ceil().max(1.0) as u64
    } else {
        (g.want / 2).max(g.granted / 4)
    };
    Mark {
        low_water: low_water.min(u64::from(u32::MAX)) as u32,
        contested,
    }
}

/// Whether a holder, by its rate, spends what it holds of a window before
/// that window ends (with the margin [`low_water`] gives a lease that
/// covers its window), so the window may be fully leased when it next
/// asks: a thick holder of a busy key, worth watching. Not a lease cut by
/// `max_lease` with what the holder still needs left in the store (a key
/// far under its limit, whose ask when it runs out is served).
pub(crate) fn runs_out_early(g: &Granted, remaining: u64, max_lease: u64) -> bool {
    if g.rate_per_us <= 0.0 {
        return false;
    }
    let short = g.rate_per_us * g.serves_us as f64 * COVER_MARGIN - g.holds.max(0) as f64;
    let capped = g.granted >= max_lease && remaining as f64 >= short;
    short > 0.0 && !capped
}

/// What a thin holder's pre-lease asks for: enough that a window with
/// twice its usual requests (and four more) rarely waits on the store —
/// a holder's requests in a window vary as much as their number.
pub(crate) fn thin_want(per_window: u64) -> u64 {
    2 * per_window + 4
}

/// A window lease's ask: what it wants, the most it takes (the script's
/// `ceiling`), and a thin holder's pre-lease cap (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowAsk {
    pub(crate) want: u64,
    pub(crate) ceiling: u64,
    pub(crate) ahead_cap: u64,
}

/// What a window lease's ask is shaped by, besides the sizing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowTerms {
    /// The largest cost waiting.
    pub(crate) need: u64,
    /// A lease of the next window, ahead of it.
    pub(crate) ahead: bool,
    /// What is left of the window asked for.
    pub(crate) time_left_us: Option<u64>,
    pub(crate) period_us: u64,
    pub(crate) limit: u64,
    pub(crate) min_lease: u64,
    pub(crate) max_lease: u64,
}

/// Per-key sizing state: updated by the sync task (and by a promotion of
/// the next window's lease), read by the request path's refunds.
#[derive(Debug, Clone)]
pub(crate) struct Sizing {
    /// Local permits right after the last refill was applied.
    /// Saturating: sizing needs the order of magnitude, not the last permit.
    level: u32,
    /// When the last refill was applied (local µs); 0 = never.
    at: u64,
    /// Permits consumed per µs, smoothed.
    rate: f64,
    /// The last lease asked for (saturating: it only seeds doubling).
    last_want: u32,
    /// Window leases: the window `spent` counts in (`NO_WINDOW`: none
    /// yet; not an `Option`, which would add a word to every holding).
    spent_window: i64,
    /// Permits spent in `spent_window`, and in the window before it
    /// (saturating: they bound a lease, which `max_lease` bounds anyway).
    spent: u32,
    spent_before: u32,
}

/// Bounds and horizon for one decision about a lease's size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SizingRule {
    pub(crate) min_lease: u64,
    pub(crate) max_lease: u64,
    pub(crate) horizon_us: u64,
}

/// `Sizing::spent_window` before anything was spent.
const NO_WINDOW: i64 = i64::MIN;

impl Default for Sizing {
    fn default() -> Self {
        Sizing {
            level: 0,
            at: 0,
            rate: 0.0,
            last_want: 0,
            spent_window: NO_WINDOW,
            spent: 0,
            spent_before: 0,
        }
    }
}

impl Sizing {
    /// Folds in what was consumed since the last refill (in `window`, for
    /// window leases) and returns the smoothed rate (permits per µs).
    pub(crate) fn observe(
        &mut self,
        permits_now: i64,
        debt: u64,
        now: u64,
        window: Option<i64>,
    ) -> f64 {
        if self.at == 0 {
            return self.rate;
        }
        let consumed = (i64::from(self.level) - permits_now.max(0)).max(0) as f64 + debt as f64;
        // Counted per window even with no time elapsed since the last
        // refill (several lease calls within one clock reading: without
        // it, a key asked thirty times in one instant counted seven, and
        // looked thin).
        self.spent_in(window, consumed as u64);
        if now <= self.at {
            return self.rate;
        }
        let dt = (now - self.at) as f64;
        let instant = consumed / dt;
        if self.rate == 0.0 && consumed >= SEED_PERMITS {
            // The first measure of a key's demand seeds the average:
            // smoothing it up from zero would size the next leases of a
            // key at thousands a second as if it saw a few, and cost a
            // round trip per doubling until the estimate caught up. Only
            // a measure of several permits: two requests a moment apart
            // say nothing of a thin key's rate, and a thin key taken for a
            // hot one fetches ahead and strands permits.
            self.rate = instant;
            return self.rate;
        }
        let alpha = 1.0 - (-dt / TAU_US).exp();
        self.rate += alpha * (instant - self.rate);
        self.rate
    }

    /// Counts `permits` spent in `window`.
    fn spent_in(&mut self, window: Option<i64>, permits: u64) {
        let Some(window) = window else {
            return;
        };
        let w = self.spent_window;
        match w {
            NO_WINDOW => {
                self.spent_before = 0;
                self.spent = 0;
            }
            w if window == w => {}
            w if window < w => return,
            w if window == w + 1 => {
                self.spent_before = self.spent;
                self.spent = 0;
            }
            _ => {
                self.spent_before = 0;
                self.spent = 0;
            }
        }
        self.spent_window = window;
        self.spent = self
            .spent
            .saturating_add(u32::try_from(permits).unwrap_or(u32::MAX));
    }

    /// Window leases: the most this process spent of the key in one
    /// window, of the current one so far and the one before; `None`
    /// before anything was counted. Unlike the rate, which is sampled at
    /// lease calls (and those follow requests), it is not biased upward
    /// for a key seen a few times a window.
    pub(crate) fn per_window(&self) -> Option<u64> {
        (self.spent_window != NO_WINDOW).then(|| u64::from(self.spent.max(self.spent_before)))
    }

    /// Whether this process is a thin holder of the key: it spent fewer
    /// than [`THICK_PER_WINDOW`] permits in each of its last two windows.
    /// A thick holder's share of the next window surely gets used; a thin
    /// holder's often strands (one request a window means none about a
    /// third of the time), and a thousand thin holders' pre-leases could
    /// take a window's budget that then sits idle, so a thin holder is
    /// pre-leased only while the key is far under its limit.
    pub(crate) fn thin(&self) -> bool {
        self.per_window().is_some_and(|n| n < THICK_PER_WINDOW)
    }

    /// The most a window lease may hold (see [`EARNED_FLOOR_DIVISOR`]):
    /// what was spent in the last two windows, at least a sixteenth of
    /// `limit` and `min_lease`.
    pub(crate) fn earned(&self, limit: u64, min_lease: u64) -> u64 {
        (limit / EARNED_FLOOR_DIVISOR)
            .max(min_lease)
            .max(1)
            .max(u64::from(self.spent) + u64::from(self.spent_before))
    }

    /// The size of the next lease. `time_left_us` caps it at what the
    /// observed rate can use before the lease ends (fixed window), so few
    /// permits strand at the boundary. `need` is the largest pending cost.
    /// Also whether that cap cut it: then it is the window's last lease,
    /// one to spend, not to refill ahead of need.
    pub(crate) fn want_to_the_end(
        &mut self,
        rule: SizingRule,
        permits_now: i64,
        now: u64,
        need: u64,
        time_left_us: Option<u64>,
    ) -> (u64, bool) {
        let by_rate = (self.rate * rule.horizon_us as f64).ceil();
        let mut want = if by_rate.is_finite() {
            by_rate as u64
        } else {
            rule.max_lease
        };
        // The last lease ran dry within half a horizon: demand outruns the
        // average, so double.
        let quick = self.at != 0
            && permits_now <= i64::from(self.level / 2)
            && now.saturating_sub(self.at) < rule.horizon_us / 2;
        if quick {
            want = want.max(u64::from(self.last_want).saturating_mul(2));
        }
        let mut to_the_end = false;
        if let Some(left) = time_left_us {
            if self.rate > 0.0 {
                let usable = (self.rate * left as f64 * COVER_MARGIN).ceil() as u64;
                if usable.max(rule.min_lease) < want {
                    want = usable.max(rule.min_lease);
                    to_the_end = true;
                }
            }
        }
        let want = want.clamp(rule.min_lease, rule.max_lease).max(need);
        self.last_want = want.min(u64::from(u32::MAX)) as u32;
        (want, to_the_end)
    }

    /// Records the local level after a refill was applied.
    pub(crate) fn applied(&mut self, level: i64, now: u64) {
        self.level = level.clamp(0, i64::from(u32::MAX)) as u32;
        self.at = now;
    }

    /// The local permits changed by something other than spending: a
    /// pre-lease put in place (`added`, replacing `removed`) or a lease
    /// voided at its deadline (`removed`). The level moves with them, so
    /// the next observation counts only what requests spent: a voided
    /// lease is not demand, and permits spent from a promoted pre-lease
    /// are (without this, a key whose every window starts from a
    /// pre-lease looks idle, and its next pre-lease is sized too small).
    pub(crate) fn moved(&mut self, added: i64, removed: i64) {
        let level = i64::from(self.level) + added.max(0) - removed.max(0);
        self.level = level.clamp(0, i64::from(u32::MAX)) as u32;
    }

    /// The last lease asked for.
    pub(crate) fn last_want(&self) -> u64 {
        u64::from(self.last_want)
    }

    /// Permits consumed per µs, smoothed.
    pub(crate) fn rate_per_us(&self) -> f64 {
        self.rate
    }

    /// The most a headroom lease may hold: a key's fair share of what the
    /// store has left is worth taking only up to what this process can use
    /// — twice what its observed rate spends in `time_left_us` — or, for a
    /// key it has not seen spend yet, `cold` (a useful first lease, not one
    /// permit). Never below `want`, never above `max_lease`.
    pub(crate) fn ceiling(&self, want: u64, time_left_us: u64, cold: u64, max_lease: u64) -> u64 {
        let usable = if self.rate > 0.0 {
            (self.rate * time_left_us as f64 * 2.0)
                .ceil()
                .min(max_lease as f64) as u64
        } else {
            cold
        };
        usable.max(want).min(max_lease.max(want))
    }

    /// A window lease's ask from the rate's (`rate`): earned by use (see
    /// [`EARNED_FLOOR_DIVISOR`]: what a burst seemed to promise is not
    /// taken from processes that keep asking); a thin holder's pre-lease
    /// what its next window will likely use, only while the key is far
    /// under its limit (the store checks; see [`Sizing::thin`]); and at
    /// least what the process spent of the key in a whole recent window,
    /// pro rata in what is left of this one (the rate, an average, decays
    /// to nothing while the key is denied, and a key spent to its limit by
    /// mid-window began the next window in a dozen leases instead of one).
    pub(crate) fn window_ask(&self, rate: WindowAsk, t: &WindowTerms) -> WindowAsk {
        let earned = self.earned(t.limit, t.min_lease);
        let (mut want, mut ahead_cap) = (rate.want, rate.ahead_cap);
        if let Some(used) = self.per_window().filter(|_| t.ahead && self.thin()) {
            want = want.max(thin_want(used));
            ahead_cap = (t.limit / THIN_AHEAD_CAP_DIVISOR).max(1);
        }
        let want = want.min(earned).max(t.need);
        let mut ceiling = rate.ceiling;
        if let (Some(spent), Some(left)) = (self.per_window(), t.time_left_us) {
            let pro_rata = (u128::from(spent) * u128::from(left.min(t.period_us))
                / u128::from(t.period_us.max(1))) as u64;
            ceiling = ceiling.max(pro_rata.min(t.max_lease));
        }
        WindowAsk {
            want,
            ceiling: ceiling.min(earned).max(want),
            ahead_cap,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted(want: u64, granted: u64) -> Granted {
        Granted {
            windowed: true,
            want,
            granted,
            thin: false,
            rate_per_us: 0.0,
            serves_us: 1_000_000,
            holds: granted as i64,
            to_the_end: false,
            rtt_us: 1_000,
        }
    }

    #[test]
    fn a_lease_refills_at_half_its_ask_or_a_quarter_of_its_grant() {
        let mark = low_water(&granted(100, 80), Ablation::default());
        assert_eq!(
            mark,
            Mark {
                low_water: 50,
                contested: false
            }
        );
        // A headroom grant above the ask: a quarter of it.
        assert_eq!(
            low_water(&granted(100, 400), Ablation::default()).low_water,
            100
        );
        // Buckets are never contested, however cut.
        let bucket = Granted {
            windowed: false,
            ..granted(100, 10)
        };
        assert_eq!(low_water(&bucket, Ablation::default()).low_water, 50);
    }

    #[test]
    fn contested_and_thin_holders_refill_only_when_empty() {
        assert_eq!(
            low_water(&granted(100, 49), Ablation::default()),
            Mark {
                low_water: 0,
                contested: true
            }
        );
        let thin = Granted {
            thin: true,
            ..granted(6, 6)
        };
        assert_eq!(low_water(&thin, Ablation::default()).low_water, 0);
        // Switched off, a contested lease refills at half again.
        assert_eq!(
            low_water(&granted(100, 49), Ablation::parse("contested")).low_water,
            50
        );
    }

    #[test]
    fn a_lease_that_covers_its_window_refills_two_round_trips_before_empty() {
        // 1 permit/ms for 1 s needs 1,200 with the margin; 1,300 cover it.
        let g = Granted {
            rate_per_us: 0.001,
            holds: 1_300,
            ..granted(2_000, 1_300)
        };
        // 0.001/µs × (2 × 1 ms + 1 ms) = 3 permits.
        assert_eq!(low_water(&g, Ablation::default()).low_water, 3);
        assert!(!runs_out_early(&g, 0, u64::MAX));
        // 1,100 do not: refilled at half, and watched.
        let short = Granted { holds: 1_100, ..g };
        assert_eq!(low_water(&short, Ablation::default()).low_water, 1_000);
        assert!(runs_out_early(&short, 0, u64::MAX));
        // Unless max_lease cut it with what it needs still in the store.
        assert!(!runs_out_early(&short, 500, 1_300));
        assert!(runs_out_early(&short, 50, 1_300));
    }

    const RULE: SizingRule = SizingRule {
        min_lease: 1,
        max_lease: 10_000,
        horizon_us: 250_000,
    };

    #[test]
    fn a_cold_key_leases_the_minimum() {
        let mut s = Sizing::default();
        assert_eq!(s.want_to_the_end(RULE, 0, 1_000, 1, None).0, 1);
    }

    #[test]
    fn a_hot_key_grows_its_lease_quickly_and_settles_near_rate_times_horizon() {
        // 10 000 permits/s, a refill whenever the lease runs out.
        let mut s = Sizing::default();
        let mut now = 1_000_000u64;
        let mut want = s.want_to_the_end(RULE, 0, now, 1, None).0;
        s.applied(want as i64, now);
        let mut round_trips = 0;
        for _ in 0..200 {
            now += want * 100; // 100 µs per permit
            s.observe(0, 0, now, None);
            want = s.want_to_the_end(RULE, 0, now, 1, None).0;
            s.applied(want as i64, now);
            round_trips += 1;
            if want >= 2_000 {
                break;
            }
        }
        assert!(round_trips < 20, "took {round_trips} refills to grow");
        // Then steady state: refill at half the lease.
        for _ in 0..100 {
            now += want / 2 * 100;
            s.observe(want as i64 / 2, 0, now, None);
            want = s.want_to_the_end(RULE, want as i64 / 2, now, 1, None).0;
            s.applied(want as i64, now);
        }
        let ideal = 10_000.0 * 0.25;
        assert!(
            (want as f64) > ideal * 0.6 && (want as f64) < ideal * 2.5,
            "{want}"
        );
    }

    #[test]
    fn leases_are_clamped_and_capped_by_time_left() {
        let mut s = Sizing {
            level: 0,
            at: 1,
            rate: 1.0, // a million per second
            ..Sizing::default()
        };
        assert_eq!(s.want_to_the_end(RULE, 0, 10, 1, None), (10_000, false));
        assert_eq!(
            s.want_to_the_end(RULE, 0, 10, 1, Some(100)),
            (120, true),
            "cut to what the rest of the window uses"
        );
        // a pending request larger than the lease is still served
        let mut cold = Sizing::default();
        assert_eq!(cold.want_to_the_end(RULE, 0, 10, 50, None).0, 50);
    }

    #[test]
    fn a_headroom_lease_is_capped_by_what_the_process_can_use() {
        let mut s = Sizing::default();
        // Cold: the cold share, at least the rate's want.
        assert_eq!(s.ceiling(1, 1_000_000, 16, 10_000), 16);
        assert_eq!(s.ceiling(40, 1_000_000, 16, 10_000), 40);
        // 2 permits/s with 30 s left: about 120, whatever the share.
        s.rate = 2e-6;
        assert_eq!(s.ceiling(1, 30_000_000, 16, 10_000), 120);
        assert_eq!(s.ceiling(1, 30_000_000, 16, 50), 50, "max_lease caps it");
    }

    #[test]
    fn the_rate_decays_when_the_key_goes_quiet() {
        let mut s = Sizing::default();
        s.applied(100, 1);
        s.observe(0, 0, 100_001, None);
        let hot = s.rate_per_us();
        s.applied(100, 100_001);
        s.observe(100, 0, 5_100_001, None);
        assert!(s.rate_per_us() < hot / 10.0);
    }
}
