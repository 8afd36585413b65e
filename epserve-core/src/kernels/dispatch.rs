//! Picks the MoE micro-kernel tier once per process: CPU features are
//! detected at run time (never from `target-cpu`), the best tier is cached,
//! and `EPSERVE_KERNEL=generic|avx2|neon|neon-dot|neon-i8mm` forces one
//! (falling back, with a warning, when the CPU lacks it).
//!
//! A [`Kernels`] value can only be obtained for a tier the CPU supports,
//! which is what makes calling its SIMD functions sound.

use std::sync::OnceLock;

use super::generic;
use super::layout::{I8_GROUP_BYTES, KG, NR};

/// A set of micro-kernels for one instruction-set level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Scalar twins, any CPU.
    Generic,
    /// x86_64 AVX2 + FMA.
    Avx2,
    /// aarch64 NEON (bf16 widened to f32; int8 by widening multiply).
    Neon,
    /// aarch64 NEON + SDOT for int8.
    NeonDot,
    /// aarch64 NEON + SMMLA (i8mm) for int8.
    NeonI8mm,
}

impl Tier {
    /// Every tier, slowest first.
    pub const ALL: [Tier; 5] = [
        Tier::Generic,
        Tier::Avx2,
        Tier::Neon,
        Tier::NeonDot,
        Tier::NeonI8mm,
    ];

    /// The name `EPSERVE_KERNEL` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Generic => "generic",
            Tier::Avx2 => "avx2",
            Tier::Neon => "neon",
            Tier::NeonDot => "neon-dot",
            Tier::NeonI8mm => "neon-i8mm",
        }
    }

    /// Parses a tier name.
    pub fn parse(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.name() == s.trim())
    }

    /// Whether this CPU can run the tier.
    pub fn supported(self) -> bool {
        match self {
            Tier::Generic => true,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "aarch64")]
            Tier::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Tier::NeonDot => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            #[cfg(target_arch = "aarch64")]
            Tier::NeonI8mm => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("i8mm")
            }
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The supported tiers of this CPU, slowest first.
    pub fn available() -> Vec<Tier> {
        Tier::ALL.into_iter().filter(|t| t.supported()).collect()
    }
}

type Bf16Tile = unsafe fn(&[u16], &[&[f32]], &mut [f32]);
type I8Tile = unsafe fn(&[i8], &[&[i8]], &mut [i32]);

/// The micro-kernels of one supported tier.
#[derive(Clone, Copy)]
pub struct Kernels {
    tier: Tier,
    bf16_mr: usize,
    bf16: Bf16Tile,
    i8_mr: usize,
    i8: I8Tile,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("tier", &self.tier)
            .field("bf16_mr", &self.bf16_mr)
            .field("i8_mr", &self.i8_mr)
            .finish()
    }
}

/// Most tokens any tier takes per tile (sizes stack arrays of row slices).
pub const MAX_MR: usize = 8;

// SAFETY (for both): the scalar twins have no preconditions beyond what the
// `Kernels` methods assert, so wrapping them as `unsafe fn` is trivially sound.
unsafe fn generic_bf16(w: &[u16], x: &[&[f32]], acc: &mut [f32]) {
    generic::bf16_tile(w, x, acc)
}
unsafe fn generic_i8(w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
    generic::i8_tile(w, x, acc)
}

impl Kernels {
    /// The kernels of `tier`, or `None` when this CPU cannot run it.
    pub fn for_tier(tier: Tier) -> Option<Kernels> {
        if !tier.supported() {
            return None;
        }
        let k = match tier {
            Tier::Generic => Kernels {
                tier,
                bf16_mr: 4,
                bf16: generic_bf16,
                i8_mr: 4,
                i8: generic_i8,
            },
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                use super::x86::avx2;
                Kernels {
                    tier,
                    bf16_mr: avx2::BF16_MR,
                    bf16: avx2::bf16_tile,
                    i8_mr: avx2::I8_MR,
                    i8: avx2::i8_tile,
                }
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm => {
                use super::aarch64::neon;
                let (i8_mr, i8): (usize, I8Tile) = match tier {
                    Tier::NeonI8mm => (neon::I8MM_MR, neon::i8_tile_mmla),
                    Tier::NeonDot => (neon::I8_MR, neon::i8_tile_dot),
                    _ => (neon::I8_MR, neon::i8_tile),
                };
                Kernels {
                    tier,
                    bf16_mr: neon::BF16_MR,
                    bf16: neon::bf16_tile,
                    i8_mr,
                    i8,
                }
            }
            #[allow(unreachable_patterns)]
            _ => return None,
        };
        debug_assert!(k.bf16_mr <= MAX_MR && k.i8_mr <= MAX_MR);
        Some(k)
    }

