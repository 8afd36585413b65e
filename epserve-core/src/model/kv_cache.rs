//! Per-sequence key/value cache: for every layer, the keys and values of all
//! positions seen so far, `[position, kv_heads, head_dim]`, appended as the
//! sequence grows.

/// Keys and values of one layer.
#[derive(Debug, Clone, Default)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// The cache of one sequence.
#[derive(Debug, Clone)]
pub struct SeqCache {
    pub layers: Vec<LayerKv>,
    len: usize,
}

impl SeqCache {
    /// An empty cache for a model with `num_layers` decoder layers.
    pub fn new(num_layers: usize) -> Self {
        SeqCache {
            layers: vec![LayerKv::default(); num_layers],
            len: 0,
        }
    }

    /// Number of positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records that `n` positions were appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops everything after the first `len` positions (`kv_width` floats per
    /// position per layer).
    pub fn truncate(&mut self, len: usize, kv_width: usize) {
        for l in &mut self.layers {
            l.k.truncate(len * kv_width);
            l.v.truncate(len * kv_width);
        }
        self.len = self.len.min(len);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.k.len() + l.v.len()) * 4)
            .sum()
    }
}
