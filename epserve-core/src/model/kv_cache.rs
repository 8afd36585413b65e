//! Paged KV cache. A [`KvPool`] owns, for every layer, one big array of
//! fixed-size blocks (`block_size` positions each); a sequence's [`SeqCache`] is
//! just its block table and length. Blocks are handed out by a free list, so
//! sequences of any length share one memory budget without fragmentation, and
//! a finished or preempted sequence gives its blocks back at once.
//!
//! With automatic prefix caching ([`KvPool::enable_prefix_caching`], as vLLM's)
//! every full block is content-hashed as it fills: the hash of block `i` chains
//! the hash of block `i - 1` with the block's token ids (seeded with the model's
//! identity). Blocks are reference-counted; a released block that is full and
//! hashed is not freed but parked in an LRU of cached-free blocks, evicted
//! (oldest first) only when a reservation finds no truly free block. A new
//! sequence whose tokens start with a cached chain attaches those blocks
//! ([`KvPool::match_prefix`]) and computes only the rest. A full block is
//! immutable: a sequence only ever writes positions past the blocks it shares.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::kernels::attention::{KvRows, KvView, column_index};
use crate::kernels::layout::f32_to_bf16_bits;
use crate::mem::ZeroBuf;

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
    F32(ZeroBuf<f32>),
    Bf16(ZeroBuf<u16>),
}

impl KvData {
    /// `n` zeros, untouched fresh pages marked for huge pages: decode at
    /// long context streams the whole cache ([`crate::mem`]).
    fn zeros(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F32 => KvData::F32(ZeroBuf::zeroed(n)),
            KvDtype::Bf16 => KvData::Bf16(ZeroBuf::zeroed(n)),
        }
    }
    /// The elements, for the attention kernels.
    pub fn rows(&self) -> KvRows<'_> {
        match self {
            KvData::F32(v) => KvRows::F32(v),
            KvData::Bf16(v) => KvRows::Bf16(v),
        }
    }
    /// Copies `rows` rows of `width` elements from row `from` to row `to`
    /// of the rows starting at element `base`.
    fn copy_rows(&mut self, base: usize, from: usize, to: usize, rows: usize, width: usize) {
        let (src, n, dst) = (base + from * width, rows * width, base + to * width);
        match self {
            KvData::F32(v) => v.copy_within(src..src + n, dst),
            KvData::Bf16(v) => v.copy_within(src..src + n, dst),
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
    /// Writes `src` as one position of a block stored by column: element `c`
    /// at `base + c·step` (bf16 rounded to nearest even).
    fn write_strided(&mut self, base: usize, step: usize, src: &[f32]) {
        match self {
            KvData::F32(v) => {
                for (c, &x) in src.iter().enumerate() {
                    v[base + c * step] = x;
                }
            }
            KvData::Bf16(v) => {
                for (c, &x) in src.iter().enumerate() {
                    v[base + c * step] = f32_to_bf16_bits(x);
                }
            }
        }
    }
}

/// Whether layers with separate values store their keys by column
/// (`EPSERVE_KEY_COLUMNS` is not `0`/`off`; read once).
fn key_columns_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !crate::mem::switched_off("EPSERVE_KEY_COLUMNS"))
}

/// Whether layers of several KV heads store each head in its own plane
/// (`EPSERVE_KV_PLANES` is not `0`/`off`; read once).
fn head_planes_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !crate::mem::switched_off("EPSERVE_KV_PLANES"))
}

/// Whether value rows whose bytes are a multiple of 1 KiB get one cache
/// line of padding (`EPSERVE_KV_PAD` is not `0`/`off`; read once).
fn value_padding_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !crate::mem::switched_off("EPSERVE_KV_PAD"))
}

/// Elements from one value row to the next in a pool of `dtype` with rows
/// of `v_width` elements, `pad` (see [`value_padding_enabled`]) allowing.
///
/// The value pass reads a chunk of consecutive positions' rows one column
/// block at a time. Rows a multiple of 1 KiB apart fall into a few L1 sets
/// (L1 sets repeat every 4 KiB on a 32 KiB 8-way cache, every 16 KiB on a
/// 64 KiB 4-way one): at 4 KV heads × 128 bf16 every fourth row shares a
/// set, at 16 heads all rows do, and the chunk's lines evict each other
/// between passes. One 64-byte line after each such row walks the rows
/// across the sets at a cost of 64 bytes a row (6 % of the values at 1 KiB,
/// 1.6 % at 4 KiB). Rows stay 64-byte aligned; the kernels never read the
/// padding (it stays zero).
pub fn value_stride(v_width: usize, dtype: KvDtype, pad: bool) -> usize {
    let bytes = v_width * dtype.bytes();
    if pad && v_width > 0 && bytes.is_multiple_of(1024) {
        v_width + 64 / dtype.bytes()
    } else {
        v_width
    }
}

/// What one layer caches per position: key and value widths (elements;
/// MLA: the latent and RoPE key as the key, no value) and the KV heads
/// they hold side by side (1 for MLA's one latent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayerShape {
    pub k_width: usize,
    pub v_width: usize,
    pub heads: usize,
}

impl KvLayerShape {
    /// `heads` KV heads of `head_dim` keys and values each (GQA / MHA).
    pub fn heads(heads: usize, head_dim: usize) -> Self {
        KvLayerShape {
            k_width: heads * head_dim,
            v_width: heads * head_dim,
            heads,
        }
    }
}

impl From<(usize, usize)> for KvLayerShape {
    /// Widths stored as one row per position (one plane).
    fn from((k_width, v_width): (usize, usize)) -> Self {
        KvLayerShape {
            k_width,
            v_width,
            heads: 1,
        }
    }
}

