//! Which key a request counts against, and what it costs.

use std::fmt;
use std::sync::Arc;

use http::{Extensions, HeaderMap, Method, Uri};

use crate::ip::ClientIp;

/// The parts of a request an extractor may look at.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RequestView<'a> {
    /// The request method.
    pub method: &'a Method,
    /// The request URI.
    pub uri: &'a Uri,
    /// The request headers.
    pub headers: &'a HeaderMap,
    /// The request extensions (connection info lives here).
    pub extensions: &'a Extensions,
}

impl<'a> RequestView<'a> {
    /// The view of `request`.
    pub fn new<B>(request: &'a http::Request<B>) -> Self {
        RequestView {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
        }
    }
}

type KeyFn = dyn Fn(&RequestView<'_>) -> Option<String> + Send + Sync;

/// Finds the rate-limit key of a request.
#[derive(Clone)]
pub struct KeyExtractor {
    extract: Arc<KeyFn>,
    describe: &'static str,
    /// The header read, named in the 401's challenge.
    header: Option<http::HeaderName>,
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeyExtractor").field(&self.describe).finish()
    }
}

impl KeyExtractor {
    /// The value of a header, such as `x-api-key`; the name may come from
    /// configuration (any case). A missing or empty header (or one that is
    /// not visible ASCII) is a missing key.
    ///
    /// # Panics
    /// If `name` is not a valid header name; see
    /// [`try_header`](KeyExtractor::try_header) for names read at run time.
    pub fn header(name: &str) -> Self {
        KeyExtractor::try_header(name).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`header`](KeyExtractor::header), for a name known only at run
    /// time.
    ///
    /// # Errors
    /// An [`InvalidInput`](slicelimit::ErrorKind::InvalidInput) error if `name`
    /// is not a valid header name.
    pub fn try_header(name: &str) -> Result<Self, slicelimit::Error> {
        let name = http::HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
            slicelimit::Error::invalid(format!("{name:?} is not a valid HTTP header name"))
        })?;
        let read = name.clone();
        Ok(KeyExtractor {
            extract: Arc::new(move |r: &RequestView<'_>| {
                r.headers
                    .get(&read)
                    .and_then(|v| v.to_str().ok())
                    .map(str::trim)
                    .filter(|v| !v.is_empty())
                    .map(str::to_owned)
            }),
            describe: "header",
            header: Some(name),
        })
    }

    /// The client's IP address as the connection reports it (axum's
    /// `ConnectInfo<SocketAddr>` with the `axum` feature, tonic's
    /// `TcpConnectInfo` with the `tonic` feature, or a `SocketAddr` /
    /// `IpAddr` extension); forwarding headers are ignored. IPv6 clients
    /// are keyed per /64. See [`ip`](KeyExtractor::ip) for clients behind
    /// proxies.
    pub fn client_ip() -> Self {
        KeyExtractor::ip(ClientIp::peer())
    }

    /// The client's IP address behind exactly `hops` proxies, from
    /// `X-Forwarded-For` (see [`ClientIp::hops`]). `forwarded_for(0)`
    /// ignores the header. Prefer [`ip`](KeyExtractor::ip) with
    /// [`ClientIp::behind`], which checks the proxies' addresses.
    pub fn forwarded_for(hops: usize) -> Self {
        KeyExtractor::ip(ClientIp::hops(hops))
    }

    /// The client's IP address (or network) found as `ip` says.
    pub fn ip(ip: ClientIp) -> Self {
        KeyExtractor {
            extract: Arc::new(move |r: &RequestView<'_>| ip.key(r)),
            describe: "ip",
            header: None,
        }
    }

    /// Any function of the request; `None` is a missing key.
    pub fn from_fn(f: impl Fn(&RequestView<'_>) -> Option<String> + Send + Sync + 'static) -> Self {
        KeyExtractor {
            extract: Arc::new(f),
            describe: "custom",
            header: None,
        }
    }

    pub(crate) fn extract(&self, request: &RequestView<'_>) -> Option<String> {
        (self.extract)(request)
    }

    /// The request's key, or, for a request without one, the shared key
    /// `missing` names, or the status to answer it with.
    pub(crate) fn extract_or(
        &self,
        request: &RequestView<'_>,
        missing: &MissingKey,
    ) -> Result<String, http::StatusCode> {
        match (self.extract(request), missing) {
            (Some(key), _) => Ok(key),
            (None, MissingKey::Shared(shared)) => Ok(shared.clone()),
            (None, MissingKey::Reject(status)) => Err(*status),
        }
    }

    /// The `WWW-Authenticate` challenge of a 401 for a request without
    /// this key.
    pub(crate) fn challenge(&self) -> String {
        match &self.header {
            Some(name) => format!("ApiKey header=\"{}\"", name.as_str()),
            None => "ApiKey".to_owned(),
        }
    }
}

/// What to do with a request that has no key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer with this status (for instance 400 or 401) and a problem body;
    /// the inner service is not called.
    Reject(http::StatusCode),
    /// Count the request against this one shared key.
    Shared(String),
}

impl Default for MissingKey {
    fn default() -> Self {
        MissingKey::Reject(http::StatusCode::UNAUTHORIZED)
    }
}
