//! `listen`'s status file, `PATH.listen.json` beside the index: written by `listen` (whole, by
//! a rename), read by `stats` for the listener's live figures.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::listen::ListenHealth;
use serde_json::json;
use superfluid_warm::ListenStats;

/// Where `listen` keeps its live status (connections, replays, lag) for `stats` to show: beside
/// the index file, as `<file>.listen.json`.
pub(crate) fn listen_status_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".listen.json");
    PathBuf::from(name)
}

/// Writes `listen`'s status file (whole, by a rename: a reader never sees half of one; on a
/// full disk, where no new file can be made, over the old one in place). A failure is said on
/// stderr and does not stop the listener.
pub(crate) fn write_listen_status(
    path: &Path,
    stats: &[ListenStats],
    health: &ListenHealth,
    running: bool,
    refresh: Duration,
) {
    let ms = |l: Option<f64>| l.map(|l| l * 1000.0);
    let line = json!({
        "pid": std::process::id(), "running": running, "written_at": unix_now(),
        "refresh_s": refresh.as_secs_f64(), "error": health.error, "sharing": health.sharing_json(running),
        "engines": stats.iter().map(|s| json!({
            "node": s.node, "connected": s.connected && running, "received": s.received,
            "undecodable": s.undecodable, "malformed": s.malformed, "replays": s.replays,
            "replays_short": s.replays_short, "replays_skipped": s.replays_skipped, "replaying": s.replaying,
            "replay_backoff_s": s.replay_backoff, "dropped": s.dropped, "lag_p50_ms": ms(s.lag_p50), "lag_p99_ms": ms(s.lag_p99),
            "silent_for_s": s.silent_for, "error": s.error,
        })).collect::<Vec<_>>(),
    })
    .to_string();
    let tmp = path.with_extension("json.tmp");
    let written = std::fs::write(&tmp, &line).and_then(|()| std::fs::rename(&tmp, path));
    let Err(e) = written else { return };
    let _ = std::fs::remove_file(&tmp);
    // The old file's blocks hold the new text (a few hundred bytes) where no new block is free.
    let in_place = std::fs::OpenOptions::new().write(true).open(path).and_then(|mut f| {
        f.write_all(line.as_bytes())?;
        f.set_len(line.len() as u64)
    });
    if in_place.is_err() {
        eprintln!("superfluid-warm: cannot write the status file {}: {e}", path.display());
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// What `stats` shows of a listener: its status file's engines, if a listener is running (its
/// process is alive and it wrote within three refreshes), and otherwise why not; and why it
/// stopped on its own, if it did.
pub(crate) fn listen_status(path: &Path) -> (Option<String>, Vec<serde_json::Value>, Option<String>) {
    let Ok(text) = std::fs::read_to_string(listen_status_path(path)) else { return (None, Vec::new(), None) };
    let Ok(status) = serde_json::from_str::<serde_json::Value>(&text) else {
        return (Some("its status file does not parse".into()), Vec::new(), None);
    };
    let error = status["error"].as_str().map(str::to_string);
    let age = unix_now() - status["written_at"].as_f64().unwrap_or(0.0);
    let alive = status["pid"].as_u64().is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
    let fresh = age <= 3.0 * status["refresh_s"].as_f64().unwrap_or(10.0) + 5.0;
    let engines = status["engines"].as_array().cloned().unwrap_or_default();
    if status["running"].as_bool() == Some(false) {
        (Some(format!("stopped {age:.0} s ago")), engines, error)
    } else if !alive || !fresh {
        (Some(format!("not running (its last status is {age:.0} s old)")), engines, error)
    } else {
        (None, engines, error)
    }
}
