//! Picks the MoE micro-kernel tier once per process: CPU features are
//! detected at run time (never from `target-cpu`), the best tier is cached,
//! and `EPSERVE_KERNEL=generic|avx2|avx512|avx512-vnni|avx512-bf16|amx|neon|
//! neon-dot|neon-i8mm|neon-bf16` forces one (falling back, with a warning,
//! when the CPU lacks it).
//!
//! A [`Kernels`] value can only be obtained for a tier the CPU supports,
//! which is what makes calling its SIMD functions sound.

use std::sync::OnceLock;

use super::attention::KvRows;
use super::generic;
use super::layout::{I8_GROUP_BYTES, KG, NR, bf16_padded_k, mm_padded_k};

/// A set of micro-kernels for one instruction-set level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Scalar twins, any CPU.
    Generic,
    /// x86_64 AVX2 + FMA.
    Avx2,
    /// x86_64 AVX-512 F/BW (bf16 widened to f32 in zmm; int8 as AVX2).
    Avx512,
    /// x86_64 AVX-512 + VNNI (int8 through `vpdpbusd`).
    Avx512Vnni,
    /// x86_64 AVX-512 + VNNI + BF16 (bf16 activations through `vdpbf16ps`).
    Avx512Bf16,
    /// x86_64 `avx512-bf16` + AMX tiles (`tdpbf16ps`, `tdpbssd`) on the
    /// prefill path of bf16-activation and int8 experts.
    Amx,
    /// aarch64 NEON (bf16 widened to f32; int8 by widening multiply).
    Neon,
    /// aarch64 NEON + SDOT for int8.
    NeonDot,
    /// aarch64 NEON + SMMLA (i8mm) for int8.
    NeonI8mm,
    /// aarch64 NEON + SMMLA for int8 + BFDOT (decode) and BFMMLA (prefill)
    /// for bf16 activations.
    NeonBf16,
}

impl Tier {
    /// Every tier, slowest first within each architecture.
    pub const ALL: [Tier; 10] = [
        Tier::Generic,
        Tier::Avx2,
        Tier::Avx512,
        Tier::Avx512Vnni,
        Tier::Avx512Bf16,
        Tier::Amx,
        Tier::Neon,
        Tier::NeonDot,
        Tier::NeonI8mm,
        Tier::NeonBf16,
    ];

    /// The name `EPSERVE_KERNEL` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Generic => "generic",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Avx512Vnni => "avx512-vnni",
            Tier::Avx512Bf16 => "avx512-bf16",
            Tier::Amx => "amx",
            Tier::Neon => "neon",
            Tier::NeonDot => "neon-dot",
            Tier::NeonI8mm => "neon-i8mm",
            Tier::NeonBf16 => "neon-bf16",
        }
    }

    /// Every accepted name, for messages.
    pub fn names() -> String {
        Tier::ALL.map(Tier::name).join("|")
    }

    /// Parses a tier name.
    pub fn parse(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.name() == s.trim())
    }

    /// Whether this CPU can run the tier.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let avx512 = || {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
        };
        match self {
            Tier::Generic => true,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => avx512(),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Vnni => avx512() && is_x86_feature_detected!("avx512vnni"),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Bf16 => {
                avx512()
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Amx => Tier::Avx512Bf16.supported() && super::x86::amx::supported(),
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
            #[cfg(target_arch = "aarch64")]
            Tier::NeonBf16 => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("i8mm")
                    && std::arch::is_aarch64_feature_detected!("bf16")
            }
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The supported tiers of this CPU, slowest first.
    pub fn available() -> Vec<Tier> {
        Tier::ALL.into_iter().filter(|t| t.supported()).collect()
    }

    /// The tiers of this build's architecture that this CPU lacks (tests
    /// report them as skipped).
    pub fn unavailable() -> Vec<Tier> {
        let arch: &[Tier] = if cfg!(target_arch = "x86_64") {
            &[
                Tier::Avx2,
                Tier::Avx512,
                Tier::Avx512Vnni,
                Tier::Avx512Bf16,
                Tier::Amx,
            ]
        } else if cfg!(target_arch = "aarch64") {
            &[Tier::Neon, Tier::NeonDot, Tier::NeonI8mm, Tier::NeonBf16]
        } else {
            &[]
        };
        arch.iter().copied().filter(|t| !t.supported()).collect()
    }
}

type Bf16Tile = unsafe fn(&[u16], usize, &[&[f32]], &mut [f32]);
type Bf16PairTile = unsafe fn([&[u16]; 2], usize, usize, &[f32], [&mut [f32]; 2]);
type Bf16xTile = unsafe fn(&[u16], &[&[u16]], &mut [f32]);
type Bf16xPairTile = unsafe fn([&[u16]; 2], usize, &[u16], [&mut [f32]; 2]);
type Bf16mmTile = unsafe fn(&[u16], usize, &[u16], &mut [f32]);
type I8Tile = unsafe fn(&[i8], &[&[i8]], &mut [i32]);
type AttnScores = unsafe fn(&[f32], usize, *const u8, usize, usize, f32, &mut [f32], usize);
type AttnScoresB16 = unsafe fn(&[u16], usize, *const u8, usize, usize, f32, &mut [f32], usize);
type AttnScoresCols =
    unsafe fn(&[f32], usize, *const u8, usize, usize, usize, f32, &mut [f32], usize);
type AttnScoresColsHinted = unsafe fn(
    &[f32],
    usize,
    *const u8,
    usize,
    usize,
    usize,
    f32,
    &mut [f32],
    usize,
    *const u8,
    *const u8,
);
type AttnScoresColsB16 =
    unsafe fn(&[u16], usize, *const u8, usize, usize, usize, f32, &mut [f32], usize, *const u8);
type AttnAccum = unsafe fn(&[f32], usize, *const u8, usize, usize, &mut [f32], usize);
type AttnAccumHinted =
    unsafe fn(&[f32], usize, *const u8, usize, usize, &mut [f32], usize, *const u8);
type AttnSoftmax = unsafe fn(&mut [f32], f32) -> (f32, f32);

/// The value pass's extents ([`Kernels::attn_accum`] and its hinted and
/// permuted forms): panics unless `acc` is whole rows of `dv` and every row
/// of `v` and `p` the pass reads is inside its slice; returns the rows.
fn accum_extents(
    p: &[f32],
    ldp: usize,
    v: KvRows<'_>,
    stride: usize,
    n: usize,
    acc: &[f32],
    dv: usize,
) -> usize {
    let m = acc.len() / dv.max(1);
    assert!(dv > 0 && acc.len() == m * dv && ldp >= n && stride >= dv);
    assert!(v.len() >= (n - 1) * stride + dv && p.len() >= (m - 1) * ldp + n);
    m
}

