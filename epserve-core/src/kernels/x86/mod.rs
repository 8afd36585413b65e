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
