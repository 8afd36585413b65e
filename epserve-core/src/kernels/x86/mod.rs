//! x86_64 tiers of the MoE micro-kernels. Only compiled on x86_64; each tier
//! is chosen at run time by [`super::dispatch`] after feature detection.

pub mod avx2;