/// Storage of one layer: keys and values in `planes` planes (one per KV
/// head with [`KvLayout::head_planes`], else one), each plane
/// `[num_blocks * block_size, width / planes]` (value rows `v_stride`
/// elements apart: [`value_stride`]). A head's keys and values for
/// consecutive positions are then consecutive in memory: a decode reads
/// each head's cache as one stream (rows holding every head side by side
/// made it a strided read of a slice of each row). The keys of a layer
/// with separate values are stored by column inside each block of a
/// plane (`k_by_column`, see
/// [`crate::kernels::attention::KvView::by_column`]).
#[derive(Debug, Clone)]
pub struct LayerPool {
    pub k: KvData,
    pub v: KvData,
    pub k_width: usize,
    pub v_width: usize,
    /// Planes the heads are stored in (1: rows hold every head).
    pub planes: usize,
    /// Elements from one value row to the next in a plane (`v_width /
    /// planes` plus any padding).
    pub v_stride: usize,
    /// Positions in the pool (rows of each plane).
    rows: usize,
    /// Keys stored by column inside each block: position `t` of block `b`,
    /// element `c` at `b·bs·k_width + c·bs + t`. Set for every layer with
    /// separate values (not MLA, whose latent rows are keys and values at
    /// once) unless `EPSERVE_KEY_COLUMNS=0`.
    pub k_by_column: bool,
    block_size: usize,
}

impl LayerPool {
    /// Key elements per plane row.
    fn k_plane_width(&self) -> usize {
        self.k_width / self.planes
    }
    /// Value elements per plane row (without padding).
    fn v_plane_width(&self) -> usize {
        self.v_width / self.planes
    }
    /// Index of key element `c` (of the plane) of pool row `r` in plane `p`.
    fn key_index(&self, p: usize, r: usize, c: usize) -> usize {
        let kw = self.k_plane_width();
        p * self.rows * kw
            + if self.k_by_column {
                column_index(r, c, self.block_size, kw)
            } else {
                r * kw + c
            }
    }
    /// Index of value element `c` (of the plane) of pool row `r` in plane `p`.
    fn value_index(&self, p: usize, r: usize, c: usize) -> usize {
        (p * self.rows + r) * self.v_stride + c
    }
    /// Writes pool row `r`'s key (`k_width` elements, the heads side by side).
    pub fn write_k(&mut self, r: usize, src: &[f32]) {
        debug_assert_eq!(src.len(), self.k_width);
        let kw = self.k_plane_width();
        for (p, head) in src.chunks_exact(kw.max(1)).enumerate() {
            let base = self.key_index(p, r, 0);
            if self.k_by_column {
                self.k.write_strided(base, self.block_size, head);
            } else {
                self.k.write(base, head);
            }
        }
    }
    /// Writes pool row `r`'s value (`v_width` elements, the heads side by side).
    pub fn write_v(&mut self, r: usize, src: &[f32]) {
        debug_assert_eq!(src.len(), self.v_width);
        let vw = self.v_plane_width();
        for (p, head) in src.chunks_exact(vw.max(1)).enumerate() {
            let base = self.value_index(p, r, 0);
            self.v.write(base, head);
        }
    }
    /// The key and value views of a layer with separate values holding KV
    /// heads of `head_width` elements (GQA / MHA), in the layout this pool
    /// stores them. Panics if the pool's planes are not one head wide.
    pub fn views(&self, head_width: usize) -> (KvView<'_>, KvView<'_>) {
        let view = |rows, stride, head_stride, by_column| KvView {
            rows,
            stride,
            head_stride,
            width: head_width,
            by_column,
        };
        if self.planes == 1 {
            return (
                view(self.k.rows(), self.k_width, head_width, self.k_by_column),
                view(self.v.rows(), self.v_stride, head_width, false),
            );
        }
        assert_eq!(self.k_plane_width(), head_width, "one head per plane");
        assert_eq!(self.v_plane_width(), head_width, "one head per plane");
        // Keys by column count a head's offset in columns of `bs` elements
        // (`KvView::by_column`): a plane is `rows / bs` blocks of them.
        let k_head = if self.k_by_column {
            self.rows / self.block_size * head_width
        } else {
            self.rows * head_width
        };
        (
            view(self.k.rows(), head_width, k_head, self.k_by_column),
            view(
                self.v.rows(),
                self.v_stride,
                self.rows * self.v_stride,
                false,
            ),
        )
    }
    /// Element `c` of pool row `r`'s key (`c` over all heads, side by side),
    /// as stored (widened to f32).
    pub fn key(&self, r: usize, c: usize) -> f32 {
        let kw = self.k_plane_width();
        self.k.rows().get(self.key_index(c / kw, r, c % kw))
    }
    /// Element `c` of pool row `r`'s value (`c` over all heads, side by
    /// side), as stored (widened to f32).
    pub fn value(&self, r: usize, c: usize) -> f32 {
        let vw = self.v_plane_width();
        let (p, c) = (c / vw, c % vw);
        self.v.rows().get(self.value_index(p, r, c))
    }
}

/// How a pool lays out its layers ([`KvPool::with_layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Keys of layers with separate values stored by column inside each
    /// block (`EPSERVE_KEY_COLUMNS=0` turns it off by default).
    pub key_columns: bool,
    /// Value rows padded by a cache line where their bytes are a multiple
    /// of 1 KiB ([`value_stride`]; `EPSERVE_KV_PAD=0` turns it off by
    /// default).
    pub pad_values: bool,
    /// Each KV head of a layer in its own plane ([`LayerPool`];
    /// `EPSERVE_KV_PLANES=0` turns it off by default).
    pub head_planes: bool,
}

impl Default for KvLayout {
    /// What the environment asks (both on unless switched off).
    fn default() -> Self {
        KvLayout {
            key_columns: key_columns_enabled(),
            pad_values: value_padding_enabled(),
            head_planes: head_planes_enabled(),
        }
    }
}

/// The shared block pool.
#[derive(Debug)]
pub struct KvPool {
    block_size: usize,
    num_blocks: usize,
    dtype: KvDtype,
    layers: Vec<LayerPool>,
    free: Vec<u32>,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// Set when prefix caching is on: the seed of every hash chain.
    prefix_seed: Option<u64>,
    /// Per block, the chain hash it is registered under (full blocks only).
    block_hash: Vec<Option<u64>>,
    /// Registered full blocks by chain hash, with what they hold (checked on
    /// lookup, so a 64-bit collision can never attach the wrong block).
    cached: HashMap<u64, CachedBlock>,
    /// Hashed blocks no sequence holds, by release tick (oldest first).
    lru: BTreeMap<u64, u32>,
    /// Per block, its key in `lru` while it is there.
    lru_tick: Vec<u64>,
    tick: u64,
}

