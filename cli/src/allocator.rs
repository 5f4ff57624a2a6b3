//! The process's allocator: mimalloc, counted, and told to keep the memory it frees.
//!
//! mimalloc rather than glibc's malloc because a training step frees and reallocates
//! megabytes of tensors: glibc gave them back to the kernel and took them again, so every step
//! paid page faults and freshly zeroed pages (a quarter of a GPT step on one core). mimalloc
//! by default still purges freed pages (its `purge_delay`, 1 s, times its arena multiplier),
//! and a GPT trainer still took ~3,500 page faults a second and spent ~11% of its CPU in the
//! kernel zeroing pages (a lone `configs/text-gpt.toml` node on one core; a purge delay of
//! 1000 ms set explicitly changed nothing). Never purging ([`keep_freed_memory`]) took that to
//! ~20 a second. The cost: the heap stays at its peak, the
//! size a training step needs again at the next step anyway.
//!
//! `cap` counts what is allocated (its limit left unbounded), because it can wrap another
//! allocator in a `static`: status reports the live heap from it (`node.memory.heap_bytes`), the
//! only memory figure that shows a leak apart from what the allocator keeps after a peak.

// The one FFI call, to set a mimalloc option; nothing else here is unsafe.
#![allow(unsafe_code)]

/// The global allocator.
#[global_allocator]
static ALLOCATOR: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

/// `mi_option_purge_delay` in mimalloc v3's `mi_option_t` (`mimalloc.h`), which
/// `libmimalloc-sys` names no constant for; the unit test checks it by its default.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Bytes allocated and not yet released, by [`ALLOCATOR`]'s count.
pub fn live_heap_bytes() -> u64 {
    ALLOCATOR.allocated() as u64
}

/// Tells mimalloc never to give freed pages back to the kernel (a purge delay of -1), so the
/// next step reuses them instead of faulting in zeroed ones, unless `MIMALLOC_PURGE_DELAY`
/// says otherwise (mimalloc reads it; that is how to measure the difference). Call once, first
/// thing in `main`.
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: `mi_option_set` only stores a number in mimalloc's option table; any option
    // index below `_mi_option_last` and any value are accepted, at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // SAFETY: reading an option is a table lookup (and, once, an environment read).
        let read = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            // mimalloc v3's documented default for `purge_delay`: 1000 ms. Another index
            // would read another option's default.
            assert_eq!(read(), 1000);
            keep_freed_memory();
            assert_eq!(read(), -1);
        }
    }
}
