//! What the embedded store keeps per key: the same state the scripts
//! keep in a Redis hash, and the helpers every algorithm's mirror shares
//! to read and write it. Plain data; the store owns the map around it.

use crate::error::{Error, ErrorKind};

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) state: State,
    /// Store time (µs) after which the entry is as good as absent.
    pub(crate) expires_us: u64,
    /// Fixed window: who leased the key lately (the lease script's "h…"
    /// and "p…" fields); boxed, since most entries never have any.
    pub(crate) holders: Option<Box<Holders>>,
}

/// The processes that leased a fixed-window key in recent windows.
#[derive(Debug, Clone, Default)]
pub(crate) struct Holders {
    /// Window → processes that leased in it.
    pub(crate) counts: Vec<(i64, u64)>,
    /// Process → the last window it leased in.
    pub(crate) last: Vec<(String, i64)>,
    /// Process → its last grant: (lease id, permits, all it was granted
    /// in that window, window).
    pub(crate) grants: Vec<(String, (u64, i64, i64, i64))>,
}

impl Holders {
    pub(crate) fn count(&self, window: i64) -> u64 {
        self.counts
            .iter()
            .find(|(w, _)| *w == window)
            .map_or(0, |(_, n)| *n)
    }

    pub(crate) fn last(&self, holder: &str) -> i64 {
        self.last
            .iter()
            .find(|(h, _)| h == holder)
            .map_or(-1, |(_, w)| *w)
    }

    pub(crate) fn joined(&mut self, holder: &str, window: i64) {
        match self.last.iter_mut().find(|(h, _)| h == holder) {
            Some((_, w)) => *w = window,
            None => self.last.push((holder.to_owned(), window)),
        }
        match self.counts.iter_mut().find(|(w, _)| *w == window) {
            Some((_, n)) => *n += 1,
            None => self.counts.push((window, 1)),
        }
    }

    pub(crate) fn forget_before(&mut self, window: i64) {
        self.counts.retain(|(w, _)| *w >= window);
        self.last.retain(|(_, w)| *w >= window);
        self.grants.retain(|(_, (_, _, _, w))| *w >= window);
    }

    pub(crate) fn grant(&self, holder: &str) -> Option<(u64, i64, i64, i64)> {
        self.grants
            .iter()
            .find(|(h, _)| h == holder)
            .map(|(_, g)| *g)
    }

    pub(crate) fn granted(&mut self, holder: &str, grant: (u64, i64, i64, i64)) {
        match self.grants.iter_mut().find(|(h, _)| h == holder) {
            Some((_, g)) => *g = grant,
            None => self.grants.push((holder.to_owned(), grant)),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum State {
    /// (window index, permits counted) for at most three windows.
    Window(Vec<(i64, i64)>),
    Bucket {
        tokens: f64,
        ts: u64,
        /// The give-back counter ("gb"): the key's creation time plus every
        /// permit given back; `None` until a lease wrote it.
        gb: Option<u64>,
    },
    Gcra {
        tat: f64,
        gb: Option<u64>,
    },
}

pub(crate) fn wrong_type(key: &str) -> Error {
    Error::new(
        ErrorKind::WrongType,
        format!("WRONGTYPE: key {key} holds a value of another algorithm"),
    )
}

pub(crate) fn ceil_ms_to_us(us: f64) -> u64 {
    ((us / 1000.0).ceil().max(0.0) as u64) * 1000
}

pub(crate) fn windows<'a>(
    entry: &'a mut Option<Entry>,
    key: &str,
) -> Result<Option<&'a mut Vec<(i64, i64)>>, Error> {
    match entry {
        None => Ok(None),
        Some(Entry {
            state: State::Window(w),
            ..
        }) => Ok(Some(w)),
        Some(_) => Err(wrong_type(key)),
    }
}

pub(crate) fn count_in(w: Option<&mut Vec<(i64, i64)>>, window: i64) -> i64 {
    w.and_then(|w| w.iter().find(|(i, _)| *i == window).map(|(_, c)| *c))
        .unwrap_or(0)
}

/// HINCRBY on a window field, creating the entry if needed; returns the new count.
pub(crate) fn incr_window(entry: &mut Option<Entry>, window: i64, by: i64) -> i64 {
    let e = entry.get_or_insert(Entry {
        state: State::Window(Vec::new()),
        expires_us: 0,
        holders: None,
    });
    let State::Window(w) = &mut e.state else {
        unreachable!("checked by windows()")
    };
    match w.iter_mut().find(|(i, _)| *i == window) {
        Some((_, c)) => {
            *c += by;
            *c
        }
        None => {
            w.push((window, by));
            by
        }
    }
}

/// Drops windows older than the previous one and lengthens the TTL to `ttl_us`.
pub(crate) fn trim_and_expire(entry: &mut Option<Entry>, current: i64, now: u64, ttl_us: u64) {
    if let Some(e) = entry {
        if let State::Window(w) = &mut e.state {
            if w.len() > 2 {
                w.retain(|(i, _)| *i >= current - 1);
            }
        }
        e.expires_us = e.expires_us.max(now + ttl_us);
    }
}
