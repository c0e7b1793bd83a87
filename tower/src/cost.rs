//! A tower layer for costs known only after the work (an LLM API's
//! tokens): each request reserves an estimate derived from it (admitted
//! or answered `429`), and the reservation settles to the actual cost
//! the response reports — a typed [`ActualCost`] extension or a header —
//! or to what its body's frames cost, charged as they stream and settled
//! when the body ends or is dropped (a client that goes away mid-stream
//! pays for what was sent). See `slicelimit::Reservation` and the
//! library's `docs/costs.md`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use slicelimit::{Limiter, Reservation};
use tower::{Layer, Service};

use crate::body::RateLimitBody;
use crate::headers::PolicyHeaders;
use crate::key::{KeyExtractor, MissingKey, RequestView};
use crate::reject::{Rejection, RejectionKind};

/// The actual cost of a response, put in its extensions by the service
/// behind a [`CostLayer`]: the reservation settles to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActualCost(pub u64);

type Estimate = dyn Fn(&RequestView<'_>) -> u64 + Send + Sync;
type FrameCost = dyn Fn(&Bytes) -> u64 + Send + Sync;

/// Reserves a cost per request and settles it from the response (see the
/// module).
#[derive(Clone)]
pub struct CostLayer {
    config: Arc<Config>,
}

#[derive(Clone)]
struct Config {
    limiter: Limiter,
    key: KeyExtractor,
    missing: MissingKey,
    estimate: Arc<Estimate>,
    header: Option<HeaderName>,
    per_frame: Option<Arc<FrameCost>>,
    /// What a metered response costs before its first frame (its
    /// prompt's tokens).
    base: Option<Arc<Estimate>>,
    stop_when_exhausted: bool,
    policy: PolicyHeaders,
    challenge: HeaderValue,
}

impl std::fmt::Debug for CostLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CostLayer")
            .field("limiter", &self.config.limiter)
            .field("header", &self.config.header)
            .field("per_frame", &self.config.per_frame.is_some())
            .finish()
    }
}

impl CostLayer {
    /// Reserves `estimate(request)` of `limiter`'s budget for the key
    /// `key` extracts. Without [`actual_cost_header`](Self::actual_cost_header),
    /// an [`ActualCost`] extension or [`per_frame`](Self::per_frame), a
    /// response settles at its estimate.
    pub fn new(
        limiter: Limiter,
        key: KeyExtractor,
        estimate: impl Fn(&RequestView<'_>) -> u64 + Send + Sync + 'static,
    ) -> Self {
        let challenge = HeaderValue::from_str(&key.challenge())
            .unwrap_or_else(|_| HeaderValue::from_static("ApiKey"));
        let policy = PolicyHeaders::new(limiter.name(), &limiter.quota());
        CostLayer {
            config: Arc::new(Config {
                limiter,
                key,
                missing: MissingKey::default(),
                estimate: Arc::new(estimate),
                header: None,
                per_frame: None,
                base: None,
                stop_when_exhausted: false,
                policy,
                challenge,
            }),
        }
    }

    /// Settles to the number in this response header, when the response
    /// has one (an [`ActualCost`] extension wins).
    ///
    /// # Errors
    /// `name` is not a valid header name.
    pub fn actual_cost_header(mut self, name: &str) -> Result<Self, slicelimit::Error> {
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|e| {
            slicelimit::Error::new(
                slicelimit::ErrorKind::InvalidInput,
                format!("actual_cost_header {name:?}: {e}"),
            )
        })?;
        Arc::make_mut(&mut self.config).header = Some(name);
        Ok(self)
    }

    /// A response that reports no actual cost is charged per data frame
    /// of its body, `cost(frame)` each, as it streams: within the estimate
    /// nothing more is counted, past it each frame is charged (even past
    /// the limit); the reservation settles to the sum when the body ends
    /// or is dropped.
    #[must_use]
    pub fn per_frame(mut self, cost: impl Fn(&Bytes) -> u64 + Send + Sync + 'static) -> Self {
        Arc::make_mut(&mut self.config).per_frame = Some(Arc::new(cost));
        self
    }

