//! Activations on the wire: row-major f32 tensors encoded as raw little-endian
//! bytes in the tensor's dtype: f32 (exact), bf16 (half the bytes) or int8
//! with one f32 scale per row (a quarter of the bytes plus 4 per row; the
//! W8A8 kernels' own activation quantization,
//! [`quantize_row_i8`], so int8 experts take the rows as they are).
//!
//! Payloads are [`Bytes`]: cloning an encoded tensor (the same hidden state
//! to several peers) shares its buffer.

use epserve_core::kernels::layout::quantize_row_i8;
use half::bf16;
use prost::bytes::Bytes;

use crate::pb::{Dtype, Tensor};

/// Encoding errors (a peer sent something inconsistent).
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("tensor of {rows}x{cols} {dtype:?} has {got} bytes, expected {want}")]
    Size {
        rows: u32,
        cols: u32,
        dtype: Dtype,
        got: usize,
        want: usize,
    },
    #[error("unsupported tensor dtype {0:?}")]
    Dtype(i32),
    #[error("row {row} has a non-finite value ({value}) in column {col}")]
    NonFinite { row: usize, col: usize, value: f32 },
    #[error("int8 tensor of {rows} rows has {got} bytes of scales, expected {want}")]
    Scales { rows: u32, got: usize, want: usize },
    #[error("int8 row {row} has scale {value} (must be finite and >= 0)")]
    BadScale { row: usize, value: f32 },
    #[error("int8 row {row} has -128 in column {col} (the wire uses -127..=127)")]
    Int8Range { row: usize, col: usize },
    #[error("{dtype:?} tensor carries {got} bytes of scales (only int8 has scales)")]
    StrayScales { dtype: Dtype, got: usize },
}

/// The dtype of outputs returned for inputs sent as `wire`: int8 requests
/// ask for bf16 outputs, f32 and bf16 for their own dtype.
pub fn output_dtype(wire: Dtype) -> Dtype {
    match wire {
        Dtype::F32 => Dtype::F32,
        _ => Dtype::Bf16,
    }
}

/// Bytes a tensor puts on the wire (payload and scales, not the framing).
pub fn payload_bytes(t: &Tensor) -> usize {
    t.data.len() + t.scales.len()
}

/// Rounds values to what a round trip through `dtype` gives (so a local run
/// can reproduce the cluster's numbers exactly). f32 and bf16 only: int8's
/// rounding depends on the row (use `decode(&encode(..))`).
pub fn round_trip(dtype: Dtype, x: &mut [f32]) {
    if dtype == Dtype::Bf16 {
        for v in x {
            *v = bf16::from_f32(*v).to_f32();
        }
    }
}

/// Encodes `[rows, cols]` f32 values as `dtype` (anything but bf16 and int8
/// is sent as f32).
pub fn encode(x: &[f32], rows: usize, cols: usize, dtype: Dtype) -> Tensor {
    let (dtype, data, scales) = match dtype {
        Dtype::Bf16 => {
            let mut out = Vec::with_capacity(x.len() * 2);
            for v in x {
                out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
            (Dtype::Bf16, out, Vec::new())
        }
        Dtype::Int8 => {
            let mut q = vec![0i8; rows * cols];
            let mut scales = Vec::with_capacity(rows * 4);
            if cols > 0 {
                for (qr, xr) in q.chunks_exact_mut(cols).zip(x.chunks_exact(cols)) {
                    scales.extend_from_slice(&quantize_row_i8(xr, qr).to_le_bytes());
                }
            } else {
                scales.resize(rows * 4, 0);
            }
            (Dtype::Int8, bytemuck::cast_vec::<i8, u8>(q), scales)
        }
        _ => {
            let mut out = Vec::with_capacity(x.len() * 4);
            for v in x {
                out.extend_from_slice(&v.to_le_bytes());
            }
            (Dtype::F32, out, Vec::new())
        }
    };
    Tensor {
        dtype: dtype as i32,
        rows: rows as u32,
        cols: cols as u32,
        data: Bytes::from(data),
        scales: Bytes::from(scales),
    }
}

/// An int8 tensor's rows as sent: `x[r, c] = scales[r] * q[r, c]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Rows {
    /// `[rows, cols]` row-major, in `-127..=127`.
    pub q: Vec<i8>,
    /// One scale per row, finite and >= 0.
    pub scales: Vec<f32>,
}

