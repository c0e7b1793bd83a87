//! What a store's URLs ask for (TLS or not), how they are shown without
//! their credentials, and what a failed connection says.

use super::*;

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

pub(super) fn connect_error(target: &str, e: redis::RedisError) -> Error {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.kind() == redis::ErrorKind::InvalidClientConfig {
        ErrorKind::InvalidInput
    } else {
        ErrorKind::Connection
    };
    Error::new(kind, format!("cannot connect to {target}: {e}")).caused_by(e)
}
