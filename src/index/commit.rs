//! The writer's side of a `Warm`: what both locks guard, and the commit thread. A flush takes
//! the queue, gives its effects to the writer, commits as asked, then tells the callers (a fresh
//! view of the last commit, built outside their lock and swapped in whole, and the memtable maps
//! it made redundant dropped).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use redb::{Database, ReadableDatabase, ReadableTable};

use super::front::{Committed, CommittedOthers, Front, MAX_BATCH_BLOCKS, Published};
use super::others::OthersCache;
use super::presence::Filters;
use super::queue::Queued;
use super::warm::Opened;
use crate::error::{Error, Result, redb_err};
use crate::file::lock::HeadLock;
use crate::file::owner::Owner;
use crate::file::{compact, seal};
use crate::keys::{BlockKey, Scheme};
use crate::store::tables::{OTHERS, PREFIXES};
use crate::store::writer::{RolledBack, Writer};
use crate::telemetry;

/// What the writer lock guards: redb's writer, and the changes its open batch holds.
pub(crate) struct Back {
    pub writer: Writer,
    /// The changes in the batch, oldest first: retried if it is rolled back, dropped from the
    /// memtable once it is committed.
    pub batch: Vec<Queued>,
}

/// The locks of a `Warm`, in the order they are taken when more than one is held: a lock is
/// never taken while one after it in this table is held.
///
/// | # | lock             | guards                                            | held by, for              |
/// |---|------------------|---------------------------------------------------|---------------------------|
/// | 1 | `back`           | redb's writer and the batch being committed       | a flush: a commit         |
/// | 2 | `presence`       | the presence filters and their rebuild            | a flush, with `back` held |
/// | 3 | `front`          | the callers' state: decided, memtable, view, queue | every call: microseconds, never across a file read |
/// | 4 | `others`         | the callers' copy of committed others rows        | a copy in or out          |
/// | 5 | `queue_recorded` | which reading of the queue's figures was recorded | a compare and a store     |
///
/// A sharing head's own locks (`share/link.rs`: `pending` before `outbox`; `status` alone) are
/// never held while one of these is taken.
/// Every lock of `Inner` is in this table (a test reads both).
///
/// Dropped in this order: the batch and the read view, then redb (which closes the file), then
/// the sealer (which seals the closed file and lets go of its lock).
pub(crate) struct Inner {
    pub back: Mutex<Back>,
    pub front: Mutex<Front>,
    /// The callers' copy of the committed view's others.
    pub others: Mutex<OthersCache>,
    /// Wakes the commit thread (work queued, or closing).
    pub wake: Condvar,
    /// Wakes callers waiting for the queue to be taken.
    pub drained: Condvar,
    pub window: Duration,
    pub opened: Opened,
    /// How the file's keys are made (from its meta record; fixed for its life).
    pub scheme: Scheme,
    /// Whether the file holds 0.1.7's imported entries (`Published::legacy_entries > 0`), kept
    /// beside it so that hashing a prompt never waits for the callers' lock.
    pub legacy: AtomicBool,
    /// The block sizes of the hybrid engines' holdings (bit `n`: size `2^n`), as the last engine
    /// batch decided left them (`Engines::hybrid_sizes`), beside them for the same reason: a
    /// prompt's fine keys are made at these sizes.
    pub hybrid_sizes: AtomicU64,
    /// The filter of the committed keys, and its rebuild.
    pub presence: Mutex<Filters>,
    pub db: Database,
    pub sealer: Sealer,
    /// The writer's stream position as of its last durable commit (what a sharing head acks).
    pub durable_position: AtomicU64,
    /// The number of the queue's figures last recorded (see [`record_queue`]).
    pub queue_recorded: Mutex<u64>,
    /// The process that opened the file: no other (a fork's child) may touch it.
    pub owner: Owner,
}

/// Holds the head's lock of its file; when dropped, after redb has closed the file, seals it
/// (if the close committed everything and the file was verified at open) and lets go.
pub(crate) struct Sealer {
    pub lock: Option<(HeadLock, PathBuf)>,
    /// Whether the file may be sealed: only a file verified at open, closed with everything
    /// committed (a seal vouches for every byte).
    pub sealable: bool,
    /// Whether to compact a sparse file first ([`crate::Builder::compact_on_close`]).
    pub compact: bool,
    pub clean: AtomicBool,
}

