//! A listener's status file, `PATH.listen.json` beside the index: what the process that follows
//! the engines (`superfluid-warm listen`, or any head that writes it) last saw of each engine and
//! of its stream, for `stats`, the Python package and Rust callers to read from another process.
//! One JSON object, written whole (by a rename) every refresh.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::index_file::IndexFile;
use crate::error::{Error, Result};
use crate::route::tally::RouteStats;

/// A listener's status, as its status file holds it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ListenStatus {
    /// The listener's process id.
    pub pid: u32,
    /// Whether it was running when it wrote this (`false`: its last status, written as it
    /// stopped).
    pub running: bool,
    /// When it wrote this, in seconds since the Unix epoch.
    pub written_at: f64,
    /// Seconds between its writes.
    pub refresh_s: f64,
    /// Why it stopped on its own, if it did.
    pub error: Option<String>,
    /// Its link to a shared stream (`None`: it applies to its own file).
    pub sharing: Option<LinkStatus>,
    /// Each engine it follows.
    pub engines: Vec<EngineStatus>,
    /// A routing head's figures per engine (`serve`): requests, failures, predicted against
    /// delivered. Empty for a head that only listens.
    #[serde(default)]
    pub routes: Vec<RouteStats>,
}

/// What a listener's link to a NATS JetStream stream has seen (`ShareStats`' figures
/// that an operator reads).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LinkStatus {
    /// The stream.
    pub stream: String,
    /// This head's name in it.
    pub head: String,
    /// Whether it is connected to the server.
    pub connected: bool,
    /// Whether it has opened the stream.
    pub ready: bool,
    /// The stream's last event applied to the file.
    pub applied: u64,
    /// Events in the stream not yet applied.
    pub unapplied: u64,
    /// Events this head published.
    pub published: u64,
    /// Events waiting to be published.
    pub buffered: u64,
    /// Events dropped unpublished (the buffer was full).
    pub dropped: u64,
    /// What is wrong with the link now, if anything.
    pub error: Option<String>,
    /// Why the link stopped for good, if it did.
    pub halted: Option<String>,
}

/// What a listener has seen of one engine (`ListenStats`, lags in milliseconds).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct EngineStatus {
    /// The node.
    pub node: String,
    /// Whether its event socket was connected.
    pub connected: bool,
    /// Batches received.
    pub received: u64,
    /// Batches that did not decode.
    pub undecodable: u64,
    /// Messages of the wrong shape.
    pub malformed: u64,
    /// Replays asked for.
    pub replays: u64,
    /// Replays that did not cover their gap.
    pub replays_short: u64,
    /// Gaps not replayed while the replay endpoint was left alone.
    pub replays_skipped: u64,
    /// Whether a replay was being waited for.
    pub replaying: bool,
    /// Seconds until the replay endpoint is asked again.
    pub replay_backoff_s: Option<f64>,
    /// Connections dropped for good and made again.
    pub dropped: u64,
    /// Lag from publish to applied, median, in milliseconds.
    pub lag_p50_ms: Option<f64>,
    /// Lag from publish to applied, 99th percentile, in milliseconds.
    pub lag_p99_ms: Option<f64>,
    /// Seconds since its last batch.
    pub silent_for_s: Option<f64>,
    /// The listening thread's newest error.
    pub error: Option<String>,
}

impl ListenStatus {
    /// A status of this process, written now, with writes `refresh` apart.
    pub fn now(running: bool, refresh: Duration) -> ListenStatus {
        ListenStatus {
            pid: std::process::id(),
            running,
            written_at: unix_now(),
            refresh_s: refresh.as_secs_f64(),
            ..ListenStatus::default()
        }
    }

    /// The status file of the index `file`, if there is one.
    ///
    /// # Errors
    /// [`Error::Io`] if it cannot be read; [`Error::UnknownFormat`] if it is not a status file.
    pub fn read(file: &IndexFile) -> Result<Option<ListenStatus>> {
        let path = file.listen_status_path();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        serde_json::from_str(&text).map(Some).map_err(|e| Error::UnknownFormat {
            detail: format!(
                "{} is not a listener's status file (delete it; the listener writes it again)",
                path.display()
            ),
            source: Some(std::sync::Arc::new(e)),
        })
    }

    /// Writes it as the status file of the index `file`: whole, by a rename, so that a reader
    /// never sees half of one; on a full disk, where no new file can be made, over the old one
    /// in place.
    ///
    /// # Errors
    /// [`Error::Io`] if neither can be written.
    pub fn write(&self, file: &IndexFile) -> Result<()> {
        let path = file.listen_status_path();
        let text = serde_json::to_string(self).map_err(|e| Error::io(&path, e.into()))?;
        let tmp = path.with_extension("json.tmp");
        let Err(e) = std::fs::write(&tmp, &text).and_then(|()| std::fs::rename(&tmp, &path)) else { return Ok(()) };
        let _ = std::fs::remove_file(&tmp);
        // The old file's blocks hold the new text (a few hundred bytes) where no new block is free.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| {
                f.write_all(text.as_bytes())?;
                f.set_len(text.len() as u64)
            })
            .map_err(|_| Error::io(&path, e))
    }

    /// Seconds since it was written.
    pub fn age(&self) -> f64 {
        unix_now() - self.written_at
    }

    /// Why its listener is not running now, or `None` if it is: it wrote that it stopped, or its
    /// process is gone, or it has not written for three refreshes (and 5 s).
    pub fn down(&self) -> Option<String> {
        let age = self.age();
        let alive = Path::new(&format!("/proc/{}", self.pid)).exists();
        let fresh = age <= 3.0 * self.refresh_s + 5.0;
        if !self.running {
            Some(format!("stopped {age:.0} s ago"))
        } else if !alive || !fresh {
            Some(format!("not running (its last status is {age:.0} s old)"))
        } else {
            None
        }
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_reads_back_as_written_and_says_when_its_listener_is_down() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let file = IndexFile::new(dir.path().join("i.redb"));
        assert_eq!(ListenStatus::read(&file)?, None, "no status file");
        let mut status = ListenStatus::now(true, Duration::from_secs(2));
        // Whole seconds: serde_json reads back some fractions a unit in the last place off.
        status.written_at = status.written_at.floor();
        status.engines.push(EngineStatus {
            node: "gpu-0".into(),
            received: 7,
            lag_p99_ms: Some(3.5),
            ..EngineStatus::default()
        });
        status.write(&file)?;
        let read = ListenStatus::read(&file)?.expect("written");
        assert_eq!(read, status);
        assert_eq!(read.down(), None, "this process, just written");
        status.written_at -= 60.0;
        status.write(&file)?;
        assert!(ListenStatus::read(&file)?.and_then(|s| s.down()).is_some_and(|d| d.starts_with("not running")));
        status.running = false;
        status.write(&file)?;
        assert!(ListenStatus::read(&file)?.and_then(|s| s.down()).is_some_and(|d| d.starts_with("stopped")));
        std::fs::write(file.listen_status_path(), "{").map_err(|e| Error::io("status", e))?;
        assert!(matches!(ListenStatus::read(&file), Err(Error::UnknownFormat { .. })), "a torn or foreign file");
        Ok(())
    }
}
