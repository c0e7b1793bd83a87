//! The response future of [`RateLimit`](crate::RateLimit).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use slicelimit::Decision;

use crate::body::RateLimitBody;
use crate::prepared::Prepared;

type Boxed<B, E> = Pin<Box<dyn Future<Output = Result<Response<RateLimitBody<B>>, E>> + Send>>;

/// An admitted request's decisions, whose headers go on the inner
/// service's response once it exists (appended to whatever it carries).
pub(crate) struct Admitted {
    pub(crate) config: Arc<Prepared>,
    pub(crate) route: usize,
    pub(crate) decisions: Vec<Decision>,
    /// Each policy's key, for a refund the response may earn (empty when
    /// no response can earn one).
    pub(crate) keys: Vec<String>,
}

impl Admitted {
    /// The inner response with the rate-limit headers added (none when
    /// `admitted` is `None`: shadow mode, unlimited requests).
    pub(crate) fn finish<B>(
        admitted: Option<Admitted>,
        mut response: Response<B>,
    ) -> Response<RateLimitBody<B>> {
        if let Some(a) = admitted {
            a.config
                .append_headers(a.route, &a.decisions, response.headers_mut());
            if a.config.refunds(response.status()) {
                a.config.refund(a.route, &a.keys, &a.decisions);
            }
        }
        response.map(RateLimitBody::inner)
    }
}

pin_project! {
    /// Resolves to the inner service's response (with rate-limit headers)
    /// or to the layer's own answer (429, 503, missing key).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        // Decided locally and admitted: the inner call, then headers.
        Inner { #[pin] future: F, admitted: Option<Admitted> },
        // Answered by the layer.
        Ready { response: Option<Response<RateLimitBody<B>>> },
        // A decision needs the store, or a denial is waited out:
        // decisions and inner call together.
        Waiting { future: Boxed<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn inner(future: F, admitted: Option<Admitted>) -> Self {
        ResponseFuture {
            state: State::Inner { future, admitted },
        }
    }

    pub(crate) fn ready(response: Response<RateLimitBody<B>>) -> Self {
        ResponseFuture {
            state: State::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn waiting(future: Boxed<B, E>) -> Self {
        ResponseFuture {
            state: State::Waiting { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<RateLimitBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { future, admitted } => {
                let result = ready!(future.poll(cx));
                Poll::Ready(result.map(|response| Admitted::finish(admitted.take(), response)))
            }
            StateProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
            StateProj::Waiting { future } => future.as_mut().poll(cx),
        }
    }
}
