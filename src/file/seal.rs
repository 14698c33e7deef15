//! The seal: a digest of the whole file, written into its side file (`<file>.seal`) at a clean
//! close, so that the next open can trust the file without redb's page-by-page integrity check.
//! While a head has the file open, the side file holds a mark instead (and the head's lock, see
//! `lock.rs`).
//!
//! Opening a file redb did not write (a flipped bit, a truncated copy) without that check can
//! answer wrongly or panic inside redb, and the check reads every page through redb's cache,
//! then commits. Reading the file once and hashing it with XXH3-128 does the same job at about
//! the speed of reading the file (on every core): if the digest matches, the bytes are exactly those redb left at
//! a clean close, so redb's own fast open is safe. If the seal is missing, unreadable, of another
//! version, or does not match (any write since, a crash, a flipped bit, a copy without its
//! seal), the open falls back to the full check: the seal can only save time, never make an open
//! trust a file it would not have trusted. It is not fsynced: a seal lost to power failure costs
//! one full check.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::store::codec;

/// The seal format this build writes and reads. Version 1 (a blake3 of per-chunk XXH64s) is
/// not read: a file sealed by it opens with the full check once, and is sealed anew at close.
const SEAL_VERSION: u32 = 2;
/// Bytes of the file hashed on their own (and read at once).
const PIECE_BYTES: usize = 1 << 20;
/// Bytes read at once: small enough that the copy out of the page cache is still in the core's
/// cache when it is hashed (reading whole pieces at once was slower by a third).
const READ_BYTES: usize = 128 << 10;

/// The side file: a version, then what it says of the index file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    /// [`SEAL_VERSION`].
    version: u32,
    mark: Mark,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Mark {
    /// Closed cleanly: the file as its head left it.
    Sealed {
        /// The file's length.
        len: u64,
        /// Its modification time, nanoseconds since the epoch (a quick refusal before hashing).
        modified: u128,
        /// XXH3-128 of its bytes.
        digest: u128,
    },
    /// Open by the head whose process id this is (for people: whether it is alive is the lock's
    /// business).
    Open {
        /// Its process id.
        pid: u32,
    },
}

/// Where the side file of the index file at `path` is kept: the same name with `.seal` appended.
pub(crate) fn seal_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".seal");
    PathBuf::from(name)
}

/// Replaces the side file's contents (through the head's handle, which holds the lock).
fn put(mut side: &File, mark: Mark) -> std::io::Result<()> {
    let bytes = codec::encode("seal", &Record { version: SEAL_VERSION, mark }).map_err(std::io::Error::other)?;
    side.set_len(0)?;
    side.seek(SeekFrom::Start(0))?;
    side.write_all(&bytes)
}

/// Seals the index file at `path`, which redb has just closed cleanly, into its side file.
/// Best effort: a seal that is not written costs the next open a full check (the side file is
/// emptied, so that it does not go on naming a head that is gone).
pub(crate) fn write_sealed(side: &File, path: &Path) -> std::io::Result<()> {
    let sealed =
        stat(path).and_then(|(len, modified)| put(side, Mark::Sealed { len, modified, digest: digest(path, len)? }));
    if sealed.is_err() {
        let _ = side.set_len(0);
    }
    sealed
}

/// Marks the index file open by this process: the seal no longer describes it. Best effort: a
/// reader trusts a seal only while no head holds the lock anyway.
pub(crate) fn write_open(side: &File) {
    let _ = put(side, Mark::Open { pid: std::process::id() });
}

/// Whether the index file at `path` is exactly the file its seal was written for. Any doubt (no
/// seal, an unreadable one, another version, a different length, time or digest) is `false`.
pub(crate) fn matches(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(seal_path(path)) else { return false };
    let Ok(record) = codec::decode::<Record>("seal", &bytes) else { return false };
    match record.mark {
        Mark::Sealed { len, modified, digest: sealed } if record.version == SEAL_VERSION => {
            stat(path).ok() == Some((len, modified)) && digest(path, len).is_ok_and(|d| d == sealed)
        }
        _ => false,
    }
}

/// Whether the side file read from `side` says a head wrote its index file: a seal of a
/// non-empty file, or the mark of a head (which marks only a file it has committed to). An empty,
/// unreadable or foreign side file says nothing.
pub(crate) fn claims_a_file(mut side: &File) -> bool {
    use std::io::Read;
    let mut bytes = Vec::new();
    if side.seek(SeekFrom::Start(0)).and_then(|_| side.read_to_end(&mut bytes)).is_err() {
        return false;
    }
    match codec::decode::<Record>("seal", &bytes) {
        Ok(Record { mark: Mark::Sealed { len, .. }, .. }) => len > 0,
        Ok(Record { mark: Mark::Open { .. }, .. }) => true,
        Err(_) => false,
    }
}

fn stat(path: &Path) -> std::io::Result<(u64, u128)> {
    let meta = std::fs::metadata(path)?;
    let modified = meta.modified()?.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    Ok((meta.len(), modified))
}

/// The seal's digest of the file's bytes: XXH3-128 over `len` (u64 LE) followed by the
/// XXH3-128 (u128 LE) of each [`PIECE_BYTES`] piece in order. The pieces are hashed on every
/// core, each thread reading its own with positioned reads; the digest depends only on the
/// bytes, never on the thread count. A file that is not `len` bytes long is an error.
fn digest(path: &Path, len: u64) -> std::io::Result<u128> {
    // Asked once: on Linux it reads the cgroup's CPU quota from files (~0.1 ms).
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    digest_on(path, len, *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get())))
}