    /// What a metered response costs besides its frames, from the
    /// request (an LLM's prompt tokens): counted first, then each frame's
    /// cost on top (default: nothing).
    #[must_use]
    pub fn base_cost(
        mut self,
        cost: impl Fn(&RequestView<'_>) -> u64 + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.config).base = Some(Arc::new(cost));
        self
    }

    /// Ends a metered body early once the key's budget is gone: when
    /// the frames have cost the estimate plus what the key had left when
    /// it was admitted, or a charge says so (default: the body runs to
    /// its end, and is charged for it).
    #[must_use]
    pub fn stop_when_exhausted(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).stop_when_exhausted = on;
        self
    }

    /// What a request without a key gets (default: 401).
    #[must_use]
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        Arc::make_mut(&mut self.config).missing = missing;
        self
    }
}

impl<S> Layer<S> for CostLayer {
    type Service = Cost<S>;

    fn layer(&self, inner: S) -> Cost<S> {
        Cost {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`CostLayer`] wraps around another.
#[derive(Clone)]
pub struct Cost<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> std::fmt::Debug for Cost<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cost").finish_non_exhaustive()
    }
}

type Answer<B, E> = Result<Response<CostBody<B>>, E>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Cost<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<CostBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Answer<ResBody, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The service made ready is the one called; a fresh clone stays.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        let view = RequestView::new(&request);
        let grpc = crate::service::is_grpc(request.headers());
        let estimate = (config.estimate)(&view);
        let base = config.base.as_ref().map_or(0, |base| base(&view));
        let key = config.key.extract_or(&view, &config.missing);
        Box::pin(async move {
            let key = match key {
                Ok(key) => key,
                Err(status) => {
                    let rejection = Rejection {
                        kind: RejectionKind::MissingKey(status),
                        grpc,
                        violated_policies: Vec::new(),
                        retry_after: None,
                    };
                    return Ok(reject(&config, &rejection, HeaderMap::new()));
                }
            };
            // Dropped with this future (the client went away before the
            // answer), the reservation settles at its estimate.
            let reservation = config.limiter.reserve(&key, estimate).await;
            let mut headers = HeaderMap::new();
            config
                .policy
                .append_to(&mut headers, reservation.decision());
            if !reservation.is_allowed() {
                let decision = reservation.decision();
                let rejection = Rejection {
                    kind: if decision.source() == slicelimit::Source::FailClosed {
                        RejectionKind::Unavailable
                    } else {
                        RejectionKind::QuotaExceeded
                    },
                    grpc,
                    violated_policies: vec![config.policy.name().to_owned()],
                    retry_after: decision.retry_after(),
                };
                return Ok(reject(&config, &rejection, headers));
            }
            let mut response = inner.call(request).await?;
            for (name, value) in &headers {
                response.headers_mut().append(name, value.clone());
            }
            let actual = response
                .extensions()
                .get::<ActualCost>()
                .map(|a| a.0)
                .or_else(|| {
                    let name = config.header.as_ref()?;
                    response
                        .headers()
                        .get(name)?
                        .to_str()
                        .ok()?
                        .trim()
                        .parse()
                        .ok()
                });
            let meter = match (actual, &config.per_frame) {
                (Some(actual), _) => {
                    settle_later(reservation, actual);
                    None
                }
                (None, Some(cost)) => Some(Meter::new(reservation, cost.clone(), base, &config)),
                // Settles at the estimate when the body is done with.
                (None, None) => Some(Meter::flat(reservation)),
            };
            Ok(response.map(|body| CostBody {
                body: RateLimitBody::inner(body),
                meter,
            }))
        })
    }
}

fn reject<B>(config: &Config, rejection: &Rejection, headers: HeaderMap) -> Response<CostBody<B>> {
    let quoted = [config.policy.quoted()];
    let response: Response<Bytes> = rejection.respond(&quoted, headers, &config.challenge);
    response.map(|bytes| CostBody {
        body: RateLimitBody::full(bytes),
        meter: None,
    })
}

/// Settles `reservation` at `actual` in a task of its own (no response
/// waits for it); without a runtime it is dropped, settling at its
/// estimate.
fn settle_later(reservation: Reservation, actual: u64) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            reservation.settle(actual).await;
        });
    }
}

