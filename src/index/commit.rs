//! The writer's side of a `Warm`: what both locks guard, and the commit thread. A flush takes
//! the queue, writes it into the batch, commits it as asked, then tells the callers (a fresh
//! view of the last commit, and the overlay maps it made redundant dropped).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use redb::{Database, ReadableDatabase, ReadableTable};

use super::front::{Committed, CommittedOthers, Front, MAX_BATCH_BLOCKS, Published};
use super::horizon::Horizon;
use super::presence::Filters;
use super::warm::Opened;
use crate::error::{Error, Result, redb_err};
use crate::file::lock::HeadLock;
use crate::file::{compact, seal};
use crate::keys::{BlockKey, Scheme};
use crate::store::tables::{LIVE, OTHERS, PREFIXES, STATE};
use crate::store::writer::{Change, RolledBack, Writer, read_floor};

/// Dropped in this order: the batch and the read view, then redb (which closes the file), then
/// the sealer (which seals the closed file and lets go of its lock).
pub(crate) struct Inner {
    pub back: Mutex<Writer>,
    pub front: Mutex<Front>,
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
    /// The filter of the committed keys, and its rebuild; touched only with the writer held.
    pub presence: Mutex<Filters>,
    pub db: Database,
    pub sealer: Sealer,
    /// The writer's stream position as of its last durable commit (what a sharing head acks).
    pub durable_position: AtomicU64,
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
        if let (Some((lock, path)), true, true) = (&self.lock, self.sealable, *self.clean.get_mut()) {
            // Best effort: an uncompacted file opens as safely, only slower; without a seal the
            // next open verifies every page instead.
            if self.compact && compact::compact_if_sparse(path) == compact::Compaction::Failed {
                // A file whose compaction failed is not vouched for.
                let _ = lock.side_file().set_len(0);
                return;
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

/// The callers' horizon of the file as last committed, whose meta `published` gives (nothing
/// may be pending: no `ran` since, nothing in the batch).
pub(crate) fn horizon(db: &Database, published: Published) -> Result<Horizon> {
    let read = db.begin_read().map_err(redb_err("starting a read"))?;
    let live = read.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
    let floor = read_floor(&read.open_table(STATE).map_err(redb_err("reading the floor"))?)?;
    Horizon::load(&live, floor, published.entries, published.capacity)
}

/// Reads the callers' horizon if it has not been read since the open (or an import): before the first `ran`
/// (by it, or earlier by the commit thread), so that opening a file never waits for it.
pub(crate) fn ensure_horizon<'a>(db: &Database, front: &'a mut Front) -> Result<&'a mut Horizon> {
    let horizon = match front.horizon.take() {
        Some(h) => h,
        None => horizon(db, front.published)?,
    };
    front.searched = None;
    Ok(front.horizon.insert(horizon))
}

pub(crate) fn published(writer: &Writer) -> Published {
    let nodes = &writer.nodes;
    let named: u64 = nodes.held.iter().sum();
    let reclaimable = nodes.held.iter().zip(&nodes.retired).filter(|(_, r)| r.is_some()).map(|(h, _)| h).sum();
    Published {
        entries: writer.meta.entries,
        legacy_entries: writer.meta.legacy_entries,
        capacity: writer.meta.capacity,
        others: named.saturating_sub(writer.meta.entries),
        reclaimable,
        floor: writer.floor,
    }
}

/// What a flush ends with.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flush {
    /// Write the queue into the batch; commit only if the oldest change is a window old or the
    /// batch is full.
    IfDue,
    /// Write the queue and commit.
    Commit,
    /// Write the queue, commit, and mark the file closed.
    Close,
}

/// Takes the queue, writes it into the batch and commits as `how` says, then tells the callers.
/// On failure the batch is rolled back and its `ran`s go back to the head of the queue (still in
/// the overlay) to be retried; the error is returned and kept in `failed` until a commit
/// succeeds.
pub(crate) fn flush(inner: &Inner, how: Flush) -> Result<()> {
    let mut back = inner.back.lock().map_err(|_| Error::Poisoned)?;
    flush_locked(inner, &mut back, how)
}

/// [`flush`] with the writer already held.
pub(crate) fn flush_locked(inner: &Inner, back: &mut Writer, how: Flush) -> Result<()> {
    let (rans, due) = take_queue(inner)?;
    let written = write_batch(inner, back, rans);
    let due = due || back.applied.iter().map(Change::blocks).sum::<usize>() >= MAX_BATCH_BLOCKS;
    let outcome = match written {
        Err(rolled_back) => Err(rolled_back),
        Ok(()) if matches!(how, Flush::Commit | Flush::Close) || due => {
            back.commit(&inner.db, how == Flush::Close).map(Some)
        }
        Ok(()) => Ok(None),
    };
    publish(inner, back, outcome)
}

/// Takes the queue from the callers, and whether its oldest change is a window old.
fn take_queue(inner: &Inner) -> Result<(Vec<Change>, bool)> {
    let mut front = inner.front.lock().map_err(|_| Error::Poisoned)?;
    let due = front.oldest_pending.is_some_and(|t| t.elapsed() >= inner.window);
    let rans = front.take();
    inner.drained.notify_all();
    Ok((rans, due))
}

