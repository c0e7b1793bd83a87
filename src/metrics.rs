//! Metric names, recording, and the one-call Prometheus exporter.
//!
//! Everything goes through the `metrics` facade, so any recorder works.
//! Labels are the limiter's name, the decision's outcome and source, and
//! an error's kind — never a user key, so cardinality stays fixed. Handles
//! are registered once per limiter when it is built: install a recorder
//! (for instance with `install_prometheus`, feature `prometheus`) before
//! building limiters.

use metrics::{
    describe_counter, describe_gauge, describe_histogram, Counter, Gauge, Histogram, Unit,
};

use crate::breaker::CircuitState;
use crate::decision::Source;
#[cfg(feature = "prometheus")]
use crate::error::Error;
use crate::error::ErrorKind;

/// Decisions, labelled `limiter`, `outcome` (`allowed` / `denied`) and `source`.
pub const DECISIONS: &str = "slicelimit_decisions_total";
/// Permits admitted beyond what the store granted (optimistic credit the
/// store could not cover, fallback admissions it could not absorb).
pub const OVERSHOOT: &str = "slicelimit_overshoot_permits_total";
/// Leased permits that expired unused and could not be given back.
pub const STRANDED: &str = "slicelimit_stranded_permits_total";
/// Leased permits given back unused.
pub const GIVEN_BACK: &str = "slicelimit_given_back_permits_total";
/// Lease calls sent (wanting at least one permit).
pub const LEASES_REQUESTED: &str = "slicelimit_leases_requested_total";
/// Lease calls that granted at least one permit.
pub const LEASES_GRANTED: &str = "slicelimit_leases_granted_total";
/// Permits granted per lease.
pub const LEASE_SIZE: &str = "slicelimit_lease_size_permits";
/// Round trips to the store: pipelines and single calls sent (on a
/// cluster, a batch is one pipeline per hash slot).
pub const ROUND_TRIPS: &str = "slicelimit_store_round_trips_total";
/// Script calls sent to the store, each once whether alone or pipelined.
pub const STORE_CALLS: &str = "slicelimit_store_calls_total";
/// Store round-trip latency.
pub const STORE_LATENCY: &str = "slicelimit_store_latency_seconds";
/// Store errors, labelled `kind`.
pub const STORE_ERRORS: &str = "slicelimit_store_errors_total";
/// The store's circuit breaker: 0 closed, 1 half open, 2 open.
pub const CIRCUIT_STATE: &str = "slicelimit_circuit_state";
/// Keys tracked in the local map.
pub const LOCAL_KEYS: &str = "slicelimit_local_keys";
/// Permits admitted by the local fallback while the store was unavailable.
pub const FALLBACK_ADMISSIONS: &str = "slicelimit_fallback_admissions_total";
/// Permits admitted on credit (optimistic mode).
pub const CREDIT: &str = "slicelimit_credit_permits_total";
/// Fallback admissions reported to the store after an outage.
pub const RECONCILED: &str = "slicelimit_reconciled_permits_total";
/// Permits of debt or reconciliation reports the store refused for good
/// (e.g. a key of the wrong type), or that found the reconciliation ledger
/// full: dropped rather than retried forever or held without bound.
pub const REPORTS_DROPPED: &str = "slicelimit_dropped_report_permits_total";
/// Times a hybrid limiter's background task was found gone and restarted.
pub const SYNC_RESTARTS: &str = "slicelimit_sync_restarts_total";
/// Requests the HTTP layer let through in shadow mode although denied.
pub const SHADOW_DENIALS: &str = "slicelimit_http_shadow_denials_total";
/// Permits refunds gave back to the window they were taken from.
pub const REFUNDED: &str = "slicelimit_refunded_permits_total";
/// Permits refunds could not give back (their window had ended).
pub const REFUNDS_IGNORED: &str = "slicelimit_refunds_ignored_permits_total";
/// Permits counted by `Limiter::charge` and reservations settled past
/// their estimate, whatever was left.
pub const CHARGED: &str = "slicelimit_charged_permits_total";
/// Sleeps `Limiter::acquire` took before asking again.
pub const ACQUIRE_WAITS: &str = "slicelimit_acquire_waits_total";
/// `Limiter::acquire` calls that slept and were still denied when their
/// wait ran out.
pub const ACQUIRE_TIMEOUTS: &str = "slicelimit_acquire_timeouts_total";