/// A value pass's hint (`n` rows of `dv` elements `stride` apart from
/// element `off`), kept only where every hinted row is inside its slice.
fn accum_hint(
    hint: Option<(KvRows<'_>, usize)>,
    n: usize,
    stride: usize,
    dv: usize,
) -> Option<(KvRows<'_>, usize)> {
    hint.filter(|(rows, off)| off + (n - 1) * stride + dv <= rows.len())
}

/// A value pass over bf16 rows whose accumulators stay in the tier's own
/// lane order between calls (see [`Kernels::attn_accum_permuted`]).
#[derive(Clone, Copy)]
struct AccumPermuted {
    accum: AttnAccumHinted,
    /// Whether it takes `m` accumulator rows of `dv`.
    takes: fn(usize, usize) -> bool,
    /// Rows of `dv` into its order (`true`) or back.
    permute: unsafe fn(&mut [f32], usize, bool),
}

/// A tier's attention micro-kernels, `[f32 rows, bf16 rows]` each (see
/// [`Kernels::attn_scores`], [`Kernels::attn_accum`]) and its online-softmax
/// step ([`Kernels::attn_softmax`]).
#[derive(Clone, Copy)]
struct AttnFns {
    scores: [AttnScores; 2],
    /// bf16 queries against bf16 keys with a native bf16 dot, where the
    /// tier has one (see [`Kernels::attn_scores_b16`]).
    scores_b16: Option<AttnScoresB16>,
    /// The scores against a block's keys stored by column (see
    /// [`Kernels::attn_scores_cols`]), `[f32, bf16]`.
    scores_cols: [AttnScoresCols; 2],
    /// The same, hinting the next block's columns from inside its loop,
    /// where the tier does (see [`Kernels::attn_scores_cols_hinted`]).
    scores_cols_hinted: Option<[AttnScoresColsHinted; 2]>,
    /// bf16 queries against bf16 columns with a native bf16 dot.
    scores_cols_b16: Option<AttnScoresColsB16>,
    accum: [AttnAccum; 2],
    /// The same, hinting the next block's value rows from inside its
    /// passes, where the tier does (see [`Kernels::attn_accum_hinted`]).
    accum_hinted: Option<[AttnAccumHinted; 2]>,
    /// The bf16 value pass over permuted accumulators, where the tier has
    /// one.
    accum_permuted: Option<AccumPermuted>,
    softmax: AttnSoftmax,
}

/// The micro-kernels of one supported tier.
#[derive(Clone, Copy)]
pub struct Kernels {
    tier: Tier,
    bf16_mr: usize,
    bf16: Bf16Tile,
    /// A two-panel bf16 tile (f32 activations) for the prefill path, where
    /// the tier has one.
    bf16_pair: Option<(usize, Bf16PairTile)>,
    /// A native bf16 × bf16 dot-product tile, where the tier has one.
    bf16x: Option<(usize, Bf16xTile)>,
    /// Its two-panel form over packed activations (the prefill path where
    /// `bf16x_prefill`), where the tier has one.
    bf16x_pair: Option<(usize, Bf16xPairTile)>,
    /// A bf16 × bf16 matrix-multiply tile over packed activations for the
    /// prefill path (BFMMLA), where the tier has one.
    bf16mm: Option<(usize, Bf16mmTile)>,
    i8_mr: usize,
    i8: I8Tile,
    /// AMX tiles for the prefill path (bf16 activations and int8).
    amx: bool,
    /// The native bf16 dot tile also on the prefill path (bf16 activations),
    /// where it out-runs the widening f32 FMA tile (see
    /// [`Kernels::bf16x_prefill`]).
    bf16x_prefill: bool,
    /// Attention's inner loops (`None`: the scalar twins).
    attn: Option<AttnFns>,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("tier", &self.tier)
            .field("bf16_mr", &self.bf16_mr)
            .field("bf16_pair_mr", &self.bf16_pair.map(|b| b.0))
            .field("bf16x_mr", &self.bf16x.map(|b| b.0))
            .field("bf16x_pair_mr", &self.bf16x_pair.map(|b| b.0))
            .field("bf16mm_mr", &self.bf16mm.map(|b| b.0))
            .field("i8_mr", &self.i8_mr)
            .field("amx", &self.amx)
            .field("bf16x_prefill", &self.bf16x_prefill)
            .finish()
    }
}

/// Whether this x86 CPU's zmm bf16 dot instruction out-runs its zmm FMA in
/// multiply-adds (AMD: Zen 4 is the first with AVX-512 BF16, and each zmm
/// `vdpbf16ps` does twice an FMA's work at the same rate).
#[cfg(target_arch = "x86_64")]
fn dot_beats_fma_on_prefill() -> bool {
    &super::x86::cpu_vendor() == b"AuthenticAMD"
}

/// Whether the AVX-512 FMA tiles whose activations each feed several FMAs
/// (the two-panel prefill tile, attention's value pass) give every FMA an
/// embedded broadcast operand rather than broadcasting once into a
/// register. On AMD Zen 4 a zmm `vbroadcastss` takes a slot of the FP pipes
/// (measured: see [`super::x86::avx512::bf16_pair_tile`]); on Intel it is a
/// pure load, and Skylake-SP / Ice Lake's two load ports would be the limit
/// of the embedded form. The same bits either way; decided by the vendor.
#[cfg(target_arch = "x86_64")]
fn embedded_broadcasts() -> bool {
    &super::x86::cpu_vendor() == b"AuthenticAMD"
}

/// Most tokens any tier takes per tile (sizes stack arrays of row slices).
pub const MAX_MR: usize = 12;

