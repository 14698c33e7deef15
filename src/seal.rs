//! The seal: a blake3 digest of the whole file, written beside it (`<file>.seal`) after a clean
//! close, so that the next open can trust the file without redb's page-by-page integrity check.
//!
//! Opening a file redb did not write (a flipped bit, a truncated copy) without that check can
//! answer wrongly or panic inside redb, and the check reads every page through redb's cache (a
//! read call, a checksum and a buffer per page), then commits. Reading the file in 1 MiB chunks
//! and hashing them on every core does the same job several times faster: if the digest matches,
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

use crate::codec;

/// Bytes hashed as one unit (a leaf of the digest).
const CHUNK: usize = 1 << 20;
/// Bytes read at a time.
const READ: usize = 1 << 17;
/// Most threads one digest uses.
const MAX_THREADS: usize = 8;
/// The seal format this build writes and reads.
const SEAL_VERSION: u32 = 1;

/// What a seal records of the file it was written for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Seal {
    /// [`SEAL_VERSION`].
    version: u32,
    /// The file's length.
    len: u64,
    /// Its modification time, nanoseconds since the epoch (a quick refusal before hashing).
    modified: u128,
    /// [`digest`] of its bytes.
    digest: [u8; 32],
}

/// Where the seal of the index file at `path` is kept: the same name with `.seal` appended.
/// Copy it with the file (after the head has closed it) to keep the next open fast; a file
/// without its seal opens as safely, verified page by page.
pub fn seal_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".seal");
    PathBuf::from(name)
}

/// Writes the seal of the file at `path`, which redb has just closed cleanly. Best effort: a
/// seal that is not written costs the next open a full check.
pub(crate) fn write(path: &Path) -> std::io::Result<()> {
    let (len, modified) = stat(path)?;
    let seal = Seal { version: SEAL_VERSION, len, modified, digest: digest(path, len)? };
    let bytes = codec::encode("seal", &seal).map_err(std::io::Error::other)?;
    std::fs::write(seal_path(path), bytes)
}

/// Whether the file at `path` is exactly the file its seal was written for. Any doubt (no seal,
/// an unreadable one, a different length or time, a different digest) is `false`.
pub(crate) fn matches(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(seal_path(path)) else { return false };
    let Ok(seal) = codec::decode::<Seal>("seal", &bytes) else { return false };
    if seal.version != SEAL_VERSION || stat(path).ok() != Some((seal.len, seal.modified)) {
        return false;
    }
    digest(path, seal.len).is_ok_and(|d| d == seal.digest)
}

fn stat(path: &Path) -> std::io::Result<(u64, u128)> {
    let meta = std::fs::metadata(path)?;
    let modified = meta.modified()?.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    Ok((meta.len(), modified))
}

/// blake3 over (length, the blake3 of each 1 MiB chunk in order). The chunks are hashed in
/// parallel; the result does not depend on how many threads did it. A file that is not `len`
/// bytes long is an error.
fn digest(path: &Path, len: u64) -> std::io::Result<[u8; 32]> {
    let chunks = usize::try_from(len.div_ceil(CHUNK as u64)).map_err(std::io::Error::other)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, MAX_THREADS).min(chunks.max(1));
    let per = chunks.div_ceil(threads).max(1);
    let mut leaves = vec![[0u8; 32]; chunks];
    std::thread::scope(|scope| {
        let mut parts = leaves.chunks_mut(per).enumerate();
        let mine = parts.next();
        let handles: Vec<_> =
            parts.map(|(i, part)| scope.spawn(move || hash_chunks(path, len, i * per, part))).collect();
        let mut result = mine.map_or(Ok(()), |(_, part)| hash_chunks(path, len, 0, part));
        for handle in handles {
            result =
                result.and(handle.join().unwrap_or_else(|_| Err(std::io::Error::other("a digest thread panicked"))));
        }
        result
    })?;
    let mut hasher = blake3::Hasher::new();
    hasher.update(&len.to_le_bytes());
    for leaf in &leaves {
        hasher.update(leaf);
    }
    Ok(*hasher.finalize().as_bytes())
}

/// Hashes chunks `start..start + out.len()` of the `len`-byte file into `out`, from its own
/// handle; a file shorter than that is an error.
fn hash_chunks(path: &Path, len: u64, start: usize, out: &mut [[u8; 32]]) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom};
    let mut file = File::open(path)?;
    file.seek(SeekFrom::Start((start * CHUNK) as u64))?;
    // Read in pieces that stay in the core's cache while they are hashed.
    let mut buf = vec![0u8; READ];
    for (i, leaf) in out.iter_mut().enumerate() {
        let offset = ((start + i) * CHUNK) as u64;
        let mut left = len.saturating_sub(offset).min(CHUNK as u64);
        let mut hasher = blake3::Hasher::new();
        while left > 0 {
            let piece = &mut buf[..usize::try_from(left.min(READ as u64)).map_err(std::io::Error::other)?];
            file.read_exact(piece)?;
            hasher.update(piece);
            left -= piece.len() as u64;
        }
        *leaf = *hasher.finalize().as_bytes();
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
        let mut leaves = [[0u8; 32]; 6];
        hash_chunks(&path, len as u64, 0, &mut leaves[..2]).expect("first");
        hash_chunks(&path, len as u64, 2, &mut leaves[2..]).expect("rest");
        let mut hasher = blake3::Hasher::new();
        hasher.update(&(len as u64).to_le_bytes());
        leaves.iter().for_each(|l| {
            hasher.update(l);
        });
        assert_eq!(*hasher.finalize().as_bytes(), whole);
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(leaves[5], *blake3::hash(&bytes[5 * CHUNK..]).as_bytes());
        // A seal of a garbled or truncated record is refused, not trusted.
        std::fs::write(seal_path(&path), b"\x01\x02").expect("garble");
        assert!(!matches(&path));
    }
}
