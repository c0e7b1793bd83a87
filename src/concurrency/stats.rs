//! The concurrency limiter's metric names, labelled `limiter`.

use metrics::{describe_counter, describe_gauge, Counter, Gauge, Unit};

/// Permits alive in this process.
pub const IN_FLIGHT: &str = "slicelimit_inflight_requests";
/// Slots this process's hybrid leases hold.
pub const LEASED: &str = "slicelimit_inflight_leased_slots";
/// Slots of leases the store found expired (a holder that stopped
/// renewing: leaked, and now free again), seen by this process's calls.
pub const EXPIRED: &str = "slicelimit_inflight_expired_slots_total";
/// Slots of this process that expired while in use (it could not renew in
/// time): requests running outside the bound.
pub const LOST: &str = "slicelimit_inflight_lost_slots_total";
/// Acquisitions that waited for a slot and got one.
pub const WAITED: &str = "slicelimit_inflight_waits_total";
/// Acquisitions that waited for a slot until their deadline.
pub const TIMEOUTS: &str = "slicelimit_inflight_timeouts_total";
/// Attempts that found no slot.
pub const DENIED: &str = "slicelimit_inflight_denials_total";
/// Permits the failure policy gave while the store could not answer.
pub const FALLBACK: &str = "slicelimit_inflight_fallback_total";
/// Calls to the store's slots script.
pub const STORE_CALLS: &str = "slicelimit_inflight_store_calls_total";

/// A limiter's handles, registered once.
#[derive(Debug, Clone)]
pub(crate) struct Handles {
    pub(crate) in_flight: Gauge,
    pub(crate) leased: Gauge,
    pub(crate) expired: Counter,
    pub(crate) lost: Counter,
    pub(crate) waited: Counter,
    pub(crate) timeouts: Counter,
    pub(crate) denied: Counter,
    pub(crate) fallback: Counter,
    pub(crate) store_calls: Counter,
}

impl Handles {
    pub(crate) fn new(name: &str) -> Self {
        let label = [("limiter", name.to_owned())];
        Handles {
            in_flight: metrics::gauge!(IN_FLIGHT, &label),
            leased: metrics::gauge!(LEASED, &label),
            expired: metrics::counter!(EXPIRED, &label),
            lost: metrics::counter!(LOST, &label),
            waited: metrics::counter!(WAITED, &label),
            timeouts: metrics::counter!(TIMEOUTS, &label),
            denied: metrics::counter!(DENIED, &label),
            fallback: metrics::counter!(FALLBACK, &label),
            store_calls: metrics::counter!(STORE_CALLS, &label),
        }
    }
}

/// Describes the metrics to the installed recorder.
pub(crate) fn describe() {
    describe_gauge!(IN_FLIGHT, "Concurrency permits alive in this process.");
    describe_gauge!(LEASED, "Slots this process's hybrid leases hold.");
    describe_counter!(
        EXPIRED,
        Unit::Count,
        "Slots of leases found expired (a holder that stopped renewing), now free."
    );
    describe_counter!(
        LOST,
        Unit::Count,
        "Slots of this process that expired while in use."
    );
    describe_counter!(
        WAITED,
        Unit::Count,
        "Acquisitions that waited and got a slot."
    );
    describe_counter!(TIMEOUTS, Unit::Count, "Acquisitions that waited in vain.");
    describe_counter!(DENIED, Unit::Count, "Attempts that found no slot.");
    describe_counter!(
        FALLBACK,
        Unit::Count,
        "Permits given by the failure policy while the store could not answer."
    );
    describe_counter!(STORE_CALLS, Unit::Count, "Calls to the slots script.");
}
