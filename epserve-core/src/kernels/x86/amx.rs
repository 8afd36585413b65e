//! AMX tiles (Intel Sapphire Rapids and later) for the MoE *prefill* path:
//! `tdpbf16ps` (bf16 × bf16 → f32) and `tdpbssd` (s8 × s8 → i32) on 16 × 16
//! output tiles. One instruction multiplies a 16-token × 32-`k` bf16 tile
//! (16 × 64 `k` for int8) by a 32-`k` × 16-channel weight tile: 8192 (16384)
//! multiply-adds, sixteen times a zmm FMA's work per instruction.
//!
//! Layouts (see [`crate::kernels::layout`]):
//! - `A` (activations): token rows, 64 bytes (32 bf16 / 64 int8 `k`s) per
//!   tile row, any row stride: the AMX planning
//!   (`kernels/amx_plan.rs`) packs each expert's rows contiguously
//!   with `K` zero-padded to whole tiles.
//! - `B` (weights): 16 rows of 64 bytes, row `r` = `k`-pair (bf16) or
//!   `k`-quad (int8) `r`, channel `c` at bytes `4c..4c+4`. Panels *are* this
//!   layout on x86 (16 `k`-pairs of a bf16 panel, or 8 groups = 16 `k`-quad
//!   rows of an int8 panel, are one tile), so weights are read in place.
//! - `C` (accumulators): 16 token rows × 16 channels of f32/i32, 64 bytes per
//!   row — the `acc[t · 16 + c]` layout of every other tile kernel.
//!
//! The tile registers are configured once per work item ([`configure`]) and
//! released after it ([`release`]): all eight are 16 rows × 64 bytes
//! (`tmm0..3` C, `tmm4..5` A, `tmm6..7` B). Linux hands out AMX state only
//! after `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, which
//! [`supported`] requests once; without it the first tile instruction would
//! fault. The instructions are written as inline assembly (the AMX intrinsics
//! are not stable Rust); everything here is `unsafe` and only reached through
//! [`crate::kernels::dispatch::Kernels`] of a tier that checked [`supported`].

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use crate::kernels::layout::{
    AMX_BF16_TILE_K as BF16_TILE_K, AMX_ROW_BYTES as TILE_ROW_BYTES, AMX_TILE_M as TILE_M,
};

/// Whether this CPU and kernel let this process use AMX-BF16 and AMX-INT8:
/// CPUID's AMX-TILE/BF16/INT8 bits, the OS enabling tile state in XCR0, and
/// Linux granting this process the tile data permission (requested here,
/// once).
pub fn supported() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| {
        // SAFETY: CPUID leaf 7 exists on every x86_64 CPU with AVX-512 (the
        // callers check those tiers first); on older CPUs it returns zeros.
        #[allow(unused_unsafe)]
        let l7 = unsafe { __cpuid_count(7, 0) };
        let (bf16, tile, int8) = (
            l7.edx >> 22 & 1 == 1,
            l7.edx >> 24 & 1 == 1,
            l7.edx >> 25 & 1 == 1,
        );
        // SAFETY: leaf 1 always exists.
        #[allow(unused_unsafe)]
        let l1 = unsafe { __cpuid(1) };
        let osxsave = l1.ecx >> 27 & 1 == 1;
        if !(bf16 && tile && int8 && osxsave) {
            return false;
        }
        // SAFETY: OSXSAVE is set, so XGETBV is available.
        let xcr0 = unsafe { xcr0() };
        if xcr0 >> 17 & 3 != 3 {
            return false;
        }
        request_tile_permission()
    })
}

/// # Safety
/// CPUID must report OSXSAVE.
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: XGETBV is enabled (the caller checked OSXSAVE).
    unsafe { _xgetbv(0) }
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: 0 when granted.
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain Linux system call with two integer arguments; it only
    // changes this process's permitted xsave features.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if ret != 0 {
        tracing::debug!(ret, "arch_prctl(ARCH_REQ_XCOMP_PERM) refused AMX tile data");
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// The tile configuration: palette 1, all eight tiles 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

static CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = TILE_ROW_BYTES as u8;
        c[48 + t] = TILE_M as u8;
        t += 1;
    }
    TileConfig(c)
};

/// Configures this thread's tile registers (all zeroed).
///
/// # Safety
/// [`supported`] must have returned true.
#[inline]
pub unsafe fn configure() {
    // SAFETY: the caller checked AMX; the config is a valid palette-1 block.
    unsafe { asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) }
}

/// Releases this thread's tile state (back to the init state, so context
/// switches stop saving 8 KiB of tiles).
///
/// # Safety
/// [`supported`] must have returned true.
#[inline]
pub unsafe fn release() {
    // SAFETY: as in `configure`.
    unsafe { asm!("tilerelease", options(nostack, nomem)) }
}

/// Loads tile `$t` from `$base` with row stride `$stride` bytes.
macro_rules! tload {
    ($t:literal, $base:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{b} + {s} * 1]"),
            b = in(reg) $base,
            s = in(reg) $stride,
            options(nostack, readonly)
        )
    };
}

/// Stores tile `$t` to `$base` with row stride 64 bytes.
macro_rules! tstore {
    ($t:literal, $base:expr) => {
        asm!(
            concat!("tilestored [{b} + {s} * 1], tmm", $t),
            b = in(reg) $base,
            s = in(reg) TILE_ROW_BYTES,
            options(nostack)
        )
    };
}

/// `tmm$c += tmm$a · tmm$b` with the dot-product instruction `$op`.
macro_rules! tdp {
    ($op:literal, $c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// Bytes ahead of the current weight tile to prefetch.
const B_PREFETCH: usize = 4096;

/// Where one call's tiles are.
#[derive(Clone, Copy, Debug)]
pub struct Block {
    /// Token tile 0's row 0 at the first `k`-tile; token tile 1 starts
    /// `16 · a_stride` bytes later; `k`-tile `j` at `+ 64 · j`.
    pub a: *const u8,
    /// Bytes between token rows.
    pub a_stride: usize,
    /// Panel 0's (and, with two panels, panel 1's) first `k`-tile.
    pub b: [*const u8; 2],
    /// Bytes between consecutive `k`-tiles of one panel.
    pub b_step: usize,
    /// `k`-tiles to run.
    pub kt: usize,
    /// C tile (token tile `m`, panel `n`) at `c + 4 · (n · c_pstride + 256 · m)`
    /// bytes (`c_pstride` elements per panel).
    pub c: *mut u8,
    /// Elements (4 bytes each) between the C tiles of the two panels.
    pub c_pstride: usize,
    /// Add to the C tiles in memory (true) or start from zero.
    pub accumulate: bool,
    /// Up to two byte ranges (the weights the caller reads next) to
    /// prefetch into L2, spread over the `k` loop, so that memory keeps
    /// streaming while the tiles compute.
    pub prefetch: [(*const u8, usize); 2],
}

/// `C (mt × nt tiles) (+)= A · B` over `blk.kt` `k`-tiles with `tdpbf16ps`
/// (`INT8 = false`) or `tdpbssd`, for 1–2 token tiles and 1–2 panels.
///
/// # Safety
/// AMX must be [`supported`] and [`configure`]d on this thread; every tile
/// the block describes must be readable (A, B) or writable (C).
pub unsafe fn block<const INT8: bool>(mt: usize, nt: usize, blk: &Block) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (mt, nt) {
            (1, 1) => block_t::<1, 1, INT8>(blk),
            (1, _) => block_t::<1, 2, INT8>(blk),
            (_, 1) => block_t::<2, 1, INT8>(blk),
            _ => block_t::<2, 2, INT8>(blk),
        }
    }
}

