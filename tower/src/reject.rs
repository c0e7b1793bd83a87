//! The layer's own answers: 429 over quota, 503 when the limiter cannot
//! decide and fails closed, the configured status for a request without a
//! key — as problem+json for HTTP clients, as a trailers-only response
//! with a `grpc-status` for gRPC clients — then the user's hook, if any.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use crate::headers::{in_flight_problem, missing_key_problem, quota_problem, unavailable_problem};

/// Why the layer answered a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectionKind {
    /// One or more policies are over quota: 429, gRPC `RESOURCE_EXHAUSTED`.
    QuotaExceeded,
    /// The limiter could not decide and its failure policy is to fail
    /// closed: 503, gRPC `UNAVAILABLE`.
    Unavailable,
    /// The request has no key and the layer rejects such requests with
    /// this status (gRPC: `UNAUTHENTICATED` for 401, `PERMISSION_DENIED`
    /// for 403, `INVALID_ARGUMENT` for 400).
    MissingKey(StatusCode),
    /// Every slot of the key is in flight ([`InFlightLayer`](crate::InFlightLayer)):
    /// 429, gRPC `RESOURCE_EXHAUSTED`.
    TooManyInFlight,
}

/// What the layer knows about a request it answers itself; handed to the
/// hook set with [`RateLimitLayer::on_reject`](crate::RateLimitLayer::on_reject).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    /// Why.
    pub kind: RejectionKind,
    /// Whether the request is gRPC (`content-type: application/grpc...`),
    /// answered trailers-only.
    pub grpc: bool,
    /// The names of every policy that denied the request.
    pub violated_policies: Vec<String>,
    /// How long to wait before retrying; `None` if unknown or never.
    pub retry_after: Option<Duration>,
}

impl Rejection {
    /// The HTTP status of the default answer (a gRPC answer is sent with
    /// 200 and this status mapped to a `grpc-status`).
    pub fn status(&self) -> StatusCode {
        match self.kind {
            RejectionKind::QuotaExceeded | RejectionKind::TooManyInFlight => {
                StatusCode::TOO_MANY_REQUESTS
            }
            RejectionKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            RejectionKind::MissingKey(status) => status,
        }
    }

    /// The gRPC status code of the default gRPC answer.
    pub fn grpc_status(&self) -> u16 {
        match self.status() {
            StatusCode::TOO_MANY_REQUESTS => 8,
            StatusCode::SERVICE_UNAVAILABLE => 14,
            StatusCode::UNAUTHORIZED => 16,
            StatusCode::FORBIDDEN => 7,
            StatusCode::BAD_REQUEST => 3,
            _ => 2,
        }
    }

    fn retry_secs(&self) -> Option<u64> {
        self.retry_after
            .map(|wait| crate::headers::ceil_secs(wait).max(1))
    }

    fn message(&self) -> String {
        let retry = match self.retry_secs() {
            Some(secs) => format!("; retry in {secs} s"),
            None => String::new(),
        };
        match self.kind {
            RejectionKind::QuotaExceeded => format!(
                "rate limit exceeded: {}{retry}",
                self.violated_policies.join(", ")
            ),
            RejectionKind::Unavailable => {
                format!("the rate limiter cannot decide{retry}")
            }
            RejectionKind::MissingKey(_) => "no rate-limit key in the request".to_owned(),
            RejectionKind::TooManyInFlight => {
                format!("too many requests in flight for this key{retry}")
            }
        }
    }

    /// The default answer: rate-limit `headers` plus a problem+json body,
    /// or a gRPC trailers-only response.
    pub(crate) fn respond(
        &self,
        quoted: &[&str],
        mut headers: HeaderMap,
        challenge: &HeaderValue,
    ) -> Response<Bytes> {
        let status = self.status();
        let mut response = if self.grpc {
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            headers.insert("grpc-status", HeaderValue::from(self.grpc_status()));
            if let Ok(message) = HeaderValue::from_str(&grpc_message(&self.message())) {
                headers.insert("grpc-message", message);
            }
            Response::new(Bytes::new())
        } else {
            let body = match self.kind {
                RejectionKind::QuotaExceeded => {
                    quota_problem(quoted.iter().copied(), self.retry_secs())
                }
                RejectionKind::Unavailable => {
                    unavailable_problem(quoted.iter().copied(), self.retry_secs())
                }
                RejectionKind::MissingKey(status) => missing_key_problem(status),
                RejectionKind::TooManyInFlight => in_flight_problem(self.retry_secs()),
            };
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
            if status == StatusCode::UNAUTHORIZED {
                // RFC 9110 §15.5.2: a 401 carries a challenge.
                headers.insert(http::header::WWW_AUTHENTICATE, challenge.clone());
            }
            let mut response = Response::new(Bytes::from(body));
            *response.status_mut() = status;
            response
        };
        *response.headers_mut() = headers;
        response
    }
}

/// Percent-encodes what `grpc-message` cannot carry as it is.
fn grpc_message(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for &byte in raw.as_bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(grpc_message("50% é"), "50%25 %C3%A9");
    }
}
