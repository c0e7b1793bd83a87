//! Waiting instead of denying: [`Limiter::acquire`] asks again when a
//! denial says when to, until it is admitted or its wait runs out.
//!
//! Owns the wait loop and its jitter; the waiters' queues are
//! `queues`'. Every permit is taken by an admitting [`Limiter::check`],
//! never by this module.

use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use tokio::time::Instant;

use crate::decision::Decision;
use crate::limiter::Limiter;
use crate::queues::Turn;
use crate::quota::MAX_PERIOD;

/// The longest a wake-up is delayed past its retry time.
const MAX_JITTER: Duration = Duration::from_millis(20);

/// The shortest sleep: a denial that says "retry now" must not become a
/// loop of store calls.
const MIN_SLEEP: Duration = Duration::from_millis(1);

impl Limiter {
    /// Like [`check`](Limiter::check), but a denial that says when the
    /// request could pass ([`Decision::retry_after`]) within `max_wait`
    /// is waited out and asked again, until the request is admitted or
    /// the wait runs out.
    ///
    /// - **In arrival order.** Callers waiting on one key of one limiter
    ///   are served first come, first served (the order a tokio `Mutex`
    ///   hands itself on in): only the earliest asks and sleeps; the
    ///   others wait behind it, and a caller whose wait runs out there
    ///   returns the last denial the earliest saw, without asking. Across
    ///   processes there is no queue: each process's earliest waiter asks
    ///   the store when its retry time comes, and the jitter below spreads
    ///   them.
    /// - **Bounded.** It waits for a retry only if one more `check` (as
    ///   long as the last one took) still fits before the deadline, so
    ///   `acquire` answers by the end of `max_wait`, give or take how much
    ///   one check's time varies. A denial that can never pass (no
    ///   `retry_after`: the cost is above the limit) or whose retry falls
    ///   beyond what is left of the wait is returned at once, without
    ///   sleeping for nothing. `max_wait` zero is one `check`.
    /// - **Jittered.** Each wake-up comes a little after the retry time
    ///   (up to a tenth of the wait, at most 20 ms, at random), so many
    ///   waiters in many processes do not all ask at the instant a window
    ///   resets.
    /// - **Cancel-safe.** It takes nothing itself and holds only its
    ///   place in the key's queue across its sleeps, which it leaves when
    ///   dropped: only an admitting `check` takes permits.
    ///   Dropped while it sleeps (a timeout, a client gone), it leaves
    ///   the key's budget as it was; dropped inside a `check`, it is as
    ///   cancel-safe as that check (an exact store call whose script has
    ///   already run has spent its permit, as a dropped `check` has).
    ///
    /// Returns the last decision seen: the admission, or the denial that
    /// ended the wait. Every attempt is a decision and is counted as one
    /// in [`Stats`](crate::Stats); the sleeps are counted in
    /// [`Stats::acquire_waits`](crate::Stats::acquire_waits), and the
    /// calls that slept and were still denied in
    /// [`Stats::acquire_timeouts`](crate::Stats::acquire_timeouts).
    ///
    /// ```no_run
    /// # async fn demo(limiter: slicelimit::Limiter) {
    /// use std::time::Duration;
    ///
    /// let d = limiter.acquire("report-export", 1, Duration::from_secs(2)).await;
    /// if !d.is_allowed() {
    ///     // Still over quota after waiting up to 2 s (or never possible).
    /// }
    /// # }
    /// ```
    pub async fn acquire(&self, key: &str, cost: u64, max_wait: Duration) -> Decision {
        // No wait: one check, now, whoever waits.
        if max_wait.is_zero() {
            return self.check(key, cost).await;
        }
        self.acquire_until(key, cost, deadline_after(max_wait))
            .await
    }

