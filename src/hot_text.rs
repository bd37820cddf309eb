//! The binary's hottest code moved onto 2 MiB pages when a server starts.
//!
//! Why: a request at a modest rate finds its code cold, and each 4 KiB page of code it runs
//! costs an instruction-TLB miss, a walk of the page tables that a virtual machine doubles. A
//! release build lays out the functions the request path runs first
//! (`deploy/symbol-order.txt`) and starts its code on a 2 MiB boundary (`build.rs`), so the
//! first few MiB of code hold nearly all that a server runs (docs/profiling.md, the
//! seventy-first pass). Linux maps a file's code on 4 KiB pages (huge pages for file-backed
//! code need a kernel option most kernels lack), so [`move_onto_huge_pages`] copies that code
//! into anonymous memory backed by a transparent huge page and moves the copy over the
//! original in one `mremap`: the same bytes at the same addresses, never a moment without
//! them.
//!
//! It runs before any other thread exists, and only where the build prepared for it: a binary
//! whose code does not start on a 2 MiB boundary (a debug build, another linker's) is left as
//! it is, as is a machine that has no huge page to give or whose setting for them is
//! `never`.
// Mapping memory and moving it over the code are calls into the C library.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::io;

/// The size of a transparent huge page on x86-64 (a page table's level 2 entry).
const HUGE_PAGE: usize = 2 << 20;
/// How much of the code, from its start, is moved: two huge pages held 98% of a profile's
/// samples in the server's code at 200 requests a second, the first alone 93%.
const HOT_CODE: usize = 2 * HUGE_PAGE;
/// `madvise`'s synchronous collapse into huge pages (Linux 6.1 and later); the `libc` crate
/// defines it for glibc only, and the value is Linux's on every architecture.
const MADV_COLLAPSE: c_int = 25;
/// The machine's transparent huge page setting.
const THP_SETTING: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// Why the code stayed where it was.
#[derive(Debug, thiserror::Error)]
pub enum Unmoved {
    #[error("the executable's code segment was not found")]
    NoCode,
    #[error("the code does not start on a 2 MiB boundary (the build did not align it)")]
    Unaligned,
    #[error("transparent huge pages are set to `never` on this machine")]
    Refused,
    #[error("{0}")]
    System(#[from] io::Error),
}

/// Moves the first [`HOT_CODE`] bytes of the executable's code onto huge pages and returns how
/// many bytes moved. Call it before starting any thread.
pub fn move_onto_huge_pages() -> Result<usize, Unmoved> {
    let (start, len) = executable_code().ok_or(Unmoved::NoCode)?;
    let hot = hot_length(start, len)?;
    if hot == 0 {
        return Ok(0);
    }
    // `MADV_COLLAPSE` would collapse whatever the machine's setting: an operator's `never`
    // is kept here. Read only for a binary aligned for the move.
    let setting = std::fs::read_to_string(THP_SETTING).unwrap_or_default();
    if refuses_huge_pages(&setting) {
        return Err(Unmoved::Refused);
    }
    // SAFETY: `[start, start + hot)` lies inside the executable's code segment (found above),
    // whose bytes the copy keeps, and no other thread runs while it moves.
    unsafe { move_code(start as *mut c_void, hot)? };
    Ok(hot)
}

/// Whether the kernel's transparent huge page setting (its `enabled` file: the choices, the
/// one in force in brackets) is `never`.
fn refuses_huge_pages(setting: &str) -> bool {
    setting.contains("[never]")
}

/// How much of a code segment at `start`, `len` bytes long, to move: whole huge pages only,
/// since the page past the code's end holds other sections.
fn hot_length(start: usize, len: usize) -> Result<usize, Unmoved> {
    if !start.is_multiple_of(HUGE_PAGE) {
        return Err(Unmoved::Unaligned);
    }
    Ok(HOT_CODE.min(len - len % HUGE_PAGE))
}

/// The start and length of the executable's code segment in memory (its loadable segment with
/// execute permission), if it has one.
fn executable_code() -> Option<(usize, usize)> {
    unsafe extern "C" fn first_object(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        found: *mut c_void,
    ) -> c_int {
        // SAFETY: the C library hands a valid header table for the call's length; `found` is
        // the `Option` passed below.
        unsafe {
            let info = &*info;
            let found = &mut *found.cast::<Option<(usize, usize)>>();
            let headers = std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum));
            *found = headers
                .iter()
                .find(|header| header.p_type == libc::PT_LOAD && header.p_flags & libc::PF_X != 0)
                .map(|header| {
                    (
                        (info.dlpi_addr as usize).wrapping_add(header.p_vaddr as usize),
                        header.p_memsz as usize,
                    )
                });
        }
        1 // The executable comes first: stop there.
    }
    let mut found: Option<(usize, usize)> = None;
    // SAFETY: the callback reads only what the C library hands it and writes only `found`.
    unsafe { libc::dl_iterate_phdr(Some(first_object), (&raw mut found).cast()) };
    found
}

/// Replaces the code at `[start, start + len)` (whole huge pages, aligned) with a copy of it
/// on huge pages. Nothing changes unless every step succeeds.
///
/// # Safety
/// The range must be mapped readable and hold code no other thread is running.
unsafe fn move_code(start: *mut c_void, len: usize) -> io::Result<()> {
    // SAFETY: a fresh anonymous mapping, owned here until it is moved over the code.
    unsafe {
        let copy = aligned_anonymous(len)?;
        let moved = (|| {
            // Ask for huge pages as the copy faults in, and make sure of them after: a copy on
            // small pages would cost memory and gain nothing.
            check(libc::madvise(copy, len, libc::MADV_HUGEPAGE))?;
            std::ptr::copy_nonoverlapping(start.cast::<u8>(), copy.cast::<u8>(), len);
            check(libc::madvise(copy, len, MADV_COLLAPSE))?;
            check(libc::mprotect(copy, len, libc::PROT_READ | libc::PROT_EXEC))?;
            let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
            if libc::mremap(copy, len, len, flags, start) == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })();
        if moved.is_err() {
            libc::munmap(copy, len);
        }
        moved
    }
}

