//! The binary's global allocator: mimalloc, entered through its plain functions wherever
//! they already give the alignment a layout asks for.
//!
//! The `mimalloc` crate's allocator sends every request through mimalloc's aligned entry
//! points, whose fast path checks the alignment and then the free block's address before it
//! allocates (~24 more instructions a call than `mi_malloc`, ~455 allocations a chat
//! request: docs/profiling.md, the thirty-fourth pass). Almost every Rust layout asks for
//! an alignment of 8 bytes or less, which every plain block has; this allocator takes the
//! aligned entries only where a plain block may not do.
//!
//! The rule is the one Rust's own `System` allocator uses over `malloc`: a layout whose
//! alignment is at most [`PLAIN_ALIGN`] and at most its size. mimalloc's blocks of 16 bytes
//! and more come in multiples of 16 bytes from a 16-aligned start (its `MI_MAX_ALIGN_SIZE`,
//! as C's `malloc` must give for any type), and its 8-byte blocks are 8-aligned, so a size
//! of at least the alignment always lands on a multiple of it.

// The allocator is C functions behind raw pointers: `GlobalAlloc` is an unsafe trait.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The largest alignment every plain mimalloc block of at least that many bytes has.
const PLAIN_ALIGN: usize = 16;

/// Whether a plain block of `size` bytes is aligned to `align`.
#[inline]
fn plain_block_suffices(align: usize, size: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

/// A new block for `layout`, from mimalloc's `plain` entry where a plain block suffices,
/// else from its `aligned` one.
#[inline(always)]
unsafe fn new_block(
    layout: Layout,
    plain: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    let (size, align) = (layout.size(), layout.align());
    // SAFETY: the entries are mimalloc's allocating functions, plain where a plain block has
    // the alignment (the module doc), aligned otherwise.
    let block = unsafe {
        if plain_block_suffices(align, size) {
            plain(size)
        } else {
            aligned(size, align)
        }
    };
    block.cast()
}

/// mimalloc as the global allocator (`#[global_allocator]` in `main.rs`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Allocator;

// SAFETY: every block comes from mimalloc and goes back to it; a layout that a plain block
// may not satisfy goes through mimalloc's aligned functions, which honour any power of two
// (`Layout` guarantees one). `mi_free` and `mi_realloc*` take blocks from either entry.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: a new block, as `GlobalAlloc::alloc` asks.
        unsafe { new_block(layout, mi::mi_malloc, mi::mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: a new zeroed block, as `GlobalAlloc::alloc_zeroed` asks.
        unsafe { new_block(layout, mi::mi_zalloc, mi::mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator, so from mimalloc.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        // SAFETY: `ptr` came from mimalloc; the block it may move to must satisfy `align` at
        // the new size, which is what decides the entry.
        unsafe {
            if plain_block_suffices(align, new_size) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, align).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes around every small size class, medium and large ones, for each alignment.
    fn layouts() -> Vec<Layout> {
        let mut sizes: Vec<usize> = (1..=1024).collect();
        sizes.extend([
            1500,
            4095,
            4096,
            8000,
            65_536,
            100_000,
            1 << 20,
            (4 << 20) + 8,
        ]);
        let mut layouts = Vec::new();
        for align in [1, 2, 4, 8, 16, 32, 64, 4096] {
            for &size in &sizes {
                if let Ok(layout) = Layout::from_size_align(size, align) {
                    layouts.push(layout);
                }
            }
        }
        layouts
    }

    fn is_aligned(ptr: *mut u8, align: usize) -> bool {
        !ptr.is_null() && (ptr as usize).is_multiple_of(align)
    }

    #[test]
    fn every_block_has_its_layouts_alignment() {
        let allocator = Allocator;
        for layout in layouts() {
            // Several at once, so that later blocks come from inside a page, not its start.
            let blocks: Vec<*mut u8> = (0..4).map(|_| unsafe { allocator.alloc(layout) }).collect();
            for &ptr in &blocks {
                assert!(is_aligned(ptr, layout.align()), "{layout:?} gave {ptr:p}");
                // The whole block is ours to write.
                unsafe { ptr.write_bytes(0xA5, layout.size()) };
            }
            let zeroed = unsafe { allocator.alloc_zeroed(layout) };
            assert!(is_aligned(zeroed, layout.align()), "{layout:?} zeroed");
            let bytes = unsafe { std::slice::from_raw_parts(zeroed, layout.size()) };
            assert!(bytes.iter().all(|&byte| byte == 0), "{layout:?} not zeroed");
            for ptr in blocks.into_iter().chain([zeroed]) {
                unsafe { allocator.dealloc(ptr, layout) };
            }
        }
    }

    #[test]
    fn a_reallocated_block_keeps_its_bytes_and_alignment() {
        let allocator = Allocator;
        for align in [1, 8, 16, 64] {
            let mut layout = Layout::from_size_align(align, align).unwrap_or(Layout::new::<u8>());
            let mut ptr = unsafe { allocator.alloc(layout) };
            unsafe { ptr.write_bytes(7, layout.size()) };
            // Grows through the small, medium and large classes, then shrinks.
            for new_size in [24, 100, 1000, 40_000, 3 << 20, 48, align.max(9)] {
                ptr = unsafe { allocator.realloc(ptr, layout, new_size) };
                assert!(
                    is_aligned(ptr, align),
                    "align {align}, size {new_size}: {ptr:p}"
                );
                let kept = layout.size().min(new_size);
                let bytes = unsafe { std::slice::from_raw_parts(ptr, kept) };
                assert!(
                    bytes.iter().all(|&byte| byte == 7),
                    "align {align}, size {new_size}"
                );
                unsafe { ptr.write_bytes(7, new_size) };
                layout = Layout::from_size_align(new_size, align).unwrap_or(layout);
            }
            unsafe { allocator.dealloc(ptr, layout) };
        }
    }
}
