//! x86_64 tiers of the MoE micro-kernels. Only compiled on x86_64; each tier
//! is chosen at run time by [`super::dispatch`] after feature detection.

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

/// Fewest tokens per tile that hint [`L2_AHEAD`] (one token streams at the
/// bandwidth already; the extra hints cost it 2-4 % there).
pub(crate) const L2_AHEAD_MIN_T: usize = 2;

/// Hints `lines` cache lines from [`L2_AHEAD`] bytes past `p` into L2 when
/// a tile has `t` ≥ [`L2_AHEAD_MIN_T`] tokens (a hint: never faults).
#[inline(always)]
pub(crate) fn l2_ahead(p: *const u8, t: usize, lines: usize) {
    if t >= L2_AHEAD_MIN_T {
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
