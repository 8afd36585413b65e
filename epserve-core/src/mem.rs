//! Huge pages for the large buffers a forward pass streams: packed weights
//! (experts, dense linears, the LM head) and the KV cache; and
//! [`tune_malloc`], which keeps a step's transient buffers mapped between
//! steps.
//!
//! A decode step reads hundreds of megabytes spread over 4 KiB pages: every
//! page is a TLB entry, the second-level TLB holds a few thousand, so the
//! stream takes a page walk every few kilobytes (under a hypervisor's nested
//! paging a costly one). Most Linux hosts run transparent huge pages
//! in `madvise` mode (the kernel default of many distributions, and this
//! project's machines), where only memory marked with `MADV_HUGEPAGE` gets
//! 2 MiB pages. A [`ZeroBuf`] of at least [`HUGE_PAGE`] bytes is its own
//! anonymous mapping, starting on a 2 MiB boundary and marked before it is
//! first touched, so every whole 2 MiB of it faults in as one huge page.
//!
//! `EPSERVE_HUGEPAGES=0` turns it off (read once: buffers are then heap
//! allocations, as before); the mark is a no-op where THP is `never` and
//! off Linux. No buffer takes more memory than its size (a huge page is only
//! used where a whole aligned 2 MiB range lies inside it), but a touched huge
//! page is committed whole: a KV cache's resident size grows in 2 MiB steps.

use std::sync::OnceLock;

/// The huge-page size the marked ranges are aligned to (x86-64 and arm64
/// with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// Whether the environment variable `var` switches something off (`0`,
/// `off`, `false` or `no`; unset or anything else leaves it on).
pub fn switched_off(var: &str) -> bool {
    matches!(
        std::env::var(var).as_deref(),
        Ok("0" | "off" | "false" | "no")
    )
}

/// Whether large [`ZeroBuf`]s are marked mappings (`EPSERVE_HUGEPAGES` is not `0`/`off`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| !switched_off("EPSERVE_HUGEPAGES"))
}

/// Most bytes glibc's `malloc` serves from its arenas rather than a fresh
/// mapping ([`tune_malloc`]): its own ceiling for the threshold.
pub const MALLOC_MMAP_THRESHOLD: usize = 32 << 20;
/// Free memory at the top of a `malloc` arena kept for reuse before it is
/// returned to the kernel ([`tune_malloc`]).
pub const MALLOC_TRIM_THRESHOLD: usize = 512 << 20;

