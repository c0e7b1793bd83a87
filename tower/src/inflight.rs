//! A tower layer that limits requests in flight per key with a
//! [`ConcurrencyLimiter`]: the key is extracted as for the rate limit;
//! a request with no free slot is answered `429` with `Retry-After` (gRPC:
//! `RESOURCE_EXHAUSTED`), after waiting up to a bound if configured; the
//! slot is held until the response body has been sent or dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use slicelimit::{concurrency::AcquireError, concurrency::SlotPermit, ConcurrencyLimiter};
use tower::{Layer, Service};

use crate::body::RateLimitBody;
use crate::headers::ceil_secs;
use crate::key::{KeyExtractor, MissingKey, RequestView};
use crate::reject::{Rejection, RejectionKind};

/// Limits requests in flight per key (see the module).
#[derive(Debug, Clone)]
pub struct InFlightLayer {
    config: Arc<Config>,
}

#[derive(Debug)]
struct Config {
    limiter: ConcurrencyLimiter,
    key: KeyExtractor,
    missing: MissingKey,
    wait: Duration,
    challenge: HeaderValue,
}

impl InFlightLayer {
    /// At most `limiter.max()` requests in flight per key `key` extracts.
    pub fn new(limiter: ConcurrencyLimiter, key: KeyExtractor) -> Self {
        let challenge = HeaderValue::from_str(&key.challenge())
            .unwrap_or_else(|_| HeaderValue::from_static("ApiKey"));
        InFlightLayer {
            config: Arc::new(Config {
                limiter,
                key,
                missing: MissingKey::default(),
                wait: Duration::ZERO,
                challenge,
            }),
        }
    }

    /// Waits up to `wait` for a slot before answering 429 (default: no
    /// wait).
    #[must_use]
    pub fn wait_up_to(mut self, wait: Duration) -> Self {
        Arc::make_mut(&mut self.config).wait = wait;
        self
    }

    /// What a request without a key gets (default: 401).
    #[must_use]
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        Arc::make_mut(&mut self.config).missing = missing;
        self
    }
}

impl Clone for Config {
    fn clone(&self) -> Self {
        Config {
            limiter: self.limiter.clone(),
            key: self.key.clone(),
            missing: self.missing.clone(),
            wait: self.wait,
            challenge: self.challenge.clone(),
        }
    }
}

impl<S> Layer<S> for InFlightLayer {
    type Service = InFlight<S>;

    fn layer(&self, inner: S) -> InFlight<S> {
        InFlight {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`InFlightLayer`] wraps around another.
#[derive(Debug, Clone)]
pub struct InFlight<S> {
    inner: S,
    config: Arc<Config>,
}

/// What [`InFlight`]'s future resolves to.
type Answer<B, E> = Result<Response<InFlightBody<B>>, E>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for InFlight<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<InFlightBody<ResBody>>;
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
        let grpc = crate::service::is_grpc(request.headers());
        let key = config
            .key
            .extract_or(&RequestView::new(&request), &config.missing);
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
                    return Ok(reject(&rejection, &config.challenge));
                }
            };
            let acquired = if config.wait.is_zero() {
                config.limiter.try_acquire(&key).await
            } else {
                config.limiter.acquire(&key, config.wait).await
            };
            let permit = match acquired {
                Ok(permit) => permit,
                Err(error) => {
                    let rejection = Rejection {
                        kind: match error {
                            AcquireError::Full { .. } => RejectionKind::TooManyInFlight,
                            _ => RejectionKind::Unavailable,
                        },
                        grpc,
                        violated_policies: Vec::new(),
                        retry_after: Some(error.retry_after().unwrap_or(Duration::from_secs(1))),
                    };
                    return Ok(reject(&rejection, &config.challenge));
                }
            };
            // Dropped with this future (the client went away), the permit
            // is released with it.
            let response = inner.call(request).await?;
            Ok(response.map(|body| InFlightBody {
                body: RateLimitBody::inner(body),
                permit: Some(permit),
            }))
        })
    }
}

fn reject<B>(rejection: &Rejection, challenge: &HeaderValue) -> Response<InFlightBody<B>> {
    let mut headers = HeaderMap::new();
    if let Some(wait) = rejection.retry_after {
        headers.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from(ceil_secs(wait).max(1)),
        );
    }
    let response: Response<Bytes> = rejection.respond(&[], headers, challenge);
    response.map(|bytes| InFlightBody {
        body: RateLimitBody::full(bytes),
        permit: None,
    })
}

pin_project! {
    /// A response body that holds its request's slot until it has been
    /// sent to the end, or dropped.
    pub struct InFlightBody<B> {
        #[pin]
        body: RateLimitBody<B>,
        permit: Option<SlotPermit>,
    }
}

impl<B> std::fmt::Debug for InFlightBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightBody")
            .field("holds_slot", &self.permit.is_some())
            .finish()
    }
}

impl<B> Body for InFlightBody<B>
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
        let frame = this.body.poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = &frame {
            this.permit.take();
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