    /// [`acquire`](Limiter::acquire) with a deadline instead of a
    /// duration: several waits can share one budget, e.g. a request
    /// counted against a user's and an organisation's limiter that may
    /// wait 2 s in all. Everything else is as `acquire` says (in arrival
    /// order, bounded by `deadline`, jittered, cancel-safe, counted in
    /// the same [`Stats`](crate::Stats)). With `deadline` already past it
    /// checks once, or answers with the last denial of a waiter ahead of
    /// it on this key.
    ///
    /// `deadline` is tokio's [`Instant`], so a test runtime's paused clock
    /// moves it.
    ///
    /// ```no_run
    /// # async fn demo(user: slicelimit::Limiter, org: slicelimit::Limiter) {
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    ///
    /// // One budget of 2 s for both waits, not 2 s each.
    /// let deadline = Instant::now() + Duration::from_secs(2);
    /// let by_user = user.acquire_until("alice", 1, deadline).await;
    /// let by_org = org.acquire_until("acme", 1, deadline).await;
    /// # let _ = (by_user, by_org);
    /// # }
    /// ```
    pub async fn acquire_until(&self, key: &str, cost: u64, deadline: Instant) -> Decision {
        // A cost no window can ever admit: one check, now, whoever waits.
        if self.never_admits(key, cost) {
            return self.check(key, cost).await;
        }
        let turn = match self.turn(key, deadline).await {
            Ok(turn) => turn,
            Err(Some(denial)) => return denial,
            // The head has seen no denial yet: the deadline (zero, or
            // shorter than the head's first check) came first.
            Err(None) => return self.check(key, cost).await,
        };
        let began = Instant::now();
        let first = self.check(key, cost).await;
        self.retry_in_turn(key, cost, first, deadline, began.elapsed(), &turn)
            .await
    }

    /// Waits out `denial`, the decision a [`check`](Limiter::check) of
    /// `key` and `cost` just returned, until `deadline`:
    /// [`acquire_until`](Limiter::acquire_until) for a caller that has
    /// asked once already and need not ask again before the retry time
    /// its denial names. An admission, or a denial that can never pass
    /// (no [`retry_after`](Decision::retry_after)), is returned as it is.
    ///
    /// A retry is waited for only while one more check still fits before
    /// `deadline`, as in [`acquire`](Limiter::acquire); the check behind
    /// `denial` was not timed here, so the first retry is judged as if
    /// checks took no time.
    pub async fn wait_out(
        &self,
        key: &str,
        cost: u64,
        denial: Decision,
        deadline: Instant,
    ) -> Decision {
        if denial.is_allowed() || denial.retry_after().is_none() {
            return denial;
        }
        let turn = match self.turn(key, deadline).await {
            Ok(turn) => turn,
            Err(last) => return last.unwrap_or(denial),
        };
        self.retry_in_turn(key, cost, denial, deadline, Duration::ZERO, &turn)
            .await
    }

    /// `key`'s turn in its queue (see [`Queues::join`]).
    async fn turn<'a>(
        &'a self,
        key: &'a str,
        deadline: Instant,
    ) -> Result<Turn<'a>, Option<Decision>> {
        self.inner
            .waiters
            .join(key, deadline, self.counters())
            .await
    }

    /// Whether `cost` is above what one of `key`'s quotas can ever admit.
    fn never_admits(&self, key: &str, cost: u64) -> bool {
        let algorithm = self.algorithm();
        let kept = crate::key::local_key(key);
        let key = crate::key::Key {
            given: key,
            kept: &kept,
        };
        (0..self.inner.tiers.len())
            .map(|index| self.inner.lane(key, index).quota)
            .any(|quota| cost > algorithm.max_cost(&quota))
    }

    /// The wait loop of the head of `key`'s queue.
    async fn retry_in_turn(
        &self,
        key: &str,
        cost: u64,
        mut decision: Decision,
        deadline: Instant,
        first_took: Duration,
        turn: &Turn<'_>,
    ) -> Decision {
        let mut slept = turn.waited();
        // How long a check takes here, the slowest seen: a retry that
        // would leave no time for it before the deadline is not waited
        // for, so the answer comes by the deadline. (The slowest, not the
        // last: after a cached denial of a microsecond, the retry may be
        // a check that waits on the store.)
        let mut check_took = first_took;
        loop {
            if decision.is_allowed() {
                return decision;
            }
            let Some(retry) = decision.retry_after() else {
                return decision;
            };
            turn.saw(&decision);
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() || retry.saturating_add(check_took) > left {
                if slept {
                    self.counters().acquire_timeouts.add(1);
                }
                return decision;
            }
            let retry = retry.max(MIN_SLEEP);
            let wake = (now + retry + jitter(retry)).min(deadline);
            self.counters().acquire_waits.add(1);
            slept = true;
            tokio::time::sleep_until(wake).await;
            let began = Instant::now();
            decision = self.check(key, cost).await;
            check_took = check_took.max(began.elapsed());
        }
    }
}