// SAFETY (for both): the scalar twins have no preconditions beyond what the
// `Kernels` methods assert, so wrapping them as `unsafe fn` is trivially sound.
unsafe fn generic_bf16(w: &[u16], kc: usize, x: &[&[f32]], acc: &mut [f32]) {
    generic::bf16_tile(w, kc, x, acc)
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
            Tier::Generic => Kernels::generic(),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                use super::x86::{attn, avx2};
                Kernels {
                    tier,
                    bf16_mr: avx2::BF16_MR,
                    bf16: avx2::bf16_tile,
                    bf16_pair: None,
                    bf16x: None,
                    bf16x_pair: None,
                    bf16mm: None,
                    i8_mr: avx2::I8_MR,
                    i8: avx2::i8_tile,
                    amx: false,
                    bf16x_prefill: false,
                    attn: Some(AttnFns {
                        scores: [attn::scores256::<false>, attn::scores256::<true>],
                        scores_b16: None,
                        scores_cols: [attn::scores_cols256::<false>, attn::scores_cols256::<true>],
                        scores_cols_hinted: Some([
                            attn::scores_cols256_hinted::<false>,
                            attn::scores_cols256_hinted::<true>,
                        ]),
                        scores_cols_b16: None,
                        accum: [attn::accum256::<false>, attn::accum256::<true>],
                        accum_hinted: Some([
                            attn::accum256_hinted::<false>,
                            attn::accum256_hinted::<true>,
                        ]),
                        accum_permuted: Some(AccumPermuted {
                            accum: attn::accum256_permuted,
                            takes: attn::accum256_permutes,
                            permute: attn::acc_permute256,
                        }),
                        softmax: attn::softmax256,
                    }),
                }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                use super::x86::{attn, avx2, avx512};
                let (i8_mr, i8): (usize, I8Tile) = match tier {
                    Tier::Avx512 => (avx2::I8_MR, avx2::i8_tile),
                    _ => (avx512::I8_MR, avx512::i8_tile_vnni),
                };
                let emb = embedded_broadcasts();
                let (bf16_pair, accum, accum_hinted): (
                    Bf16PairTile,
                    [AttnAccum; 2],
                    [AttnAccumHinted; 2],
                ) = if emb {
                    (
                        avx512::bf16_pair_tile::<true>,
                        [attn::accum512::<false, true>, attn::accum512::<true, true>],
                        [
                            attn::accum512_hinted::<false, true>,
                            attn::accum512_hinted::<true, true>,
                        ],
                    )
                } else {
                    (
                        avx512::bf16_pair_tile::<false>,
                        [
                            attn::accum512::<false, false>,
                            attn::accum512::<true, false>,
                        ],
                        [
                            attn::accum512_hinted::<false, false>,
                            attn::accum512_hinted::<true, false>,
                        ],
                    )
                };
                Kernels {
                    tier,
                    bf16_mr: avx512::BF16_MR,
                    bf16: avx512::bf16_tile,
                    bf16_pair: Some((avx512::BF16_PAIR_MR, bf16_pair)),
                    bf16x: matches!(tier, Tier::Avx512Bf16 | Tier::Amx)
                        .then_some((avx512::BF16X_MR, avx512::bf16x_tile as Bf16xTile)),
                    bf16x_pair: matches!(tier, Tier::Avx512Bf16 | Tier::Amx).then_some((
                        avx512::BF16X_PAIR_MR,
                        if emb {
                            avx512::bf16x_pair_tile::<true> as Bf16xPairTile
                        } else {
                            avx512::bf16x_pair_tile::<false>
                        },
                    )),
                    bf16mm: None,
                    i8_mr,
                    i8,
                    amx: tier == Tier::Amx,
                    bf16x_prefill: tier == Tier::Avx512Bf16 && dot_beats_fma_on_prefill(),
                    attn: Some(AttnFns {
                        scores: [attn::scores512::<false>, attn::scores512::<true>],
                        scores_b16: matches!(tier, Tier::Avx512Bf16 | Tier::Amx)
                            .then_some(attn::scores512_b16 as AttnScoresB16),
                        scores_cols: [attn::scores_cols512::<false>, attn::scores_cols512::<true>],
                        scores_cols_hinted: Some([
                            attn::scores_cols512_hinted::<false>,
                            attn::scores_cols512_hinted::<true>,
                        ]),
                        scores_cols_b16: matches!(tier, Tier::Avx512Bf16 | Tier::Amx)
                            .then_some(attn::scores_cols512_b16 as AttnScoresColsB16),
                        accum,
                        accum_hinted: Some(accum_hinted),
                        accum_permuted: None,
                        softmax: attn::softmax512,
                    }),
                }
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => {
                use super::aarch64::{attn, neon};
                let (i8_mr, i8): (usize, I8Tile) = match tier {
                    Tier::NeonI8mm | Tier::NeonBf16 => (neon::I8MM_MR, neon::i8_tile_mmla),
                    Tier::NeonDot => (neon::I8_MR, neon::i8_tile_dot),
                    _ => (neon::I8_MR, neon::i8_tile),
                };
                Kernels {
                    tier,
                    bf16_mr: neon::BF16_MR,
                    bf16: neon::bf16_tile,
                    bf16_pair: Some((neon::BF16_MR, neon::bf16_pair_tile as Bf16PairTile)),
                    bf16x: (tier == Tier::NeonBf16)
                        .then_some((neon::BF16_MR, neon::bf16x_tile_bfdot as Bf16xTile)),
                    bf16x_pair: None,
                    bf16mm: (tier == Tier::NeonBf16)
                        .then_some((neon::BF16MM_MR, neon::bf16mm_tile_bfmmla as Bf16mmTile)),
                    i8_mr,
                    i8,
                    amx: false,
                    bf16x_prefill: false,
                    attn: Some(AttnFns {
                        scores: [attn::scores::<false>, attn::scores::<true>],
                        scores_b16: None,
                        scores_cols: [attn::scores_cols::<false>, attn::scores_cols::<true>],
                        scores_cols_hinted: None,
                        scores_cols_b16: None,
                        accum: [attn::accum::<false>, attn::accum::<true>],
                        accum_hinted: None,
                        accum_permuted: None,
                        softmax: attn::softmax,
                    }),
                }
            }
            #[allow(unreachable_patterns)]
            _ => return None,
        };
        debug_assert!(k.bf16_mr <= MAX_MR && k.i8_mr <= MAX_MR);
        debug_assert!(k.bf16x.is_none_or(|b| b.0 <= MAX_MR));
        debug_assert!(k.bf16x_pair.is_none_or(|b| b.0 <= MAX_MR));
        debug_assert!(k.bf16_pair.is_none_or(|b| b.0 <= MAX_MR));
        debug_assert!(
            k.bf16mm
                .is_none_or(|b| b.0 <= MAX_MR && b.0.is_multiple_of(2))
        );
        Some(k)
    }

    /// The scalar twins (bf16 experts keep f32 activations: no bf16 dot tile).
    pub fn generic() -> Kernels {
        Kernels {
            tier: Tier::Generic,
            bf16_mr: 4,
            bf16: generic_bf16,
            bf16_pair: None,
            bf16x: None,
            bf16x_pair: None,
            bf16mm: None,
            i8_mr: 4,
            i8: generic_i8,
            amx: false,
            bf16x_prefill: false,
            attn: None,
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

    /// `acc[t·16 + c] += Σ_{k<kc} x[t][k] · W[k, c]` over a bf16 panel chunk
    /// `w` (`bf16_padded_k(kc) · 16` words); `1 ≤ x.len() ≤ bf16_mr`, each row
    /// ≥ `kc` long.
    #[inline]
    pub fn bf16_tile(&self, w: &[u16], kc: usize, x: &[&[f32]], acc: &mut [f32]) {
        assert!(w.len() == bf16_padded_k(kc) * NR && !x.is_empty() && x.len() <= self.bf16_mr);
        assert!(acc.len() >= x.len() * NR && x.iter().all(|r| r.len() >= kc));
        // SAFETY: this tier was checked as supported when `self` was built,
        // and the lengths were just asserted.
        unsafe { (self.bf16)(w, kc, x, acc) }
    }

    /// Most tokens per two-panel bf16 tile, if this tier has one.
    pub fn bf16_pair_mr(&self) -> Option<usize> {
        self.bf16_pair.map(|b| b.0)
    }

    /// `acc[j][r·16 + c] += Σ_{k<kc} x[r][k] · Wj[k, c]` over two bf16 panel
    /// chunks `w[j]` (`bf16_padded_k(kc) · 16` words each) for `t` rows packed
    /// by [`super::layout::pack_pairs_f32`] into `xp`; `1 ≤ t ≤
    /// bf16_pair_mr`. Each activation load serves both panels. On a tier
    /// without a two-panel tile this is the scalar twin.
    #[inline]
    pub fn bf16_pair_tile(
        &self,
        w: [&[u16]; 2],
        kc: usize,
        t: usize,
        xp: &[f32],
        acc: [&mut [f32]; 2],
    ) {
        let len = bf16_padded_k(kc) * NR;
        let mr = self.bf16_pair_mr().unwrap_or(MAX_MR);
        assert!(w.iter().all(|p| p.len() == len) && t >= 1 && t <= mr);
        assert!(xp.len() >= bf16_padded_k(kc) * t && acc.iter().all(|a| a.len() >= t * NR));
        match self.bf16_pair {
            // SAFETY: as in `bf16_tile`.
            Some((_, f)) => unsafe { f(w, kc, t, xp, acc) },
            None => generic::bf16_pair_tile(w, kc, t, xp, acc),
        }
    }

    /// Most tokens per bf16 × bf16 tile, if this tier has a native one.
    pub fn bf16x_mr(&self) -> Option<usize> {
        self.bf16x.map(|b| b.0)
    }

    /// Most tokens per two-panel bf16 × bf16 tile, if this tier has one.
    pub fn bf16x_pair_mr(&self) -> Option<usize> {
        self.bf16x_pair.map(|b| b.0)
    }

    /// `acc[j][r·16 + c] += Σ_k x[r][k] · Wj[k, c]` with **bf16** activations
    /// over two bf16 panel chunks `w[j]` (`pairs · 32` words each) for `t`
    /// rows packed by [`super::layout::pack_pairs_b16`] into `xp`; `1 ≤ t ≤
    /// bf16x_pair_mr`. On a tier without the tile this is the scalar twin.
    #[inline]
    pub fn bf16x_pair_tile(&self, w: [&[u16]; 2], t: usize, xp: &[u16], acc: [&mut [f32]; 2]) {
        let len = w[0].len();
        let mr = self.bf16x_pair_mr().unwrap_or(MAX_MR);
        assert!(len.is_multiple_of(2 * NR) && w[1].len() == len && t >= 1 && t <= mr);
        assert!(xp.len() >= len / NR * t && acc.iter().all(|a| a.len() >= t * NR));
        match self.bf16x_pair {
            // SAFETY: as in `bf16_tile`.
            Some((_, f)) => unsafe { f(w, t, xp, acc) },
            None => generic::bf16x_pair_tile(w, t, xp, acc),
        }
    }

    /// `acc[t·16 + c] += Σ_k x[t][k] · W[k, c]` with **bf16** activations over
    /// a bf16 panel chunk `w` (`pairs · 32` words); each row ≥ `2 · pairs`
    /// long (zero-padded past the real `K`); `1 ≤ x.len() ≤ bf16x_mr`. On a
    /// tier without a native tile this is the scalar twin.
    #[inline]
    pub fn bf16x_tile(&self, w: &[u16], x: &[&[u16]], acc: &mut [f32]) {
        let kp = w.len() / NR;
        let mr = self.bf16x_mr().unwrap_or(MAX_MR);
        assert!(w.len().is_multiple_of(2 * NR) && !x.is_empty() && x.len() <= mr);
        assert!(acc.len() >= x.len() * NR && x.iter().all(|r| r.len() >= kp));
        match self.bf16x {
            // SAFETY: as in `bf16_tile`.
            Some((_, f)) => unsafe { f(w, x, acc) },
            None => generic::bf16x_tile(w, x, acc),
        }
    }

    /// Whether this tier decodes B12 panels natively ([`Kernels::b12_tile`];
    /// elsewhere that is the scalar twin, far slower than the bf16 tiles).
    pub fn b12_native(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(
            self.tier,
            Tier::Avx2 | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx
        ) {
            return true;
        }
        #[cfg(target_arch = "aarch64")]
        if matches!(
            self.tier,
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16
        ) {
            return true;
        }
        false
    }

    /// Whether B12 storage pays on this tier, so that the model stores its
    /// bf16 panels as B12 by default ([`super::b12::b12_enabled`]): the
    /// AVX-512 tiers (on an AMD EPYC, Zen 4: a decode step 1.33x faster,
    /// prefill 4-8 % slower). AVX2 has a native tile and decoder too, but
    /// with half the registers it only pays for one token (`bench linear`
    /// on that EPYC with `EPSERVE_KERNEL=avx2`: 1 token 0.98-1.31x, 2 tokens
    /// 0.66-1.02x, 4 tokens 0.41-0.52x), so there it is opt-in
    /// (`EPSERVE_B12=1`). The NEON tiers have a native tile (two tokens)
    /// and decoder, tested under qemu against the twins, but no Graviton
    /// measurement yet, so there it is opt-in too.
    pub fn b12_pays(&self) -> bool {
        self.b12_native()
            && !matches!(
                self.tier,
                Tier::Avx2 | Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16
            )
    }

    /// Most tokens per [`b12_tile`](Self::b12_tile) call.
    pub fn b12_mr(&self) -> usize {
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => super::x86::avx2::B12_MR,
            #[cfg(target_arch = "aarch64")]
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => {
                super::aarch64::neon::B12_MR
            }
            _ => super::b12::B12_MR,
        }
    }

    /// `acc[t·16 + c] += Σ_k x[t][k] · W[c, k]` over a whole B12 panel
    /// ([`super::b12`]) for `1 ≤ x.len() ≤ b12_mr()` rows of at least
    /// `panel.k` values: the same bits on every tier.
    pub fn b12_tile(&self, panel: &super::b12::B12Panel<'_>, x: &[&[f32]], acc: &mut [f32]) {
        let groups = super::b12::b12_padded_k(panel.k) / super::b12::B12_GROUP_K;
        assert!(!x.is_empty() && x.len() <= self.b12_mr() && acc.len() >= x.len() * NR);
        assert!(x.iter().all(|r| r.len() >= panel.k) && panel.groups() == groups);
        assert!(panel.exc_pos.len() == panel.exc_exp.len());
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the `avx2` tier requires AVX2 and FMA; the lengths
            // were just asserted.
            Tier::Avx2 => unsafe { super::x86::avx2::b12_tile(panel, x, acc) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every AVX-512 tier requires AVX-512 F and BW; the
            // lengths were just asserted.
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
                super::x86::avx512::b12_tile(panel, x, acc)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: NEON is baseline on aarch64; the lengths were just
            // asserted.
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => unsafe {
                super::aarch64::neon::b12_tile(panel, x, acc)
            },
            _ => super::b12::b12_tile(panel, x, acc),
        }
    }

    /// Whether this tier has a native [`b12x_tile`](Self::b12x_tile) (B12
    /// decoded in registers into `vdpbf16ps`); elsewhere that is the scalar
    /// twin, and bf16 activations on B12 panels run other paths.
    pub fn b12x_native(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(self.tier, Tier::Avx512Bf16 | Tier::Amx) {
            return true;
        }
        false
    }

    /// `acc[t·16 + c] += Σ_k x[t][k] · W[c, k]` over a whole B12 panel for
    /// `1 ≤ x.len() ≤ B12_MR` rows of **bf16** activations (at least
    /// `bf16_padded_k(panel.k)` values each, zero past `k`): the bf16 dot
    /// tiles' arithmetic (exact products, f32 sums), within their bound of
    /// the twin on every tier.
    pub fn b12x_tile(&self, panel: &super::b12::B12Panel<'_>, x: &[&[u16]], acc: &mut [f32]) {
        let groups = super::b12::b12_padded_k(panel.k) / super::b12::B12_GROUP_K;
        let kp = bf16_padded_k(panel.k);
        assert!(!x.is_empty() && x.len() <= super::b12::B12_MR && acc.len() >= x.len() * NR);
        assert!(x.iter().all(|r| r.len() >= kp) && panel.groups() == groups);
        assert!(panel.exc_pos.len() == panel.exc_exp.len());
        #[cfg(target_arch = "x86_64")]
        if self.b12x_native() {
            // SAFETY: the `avx512-bf16` and `amx` tiers require AVX-512 F,
            // BW and BF16; the lengths were just asserted.
            return unsafe { super::x86::avx512::b12x_tile(panel, x, acc) };
        }
        super::b12::b12x_tile(panel, x, acc)
    }

    /// `panel`'s bf16 panel words into `dst` (as many as it holds, at most
    /// `b12_padded_k(k) · 16`; `bf16_padded_k(k) · 16` is the bf16 panel):
    /// the same words on every tier.
    pub fn b12_decode(&self, panel: &super::b12::B12Panel<'_>, dst: &mut [u16]) {
        let groups = super::b12::b12_padded_k(panel.k) / super::b12::B12_GROUP_K;
        assert!(panel.groups() == groups && panel.exc_pos.len() == panel.exc_exp.len());
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the `avx2` tier requires AVX2.
            Tier::Avx2 => unsafe { super::x86::avx2::b12_decode(panel, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every AVX-512 tier requires AVX-512 F and BW.
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
                super::x86::avx512::b12_decode(panel, dst)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: NEON is baseline on aarch64.
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => unsafe {
                super::aarch64::neon::b12_decode(panel, dst)
            },
            _ => super::b12::b12_decode(panel, dst),
        }
    }

    /// Splits the f32 row `x` into its three bf16 terms
    /// ([`super::layout::split3_bf16`]): `x[k]`'s go to `hi[k]`, `mid[k]`,
    /// `lo[k]`; the same bits on every tier.
    pub fn split3_row(&self, x: &[f32], hi: &mut [u16], mid: &mut [u16], lo: &mut [u16]) {
        let n = x.len();
        assert!(hi.len() >= n && mid.len() >= n && lo.len() >= n);
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every AVX-512 tier requires AVX-512 F; lengths checked.
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
                super::x86::avx512::split3_row(x, hi, mid, lo)
            },
            _ => super::layout::split3_row(x, hi, mid, lo),
        }
    }

    /// Widens the bf16 `row` into `f` and quantizes it to int8 into `q`
    /// ([`super::layout::quantize_bf16_row_i8`]), returning the scale: the
    /// same bits on every tier.
    pub fn quantize_bf16_row_i8(&self, row: &[u16], f: &mut [f32], q: &mut [i8]) -> f32 {
        assert!(f.len() >= row.len() && q.len() >= row.len());
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every AVX-512 tier requires AVX-512 F/BW.
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
                super::x86::avx512::quantize_bf16_row_i8(row, f, q)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the AVX2 tier requires AVX2 and FMA.
            Tier::Avx2 => unsafe { super::x86::avx2::quantize_bf16_row_i8(row, f, q) },
            _ => super::layout::quantize_bf16_row_i8(row, f, q),
        }
    }

    /// One block of a bf16 panel ([`super::layout::transpose_pairs`]): the
    /// same words on every tier.
    pub fn transpose_pairs(&self, rows: &[&[u16]; super::layout::NR], dst: &mut [u32]) {
        use super::layout::{NR, PAIR_BLOCK};
        assert!(rows.iter().all(|r| r.len() >= 2 * PAIR_BLOCK) && dst.len() >= PAIR_BLOCK * NR);
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every AVX-512 tier requires AVX-512 F; lengths checked.
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
                super::x86::avx512::transpose_pairs(rows, dst)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the AVX2 tier requires AVX2; lengths checked.
            Tier::Avx2 => unsafe { super::x86::avx2::transpose_pairs(rows, dst) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: every aarch64 tier requires NEON; lengths checked.
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => unsafe {
                super::aarch64::neon::transpose_pairs(rows, dst)
            },
            _ => super::layout::transpose_pairs(rows, dst),
        }
    }

    /// Most rows per bf16 × bf16 matrix-multiply (prefill) tile, if this
    /// tier has one (even: BFMMLA takes rows in pairs).
    pub fn bf16mm_mr(&self) -> Option<usize> {
        self.bf16mm.map(|b| b.0)
    }

    /// `acc[r·16 + c] += Σ_k x[r][k] · W[k, c]` with **bf16** activations
    /// over a bf16 panel chunk `w` (`pairs · 32` words) for `t` rows packed
    /// by [`super::layout::pack_mm_bf16`] into `xa` (at least
    /// `mm_padded_k(2 · pairs) · 2⌈t/2⌉` values); `1 ≤ t ≤ bf16mm_mr`. On a
    /// tier without a native tile this is the scalar twin (up to `MAX_MR`
    /// rows).
    #[inline]
    pub fn bf16mm_tile(&self, w: &[u16], t: usize, xa: &[u16], acc: &mut [f32]) {
        let kp = w.len() / NR;
        let mr = self.bf16mm_mr().unwrap_or(MAX_MR);
        assert!(w.len().is_multiple_of(2 * NR) && t >= 1 && t <= mr);
        assert!(xa.len() >= mm_padded_k(kp) * t.div_ceil(2) * 2 && acc.len() >= t * NR);
        match self.bf16mm {
            // SAFETY: as in `bf16_tile`.
            Some((_, f)) => unsafe { f(w, t, xa, acc) },
            None => generic::bf16mm_tile(w, t, xa, acc),
        }
    }

    /// `acc[t·16 + c] += Σ_k x[t][k] · W[k, c]` over an int8 panel chunk `w`
    /// (`groups · 128` bytes); `1 ≤ x.len() ≤ i8_mr`, each row ≥ `8·groups`
    /// long; all values in `[-127, 127]` (what the quantizer produces).
    #[inline]
    pub fn i8_tile(&self, w: &[i8], x: &[&[i8]], acc: &mut [i32]) {
        let groups = w.len() / I8_GROUP_BYTES;
        assert!(w.len().is_multiple_of(I8_GROUP_BYTES) && !x.is_empty() && x.len() <= self.i8_mr);
        assert!(acc.len() >= x.len() * NR && x.iter().all(|r| r.len() >= groups * KG));
        // SAFETY: as in `bf16_tile`; the value range is the quantizer's
        // contract (violating it can only change results, never memory).
        unsafe { (self.i8)(w, x, acc) }
    }
}