impl Drop for Sealer {
    fn drop(&mut self) {
        let clean = *self.clean.get_mut();
        if let (Some((_, path)), true, false) = (&self.lock, self.sealable, clean) {
            telemetry::closed_unclean(path);
        }
        if let (Some((lock, path)), true, true) = (&self.lock, self.sealable, clean) {
            // Best effort: an uncompacted file opens as safely, only slower; without a seal the
            // next open verifies every page instead.
            let compacted =
                if self.compact { compact::compact_if_sparse(path) } else { compact::Compaction::NotSparse };
            match compacted {
                compact::Compaction::Failed => {
                    telemetry::compaction(path, false);
                    // A file whose compaction failed is not vouched for.
                    let _ = lock.side_file().set_len(0);
                    return;
                }
                compact::Compaction::Skipped => telemetry::compaction(path, true),
                _ => {}
            }
            let _ = seal::write_sealed(lock.side_file(), path);
        }
    }
}

/// Marks the side file: the seal no longer describes the file once it is written. Not needed
/// for safety (a seal is only trusted if the file's length, time and digest match), so done off
/// the open's path, by the commit thread as it starts (at once without one).
pub(crate) fn mark_open(inner: &Inner) {
    if let Some((lock, _)) = &inner.sealer.lock {
        seal::write_open(lock.side_file());
    }
}

/// A read of the prefix table and the others as of the last commit.
pub(crate) fn committed(db: &Database) -> Result<(Committed, CommittedOthers)> {
    let read = db.begin_read().map_err(redb_err("starting a read"))?;
    let prefixes = read.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
    let others = read.open_table(OTHERS).map_err(redb_err("opening the others"))?;
    Ok((prefixes, others))
}

/// The file's figures as of the writer's batch, with `held` its node counts
/// ([`Writer::node_counts`]).
pub(crate) fn published(writer: &Writer, held: Arc<[u64]>) -> Published {
    Published {
        entries: writer.meta.entries,
        legacy_entries: writer.meta.legacy_entries,
        capacity: writer.meta.capacity,
        held,
    }
}

/// What a flush ends with.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flush {
    /// Give the queue to the batch; commit only if the oldest change is a window old or the
    /// batch is full.
    IfDue,
    /// Give the queue to the batch and write it (for figures as of every change); commit if due.
    Write,
    /// Write the queue and commit.
    Commit,
    /// Write the queue, commit, and mark the file closed.
    Close,
}

/// Takes the queue, gives it to the batch and commits as `how` says, then tells the callers.
/// On failure the batch is rolled back and its changes go back to the head of the queue (still
/// in the memtable) to be retried; the error is returned and kept in `failed` until a commit
/// succeeds.
pub(crate) fn flush(inner: &Inner, how: Flush) -> Result<()> {
    let mut back = inner.back.lock().map_err(|_| Error::Poisoned)?;
    flush_locked(inner, &mut back, how)
}

/// [`flush`] with the writer already held.
pub(crate) fn flush_locked(inner: &Inner, back: &mut Back, how: Flush) -> Result<()> {
    let (queue, due) = take_queue(inner)?;
    let written = give_batch(inner, back, queue);
    let blocks = back.batch.iter().map(Queued::blocks).sum::<usize>();
    let due = due || blocks >= MAX_BATCH_BLOCKS;
    let outcome = match written {
        Err(e) => Err(e),
        Ok(()) if matches!(how, Flush::Commit | Flush::Close) || due => {
            let started = Instant::now();
            // A commit of nothing writes nothing (an idle `sync`): not a commit to count.
            let (changes, dirty) = (back.batch.len(), back.writer.dirty());
            let committed = back.writer.commit(&inner.db, how == Flush::Close);
            if committed.is_ok() && dirty {
                telemetry::committed(started.elapsed(), changes, blocks);
            }
            committed.map(|()| Some(std::mem::take(&mut back.batch)))
        }
        Ok(()) if how == Flush::Write => match back.writer.write(&inner.db) {
            Ok(()) => Ok(None),
            Err(e) => Err(back.writer.roll_back(&inner.db, e)),
        },
        Ok(()) => Ok(None),
    };
    publish(inner, back, outcome)
}

/// Takes the queue from the callers, and whether its oldest change is a window old.
fn take_queue(inner: &Inner) -> Result<(Vec<Queued>, bool)> {
    let mut front = inner.front.lock().map_err(|_| Error::Poisoned)?;
    let due = front.queue().oldest().is_some_and(|t| t.elapsed() >= inner.window);
    let queue = front.take();
    let waiting = front.queue_figures();
    drop(front);
    inner.drained.notify_all();
    record_queue(inner, waiting);
    Ok((queue, due))
}

