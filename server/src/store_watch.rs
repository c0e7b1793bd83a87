//! Where the server's store is and what it says about it: the store
//! built from `--redis-url` without waiting for Redis (so the server
//! starts while Redis comes up, deciding by `--on-store-error` until it
//! answers), and a watch that says on standard error when Redis stops and
//! starts answering.

use std::time::Duration;

#[cfg(feature = "sentinel")]
use slicelimit::store::Sentinel;
use slicelimit::store::{bad_reply, Arg, Call, Lua, Memory, Script};
use slicelimit::{store::RedisOptions, Error, RedisStore, Store};

use crate::log::Throttled;

/// How often the watch asks the store whether it answers.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// While the store does not answer, a reminder at most this often.
pub const REMIND_EVERY: Duration = Duration::from_secs(60);

/// The store for `url`: `redis://` or `rediss://` (one node, connected on
/// first use, so the server starts while Redis is unreachable), or
/// `redis+sentinel://[user:password@]host:port[,host:port…]/service`
/// (the primary Sentinel names, followed across failovers; connected at
/// start).
///
/// # Errors
/// A URL that is not one of these; a Sentinel that cannot be reached.
pub async fn connect(url: &str, options: RedisOptions) -> Result<Store, Error> {
    match url.strip_prefix("redis+sentinel://") {
        #[cfg(feature = "sentinel")]
        Some(rest) => Ok(RedisStore::connect_sentinel(sentinel_of(rest)?, options)
            .await?
            .into()),
        #[cfg(not(feature = "sentinel"))]
        Some(_) => Err(Error::new(
            slicelimit::ErrorKind::Unsupported,
            "redis+sentinel:// needs a build with the `sentinel` feature (on by default)",
        )),
        None => Ok(RedisStore::connect_lazy(url, options)?.into()),
    }
}

/// The Sentinels and service of a `redis+sentinel://` URL (after the
/// scheme). Credentials are the primary's and the Sentinels' alike.
#[cfg(feature = "sentinel")]
fn sentinel_of(rest: &str) -> Result<Sentinel, Error> {
    let bad = |why: &str| {
        Error::invalid(format!(
            "redis+sentinel:// URL: {why}; expected \
             redis+sentinel://[user:password@]host:port[,host:port…]/service"
        ))
    };
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => (Some(auth), rest),
        None => (None, rest),
    };
    let (hosts, service) = rest.split_once('/').ok_or_else(|| bad("no /service"))?;
    let service = service.trim_end_matches('/');
    if service.is_empty() || service.contains('/') {
        return Err(bad("the service name is missing or has a /"));
    }
    let prefix = auth.map_or_else(String::new, |a| format!("{a}@"));
    let urls: Vec<String> = hosts
        .split(',')
        .map(|h| {
            if h.is_empty() || !h.contains(':') {
                Err(bad(&format!("{h:?} is not host:port")))
            } else {
                Ok(format!("redis://{prefix}{h}"))
            }
        })
        .collect::<Result<_, _>>()?;
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let mut sentinel = Sentinel::new(&refs, service);
    if let Some(auth) = auth {
        let (user, password) = match auth.split_once(':') {
            Some((user, password)) => ((!user.is_empty()).then_some(user), password),
            None => (None, auth),
        };
        sentinel = sentinel.primary_auth(user, password);
    }
    Ok(sentinel)
}

static PING_LUA: Lua = Lua::new("slicelimit_server_ping", "return {1}");

/// A call that writes and reads nothing: whether the store answers.
struct Ping;

impl Call for Ping {
    fn lua(&self) -> &'static Lua {
        &PING_LUA
    }

    fn key(&self) -> &str {
        "slicelimit-server:ping"
    }

    fn args(&self, _: &mut Vec<Arg>) {}

    fn mirror(&self, _: &mut Memory<'_>) -> Result<Vec<i64>, Error> {
        Ok(vec![1])
    }
}

impl Script for Ping {
    type Reply = ();

    fn parse(&self, values: Vec<i64>) -> Result<(), Error> {
        match values.as_slice() {
            [1] => Ok(()),
            _ => Err(bad_reply(&PING_LUA, &values)),
        }
    }
}

/// Asks `store` every [`PROBE_EVERY`] whether it answers, and says so on
/// standard error when that changes: when Redis stops answering (with
/// the error and what `policy` then decides), every [`REMIND_EVERY`]
/// while it does not, and when it answers again. Runs until dropped.
pub async fn watch(store: Store, policy: &'static str) {
    let remind = Throttled::new(REMIND_EVERY);
    let mut answering: Option<bool> = None;
    let mut down_since = std::time::Instant::now();
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = store.run(&Ping).await;
        match (&result, answering) {
            (Ok(()), Some(true)) => {}
            (Ok(()), None) => {
                eprintln!("slicelimit-server: Redis answers");
                answering = Some(true);
            }
            (Ok(()), Some(false)) => {
                eprintln!(
                    "slicelimit-server: Redis answers again, after {:.0?}; deciding by it",
                    down_since.elapsed()
                );
                answering = Some(true);
            }
            (Err(e), Some(false)) => {
                let down = down_since.elapsed();
                remind.say(|| {
                    format!("Redis still does not answer after {down:.0?} ({e}); {policy}")
                });
            }
            (Err(e), _) => {
                eprintln!("slicelimit-server: Redis does not answer ({e}); {policy}");
                answering = Some(false);
                down_since = std::time::Instant::now();
                // The reminders count from this line.
                remind.hold();
            }
        }
    }
}

#[cfg(all(test, feature = "sentinel"))]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_url_names_its_sentinels_service_and_credentials() {
        let s = format!(
            "{:?}",
            sentinel_of("u:pw@10.0.0.1:26379,10.0.0.2:26380/limits").unwrap()
        );
        assert!(s.contains("limits") && s.contains("10.0.0.2:26380"), "{s}");
        assert!(!s.contains("pw"), "the password is redacted: {s}");
        assert!(sentinel_of("10.0.0.1:26379/limits").is_ok());
        for bad in [
            "10.0.0.1:26379",
            "10.0.0.1:26379/",
            "host/limits",
            ",h:1/limits",
            "h:1/a/b",
        ] {
            assert!(sentinel_of(bad).is_err(), "{bad}");
        }
    }
}