/// Keeps a step's transient buffers (activations, q/k/v, expert inputs and
/// outputs: megabytes each at prefill) mapped from one step to the next.
///
/// By default glibc serves every allocation above 128 KiB (a threshold that
/// only adapts upwards after such a buffer is freed, and per arena trims
/// freed memory back to the kernel), so each prefill step mapped its buffers
/// afresh and paid a page fault and a zeroed page per 4 KiB: about a tenth of
/// a 2048-token prefill step on the bench model. This raises the mapping
/// threshold to [`MALLOC_MMAP_THRESHOLD`] and keeps up to
/// [`MALLOC_TRIM_THRESHOLD`] of freed arena memory, so the buffers are reused
/// (the weights and the KV cache are [`ZeroBuf`] mappings, not affected).
/// Skipped when `EPSERVE_MALLOC_TUNING` is `0`/`off` or `GLIBC_TUNABLES` sets
/// any `glibc.malloc` tunable (the operator's choice wins); a no-op off glibc.
/// Returns whether it applied. Call once at start, before worker threads.
pub fn tune_malloc() -> bool {
    if switched_off("EPSERVE_MALLOC_TUNING")
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."))
    {
        return false;
    }
    apply_malloc_tuning()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply_malloc_tuning() -> bool {
    let int = |v: usize| libc::c_int::try_from(v).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only sets glibc's allocator parameters (it takes the
    // arenas' locks itself); any value is valid to pass.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, int(MALLOC_MMAP_THRESHOLD)) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, int(MALLOC_TRIM_THRESHOLD)) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply_malloc_tuning() -> bool {
    false
}

/// An anonymous read-write mapping of at least `len` bytes whose first byte
/// lies on a [`HUGE_PAGE`] boundary, marked `MADV_HUGEPAGE` (Linux): every
/// whole 2 MiB of the buffer can then be one huge page. `mmap` alone places
/// a mapping on any base-page boundary, where a buffer of 2-5 MiB (an
/// expert's matrix) often holds one aligned 2 MiB range or none: on the bench
/// model only 1.9 of the 3.7 GB of packed weights were on huge pages. The
/// mapping is made 2 MiB longer, then its head before the boundary and its
/// tail past the buffer's pages are unmapped: still one VMA per buffer (a
/// `madvise` on a range inside would split it, nearing `vm.max_map_count`
/// with tens of thousands of experts), and no memory
/// committed beyond the buffer's own pages (the tail's last partial 2 MiB
/// is on base pages, as the mapping ends inside it).
struct AlignedMap {
    ptr: std::ptr::NonNull<u8>,
    /// The mapped bytes (the buffer's, rounded up to the base page).
    len: usize,
}

// SAFETY: the mapping is owned memory like a `Vec<u8>`'s: nothing else
// refers to it, and `&`/`&mut` access goes through `bytes`/`bytes_mut`.
unsafe impl Send for AlignedMap {}
// SAFETY: as above; shared access is read-only.
unsafe impl Sync for AlignedMap {}

impl AlignedMap {
    /// `bytes` zero bytes, or `None` where mapping fails (the caller falls
    /// back to the heap) or off Unix.
    #[cfg(unix)]
    fn new(bytes: usize) -> Option<AlignedMap> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        let len = bytes.checked_next_multiple_of(page)?;
        let total = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let b = base as usize;
        let start = b.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - b, b + total - (start + len));
        // SAFETY: both ranges lie inside the mapping just made, on page
        // boundaries (`base`, `start` and `len` are page multiples), and
        // nothing refers to them.
        unsafe {
            if head > 0 {
                libc::munmap(base, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        // A hint: where THP is `never` (or off Linux) nothing changes.
        // SAFETY: the range is this mapping.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        Some(AlignedMap {
            ptr: std::ptr::NonNull::new(start as *mut u8)?,
            len,
        })
    }

    #[cfg(not(unix))]
    fn new(_bytes: usize) -> Option<AlignedMap> {
        None
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` mapped, readable bytes, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made (its head and tail already gone);
        // no reference to it outlives `self`.
        #[cfg(unix)]
        unsafe {
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len);
        }
    }
}

/// One cache line of bytes: the storage unit of a small [`ZeroBuf`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);
// SAFETY: `Line` is `repr(C)` around a byte array whose size (64) equals its
// alignment, so it has no padding, and every bit pattern is valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; it is also `Copy` and `'static`.
unsafe impl bytemuck::Pod for Line {}

enum Storage {
    /// An anonymous mapping starting on a [`HUGE_PAGE`] boundary: fresh
    /// zero pages, untouched until written, and marked for huge pages
    /// before any is.
    Map(AlignedMap),
    /// Heap lines, for buffers smaller than a huge page (or with
    /// `EPSERVE_HUGEPAGES=0`, or where mapping failed).
    Heap(Vec<Line>),
}

/// A zero-initialized buffer of `len` plain values, at least 64-byte aligned
/// (cache lines; a mapping is page-aligned). One of at least [`HUGE_PAGE`]
/// bytes is its own anonymous mapping marked `MADV_HUGEPAGE` before first
/// touch: the allocator's zeroed memory cannot be, as an aligned
/// `alloc_zeroed` writes its zeros (faulting 4 KiB pages) before the caller
/// sees it. Pages stay unbacked until written, as with `calloc`.
pub struct ZeroBuf<T: bytemuck::Pod> {
    storage: Storage,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: bytemuck::Pod> ZeroBuf<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        const { assert!(std::mem::align_of::<T>() <= 64) };
        // As `vec![0; len]`: a size past the address space is a bug upstream.
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("buffer size overflows usize");
        let map = if bytes >= HUGE_PAGE && enabled() {
            AlignedMap::new(bytes)
        } else {
            None
        };
        let storage = map.map_or_else(
            || Storage::Heap(bytemuck::zeroed_vec(bytes.div_ceil(64))),
            Storage::Map,
        );
        ZeroBuf {
            storage,
            len,
            _t: std::marker::PhantomData,
        }
    }

    /// A copy of `v`.
    pub fn from_slice(v: &[T]) -> Self {
        let mut b = Self::zeroed(v.len());
        b.copy_from_slice(v);
        b
    }

    /// Whether the buffer is a mapping marked for huge pages.
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Map(_))
    }

    fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Map(m) => m.bytes(),
            Storage::Heap(v) => bytemuck::cast_slice(v),
        }
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for ZeroBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        let n = self.len * std::mem::size_of::<T>();
        bytemuck::cast_slice(&self.bytes()[..n])
    }
}

impl<T: bytemuck::Pod> std::ops::DerefMut for ZeroBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let n = self.len * std::mem::size_of::<T>();
        let bytes: &mut [u8] = match &mut self.storage {
            Storage::Map(m) => m.bytes_mut(),
            Storage::Heap(v) => bytemuck::cast_slice_mut(v),
        };
        bytemuck::cast_slice_mut(&mut bytes[..n])
    }
}

