//! The process's allocator: mimalloc, told to return freed memory to the system at once.
//!
//! `serve` tokenizes every prompt, and `tokenizers` allocates for every token (its text, its
//! offsets, each split of the text): on the whole conversation trace glibc's allocator took
//! about a third of the head's CPU (its free lists, and `malloc_consolidate` before each large
//! block), and a head's renders wait for cores. mimalloc serves the same allocations in less.
//! A head also keeps what its engines hold in chunks of 64-90 KiB that live as long as the
//! blocks do, among short-lived buffers: mimalloc returns a freed page to the system only after
//! its purge delay (a second by default), which on that trace kept ~200 MiB more resident; with
//! no delay the head holds what glibc held.

use mimalloc::MiMalloc;

#[global_allocator]
static ALLOCATOR: MiMalloc = MiMalloc;

#[allow(unsafe_code)]
mod ffi {
    /// mimalloc's `mi_option_purge_delay` (`mimalloc.h`'s `mi_option_e`: the 16th option),
    /// milliseconds before freed memory is returned to the system.
    pub(super) const PURGE_DELAY: i32 = 15;

    unsafe extern "C" {
        /// mimalloc's `void mi_option_set(mi_option_t option, long value)`.
        fn mi_option_set(option: i32, value: std::ffi::c_long);
        /// mimalloc's `long mi_option_get(mi_option_t option)`.
        #[cfg(test)]
        fn mi_option_get(option: i32) -> std::ffi::c_long;
    }

    /// Sets one of mimalloc's options.
    pub(super) fn set(option: i32, value: std::ffi::c_long) {
        // SAFETY: `mi_option_set` takes an option index and a value by value and stores the value
        // in mimalloc's table of options; an index out of range is ignored (it checks).
        unsafe { mi_option_set(option, value) }
    }

    /// One of mimalloc's options now.
    #[cfg(test)]
    pub(super) fn get(option: i32) -> std::ffi::c_long {
        // SAFETY: as `set`: reads the option's value from mimalloc's table.
        unsafe { mi_option_get(option) }
    }
}

/// Returns freed memory at once, unless the operator set a delay (`MIMALLOC_PURGE_DELAY`): the
/// first thing `main` does.
pub(crate) fn configure() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        ffi::set(ffi::PURGE_DELAY, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_memory_is_returned_at_once() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // mimalloc's default purge delay is a second: the option this module sets is that one.
        assert_eq!(ffi::get(ffi::PURGE_DELAY), 1000, "mimalloc's purge delay, as mimalloc.h numbers it");
        configure();
        assert_eq!(ffi::get(ffi::PURGE_DELAY), 0);
    }
}