/// A decoded tensor: f32 values, and for an int8 tensor its quantized rows
/// (what an int8 expert consumes without quantizing again).
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub values: Vec<f32>,
    pub int8: Option<Int8Rows>,
}

/// [`decode`], refusing NaN and infinities (what a worker accepts from a peer).
pub fn decode_finite(t: &Tensor) -> Result<Vec<f32>, WireError> {
    Ok(decode_rows_finite(t)?.values)
}

/// [`decode_rows`], refusing NaN and infinities.
pub fn decode_rows_finite(t: &Tensor) -> Result<Decoded, WireError> {
    let d = decode_rows(t)?;
    if let Some(i) = d.values.iter().position(|v| !v.is_finite()) {
        let cols = (t.cols as usize).max(1);
        return Err(WireError::NonFinite {
            row: i / cols,
            col: i % cols,
            value: d.values[i],
        });
    }
    Ok(d)
}

/// Decodes a tensor into f32 values, checking its size.
pub fn decode(t: &Tensor) -> Result<Vec<f32>, WireError> {
    Ok(decode_rows(t)?.values)
}

/// Decodes a tensor into f32 values (int8: dequantized, `scale * q`), and
/// keeps an int8 tensor's rows as sent; checks every length, and an int8
/// tensor's scales (finite, >= 0) and values (no -128).
pub fn decode_rows(t: &Tensor) -> Result<Decoded, WireError> {
    let dtype = Dtype::try_from(t.dtype).map_err(|_| WireError::Dtype(t.dtype))?;
    let (rows, cols) = (t.rows as usize, t.cols as usize);
    let es = match dtype {
        Dtype::F32 => 4,
        Dtype::Bf16 => 2,
        Dtype::Int8 => 1,
        _ => return Err(WireError::Dtype(t.dtype)),
    };
    let n = rows.saturating_mul(cols);
    let want = n.saturating_mul(es);
    if t.data.len() != want {
        return Err(WireError::Size {
            rows: t.rows,
            cols: t.cols,
            dtype,
            got: t.data.len(),
            want,
        });
    }
    if dtype != Dtype::Int8 && !t.scales.is_empty() {
        return Err(WireError::StrayScales {
            dtype,
            got: t.scales.len(),
        });
    }
    Ok(match dtype {
        Dtype::Bf16 => Decoded {
            values: t
                .data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            int8: None,
        },
        Dtype::Int8 => {
            if t.scales.len() != rows * 4 {
                return Err(WireError::Scales {
                    rows: t.rows,
                    got: t.scales.len(),
                    want: rows * 4,
                });
            }
            let scales: Vec<f32> = t
                .scales
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            if let Some(row) = scales.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
                return Err(WireError::BadScale {
                    row,
                    value: scales[row],
                });
            }
            let q: Vec<i8> = t.data.iter().map(|&b| b as i8).collect();
            if let Some(i) = q.iter().position(|&v| v == i8::MIN) {
                return Err(WireError::Int8Range {
                    row: i / cols.max(1),
                    col: i % cols.max(1),
                });
            }
            let mut values = Vec::with_capacity(n);
            if cols > 0 {
                for (qr, &s) in q.chunks_exact(cols).zip(&scales) {
                    values.extend(qr.iter().map(|&v| s * v as f32));
                }
            }
            Decoded {
                values,
                int8: Some(Int8Rows { q, scales }),
            }
        }
        _ => Decoded {
            values: t
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            int8: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let x = vec![1.0f32, -2.5, 3.140625, 1e-3, 0.1];
        let t = encode(&x, 1, 5, Dtype::F32);
        assert_eq!(decode(&t).ok(), Some(x.clone()));
        let t = encode(&x, 1, 5, Dtype::Bf16);
        assert_eq!(t.data.len(), 10);
        let mut r = x.clone();
        round_trip(Dtype::Bf16, &mut r);
        assert_eq!(decode(&t).ok(), Some(r));
        let mut bad = t.clone();
        bad.data.truncate(bad.data.len() - 1);
        assert!(decode(&bad).is_err());
    }

    /// Rows of assorted magnitudes, one all zero.
    fn rows(cols: usize) -> Vec<f32> {
        let mut x = Vec::new();
        for (r, mag) in [1.0f32, 1e-4, 37.5, 0.0, 3e4].iter().enumerate() {
            for c in 0..cols {
                let v = ((r * 31 + c * 17) % 23) as f32 / 11.0 - 1.0;
                x.push(v * mag * if c % 3 == 0 { -1.0 } else { 1.0 });
            }
        }
        x
    }

    #[test]
    fn int8_round_trip_keeps_scales_and_error_within_half_a_step() {
        let cols = 19;
        let x = rows(cols);
        let n = x.len() / cols;
        let t = encode(&x, n, cols, Dtype::Int8);
        assert_eq!(t.dtype, Dtype::Int8 as i32);
        assert_eq!(t.data.len(), n * cols);
        assert_eq!(t.scales.len(), n * 4);
        assert_eq!(payload_bytes(&t), n * cols + n * 4);
        let d = decode_rows_finite(&t).expect("decodes");
        let q8 = d.int8.as_ref().expect("int8 rows kept");
        for r in 0..n {
            let xr = &x[r * cols..(r + 1) * cols];
            // Same quantization as the W8A8 kernels.
            let mut q = vec![0i8; cols];
            let s = quantize_row_i8(xr, &mut q);
            assert_eq!(q8.scales[r].to_bits(), s.to_bits(), "row {r} scale");
            assert_eq!(&q8.q[r * cols..(r + 1) * cols], &q[..], "row {r}");
            let amax = xr.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!((s - amax / 127.0).abs() <= f32::EPSILON * s, "row {r}: {s}");
            let got = &d.values[r * cols..(r + 1) * cols];
            for (c, (&g, &v)) in got.iter().zip(xr).enumerate() {
                let err = (g - v).abs();
                // Half a step, plus float rounding of 127/amax and s·q.
                assert!(
                    err <= s / 2.0 * (1.0 + 2e-4),
                    "row {r} col {c}: |{g} - {v}| = {err} > {}",
                    s / 2.0
                );
            }
        }
        // The all-zero row: scale 0, zeros.
        assert_eq!(q8.scales[3], 0.0);
        assert!(d.values[3 * cols..4 * cols].iter().all(|&v| v == 0.0));
        assert_eq!(output_dtype(Dtype::Int8), Dtype::Bf16);
        assert_eq!(output_dtype(Dtype::F32), Dtype::F32);
        // Sharing an encoded tensor shares its buffer.
        let u = t.clone();
        assert_eq!(u.data.as_ptr(), t.data.as_ptr());
    }

    #[test]
    fn malformed_int8_is_refused() {
        let cols = 8;
        let x = rows(cols);
        let n = x.len() / cols;
        let good = encode(&x, n, cols, Dtype::Int8);
        let with = |f: &dyn Fn(&mut Vec<u8>, &mut Vec<u8>)| {
            let mut t = good.clone();
            let (mut d, mut s) = (t.data.to_vec(), t.scales.to_vec());
            f(&mut d, &mut s);
            t.data = d.into();
            t.scales = s.into();
            decode_rows_finite(&t).err().map(|e| e.to_string())
        };
        let set_scale = |v: f32| {
            move |_: &mut Vec<u8>, s: &mut Vec<u8>| s[4..8].copy_from_slice(&v.to_le_bytes())
        };
        let cases: Vec<(&str, Option<String>)> = vec![
            ("expected 40", with(&|d, _| d.truncate(d.len() - 1))),
            ("expected 40", with(&|d, _| d.push(0))),
            ("bytes of scales", with(&|_, s| s.truncate(s.len() - 4))),
            ("bytes of scales", with(&|_, s| s.clear())),
            ("bytes of scales", with(&|_, s| s.push(0))),
            ("scale NaN", with(&set_scale(f32::NAN))),
            ("scale inf", with(&set_scale(f32::INFINITY))),
            ("scale -0.5", with(&set_scale(-0.5))),
            ("-128", with(&|d, _| d[3] = 0x80)),
            // A finite scale whose products overflow.
            ("non-finite", with(&set_scale(f32::MAX))),
        ];
        for (want, got) in cases {
            let got = got.unwrap_or_else(|| panic!("'{want}': accepted"));
            assert!(got.contains(want), "'{want}' not in: {got}");
        }
        assert!(decode_rows_finite(&good).is_ok());
        // Scales on a float tensor are malformed too.
        let mut f = encode(&x, n, cols, Dtype::Bf16);
        f.scales = good.scales.clone();
        assert!(matches!(decode(&f), Err(WireError::StrayScales { .. })));
    }
}
