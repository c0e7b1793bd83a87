//! The per-request path: find the key, decide, answer or pass through.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use slicelimit::{Decision, Source};
use tower::Service;

use crate::body::RateLimitBody;
use crate::future::{Admitted, ResponseFuture};
use crate::key::{MissingKey, RequestView};
use crate::prepared::Prepared;
use crate::reject::{Rejection, RejectionKind};

/// A service rate-limited by a [`RateLimitLayer`](crate::RateLimitLayer).
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

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// What the layer makes of a request once every policy decided.
pub(crate) enum Verdict {
    /// Call the inner service; add these headers (none in shadow mode).
    Admit(Option<Admitted>),
    /// Answer with this.
    Reject(Response<Bytes>),
}

/// Whether a request is gRPC, so it gets a gRPC status, not an HTTP one.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// Turns one decision per policy into the layer's verdict.
pub(crate) fn conclude(
    config: &Arc<Prepared>,
    route: usize,
    keys: Vec<String>,
    decisions: Vec<Decision>,
    grpc: bool,
) -> Verdict {
    let denied = decisions.iter().any(|d| !d.is_allowed());
    if config.shadow {
        for (policy, decision) in config.policies(route).zip(&decisions) {
            if !decision.is_allowed() {
                policy.limiter.record_shadow_denial();
            }
        }
        return Verdict::Admit(None);
    }
    if !denied {
        return Verdict::Admit(Some(Admitted {
            config: config.clone(),
            route,
            decisions,
            // Kept only where a response may earn a refund.
            keys: if config.refunds_any() {
                keys
            } else {
                Vec::new()
            },
        }));
    }
    // All-or-nothing: what the policies that admitted took goes back.
    config.refund(route, &keys, &decisions);
    // Over quota if any policy denied on its own count; otherwise every
    // denial is a store that could not decide, under fail-closed.
    let over = |d: &Decision| !d.is_allowed() && d.source() != Source::FailClosed;
    let quota_denied = decisions.iter().any(over);
    let violated: Vec<(&str, &str, &Decision)> = config
        .policies(route)
        .zip(&decisions)
        .filter(|(_, d)| {
            if quota_denied {
                over(d)
            } else {
                !d.is_allowed()
            }
        })
        .map(|(p, d)| (p.headers.name(), p.headers.quoted(), d))
        .collect();
    // The request can pass once every violated policy lets it; never if
    // one never will.
    let retry_after = violated
        .iter()
        .map(|(_, _, d)| d.retry_after())
        .try_fold(std::time::Duration::ZERO, |longest, wait| {
            wait.map(|w| longest.max(w))
        });
    let rejection = Rejection {
        kind: if quota_denied {
            RejectionKind::QuotaExceeded
        } else {
            RejectionKind::Unavailable
        },
        grpc,
        violated_policies: violated.iter().map(|(n, _, _)| (*n).to_owned()).collect(),
        retry_after,
    };
    // The headers tell what remains now: the admitting policies' permits
    // went back.
    let shown: Vec<Decision> = decisions.iter().map(|d| d.clone().given_back()).collect();
    let mut headers = HeaderMap::new();
    config.append_headers(route, &shown, &mut headers);
    let quoted: Vec<&str> = violated.iter().map(|(_, q, _)| *q).collect();
    Verdict::Reject(config.reject(&rejection, &quoted, headers, &config.challenge))
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<RateLimitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = self.config.clone();
        let view = RequestView::new(&request);
        if !config.limits(&view) {
            return ResponseFuture::inner(self.inner.call(request), None);
        }
        let grpc = is_grpc(request.headers());
        let route = config.route(request.method(), request.uri().path());
        // `Err`: a key is missing (`Some`: the key of that policy alone).
        let keys = match (config.key.extract(&view), &config.missing) {
            (Some(key), _) => config.keys(route, &view, key).map_err(Some),
            (None, MissingKey::Shared(shared)) => {
                config.keys(route, &view, shared.clone()).map_err(Some)
            }
            (None, MissingKey::Reject(_)) => Err(None),
        };
        let keys = match (keys, &config.missing) {
            (Ok(keys), _) => keys,
            // Dry run: the request passes as it would without the layer;
            // it would have been refused by the policies whose key is
            // missing.
            (Err(missing), _) if config.shadow => {
                for (index, policy) in config.policies(route).enumerate() {
                    if missing.is_none_or(|i| i == index) {
                        policy.limiter.record_shadow_denial();
                    }
                }
                return ResponseFuture::inner(self.inner.call(request), None);
            }
            (Err(missing_index), missing) => {
                let status = match missing {
                    MissingKey::Reject(status) => *status,
                    MissingKey::Shared(_) => http::StatusCode::UNAUTHORIZED,
                };
                let rejection = Rejection {
                    kind: RejectionKind::MissingKey(status),
                    grpc,
                    violated_policies: Vec::new(),
                    retry_after: None,
                };
                let challenge = config.challenge_for(route, missing_index);
                let response = config.reject(&rejection, &[], HeaderMap::new(), &challenge);
                return ResponseFuture::ready(response.map(RateLimitBody::full));
            }
        };
        let cost = config.cost(&view);
        let now: Vec<Option<Decision>> = config
            .policies(route)
            .zip(&keys)
            .map(|(policy, key)| policy.limiter.check_now(key, cost))
            .collect();
        if now.iter().all(Option::is_some) && !config.waits_for(now.iter().flatten()) {
            let decisions = now.into_iter().flatten().collect();
            return match conclude(&config, route, keys, decisions, grpc) {
                Verdict::Admit(admitted) => {
                    ResponseFuture::inner(self.inner.call(request), admitted)
                }
                Verdict::Reject(response) => {
                    ResponseFuture::ready(response.map(RateLimitBody::full))
                }
            };
        }
        // Some decision needs the store, or a denial is to be waited out:
        // take the service that was polled ready, leave a clone in its
        // place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::waiting(Box::pin(async move {
            let began = tokio::time::Instant::now();
            // Dropped before the verdict (the client hung up, a timeout),
            // what the policies took so far goes back: all-or-nothing.
            let mut held = Held {
                config: &config,
                route,
                keys: &keys,
                decisions: Vec::with_capacity(now.len()),
            };
            for ((policy, decided), key) in config.policies(route).zip(now).zip(&keys) {
                let decision = match decided {
                    Some(decision) => decision,
                    None => policy.limiter.check(key, cost).await,
                };
                held.decisions.push(decision);
            }
            if config.waits_for(&held.decisions) {
                config
                    .wait_out(route, &keys, cost, began, &mut held.decisions)
                    .await;
            }
            let decisions = std::mem::take(&mut held.decisions);
            drop(held);
            match conclude(&config, route, keys, decisions, grpc) {
                Verdict::Admit(admitted) => {
                    let response = inner.call(request).await?;
                    Ok(Admitted::finish(admitted, response))
                }
                Verdict::Reject(response) => Ok(response.map(RateLimitBody::full)),
            }
        }))
    }
}

/// The decisions of a request not concluded yet; dropped with them (the
/// request's future dropped mid-decision), it refunds what they took.
struct Held<'a> {
    config: &'a Prepared,
    route: usize,
    keys: &'a [String],
    decisions: Vec<Decision>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if !self.decisions.is_empty() {
            self.config.refund(self.route, self.keys, &self.decisions);
        }
    }
}