/// The deadline of a wait of `max_wait` from now. No retry is further
/// away than the longest period, so a longer wait is that long: an absurd
/// `max_wait` (`Duration::MAX`) cannot overflow the clock.
fn deadline_after(max_wait: Duration) -> Instant {
    Instant::now() + max_wait.min(MAX_PERIOD)
}

/// How long after a retry time of `retry` to wake: uniform in
/// `[0, min(retry / 10, MAX_JITTER))`.
fn jitter(retry: Duration) -> Duration {
    let span = (retry / 10).min(MAX_JITTER).as_nanos() as u64;
    if span == 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos(next_random() % span)
}

thread_local! {
    /// xorshift64 state, seeded per thread from std's per-process random
    /// keys, so threads and processes draw different sequences.
    static RANDOM: Cell<u64> = Cell::new(
        std::collections::hash_map::RandomState::new().build_hasher().finish() | 1,
    );
}

/// A cheap pseudo-random number: jitter needs spread, not secrecy.
fn next_random() -> u64 {
    RANDOM.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_under_a_tenth_of_the_wait_and_its_cap() {
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
        assert_eq!(jitter(Duration::from_nanos(9)), Duration::ZERO);
        for retry in [
            Duration::from_micros(100),
            Duration::from_millis(50),
            Duration::from_secs(1),
            Duration::from_secs(3600),
        ] {
            let span = (retry / 10).min(MAX_JITTER);
            let draws: Vec<Duration> = (0..1_000).map(|_| jitter(retry)).collect();
            assert!(draws.iter().all(|j| *j < span), "{retry:?}");
            // Spread over the span, not stuck at one end.
            let high = draws.iter().filter(|j| **j >= span / 2).count();
            assert!((350..=650).contains(&high), "{retry:?}: {high} of 1000");
        }
    }

    /// Every waiter leaves its queue, however it ends (admitted, run out,
    /// dropped mid-wait), and the last one takes the queue's entry along.
    #[tokio::test]
    async fn queues_empty_when_their_waiters_leave() {
        use crate::nonzero;
        use crate::quota::Quota;
        use crate::store::MemoryStore;
        let limiter = Limiter::builder(Quota::per_second(nonzero!(1)))
            .store(MemoryStore::new())
            .build()
            .unwrap();
        assert!(limiter.check("k", 1).await.is_allowed());
        let mut waiters = Vec::new();
        for wait in [3_000, 100, 3_000] {
            let limiter = limiter.clone();
            waiters.push(tokio::spawn(async move {
                limiter
                    .acquire("k", 1, Duration::from_millis(wait))
                    .await
                    .is_allowed()
            }));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(limiter.inner.waiters.len(), 1);
        // One dropped while it waits in the queue.
        waiters.pop().unwrap().abort();
        let outcomes: Vec<bool> = futures_util::future::join_all(waiters)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(outcomes, [true, false]);
        assert_eq!(limiter.inner.waiters.len(), 0);
    }

    /// A head that leaves with a waiter queued behind it, and that waiter
    /// dropped before it runs: the key's entry goes with them.
    #[tokio::test]
    async fn a_queue_handed_to_a_dropped_waiter_leaves_no_entry() {
        use crate::nonzero;
        use crate::quota::Quota;
        use crate::store::MemoryStore;
        use futures_util::FutureExt;
        let limiter = Limiter::builder(Quota::per_second(nonzero!(1)))
            .store(MemoryStore::new())
            .build()
            .unwrap();
        for i in 0..100 {
            let key = format!("k{i}");
            assert!(limiter.check(&key, 1).await.is_allowed());
            let mut head = Box::pin(limiter.acquire(&key, 1, Duration::from_secs(3)));
            assert!((&mut head).now_or_never().is_none());
            let mut waiter = Box::pin(limiter.acquire(&key, 1, Duration::from_secs(3)));
            assert!((&mut waiter).now_or_never().is_none());
            drop(head);
            drop(waiter);
        }
        assert_eq!(limiter.inner.waiters.len(), 0);
    }

    #[test]
    fn absurd_waits_do_not_overflow_the_clock() {
        let deadline = deadline_after(Duration::MAX);
        assert!(deadline > Instant::now() + Duration::from_secs(365 * 24 * 3600));
    }
}
