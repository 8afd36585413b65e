//! Huge pages for the large buffers a forward pass streams: packed weights
//! (experts, dense linears, the LM head) and the KV cache.
//!
//! A decode step reads hundreds of megabytes spread over 4 KiB pages: every
//! page is a TLB entry, the second-level TLB holds a few thousand, so the
//! stream takes a page walk every few kilobytes, and the hardware prefetchers
//! stop at every 4 KiB boundary. Most Linux hosts run transparent huge pages
//! in `madvise` mode (the kernel default of many distributions, and this
//! project's machines), where only memory marked with `MADV_HUGEPAGE` gets
//! 2 MiB pages. [`advise`] marks the whole 2 MiB pages inside a fresh
//! allocation before it is first touched, so its faults map huge pages.
//!
//! `EPSERVE_HUGEPAGES=0` turns it off (read once); it is a no-op where THP
//! is `never`, off Linux, and for buffers too small to hold a whole 2 MiB
//! page. Memory use does not change: only pages inside the buffer are marked.

use std::sync::OnceLock;

/// The huge-page size the marked ranges are aligned to (x86-64 and arm64
/// with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// Whether [`advise`] marks anything (`EPSERVE_HUGEPAGES` is not `0`/`off`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("EPSERVE_HUGEPAGES").as_deref(),
            Ok("0" | "off" | "false" | "no")
        )
    })
}

/// The whole huge pages inside `len` bytes at address `addr`: `(start, len)`,
/// `len == 0` when there is none.
pub fn huge_range(addr: usize, len: usize) -> (usize, usize) {
    let start = addr.next_multiple_of(HUGE_PAGE);
    let end = (addr + len) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        (start, end - start)
    } else {
        (start, 0)
    }
}

/// Asks the kernel to back the whole 2 MiB pages inside `buf` with huge
/// pages (a hint: failures are ignored, the contents are untouched). Call it
/// on a fresh allocation before writing it, so its first faults map huge
/// pages; on touched memory the kernel may collapse the pages later.
pub fn advise<T>(buf: &[T]) {
    let (start, len) = huge_range(buf.as_ptr() as usize, std::mem::size_of_val(buf));
    if len == 0 || !enabled() {
        return;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: `start..start + len` lies inside `buf`'s allocation and is
    // page-aligned; MADV_HUGEPAGE changes how the range is backed, never its
    // contents or mapping, so no Rust reference is invalidated.
    unsafe {
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
}

/// `n` zeros in a fresh allocation marked for huge pages ([`advise`]); the
/// allocation is fresh zero pages (calloc), untouched until written.
pub fn zeroed_vec<T: bytemuck::Zeroable + Clone>(n: usize) -> Vec<T> {
    let v = bytemuck::zeroed_vec(n);
    advise(&v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_is_the_whole_huge_pages_inside() {
        assert_eq!(huge_range(0, HUGE_PAGE), (0, HUGE_PAGE));
        assert_eq!(huge_range(1, HUGE_PAGE).1, 0);
        assert_eq!(huge_range(4096, 3 * HUGE_PAGE), (HUGE_PAGE, 2 * HUGE_PAGE));
        assert_eq!(huge_range(HUGE_PAGE - 64, 64).1, 0);
        assert_eq!(huge_range(10, 100).1, 0);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_large_buffer_is_marked_and_keeps_its_zeros() {
        let v: Vec<u16> = zeroed_vec(5 * HUGE_PAGE / 2);
        assert!(v.iter().all(|&x| x == 0));
        let (start, len) = huge_range(v.as_ptr() as usize, v.len() * 2);
        assert!(len >= 3 * HUGE_PAGE / 2 && len % HUGE_PAGE == 0);
        // The kernel lists the marked range with the `hg` flag (when THP is
        // compiled in and the hint was taken; nothing to check otherwise).
        if !enabled() || !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            return;
        }
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut marked = false;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = a <= start && start + len <= b || (a >= start && b <= start + len);
                continue;
            }
            if inside && line.starts_with("VmFlags:") && line.contains(" hg") {
                marked = true;
            }
        }
        assert!(marked, "no mapping inside the buffer carries the hg flag");
    }
}