/// A metered body's reservation and what its frames cost so far.
struct Meter {
    /// Shared with the tasks charging frames; taken by the settlement.
    reservation: Arc<tokio::sync::Mutex<Option<Reservation>>>,
    cost: Option<Arc<FrameCost>>,
    /// What the response cost so far: its base, and the frames sent.
    used: u64,
    /// What the key may spend in all: the estimate and what it had left
    /// when admitted (for `stop_when_exhausted`; the charges tell more).
    allowance: u64,
    /// A charge said the key's budget is gone.
    exhausted: Arc<AtomicBool>,
    stop: bool,
    /// A frame was asked for: the body is being sent. Dropped before,
    /// it settles at its estimate (a HEAD answer, a client gone before
    /// the first byte: the work may have been done all the same).
    polled: bool,
    /// Settled (the body ended): nothing more happens on drop.
    done: bool,
}

impl Meter {
    fn new(reservation: Reservation, cost: Arc<FrameCost>, base: u64, config: &Config) -> Self {
        let allowance = reservation
            .estimate()
            .saturating_add(reservation.decision().remaining());
        let mut meter = Meter::flat(reservation);
        meter.cost = Some(cost);
        meter.allowance = allowance;
        meter.stop = config.stop_when_exhausted;
        meter.charge(base);
        meter
    }

    /// A reservation held until the body is done with, then settled at
    /// its estimate.
    fn flat(reservation: Reservation) -> Self {
        Meter {
            reservation: Arc::new(tokio::sync::Mutex::new(Some(reservation))),
            cost: None,
            used: 0,
            allowance: u64::MAX,
            exhausted: Arc::new(AtomicBool::new(false)),
            stop: false,
            polled: false,
            done: false,
        }
    }

    /// Whether the body should end here (`stop_when_exhausted`).
    fn spent(&self) -> bool {
        self.stop && (self.used >= self.allowance || self.exhausted.load(Ordering::Acquire))
    }

    /// A data frame went out: its cost is counted now and charged in a
    /// task of its own.
    fn sent(&mut self, data: &Bytes) {
        if let Some(cost) = &self.cost {
            let n = cost(data);
            self.charge(n);
        }
    }

    /// Counts `n` and charges it in a task of its own.
    fn charge(&mut self, n: u64) {
        if n == 0 {
            return;
        }
        self.used = self.used.saturating_add(n);
        let (reservation, exhausted) = (self.reservation.clone(), self.exhausted.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let mut held = reservation.lock().await;
                if let Some(r) = held.as_mut() {
                    if r.consume(n).await.exhausted() {
                        exhausted.store(true, Ordering::Release);
                    }
                }
            });
        }
    }

    /// The body ended or was dropped: the reservation settles to what the
    /// response cost (at its estimate, for a flat one or a body never
    /// sent), after the charges already sent.
    fn finish(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let reservation = self.reservation.clone();
        let metered = self.cost.is_some() && self.polled;
        let used = self.used;
        let settle = async move {
            if let Some(r) = reservation.lock().await.take() {
                if metered {
                    r.settle(used).await;
                }
                // (Else dropped: it settles at its estimate.)
            }
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(settle);
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.finish();
    }
}

pin_project! {
    /// A response body that charges its reservation as it streams (see
    /// [`CostLayer::per_frame`]) and settles it when it ends or is
    /// dropped.
    pub struct CostBody<B> {
        #[pin]
        body: RateLimitBody<B>,
        meter: Option<Meter>,
    }
}

impl<B> std::fmt::Debug for CostBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CostBody")
            .field("used", &self.meter.as_ref().map(|m| m.used))
            .finish()
    }
}

impl<B> Body for CostBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(meter) = this.meter.as_mut() {
            meter.polled = true;
            if meter.spent() {
                meter.finish();
                return Poll::Ready(None);
            }
        }
        let frame = this.body.poll_frame(cx);
        if let Some(meter) = this.meter.as_mut() {
            match &frame {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        meter.sent(data);
                    }
                }
                Poll::Ready(None | Some(Err(_))) => meter.finish(),
                Poll::Pending => {}
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