impl Kernels {
    /// Attention scores of `q.len() / dk` query vectors (rows of `dk`)
    /// against `n` cached key rows `stride` elements apart in `k` (f32 or
    /// bf16): `out[m·ldo + i] = scale · q_m · k_i`. Panics unless every row
    /// touched is inside the slices.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attn_scores(
        &self,
        q: &[f32],
        dk: usize,
        k: KvRows<'_>,
        stride: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
        ldo: usize,
    ) {
        if n == 0 || q.is_empty() {
            return;
        }
        let m = q.len() / dk.max(1);
        assert!(dk > 0 && q.len() == m * dk && ldo >= n && stride >= dk);
        assert!(k.len() >= (n - 1) * stride + dk && out.len() >= (m - 1) * ldo + n);
        match self.attn {
            // SAFETY: this tier was checked as supported when `self` was
            // built, and the extents were just asserted.
            Some(f) => unsafe {
                (f.scores[k.is_bf16() as usize])(q, dk, k.as_ptr(), stride, n, scale, out, ldo)
            },
            None => generic::attn_scores(q, dk, k, stride, n, scale, out, ldo),
        }
    }

    /// [`Kernels::attn_scores`] with the queries rounded to bf16: `qb` holds
    /// them as bf16 bits and `q` as their f32 values (the same numbers).
    /// Against bf16 keys on a tier with a native bf16 dot (`vdpbf16ps`) the
    /// dots take half the instructions and no widening; elsewhere this is
    /// [`Kernels::attn_scores`] on `q`. Either way a score's bits depend only
    /// on its query and key, never on the call's shape. Panics as
    /// [`Kernels::attn_scores`].
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attn_scores_b16(
        &self,
        q: &[f32],
        qb: &[u16],
        dk: usize,
        k: KvRows<'_>,
        stride: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
        ldo: usize,
    ) {
        match self.attn.and_then(|f| f.scores_b16) {
            Some(f) if k.is_bf16() && n > 0 && !qb.is_empty() => {
                let m = qb.len() / dk.max(1);
                assert!(dk > 0 && qb.len() == m * dk && q.len() == qb.len());
                assert!(ldo >= n && stride >= dk);
                assert!(k.len() >= (n - 1) * stride + dk && out.len() >= (m - 1) * ldo + n);
                // SAFETY: this tier was checked as supported when `self` was
                // built, and the extents were just asserted.
                unsafe { f(qb, dk, k.as_ptr(), stride, n, scale, out, ldo) }
            }
            _ => self.attn_scores(q, dk, k, stride, n, scale, out, ldo),
        }
    }

    /// Attention scores of `q.len() / dk` query vectors against positions
    /// `t0..t0 + n` of one KV head's keys in a cache block stored by column
    /// (see [`super::attention::KvView::by_column`]): `k` starts at the
    /// block's column 0, position 0, columns `bs` apart; `out[m·ldo + i] =
    /// scale · q_m · k_{t0+i}`. Each score is two FMA chains (even and odd
    /// elements) added at the end, with the same bits for any call shape on
    /// every SIMD tier. Panics unless every element touched is inside the
    /// slices.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attn_scores_cols(
        &self,
        q: &[f32],
        dk: usize,
        k: KvRows<'_>,
        bs: usize,
        t0: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
        ldo: usize,
    ) {
        self.attn_scores_cols_hinted(q, dk, k, bs, t0, n, scale, out, ldo, None, None)
    }

    /// [`attn_scores_cols`](Self::attn_scores_cols), also hinting into L2
    /// the `dk · bs` elements from element `hint.1` of `hint.0` (the next
    /// cache block's columns of this KV head, or this run's value rows),
    /// where given and inside
    /// `hint.0`: spread over the kernel's column loop on AVX-512, one burst
    /// before the call elsewhere; and, only alongside a `hint` that is
    /// used, into L1 the `dk · bs` elements at `next` (the block the caller
    /// reads in its next call), spread over the kernel's loop, on AVX2
    /// (ignored elsewhere). The same bits as without the hints.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_scores_cols_hinted(
        &self,
        q: &[f32],
        dk: usize,
        k: KvRows<'_>,
        bs: usize,
        t0: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
        ldo: usize,
        hint: Option<(KvRows<'_>, usize)>,
        next: Option<(KvRows<'_>, usize)>,
    ) {
        if n == 0 || q.is_empty() {
            return;
        }
        let m = q.len() / dk.max(1);
        assert!(dk > 0 && q.len() == m * dk && ldo >= n && t0 + n <= bs);
        assert!(k.len() >= (dk - 1) * bs + t0 + n && out.len() >= (m - 1) * ldo + n);
        let esize = if k.is_bf16() { 2 } else { 4 };
        let hint = hint.filter(|(rows, off)| off + dk * bs <= rows.len());
        let kp = k.as_ptr();
        match (self.attn, hint) {
            (
                Some(AttnFns {
                    scores_cols_hinted: Some(f),
                    ..
                }),
                Some((rows, off)),
            ) => {
                let h = rows.as_ptr().wrapping_add(off * esize);
                let nx = next
                    .filter(|(rows, off)| off + dk * bs <= rows.len())
                    .map_or(std::ptr::null(), |(rows, off)| {
                        rows.as_ptr().wrapping_add(off * esize)
                    });
                // SAFETY: this tier was checked as supported when `self` was
                // built, the extents were just asserted, and the hints are
                // only prefetched (never read).
                unsafe { (f[k.is_bf16() as usize])(q, dk, kp, bs, t0, n, scale, out, ldo, h, nx) }
            }
            (attn, hint) => {
                if let Some((rows, off)) = hint {
                    super::attention::prefetch_l2(rows, off, dk * bs * esize);
                }
                match attn {
                    // SAFETY: as above, without a hint.
                    Some(f) => unsafe {
                        (f.scores_cols[k.is_bf16() as usize])(q, dk, kp, bs, t0, n, scale, out, ldo)
                    },
                    None => generic::attn_scores_cols(q, dk, k, bs, t0, n, scale, out, ldo),
                }
            }
        }
    }

    /// [`Kernels::attn_scores_cols`] with the queries rounded to bf16 (`qb`
    /// their bits, `q` their values): against bf16 columns on a tier with a
    /// native bf16 dot, `vdpbf16ps` on interleaved pairs of columns;
    /// elsewhere [`Kernels::attn_scores_cols`] on `q`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attn_scores_cols_b16(
        &self,
        q: &[f32],
        qb: &[u16],
        dk: usize,
        k: KvRows<'_>,
        bs: usize,
        t0: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
        ldo: usize,
        hint: Option<(KvRows<'_>, usize)>,
    ) {
        match self.attn.and_then(|f| f.scores_cols_b16) {
            Some(f) if k.is_bf16() && n > 0 && !qb.is_empty() => {
                let m = qb.len() / dk.max(1);
                assert!(dk > 0 && qb.len() == m * dk && q.len() == qb.len());
                assert!(ldo >= n && t0 + n <= bs);
                assert!(k.len() >= (dk - 1) * bs + t0 + n && out.len() >= (m - 1) * ldo + n);
                // The hint's rows are bf16 as the keys are (the same pool).
                let h = hint
                    .filter(|(rows, off)| rows.is_bf16() && off + dk * bs <= rows.len())
                    .map_or(std::ptr::null(), |(rows, off)| {
                        rows.as_ptr().wrapping_add(off * 2)
                    });
                // SAFETY: this tier was checked as supported when `self` was
                // built, the extents were just asserted, and the hint is only
                // prefetched (never read).
                unsafe { f(qb, dk, k.as_ptr(), bs, t0, n, scale, out, ldo, h) }
            }
            _ => self.attn_scores_cols_hinted(q, dk, k, bs, t0, n, scale, out, ldo, hint, None),
        }
    }

    /// Weighted sum of `n` cached value rows (`stride` elements apart in
    /// `v`, f32 or bf16) into `acc.len() / dv` accumulator rows of `dv`:
    /// `acc[m·dv + c] += Σ_i p[m·ldp + i] · v_i[c]`. Panics unless every row
    /// touched is inside the slices.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attn_accum(
        &self,
        p: &[f32],
        ldp: usize,
        v: KvRows<'_>,
        stride: usize,
        n: usize,
        acc: &mut [f32],
        dv: usize,
    ) {
        if n == 0 || acc.is_empty() {
            return;
        }
        accum_extents(p, ldp, v, stride, n, acc, dv);
        match self.attn {
            // SAFETY: as in `attn_scores`.
            Some(f) => unsafe {
                (f.accum[v.is_bf16() as usize])(p, ldp, v.as_ptr(), stride, n, acc, dv)
            },
            None => generic::attn_accum(p, ldp, v, stride, n, acc, dv),
        }
    }

    /// [`attn_accum`](Self::attn_accum), also hinting into L2 the `dv`
    /// elements of each of `n` rows `stride` apart from element `hint.1` of
    /// `hint.0` (the next run's value rows of this KV head, or its key
    /// blocks), where
    /// given and inside `hint.0`: spread over the kernel's passes on
    /// AVX-512, one burst before the call elsewhere. The same bits as
    /// without the hint.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_accum_hinted(
        &self,
        p: &[f32],
        ldp: usize,
        v: KvRows<'_>,
        stride: usize,
        n: usize,
        acc: &mut [f32],
        dv: usize,
        hint: Option<(KvRows<'_>, usize)>,
    ) {
        if n == 0 || acc.is_empty() {
            return;
        }
        let esize = if v.is_bf16() { 2 } else { 4 };
        let hint = accum_hint(hint, n, stride, dv);
        match (self.attn, hint) {
            (
                Some(AttnFns {
                    accum_hinted: Some(f),
                    ..
                }),
                Some((rows, off)),
            ) => {
                accum_extents(p, ldp, v, stride, n, acc, dv);
                let h = rows.as_ptr().wrapping_add(off * esize);
                // SAFETY: this tier was checked as supported when `self` was
                // built, the extents were just asserted, and the hint is only
                // prefetched (never read).
                unsafe { (f[v.is_bf16() as usize])(p, ldp, v.as_ptr(), stride, n, acc, dv, h) }
            }
            (_, hint) => {
                if let Some((rows, off)) = hint {
                    for i in 0..n {
                        super::attention::prefetch_l2(rows, off + i * stride, dv * esize);
                    }
                }
                self.attn_accum(p, ldp, v, stride, n, acc, dv)
            }
        }
    }

    /// Whether [`attn_accum_permuted`](Self::attn_accum_permuted) takes `m`
    /// accumulator rows of `dv` (bf16 value rows): the tier's value pass
    /// keeps its accumulators in its own lane order between calls.
    pub fn attn_acc_permutes(&self, m: usize, dv: usize) -> bool {
        match self.attn {
            Some(AttnFns {
                accum_permuted: Some(a),
                ..
            }) => (a.takes)(m, dv),
            _ => false,
        }
    }

    /// Accumulator rows of `dv` into the order of
    /// [`attn_accum_permuted`](Self::attn_accum_permuted) (`to`) or back to
    /// the natural one. Moves only; panics unless
    /// [`attn_acc_permutes`](Self::attn_acc_permutes) holds.
    pub fn attn_acc_permute(&self, acc: &mut [f32], dv: usize, to: bool) {
        let m = acc.len() / dv.max(1);
        assert!(dv > 0 && acc.len() == m * dv && self.attn_acc_permutes(m, dv));
        if let Some(AttnFns {
            accum_permuted: Some(a),
            ..
        }) = self.attn
        {
            // SAFETY: this tier was checked as supported when `self` was
            // built; the rows were just checked.
            unsafe { (a.permute)(acc, dv, to) }
        }
    }

    /// [`attn_accum_hinted`](Self::attn_accum_hinted) over bf16 value rows
    /// into accumulators in the permuted order
    /// ([`attn_acc_permute`](Self::attn_acc_permute)): the same sums per
    /// column, in that order. Panics unless
    /// [`attn_acc_permutes`](Self::attn_acc_permutes) holds, the rows are
    /// bf16 and every row touched is inside the slices.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_accum_permuted(
        &self,
        p: &[f32],
        ldp: usize,
        v: KvRows<'_>,
        stride: usize,
        n: usize,
        acc: &mut [f32],
        dv: usize,
        hint: Option<(KvRows<'_>, usize)>,
    ) {
        if n == 0 || acc.is_empty() {
            return;
        }
        let m = accum_extents(p, ldp, v, stride, n, acc, dv);
        assert!(v.is_bf16() && self.attn_acc_permutes(m, dv));
        let h = accum_hint(hint, n, stride, dv).map_or(std::ptr::null(), |(rows, off)| {
            let esize = if rows.is_bf16() { 2 } else { 4 };
            rows.as_ptr().wrapping_add(off * esize)
        });
        if let Some(AttnFns {
            accum_permuted: Some(a),
            ..
        }) = self.attn
        {
            // SAFETY: this tier was checked as supported when `self` was
            // built, the extents and the rows' order were just asserted, and
            // the hint is only prefetched (never read).
            unsafe { (a.accum)(p, ldp, v.as_ptr(), stride, n, acc, dv, h) }
        }
    }

    /// One online-softmax step over a row of block scores: returns the
    /// row's maximum `cmax` and, unless it is `−∞` (all masked: the row is
    /// zeroed, the sum 0), replaces each score `x` by `e^(x − top)`, `top =
    /// max(prev_max, cmax)` (exactly 0 for masked `−∞` scores), returning
    /// their sum. The sum's order depends only on each element's index, so
    /// trailing zeros (masked keys) never change it.
    #[inline]
    pub fn attn_softmax(&self, row: &mut [f32], prev_max: f32) -> (f32, f32) {
        if row.is_empty() {
            return (f32::NEG_INFINITY, 0.0);
        }
        match self.attn {
            // SAFETY: this tier was checked as supported when `self` was built.
            Some(f) => unsafe { (f.softmax)(row, prev_max) },
            None => generic::attn_softmax(row, prev_max),
        }
    }
}

