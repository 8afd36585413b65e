//! x86_64 tiers of the MoE micro-kernels. Only compiled on x86_64; each tier
//! is chosen at run time by [`super::dispatch`] after feature detection.

use std::sync::atomic::{AtomicU8, Ordering};

/// Attention's inner loops (AVX2 and AVX-512).
pub mod attn;
pub mod avx2;
// The AVX-512 intrinsics are stable since Rust 1.89; the workspace's
// `rust-version` (1.85) is older, so building for x86_64 needs 1.89+ (README).
/// AMX tiles for the prefill path (Sapphire Rapids and later).
pub mod amx;
pub mod avx512;

/// Bytes ahead of the current weights that the one-panel tiles (bf16 with
/// f32 or bf16 activations, int8) hint into L2 when they hold at least
/// [`L2_AHEAD_MIN_T`] tokens. Their own L1 prefetch runs only 1 KiB ahead:
/// enough while a tile streams (one token: two FMAs per 64 weight bytes),
/// but from two tokens on each 64 bytes take 4-24 FMAs, the loads fall
/// behind DRAM's latency and the tile stalls on them. Measured with `epserve
/// bench moe` at the Qwen3-30B-A3B shape on a 2-vCPU AMD EPYC (Zen 4), best
/// of three alternating runs, without → with: bf16 weights with f32
/// activations at 64 tokens 41.3 → 25.9 ms, at 128 tokens 57.5 → 46.7 ms
/// (72 → 88 % of the FMA peak); bf16 activations 43.7 → 34.6 ms and int8
/// 27.1 → 23.6 ms at 128 tokens; the AVX2 tier's bf16 at 64 tokens 41.4 →
/// 27.7 ms. 4 KiB ahead gained about half of that, 16 KiB the same as 8.
pub(crate) const L2_AHEAD: usize = 8192;

/// Fewest tokens per tile that always hint [`L2_AHEAD`]; one-token tiles
/// (decode) hint where [`single_token_hints`] says so.
pub(crate) const L2_AHEAD_MIN_T: usize = 2;

/// 0: not decided yet, 1: one-token tiles do not hint L2, 2: they do.
static SINGLE_TOKEN_HINTS: AtomicU8 = AtomicU8::new(0);

/// Whether one-token tiles hint [`L2_AHEAD`] too. On the AMD EPYC (Zen 4)
/// where the hints were tuned, one token streamed at the bandwidth already
/// and the hints cost it 2-4 %. On the Intel Xeons of this pool (AVX-512
/// BF16 and AMX, 2 vCPUs) they make a one-token tile stream 1.2-1.35x
/// faster (`epserve bench linear --tokens 1`); a whole decode step of the
/// bench model went 28.4-29.1 → 21.6-23.3 ms (`epserve bench step`,
/// 2026-12-05, alternating binaries). So: on for Intel, off for other
/// vendors; `EPSERVE_DECODE_L2_HINTS=1|0` overrides.
#[inline(always)]
pub(crate) fn single_token_hints() -> bool {
    match SINGLE_TOKEN_HINTS.load(Ordering::Relaxed) {
        0 => decide_single_token_hints(),
        v => v == 2,
    }
}

#[cold]
fn decide_single_token_hints() -> bool {
    let on = match std::env::var("EPSERVE_DECODE_L2_HINTS").ok().as_deref() {
        Some("1" | "on" | "true") => true,
        Some("0" | "off" | "false") => false,
        _ => &cpu_vendor() == b"GenuineIntel",
    };
    SINGLE_TOKEN_HINTS.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    on
}

/// The CPU vendor string (`cpuid` leaf 0: `GenuineIntel`, `AuthenticAMD`, ...).
pub(crate) fn cpu_vendor() -> [u8; 12] {
    let r = std::arch::x86_64::__cpuid(0);
    let mut vendor = [0u8; 12];
    vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
    vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
    vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
    vendor
}

/// Hints `lines` cache lines from [`L2_AHEAD`] bytes past `p` into L2 when
/// a tile has `t` ≥ [`L2_AHEAD_MIN_T`] tokens, or one where
/// [`single_token_hints`] (a hint: never faults).
#[inline(always)]
pub(crate) fn l2_ahead(p: *const u8, t: usize, lines: usize) {
    if t >= L2_AHEAD_MIN_T || (t == 1 && single_token_hints()) {
        for l in 0..lines {
            // SAFETY: SSE is baseline on x86_64, and a prefetch is a hint
            // that never faults.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    p.wrapping_add(L2_AHEAD + 64 * l) as *const i8,
                );
            }
        }
    }
}
