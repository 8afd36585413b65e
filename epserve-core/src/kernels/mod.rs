//! Numeric kernels the model is built from. Everything computes in f32 with
//! f32 accumulation; weights may be f32, bf16 or f16 and are widened row by row
//! as they stream. Architecture-specific SIMD tiers will sit beside the
//! portable code here, each tested against it.

#[cfg(target_arch = "aarch64")]
pub mod aarch64;
pub(crate) mod amx_plan;
pub mod attention;
pub mod b12;
pub mod dispatch;
pub mod generic;
pub mod layout;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use std::cell::Cell;

use rayon::prelude::*;

use crate::config::Activation;
use crate::tensor::{Weight, WeightSlice};

/// Below this many multiply-adds a linear runs on the calling thread.
const PAR_THRESHOLD: usize = 1 << 16;

/// Dot product with eight independent accumulators (vectorizes well and keeps
/// f32 rounding error small).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `out[t, j] = Σ_k x[t, k] · w[j, k] (+ bias[j])` for `t < rows`: PyTorch's
/// `F.linear` with `w` of shape `[n, k]`.
pub fn linear(x: &[f32], rows: usize, w: &Weight, bias: Option<&[f32]>, out: &mut [f32]) {
    let (n, k) = (w.shape()[0], w.shape()[1]);
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(out.len(), rows * n);
    if rows == 0 || n == 0 {
        return;
    }
    let per_row = |j: usize, buf: &mut Vec<f32>, dst: &mut [f32]| {
        let wrow: &[f32] = match w.slice() {
            WeightSlice::F32(s) => &s[j * k..(j + 1) * k],
            _ => {
                buf.resize(k, 0.0);
                w.row_to_f32(j, buf);
                buf
            }
        };
        let b = bias.map(|b| b[j]).unwrap_or(0.0);
        for (t, d) in dst.iter_mut().enumerate() {
            *d = dot(&x[t * k..(t + 1) * k], wrow) + b;
        }
    };
    // Work in the transposed layout [n, rows] so each output feature is one
    // contiguous chunk, then transpose into `out`.
    let mut tmp = vec![0.0f32; n * rows];
    if rows * n * k < PAR_THRESHOLD {
        let mut buf = Vec::new();
        for (j, dst) in tmp.chunks_mut(rows).enumerate() {
            per_row(j, &mut buf, dst);
        }
    } else {
        let chunk = 16usize;
        tmp.par_chunks_mut(rows * chunk)
            .enumerate()
            .for_each_init(Vec::new, |buf, (c, block)| {
                for (i, dst) in block.chunks_mut(rows).enumerate() {
                    per_row(c * chunk + i, buf, dst);
                }
            });
    }
    for j in 0..n {
        for t in 0..rows {
            out[t * n + j] = tmp[j * rows + t];
        }
    }
}

/// Below this many values a row-wise pass stays on the calling thread.
const PAR_ROWS_MIN: usize = 1 << 16;

/// RMSNorm over each `dim`-sized row: `x / sqrt(mean(x²) + eps) * w`. Rows
/// run in parallel when there are many values; each row's result depends
/// only on the row.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    if dim == 0 {
        return;
    }
    let norm = |row: &mut [f32]| {
        let ms = sum_squares(row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = g * (*v * inv);
        }
    };
    if x.len() >= PAR_ROWS_MIN && x.len() > dim {
        x.par_chunks_mut(dim).for_each(norm);
    } else {
        x.chunks_mut(dim).for_each(norm);
    }
}

/// The residual step between two blocks in one pass over the rows:
/// `x += a`, then `out` = [`rms_norm`] of the new `x` (`x` itself stays
/// unnormalized). Same bits as the add, a copy and [`rms_norm`]; rows run in
/// parallel when there are many values (the add and the copy ran on one
/// thread before).
pub fn add_rms_norm(x: &mut [f32], a: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(x.len() == a.len() && x.len() == out.len());
    let dim = w.len();
    if dim == 0 {
        for (xv, av) in x.iter_mut().zip(a) {
            *xv += av;
        }
        out.copy_from_slice(x);
        return;
    }
    let row = |((xr, ar), or): ((&mut [f32], &[f32]), &mut [f32])| {
        for (xv, av) in xr.iter_mut().zip(ar) {
            *xv += av;
        }
        let ms = sum_squares(xr) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr.iter()).zip(w) {
            *o = g * (*v * inv);
        }
    };
    if x.len() >= PAR_ROWS_MIN && x.len() > dim {
        x.par_chunks_mut(dim)
            .zip(a.par_chunks(dim))
            .zip(out.par_chunks_mut(dim))
            .for_each(row);
    } else {
        x.chunks_mut(dim)
            .zip(a.chunks(dim))
            .zip(out.chunks_mut(dim))
            .for_each(row);
    }
}