/// Gives `queue`'s effects to the batch. On an error the batch is rolled back.
fn give_batch(inner: &Inner, back: &mut Back, queue: Vec<Queued>) -> Result<(), Box<RolledBack>> {
    if queue.is_empty() {
        return Ok(());
    }
    // Into the filters before any commit can hold them.
    let filters = lock_filters(inner);
    for keys in queue.iter().flat_map(Queued::keys) {
        filters.insert_all(keys);
    }
    drop(filters);
    let applied = queue.iter().try_for_each(|q| back.writer.apply(&inner.db, &q.effects, q.position));
    back.batch.extend(queue);
    applied.map_err(|e| back.writer.roll_back(&inner.db, e))
}

/// Tells the callers what a flush did: the figures, and after a commit a fresh view of it with
/// the memtable maps it made redundant dropped; after a failure, the changes back in the queue.
fn publish(inner: &Inner, back: &mut Back, outcome: Result<Option<Vec<Queued>>, Box<RolledBack>>) -> Result<()> {
    // Node counts that cannot be read (the file failing) stay as they were.
    let held = back.writer.node_counts(&inner.db).ok();
    // Without a fresh read (one that failed), the committed changes stay in the memtable and
    // the old view stays: the answers stay right, and the next commit drops them.
    let fresh = match &outcome {
        Ok(Some(_)) => committed(&inner.db).ok().map(Arc::new),
        _ => None,
    };
    let committed_now = matches!(outcome, Ok(Some(_)));
    let file_bytes = if committed_now { file_size(inner) } else { None };
    let mut front = inner.front.lock().map_err(|_| Error::Poisoned)?;
    let figures = published(&back.writer, held.map_or_else(|| Arc::clone(&front.view().published.held), Arc::from));
    inner.legacy.store(figures.legacy_entries > 0, Ordering::Relaxed);
    // The figures a commit changed, recorded once the lock is released.
    let recorded = committed_now.then(|| FileFigures::of(&front, &figures, file_bytes));
    let (was_failing, needed_reopen) = (front.failed().is_some(), front.failed().is_some_and(Error::needs_reopen));
    // What is replaced is dropped after the lock is released.
    let (result, replaced) = match outcome {
        Ok(Some(committed)) => {
            front.commit_succeeded();
            inner.durable_position.store(back.writer.position, Ordering::Release);
            match fresh {
                Some(tables) => {
                    let view = front.view().next(|v| {
                        v.tables = tables;
                        v.published = figures;
                    });
                    let changed = std::mem::take(&mut back.writer.held.others_changed);
                    drop(committed);
                    // The callers' copy of the others follows the view it is read with.
                    if let Ok(mut others) = inner.others.lock() {
                        others.committed(&view.tables, &changed);
                    }
                    (Ok(()), Some(front.install(view)))
                }
                None => {
                    // Their memtable maps stay (answered from there) until a commit's view is
                    // installed: the commit thread tries again a window from now, so that a
                    // `ran` waiting for the maps' room is not left waiting.
                    front.retry_later();
                    drop(committed);
                    (Ok(()), None)
                }
            }
        }
        Ok(None) => {
            front.refigure(figures);
            (Ok(()), None)
        }
        Err(rolled_back) => {
            let RolledBack { error } = *rolled_back;
            front.commit_failed(error.clone());
            front.requeue(std::mem::take(&mut back.batch));
            (Err(error), None)
        }
    };
    let waiting = front.queue_figures();
    drop(front);
    inner.drained.notify_all();
    if let Some((old_view, Some(mut map))) = replaced {
        // The committed batch's map, emptied outside the callers' lock, is the next open map.
        drop(old_view);
        let used = map.clear();
        let unused = inner.front.lock().ok().and_then(|mut front| front.reuse_map(map, used));
        drop(unused);
    }
    // Recorded and logged with no lock of the callers held.
    record_queue(inner, waiting);
    match &result {
        // Logged loudly once (the commit thread retries every window), and again if the
        // failure turns into a latched I/O error.
        Err(error) => telemetry::commit_failed(error, !was_failing || error.needs_reopen() && !needed_reopen),
        Ok(()) if committed_now && was_failing => telemetry::commits_recovered(),
        Ok(()) => {}
    }
    if let Some(recorded) = recorded {
        recorded.record();
    }
    result
}

/// Records the figures of the file as opened (before anything can commit).
pub(crate) fn record_opened(inner: &Inner) {
    let Ok(back) = inner.back.lock() else { return };
    let Ok(held) = back.writer.node_counts(&inner.db) else { return };
    let figures = published(&back.writer, held.into());
    let file_bytes = file_size(inner);
    let Ok(front) = inner.front.lock() else { return };
    let recorded = FileFigures::of(&front, &figures, file_bytes);
    drop(front);
    recorded.record();
}