impl Kernels {
    /// Whether this tier runs the prefill path on AMX tiles.
    pub fn amx(&self) -> bool {
        self.amx
    }

    /// Whether bf16 activations run the native bf16 dot tile on the prefill
    /// path too (its two-panel form, [`bf16x_pair_tile`](Self::bf16x_pair_tile))
    /// rather than the widening f32 FMA tile on their f32 originals, and on
    /// B12 panels the B12 dot tile (up to 16 rows, decode included) rather
    /// than the B12 FMA tile on the rows rounded to bf16.
    /// On AMD Zen 4 and later a zmm `vdpbf16ps` retires as fast as a zmm
    /// FMA with twice its multiply-adds; on Intel (Sapphire Rapids class,
    /// measured with `EPSERVE_KERNEL=avx512-bf16`) it runs at half the FMA
    /// rate, and the `amx` tier has tiles. Decided by the CPU's vendor, not
    /// by a timing, so a machine always computes the same bits.
    pub fn bf16x_prefill(&self) -> bool {
        self.bf16x_prefill && self.bf16x.is_some()
    }

    /// This tier with the bf16 dot tile on the prefill path forced on or off
    /// (tests, `EPSERVE_BF16_DOT_PREFILL`; on stays off on tiers without the
    /// tile).
    pub fn with_bf16x_prefill(mut self, on: bool) -> Kernels {
        self.bf16x_prefill = on && self.bf16x.is_some();
        self
    }