/// `x += a`, rows in parallel when there are many values.
pub fn add_assign(x: &mut [f32], a: &[f32]) {
    assert_eq!(x.len(), a.len());
    if x.len() >= PAR_ROWS_MIN {
        x.par_chunks_mut(1 << 14)
            .zip(a.par_chunks(1 << 14))
            .for_each(|(xr, ar)| xr.iter_mut().zip(ar).for_each(|(x, a)| *x += a));
    } else {
        x.iter_mut().zip(a).for_each(|(x, a)| *x += a);
    }
}

/// `Σ v²` in 16 independent lanes added pairwise at the end (one sequential
/// chain of dependent adds cost a latency per value), so the order depends
/// only on the length.
fn sum_squares(v: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut chunks = v.chunks_exact(16);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x * x;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|x| x * x).sum();
    let mut n = 16;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            acc[i] += acc[i + n];
        }
    }
    acc[0] + tail
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return;
    }
    let mut s = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `e^x` without branches or library calls, so that loops over it
/// vectorize: Cody–Waite reduction `x = n·ln2 + r` with `|r| ≤ ln2/2`, a
/// degree-7 Taylor polynomial for `e^r` (truncation < 2e-9 relative) and the
/// exponent bits built from `n`. Within 2 ulp of `f32::exp` for
/// `x ∈ [-87, 88]`; inputs are clamped to that range (so it returns about
/// 1.6e-38 below it and 1.65e38 above it instead of 0 and infinity); NaN
/// stays NaN.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 · 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // `n` as an integer is in `t`'s low mantissa bits (offset by ROUND's):
    // integer arithmetic on the bits, not a float-to-int cast, whose
    // saturation and NaN rules keep a loop from vectorizing.
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    p * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// SiLU `x · σ(x)` through [`fast_exp`] (vectorizable).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * (1.0 / (1.0 + fast_exp(-x)))
}

/// Applies an activation to one value.
#[inline]
pub fn activate(a: Activation, x: f32) -> f32 {
    match a {
        Activation::Silu => silu(x),
        Activation::Gelu => 0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2)),
        Activation::GeluTanh => {
            let c = (2.0f32 / std::f32::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        // The gate half of GPT-OSS's clamped SwiGLU; see [`gated`].
        Activation::SwigluOai { alpha, limit } => {
            let g = x.min(limit);
            g * sigmoid(g * alpha)
        }
    }
}

/// The gated-MLP nonlinearity `act(gate) · up`; GPT-OSS's clamped SwiGLU
/// also clamps `up` to `±limit` and uses `up + 1`.
#[inline]
pub fn gated(a: Activation, gate: f32, up: f32) -> f32 {
    match a {
        Activation::SwigluOai { limit, .. } => (up.clamp(-limit, limit) + 1.0) * activate(a, gate),
        _ => activate(a, gate) * up,
    }
}

/// Error function (Abramowitz–Stegun 7.1.26 refined with f64; |err| < 1.5e-7).
fn erf(x: f32) -> f32 {
    let x = x as f64;
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    (if x >= 0.0 { y } else { -y }) as f32
}

/// Calls `f(g, mi)` for each group of `g` ∈ {8, 4, 1} queries from `mi`,
/// the groups covering `0..m` in order (the attention kernels' query
/// blocking on every SIMD tier).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
pub(crate) fn query_groups(m: usize, f: impl FnMut(usize, usize)) {
    query_groups_from(0, m, f);
}

/// [`query_groups`] covering `mi..m` (the queries from `mi` on).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
pub(crate) fn query_groups_from(mut mi: usize, m: usize, mut f: impl FnMut(usize, usize)) {
    for g in [8, 4, 1] {
        while mi + g <= m {
            f(g, mi);
            mi += g;
        }
    }
}