    /// The scalar twins.
    pub fn generic() -> Kernels {
        Kernels {
            tier: Tier::Generic,
            bf16_mr: 4,
            bf16: generic_bf16,
            i8_mr: 4,
            i8: generic_i8,
        }
    }

    /// The best tier this CPU supports.
    pub fn best() -> Kernels {
        Tier::ALL
            .into_iter()
            .rev()
            .find_map(Kernels::for_tier)
            .unwrap_or_else(Kernels::generic)
    }

    /// Which tier these are.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Most tokens per bf16 tile.
    pub fn bf16_mr(&self) -> usize {
        self.bf16_mr
    }

    /// Most tokens per int8 tile.
    pub fn i8_mr(&self) -> usize {
        self.i8_mr
    }

    /// `acc[t·16 + c] += Σ_k x[t][k] · W[k, c]` over a bf16 panel chunk `w`
    /// (`kc · 16` words); `1 ≤ x.len() ≤ bf16_mr`, each row ≥ `kc` long.
    #[inline]
    pub fn bf16_tile(&self, w: &[u16], x: &[&[f32]], acc: &mut [f32]) {
        let kc = w.len() / NR;
        assert!(w.len() % NR == 0 && !x.is_empty() && x.len() <= self.bf16_mr);
        assert!(acc.len() >= x.len() * NR && x.iter().all(|r| r.len() >= kc));
        // SAFETY: this tier was checked as supported when `self` was built,
        // and the lengths were just asserted.
        unsafe { (self.bf16)(w, x, acc) }
    }

    /// `acc[t·16 + c] += Σ_k x[t][k] · W[k, c]` over an int8 panel chunk `w`
    /// (`groups · 128` bytes); `1 ≤ x.len() ≤ i8_mr`, each row ≥ `8·groups`
    /// long; all values in `[-127, 127]` (what the quantizer produces).
    #[inline]
    pub fn i8_tile(&self, w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
        let groups = w.len() / I8_GROUP_BYTES;
        assert!(w.len() % I8_GROUP_BYTES == 0 && !x.is_empty() && x.len() <= self.i8_mr);
        assert!(acc.len() >= x.len() * NR && x.iter().all(|r| r.len() >= groups * KG));
        // SAFETY: as in `bf16_tile`; the value range is the quantizer's
        // contract (violating it can only change results, never memory).
        unsafe { (self.i8)(w, x, acc) }
    }
}

impl Kernels {
    /// Measures this tier's f32 FMA throughput on the calling thread: runs
    /// for about `iters` rounds and returns `(flops, result)`; divide `flops`
    /// by the elapsed time for FLOP/s. The result only defeats dead-code
    /// elimination.
    pub fn fma_probe(&self, iters: usize) -> (f64, f32) {
        let seed = std::hint::black_box(1.0f32);
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                // SAFETY: `self` exists only for supported tiers (AVX2 + FMA).
                let r = unsafe { super::x86::avx2::fma_probe(iters, seed) };
                ((iters * 12 * 8 * 2) as f64, r)
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm => {
                // SAFETY: NEON is part of every supported aarch64 tier.
                let r = unsafe { super::aarch64::neon::fma_probe(iters, seed) };
                ((iters * 24 * 4 * 2) as f64, r)
            }
            _ => {
                let mut c = [seed; 16];
                for _ in 0..iters {
                    for v in c.iter_mut() {
                        *v = *v * 0.999_999 + 1e-7;
                    }
                }
                ((iters * 16 * 2) as f64, c.iter().sum())
            }
        }
    }
}

/// The process-wide kernels: `EPSERVE_KERNEL` if set and supported, else the
/// best tier. Detected on first use and cached.
pub fn kernels() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(|| {
        let forced = std::env::var("EPSERVE_KERNEL").ok();
        if let Some(name) = forced.as_deref().filter(|s| !s.is_empty()) {
            match Tier::parse(name) {
                Some(t) => match Kernels::for_tier(t) {
                    Some(k) => return k,
                    None => tracing::warn!(tier = name, "EPSERVE_KERNEL tier not supported by this CPU; using the best supported tier"),
                },
                None => tracing::warn!(
                    value = name,
                    "unknown EPSERVE_KERNEL (generic|avx2|neon|neon-dot|neon-i8mm); using the best supported tier"
                ),
            }
        }
        let k = Kernels::best();
        tracing::debug!(tier = k.tier().name(), "MoE kernel tier");
        k
    })
}

#[cfg(test)]
#[path = "tier_tests.rs"]
mod tests;
