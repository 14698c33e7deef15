//! The seal: a digest of the whole file, written beside it (`<file>.seal`) after a clean
//! close, so that the next open can trust the file without redb's page-by-page integrity check.
//! While a head has the file open, the same side file names the head's process instead, so that
//! readers know, without reading the index file, whether it is being written.
//!
//! Opening a file redb did not write (a flipped bit, a truncated copy) without that check can
//! answer wrongly or panic inside redb, and the check reads every page through redb's cache (a
//! read call, a checksum and a buffer per page), then commits. Reading the file in 128 KiB chunks
//! and checksumming them (XXH64, `src/checksum.rs`) on every core, the checksums joined by
//! blake3, does the same job at the speed of reading the file: if the digest matches,
//! the bytes are exactly those redb left at a clean close, so redb's own fast open is safe. If
//! the seal is missing, unreadable or does not match (any write since, a crash, a flipped bit, a
//! copy without its seal), the open falls back to the full check: the seal can only save time,
//! never make an open trust a file it would not have trusted. It is not fsynced: a seal lost to
//! power failure costs one full check.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

use crate::checksum::xxh64;
use crate::codec;

/// Bytes checksummed as one unit (a leaf of the digest), read at once (it stays in the core's
/// cache while it is checksummed).
const CHUNK: usize = 1 << 17;
/// Most threads one digest uses.
const MAX_THREADS: usize = 8;
/// The seal format this build writes and reads.
const SEAL_VERSION: u32 = 1;

/// The side file: a version, then what it says of the index file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    /// [`SEAL_VERSION`].
    version: u32,
    state: State,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum State {
    /// Closed cleanly: the file as its head left it.
    Sealed {
        /// The file's length.
        len: u64,
        /// Its modification time, nanoseconds since the epoch (a quick refusal before hashing).
        modified: u128,
        /// [`digest`] of its bytes.
        digest: [u8; 32],
    },
    /// Open by the head whose process id this is (or was, if it crashed).
    Open {
        /// Its process id.
        pid: u32,
    },
}

/// What the side file of an index file tells a reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// Sealed, and the file is exactly what was sealed.
    Sealed,
    /// Marked open by this process id.
    Open(u32),
    /// Nothing to trust: no side file, an unreadable one, or a seal the file does not match.
    Unknown,
}

/// Where the seal of the index file at `path` is kept: the same name with `.seal` appended.
/// Copy it with the file (after the head has closed it) to keep the next open fast; a file
/// without its seal opens as safely, verified page by page.
pub fn seal_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".seal");
    PathBuf::from(name)
}

fn put(path: &Path, state: State) -> std::io::Result<()> {
    let bytes = codec::encode("seal", &Record { version: SEAL_VERSION, state }).map_err(std::io::Error::other)?;
    std::fs::write(seal_path(path), bytes)
}

/// Writes the seal of the file at `path`, which redb has just closed cleanly. Best effort: a
/// seal that is not written costs the next open a full check (and the side file is removed, so
/// that it does not go on naming a head that is gone).
pub(crate) fn write(path: &Path) -> std::io::Result<()> {
    let sealed = stat(path).and_then(|(len, modified)| {
        let digest = digest(path, len)?;
        put(path, State::Sealed { len, modified, digest })
    });
    if sealed.is_err() {
        let _ = std::fs::remove_file(seal_path(path));
    }
    sealed
}

/// Marks the file at `path` open by this process (a head opened it). Best effort: without the
/// mark, readers verify the file before reading it, as they do a closed one.
pub(crate) fn mark_open(path: &Path) {
    let _ = put(path, State::Open { pid: std::process::id() });
}

/// What the side file of `path` says, the seal checked against the file.
pub(crate) fn found(path: &Path) -> Found {
    let Ok(bytes) = std::fs::read(seal_path(path)) else { return Found::Unknown };
    let Ok(record) = codec::decode::<Record>("seal", &bytes) else { return Found::Unknown };
    match record.state {
        _ if record.version != SEAL_VERSION => Found::Unknown,
        State::Open { pid } => Found::Open(pid),
        State::Sealed { len, modified, digest: sealed } => {
            let same = stat(path).ok() == Some((len, modified)) && digest(path, len).is_ok_and(|d| d == sealed);
            if same { Found::Sealed } else { Found::Unknown }
        }
    }
}

/// Whether the file at `path` is exactly the file its seal was written for. Any doubt (no seal,
/// an unreadable one, a different length or time, a different digest) is `false`.
pub(crate) fn matches(path: &Path) -> bool {
    found(path) == Found::Sealed
}

fn stat(path: &Path) -> std::io::Result<(u64, u128)> {
    let meta = std::fs::metadata(path)?;
    let modified = meta.modified()?.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    Ok((meta.len(), modified))
}

