//! What a store runs: a script, named by its Lua and mirrored in Rust.
//!
//! A script is a type: its value is one call (the keys and arguments), it
//! names its Lua (one `static` [`Lua`] per script, hashed once), it says
//! how to read the integers the Lua replies, and it carries the mirror
//! the [`MemoryStore`](super::MemoryStore) runs in place of the Lua. Both
//! paths reply the same integers, so one parser serves both and a parity
//! test can compare them value for value.
//!
//! Any package can write scripts; a store runs whatever it is given. This
//! module owns the vocabulary and nothing else: no I/O, no policy.

use std::borrow::Cow;
use std::sync::OnceLock;

use crate::error::Error;

use super::memory::Memory;

/// A Lua script's source and name; declare one `static` per script.
///
/// ```
/// use slicelimit::store::Lua;
/// static TOUCH: Lua = Lua::new("touch", "return redis.call('PEXPIRE', KEYS[1], ARGV[1])");
/// assert_eq!(TOUCH.name(), "touch");
/// assert_eq!(TOUCH.sha().len(), 40);
/// ```
#[derive(Debug)]
pub struct Lua {
    name: &'static str,
    source: Source,
    /// The SHA1 `EVALSHA` names it by, computed on first use.
    sha: OnceLock<String>,
}

/// A script's text: whole, or parts joined on first use (another
/// package's building blocks in front of its own text, which `concat!`
/// cannot join: it takes literals only).
#[derive(Debug)]
enum Source {
    Whole(&'static str),
    Joined(&'static [&'static str], OnceLock<String>),
}

impl Lua {
    /// A script called `name` (unique among the scripts a process runs;
    /// it names the script in errors) with this source.
    pub const fn new(name: &'static str, source: &'static str) -> Self {
        Lua {
            name,
            source: Source::Whole(source),
            sha: OnceLock::new(),
        }
    }

    /// A script called `name` whose source is `parts` joined in order:
    /// building blocks such as [`fair::LUA`](super::fair::LUA) that define
    /// functions, then the script that calls them. Redis sees one script
    /// (its [`sha`](Lua::sha) is the joined text's).
    pub const fn joined(name: &'static str, parts: &'static [&'static str]) -> Self {
        Lua {
            name,
            source: Source::Joined(parts, OnceLock::new()),
            sha: OnceLock::new(),
        }
    }

    /// Its name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Its source, which `SCRIPT LOAD` sends.
    pub fn source(&self) -> &str {
        match &self.source {
            Source::Whole(source) => source,
            Source::Joined(parts, joined) => joined.get_or_init(|| parts.concat()),
        }
    }

    /// The hex SHA1 of its source.
    pub fn sha(&self) -> &str {
        self.sha
            .get_or_init(|| redis::Script::new(self.source()).get_hash().to_owned())
    }
}

/// One script argument (an ARGV entry), as the script's header documents it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Arg {
    /// An unsigned integer.
    Uint(u64),
    /// A signed integer.
    Int(i64),
    /// A number with a fraction.
    Float(f64),
    /// Text.
    Text(Cow<'static, str>),
}

/// One call of a script, its reply left as integers: what a store needs
/// to run it. Every [`Script`] is one; a store holds calls as `&dyn Call`.
pub trait Call: Send + Sync {
    /// The script.
    fn lua(&self) -> &'static Lua;

    /// `KEYS[1]`: where the call runs (its hash slot, on a cluster).
    fn key(&self) -> &str;

    /// `KEYS[2]` and on, if any; each in `KEYS[1]`'s hash slot.
    fn more_keys(&self, keys: &mut Vec<String>) {
        let _ = keys;
    }

    /// `ARGV`, appended to `args`.
    fn args(&self, args: &mut Vec<Arg>);

    /// What the Lua would reply, computed on the memory store's data: the
    /// same integers, the same writes, the same expiries. It runs with
    /// every key of the call's hash slot locked, as a script runs alone.
    ///
    /// # Errors
    /// As the Lua would raise one (a malformed argument).
    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error>;
}

/// A script: a [`Call`] whose reply has a type.
pub trait Script: Call {
    /// The reply, read.
    type Reply;

    /// Reads the integers the Lua (or the mirror) replied.
    ///
    /// # Errors
    /// An [`ErrorKind::Store`](crate::ErrorKind::Store) error when they
    /// are not what the script replies.
    fn parse(&self, values: Vec<i64>) -> Result<Self::Reply, Error>;
}

/// The error for a reply that is not what `script` replies (for a
/// [`Script::parse`] of your own).
pub fn bad_reply(script: &Lua, values: &[i64]) -> Error {
    Error::new(
        crate::error::ErrorKind::Store,
        format!("{} replied {values:?}", script.name()),
    )
}