    /// Runs `f` with this thread's AMX tiles configured (released again
    /// afterwards, also on unwind); `None` on tiers without AMX.
    pub fn amx_scope<R>(&self, f: impl FnOnce(&AmxTiles) -> R) -> Option<R> {
        if !self.amx {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            struct Release;
            impl Drop for Release {
                fn drop(&mut self) {
                    // SAFETY: only built after `configure` below succeeded on
                    // a tier that checked AMX support.
                    unsafe { super::x86::amx::release() }
                }
            }
            // SAFETY: `self.amx` is only set for the AMX tier, which exists
            // only where `amx::supported()` holds.
            unsafe { super::x86::amx::configure() };
            let _release = Release;
            Some(f(&AmxTiles {
                _thread: std::marker::PhantomData,
            }))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = f;
            None
        }
    }
}

/// This thread's configured AMX tiles (see [`Kernels::amx_scope`]): all
/// eight tiles 16 rows × 64 bytes. Tiles are per thread, so this is neither
/// `Send` nor `Sync`.
pub struct AmxTiles {
    _thread: std::marker::PhantomData<*const ()>,
}

/// One AMX product: `C (mt × nt tiles) (+)= A · B` over `kt` `k`-tiles.
/// `a` starts at token tile 0's row 0 at the first `k`-tile (token rows
/// `a_stride` bytes apart, token tile 1 sixteen rows on); `b[n]` at panel
/// `n`'s first `k`-tile (`b_step` bytes between `k`-tiles, each 16 rows of
/// 64 bytes); C tile `(m, n)` at element `c_off + n · c_pstride + 256 · m`
/// of the accumulator slice, 16 rows of 16 elements.
#[derive(Clone, Copy, Debug)]
pub struct AmxBlock<'a> {
    pub a: &'a [u8],
    pub a_stride: usize,
    pub mt: usize,
    pub b: [&'a [u8]; 2],
    pub b_step: usize,
    pub nt: usize,
    pub kt: usize,
    pub c_off: usize,
    pub c_pstride: usize,
    pub accumulate: bool,
    /// Weights read next, prefetched into L2 while this block computes
    /// (empty slices for none).
    pub prefetch: [&'a [u8]; 2],
}

impl AmxBlock<'_> {
    /// Panics unless every byte the block touches is inside its slices
    /// (`c_len` accumulator elements).
    fn check(&self, c_len: usize) {
        use super::layout::NR;
        const ROWS: usize = 16;
        const TILE: usize = ROWS * 64;
        assert!((1..=2).contains(&self.mt) && (1..=2).contains(&self.nt));
        assert!(self.a_stride >= 64 || self.kt == 0);
        let a_end = (self.mt * ROWS - 1) * self.a_stride + self.kt * 64;
        assert!(
            self.kt == 0 || a_end <= self.a.len(),
            "AMX A tile out of bounds"
        );
        for b in &self.b[..self.nt] {
            assert!(
                self.kt == 0 || (self.kt - 1) * self.b_step + TILE <= b.len(),
                "AMX B tile out of bounds"
            );
        }
        let c_end = self.c_off + (self.nt - 1) * self.c_pstride + self.mt * ROWS * NR;
        assert!(c_end <= c_len, "AMX C tile out of bounds");
    }
}

