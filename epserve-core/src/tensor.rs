//! Weights as the model reads them: a dtype, a shape and bytes that are either
//! a window into a memory-mapped safetensors file (no copy) or an owned,
//! aligned buffer. Activations are plain `Vec<f32>` in row-major layout.

use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

/// Element types weights may be stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

enum Backing {
    Mmap(Mmap),
    /// `u64` words keep the bytes 8-aligned for any element type.
    Owned(Vec<u64>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => bytemuck::cast_slice(v),
        }
    }
}

/// A memory-mapped file shared by the weights that live in it.
#[derive(Clone)]
pub struct SharedMmap(Arc<Backing>);

impl SharedMmap {
    /// Wraps a mapping so weights can borrow windows of it.
    pub fn new(m: Mmap) -> Self {
        SharedMmap(Arc::new(Backing::Mmap(m)))
    }
    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// Typed, borrowed view of a weight's elements.
#[derive(Debug, Clone, Copy)]
pub enum WeightSlice<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// A weight tensor (row-major).
#[derive(Clone)]
pub struct Weight {
    dtype: DType,
    shape: Vec<usize>,
    backing: Arc<Backing>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weight")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

impl Weight {
    /// A window of a mapped file. The window is copied into an aligned buffer
    /// only if its offset is not aligned for the element type.
    pub fn from_mmap(
        map: &SharedMmap,
        dtype: DType,
        shape: Vec<usize>,
        offset: usize,
        len: usize,
    ) -> Self {
        let aligned = (map.bytes().as_ptr() as usize + offset).is_multiple_of(dtype.size());
        if aligned {
            Weight {
                dtype,
                shape,
                backing: map.0.clone(),
                offset,
                len,
            }
        } else {
            Self::from_bytes(dtype, shape, &map.bytes()[offset..offset + len])
        }
    }

    /// An owned copy of raw little-endian bytes.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Weight {
            dtype,
            shape,
            backing: Arc::new(Backing::Owned(words)),
            offset: 0,
            len: bytes.len(),
        }
    }

    /// An owned f32 weight (tests, derived tensors).
    pub fn from_f32(shape: Vec<usize>, data: &[f32]) -> Self {
        Self::from_bytes(DType::F32, shape, bytemuck::cast_slice(data))
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Raw bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.backing.bytes()[self.offset..self.offset + self.len]
    }

    /// Typed view of the elements.
    pub fn slice(&self) -> WeightSlice<'_> {
        let b = self.bytes();
        // Alignment was established at construction, so these casts cannot fail;
        // fall back to an empty slice rather than panic if that invariant broke.
        match self.dtype {
            DType::F32 => WeightSlice::F32(bytemuck::try_cast_slice(b).unwrap_or(&[])),
            DType::BF16 => WeightSlice::BF16(bytemuck::try_cast_slice(b).unwrap_or(&[])),
            DType::F16 => WeightSlice::F16(bytemuck::try_cast_slice(b).unwrap_or(&[])),
        }
    }

    /// The `i`-th slice along the first dimension (e.g. one expert of a fused
    /// `[experts, out, in]` tensor), without copying.
    pub fn index0(&self, i: usize) -> Weight {
        let inner: usize = self.shape[1..].iter().product();
        self.narrow_elems(self.shape[1..].to_vec(), i * inner, inner)
    }

    /// Rows `start..start+n` of a 2-D weight, without copying.
    pub fn rows(&self, start: usize, n: usize) -> Weight {
        let cols: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = n;
        self.narrow_elems(shape, start * cols, n * cols)
    }

    /// Columns `start..start+n` of a 2-D weight, as an owned copy (columns are
    /// not contiguous; used for a tensor-parallel shard's slice of `o_proj`).
    pub fn columns(&self, start: usize, n: usize) -> Weight {
        let (rows, cols) = (self.shape[0], self.shape[1..].iter().product::<usize>());
        let es = self.dtype.size();
        let src = self.bytes();
        let mut out = Vec::with_capacity(rows * n * es);
        for r in 0..rows {
            let at = (r * cols + start) * es;
            out.extend_from_slice(&src[at..at + n * es]);
        }
        Self::from_bytes(self.dtype, vec![rows, n], &out)
    }

    fn narrow_elems(&self, shape: Vec<usize>, start: usize, n: usize) -> Weight {
        let es = self.dtype.size();
        Weight {
            dtype: self.dtype,
            shape,
            backing: self.backing.clone(),
            offset: self.offset + start * es,
            len: n * es,
        }
    }

    /// Converts row `r` of a 2-D weight into `out` (length = columns).
    #[inline]
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let k = out.len();
        match self.slice() {
            WeightSlice::F32(s) => out.copy_from_slice(&s[r * k..(r + 1) * k]),
            WeightSlice::BF16(s) => {
                for (o, v) in out.iter_mut().zip(&s[r * k..(r + 1) * k]) {
                    *o = v.to_f32();
                }
            }
            WeightSlice::F16(s) => {
                for (o, v) in out.iter_mut().zip(&s[r * k..(r + 1) * k]) {
                    *o = v.to_f32();
                }
            }
        }
    }

    /// All elements as f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.slice() {
            WeightSlice::F32(s) => s.to_vec(),
            WeightSlice::BF16(s) => s.iter().map(|v| v.to_f32()).collect(),
            WeightSlice::F16(s) => s.iter().map(|v| v.to_f32()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_and_rows_are_views() {
        let data: Vec<f32> = (0..24).map(|x| x as f32).collect();
        let w = Weight::from_f32(vec![2, 3, 4], &data);
        let e1 = w.index0(1);
        assert_eq!(e1.shape(), &[3, 4]);
        assert_eq!(e1.to_f32_vec()[0], 12.0);
        let r = e1.rows(1, 2);
        assert_eq!(r.shape(), &[2, 4]);
        assert_eq!(
            r.to_f32_vec(),
            (16..24).map(|x| x as f32).collect::<Vec<_>>()
        );
        let mut row = vec![0.0; 4];
        r.row_to_f32(1, &mut row);
        assert_eq!(row, vec![20.0, 21.0, 22.0, 23.0]);
    }

    #[test]
    fn bf16_converts_exactly() {
        let vals = [1.5f32, -2.25, 3.0e-3];
        let b: Vec<bf16> = vals.iter().map(|v| bf16::from_f32(*v)).collect();
        let w = Weight::from_bytes(DType::BF16, vec![3], bytemuck::cast_slice(&b));
        let back = w.to_f32_vec();
        for (x, y) in back.iter().zip(&b) {
            assert_eq!(*x, y.to_f32());
        }
    }
}