/// Writes `rans` into the batch, merged, with the evictions their floors carry. On an error the
/// batch is rolled back and every `ran` it held or was to hold is returned with it.
fn write_batch(inner: &Inner, back: &mut Writer, rans: Vec<Change>) -> Result<(), Box<RolledBack>> {
    if rans.is_empty() {
        return Ok(());
    }
    // Into the filters before any commit can hold them.
    let filters = lock_filters(inner);
    for change in &rans {
        if let Change::Ran(ran) = change {
            filters.insert_all(&ran.blocks);
        }
    }
    drop(filters);
    match back.apply(&inner.db, &rans) {
        Ok(()) => {
            back.applied.extend(rans);
            Ok(())
        }
        Err(e) => {
            let mut rolled_back = back.roll_back(&inner.db, e);
            rolled_back.rans.extend(rans);
            Err(rolled_back)
        }
    }
}

/// Tells the callers what a flush did: the counts, and after a commit a fresh view of it with
/// the overlay maps it made redundant dropped; after a failure, the `ran`s back in the queue.
fn publish(inner: &Inner, back: &mut Writer, outcome: Result<Option<Vec<Change>>, Box<RolledBack>>) -> Result<()> {
    // Without a fresh view (a read that failed), the committed `ran`s stay in the overlay and
    // the old view stays: the answers stay right, and the next commit drops them.
    let fresh = match &outcome {
        Ok(Some(_)) => committed(&inner.db).ok(),
        _ => None,
    };
    let mut front = inner.front.lock().map_err(|_| Error::Poisoned)?;
    // A search reads the file's floor until the horizon is read (a new view is dealt with
    // below).
    if front.horizon.is_none() {
        front.searched = None;
    }
    front.adopt(&back.nodes);
    front.published = published(back);
    inner.legacy.store(front.published.legacy_entries > 0, Ordering::Relaxed);
    // An import may carry clocks past the callers' (0.1.7's own): the clock never goes back.
    front.clock = front.clock.max(back.meta.clock);
    // What is replaced is dropped after the lock is released.
    let (result, _old_view, _gone) = match outcome {
        Ok(Some(committed)) => {
            front.failed = None;
            inner.durable_position.store(back.position, Ordering::Release);
            match fresh {
                Some((fresh, fresh_others)) => {
                    front.others.committed(&std::mem::take(&mut back.nodes.others_changed));
                    front.searched = None;
                    let old = std::mem::replace(&mut front.committed, fresh);
                    let old_others = std::mem::replace(&mut front.committed_others, fresh_others);
                    (Ok(()), Some((old, old_others)), front.drop_committed(&committed))
                }
                None => {
                    front.oldest_pending = front.queue.first().map(Change::at);
                    (Ok(()), None, Vec::new())
                }
            }
        }
        Ok(None) => (Ok(()), None, Vec::new()),
        Err(rolled_back) => {
            let RolledBack { error, rans } = *rolled_back;
            front.failed = Some(error.clone());
            front.requeue(rans);
            (Err(error), None, Vec::new())
        }
    };
    drop(front);
    inner.drained.notify_all();
    result
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
            if !front.queue.is_empty() || front.closing {
                return;
            }
            continue;
        }
        if filters.wants_build() {
            let applied: Vec<&[BlockKey]> = back
                .applied
                .iter()
                .filter_map(|c| match c {
                    Change::Ran(ran) => Some(&ran.blocks[..]),
                    Change::Forget { .. } => None,
                })
                .collect();
            let keys = back.meta.capacity.max(back.meta.entries);
            filters.start(usize::try_from(keys).unwrap_or(usize::MAX), &applied);
        }
        let stepped = filters.step(&inner.db);
        filters.due = Some(now + now.elapsed() * BUILD_PAUSE);
        match stepped {
            Ok(Some(whole)) => {
                if let Ok(mut front) = inner.front.lock() {
                    front.presence = Some(whole);
                }
                return;
            }
            Ok(None) if filters.building.is_some() => {}
            _ => return,
        }
        drop(filters);
        drop(back);
        if inner.front.lock().map_or(true, |front| !front.queue.is_empty() || front.closing) {
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
    if let (Ok(segments), Ok(mut front)) = (found, inner.front.lock()) {
        front.others.segments = Some(segments);
    }
}

/// The commit thread: writes queued `ran`s into the batch as they come, and commits the batch
/// once its oldest change is a window old.
pub(crate) fn flush_loop(inner: &Inner) {
    // Read the horizon now, while the head is likely still starting up; a failure is met
    // again, and reported, by the first `ran`.
    mark_open(inner);
    if let Ok(mut front) = inner.front.lock() {
        let _ = ensure_horizon(&inner.db, &mut front);
    }
    index_segments(inner);
    build_presence(inner);
    loop {
        let how = {
            let Ok(mut front) = inner.front.lock() else { return };
            loop {
                if front.closing {
                    return;
                }
                if front.failed.is_some() {
                    // Retry a failed commit a window later (or sooner, at a caller's sync); a
                    // commit that succeeds, even of nothing, clears the failure.
                    front = match inner.wake.wait_timeout(front, inner.window) {
                        Ok((guard, _)) => guard,
                        Err(_) => return,
                    };
                    if front.closing {
                        return;
                    }
                    if front.failed.is_some() {
                        break Flush::Commit;
                    }
                    continue;
                }
                if !front.queue.is_empty() {
                    break Flush::IfDue;
                }
                let wait = match front.oldest_pending {
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
