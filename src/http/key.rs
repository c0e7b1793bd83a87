//! Which key a request counts against, and what it costs.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::{Extensions, HeaderMap, Method, Uri};

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

type KeyFn = dyn Fn(&RequestView<'_>) -> Option<String> + Send + Sync;

/// Finds the rate-limit key of a request.
#[derive(Clone)]
pub struct KeyExtractor {
    extract: Arc<KeyFn>,
    describe: &'static str,
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeyExtractor").field(&self.describe).finish()
    }
}

impl KeyExtractor {
    /// The value of a header, such as `x-api-key`. A missing or empty
    /// header (or one that is not visible ASCII) is a missing key.
    pub fn header(name: &'static str) -> Self {
        KeyExtractor {
            extract: Arc::new(move |r: &RequestView<'_>| {
                r.headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::trim)
                    .filter(|v| !v.is_empty())
                    .map(str::to_owned)
            }),
            describe: "header",
        }
    }

    /// The client's IP address, from a `SocketAddr` or `IpAddr` request
    /// extension (put there by your server; with axum, use
    /// [`from_fn`](KeyExtractor::from_fn) and `ConnectInfo`).
    pub fn client_ip() -> Self {
        KeyExtractor {
            extract: Arc::new(|r: &RequestView<'_>| {
                client_ip(r.extensions).map(|ip| ip.to_string())
            }),
            describe: "client_ip",
        }
    }

    /// The client IP from `X-Forwarded-For`, trusting `trusted_proxies`
    /// proxies in front of this server: the address that many entries from
    /// the right. Entries further left are set by the client and can be
    /// forged. Falls back to the connection's address without the header.
    pub fn forwarded_for(trusted_proxies: usize) -> Self {
        KeyExtractor {
            extract: Arc::new(move |r: &RequestView<'_>| {
                let hops: Vec<&str> = r
                    .headers
                    .get_all("x-forwarded-for")
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .flat_map(|v| v.split(','))
                    .map(str::trim)
                    .filter(|v| !v.is_empty())
                    .collect();
                if hops.is_empty() {
                    return client_ip(r.extensions).map(|ip| ip.to_string());
                }
                let index = hops.len().saturating_sub(trusted_proxies.max(1));
                hops[index].parse::<IpAddr>().ok().map(|ip| ip.to_string())
            }),
            describe: "forwarded_for",
        }
    }

    /// Any function of the request; `None` is a missing key.
    pub fn from_fn(f: impl Fn(&RequestView<'_>) -> Option<String> + Send + Sync + 'static) -> Self {
        KeyExtractor {
            extract: Arc::new(f),
            describe: "custom",
        }
    }

    pub(crate) fn extract(&self, request: &RequestView<'_>) -> Option<String> {
        (self.extract)(request)
    }
}

fn client_ip(extensions: &Extensions) -> Option<IpAddr> {
    extensions
        .get::<SocketAddr>()
        .map(SocketAddr::ip)
        .or_else(|| extensions.get::<IpAddr>().copied())
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
