//! A fault-injecting redb storage backend: keeps the live image (what the process wrote) and the
//! durable image (what the last sync made safe), records every operation so crash images can be
//! built at any point, and fails writes or syncs on demand (I/O error, disk full).
#![allow(dead_code)]

use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use redb::StorageBackend;

/// One operation redb asked of the storage.
#[derive(Clone, Debug)]
pub enum Op {
    Write(u64, Vec<u8>),
    SetLen(u64),
    Sync,
}

#[derive(Debug, Default)]
pub struct DiskState {
    pub live: Vec<u8>,
    pub durable: Vec<u8>,
    pub ops: Vec<Op>,
    pub record: bool,
    pub fail_writes: bool,
    pub fail_syncs: bool,
    /// Writes or growth past this many bytes fail with "no space left on device".
    pub limit: Option<u64>,
}

/// A disk shared between the test and the backend redb holds.
#[derive(Clone, Debug, Default)]
pub struct Disk(pub Arc<Mutex<DiskState>>);

impl Disk {
    pub fn with_image(bytes: Vec<u8>) -> Disk {
        Disk(Arc::new(Mutex::new(DiskState { live: bytes.clone(), durable: bytes, ..DiskState::default() })))
    }

    pub fn state(&self) -> MutexGuard<'_, DiskState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn backend(&self) -> FaultBackend {
        FaultBackend(self.clone())
    }
}

#[derive(Debug)]
pub struct FaultBackend(pub Disk);

fn apply(image: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write(offset, data) => {
            let end = *offset as usize + data.len();
            if image.len() < end {
                image.resize(end, 0);
            }
            image[*offset as usize..end].copy_from_slice(data);
        }
        Op::SetLen(len) => image.resize(*len as usize, 0),
        Op::Sync => {}
    }
}

/// The images a crash right before operation `k` can leave: only what was synced; everything
/// written (the OS flushed it all); and a torn flush of the first half of the unsynced writes.
pub fn crash_images(start: &[u8], ops: &[Op], k: usize) -> Vec<Vec<u8>> {
    let mut durable = start.to_vec();
    let mut pending: Vec<&Op> = Vec::new();
    for op in &ops[..k] {
        match op {
            Op::Sync => {
                for p in pending.drain(..) {
                    apply(&mut durable, p);
                }
            }
            op => pending.push(op),
        }
    }
    let mut all = durable.clone();
    let mut torn = durable.clone();
    for (i, p) in pending.iter().enumerate() {
        apply(&mut all, p);
        if i < pending.len() / 2 {
            apply(&mut torn, p);
        }
    }
    vec![durable, all, torn]
}

fn enospc() -> io::Error {
    io::Error::new(io::ErrorKind::StorageFull, "no space left on device (injected)")
}

impl StorageBackend for FaultBackend {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.0.state().live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        let state = self.0.state();
        let src = state
            .live
            .get(offset as usize..offset as usize + out.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        let mut state = self.0.state();
        if state.limit.is_some_and(|l| len > l) {
            return Err(enospc());
        }
        if state.record {
            state.ops.push(Op::SetLen(len));
        }
        state.live.resize(len as usize, 0);
        Ok(())
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        let mut state = self.0.state();
        if state.fail_syncs {
            return Err(io::Error::other("sync failed (injected)"));
        }
        if state.record {
            state.ops.push(Op::Sync);
        }
        state.durable = state.live.clone();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        let mut state = self.0.state();
        if state.fail_writes {
            return Err(io::Error::other("write failed (injected)"));
        }
        if state.limit.is_some_and(|l| offset + data.len() as u64 > l) {
            return Err(enospc());
        }
        if state.record {
            state.ops.push(Op::Write(offset, data.to_vec()));
        }
        let op = Op::Write(offset, data.to_vec());
        apply(&mut state.live, &op);
        Ok(())
    }
}
