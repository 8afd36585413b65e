//! Paged KV cache. A [`KvPool`] owns, for every layer, one big array of
//! fixed-size blocks (`block_size` positions each); a sequence's [`SeqCache`] is
//! just its block table and length. Blocks are handed out by a free list, so
//! sequences of any length share one memory budget without fragmentation, and
//! a finished or preempted sequence gives its blocks back at once.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Storage of one layer: keys and values, `[num_blocks * block_size, width]`.
#[derive(Debug, Clone)]
pub struct LayerPool {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub k_width: usize,
    pub v_width: usize,
}

/// The shared block pool.
#[derive(Debug)]
pub struct KvPool {
    block_size: usize,
    num_blocks: usize,
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
    pub fn new(layer_widths: &[(usize, usize)], block_size: usize, num_blocks: usize) -> Self {
        let block_size = block_size.max(1);
        let rows = block_size * num_blocks;
        KvPool {
            block_size,
            num_blocks,
            layers: layer_widths
                .iter()
                .map(|&(kw, vw)| LayerPool {
                    k: vec![0.0; rows * kw],
                    v: vec![0.0; rows * vw],
                    k_width: kw,
                    v_width: vw,
                })
                .collect(),
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    /// Bytes one block takes over all layers.
    pub fn block_bytes(layer_widths: &[(usize, usize)], block_size: usize) -> usize {
        layer_widths.iter().map(|(k, v)| (k + v) * 4).sum::<usize>() * block_size
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
        let mut p = KvPool::new(&[(4, 4)], 4, 3);
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
}
