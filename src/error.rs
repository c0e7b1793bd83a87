//! The one error type of the crate.
//!
//! An [`Error`] means "could not decide": bad configuration, or a store that
//! did not answer in time. A denial is never an error; it is a
//! [`Decision`](crate::Decision).

use std::fmt;

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
        }
    }
}

/// The error of every fallible operation in this crate.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
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

impl std::error::Error for Error {}

impl From<redis::RedisError> for Error {
    fn from(err: redis::RedisError) -> Self {
        let kind = if err.is_timeout() {
            ErrorKind::Timeout
        } else if err.is_io_error()
            || err.is_connection_refusal()
            || err.is_connection_dropped()
            || err.is_unrecoverable_error()
        {
            ErrorKind::Connection
        } else if matches!(
            err.code(),
            Some("LOADING" | "MASTERDOWN" | "CLUSTERDOWN" | "TRYAGAIN" | "READONLY" | "BUSY")
        ) {
            // Up but unable to serve: a restart loading, a failover.
            ErrorKind::Connection
        } else if err.code() == Some("WRONGTYPE") || err.to_string().contains("WRONGTYPE") {
            ErrorKind::WrongType
        } else {
            ErrorKind::Store
        };
        Error::new(kind, err.to_string())
    }
}