impl AmxTiles {
    /// The block with `tdpbf16ps` (bf16 `A` and `B`, f32 `C`).
    pub fn bf16(&self, blk: &AmxBlock<'_>, c: &mut [f32]) {
        blk.check(c.len());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tiles are configured (`self` exists only inside
        // `amx_scope`) and the extents were just checked.
        unsafe {
            super::x86::amx::block::<false>(blk.mt, blk.nt, &raw_block(blk, c.as_mut_ptr().cast()))
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = c;
    }

    /// The block with `tdpbssd` (int8 `A` and `B`, i32 `C`).
    pub fn i8(&self, blk: &AmxBlock<'_>, c: &mut [i32]) {
        blk.check(c.len());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `bf16`.
        unsafe {
            super::x86::amx::block::<true>(blk.mt, blk.nt, &raw_block(blk, c.as_mut_ptr().cast()))
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = c;
    }
}

#[cfg(target_arch = "x86_64")]
fn raw_block(blk: &AmxBlock<'_>, c: *mut u8) -> super::x86::amx::Block {
    super::x86::amx::Block {
        a: blk.a.as_ptr(),
        a_stride: blk.a_stride,
        b: [blk.b[0].as_ptr(), blk.b[1].as_ptr()],
        b_step: blk.b_step,
        kt: blk.kt,
        c: c.wrapping_add(4 * blk.c_off),
        c_pstride: blk.c_pstride,
        accumulate: blk.accumulate,
        prefetch: blk.prefetch.map(|p| (p.as_ptr(), p.len())),
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
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                // SAFETY: every AVX-512 tier requires AVX-512 F.
                let r = unsafe { super::x86::avx512::fma_probe(iters, seed) };
                ((iters * 16 * 16 * 2) as f64, r)
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => {
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

    /// The instruction [`fma_probe`](Self::fma_probe) measures.
    pub fn fma_probe_name(&self) -> &'static str {
        match self.tier {
            Tier::Avx2 => "f32 FMA, AVX2 (ymm vfmadd)",
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                "f32 FMA, AVX-512 (zmm vfmadd)"
            }
            Tier::Neon | Tier::NeonDot | Tier::NeonI8mm | Tier::NeonBf16 => "f32 FMA, NEON (fmla)",
            Tier::Generic => "f32 multiply-add, scalar code",
        }
    }

    /// Measures the native bf16 dot-product throughput (`vdpbf16ps`; on the
    /// `amx` tier `tdpbf16ps`, on `neon-bf16` `bfmmla`: the prefill tiles'
    /// instructions) like [`fma_probe`](Self::fma_probe), counting two FLOPs
    /// per multiply-add; `None` on tiers without one.
    pub fn bf16_dot_probe(&self, iters: usize) -> Option<(f64, f32, &'static str)> {
        let seed = std::hint::black_box(1.0f32);
        match self.tier {
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Bf16 => {
                // SAFETY: this tier requires AVX-512 F, BW and BF16.
                let r = unsafe { super::x86::avx512::dpbf16_probe(iters, seed) };
                Some((
                    (iters * 16 * 16 * 4) as f64,
                    r,
                    "bf16 dot, AVX-512 BF16 (zmm vdpbf16ps)",
                ))
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Amx => {
                // SAFETY: this tier exists only where AMX is supported.
                let flops = unsafe { super::x86::amx::bf16_probe(iters) };
                Some((flops, seed, "bf16 dot, AMX (tdpbf16ps)"))
            }
            #[cfg(target_arch = "aarch64")]
            Tier::NeonBf16 => {
                // The prefill tile's instruction (twice BFDOT's multiply-adds
                // per instruction), as AMX's on the `amx` tier.
                // SAFETY: this tier requires the bf16 feature.
                let r = unsafe { super::aarch64::neon::bfmmla_probe(iters, seed) };
                Some(((iters * 24 * 32) as f64, r, "bf16 matmul, NEON BFMMLA"))
            }
            _ => {
                let _ = (iters, seed);
                None
            }
        }
    }
}

/// The process-wide kernels: `EPSERVE_KERNEL` if set and supported, else the
/// best tier. Detected on first use and cached.
pub fn kernels() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(|| {
        let k = forced_or_best();
        // `EPSERVE_BF16_DOT_PREFILL=0|1`: the bf16 dot tile on the prefill
        // path off or on, whatever the vendor says (A/B runs).
        match std::env::var("EPSERVE_BF16_DOT_PREFILL").ok().as_deref() {
            None | Some("") => k,
            Some("0") => k.with_bf16x_prefill(false),
            Some("1") => k.with_bf16x_prefill(true),
            Some(v) => {
                tracing::warn!(value = v, "EPSERVE_BF16_DOT_PREFILL is 0 or 1; ignored");
                k
            }
        }
    })
}

/// `EPSERVE_KERNEL`'s tier if set and supported, else the best one.
fn forced_or_best() -> Kernels {
    let forced = std::env::var("EPSERVE_KERNEL").ok();
    if let Some(name) = forced.as_deref().filter(|s| !s.is_empty()) {
        match Tier::parse(name) {
            Some(t) => match Kernels::for_tier(t) {
                Some(k) => return k,
                None => tracing::warn!(
                    tier = name,
                    "EPSERVE_KERNEL tier not supported by this CPU; using the best supported tier"
                ),
            },
            None => tracing::warn!(
                value = name,
                accepted = %Tier::names(),
                "unknown EPSERVE_KERNEL; using the best supported tier"
            ),
        }
    }
    let k = Kernels::best();
    tracing::debug!(tier = k.tier().name(), "MoE kernel tier");
    k
}

#[cfg(test)]
#[path = "tier_tests.rs"]
mod tests;
