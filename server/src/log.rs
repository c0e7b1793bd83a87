//! What the server says on standard error about trouble that can repeat
//! on every request (a store that does not answer, a request the server
//! cannot honour as sent): at most one line per kind and interval, with
//! how many were held back, so a flood of requests cannot flood the log.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// One kind of line, printed at most once per interval.
#[derive(Debug)]
pub struct Throttled {
    every_ms: u64,
    /// When the next line may be printed (ms since the process began;
    /// 0: at once).
    next_ms: AtomicU64,
    /// Lines held back since the last one printed.
    held: AtomicU64,
}

fn since_start_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

impl Throttled {
    /// A line printed at most once per `every`.
    pub const fn new(every: Duration) -> Throttled {
        Throttled {
            every_ms: every.as_millis() as u64,
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// Holds every line back for an interval from now (after a line of
    /// another kind said the same).
    pub fn hold(&self) {
        self.next_ms
            .store(since_start_ms() + self.every_ms, Ordering::Relaxed);
        self.held.store(0, Ordering::Relaxed);
    }

    /// Prints `line()` (prefixed with the server's name) if none was
    /// printed in the interval, saying how many were held back; else
    /// counts it held back. Returns whether it printed.
    pub fn say(&self, line: impl FnOnce() -> String) -> bool {
        let now = since_start_ms();
        let next = self.next_ms.load(Ordering::Relaxed);
        if now < next
            || self
                .next_ms
                .compare_exchange(
                    next,
                    now + self.every_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            self.held.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let held = self.held.swap(0, Ordering::Relaxed);
        let line = line();
        if held == 0 {
            eprintln!("slicelimit-server: {line}");
        } else {
            eprintln!("slicelimit-server: {line} ({held} more like it held back)");
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_line_within_the_interval_is_held_back_and_counted() {
        let log = Throttled::new(Duration::from_secs(3600));
        assert!(log.say(|| "first".into()));
        assert!(!log.say(|| unreachable!("not formatted when held back")));
        assert_eq!(log.held.load(Ordering::Relaxed), 1);
        let held = Throttled::new(Duration::from_secs(3600));
        held.hold();
        assert!(!held.say(|| unreachable!("held back after `hold`")));
        let every = Throttled::new(Duration::ZERO);
        assert!(every.say(|| "a".into()));
        assert!(every.say(|| "b".into()));
    }
}