/// The by-row score kernels' query loop on every SIMD tier, for key row `i`
/// (at the pointer `k`): for the queries `mi0..m` of the slice `q` (rows `dk`
/// apart) in groups of 8, 4 and 1 ([`query_groups_from`]), the tier's
/// `dots::<G, BF>(q, dk, k, &mut [f32; G])`, each sum times `scale` stored
/// at `out[mi · ldo + i]`. Expands to unsafe pointer arithmetic: use it inside
/// an `unsafe` block whose caller guarantees the extents.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! row_scores {
    ($dots:ident::<$bf:ident>, $mi0:expr, $m:expr, $q:ident, $dk:ident, $k:ident, $i:ident, $scale:ident, $out:ident, $ldo:ident) => {
        $crate::kernels::query_groups_from($mi0, $m, |g, mi| {
            let (qg, o) = (
                $q.as_ptr().add(mi * $dk),
                $out.as_mut_ptr().add(mi * $ldo + $i),
            );
            macro_rules! group {
                ($g:literal) => {{
                    let mut d = [0.0f32; $g];
                    $dots::<$g, $bf>(qg, $dk, $k, &mut d);
                    for (g, x) in d.iter().enumerate() {
                        *o.add(g * $ldo) = x * $scale;
                    }
                }};
            }
            match g {
                8 => group!(8),
                4 => group!(4),
                _ => group!(1),
            }
        })
    };
}
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) use row_scores;

/// The first-element pointers of up to `N` token rows (the rest null): what
/// the arch tiers' tile kernels take instead of a slice of slices.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn row_ptrs<T, const N: usize>(x: &[&[T]]) -> [*const T; N] {
    let mut p = [std::ptr::null::<T>(); N];
    for (d, r) in p.iter_mut().zip(x) {
        *d = r.as_ptr();
    }
    p
}

thread_local! {
    /// Where this thread's two-panel prefill tiles send their L2 hints:
    /// `(next, end)` addresses, or `(0, 0)` for their own panels' next K
    /// block (see [`set_pair_l2_target`]).
    static PAIR_L2_TARGET: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
}

/// Points this thread's two-panel prefill tiles' L2 hints at `bytes`, one
/// line per `k`-pair step from its start until its end, instead of at their
/// own panels' next K block (`None`: back to that). The B12 prefill path
/// runs the tiles on panels it just decoded into L2, where those hints are
/// wasted; pointed at the next run's encoded panels they stream them into L2
/// while this run computes, so the next decode reads L2, not memory. Only a
/// hint: no result depends on it (the AVX-512 tiles read it; others ignore
/// it).
pub fn set_pair_l2_target(bytes: Option<&[u8]>) {
    let r = bytes.map_or((0, 0), |b| {
        let a = b.as_ptr() as usize;
        (a, a + b.len())
    });
    PAIR_L2_TARGET.with(|c| c.set(r));
}

/// The tiles' side of [`set_pair_l2_target`]: the current `(next, end)`.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn pair_l2_target() -> (usize, usize) {
    PAIR_L2_TARGET.with(|c| c.get())
}

