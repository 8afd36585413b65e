//! Paged KV cache. A [`KvPool`] owns, for every layer, one big array of
//! fixed-size blocks (`block_size` positions each); a sequence's [`SeqCache`] is
//! just its block table and length. Blocks are handed out by a free list, so
//! sequences of any length share one memory budget without fragmentation, and
//! a finished or preempted sequence gives its blocks back at once.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::kernels::attention::KvRows;
use crate::kernels::layout::f32_to_bf16_bits;

/// Element type of the cached keys and values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvDtype {
    #[default]
    F32,
    /// bf16, rounded to nearest even on write; half the bytes per block.
    Bf16,
}

impl KvDtype {
    /// Bytes per cached element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }
    /// `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }
}

/// What `--kv-cache-dtype` asks for: `auto` is the model's declared dtype
/// (`bfloat16` → bf16, anything else → f32), as vLLM does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    #[default]
    Auto,
    F32,
    Bf16,
}

impl KvCacheDtype {
    /// Parses `auto`, `bf16` or `f32`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(KvCacheDtype::Auto),
            "bf16" | "bfloat16" => Some(KvCacheDtype::Bf16),
            "f32" | "float32" | "float" => Some(KvCacheDtype::F32),
            _ => None,
        }
    }

    /// The cache dtype for a model declaring `declared` (config.json's
    /// `dtype` / `torch_dtype`).
    pub fn resolve(self, declared: Option<&str>) -> KvDtype {
        match self {
            KvCacheDtype::F32 => KvDtype::F32,
            KvCacheDtype::Bf16 => KvDtype::Bf16,
            KvCacheDtype::Auto => match declared.map(|d| d.trim().to_ascii_lowercase()) {
                Some(d) if d == "bfloat16" || d == "bf16" => KvDtype::Bf16,
                _ => KvDtype::F32,
            },
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        KvCacheDtype::parse(s)
            .ok_or_else(|| format!("unknown KV cache dtype '{s}' (auto, bf16, f32)"))
    }
}

/// Cached elements as stored.
#[derive(Debug, Clone)]
pub enum KvData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl KvData {
    fn zeros(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F32 => KvData::F32(vec![0.0; n]),
            KvDtype::Bf16 => KvData::Bf16(vec![0; n]),
        }
    }
    /// The elements, for the attention kernels.
    pub fn rows(&self) -> KvRows<'_> {
        match self {
            KvData::F32(v) => KvRows::F32(v),
            KvData::Bf16(v) => KvRows::Bf16(v),
        }
    }
    /// Writes `src` at element `off` (bf16 rounded to nearest even).
    pub fn write(&mut self, off: usize, src: &[f32]) {
        match self {
            KvData::F32(v) => v[off..off + src.len()].copy_from_slice(src),
            KvData::Bf16(v) => {
                for (d, &x) in v[off..off + src.len()].iter_mut().zip(src) {
                    *d = f32_to_bf16_bits(x);
                }
            }
        }
    }
}

/// Storage of one layer: keys and values, `[num_blocks * block_size, width]`.
#[derive(Debug, Clone)]
pub struct LayerPool {
    pub k: KvData,
    pub v: KvData,
    pub k_width: usize,
    pub v_width: usize,
}

/// The shared block pool.
#[derive(Debug)]
pub struct KvPool {
    block_size: usize,
    num_blocks: usize,
    dtype: KvDtype,
    layers: Vec<LayerPool>,
    free: Vec<u32>,
}

/// One sequence's view of the pool.
#[derive(Debug, Clone)]
pub struct SeqCache {
    blocks: Vec<u32>,
    len: usize,
    /// Unique in this process: names the sequence's KV on attention-workers.
    id: u64,
}

/// Source of [`SeqCache`] ids.
static NEXT_SEQ_ID: AtomicU64 = AtomicU64::new(1);

impl Default for SeqCache {
    fn default() -> Self {
        Self::new()
    }
}

