//! The commands that write a file no head has open: `import`, `forget`, `compact`, and
//! `check --repair`'s recovery.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::CliError;
use crate::emit;
use crate::format::{say_how_opened, say_recovered};
use superfluid_warm::{Error, IndexFile, LegacyJson, Snapshot, Warm};

/// An index file that must already be there (a typo must not create one).
fn existing(path: &Path) -> Result<(), CliError> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(_) => Err(CliError::Index(Error::Io {
            path: path.to_path_buf(),
            source: std::sync::Arc::new(std::io::Error::new(std::io::ErrorKind::NotFound, "no index file here")),
        })),
    }
}

/// `check --repair`: recovers a file left by a crashed head (opening it as a head repairs it to
/// its last commit), before it is checked.
pub(crate) fn repair(path: &Path) -> Result<(), CliError> {
    existing(path)?;
    let warm = Warm::open(path)?;
    say_how_opened(path, &warm.stats()?);
    warm.close()?;
    Ok(())
}

/// `compact`: gives a closed file's free pages back to the filesystem.
pub(crate) fn compact(out: &mut impl Write, path: &Path) -> Result<ExitCode, CliError> {
    let done = IndexFile::new(path).compact()?;
    if let Some(pid) = done.recovered_from {
        say_recovered(path, pid);
    }
    emit(out, &format!("compacted {}: {} -> {} bytes", path.display(), done.bytes_before, done.bytes_after))
}

/// What a command that may create files finds at a path before it runs: so that on failure it
/// removes only what it created (never a symlink, or a file, that was there before).
struct Created {
    /// The file a failure should remove, if the command creates it: `path` itself, or the end
    /// of a chain of dangling symlinks at `path`.
    target: Option<PathBuf>,
    /// The side file a head makes beside `path` (beside the link, not its target), if it was
    /// not there before.
    side_file: Option<PathBuf>,
}

impl Created {
    fn note(path: &Path) -> Created {
        let target = match std::fs::metadata(path) {
            // Nothing is created where a file is, or where nothing can be (a symlink loop).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(dangling_end(path)),
            _ => None,
        };
        let side_file = IndexFile::new(path).seal_path();
        let side_file = (target.is_some() && std::fs::symlink_metadata(&side_file).is_err()).then_some(side_file);
        Created { target, side_file }
    }

    /// Removes what the command created (the file and its side file), and nothing else.
    fn remove(&self) {
        for made in self.target.iter().chain(&self.side_file) {
            let _ = std::fs::remove_file(made);
        }
    }
}

/// Where a file created at `path`, which does not exist, lands: `path`, or the end of the chain
/// of dangling symlinks that starts there.
fn dangling_end(path: &Path) -> PathBuf {
    let mut at = path.to_path_buf();
    // As many links as the kernel follows.
    for _ in 0..40 {
        match std::fs::read_link(&at) {
            Ok(link) => at = at.parent().map_or(link.clone(), |dir| dir.join(link)),
            Err(_) => break,
        }
    }
    at
}

pub(crate) fn import(out: &mut impl Write, old: &Path, path: &Path) -> Result<ExitCode, CliError> {
    // Read and checked whole before the index is touched: a bad file changes nothing.
    let legacy = LegacyJson::read(old)?;
    let created = Created::note(path);
    let imported = Warm::open(path).and_then(|warm| {
        let stats = warm.stats();
        let report = warm.import(&legacy);
        // Closed either way; the import's error is the one that matters.
        let closed = warm.close();
        let (stats, report) = (stats?, report?);
        closed.map(|()| (stats, report))
    });
    let (opened, report) = match imported {
        Ok(done) => done,
        Err(e) => {
            // Another head's file, made since the look: not this command's to remove.
            if !matches!(e, Error::AlreadyOpen { .. }) {
                created.remove();
            }
            return Err(e.into());
        }
    };
    say_how_opened(path, &opened);
    let line = if report.already_imported {
        format!("{} was imported before: nothing to do", old.display())
    } else {
        format!(
            "imported {} of {} entries from {} ({} evicted to stay in capacity)",
            report.imported,
            report.in_file,
            old.display(),
            report.evicted
        )
    };
    emit(out, &line)
}

pub(crate) fn forget(out: &mut impl Write, path: &Path, node: &str) -> Result<ExitCode, CliError> {
    // Read first: a node the file does not name needs no write (and no upgrade).
    let named = match Snapshot::open(path) {
        Ok(snapshot) => Some(snapshot.nodes().any(|(n, forgotten)| n == node && !forgotten)),
        // Recovered below, which says so.
        Err(Error::CrashedWriter { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    if named == Some(false) {
        return emit(
            out,
            &format!("node {node} of {}: not known (nothing to forget; the file is unchanged)", path.display()),
        );
    }
    let warm = Warm::open(path)?;
    let stats = warm.stats()?;
    say_how_opened(path, &stats);
    let known = stats.nodes.iter().any(|n| n.name == node && !n.forgotten);
    if known {
        warm.forget_node(node)?;
    }
    warm.close()?;
    let what = if known { "forgotten" } else { "not known (nothing to forget)" };
    emit(out, &format!("node {node} of {}: {what}", path.display()))
}
