//! What a store's URLs ask for (TLS or not), how they are shown without
//! their credentials, and what a failed connection says.

use std::time::Duration;

use super::RedisOptions;
use crate::error::{Error, ErrorKind};

/// `url` without the credentials it may carry: the user part before an
/// `@` (with or without a scheme), and `pass`, `password`, `user` or
/// `username` query parameters (Unix socket URLs).
pub(super) fn redact(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url.trim_start_matches('/')),
    };
    let (path, query) = match rest.find('?') {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let path = match path.rfind('@') {
        Some(at) => format!("<credentials>@{}", &path[at + 1..]),
        None => path.to_owned(),
    };
    let query = query.map(|q| {
        q.split('&')
            .map(|pair| {
                let name = pair.split('=').next().unwrap_or("");
                if ["pass", "password", "user", "username"]
                    .contains(&name.to_ascii_lowercase().as_str())
                {
                    format!("{name}=<redacted>")
                } else {
                    pair.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("&")
    });
    match query {
        Some(q) => format!("{scheme}{path}?{q}"),
        None => format!("{scheme}{path}"),
    }
}

/// Whether `url` asks for TLS.
pub(super) fn is_tls(url: &str) -> bool {
    let url = url.trim_start().to_ascii_lowercase();
    url.starts_with("rediss://") || url.starts_with("valkeys://")
}

/// Refuses what would connect other than as asked: a `rediss://` URL in a
/// build without TLS, TLS settings with a plain URL (never a silent
/// plaintext connection in place of an encrypted one).
pub(super) fn check_scheme(urls: &[&str], options: &RedisOptions) -> Result<(), Error> {
    for url in urls {
        if is_tls(url) && cfg!(not(feature = "tls")) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} is a TLS URL; TLS needs slicelimit's `tls` feature",
                    redact(url)
                ),
            ));
        }
        if options.has_tls() && !is_tls(url) {
            return Err(Error::invalid(format!(
                "TLS settings were given for {}, a plain redis:// URL; use rediss://",
                redact(url)
            )));
        }
    }
    Ok(())
}

/// rustls needs a process-wide crypto provider; when the application has
/// not chosen one, ring (the one this crate's `tls` feature builds).
#[cfg(feature = "tls")]
pub(super) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race to another installer is fine: one is in place.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(not(feature = "tls"))]
pub(super) fn ensure_crypto_provider() {}

/// `host:port` of `addr` when it is reached over TLS.
pub(super) fn tls_address(addr: &redis::ConnectionAddr) -> Option<String> {
    match addr {
        redis::ConnectionAddr::TcpTls { host, port, .. } => Some(format!("{host}:{port}")),
        _ => None,
    }
}

/// The likeliest reason a TLS connection to `address` times out or fails
/// before its handshake completes: a port that serves plaintext leaves
/// the client's handshake unanswered, or answers it with a plaintext
/// error. (The error alone says only "timeout" or "corrupt message".)
fn tls_hint(address: &str) -> String {
    format!(
        "a TLS handshake to {address} got no TLS answer: is the server serving TLS on that port?"
    )
}

/// A connection to `target` that did not finish within `after`; `tls` is
/// the server's address when the connection was over TLS.
pub(super) fn connect_timeout(target: &str, after: Duration, tls: Option<&str>) -> Error {
    let mut message = format!("connecting to {target} did not finish within {after:?}");
    if let Some(address) = tls {
        message = format!("{message}: {}", tls_hint(address));
    }
    Error::new(ErrorKind::Timeout, message)
}

/// A connection to `target` that failed; `tls` is the server's address
/// when the connection was over TLS.
pub(super) fn connect_error(target: &str, e: redis::RedisError, tls: Option<&str>) -> Error {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.kind() == redis::ErrorKind::InvalidClientConfig {
        ErrorKind::InvalidInput
    } else {
        ErrorKind::Connection
    };
    let mut message = format!("cannot connect to {target}: {e}");
    if let Some(address) = tls.filter(|_| e.is_timeout() || handshake_unanswered(&e)) {
        message = format!("{message}: {}", tls_hint(address));
    }
    Error::new(kind, message).caused_by(e)
}

/// Whether a TLS handshake failed for want of a TLS server: the reply was
/// no TLS record, or the connection closed before one came. A certificate
/// that does not verify, or an alert the server sent, is a TLS server's
/// answer and gets no hint.
#[cfg(feature = "tls")]
fn handshake_unanswered(e: &redis::RedisError) -> bool {
    use std::error::Error as _;
    // redis-rs keeps an I/O error behind an `Arc` (its source is the
    // `Arc`); tokio-rustls keeps a TLS error inside the I/O error.
    let Some(source) = e.source() else {
        return false;
    };
    let io = source.downcast_ref::<std::io::Error>().or_else(|| {
        source
            .downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>()?
            .downcast_ref::<std::io::Error>()
    });
    let Some(io) = io else {
        return false;
    };
    match io
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls) => matches!(
            tls,
            rustls::Error::InvalidMessage(_)
                | rustls::Error::InappropriateMessage { .. }
                | rustls::Error::InappropriateHandshakeMessage { .. }
        ),
        None => io.kind() == std::io::ErrorKind::UnexpectedEof,
    }
}

#[cfg(not(feature = "tls"))]
fn handshake_unanswered(_: &redis::RedisError) -> bool {
    false
}