impl<T: bytemuck::Pod> Clone for ZeroBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for ZeroBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroBuf")
            .field("len", &self.len)
            .field("mapped", &self.is_mapped())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A freed 16 MiB buffer is reused by the next one of its size without
    /// a page fault per page (untuned glibc maps it afresh: 4096 faults).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn tuned_malloc_reuses_a_freed_step_buffer_without_faults() {
        assert!(apply_malloc_tuning());
        // Faults of this thread only: other tests run beside it.
        let faults = || {
            // SAFETY: getrusage writes the zeroed struct we own.
            unsafe {
                let mut u: libc::rusage = std::mem::zeroed();
                libc::getrusage(libc::RUSAGE_THREAD, &mut u);
                u.ru_minflt
            }
        };
        let n = (16 << 20) / 4;
        let pages = (n * 4 / 4096) as libc::c_long;
        let touch = |v: &mut Vec<f32>| {
            for x in v.iter_mut().step_by(1024) {
                *x = 1.0;
            }
            std::hint::black_box(v.as_ptr());
        };
        let mut a = vec![0.0f32; n];
        touch(&mut a);
        drop(a);
        let before = faults();
        let mut b = vec![0.0f32; n];
        touch(&mut b);
        let again = faults() - before;
        eprintln!("{again} page faults touching a reused 16 MiB buffer ({pages} pages)");
        assert!(again < pages / 4, "{again} faults of {pages} pages");
    }

    #[test]
    fn buffers_are_zeros_aligned_and_hold_what_is_written() {
        for len in [
            0usize,
            1,
            100,
            HUGE_PAGE / 2 - 3,
            HUGE_PAGE / 2,
            5 * HUGE_PAGE / 4 + 7,
        ] {
            let mut b: ZeroBuf<u16> = ZeroBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            assert_eq!(b.as_ptr() as usize % 64, 0);
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as u16;
            }
            let c = b.clone();
            assert!(c.iter().enumerate().all(|(i, &x)| x == i as u16));
            assert_eq!(b.is_mapped(), len * 2 >= HUGE_PAGE && enabled());
            if b.is_mapped() {
                // Every whole 2 MiB of a mapped buffer can be a huge page.
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
            }
        }
    }

    /// Many mapped buffers of odd sizes, made and dropped interleaved: each
    /// starts on a huge-page boundary, keeps what is written to it, and
    /// unmapping one (its trimmed head and tail gone before) leaves the
    /// others intact.
    #[test]
    fn aligned_mappings_stay_apart_and_drop_cleanly() {
        if !enabled() {
            return;
        }
        let sizes = [
            HUGE_PAGE,
            HUGE_PAGE + 1,
            5 * HUGE_PAGE / 4 + 7,
            3 * HUGE_PAGE - 4096,
        ];
        let mut kept = Vec::new();
        for (i, &n) in sizes.iter().cycle().take(12).enumerate() {
            let mut b: ZeroBuf<u8> = ZeroBuf::zeroed(n);
            assert!(b.is_mapped());
            assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
            b.fill(i as u8 + 1);
            if i % 3 == 1 {
                drop(b);
            } else {
                kept.push((i as u8 + 1, b));
            }
        }
        for (v, b) in &kept {
            assert!(b.iter().all(|x| x == v));
        }
    }

    /// The mapping (and only it) carries the kernel's `hg` flag, and once
    /// written it is backed by huge pages where the host has them.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_large_buffer_is_marked_for_huge_pages() {
        let mut b: ZeroBuf<u8> = ZeroBuf::zeroed(3 * HUGE_PAGE);
        if !enabled() {
            return;
        }
        b.fill(1);
        let (a0, n) = (b.as_ptr() as usize, b.len());
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let (mut inside, mut marked, mut huge_kb) = (false, false, 0u64);
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, e)) = range.split_once('-')
                && let (Ok(a), Ok(e)) = (usize::from_str_radix(a, 16), usize::from_str_radix(e, 16))
            {
                inside = a < a0 + n && e > a0;
                continue;
            }
            if !inside {
                continue;
            }
            if line.starts_with("VmFlags:") && line.contains(" hg") {
                marked = true;
            }
            if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                huge_kb += kb
                    .trim()
                    .trim_end_matches(" kB")
                    .parse::<u64>()
                    .unwrap_or(0);
            }
        }
        // Kernels without THP list no flag; then there is nothing to check.
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            return;
        }
        assert!(marked, "the mapping does not carry the hg flag");
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        eprintln!(
            "THP {}: {huge_kb} kB of the buffer on huge pages",
            mode.trim()
        );
    }
}

/// A shared output buffer that work items write disjoint parts of.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: an `Out` is only used inside the call that exclusively borrows the
// buffer it points to (an expert or linear phase, an attention merge), and
// every work item writes a disjoint set of indices (see `run_mut`).
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// Points at `v` (which the caller keeps borrowed while this is used).
    pub(crate) fn new(v: &mut [f32]) -> Self {
        Out {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }

    /// Indices `i..i + n` to write in place. Results are computed straight
    /// into them: a copy through a stack array cost a stall per run (its
    /// wide reload of the array's narrow stores cannot be forwarded), and a
    /// `memcpy` call per 8 or 16 values.
    ///
    /// # Safety
    /// No other thread may read or write those indices during the phase;
    /// the slice must be dropped before the phase ends.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn run_mut(&self, i: usize, n: usize) -> &mut [f32] {
        assert!(i <= self.len && n <= self.len - i);
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i), n) }
    }
}