/// Stores how far a tile got through the target (`next`), so the next tile
/// call hints the lines after it.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn advance_pair_l2_target(next: usize) {
    PAIR_L2_TARGET.with(|c| {
        let (_, end) = c.get();
        c.set((next, end));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused residual step gives the bits of the add, then the norm, on
    /// one thread and in parallel.
    #[test]
    fn add_rms_norm_equals_the_add_then_the_norm() {
        let dim = 2048 + 5;
        // 3 rows stay on the calling thread, 40 run in parallel.
        for rows in [3usize, 40] {
            let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
            let x: Vec<f32> = (0..rows * dim)
                .map(|i| ((i * 2654435761usize) % 1000) as f32 / 250.0 - 2.0)
                .collect();
            let a: Vec<f32> = (0..rows * dim)
                .map(|i| ((i * 40503usize) % 997) as f32 / 500.0 - 1.0)
                .collect();
            let mut want_x = x.clone();
            for (xv, av) in want_x.iter_mut().zip(&a) {
                *xv += av;
            }
            let mut want = want_x.clone();
            rms_norm(&mut want, &w, 1e-6);
            let (mut got_x, mut got) = (x.clone(), vec![f32::NAN; rows * dim]);
            add_rms_norm(&mut got_x, &a, &w, 1e-6, &mut got);
            assert_eq!(got_x, want_x, "{rows} rows: the residual");
            assert_eq!(got, want, "{rows} rows: the norm");
            let mut sum = x.clone();
            add_assign(&mut sum, &a);
            assert_eq!(sum, want_x, "{rows} rows: add_assign");
        }
    }

    /// Rows normalized in parallel (a prefill-sized batch) give the bits of
    /// each row normalized alone, and match the formula in f64.
    #[test]
    fn rms_norm_rows_do_not_depend_on_the_batch() {
        let dim = 2048 + 5;
        let rows = 40;
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        let x: Vec<f32> = (0..rows * dim)
            .map(|i| ((i * 2654435761usize) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let mut all = x.clone();
        rms_norm(&mut all, &w, 1e-6);
        for (r, got) in all.chunks(dim).enumerate() {
            let mut one = x[r * dim..(r + 1) * dim].to_vec();
            rms_norm(&mut one, &w, 1e-6);
            assert_eq!(got, &one[..], "row {r}");
            let src = &x[r * dim..(r + 1) * dim];
            let ms = src.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for ((g, &v), &wv) in got.iter().zip(src).zip(&w) {
                let want = wv as f64 * v as f64 * inv;
                assert!(
                    (*g as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn linear_matches_naive() {
        let (rows, n, k) = (3, 37, 129);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0)
            .collect();
        let wv: Vec<f32> = (0..n * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0)
            .collect();
        let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
        let w = Weight::from_f32(vec![n, k], &wv);
        let mut out = vec![0.0; rows * n];
        linear(&x, rows, &w, Some(&bias), &mut out);
        for t in 0..rows {
            for j in 0..n {
                let r: f64 = (0..k)
                    .map(|i| x[t * k + i] as f64 * wv[j * k + i] as f64)
                    .sum::<f64>()
                    + bias[j] as f64;
                assert!((out[t * n + j] as f64 - r).abs() < 1e-4, "{t} {j}");
            }
        }
        // Big enough to take the parallel path.
        let (rows, n, k) = (9, 300, 64);
        let x: Vec<f32> = (0..rows * k).map(|i| (i % 17) as f32 / 17.0).collect();
        let wv: Vec<f32> = (0..n * k).map(|i| (i % 19) as f32 / 19.0 - 0.5).collect();
        let w = Weight::from_f32(vec![n, k], &wv);
        let mut out = vec![0.0; rows * n];
        linear(&x, rows, &w, None, &mut out);
        for t in 0..rows {
            for j in 0..n {
                let r = dot(&x[t * k..(t + 1) * k], &wv[j * k..(j + 1) * k]);
                assert_eq!(out[t * n + j], r);
            }
        }
    }

    #[test]
    fn fast_exp_is_within_two_ulp_of_libm() {
        let ulp = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs();
        let mut worst = 0;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let (got, want) = (fast_exp(x), x.exp());
            worst = worst.max(ulp(got, want));
            assert!(ulp(got, want) <= 2, "e^{x}: {got} vs {want}");
            x += 0.000_731;
        }
        assert!(worst <= 2);
        assert!(fast_exp(f32::NAN).is_nan());
        assert!(fast_exp(-1e30) > 0.0 && fast_exp(-1e30) < 1e-37);
        assert!(fast_exp(1e30).is_finite());
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(-100.0)).abs() < 1e-30 && (silu(100.0) - 100.0).abs() < 1e-4);
    }

    #[test]
    fn softmax_and_norm() {
        let mut v = vec![1.0, 2.0, 3.0];
        softmax(&mut v);
        assert!((v.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let mut x = vec![3.0, 4.0];
        rms_norm(&mut x, &[1.0, 2.0], 0.0);
        let inv = 1.0 / (12.5f32).sqrt();
        assert!((x[0] - 3.0 * inv).abs() < 1e-6 && (x[1] - 8.0 * inv).abs() < 1e-6);
        assert!((activate(Activation::Gelu, 1.0) - 0.841_344_7).abs() < 1e-5);
    }
}