#[inline(always)]
unsafe fn block_t<const MT: usize, const NT: usize, const INT8: bool>(blk: &Block) {
    let c = |m: usize, n: usize| blk.c.wrapping_add(4 * (n * blk.c_pstride + 256 * m));
    let a1 = blk.a.wrapping_add(TILE_M * blk.a_stride);
    // SAFETY: the caller guarantees AMX, the configuration and the extents.
    unsafe {
        if blk.accumulate {
            tload!("0", c(0, 0), TILE_ROW_BYTES);
            if NT == 2 {
                tload!("1", c(0, 1), TILE_ROW_BYTES);
            }
            if MT == 2 {
                tload!("2", c(1, 0), TILE_ROW_BYTES);
                if NT == 2 {
                    tload!("3", c(1, 1), TILE_ROW_BYTES);
                }
            }
        } else {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
        }
        let lines = blk.prefetch.map(|(_, len)| len.div_ceil(64));
        let per = lines.map(|l| l.div_ceil(blk.kt.max(1)));
        for j in 0..blk.kt {
            for q in 0..2 {
                let (p, _) = blk.prefetch[q];
                for l in j * per[q]..((j + 1) * per[q]).min(lines[q]) {
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(l * 64) as *const i8);
                }
            }
            let off = j * TILE_ROW_BYTES;
            let (b0, b1) = (
                blk.b[0].wrapping_add(j * blk.b_step),
                blk.b[1].wrapping_add(j * blk.b_step),
            );
            // Weights stream from memory once: prefetch a few tiles ahead.
            for r in 0..TILE_M {
                _mm_prefetch::<_MM_HINT_T0>(b0.wrapping_add(B_PREFETCH + r * 64) as *const i8);
                if NT == 2 {
                    _mm_prefetch::<_MM_HINT_T0>(b1.wrapping_add(B_PREFETCH + r * 64) as *const i8);
                }
            }
            tload!("6", b0, TILE_ROW_BYTES);
            tload!("4", blk.a.wrapping_add(off), blk.a_stride);
            if INT8 {
                tdp!("tdpbssd", "0", "4", "6");
            } else {
                tdp!("tdpbf16ps", "0", "4", "6");
            }
            if NT == 2 {
                tload!("7", b1, TILE_ROW_BYTES);
                if INT8 {
                    tdp!("tdpbssd", "1", "4", "7");
                } else {
                    tdp!("tdpbf16ps", "1", "4", "7");
                }
            }
            if MT == 2 {
                tload!("5", a1.wrapping_add(off), blk.a_stride);
                if INT8 {
                    tdp!("tdpbssd", "2", "5", "6");
                } else {
                    tdp!("tdpbf16ps", "2", "5", "6");
                }
                if NT == 2 {
                    if INT8 {
                        tdp!("tdpbssd", "3", "5", "7");
                    } else {
                        tdp!("tdpbf16ps", "3", "5", "7");
                    }
                }
            }
        }
        tstore!("0", c(0, 0));
        if NT == 2 {
            tstore!("1", c(0, 1));
        }
        if MT == 2 {
            tstore!("2", c(1, 0));
            if NT == 2 {
                tstore!("3", c(1, 1));
            }
        }
    }
}

/// Runs `iters` rounds of four independent `tdpbf16ps` on zero-filled tiles
/// (16 × 16 × 32 multiply-adds each) and returns the FLOPs done: the AMX
/// bf16 peak of the calling thread.
///
/// # Safety
/// AMX must be [`supported`].
pub unsafe fn bf16_probe(iters: usize) -> f64 {
    // SAFETY: forwarded; the tiles are zeroed and never stored.
    unsafe {
        configure();
        asm!(
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nostack, nomem)
        );
        for _ in 0..iters {
            tdp!("tdpbf16ps", "0", "4", "6");
            tdp!("tdpbf16ps", "1", "4", "7");
            tdp!("tdpbf16ps", "2", "5", "6");
            tdp!("tdpbf16ps", "3", "5", "7");
        }
        release();
    }
    (iters * 4 * TILE_M * TILE_M * BF16_TILE_K * 2) as f64
}