impl SeqCache {
    /// An empty cache (no blocks yet) with a fresh id.
    pub fn new() -> Self {
        SeqCache {
            blocks: Vec::new(),
            len: 0,
            id: NEXT_SEQ_ID.fetch_add(1, Ordering::Relaxed),
        }
    }
    /// The sequence's id, unique in this process (remote attention shards
    /// keep their KV under it).
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The block table.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

impl KvPool {
    /// A pool of `num_blocks` blocks of `block_size` positions for layers with
    /// the given (key width, value width) in floats per position. Memory is
    /// zero-initialized lazily by the OS, so a large pool costs nothing until used.
    /// Elements are stored as `dtype`.
    pub fn new(
        layer_widths: &[(usize, usize)],
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> Self {
        let block_size = block_size.max(1);
        let rows = block_size * num_blocks;
        KvPool {
            block_size,
            num_blocks,
            dtype,
            layers: layer_widths
                .iter()
                .map(|&(kw, vw)| LayerPool {
                    k: KvData::zeros(dtype, rows * kw),
                    v: KvData::zeros(dtype, rows * vw),
                    k_width: kw,
                    v_width: vw,
                })
                .collect(),
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    /// Bytes one block takes over all layers with elements of `dtype`.
    pub fn block_bytes(
        layer_widths: &[(usize, usize)],
        block_size: usize,
        dtype: KvDtype,
    ) -> usize {
        layer_widths
            .iter()
            .map(|(k, v)| (k + v) * dtype.bytes())
            .sum::<usize>()
            * block_size
    }

    /// Element type of the cached keys and values.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    /// Blocks a sequence needs to hold `len` positions.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }

    /// Makes room for `seq` to grow to `new_len` positions. On failure nothing
    /// is allocated.
    pub fn reserve(&mut self, seq: &mut SeqCache, new_len: usize) -> Result<()> {
        let need = self.blocks_for(new_len).saturating_sub(seq.blocks.len());
        if need > self.free.len() {
            return Err(Error::InvalidInput(format!(
                "KV cache full: {need} more blocks needed, {} free of {}",
                self.free.len(),
                self.num_blocks
            )));
        }
        for _ in 0..need {
            if let Some(b) = self.free.pop() {
                seq.blocks.push(b);
            }
        }
        Ok(())
    }

    /// Gives back blocks beyond the first `keep` (undoing a [`reserve`](Self::reserve)).
    pub fn shrink(&mut self, seq: &mut SeqCache, keep: usize) {
        while seq.blocks.len() > keep {
            if let Some(b) = seq.blocks.pop() {
                self.free.push(b);
            }
        }
        seq.len = seq.len.min(seq.blocks.len() * self.block_size);
    }

    /// Returns all of a sequence's blocks to the pool and empties it.
    pub fn release(&mut self, seq: &mut SeqCache) {
        self.free.extend(seq.blocks.drain(..).rev());
        seq.len = 0;
    }

    /// Row index of position `pos` of `seq` in a layer's storage.
    #[inline]
    pub fn row(&self, seq: &SeqCache, pos: usize) -> usize {
        seq.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// A layer's storage.
    pub fn layer(&self, l: usize) -> &LayerPool {
        &self.layers[l]
    }
    /// A layer's storage, mutable.
    pub fn layer_mut(&mut self, l: usize) -> &mut LayerPool {
        &mut self.layers[l]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reused_and_exhaustion_is_an_error() {
        let mut p = KvPool::new(&[(4, 4)], 4, 3, KvDtype::F32);
        let mut a = SeqCache::new();
        p.reserve(&mut a, 9).expect("fits");
        assert_eq!(a.blocks().len(), 3);
        assert_eq!(p.free_blocks(), 0);
        let mut b = SeqCache::new();
        assert!(p.reserve(&mut b, 1).is_err());
        assert!(b.blocks().is_empty());
        p.release(&mut a);
        assert_eq!(p.free_blocks(), 3);
        p.reserve(&mut b, 5).expect("fits after release");
        assert_eq!(p.row(&b, 5), b.blocks()[1] as usize * 4 + 1);
    }

    #[test]
    fn bf16_pools_halve_the_bytes_and_round_to_nearest_even() {
        let w = [(8, 8), (5, 0)];
        assert_eq!(
            KvPool::block_bytes(&w, 16, KvDtype::F32),
            2 * KvPool::block_bytes(&w, 16, KvDtype::Bf16)
        );
        let mut p = KvPool::new(&w, 2, 2, KvDtype::Bf16);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0);
        // 1 + 3·2^-8 rounds up to 1 + 2^-6.
        p.layer_mut(0)
            .k
            .write(3, &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0]);
        let rows = p.layer(0).k.rows();
        assert_eq!((rows.get(3), rows.get(4)), (1.0, 1.0 + 1.0 / 64.0));
        assert_eq!(KvCacheDtype::Auto.resolve(Some("bfloat16")), KvDtype::Bf16);
        assert_eq!(KvCacheDtype::Auto.resolve(Some("float32")), KvDtype::F32);
        assert_eq!(KvCacheDtype::Auto.resolve(None), KvDtype::F32);
        assert_eq!(KvCacheDtype::F32.resolve(Some("bfloat16")), KvDtype::F32);
        assert_eq!("bf16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Bf16));
        assert!("fp8".parse::<KvCacheDtype>().is_err());
    }
}