/// Registers a description and unit for every metric above with the
/// installed recorder. `install_prometheus` (feature `prometheus`) calls it
/// for you.
pub fn describe() {
    crate::concurrency::stats::describe();
    describe_counter!(
        DECISIONS,
        Unit::Count,
        "Rate-limit decisions by outcome and source."
    );
    describe_counter!(
        OVERSHOOT,
        Unit::Count,
        "Permits admitted beyond what the store granted (uncovered credit or fallback admissions)."
    );
    describe_counter!(
        STRANDED,
        Unit::Count,
        "Leased permits that expired unused and could not be given back."
    );
    describe_counter!(
        GIVEN_BACK,
        Unit::Count,
        "Leased permits given back to the store unused."
    );
    describe_counter!(
        LEASES_REQUESTED,
        Unit::Count,
        "Lease calls sent to the store."
    );
    describe_counter!(
        LEASES_GRANTED,
        Unit::Count,
        "Lease calls that granted at least one permit."
    );
    describe_histogram!(LEASE_SIZE, Unit::Count, "Permits granted per lease.");
    describe_counter!(
        ROUND_TRIPS,
        Unit::Count,
        "Round trips to the store: pipelines and single calls sent."
    );
    describe_counter!(
        STORE_CALLS,
        Unit::Count,
        "Script calls sent to the store, pipelined or not."
    );
    describe_histogram!(STORE_LATENCY, Unit::Seconds, "Store round-trip latency.");
    describe_counter!(STORE_ERRORS, Unit::Count, "Store errors by kind.");
    describe_counter!(
        SYNC_RESTARTS,
        Unit::Count,
        "Times a hybrid limiter's background task was found gone and restarted."
    );
    describe_counter!(
        REPORTS_DROPPED,
        Unit::Count,
        "Permits of debt or reconciliation reports the store refused for good."
    );
    describe_gauge!(
        CIRCUIT_STATE,
        "Circuit breaker state: 0 closed, 1 half open, 2 open."
    );
    describe_gauge!(LOCAL_KEYS, Unit::Count, "Keys tracked in the local map.");
    describe_counter!(
        FALLBACK_ADMISSIONS,
        Unit::Count,
        "Permits admitted by the local fallback while the store was unavailable."
    );
    describe_counter!(
        CREDIT,
        Unit::Count,
        "Permits admitted on credit while a refill was in flight."
    );
    describe_counter!(
        RECONCILED,
        Unit::Count,
        "Permits reported to the store after the fact: fallback admissions after an outage, and charges."
    );
    describe_counter!(
        SHADOW_DENIALS,
        Unit::Count,
        "Denied requests let through by the HTTP layer in shadow mode."
    );
    describe_counter!(
        REFUNDED,
        Unit::Count,
        "Permits refunds gave back to the window they were taken from."
    );
    describe_counter!(
        REFUNDS_IGNORED,
        Unit::Count,
        "Permits refunds could not give back: their window had ended."
    );
    describe_counter!(
        CHARGED,
        Unit::Count,
        "Permits counted by charges (costs known after the work), whatever was left."
    );
    describe_counter!(
        ACQUIRE_WAITS,
        Unit::Count,
        "Sleeps acquire took before asking again."
    );
    describe_counter!(
        ACQUIRE_TIMEOUTS,
        Unit::Count,
        "Acquire calls that slept and were still denied when their wait ran out."
    );
}

/// The Prometheus recorder [`install_prometheus`] installed: renders the
/// exposition its HTTP listener serves, on demand (for a scrape endpoint of
/// your own, or a test).
#[cfg(feature = "prometheus")]
#[derive(Clone)]
pub struct PrometheusExporter {
    handle: metrics_exporter_prometheus::PrometheusHandle,
}

#[cfg(feature = "prometheus")]
impl PrometheusExporter {
    /// Every metric recorded so far, in the Prometheus text format.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Drains histogram samples into their buckets; needed only with
    /// [`install_prometheus_recorder`] (the listener of
    /// [`install_prometheus`] does it itself).
    pub fn run_upkeep(&self) {
        self.handle.run_upkeep();
    }
}

#[cfg(feature = "prometheus")]
impl std::fmt::Debug for PrometheusExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrometheusExporter").finish_non_exhaustive()
    }
}

/// Installs a Prometheus recorder as the global `metrics` recorder, serves
/// its exposition on `addr` (any path) from the current Tokio runtime, and
/// describes every slicelimit metric. Call it once per process, before
/// building limiters. The returned exporter renders the same text on demand.
/// Feature `prometheus`.
///
/// # Errors
/// [`Io`](ErrorKind::Io) if the address cannot be bound (in use by
/// another process: give each process on a host its own port);
/// [`InvalidInput`](ErrorKind::InvalidInput) if called outside a Tokio
/// runtime or if a global recorder is already installed.
#[cfg(feature = "prometheus")]
pub fn install_prometheus(addr: std::net::SocketAddr) -> Result<PrometheusExporter, Error> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| Error::invalid("install_prometheus must be called inside a Tokio runtime"))?;
    // The exporter reports a busy port as a build error of its own; bind
    // first to say what happened.
    drop(std::net::TcpListener::bind(addr).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot serve metrics on {addr}: {e} (is another process using it?)"),
        )
        .caused_by(e)
    })?);
    let (recorder, exporter) = {
        let _guard = runtime.enter();
        prometheus_builder()?
            .with_http_listener(addr)
            .build()
            .map_err(prometheus_error)?
    };
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(prometheus_error)?;
    runtime.spawn(exporter);
    describe();
    Ok(PrometheusExporter { handle })
}