/// [`digest`] with at most `threads` threads.
fn digest_on(path: &Path, len: u64, threads: usize) -> std::io::Result<u128> {
    let file = File::open(path)?;
    let actual = file.metadata()?.len();
    if actual != len {
        return Err(std::io::Error::other(format!("{actual} bytes where the seal says {len}")));
    }
    let pieces = usize::try_from(len.div_ceil(PIECE_BYTES as u64)).map_err(std::io::Error::other)?;
    let threads = threads.clamp(1, pieces.max(1));
    let mut hashes = vec![0u128; pieces];
    std::thread::scope(|scope| -> std::io::Result<()> {
        let file = &file;
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || -> std::io::Result<Vec<(usize, u128)>> {
                    let mut buf = vec![0u8; READ_BYTES];
                    let mut out = Vec::new();
                    for piece in (t..pieces).step_by(threads) {
                        let start = piece as u64 * PIECE_BYTES as u64;
                        let end = (start + PIECE_BYTES as u64).min(len);
                        let mut hasher = Xxh3::new();
                        let mut at = start;
                        while at < end {
                            let n =
                                usize::try_from((end - at).min(READ_BYTES as u64)).map_err(std::io::Error::other)?;
                            let chunk = buf.get_mut(..n).ok_or_else(|| {
                                std::io::Error::other(format!("a read of {n} bytes into a buffer of {READ_BYTES}"))
                            })?;
                            read_exact_at(file, chunk, at)?;
                            hasher.update(chunk);
                            at += n as u64;
                        }
                        out.push((piece, hasher.digest128()));
                    }
                    Ok(out)
                })
            })
            .collect();
        for worker in workers {
            let done = worker.join().map_err(|_| std::io::Error::other("a seal hashing thread panicked"))??;
            for (piece, hash) in done {
                let slot = hashes.get_mut(piece).ok_or_else(|| {
                    std::io::Error::other(format!("a hash of piece {piece} of a file of {pieces} pieces"))
                })?;
                *slot = hash;
            }
        }
        Ok(())
    })?;
    let mut joined = Vec::with_capacity(8 + 16 * pieces);
    joined.extend_from_slice(&len.to_le_bytes());
    for hash in hashes {
        joined.extend_from_slice(&hash.to_le_bytes());
    }
    Ok(xxhash_rust::xxh3::xxh3_128(&joined))
}

/// Fills `buf` from `file` at offset `at`, without moving a shared cursor.
fn read_exact_at(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, at)
    }
    #[cfg(windows)]
    {
        let mut done = 0;
        while let Some(rest) = buf.get_mut(done..).filter(|rest| !rest.is_empty()) {
            let n = std::os::windows::fs::FileExt::seek_read(file, rest, at + done as u64)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]
    use super::*;

    fn file_of(dir: &Path, len: usize) -> PathBuf {
        let path = dir.join("f");
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&path, bytes).expect("write");
        path
    }

    fn side(path: &Path) -> File {
        File::options().read(true).write(true).create(true).truncate(false).open(seal_path(path)).expect("side file")
    }

    #[test]
    fn a_seal_matches_its_file_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        for len in [0, 1, PIECE_BYTES - 1, PIECE_BYTES, 3 * PIECE_BYTES + 17] {
            let path = file_of(dir.path(), len);
            assert!(!matches(&path), "no seal yet");
            write_sealed(&side(&path), &path).expect("seal");
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
    fn the_digest_is_of_the_bytes_whatever_the_thread_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_of(dir.path(), 5 * PIECE_BYTES + 3);
        let len = stat(&path).expect("stat").0;
        let one = digest_on(&path, len, 1).expect("digest");
        for threads in [2, 3, 8] {
            assert_eq!(digest_on(&path, len, threads).expect("digest"), one, "{threads} threads");
        }
        // The definition: XXH3-128 of the length and each piece's XXH3-128.
        let bytes = std::fs::read(&path).expect("read");
        let mut joined = len.to_le_bytes().to_vec();
        for piece in bytes.chunks(PIECE_BYTES) {
            joined.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(piece).to_le_bytes());
        }
        assert_eq!(one, xxhash_rust::xxh3::xxh3_128(&joined));
    }

    #[test]
    fn a_mark_an_old_version_or_a_garbled_record_is_never_a_seal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_of(dir.path(), 5000);
        let side = side(&path);
        write_sealed(&side, &path).expect("seal");
        assert!(matches(&path));
        assert!(digest(&path, 5001).is_err(), "a file shorter than its seal says");
        write_open(&side);
        assert!(!matches(&path), "marked open");
        // The same seal, as a record of another version: refused (and so, one full check).
        let (len, modified) = stat(&path).expect("stat");
        let sealed = Mark::Sealed { len, modified, digest: digest(&path, len).expect("digest") };
        for version in [1, SEAL_VERSION + 1] {
            let bytes = codec::encode("seal", &Record { version, mark: sealed.clone() }).expect("encode");
            std::fs::write(seal_path(&path), bytes).expect("write");
            assert!(!matches(&path), "version {version}");
        }
        std::fs::write(seal_path(&path), b"\x02\x00\x01").expect("garble");
        assert!(!matches(&path));
        write_sealed(&side, &path).expect("seal");
        assert!(matches(&path), "sealed anew");
    }
}