/// What a registered block holds: its chain's parent hash and its tokens.
#[derive(Debug)]
struct CachedBlock {
    block: u32,
    parent: u64,
    tokens: Box<[u32]>,
}

/// One sequence's view of the pool.
#[derive(Debug, Clone)]
pub struct SeqCache {
    blocks: Vec<u32>,
    len: usize,
    /// Unique in this process: names the sequence's KV on attention-workers.
    id: u64,
    /// Chain hashes of the full blocks so far (prefix caching only).
    hashes: Vec<u64>,
    /// Tokens written past the last full block (prefix caching only).
    tail: Vec<u32>,
    /// Set by [`KvPool::uncache`]: its keys/values are not to be reused.
    no_cache: bool,
    /// Mixed into the first block's hash ([`SeqCache::set_salt`]): sequences
    /// with different salts never share blocks.
    salt: Option<u64>,
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
            hashes: Vec::new(),
            tail: Vec::new(),
            no_cache: false,
            salt: None,
        }
    }
    /// A view of blocks someone else allocated (an attention shard following
    /// the coordinator's block table): `blocks` in this pool's block size,
    /// `len` positions held. Not for [`KvPool::reserve`] / `release`.
    pub fn with_blocks(blocks: Vec<u32>, len: usize) -> Self {
        SeqCache {
            blocks,
            len,
            ..Self::new()
        }
    }
    /// Sets the per-request cache salt (vLLM's `cache_salt`): it is mixed
    /// into the hash of the first block, so only sequences with the same salt
    /// share cached blocks. Call before the first [`KvPool::match_prefix`].
    pub fn set_salt(&mut self, salt: &str) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        "epserve-cache-salt".hash(&mut h);
        salt.hash(&mut h);
        self.salt = Some(h.finish());
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
        Self::with_layout(
            layer_widths,
            block_size,
            num_blocks,
            dtype,
            KvLayout::default(),
        )
    }

    /// [`KvPool::new`] with the given layout (benchmarks and tests compare
    /// layouts; `new` takes [`KvLayout::default`]).
    pub fn with_layout(
        layer_widths: &[(usize, usize)],
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
        layout: KvLayout,
    ) -> Self {
        let shapes: Vec<KvLayerShape> = layer_widths.iter().map(|&w| w.into()).collect();
        Self::for_layers(&shapes, block_size, num_blocks, dtype, layout)
    }

    /// Planes a layer of `shape` is stored in under `layout`: one per KV
    /// head with [`KvLayout::head_planes`] (MLA's latent: one).
    fn planes(shape: &KvLayerShape, layout: KvLayout) -> usize {
        let h = shape.heads.max(1);
        let even = shape.k_width.is_multiple_of(h) && shape.v_width.is_multiple_of(h);
        if layout.head_planes && even { h } else { 1 }
    }

    /// A pool for layers of the given shapes (their KV heads known, so each
    /// head can have its plane), laid out as `layout` says.
    pub fn for_layers(
        layers: &[KvLayerShape],
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
        layout: KvLayout,
    ) -> Self {
        let block_size = block_size.max(1);
        let rows = block_size * num_blocks;
        KvPool {
            block_size,
            num_blocks,
            dtype,
            layers: layers
                .iter()
                .map(|shape| {
                    let planes = Self::planes(shape, layout);
                    let (kw, vw) = (shape.k_width, shape.v_width);
                    let v_stride = value_stride(vw / planes, dtype, layout.pad_values);
                    LayerPool {
                        k: KvData::zeros(dtype, rows * kw),
                        v: KvData::zeros(dtype, rows * planes * v_stride),
                        k_width: kw,
                        v_width: vw,
                        planes,
                        v_stride,
                        rows,
                        k_by_column: vw > 0 && layout.key_columns,
                        block_size,
                    }
                })
                .collect(),
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
            prefix_seed: None,
            block_hash: vec![None; num_blocks],
            cached: HashMap::new(),
            lru: BTreeMap::new(),
            lru_tick: vec![0; num_blocks],
            tick: 0,
        }
    }

    /// Turns on automatic prefix caching; `identity` (the model's and any
    /// salt's) seeds every hash chain. Call before any sequence holds blocks.
    pub fn enable_prefix_caching(&mut self, identity: &str) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        "epserve-prefix-cache-v1".hash(&mut h);
        identity.hash(&mut h);
        self.block_size.hash(&mut h);
        self.dtype.name().hash(&mut h);
        self.prefix_seed = Some(h.finish());
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_seed.is_some()
    }

    /// Hashed blocks no sequence holds (reusable on a prefix hit, evicted
    /// when a reservation finds no truly free block).
    pub fn cached_free_blocks(&self) -> usize {
        self.lru.len()
    }

    /// The first parent of `seq`'s hash chain: the pool's seed, salted.
    fn chain_seed(seed: u64, seq: &SeqCache) -> u64 {
        match seq.salt {
            Some(salt) => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                seed.hash(&mut h);
                salt.hash(&mut h);
                h.finish()
            }
            None => seed,
        }
    }

    /// Forgets every registered block (a worker holding the keys/values may
    /// have lost them): cached-free blocks become truly free, held ones are
    /// freed when released. Nothing is shared afterwards until computed again.
    pub fn clear_prefix_cache(&mut self) {
        self.cached.clear();
        for h in &mut self.block_hash {
            *h = None;
        }
        while let Some((_, b)) = self.lru.pop_first() {
            self.free.push(b);
        }
    }

    fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// A block no sequence holds: a truly free one, else the least recently
    /// released cached one (its hash forgotten).
    fn take_block(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first()?;
                if let Some(h) = self.block_hash[b as usize].take() {
                    self.cached.remove(&h);
                }
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Drops one reference to `b`; at zero it is parked in the LRU when it
    /// holds a registered full block, freed otherwise.
    fn put_block(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r = r.saturating_sub(1);
        if *r > 0 {
            return;
        }
        if self.block_hash[b as usize].is_some() {
            self.tick += 1;
            self.lru_tick[b as usize] = self.tick;
            self.lru.insert(self.tick, b);
        } else {
            self.free.push(b);
        }
    }

    /// Attaches to an empty `seq` the longest chain of cached full blocks
    /// matching the start of `tokens`, leaving at least the last token to
    /// compute (its logits are needed), and returns the positions attached
    /// (a multiple of the block size; 0 when caching is off).
    pub fn match_prefix(&mut self, seq: &mut SeqCache, tokens: &[u32]) -> usize {
        let Some(seed) = self.prefix_seed else {
            return 0;
        };
        if !seq.blocks.is_empty() || seq.len > 0 {
            return 0;
        }
        let bs = self.block_size;
        let mut parent = Self::chain_seed(seed, seq);
        for chunk in tokens[..tokens.len().saturating_sub(1)].chunks_exact(bs) {
            let h = Self::chain_hash(parent, chunk);
            let b = match self.cached.get(&h) {
                Some(c) if c.parent == parent && *c.tokens == *chunk => c.block,
                _ => break,
            };
            if self.refs[b as usize] == 0 {
                self.lru.remove(&self.lru_tick[b as usize]);
            }
            self.refs[b as usize] += 1;
            seq.blocks.push(b);
            seq.hashes.push(h);
            parent = h;
        }
        seq.len = seq.blocks.len() * bs;
        seq.len
    }

    /// Moves `seq` past `tokens` just written (the forward pass calls it);
    /// with prefix caching, blocks that became full are hashed and registered.
    pub fn advance(&mut self, seq: &mut SeqCache, tokens: &[u32]) {
        seq.len += tokens.len();
        let Some(seed) = self.prefix_seed else {
            return;
        };
        if seq.no_cache {
            return;
        }
        let bs = self.block_size;
        // Only positions in whole blocks this sequence tracks are hashed.
        if seq.hashes.len() * bs + seq.tail.len() + tokens.len() != seq.len {
            seq.tail.clear();
            seq.hashes.clear();
            return;
        }
        seq.tail.extend_from_slice(tokens);
        let first = Self::chain_seed(seed, seq);
        while seq.tail.len() >= bs {
            let i = seq.hashes.len();
            let parent = seq.hashes.last().copied().unwrap_or(first);
            let h = Self::chain_hash(parent, &seq.tail[..bs]);
            if let Some(&b) = seq.blocks.get(i)
                && self.block_hash[b as usize].is_none()
                && !self.cached.contains_key(&h)
            {
                self.block_hash[b as usize] = Some(h);
                self.cached.insert(
                    h,
                    CachedBlock {
                        block: b,
                        parent,
                        tokens: seq.tail[..bs].into(),
                    },
                );
            }
            seq.hashes.push(h);
            seq.tail.drain(..bs);
        }
    }

    /// Bytes one block takes over layers of the given shapes with elements
    /// of `dtype` in the default layout (heads' planes and value padding
    /// included): what [`KvPool::for_layers`] allocates per block.
    pub fn layer_block_bytes(layers: &[KvLayerShape], block_size: usize, dtype: KvDtype) -> usize {
        let layout = KvLayout::default();
        layers
            .iter()
            .map(|shape| {
                let planes = Self::planes(shape, layout);
                let v = planes * value_stride(shape.v_width / planes, dtype, layout.pad_values);
                (shape.k_width + v) * dtype.bytes()
            })
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
    /// Blocks not held by any sequence (truly free plus cached-free).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.lru.len()
    }
    /// Blocks a sequence needs to hold `len` positions.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }

    /// Makes room for `seq` to grow to `new_len` positions. On failure nothing
    /// is allocated.
    pub fn reserve(&mut self, seq: &mut SeqCache, new_len: usize) -> Result<()> {
        let need = self.blocks_for(new_len).saturating_sub(seq.blocks.len());
        if need > self.free_blocks() {
            return Err(Error::InvalidInput(format!(
                "KV cache full: {need} more blocks needed, {} free of {}",
                self.free_blocks(),
                self.num_blocks
            )));
        }
        for _ in 0..need {
            if let Some(b) = self.take_block() {
                seq.blocks.push(b);
            }
        }
        Ok(())
    }

    /// Keeps what `seq` computed out of the prefix cache: its registered
    /// blocks are forgotten (freed, not cached, when released) and its later
    /// blocks are not registered, until it is released. For keys/values
    /// computed without part of the model (a lost or rerouted expert), which
    /// another request must never reuse.
    pub fn uncache(&mut self, seq: &mut SeqCache) {
        seq.no_cache = true;
        for &b in &seq.blocks {
            if let Some(h) = self.block_hash[b as usize].take() {
                self.cached.remove(&h);
            }
        }
    }

    /// Gives back blocks beyond the first `keep` (undoing a [`reserve`](Self::reserve)).
    pub fn shrink(&mut self, seq: &mut SeqCache, keep: usize) {
        while seq.blocks.len() > keep {
            if let Some(b) = seq.blocks.pop() {
                self.put_block(b);
            }
        }
        seq.len = seq.len.min(seq.blocks.len() * self.block_size);
        let full = seq.len / self.block_size;
        if seq.hashes.len() > full || seq.hashes.len() * self.block_size + seq.tail.len() > seq.len
        {
            seq.hashes.truncate(full);
            seq.tail.clear();
            // Re-derived only from whole blocks: a partial tail is forgotten.
            if seq.hashes.len() * self.block_size != seq.len {
                seq.hashes.clear();
            }
        }
    }

    /// A copy of `seq` for another sample of the same prompt (`n` > 1) that
    /// shares its keys/values: its full blocks are shared (reference-counted;
    /// a full block is never written again), a partial last block is copied
    /// into a fresh block, and blocks reserved past its length are not taken.
    /// Works with or without prefix caching. `None` (nothing taken) when no
    /// block is free for the copy.
    pub fn fork(&mut self, seq: &SeqCache) -> Option<SeqCache> {
        let bs = self.block_size;
        let full = (seq.len / bs).min(seq.blocks.len());
        let partial = seq.len - full * bs;
        let mut child = SeqCache::new();
        if partial > 0 {
            let src = *seq.blocks.get(full)?;
            let dst = self.take_block()?;
            for l in &mut self.layers {
                let (kw, vs) = (l.k_plane_width(), l.v_stride);
                // Keys by column interleave the block's positions: the
                // whole block is copied (positions past `partial` are
                // rewritten before they are read).
                let krows = if l.k_by_column { bs } else { partial };
                let (from, to) = (src as usize * bs, dst as usize * bs);
                for p in 0..l.planes {
                    l.k.copy_rows(p * l.rows * kw, from, to, krows, kw);
                    l.v.copy_rows(p * l.rows * vs, from, to, partial, vs);
                }
            }
            child.blocks.extend_from_slice(&seq.blocks[..full]);
            child.blocks.push(dst);
        } else {
            child.blocks.extend_from_slice(&seq.blocks[..full]);
        }
        for &b in &seq.blocks[..full] {
            self.refs[b as usize] += 1;
        }
        child.len = seq.len;
        child.hashes = seq.hashes.clone();
        child.tail = seq.tail.clone();
        child.no_cache = seq.no_cache;
        Some(child)
    }

    /// Returns all of a sequence's blocks to the pool and empties it. Its
    /// last blocks are released first, so the LRU evicts a chain's tail
    /// before its head.
    pub fn release(&mut self, seq: &mut SeqCache) {
        while let Some(b) = seq.blocks.pop() {
            self.put_block(b);
        }
        seq.len = 0;
        seq.hashes.clear();
        seq.tail.clear();
        seq.no_cache = false;
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
    fn a_fork_shares_full_blocks_and_copies_the_partial_one() {
        for caching in [false, true] {
            let mut p = KvPool::new(&[(2, 2)], 4, 4, KvDtype::F32);
            if caching {
                p.enable_prefix_caching("test-model");
            }
            let toks: Vec<u32> = (0..6).collect();
            let mut a = SeqCache::new();
            p.reserve(&mut a, 6).expect("fits");
            for pos in 0..6 {
                let r = p.row(&a, pos);
                p.layer_mut(0).k.write(r * 2, &[pos as f32, 1.0]);
                p.layer_mut(0).v.write(r * 2, &[-(pos as f32), 2.0]);
            }
            p.advance(&mut a, &toks);
            let mut b = p.fork(&a).expect("a free block for the copy");
            assert_eq!(b.len(), 6);
            assert_ne!(b.id(), a.id());
            assert_eq!(b.blocks()[0], a.blocks()[0], "full block shared");
            assert_ne!(b.blocks()[1], a.blocks()[1], "partial block copied");
            assert_eq!(p.free_blocks(), 1);
            let rows = |p: &KvPool, s: &SeqCache| -> Vec<f32> {
                let KvRows::F32(k) = p.layer(0).k.rows() else {
                    unreachable!()
                };
                let KvRows::F32(v) = p.layer(0).v.rows() else {
                    unreachable!()
                };
                (0..6)
                    .flat_map(|pos| {
                        let r = p.row(s, pos);
                        [k[r * 2], k[r * 2 + 1], v[r * 2], v[r * 2 + 1]]
                    })
                    .collect()
            };
            assert_eq!(rows(&p, &a), rows(&p, &b));
            // Each grows on its own: writes past the shared prefix do not meet.
            p.reserve(&mut a, 7).expect("fits");
            p.reserve(&mut b, 7).expect("fits");
            let (ra, rb) = (p.row(&a, 6), p.row(&b, 6));
            assert_ne!(ra, rb);
            p.advance(&mut a, &[6]);
            p.advance(&mut b, &[9]);
            if caching {
                assert_eq!(b.hashes.len(), 1);
                assert_eq!(b.tail, vec![4, 5, 9]);
            }
            // No free block for a copy: nothing is taken.
            let mut c = p.fork(&a).expect("the last block");
            assert_eq!(p.free_blocks(), 0);
            assert!(p.fork(&a).is_none());
            assert_eq!(p.free_blocks(), 0);
            p.release(&mut a);
            p.release(&mut c);
            assert_eq!(p.free_blocks(), 2);
            p.release(&mut b);
            assert_eq!(p.free_blocks(), 4, "caching {caching}");
        }
        // A fork of a sequence ending on a block boundary copies nothing.
        let mut p = KvPool::new(&[(2, 2)], 4, 3, KvDtype::F32);
        let mut a = SeqCache::new();
        p.reserve(&mut a, 8).expect("fits");
        p.advance(&mut a, &[0; 8]);
        let mut b = p.fork(&a).expect("nothing to copy");
        assert_eq!(b.blocks(), a.blocks());
        assert_eq!(p.free_blocks(), 1);
        p.release(&mut a);
        assert_eq!(p.free_blocks(), 1);
        p.release(&mut b);
        assert_eq!(p.free_blocks(), 3);
    }

    /// A caching pool of `n` blocks of 4 positions.
    fn caching_pool(n: usize) -> KvPool {
        let mut p = KvPool::new(&[(2, 2)], 4, n, KvDtype::F32);
        p.enable_prefix_caching("test-model");
        p
    }

    /// A sequence that wrote `tokens` (reserved and advanced in `steps` pieces).
    fn written(p: &mut KvPool, tokens: &[u32], steps: &[usize]) -> SeqCache {
        let mut s = SeqCache::new();
        let hit = p.match_prefix(&mut s, tokens);
        let mut at = hit;
        for &n in steps {
            let n = n.min(tokens.len() - at);
            if n == 0 {
                break;
            }
            p.reserve(&mut s, at + n).expect("fits");
            p.advance(&mut s, &tokens[at..at + n]);
            at += n;
        }
        if at < tokens.len() {
            p.reserve(&mut s, tokens.len()).expect("fits");
            p.advance(&mut s, &tokens[at..]);
        }
        s
    }

    #[test]
    fn full_blocks_are_hashed_as_a_chain_however_they_were_written() {
        let mut p = caching_pool(16);
        let toks: Vec<u32> = (0..14).collect();
        let a = written(&mut p, &toks, &[14]);
        let b = written(&mut p, &toks, &[1, 2, 3, 1, 5, 2]);
        // 3 full blocks each; the tail of 2 tokens is not hashed.
        assert_eq!(a.hashes.len(), 3);
        assert_eq!(a.hashes, b.hashes);
        assert_eq!(a.tail, vec![12, 13]);
        // The chain: same block content after a different prefix hashes differently.
        let mut other = toks.clone();
        other[0] = 99;
        let c = written(&mut p, &other, &[14]);
        assert_ne!(c.hashes[1], a.hashes[1]);
        // A different model identity hashes differently.
        let mut q = KvPool::new(&[(2, 2)], 4, 16, KvDtype::F32);
        q.enable_prefix_caching("another-model");
        let d = written(&mut q, &toks, &[14]);
        assert_ne!(d.hashes[0], a.hashes[0]);
    }

    #[test]
    fn a_matching_prefix_is_shared_with_reference_counts_and_leaves_the_last_token() {
        let mut p = caching_pool(8);
        let toks: Vec<u32> = (0..10).collect();
        let mut a = written(&mut p, &toks, &[10]);
        assert_eq!(p.free_blocks(), 5);
        // 12 tokens sharing the first 10: blocks 0 and 1 are shared.
        let longer: Vec<u32> = (0..12).collect();
        let mut b = SeqCache::new();
        assert_eq!(p.match_prefix(&mut b, &longer), 8);
        assert_eq!(b.len(), 8);
        assert_eq!(&b.blocks()[..2], &a.blocks()[..2]);
        assert_eq!(p.free_blocks(), 5, "a hit takes no new block");
        // Exactly two full blocks of prompt: the last token is left to compute,
        // so only the first block is attached.
        let mut c = SeqCache::new();
        assert_eq!(p.match_prefix(&mut c, &toks[..8]), 4);
        // Releasing the first holder keeps the shared blocks alive.
        p.release(&mut a);
        assert_eq!(p.refs[b.blocks()[0] as usize], 2);
        assert_eq!(p.refs[b.blocks()[1] as usize], 1);
        p.reserve(&mut b, 12).expect("fits");
        p.advance(&mut b, &longer[8..]);
        assert_eq!(b.hashes.len(), 3);
        p.release(&mut b);
        p.release(&mut c);
        assert_eq!(p.free_blocks(), 8, "no leak");
        assert!(p.refs.iter().all(|&r| r == 0));
        // The three full blocks stay cached (the partial one of `a` was freed).
        assert_eq!(p.cached_free_blocks(), 3);
        let mut d = SeqCache::new();
        assert_eq!(p.match_prefix(&mut d, &longer), 8);
        assert_eq!(p.cached_free_blocks(), 1, "taken back out of the LRU");
        p.release(&mut d);
        assert_eq!(p.cached_free_blocks(), 3);
    }

    #[test]
    fn cached_blocks_are_evicted_oldest_first_and_only_when_nothing_is_free() {
        let mut p = caching_pool(4);
        let x: Vec<u32> = (0..9).collect(); // 2 full blocks + 1 partial
        let mut a = written(&mut p, &x, &[9]);
        p.release(&mut a);
        assert_eq!((p.free.len(), p.cached_free_blocks()), (2, 2));
        // Two blocks fit in the truly free ones: the cache survives.
        let y: Vec<u32> = (100..108).collect();
        let mut b = written(&mut p, &y, &[8]);
        assert_eq!(p.cached_free_blocks(), 2);
        // One more: the oldest cached block goes, which is the chain's tail
        // (released first), so the head still hits.
        let mut c = SeqCache::new();
        p.reserve(&mut c, 1).expect("evicts one");
        assert_eq!(p.cached_free_blocks(), 1);
        let mut d = SeqCache::new();
        assert_eq!(p.match_prefix(&mut d, &x), 4);
        // Full: a reservation fails and takes nothing.
        let mut e = SeqCache::new();
        assert!(p.reserve(&mut e, 1).is_err());
        for s in [&mut b, &mut c, &mut d] {
            p.release(s);
        }
        assert_eq!(p.free_blocks(), 4);
    }

    #[test]
    fn salted_sequences_share_only_with_the_same_salt() {
        let mut p = caching_pool(16);
        let toks: Vec<u32> = (0..9).collect();
        let salted = |p: &mut KvPool, salt: Option<&str>| {
            let mut s = SeqCache::new();
            if let Some(salt) = salt {
                s.set_salt(salt);
            }
            let hit = p.match_prefix(&mut s, &toks);
            p.reserve(&mut s, toks.len()).expect("fits");
            p.advance(&mut s, &toks[hit..]);
            (s, hit)
        };
        let (mut a, hit) = salted(&mut p, Some("alice"));
        assert_eq!(hit, 0);
        // Unsalted and differently salted sequences miss; the same salt hits.
        let (mut b, hit) = salted(&mut p, None);
        assert_eq!(hit, 0);
        let (mut c, hit) = salted(&mut p, Some("bob"));
        assert_eq!(hit, 0);
        let (mut d, hit) = salted(&mut p, Some("alice"));
        assert_eq!(hit, 8);
        assert_eq!(&d.blocks()[..2], &a.blocks()[..2]);
        assert_ne!(a.hashes[1], b.hashes[1], "the salt changes the whole chain");
        assert_ne!(a.hashes[0], c.hashes[0]);
        for s in [&mut a, &mut b, &mut c, &mut d] {
            p.release(s);
        }
        assert_eq!(p.free_blocks(), 16);
    }

    #[test]
    fn clearing_the_prefix_cache_forgets_every_block() {
        let mut p = caching_pool(8);
        let toks: Vec<u32> = (0..9).collect();
        let mut a = written(&mut p, &toks, &[9]);
        let mut b = written(&mut p, &(20..29).collect::<Vec<u32>>(), &[9]);
        p.release(&mut a);
        assert_eq!(p.cached_free_blocks(), 2);
        p.clear_prefix_cache();
        assert_eq!(p.cached_free_blocks(), 0);
        assert_eq!(p.free_blocks(), 5);
        let mut c = SeqCache::new();
        assert_eq!(p.match_prefix(&mut c, &toks), 0);
        p.release(&mut b);
        assert_eq!((p.free_blocks(), p.cached_free_blocks()), (8, 0));
        // Caching goes on for what is computed afterwards.
        let mut d = written(&mut p, &toks, &[9]);
        p.release(&mut d);
        assert_eq!(p.match_prefix(&mut c, &toks), 8);
        p.release(&mut c);
    }

    #[test]
    fn uncached_sequences_leave_nothing_to_reuse() {
        let mut p = caching_pool(8);
        let toks: Vec<u32> = (0..9).collect();
        let mut a = SeqCache::new();
        p.reserve(&mut a, 5).expect("fits");
        p.advance(&mut a, &toks[..5]);
        p.uncache(&mut a);
        p.reserve(&mut a, 9).expect("fits");
        p.advance(&mut a, &toks[5..]);
        let mut b = SeqCache::new();
        assert_eq!(p.match_prefix(&mut b, &toks), 0, "nothing registered");
        p.release(&mut a);
        assert_eq!((p.free_blocks(), p.cached_free_blocks()), (8, 0));
    }

    #[test]
    fn without_prefix_caching_nothing_is_hashed_or_shared() {
        let mut p = KvPool::new(&[(2, 2)], 4, 4, KvDtype::F32);
        let toks: Vec<u32> = (0..9).collect();
        let mut a = written(&mut p, &toks, &[9]);
        assert!(a.hashes.is_empty());
        p.release(&mut a);
        assert_eq!(p.cached_free_blocks(), 0);
        let mut b = SeqCache::new();
        assert_eq!(p.match_prefix(&mut b, &toks), 0);
    }

    /// Keys of layers with separate values are stored by column inside each
    /// block (MLA's latent rows stay rows); a fork's copied partial block
    /// keeps them.
    #[test]
    fn keys_are_stored_by_column_and_forks_copy_them() {
        let (bs, kw) = (4usize, 3usize);
        let layout = KvLayout {
            key_columns: true,
            pad_values: true,
            head_planes: false,
        };
        let mut p = KvPool::with_layout(&[(kw, kw), (kw, 0)], bs, 4, KvDtype::F32, layout);
        assert!(p.layer(0).k_by_column && !p.layer(1).k_by_column);
        let mut s = SeqCache::new();
        p.reserve(&mut s, 6).expect("blocks");
        let key = |pos: usize, c: usize| (pos * 10 + c) as f32;
        for pos in 0..6 {
            let r = p.row(&s, pos);
            let k: Vec<f32> = (0..kw).map(|c| key(pos, c)).collect();
            for l in 0..2 {
                p.layer_mut(l).write_k(r, &k);
            }
            p.layer_mut(0).write_v(r, &[-1.0; 3]);
        }
        s.len = 6;
        for pos in 0..6 {
            let r = p.row(&s, pos);
            let (b, t) = (r / bs, r % bs);
            for c in 0..kw {
                assert_eq!(p.layer(0).key(r, c), key(pos, c));
                assert_eq!(p.layer(1).key(r, c), key(pos, c));
                assert_eq!(
                    p.layer(0).k.rows().get(b * bs * kw + c * bs + t),
                    key(pos, c)
                );
                assert_eq!(p.layer(1).k.rows().get(r * kw + c), key(pos, c));
            }
        }
        let child = p.fork(&s).expect("a free block");
        assert_ne!(child.blocks()[1], s.blocks()[1]);
        for pos in 0..6 {
            for c in 0..kw {
                for l in 0..2 {
                    let (a, b) = (p.row(&s, pos), p.row(&child, pos));
                    assert_eq!(
                        p.layer(l).key(a, c),
                        p.layer(l).key(b, c),
                        "layer {l} pos {pos}"
                    );
                }
            }
        }
    }

    #[test]
    fn value_rows_of_whole_kibibytes_are_padded_by_a_line_and_forks_copy_them() {
        // f32 rows of 256 (1 KiB) and bf16 rows of 512 (1 KiB) get one
        // 64-byte line; 64 f32 (256 B) and MLA's absent values get none.
        assert_eq!(value_stride(256, KvDtype::F32, true), 272);
        assert_eq!(value_stride(512, KvDtype::Bf16, true), 544);
        assert_eq!(value_stride(1024, KvDtype::Bf16, true), 1056);
        assert_eq!(value_stride(64, KvDtype::F32, true), 64);
        assert_eq!(value_stride(0, KvDtype::Bf16, true), 0);
        assert_eq!(value_stride(512, KvDtype::Bf16, false), 512);
        let (bs, w, hd) = (4usize, 512usize, 128usize);
        for pad in [false, true] {
            let layout = KvLayout {
                key_columns: true,
                pad_values: pad,
                head_planes: false,
            };
            let mut p = KvPool::with_layout(&[(w, w)], bs, 4, KvDtype::Bf16, layout);
            let stride = p.layer(0).v_stride;
            assert_eq!(stride, if pad { w + 32 } else { w });
            let mut s = SeqCache::new();
            p.reserve(&mut s, 6).expect("blocks");
            // Small integers are exact in bf16.
            let value = |pos: usize, c: usize| ((pos * 7 + c) % 200) as f32;
            for pos in 0..6 {
                let r = p.row(&s, pos);
                let v: Vec<f32> = (0..w).map(|c| value(pos, c)).collect();
                p.layer_mut(0).write_v(r, &v);
            }
            s.len = 6;
            let child = p.fork(&s).expect("a free block");
            assert_ne!(child.blocks()[1], s.blocks()[1]);
            let (_, view) = p.layer(0).views(hd);
            assert_eq!(
                (view.stride, view.head_stride, view.width),
                (stride, hd, hd)
            );
            for seq in [&s, &child] {
                for pos in 0..6 {
                    let r = p.row(seq, pos);
                    for c in 0..w {
                        assert_eq!(view.rows.get(r * stride + c), value(pos, c));
                    }
                    for c in w..stride {
                        assert_eq!(view.rows.get(r * stride + c), 0.0, "padding");
                    }
                }
            }
        }
        let unpadded = 4 * (512 + 512) * 2;
        let bytes = KvPool::layer_block_bytes(&[(w, w).into()], bs, KvDtype::Bf16);
        let pad = KvLayout::default().pad_values;
        assert_eq!(bytes, unpadded + if pad { 4 * 64 } else { 0 });
    }

    /// Each KV head in its own plane: a head's rows are consecutive (keys
    /// by column inside each block of its plane, values padded per plane
    /// row), a fork copies every plane, and attention over the views reads
    /// the same keys and values, to the bit, as over rows holding the heads
    /// side by side, with keys by column or by row, f32 or bf16.
    #[test]
    fn heads_in_planes_read_as_rows_side_by_side_and_forks_copy_them() {
        use crate::kernels::attention::{AttnSeq, AttnShape, attention};
        let (bs, nkv, hd, heads) = (4usize, 4usize, 8usize, 8usize);
        let shape = KvLayerShape::heads(nkv, hd);
        let key = |pos: usize, c: usize| ((pos * 13 + c * 7) % 29) as f32 / 8.0 - 1.5;
        let value = |pos: usize, c: usize| ((pos * 5 + c * 11) % 31) as f32 / 8.0 - 2.0;
        let q: Vec<f32> = (0..2 * heads * hd)
            .map(|i| ((i * 17) % 23) as f32 / 16.0 - 0.7)
            .collect();
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            for key_columns in [true, false] {
                let mut outs = Vec::new();
                for head_planes in [false, true] {
                    let layout = KvLayout {
                        key_columns,
                        pad_values: true,
                        head_planes,
                    };
                    let mut p = KvPool::for_layers(&[shape, (6, 0).into()], bs, 6, dtype, layout);
                    let l = p.layer(0);
                    assert_eq!(l.planes, if head_planes { nkv } else { 1 });
                    assert_eq!(p.layer(1).planes, 1, "MLA's latent is one plane");
                    let mut s = SeqCache::new();
                    p.reserve(&mut s, 10).expect("blocks");
                    for pos in 0..10 {
                        let r = p.row(&s, pos);
                        let k: Vec<f32> = (0..nkv * hd).map(|c| key(pos, c)).collect();
                        let v: Vec<f32> = (0..nkv * hd).map(|c| value(pos, c)).collect();
                        p.layer_mut(0).write_k(r, &k);
                        p.layer_mut(0).write_v(r, &v);
                    }
                    s.len = 10;
                    let child = p.fork(&s).expect("a free block");
                    assert_ne!(child.blocks()[2], s.blocks()[2]);
                    let l = p.layer(0);
                    let (kv_k, kv_v) = l.views(hd);
                    for seq in [&s, &child] {
                        for pos in 0..10 {
                            let r = p.row(seq, pos);
                            for c in 0..nkv * hd {
                                assert_eq!(l.key(r, c), key(pos, c));
                                assert_eq!(l.value(r, c), value(pos, c));
                                let (h, cc) = (c / hd, c % hd);
                                let vi = r * kv_v.stride + h * kv_v.head_stride + cc;
                                assert_eq!(kv_v.rows.get(vi), value(pos, c));
                                assert_eq!(kv_k.at(r, h * kv_k.head_stride + cc, bs), key(pos, c));
                            }
                        }
                    }
                    if head_planes {
                        // A head's rows are consecutive: position 1 right
                        // after position 0 in its plane.
                        assert_eq!(kv_v.stride, hd);
                        assert_eq!(kv_v.head_stride, 6 * bs * hd);
                    }
                    // The child's last position decodes against both
                    // sequences' caches (2 rows, the fork's copy included).
                    let tables = [s.blocks().to_vec(), child.blocks().to_vec()];
                    let seqs: Vec<AttnSeq<'_>> = tables
                        .iter()
                        .enumerate()
                        .map(|(i, b)| AttnSeq {
                            blocks: b,
                            start: i,
                            len: 1,
                            past: 9,
                        })
                        .collect();
                    let mut out = vec![0.0f32; 2 * heads * hd];
                    attention(
                        crate::kernels::dispatch::kernels(),
                        &AttnShape {
                            heads,
                            kv_heads: nkv,
                            scale: 0.3,
                            window: None,
                            sinks: None,
                            block_size: bs,
                            bf16_queries: false,
                        },
                        &seqs,
                        &q,
                        kv_k,
                        kv_v,
                        &mut out,
                    );
                    assert!(out.iter().all(|x| x.is_finite()));
                    outs.push(out);
                }
                assert!(
                    outs[0]
                        .iter()
                        .zip(&outs[1])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?} key_columns {key_columns}"
                );
            }
        }
        // Planes of 128 bf16 (256 B) need no padding; rows of 4 heads side
        // by side (1 KiB) did.
        let qwen = KvLayerShape::heads(4, 128);
        let bytes = KvPool::layer_block_bytes(&[qwen], 16, KvDtype::Bf16);
        let layout = KvLayout::default();
        let want = match (layout.head_planes, layout.pad_values) {
            (false, true) => 16 * (1024 + 1088),
            _ => 16 * 2048,
        };
        assert_eq!(bytes, want);
    }

    #[test]
    fn bf16_pools_halve_the_bytes_and_round_to_nearest_even() {
        let w = [(8, 8), (5, 0)];
        let shapes: Vec<KvLayerShape> = w.iter().map(|&x| x.into()).collect();
        assert_eq!(
            KvPool::layer_block_bytes(&shapes, 16, KvDtype::F32),
            2 * KvPool::layer_block_bytes(&shapes, 16, KvDtype::Bf16)
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
