//! The process's allocator: mimalloc, told to return freed memory to the system soon, in small
//! pages.
//!
//! `serve` tokenizes every prompt, and `tokenizers` allocates for every token (its text, its
//! offsets, each split of the text): on the whole conversation trace glibc's allocator took
//! about a third of the head's CPU (its free lists, and `malloc_consolidate` before each large
//! block), and a head's renders wait for cores. mimalloc serves the same allocations in less.
//!
//! A head also keeps what its engines hold in chunks of 64-90 KiB that live as long as the
//! blocks do, among short-lived buffers. Two of mimalloc's defaults cost a head memory or CPU:
//! - its purge delay (a second): a freed page goes back to the system only that long after, which
//!   on the conversation trace kept ~200 MiB more resident. With none at all, a long prompt's
//!   buffers (its body, its ids, an engine's event batch of thousands of blocks) go back as they
//!   are freed and fault in again for the next: three times the CPU for a 110k-token prompt.
//!   [`PURGE_DELAY_MS`] keeps them between one request and the next;
//! - transparent huge pages on its arenas: a page faulted in again after a purge is zeroed 2 MiB
//!   at a time. Off for the process, the head ingests an engine's events in ~30% less CPU.
//!
//! An operator's `MIMALLOC_PURGE_DELAY` or `MIMALLOC_ALLOW_THP` is kept.

use mimalloc::MiMalloc;

#[global_allocator]
static ALLOCATOR: MiMalloc = MiMalloc;

/// Milliseconds before mimalloc returns a freed page to the system.
pub(crate) const PURGE_DELAY_MS: std::ffi::c_long = 10;

#[allow(unsafe_code)]
mod ffi {
    use std::ffi::{c_int, c_long};

    /// mimalloc's `mi_option_purge_delay` (`mimalloc.h`'s `mi_option_e`), milliseconds before
    /// freed memory is returned to the system.
    pub(super) const PURGE_DELAY: c_int = 15;

    /// mimalloc's `mi_option_allow_thp`: whether its arenas ask for transparent huge pages.
    pub(super) const ALLOW_THP: c_int = 43;

    /// Linux's `PR_SET_THP_DISABLE` and `PR_GET_THP_DISABLE` (`linux/prctl.h`).
    #[cfg(target_os = "linux")]
    pub(super) const PR_SET_THP_DISABLE: c_int = 41;
    #[cfg(all(target_os = "linux", test))]
    pub(super) const PR_GET_THP_DISABLE: c_int = 42;

    unsafe extern "C" {
        /// mimalloc's `void mi_option_set(mi_option_t option, long value)`.
        fn mi_option_set(option: c_int, value: c_long);
        /// mimalloc's `long mi_option_get(mi_option_t option)`.
        #[cfg(test)]
        fn mi_option_get(option: c_int) -> c_long;
        /// The C library's `int prctl(int option, ...)`.
        #[cfg(target_os = "linux")]
        fn prctl(option: c_int, ...) -> c_int;
    }

    /// Sets one of mimalloc's options.
    pub(super) fn set(option: c_int, value: c_long) {
        // SAFETY: `mi_option_set` takes an option index and a value by value and stores the value
        // in mimalloc's table of options; an index out of range is ignored (it checks).
        unsafe { mi_option_set(option, value) }
    }

    /// One of mimalloc's options now.
    #[cfg(test)]
    pub(super) fn get(option: c_int) -> c_long {
        // SAFETY: as `set`: reads the option's value from mimalloc's table.
        unsafe { mi_option_get(option) }
    }

    /// `prctl(option, value, 0, 0, 0)`, for the options that take one number; the kernel's
    /// answer (-1: refused).
    #[cfg(target_os = "linux")]
    pub(super) fn process_control(option: c_int, value: std::ffi::c_ulong) -> c_int {
        // SAFETY: the THP options read their arguments as unsigned longs and touch no memory of
        // the caller's; an option the kernel does not know is refused with EINVAL.
        unsafe { prctl(option, value, 0 as std::ffi::c_ulong, 0 as std::ffi::c_ulong, 0 as std::ffi::c_ulong) }
    }
}

/// Sets the purge delay and turns transparent huge pages off, unless the operator set them: the
/// first thing `main` does. (mimalloc's own THP option is read as its arenas are made, some
/// before `main`; the process-wide switch covers those too.)
pub(crate) fn configure() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        ffi::set(ffi::PURGE_DELAY, PURGE_DELAY_MS);
    }
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        ffi::set(ffi::ALLOW_THP, 0);
        #[cfg(target_os = "linux")]
        let _ = ffi::process_control(ffi::PR_SET_THP_DISABLE, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_pages_go_back_soon_and_small() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() || std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
            return;
        }
        // mimalloc's defaults, a second and huge pages allowed: the options this module sets
        // are those, as mimalloc.h numbers them.
        assert_eq!(ffi::get(ffi::PURGE_DELAY), 1000, "mimalloc's purge delay");
        assert_eq!(ffi::get(ffi::ALLOW_THP), 1, "mimalloc's allow_thp");
        configure();
        assert_eq!(ffi::get(ffi::PURGE_DELAY), PURGE_DELAY_MS);
        assert_eq!(ffi::get(ffi::ALLOW_THP), 0);
        #[cfg(target_os = "linux")]
        assert_eq!(ffi::process_control(ffi::PR_GET_THP_DISABLE, 0), 1, "THP off for the process");
    }
}
