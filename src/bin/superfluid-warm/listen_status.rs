//! `listen`'s status file (`ListenStatus`, `PATH.listen.json` beside the index): written by
//! `listen` every refresh, read by `stats` for the listener's live figures.

use std::path::Path;
use std::time::Duration;

use crate::listen::ListenHealth;
use superfluid_warm::{EngineStatus, Error, IndexFile, ListenStats, ListenStatus, RouteStats};

/// Writes `listen`'s status file. A failure is said on stderr and does not stop the listener.
pub(crate) fn write_listen_status(
    path: &Path,
    stats: &[ListenStats],
    health: &ListenHealth,
    running: bool,
    refresh: Duration,
) {
    let mut status = ListenStatus::now(running, refresh);
    status.error.clone_from(&health.error);
    status.sharing = health.link_status(running);
    status.engines = stats
        .iter()
        .map(|s| {
            let mut e = EngineStatus::from(s);
            e.connected &= running;
            e
        })
        .collect();
    if let Err(e) = status.write(&IndexFile::new(path)) {
        eprintln!("superfluid-warm: cannot write the status file: {e}");
    }
}

/// What `stats` shows of a listener: its status file's engines, if a listener is running (its
/// process is alive and it wrote within three refreshes), and otherwise why not; and why it
/// stopped on its own, if it did.
pub(crate) fn listen_status(path: &Path) -> (Option<String>, Vec<EngineStatus>, Option<String>) {
    let (down, engines, error, _) = head_status(path);
    (down, engines, error)
}

/// As [`listen_status`], with a routing head's figures per engine (`serve`).
pub(crate) fn head_status(path: &Path) -> (Option<String>, Vec<EngineStatus>, Option<String>, Vec<RouteStats>) {
    match IndexFile::new(path).listen_status() {
        // One that cannot be read is taken as none, as before it was a type.
        Ok(None) | Err(Error::Io { .. }) => (None, Vec::new(), None, Vec::new()),
        Err(_) => (Some("its status file does not parse".into()), Vec::new(), None, Vec::new()),
        Ok(Some(status)) => (status.down(), status.engines, status.error, status.routes),
    }
}
