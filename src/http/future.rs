//! The response future of [`RateLimit`](super::RateLimit).

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{HeaderMap, Response};
use pin_project_lite::pin_project;

type Boxed<B, E> = Pin<Box<dyn Future<Output = Result<Response<B>, E>> + Send>>;

pin_project! {
    /// Resolves to the inner service's response (with rate-limit headers)
    /// or to the layer's own answer (429, missing key).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        // Decided locally and admitted: the inner call, then headers.
        Inner { #[pin] future: F, headers: Option<HeaderMap> },
        // Answered by the layer.
        Ready { response: Option<Result<Response<B>, E>> },
        // The decision needs the store: decision and inner call together.
        Waiting { future: Boxed<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn inner(future: F, headers: Option<HeaderMap>) -> Self {
        ResponseFuture {
            state: State::Inner { future, headers },
        }
    }

    pub(crate) fn ready(response: Response<B>) -> Self {
        ResponseFuture {
            state: State::Ready {
                response: Some(Ok(response)),
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
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { future, headers } => {
                let result = ready!(future.poll(cx));
                Poll::Ready(result.map(|mut response| {
                    if let Some(headers) = headers.take() {
                        response.headers_mut().extend(headers);
                    }
                    response
                }))
            }
            StateProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(response),
                None => panic!("ResponseFuture polled after completion"),
            },
            StateProj::Waiting { future } => future.as_mut().poll(cx),
        }
    }
}
