//! Activations on the wire: row-major f32 tensors encoded as raw little-endian
//! bytes in the tensor's dtype (f32 exact, bf16 half the bytes).

use half::bf16;

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
}

/// Rounds values to what a round trip through `dtype` gives (so a local run
/// can reproduce the cluster's numbers exactly).
pub fn round_trip(dtype: Dtype, x: &mut [f32]) {
    if dtype == Dtype::Bf16 {
        for v in x {
            *v = bf16::from_f32(*v).to_f32();
        }
    }
}

/// Encodes `[rows, cols]` f32 values as `dtype`.
pub fn encode(x: &[f32], rows: usize, cols: usize, dtype: Dtype) -> Tensor {
    let data = match dtype {
        Dtype::Bf16 => {
            let mut out = Vec::with_capacity(x.len() * 2);
            for v in x {
                out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
            out
        }
        _ => {
            let mut out = Vec::with_capacity(x.len() * 4);
            for v in x {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out
        }
    };
    let dtype = if dtype == Dtype::Bf16 {
        Dtype::Bf16
    } else {
        Dtype::F32
    };
    Tensor {
        dtype: dtype as i32,
        rows: rows as u32,
        cols: cols as u32,
        data,
        scales: Vec::new(),
    }
}

/// [`decode`], refusing NaN and infinities (what a worker accepts from a peer).
pub fn decode_finite(t: &Tensor) -> Result<Vec<f32>, WireError> {
    let x = decode(t)?;
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        let cols = (t.cols as usize).max(1);
        return Err(WireError::NonFinite {
            row: i / cols,
            col: i % cols,
            value: x[i],
        });
    }
    Ok(x)
}

/// Decodes a tensor into f32 values, checking its size.
pub fn decode(t: &Tensor) -> Result<Vec<f32>, WireError> {
    let dtype = Dtype::try_from(t.dtype).map_err(|_| WireError::Dtype(t.dtype))?;
    let n = t.rows as usize * t.cols as usize;
    let es = match dtype {
        Dtype::F32 => 4,
        Dtype::Bf16 => 2,
        _ => return Err(WireError::Dtype(t.dtype)),
    };
    if t.data.len() != n * es {
        return Err(WireError::Size {
            rows: t.rows,
            cols: t.cols,
            dtype,
            got: t.data.len(),
            want: n * es,
        });
    }
    Ok(match dtype {
        Dtype::Bf16 => t
            .data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => t
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
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
        bad.data.pop();
        assert!(decode(&bad).is_err());
    }
}