/// The size of the head's file (none with a custom backend).
fn file_size(inner: &Inner) -> Option<u64> {
    let (_, path) = inner.sealer.lock.as_ref()?;
    std::fs::metadata(path).ok().map(|m| m.len())
}

/// What an operator sees of the file as of a commit (or the open): its totals and each node's,
/// taken under the callers' lock and recorded once it is released.
struct FileFigures {
    entries: u64,
    legacy_entries: u64,
    capacity: u64,
    file_bytes: Option<u64>,
    nodes: Vec<telemetry::NodeFigures>,
}

impl FileFigures {
    fn of(front: &Front, figures: &Published, file_bytes: Option<u64>) -> FileFigures {
        let (entries, legacy_entries, capacity) = (figures.entries, figures.legacy_entries, figures.capacity);
        FileFigures { entries, legacy_entries, capacity, file_bytes, nodes: node_figures(front, figures) }
    }

    fn record(&self) {
        telemetry::figures(self.entries, self.legacy_entries, self.capacity, self.file_bytes);
        for node in &self.nodes {
            telemetry::node(node);
        }
    }
}

/// Records the queue's figures `(reading, blocks, bytes)` unless a later reading was recorded
/// already (callers and the commit thread record after releasing the callers' lock, in any
/// order).
pub(crate) fn record_queue(inner: &Inner, (reading, blocks, bytes): (u64, usize, usize)) {
    let mut recorded = inner.queue_recorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if reading > *recorded {
        *recorded = reading;
        telemetry::queued(blocks, bytes);
    }
}

/// Each current node's blocks named (as of `figures`) and its cache (held, capacity) if kept;
/// a name whose last incarnation was forgotten, 0 (nothing of it is answered).
fn node_figures(front: &Front, figures: &Published) -> Vec<telemetry::NodeFigures> {
    let nodes = &front.decided.nodes;
    // `stats` lists the current incarnations in id order, as `all` lists them.
    let mut caches = front.decided.caches.stats(nodes.all()).into_iter();
    let mut out: Vec<telemetry::NodeFigures> = Vec::new();
    for ((name, forgotten), &held) in nodes.all().zip(figures.held.iter()) {
        match forgotten {
            // A forgotten name is answered for nothing, until its next incarnation.
            true if nodes.current(name).is_none() && !out.iter().any(|f| f.name == name) => {
                out.push(telemetry::NodeFigures { name: name.to_string(), held: 0, cache: Some((0, None)) });
            }
            true => {}
            false => {
                let cache = caches.next().filter(|c| c.capacity.is_some() || c.held > 0);
                out.retain(|f| f.name != name);
                out.push(telemetry::NodeFigures {
                    name: name.to_string(),
                    held,
                    cache: cache.map(|c| (c.held, c.capacity)),
                });
            }
        }
    }
    out
}

/// The filters (a panic while they were held cannot have left them wrong: each insert is one
/// atomic word).
pub(crate) fn lock_filters(inner: &Inner) -> std::sync::MutexGuard<'_, Filters> {
    inner.presence.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Builds the presence filter, a step at a time with the writer held, until it is whole or
/// `ran`s are queued (the next flush comes first; the build goes on after it). Starts one when
/// there is none or the callers' is full. A failed read drops the build (the callers keep what
/// they have; the next call starts over).
fn build_presence(inner: &Inner) {
    loop {
        let Ok(back) = inner.back.lock() else { return };
        let mut filters = lock_filters(inner);
        let now = std::time::Instant::now();
        let wait = filters.due.and_then(|due| due.checked_duration_since(now)).filter(|w| !w.is_zero());
        if let Some(wait) = wait.filter(|_| filters.building.is_some()) {
            // Paused between steps: the scan reads the whole table through redb's cache, and
            // the head's reads must keep their share of it and of the machine.
            drop(filters);
            drop(back);
            let Ok(front) = inner.front.lock() else { return };
            let front = match inner.wake.wait_timeout(front, wait) {
                Ok((front, _)) => front,
                Err(_) => return,
            };
            if !front.queue().is_empty() || front.closing() {
                return;
            }
            continue;
        }
        if filters.wants_build() {
            let applied: Vec<&[BlockKey]> = back.batch.iter().flat_map(Queued::keys).collect();
            let keys = back.writer.meta.capacity.max(back.writer.meta.entries);
            filters.start(usize::try_from(keys).unwrap_or(usize::MAX), &applied);
        }
        let stepped = filters.step(&inner.db);
        filters.due = Some(now + now.elapsed() * BUILD_PAUSE);
        match stepped {
            Ok(Some(whole)) => {
                if let Ok(mut front) = inner.front.lock() {
                    front.change_view(|v| v.presence = Some(whole));
                }
                return;
            }
            Ok(None) if filters.building.is_some() => {}
            _ => return,
        }
        drop(filters);
        drop(back);
        if inner.front.lock().map_or(true, |front| !front.queue().is_empty() || front.closing()) {
            return;
        }
    }
}

