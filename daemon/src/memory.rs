//! The node's own memory, as status reports it: what its allocations hold, and what is
//! resident.
//!
//! Resident memory is the kernel's count. It also holds what the allocator keeps after a
//! peak (glibc returns freed memory to the kernel lazily, and pages of a reserved buffer count
//! only once touched), so a step in it does not say the node holds more. The heap count does:
//! the binary counts every allocation and release in its global allocator and registers that
//! count here with [`count_heap_with`] (a library does not choose the process's allocator).
//! It covers what Rust allocates through the global allocator: not the allocator's own
//! overhead, nor what C code allocates with `malloc` directly.

use std::sync::OnceLock;

/// The binary's count of bytes allocated and not yet released.
static HEAP_COUNTER: OnceLock<fn() -> u64> = OnceLock::new();

/// Registers the binary's live-heap count. Only the first registration counts.
pub fn count_heap_with(counter: fn() -> u64) {
    let _ = HEAP_COUNTER.set(counter);
}

/// Bytes the process's allocations hold now; `None` when the binary counts none.
pub fn heap_bytes() -> Option<u64> {
    HEAP_COUNTER.get().map(|count| count())
}

/// The process's resident memory in bytes (`VmRSS`); `None` where `/proc` does not say.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            let rss = resident_bytes().expect("VmRSS");
            assert!(rss > 1024 * 1024, "{rss}");
        }
    }
}
