//! The per-request path: find the key, decide, answer or pass through.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use tower::Service;

use super::future::ResponseFuture;
use super::headers::missing_key_problem;
use super::key::{MissingKey, RequestView};
use super::layer::{Prepared, Route};
use crate::Decision;

/// A service rate-limited by a [`RateLimitLayer`](super::RateLimitLayer).
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    config: Arc<Prepared>,
}

impl<S> std::fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit").finish_non_exhaustive()
    }
}

impl<S> RateLimit<S> {
    pub(crate) fn new(inner: S, config: Arc<Prepared>) -> Self {
        RateLimit { inner, config }
    }
}

fn problem_response<B: From<String>>(
    status: StatusCode,
    headers: HeaderMap,
    body: String,
) -> Response<B> {
    let mut response = Response::new(B::from(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// The 429 for a denial.
fn denial<B: From<String>>(route: &Route, decision: &Decision) -> Response<B> {
    let mut headers = HeaderMap::new();
    route.headers.apply(&mut headers, decision);
    problem_response(
        StatusCode::TOO_MANY_REQUESTS,
        headers,
        route.headers.problem(decision),
    )
}

/// Headers for an admitted response; none in shadow mode, which must not
/// change what clients see.
fn admitted_headers(config: &Prepared, route: &Route, decision: &Decision) -> Option<HeaderMap> {
    if config.shadow {
        if !decision.is_allowed() {
            metrics::counter!(crate::metrics::SHADOW_DENIALS, "limiter" => route.name.clone())
                .increment(1);
        }
        return None;
    }
    let mut headers = HeaderMap::new();
    route.headers.apply(&mut headers, decision);
    Some(headers)
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = self.config.clone();
        let view = RequestView {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
        };
        let key = match (config.key.extract(&view), &config.missing) {
            (Some(key), _) => key,
            (None, MissingKey::Shared(shared)) => shared.clone(),
            (None, MissingKey::Reject(status)) => {
                return ResponseFuture::ready(problem_response(
                    *status,
                    HeaderMap::new(),
                    missing_key_problem(*status),
                ));
            }
        };
        let cost = (config.cost)(&view);
        let route = config.route(request.uri().path());
        if let Some(decision) = route.limiter.check_now(&key, cost) {
            if decision.is_allowed() || config.shadow {
                let headers = admitted_headers(&config, route, &decision);
                return ResponseFuture::inner(self.inner.call(request), headers);
            }
            return ResponseFuture::ready(denial(route, &decision));
        }
        // The decision needs the store: take the service that was polled
        // ready, leave a clone in its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::waiting(Box::pin(async move {
            let route = config.route(request.uri().path());
            let decision = route.limiter.check(&key, cost).await;
            if decision.is_allowed() || config.shadow {
                let headers = admitted_headers(&config, route, &decision);
                let mut response = inner.call(request).await?;
                if let Some(headers) = headers {
                    response.headers_mut().extend(headers);
                }
                Ok(response)
            } else {
                Ok(denial(route, &decision))
            }
        }))
    }
}
