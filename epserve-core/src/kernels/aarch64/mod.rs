//! aarch64 tiers of the MoE micro-kernels (Graviton 2/3/4, Neoverse N1/V1/V2).
//! Only compiled on aarch64; the tier is chosen at run time by
//! [`super::dispatch`] with `is_aarch64_feature_detected!`.
//!
//! - `neon`: the baseline every aarch64 CPU has (bf16 weights widened to f32
//!   and FMA'd; int8 with widening multiplies).
//! - `neon` + `dotprod`: int8 through SDOT (Neoverse N1 and later).
//! - `neon` + `i8mm`: int8 through SMMLA, two tokens × two channels per
//!   instruction (Neoverse V1/V2, Graviton 3/4).

/// Attention's inner loops (NEON).
pub mod attn;
pub mod neon;
