//! What a request reserved, kept in the store from the call that made the
//! reservation to the call that settles it: Envoy's second
//! `ShouldRateLimit` at a stream's end may reach another replica, minutes
//! later. The script is `lua/reservation.lua`; [`Keep`] and [`Take`]
//! mirror it for the memory store.

use slicelimit::store::{bad_reply, Arg, Call, Lua, Memory, Script};
use slicelimit::{Error, Receipt};

/// The script (see its header).
pub static RESERVATION: Lua = Lua::new("reservation", include_str!("../lua/reservation.lua"));

/// The longest record kept: an estimate and a receipt are a few dozen
/// bytes.
const MAX_RECORD: usize = 512;

/// What a settlement needs of a reservation: the estimate it counted, and
/// the receipt that gives part of it back (none where the admission
/// cannot be refunded elsewhere: a hybrid bucket lease's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The hits the reservation counted.
    pub estimate: u64,
    /// What it took, for a refund.
    pub receipt: Option<Receipt>,
}

impl Record {
    fn text(&self) -> String {
        match &self.receipt {
            Some(receipt) => format!("{} {receipt}", self.estimate),
            None => format!("{} -", self.estimate),
        }
    }

    fn parse(text: &str) -> Option<Record> {
        let (estimate, receipt) = text.split_once(' ')?;
        Some(Record {
            estimate: estimate.parse().ok()?,
            receipt: match receipt {
                "-" => None,
                r => Some(r.parse().ok()?),
            },
        })
    }
}

/// The memory store's value of a reservation's key.
#[derive(Debug, Clone)]
enum Kept {
    Ready {
        by: String,
        record: String,
    },
    Taken {
        by: String,
        record: String,
    },
    /// Reserved twice under one identity: nothing to settle against.
    Spoilt,
}

/// Keeps `record` under `key` for `ttl_ms`, as the request `by`. Another
/// request's record under the same key spoils both (see the script).
#[derive(Debug)]
pub struct Keep<'a> {
    /// Where it is kept.
    pub key: &'a str,
    /// The reserving call's identity.
    pub by: &'a str,
    /// What is kept.
    pub record: &'a Record,
    /// How long, ms.
    pub ttl_ms: u64,
}

impl Call for Keep<'_> {
    fn lua(&self) -> &'static Lua {
        &RESERVATION
    }

    fn key(&self) -> &str {
        self.key
    }

    fn args(&self, args: &mut Vec<Arg>) {
        args.push(Arg::Text("put".into()));
        args.push(Arg::Text(self.by.to_owned().into()));
        args.push(Arg::Text(self.record.text().into()));
        args.push(Arg::Uint(self.ttl_ms.max(1)));
    }

    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        match memory.get::<Kept>(self.key) {
            None => {
                let expires = memory.now_us() + self.ttl_ms.max(1) * 1_000;
                let kept = Kept::Ready {
                    by: self.by.to_owned(),
                    record: self.record.text(),
                };
                memory.set(self.key, kept, expires);
                Ok(vec![1])
            }
            Some(Kept::Ready { by, .. }) if by == self.by => Ok(vec![1]),
            Some(kept) => {
                *kept = Kept::Spoilt;
                Ok(vec![0])
            }
        }
    }
}

impl Script for Keep<'_> {
    /// Whether this call kept it (`false`: another request's was kept
    /// under the same key, and both are spoilt).
    type Reply = bool;

    fn parse(&self, values: Vec<i64>) -> Result<bool, Error> {
        match values.as_slice() {
            [kept] => Ok(*kept == 1),
            _ => Err(bad_reply(&RESERVATION, &values)),
        }
    }
}

/// Takes the record kept under `key`, as the call `by` (the same `by`
/// sent again gets the same record: its first reply may have been lost).
#[derive(Debug)]
pub struct Take<'a> {
    /// Where it is kept.
    pub key: &'a str,
    /// The taking call's identity.
    pub by: &'a str,
}

impl Call for Take<'_> {
    fn lua(&self) -> &'static Lua {
        &RESERVATION
    }

    fn key(&self) -> &str {
        self.key
    }

    fn args(&self, args: &mut Vec<Arg>) {
        args.push(Arg::Text("take".into()));
        args.push(Arg::Text(self.by.to_owned().into()));
    }

    fn mirror(&self, memory: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        let Some(kept) = memory.get::<Kept>(self.key) else {
            return Ok(Vec::new());
        };
        let record = match kept.clone() {
            Kept::Ready { record, .. } => {
                *kept = Kept::Taken {
                    by: self.by.to_owned(),
                    record: record.clone(),
                };
                record
            }
            Kept::Taken { by, record } if by == self.by => record,
            Kept::Taken { .. } => return Ok(vec![0]),
            Kept::Spoilt => return Ok(Vec::new()),
        };
        Ok(record.bytes().map(i64::from).collect())
    }
}

/// What a [`Take`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// The record, taken by this call.
    Kept(Record),
    /// Taken by another call: settled already.
    Settled,
    /// None kept: never made, reserved twice, or expired.
    Nothing,
}

impl Script for Take<'_> {
    type Reply = Found;

    fn parse(&self, values: Vec<i64>) -> Result<Found, Error> {
        match values.as_slice() {
            [] => return Ok(Found::Nothing),
            [0] => return Ok(Found::Settled),
            _ => {}
        }
        let bytes: Option<Vec<u8>> = values
            .iter()
            .take(MAX_RECORD + 1)
            .map(|&b| u8::try_from(b).ok())
            .collect();
        let text = bytes
            .filter(|b| b.len() <= MAX_RECORD)
            .and_then(|b| String::from_utf8(b).ok());
        match text.as_deref().and_then(Record::parse) {
            Some(record) => Ok(Found::Kept(record)),
            None => Err(bad_reply(&RESERVATION, &values[..values.len().min(16)])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slicelimit::MemoryStore;

    #[test]
    fn a_record_is_kept_once_and_taken_once() {
        let store = MemoryStore::new();
        let receipt: Receipt = "r1.1000.60000000.800.w.28333334.41250.0".parse().unwrap();
        let record = Record {
            estimate: 800,
            receipt: Some(receipt),
        };
        let keep = |key, by| Keep {
            key,
            by,
            record: &record,
            ttl_ms: 60_000,
        };
        assert!(store.run_now(&keep("k", "p")).unwrap());
        // A second delivery changes nothing.
        assert!(store.run_now(&keep("k", "p")).unwrap());
        let take = |key, by| store.run_now(&Take { key, by }).unwrap();
        assert_eq!(take("k", "a"), Found::Kept(record.clone()));
        // Sent again by the same call: the same record; by another: it
        // was settled.
        assert_eq!(take("k", "a"), Found::Kept(record.clone()));
        assert_eq!(take("k", "b"), Found::Settled);
        assert_eq!(take("other", "a"), Found::Nothing);
        // Reserved by two requests under one identity: nothing to settle
        // against, however often asked.
        assert!(store.run_now(&keep("twice", "p")).unwrap());
        assert!(!store.run_now(&keep("twice", "q")).unwrap());
        assert_eq!(take("twice", "a"), Found::Nothing);
        assert_eq!(take("twice", "b"), Found::Nothing);
    }

    #[test]
    fn a_record_without_a_receipt_reads_back() {
        let record = Record {
            estimate: 12,
            receipt: None,
        };
        assert_eq!(Record::parse(&record.text()), Some(record));
        assert_eq!(Record::parse("12"), None);
        assert_eq!(Record::parse("x -"), None);
    }
}
