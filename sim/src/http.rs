//! For the HTTP layer's tests: exact fixed windows on the embedded store
//! under a fake clock, limiters whose store never answers, and the
//! `RateLimit` fields parsed with a third-party Structured Fields parser.

use std::num::NonZeroU32;
use std::time::Duration;

use sfv::{BareItem, ListEntry, Parser};

use crate::faults::{Faults, FaultyStore};
use slicelimit::{clock::FakeClock, nonzero, FailurePolicy, Limiter, MemoryStore, Quota};

/// A whole minute, so per-minute windows start here.
pub const ORIGIN: Duration = Duration::from_secs(1_700_000_040);

/// An exact limiter of `limit` per minute on its own embedded store, its
/// clock `into` the first window; in `namespace` if given.
pub fn per_minute(limit: u32, into: Duration, namespace: Option<&str>) -> Limiter {
    let clock = FakeClock::new(ORIGIN + into);
    let limit = NonZeroU32::new(limit).expect("a limit of at least 1");
    let builder = Limiter::builder(Quota::per_minute(limit))
        .store(MemoryStore::with_clock(clock.clone()))
        .clock(clock);
    match namespace {
        Some(namespace) => builder.namespace(namespace),
        None => builder,
    }
    .build()
    .unwrap()
}

/// A limiter of 10 per minute whose store never answers, so `policy`
/// decides every request.
pub fn unavailable(policy: FailurePolicy) -> Limiter {
    let clock = FakeClock::new(ORIGIN);
    let faults = Faults {
        lost_before: 1.0,
        ..Faults::default()
    };
    let store = FaultyStore::new(
        MemoryStore::with_clock(clock.clone()),
        faults,
        1,
        clock.clone(),
    );
    Limiter::builder(Quota::per_minute(nonzero!(10)))
        .store(store)
        .clock(clock)
        .on_store_error(policy)
        .build()
        .unwrap()
}

/// One list item: the policy name and its integer parameters.
pub type Item = (String, Vec<(String, i64)>);

/// Parses the lines of the list field `name` as one list (as RFC 9651
/// combines them); every item must be an sf-string with integer params.
pub fn sf_items<'a>(name: &str, lines: impl Iterator<Item = &'a str>) -> Vec<Item> {
    let joined = lines.collect::<Vec<_>>().join(", ");
    if joined.is_empty() {
        return Vec::new();
    }
    let list = Parser::parse_list(joined.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
    list.iter()
        .map(|entry| {
            let ListEntry::Item(item) = entry else {
                panic!("{name}: an inner list")
            };
            let BareItem::String(policy) = &item.bare_item else {
                panic!(
                    "{name}: the item must be an sf-string, got {:?}",
                    item.bare_item
                )
            };
            let params = item
                .params
                .iter()
                .map(|(k, v)| match v {
                    BareItem::Integer(n) => (k.clone(), *n),
                    other => panic!("{name}: {k} is not an integer: {other:?}"),
                })
                .collect();
            (policy.clone(), params)
        })
        .collect()
}
