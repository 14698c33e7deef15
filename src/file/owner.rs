//! The process a handle belongs to. A handle's threads (the commit thread, a sharing head's
//! runtime, a listener's subscribers), its locks' states and redb's view of the file are its
//! opening process's: a child made by `fork` gets a copy of the memory without the threads, with
//! locks that may be held forever and a redb state the parent goes on changing underneath. A
//! handle used there would commit a stale state over the parent's and destroy the file. So every
//! call checks that it runs in the process that opened the handle, before it takes any lock, and
//! a handle dropped in another process leaves everything as it is.

use crate::error::{Error, Result};

/// The process that opened a handle.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner {
    pid: u32,
}

impl Owner {
    /// This process.
    pub(crate) fn current() -> Owner {
        Owner { pid: std::process::id() }
    }

    /// Whether the caller runs in the process that opened the handle.
    pub(crate) fn is_current(self) -> bool {
        std::process::id() == self.pid
    }

    /// `Ok` in the process that opened the handle.
    ///
    /// # Errors
    /// [`Error::Forked`] in any other (a child made by `fork`).
    pub(crate) fn check(self) -> Result<()> {
        let here = std::process::id();
        if here == self.pid { Ok(()) } else { Err(Error::Forked { opened_by: self.pid, used_by: here }) }
    }
}
