//! slicelimit: placeholder
#![allow(missing_docs)]
mod clock;
mod decision;
mod error;
mod exact;
mod failure;
mod hybrid;
mod key;
mod limiter;
mod local;
mod quota;
mod stats;
mod store;
pub use clock::{Clock, FakeClock, SystemClock};
pub use decision::{Decision, Source};
pub use error::{Error, ErrorKind};
pub use failure::FailurePolicy;
pub use hybrid::{Consistency, HybridConfig};
pub use limiter::{Builder, Limiter};
pub use stats::Stats;
pub use quota::{Algorithm, Quota};
pub use store::{MemoryStore, RedisOptions, RedisStore, Store};