/// blake3 over (length, the XXH64 of each 128 KiB chunk in order, little endian). The chunks
/// are checksummed in parallel; the result does not depend on how many threads did it. A file
/// that is not `len` bytes long is an error.
fn digest(path: &Path, len: u64) -> std::io::Result<[u8; 32]> {
    let chunks = usize::try_from(len.div_ceil(CHUNK as u64)).map_err(std::io::Error::other)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, MAX_THREADS).min(chunks.max(1));
    let per = chunks.div_ceil(threads).max(1);
    let mut leaves = vec![0u64; chunks];
    std::thread::scope(|scope| {
        let mut parts = leaves.chunks_mut(per).enumerate();
        let mine = parts.next();
        let handles: Vec<_> =
            parts.map(|(i, part)| scope.spawn(move || checksum_chunks(path, len, i * per, part))).collect();
        let mut result = mine.map_or(Ok(()), |(_, part)| checksum_chunks(path, len, 0, part));
        for handle in handles {
            result =
                result.and(handle.join().unwrap_or_else(|_| Err(std::io::Error::other("a digest thread panicked"))));
        }
        result
    })?;
    let mut hasher = blake3::Hasher::new();
    hasher.update(&len.to_le_bytes());
    for leaf in &leaves {
        hasher.update(&leaf.to_le_bytes());
    }
    Ok(*hasher.finalize().as_bytes())
}

/// Checksums chunks `start..start + out.len()` of the `len`-byte file into `out`, from its own
/// handle; a file shorter than that is an error.
fn checksum_chunks(path: &Path, len: u64, start: usize, out: &mut [u64]) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom};
    let mut file = File::open(path)?;
    file.seek(SeekFrom::Start((start * CHUNK) as u64))?;
    let mut buf = vec![0u8; CHUNK];
    for (i, leaf) in out.iter_mut().enumerate() {
        let offset = ((start + i) * CHUNK) as u64;
        let want = usize::try_from(len.saturating_sub(offset).min(CHUNK as u64)).map_err(std::io::Error::other)?;
        file.read_exact(&mut buf[..want])?;
        *leaf = xxh64(&buf[..want]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(dir: &Path, len: usize) -> PathBuf {
        let path = dir.join("f");
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&path, bytes).expect("write");
        path
    }

    #[test]
    fn a_seal_matches_its_file_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        for len in [0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 17] {
            let path = file_of(dir.path(), len);
            assert!(!matches(&path), "no seal yet");
            write(&path).expect("seal");
            assert!(matches(&path), "sealed, {len} bytes");
            if len > 0 {
                // One flipped bit anywhere, the length and time put back: refused.
                let mut bytes = std::fs::read(&path).expect("read");
                let modified = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
                bytes[len / 2] ^= 0x10;
                std::fs::write(&path, &bytes).expect("flip");
                File::options().write(true).open(&path).and_then(|f| f.set_modified(modified)).expect("set time");
                assert_eq!(stat(&path).expect("stat").0, len as u64);
                assert!(!matches(&path), "a flipped bit at {} of {len}", len / 2);
            }
            std::fs::remove_file(seal_path(&path)).expect("unseal");
            assert!(!matches(&path));
        }
    }

    #[test]
    fn the_digest_does_not_depend_on_the_threads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let len = 5 * CHUNK + 3;
        let path = file_of(dir.path(), len);
        let whole = digest(&path, len as u64).expect("digest");
        let mut leaves = [0u64; 6];
        checksum_chunks(&path, len as u64, 0, &mut leaves[..2]).expect("first");
        checksum_chunks(&path, len as u64, 2, &mut leaves[2..]).expect("rest");
        let mut hasher = blake3::Hasher::new();
        hasher.update(&(len as u64).to_le_bytes());
        leaves.iter().for_each(|l| {
            hasher.update(&l.to_le_bytes());
        });
        assert_eq!(*hasher.finalize().as_bytes(), whole);
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(leaves[5], xxh64(&bytes[5 * CHUNK..]));
        assert!(digest(&path, len as u64 + 1).is_err(), "a file shorter than its seal says");
        // A seal of a garbled or truncated record is refused, not trusted.
        std::fs::write(seal_path(&path), b"\x01\x02").expect("garble");
        assert!(!matches(&path));
        assert_eq!(found(&path), Found::Unknown);
        // Marked open: readers learn the head's process, and an open never trusts it as a seal.
        mark_open(&path);
        assert_eq!(found(&path), Found::Open(std::process::id()));
        assert!(!matches(&path));
        write(&path).expect("seal");
        assert_eq!(found(&path), Found::Sealed);
    }
}
