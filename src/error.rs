//! The one error type of the crate.
//!
//! An [`Error`] means "could not decide": bad configuration, or a store that
//! did not answer in time. A denial is never an error; it is a
//! [`Decision`](crate::Decision).

use std::fmt;
use std::sync::Arc;

/// What went wrong, coarsely, so callers and metrics can branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A quota or configuration value is out of range.
    InvalidInput,
    /// The store did not answer within the configured timeout.
    Timeout,
    /// The store could not be reached, or the connection broke.
    Connection,
    /// A key holds a value of another type than the script expects
    /// (someone else wrote to a key in the limiter's namespace).
    WrongType,
    /// The store answered with an error or a reply of an unexpected shape.
    Store,
    /// The circuit breaker is open: the store is not being asked at all.
    CircuitOpen,
    /// The requested combination is not supported.
    Unsupported,
    /// The operating system refused (an address already in use).
    Io,
}

impl ErrorKind {
    /// A short, stable name, usable as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Connection => "connection",
            ErrorKind::WrongType => "wrong_type",
            ErrorKind::Store => "store",
            ErrorKind::CircuitOpen => "circuit_open",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Io => "io",
        }
    }
}

/// The error of every fallible operation in this crate.
///
/// When the store's client reported the failure, that error is the
/// [`source`](std::error::Error::source) (its type is not part of this
/// crate's API: read it through `dyn Error`).
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    /// The client's error this one was made from, shared so that `Error`
    /// stays `Clone` (a failed batch hands one error to every caller in it).
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl Error {
    /// An error of `kind` saying `message` (for a store of your own, see
    /// [`Backend`](crate::store::Backend), and for layers over the library).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Records `source` as the cause of this error.
    #[must_use]
    pub fn caused_by(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// An [`ErrorKind::InvalidInput`] error saying `message`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidInput, message)
    }

    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The store did not answer within its timeout.
    pub fn is_timeout(&self) -> bool {
        self.kind == ErrorKind::Timeout
    }

    /// The store could not be reached or the connection broke.
    pub fn is_connection(&self) -> bool {
        self.kind == ErrorKind::Connection
    }

    /// A key in the limiter's namespace holds a value of the wrong type.
    pub fn is_wrong_type(&self) -> bool {
        self.kind == ErrorKind::WrongType
    }

    /// A quota, key or configuration value was rejected.
    pub fn is_invalid_input(&self) -> bool {
        self.kind == ErrorKind::InvalidInput
    }

    /// The circuit breaker refused to ask the store.
    pub fn is_circuit_open(&self) -> bool {
        self.kind == ErrorKind::CircuitOpen
    }

    /// Whether this error says the store is unavailable (as opposed to
    /// misconfigured): the failure policy applies to these.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::Timeout | ErrorKind::Connection | ErrorKind::CircuitOpen
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The code of a node that is up but busy running a script past its time
/// limit (the client has no kind for it).
const BUSY: &str = "BUSY";

/// The code of a command (or a script's call) on a key of another type.
const WRONGTYPE: &str = "WRONGTYPE";

impl Error {
    /// Classifies an error of the Redis client by what the client says it
    /// is (its kind, I/O condition and server error code), never by its
    /// text; the client's error becomes the source.
    pub(crate) fn from_redis(err: redis::RedisError) -> Self {
        use redis::{ErrorKind as Redis, ServerErrorKind as Server};

        let kind = if err.is_timeout() {
            ErrorKind::Timeout
        } else if err.is_io_error()
            || err.is_connection_refusal()
            || err.is_connection_dropped()
            || err.is_unrecoverable_error()
        {
            ErrorKind::Connection
        } else if matches!(
            err.kind(),
            Redis::Server(
                Server::BusyLoading
                    | Server::MasterDown
                    | Server::ClusterDown
                    | Server::TryAgain
                    | Server::ReadOnly
            )
        ) || err.code() == Some(BUSY)
        {
            // Up but unable to serve: a restart loading, a failover.
            ErrorKind::Connection
        } else if err.code() == Some(WRONGTYPE) {
            ErrorKind::WrongType
        } else {
            ErrorKind::Store
        };
        Error::new(kind, err.to_string()).caused_by(err)
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;
    use std::io;

    use super::*;

    fn server(reply: &[u8]) -> redis::RedisError {
        match redis::parse_redis_value(reply).expect("a RESP error reply") {
            redis::Value::ServerError(e) => e.into(),
            v => panic!("not an error reply: {v:?}"),
        }
    }

    #[test]
    fn the_client_error_is_the_source_and_invalid_input_has_none() {
        let e = Error::from_redis(io::Error::new(io::ErrorKind::ConnectionReset, "reset").into());
        let source = e.source().expect("the client's error");
        assert!(source.downcast_ref::<redis::RedisError>().is_some());
        assert!(e.clone().source().is_some(), "clones keep the cause");
        assert!(Error::invalid("quota limit must be at least 1")
            .source()
            .is_none());
    }

    #[test]
    fn client_errors_are_classified_by_kind_and_code() {
        let io = |kind: io::ErrorKind| Error::from_redis(io::Error::new(kind, "x").into());
        assert!(io(io::ErrorKind::TimedOut).is_timeout());
        assert!(io(io::ErrorKind::ConnectionRefused).is_connection());
        assert!(io(io::ErrorKind::BrokenPipe).is_connection());
        for reply in [
            &b"-LOADING Redis is loading the dataset in memory\r\n"[..],
            b"-READONLY You can't write against a read only replica.\r\n",
            b"-MASTERDOWN Link with MASTER is down\r\n",
            b"-CLUSTERDOWN The cluster is down\r\n",
            b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
            b"-BUSY Redis is busy running a script.\r\n",
        ] {
            let e = Error::from_redis(server(reply));
            assert!(e.is_connection(), "{e}");
        }
        let e = Error::from_redis(server(
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        ));
        assert!(e.is_wrong_type() && e.source().is_some(), "{e}");
        // The code, not the text, decides: an ERR that mentions WRONGTYPE
        // is a store error.
        let e = Error::from_redis(server(b"-ERR user script said WRONGTYPE\r\n"));
        assert_eq!(e.kind(), ErrorKind::Store, "{e}");
    }
}