/// A rebuild pauses this many times a step's time after each step.
const BUILD_PAUSE: u32 = 32;

/// Reads which segments of the last commit have others rows, for `warm_nodes` to skip the
/// rest. Holding the writer, so no commit lands between the read and the callers getting it;
/// rows of the batch join at the commit that makes them visible (`publish`). A failure leaves
/// the callers reading every segment.
fn index_segments(inner: &Inner) {
    let Ok(_writer) = inner.back.lock() else { return };
    let found = (|| -> Result<std::collections::HashSet<u64>> {
        let read = inner.db.begin_read().map_err(redb_err("starting a read"))?;
        let others = read.open_table(OTHERS).map_err(redb_err("opening the others"))?;
        let mut segments = std::collections::HashSet::new();
        for item in others.iter().map_err(redb_err("reading the others"))? {
            let (key, _) = item.map_err(redb_err("reading the others"))?;
            segments.insert((key.value() >> 64) as u64);
        }
        Ok(segments)
    })();
    if let (Ok(segments), Ok(mut others)) = (found, inner.others.lock()) {
        others.segments = Some(segments);
    }
}

/// The commit thread: writes queued `ran`s into the batch as they come, and commits the batch
/// once its oldest change is a window old.
pub(crate) fn flush_loop(inner: &Inner) {
    mark_open(inner);
    index_segments(inner);
    build_presence(inner);
    loop {
        let how = {
            let Ok(mut front) = inner.front.lock() else { return };
            loop {
                if front.closing() {
                    return;
                }
                if front.failed().is_some() {
                    // Retry a failed commit a window later (or sooner, at a caller's sync); a
                    // commit that succeeds, even of nothing, clears the failure.
                    front = match inner.wake.wait_timeout(front, inner.window) {
                        Ok((guard, _)) => guard,
                        Err(_) => return,
                    };
                    if front.closing() {
                        return;
                    }
                    if front.failed().is_some() {
                        break Flush::Commit;
                    }
                    continue;
                }
                if !front.queue().is_empty() {
                    break Flush::IfDue;
                }
                let wait = match front.queue().oldest() {
                    None => None,
                    Some(since) => match inner.window.checked_sub(since.elapsed()) {
                        Some(left) if !left.is_zero() => Some(left),
                        _ => break Flush::IfDue,
                    },
                };
                front = match wait {
                    None => match inner.wake.wait(front) {
                        Ok(guard) => guard,
                        Err(_) => return,
                    },
                    Some(d) => match inner.wake.wait_timeout(front, d) {
                        Ok((guard, _)) => guard,
                        Err(_) => return,
                    },
                };
            }
        };
        // A failure is kept by `flush` (in `failed`) for the callers, and retried.
        let _ = flush(inner, how);
        build_presence(inner);
    }
}

#[cfg(test)]
mod tests {
    /// The lock-order table on `Inner` lists every lock `Inner` holds, each once.
    #[test]
    fn the_lock_order_table_lists_every_lock_of_inner() {
        let source = include_str!("commit.rs");
        let start = source.find("pub(crate) struct Inner {").expect("Inner");
        let body = source.get(start..).and_then(|s| s.split("\n}\n").next()).expect("its body");
        let mut fields: Vec<&str> = body
            .lines()
            .filter(|l| l.contains(": Mutex<"))
            .filter_map(|l| l.trim().strip_prefix("pub ")?.split(':').next())
            .collect();
        let doc = source.get(..start).and_then(|s| s.rsplit("/// The locks of a `Warm`").next()).expect("the table");
        let mut listed: Vec<&str> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("/// | ")?.split(" | ").nth(1))
            .filter_map(|cell| cell.trim().strip_prefix('`')?.strip_suffix('`'))
            .collect();
        assert!(fields.len() >= 5, "{fields:?}");
        assert_eq!(listed.first(), Some(&"back"), "{listed:?}");
        fields.sort_unstable();
        listed.sort_unstable();
        assert_eq!(fields, listed, "every lock of Inner in the table, and nothing else");
    }
}