/// A readable, writable anonymous mapping of `len` bytes that starts on a huge page's boundary.
///
/// # Safety
/// The caller owns the mapping and unmaps it.
unsafe fn aligned_anonymous(len: usize) -> io::Result<*mut c_void> {
    let reserved = len
        .checked_add(HUGE_PAGE)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: an anonymous mapping anywhere; its slack before and after the aligned part is
    // unmapped at once.
    unsafe {
        let raw = libc::mmap(
            std::ptr::null_mut(),
            reserved,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let raw = raw as usize;
        let aligned = raw.next_multiple_of(HUGE_PAGE);
        if aligned > raw {
            libc::munmap(raw as *mut c_void, aligned - raw);
        }
        let tail = raw + reserved - (aligned + len);
        if tail > 0 {
            libc::munmap((aligned + len) as *mut c_void, tail);
        }
        Ok(aligned as *mut c_void)
    }
}

fn check(result: c_int) -> io::Result<()> {
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The addresses a line of `/proc/self/maps` or `smaps` maps (`from-to ...`), if it is a
    /// mapping's first line.
    fn mapped_range(line: &str) -> Option<std::ops::Range<usize>> {
        let (from, to) = line.split_whitespace().next()?.split_once('-')?;
        Some(usize::from_str_radix(from, 16).ok()?..usize::from_str_radix(to, 16).ok()?)
    }

    /// The huge pages backing the mapping that contains `address`, in KiB (`smaps`).
    fn huge_kib_at(address: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some(range) = mapped_range(line) {
                inside = range.contains(&address);
            } else if inside && let Some(rest) = line.strip_prefix("AnonHugePages:") {
                return rest.trim().trim_end_matches(" kB").parse().expect("a size");
            }
        }
        0
    }

    /// The permissions of the mapping that contains `address` (`maps`: `r-xp`, ...).
    fn permissions_at(address: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        maps.lines()
            .find(|line| mapped_range(line).is_some_and(|range| range.contains(&address)))
            .and_then(|line| line.split_whitespace().nth(1))
            .expect("a mapping")
            .to_owned()
    }

    #[test]
    fn moved_code_keeps_its_bytes_and_protection_and_sits_on_huge_pages() {
        let len = 2 * HUGE_PAGE;
        // SAFETY: a mapping of this test's own, made to stand for a code segment: bytes that
        // differ page to page, then read and execute only, as a binary's code is mapped.
        let (start, pattern) = unsafe {
            let start = aligned_anonymous(len).expect("a mapping");
            // Small pages, as a file's code is mapped, whatever the machine's default.
            check(libc::madvise(start, len, libc::MADV_NOHUGEPAGE)).expect("small pages");
            let pattern: Vec<u8> = (0..len).map(|i| (i / 4096 + i % 251) as u8).collect();
            std::ptr::copy_nonoverlapping(pattern.as_ptr(), start.cast::<u8>(), len);
            check(libc::mprotect(
                start,
                len,
                libc::PROT_READ | libc::PROT_EXEC,
            ))
            .expect("r-x");
            (start, pattern)
        };
        assert_eq!(
            huge_kib_at(start as usize),
            0,
            "small pages before the move"
        );

        // SAFETY: the range is this test's mapping, readable, and runs no code.
        let moved = unsafe { move_code(start, len) };

        // Moved or not (a kernel without huge pages to give), the bytes and their protection
        // are as they were.
        // SAFETY: still mapped, readable, `len` bytes.
        let after = unsafe { std::slice::from_raw_parts(start.cast::<u8>(), len) };
        assert!(
            after == pattern.as_slice(),
            "the same bytes at the same addresses"
        );
        assert_eq!(permissions_at(start as usize), "r-xp");
        let huge = huge_kib_at(start as usize);
        match moved {
            Ok(()) => assert_eq!(huge, 4096, "both huge pages in place"),
            Err(error) => assert_eq!(huge, 0, "left on small pages ({error})"),
        }
        // SAFETY: this test's mapping, unmapped once.
        unsafe { libc::munmap(start, len) };
    }

    #[test]
    fn a_machine_set_to_never_is_not_given_huge_pages() {
        assert!(refuses_huge_pages("always madvise [never]\n"));
        assert!(!refuses_huge_pages("always [madvise] never\n"));
        assert!(!refuses_huge_pages("[always] madvise never\n"));
        // A kernel without the setting: `MADV_COLLAPSE` answers for it.
        assert!(!refuses_huge_pages(""));
    }

    #[test]
    fn only_whole_huge_pages_of_aligned_code_move() {
        let mib = 1 << 20;
        assert!(matches!(
            hot_length(HUGE_PAGE + 4096, 8 * mib),
            Err(Unmoved::Unaligned)
        ));
        assert_eq!(hot_length(HUGE_PAGE, 22 * mib).ok(), Some(HOT_CODE));
        assert_eq!(hot_length(HUGE_PAGE, 3 * mib).ok(), Some(HUGE_PAGE));
        assert_eq!(hot_length(HUGE_PAGE, mib).ok(), Some(0));
    }

    #[test]
    fn the_executable_code_is_found_where_this_function_runs() {
        let (start, len) = executable_code().expect("the test binary's code");
        let here = the_executable_code_is_found_where_this_function_runs as *const () as usize;
        assert!((start..start + len).contains(&here));
    }
}