/// Installs a Prometheus recorder as the global `metrics` recorder
/// without serving it: for a process that serves
/// [`render`](PrometheusExporter::render) on an endpoint of its own
/// (as `slicelimit-server` does). Call
/// [`run_upkeep`](PrometheusExporter::run_upkeep) every few seconds.
/// Feature `prometheus`.
///
/// # Errors
/// [`InvalidInput`](ErrorKind::InvalidInput) if a global recorder is
/// already installed.
#[cfg(feature = "prometheus")]
pub fn install_prometheus_recorder() -> Result<PrometheusExporter, Error> {
    let recorder = prometheus_builder()?.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(prometheus_error)?;
    describe();
    Ok(PrometheusExporter { handle })
}

#[cfg(feature = "prometheus")]
fn prometheus_error(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::new(ErrorKind::InvalidInput, format!("Prometheus exporter: {e}")).caused_by(e)
}

/// The exporter with slicelimit's histogram buckets.
#[cfg(feature = "prometheus")]
fn prometheus_builder() -> Result<metrics_exporter_prometheus::PrometheusBuilder, Error> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

    let latency = [
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        1.0,
    ];
    let sizes = [
        1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 10_000.0, 100_000.0,
    ];
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(STORE_LATENCY.to_owned()), &latency)
        .map_err(prometheus_error)?
        .set_buckets_for_metric(Matcher::Full(LEASE_SIZE.to_owned()), &sizes)
        .map_err(prometheus_error)
}

const SOURCES: [Source; 8] = [
    Source::Store,
    Source::Lease,
    Source::Credit,
    Source::DeniedCache,
    Source::Local,
    Source::FailOpen,
    Source::FailClosed,
    Source::Fallback,
];

const KINDS: [ErrorKind; 8] = [
    ErrorKind::InvalidInput,
    ErrorKind::Timeout,
    ErrorKind::Connection,
    ErrorKind::WrongType,
    ErrorKind::Store,
    ErrorKind::CircuitOpen,
    ErrorKind::Unsupported,
    ErrorKind::Io,
];

#[inline]
fn source_index(source: Source) -> usize {
    SOURCES.iter().position(|s| *s == source).unwrap_or(0)
}

/// One limiter's metric handles, registered once.
pub(crate) struct Meters {
    /// [0 allowed, 1 denied][source]
    decisions: [[Counter; SOURCES.len()]; 2],
    errors: [Counter; KINDS.len()],
    pub(crate) lease_size: Histogram,
    pub(crate) store_latency: Histogram,
    circuit: Gauge,
    pub(crate) local_keys: Gauge,
}

impl Meters {
    pub(crate) fn new(limiter: &str) -> Self {
        let name = limiter.to_owned();
        let decision = |allowed: bool, source: Source| {
            metrics::counter!(
                DECISIONS,
                "limiter" => name.clone(),
                "outcome" => if allowed { "allowed" } else { "denied" },
                "source" => source.as_str()
            )
        };
        Meters {
            decisions: [SOURCES.map(|s| decision(true, s)), SOURCES.map(|s| decision(false, s))],
            errors: KINDS.map(|k| metrics::counter!(STORE_ERRORS, "limiter" => name.clone(), "kind" => k.as_str())),
            lease_size: metrics::histogram!(LEASE_SIZE, "limiter" => name.clone()),
            store_latency: metrics::histogram!(STORE_LATENCY, "limiter" => name.clone()),
            circuit: metrics::gauge!(CIRCUIT_STATE, "limiter" => name.clone()),
            local_keys: metrics::gauge!(LOCAL_KEYS, "limiter" => name),
        }
    }

    /// A counter handle for one of the per-limiter totals.
    pub(crate) fn counter(limiter: &str, metric: &'static str) -> Counter {
        metrics::counter!(metric, "limiter" => limiter.to_owned())
    }

    #[inline]
    pub(crate) fn decision(&self, allowed: bool, source: Source) {
        self.decisions[usize::from(!allowed)][source_index(source)].increment(1);
    }

    pub(crate) fn error(&self, kind: ErrorKind) {
        let i = KINDS.iter().position(|k| *k == kind).unwrap_or(0);
        self.errors[i].increment(1);
    }

    pub(crate) fn circuit(&self, state: CircuitState) {
        self.circuit.set(match state {
            CircuitState::Closed => 0.0,
            CircuitState::HalfOpen => 1.0,
            CircuitState::Open => 2.0,
        });
    }
}
