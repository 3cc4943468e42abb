//! A count of the process's heap allocations, to measure what a message costs end to end
//! (`bench/allocations.sh`): socket, codec, session, broker and store together. Off unless
//! `WARREN_COUNT_ALLOCATIONS` is set when the broker starts; then each allocation adds to two
//! counters shared by every thread, which `/metrics` shows. Off, an allocation costs one
//! relaxed load more than the system allocator's own.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The system allocator, counting when asked to.
pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

fn count(size: usize) {
    if ON.load(Ordering::Relaxed) {
        COUNT.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(size as u64, Ordering::Relaxed);
    }
}

// SAFETY: every call goes to `System` unchanged; the counters are atomics that allocate
// nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Starts counting if the environment asks for it (`WARREN_COUNT_ALLOCATIONS` set, not `0`).
pub fn enable_from_env() {
    let on = std::env::var_os("WARREN_COUNT_ALLOCATIONS").is_some_and(|v| v != "0");
    if on {
        ON.store(true, Ordering::Relaxed);
    }
}

/// Allocations (reallocations included) and the bytes they asked for since counting began;
/// `None` when it is off.
pub fn totals() -> Option<(u64, u64)> {
    ON.load(Ordering::Relaxed)
        .then(|| (COUNT.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed)))
}

/// Free heap memory the allocator held at the last [`Trimmer::check`], and what it
/// released. glibc's malloc returns only the top of each heap by itself, so after a large
/// release in the middle of one (a deep queue drained, a quorum queue's snapshot read at a
/// start or its log replayed, once their contents went to `away/`) a node kept its peak as RSS,
/// which is also what its memory alarm measures: a member of a 1,000,000-message quorum queue
/// stayed at 805 MB after a restart where it held 353 MB before (380 MB once trimmed).
#[derive(Debug, Default)]
pub struct Trimmer {
    /// The allocator's free bytes after the last trim (or the lowest seen since).
    base: u64,
}

/// Free memory that grew by this much since the last trim is handed back.
const TRIM_GROWTH: u64 = 64 << 20;

impl Trimmer {
    /// Whether `free` bytes are [`TRIM_GROWTH`] more than after the last trim (or the lowest
    /// seen since); if so they count as trimmed from now on: the chunks stay free in the
    /// allocator's books once their pages went back, and only growth beyond them counts.
    fn grew(&mut self, free: u64) -> bool {
        self.base = self.base.min(free);
        if free < self.base.saturating_add(TRIM_GROWTH) {
            return false;
        }
        self.base = free;
        true
    }

    /// Hands the allocator's free memory back to the system (`malloc_trim`) when it grew by
    /// [`TRIM_GROWTH`] since the last time: a large release happened. Returns the free bytes
    /// it found then. Walks the heaps under their locks (milliseconds for hundreds of MB):
    /// for a periodic check, not a hot path. Elsewhere than glibc, nothing.
    pub fn check(&mut self) -> Option<u64> {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: mallinfo2 only reads the allocator's statistics.
            let free = unsafe { libc::mallinfo2() }.fordblks as u64;
            if !self.grew(free) {
                return None;
            }
            // SAFETY: malloc_trim takes no pointer and only returns free pages to the system.
            unsafe {
                libc::malloc_trim(0);
            }
            Some(free)
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counting_sees_an_allocation_once_it_is_on() {
        // The test binary's allocator is the system one: call this one directly.
        let layout = Layout::from_size_align(100, 8).expect("layout");
        ON.store(true, Ordering::Relaxed);
        let (n, b) = totals().expect("on");
        // SAFETY: a valid layout; freed with the same one.
        unsafe {
            let p = Counting.alloc(layout);
            assert!(!p.is_null());
            Counting.dealloc(p, layout);
        }
        let (n2, b2) = totals().expect("on");
        assert!(n2 > n && b2 >= b + 100);
    }

    /// 96 MiB freed in the middle of the heap (its top still held) is handed back once, and
    /// not again until more is freed.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_large_release_is_handed_back_once() {
        let mut trimmer = Trimmer::default();
        trimmer.check();
        // 64 KiB blocks stay in the heap (below glibc's mmap threshold); touched, so resident.
        let mut blocks: Vec<Vec<u8>> = (0..1536).map(|i| vec![i as u8; 64 << 10]).collect();
        let top = vec![1u8; 64 << 10];
        blocks.clear();
        assert!(
            trimmer.check().is_some(),
            "96 MiB freed in the middle of the heap"
        );
        drop(top);
    }

    /// Trimmed once per growth of the free memory, however often it is looked at; a lower
    /// figure (memory reused) is where the next growth counts from.
    #[test]
    fn free_memory_is_trimmed_once_per_growth() {
        let mut t = Trimmer::default();
        let mib = 1u64 << 20;
        assert!(!t.grew(10 * mib));
        assert!(t.grew(100 * mib), "grew by 90 MiB from the lowest seen");
        assert!(!t.grew(100 * mib), "the same free memory again");
        assert!(!t.grew(150 * mib), "50 MiB more is not enough");
        assert!(t.grew(170 * mib));
        assert!(!t.grew(20 * mib), "reused");
        assert!(t.grew(90 * mib), "70 MiB above the lowest seen since");
    }
}
