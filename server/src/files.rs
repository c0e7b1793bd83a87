//! The configuration on disk: one YAML file, or a directory of them (one
//! domain each), read again every [`POLL`] and applied when what it says
//! changed. Reading contents rather than watching events sees every way a
//! file changes, including the symlink swap of a Kubernetes ConfigMap
//! (`..data` pointing at a new directory).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::Config;
use crate::stats;
use crate::table::{Settings, Table, RETIRE_AFTER};
use slicelimit::{Error, ErrorKind};

/// How often the configuration is read again: a change applies within
/// this (plus the time to read and build it).
pub const POLL: Duration = Duration::from_millis(250);

/// The files of a configuration, each as `(path, text)`, in path order.
pub type Sources = Vec<(PathBuf, String)>;

/// Reads `path`: the file itself, or every `.yaml` / `.yml` file of the
/// directory (following symlinks; names starting with `.` are skipped,
/// as Kubernetes keeps its old versions there).
///
/// # Errors
/// [`Io`](ErrorKind::Io) naming the path that could not be read.
pub fn read(path: &Path) -> Result<Sources, Error> {
    read_or_missing(path).map_err(|(_, e)| e)
}

/// [`read`], saying whether the error was a file not found (as in the
/// middle of a swap).
fn read_or_missing(path: &Path) -> Result<Sources, (bool, Error)> {
    let io = |at: &Path, e: std::io::Error| {
        let missing = e.kind() == std::io::ErrorKind::NotFound;
        let error = Error::new(ErrorKind::Io, format!("{}: {e}", at.display())).caused_by(e);
        (missing, error)
    };
    let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
    if !meta.is_dir() {
        let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
        return Ok(vec![(path.to_owned(), text)]);
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| io(path, e))? {
        let entry = entry.map_err(|e| io(path, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        if name.starts_with('.') || !yaml {
            continue;
        }
        let file = entry.path();
        if std::fs::metadata(&file).map_err(|e| io(&file, e))?.is_dir() {
            continue;
        }
        let text = std::fs::read_to_string(&file).map_err(|e| io(&file, e))?;
        out.push((file, text));
    }
    out.sort();
    Ok(out)
}

/// Parses every file.
///
/// # Errors
/// The first file's error, naming it; a directory with no YAML files.
pub fn parse(sources: &Sources) -> Result<Vec<Config>, Error> {
    if sources.is_empty() {
        return Err(Error::invalid(
            "no .yaml or .yml files in the configuration directory",
        ));
    }
    sources
        .iter()
        .map(|(path, text)| Config::parse(&path.display().to_string(), text))
        .collect()
}

/// Every file's configuration, those of one domain merged into one when
/// `merge_domains` (in file order).
///
/// # Errors
/// As [`parse`]; with `merge_domains`, what [`Config::merge`] refuses.
pub fn configs(sources: &Sources, merge_domains: bool) -> Result<Vec<Config>, Error> {
    let parsed = parse(sources)?;
    if !merge_domains {
        return Ok(parsed);
    }
    let mut merged: Vec<Config> = Vec::with_capacity(parsed.len());
    for config in parsed {
        match merged.iter().position(|c| c.domain() == config.domain()) {
            Some(i) => {
                let first = merged.swap_remove(i);
                merged.push(first.merge(config)?);
            }
            None => merged.push(config),
        }
    }
    Ok(merged)
}

/// Reads, parses and builds the first table.
///
/// # Errors
/// Whatever [`read`], [`parse`] or [`Table::build`] refuses.
pub fn load(path: &Path, settings: &Settings) -> Result<(Table, Sources), Error> {
    let sources = read(path)?;
    let (table, _) = Table::build(configs(&sources, settings.merge_domains)?, settings, None)?;
    loaded(&table);
    Ok((table, sources))
}

fn loaded(table: &Table) {
    metrics::counter!(stats::CONFIG_LOADS, "result" => "ok").increment(1);
    metrics::gauge!(stats::CONFIG_FAILING).set(0.0);
    metrics::gauge!(stats::RULES).set(table.rules() as f64);
}

/// Applies changes to the configuration at `path` to `table` until the
/// task is dropped. `seen` is what the current table was built from. A
/// configuration that fails (a file that does not parse or cannot be
/// read) keeps the table as it is, and is reported once (log and
/// [`stats::CONFIG_LOADS`]) until it changes again.
pub async fn watch(
    path: PathBuf,
    table: Arc<ArcSwap<Table>>,
    settings: Settings,
    mut seen: Sources,
) {
    let mut ticker = tokio::time::interval(POLL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unreadable: Option<String> = None;
    loop {
        ticker.tick().await;
        let sources = match read_or_missing(&path) {
            Ok(sources) => sources,
            // Mid-swap: read again at the next tick.
            Err((true, _)) => continue,
            // Unreadable (not UTF-8, no permission): a failure like a
            // parse error, reported once.
            Err((false, e)) => {
                let said = e.to_string();
                if unreadable.as_deref() != Some(said.as_str()) {
                    failed(&e);
                    unreadable = Some(said);
                }
                continue;
            }
        };
        unreadable = None;
        if sources == seen {
            continue;
        }
        seen = sources;
        let current = table.load_full();
        let built = configs(&seen, settings.merge_domains)
            .and_then(|configs| Table::build(configs, &settings, Some(&current)));
        match built {
            Ok((next, retired)) => {
                table.store(Arc::new(next));
                loaded(&table.load());
                eprintln!(
                    "slicelimit-server: configuration reloaded ({} rules)",
                    table.load().rules()
                );
                if !retired.is_empty() {
                    tokio::spawn(async move {
                        tokio::time::sleep(RETIRE_AFTER).await;
                        for limiter in retired {
                            limiter.shutdown().await;
                        }
                    });
                }
            }
            Err(e) => failed(&e),
        }
    }
}

fn failed(e: &Error) {
    metrics::counter!(stats::CONFIG_LOADS, "result" => "error").increment(1);
    metrics::gauge!(stats::CONFIG_FAILING).set(1.0);
    eprintln!("slicelimit-server: configuration not applied, keeping the last good one: {e}");
}
