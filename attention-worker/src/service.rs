//! `AttentionService`: decode the layer input, run this shard's heads with
//! its KV cache, return the partial output projection. Malformed requests
//! (unknown layer, wrong lengths, NaN/Inf, inconsistent sequence chunks,
//! oversize, unknown dtype) answer INVALID_ARGUMENT and change nothing.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use epserve_core::model::attn_shard::{AttentionShard, SeqChunk};
use epserve_proto::pb::attention_service_server::AttentionService;
use epserve_proto::pb::{
    AttentionHealthResponse, AttentionRequest, AttentionResponse, Dtype, HealthRequest,
    ReleaseRequest, ReleaseResponse,
};
use epserve_proto::wire;
use tonic::{Request, Response, Status};

/// The most token rows one Forward may carry.
pub const MAX_FORWARD_ROWS: usize = 1 << 20;
/// The most positions a sequence may reach (`past + len`).
pub const MAX_POSITIONS: usize = 1 << 24;

/// The worker's state: one shard behind a lock (one coordinator drives it,
/// one layer at a time).
pub struct AttentionWorker {
    id: String,
    shard: Arc<Mutex<AttentionShard>>,
    index: u32,
    of: u32,
    num_layers: u32,
    hidden: u32,
}

impl AttentionWorker {
    /// Serves `shard` as worker `id`.
    pub fn new(id: String, shard: AttentionShard) -> Self {
        let hs = shard.shard();
        AttentionWorker {
            id,
            index: hs.index as u32,
            of: hs.of as u32,
            num_layers: shard.num_layers() as u32,
            hidden: shard.hidden() as u32,
            shard: Arc::new(Mutex::new(shard)),
        }
    }

    /// Checks a Forward request against the shard: everything a peer could
    /// get wrong is INVALID_ARGUMENT. Returns the decoded input and chunks.
    fn check_forward(&self, r: &AttentionRequest) -> Result<(Vec<f32>, Vec<SeqChunk>), Status> {
        let bad = |m: String| Err(Status::invalid_argument(m));
        let hidden = r
            .hidden
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("missing hidden"))?;
        if r.layer >= self.num_layers {
            return bad(format!(
                "layer {} does not exist (the model has {})",
                r.layer, self.num_layers
            ));
        }
        if hidden.cols != self.hidden {
            return bad(format!(
                "hidden has {} columns; the model's hidden size is {}",
                hidden.cols, self.hidden
            ));
        }
        if hidden.rows as usize > MAX_FORWARD_ROWS {
            return bad(format!(
                "{} rows exceed the limit of {MAX_FORWARD_ROWS} per call",
                hidden.rows
            ));
        }
        if Dtype::try_from(r.output_dtype).is_err() {
            return bad(format!("unknown output dtype {}", r.output_dtype));
        }
        let mut seen = std::collections::HashSet::with_capacity(r.seqs.len());
        let mut rows = 0usize;
        for c in &r.seqs {
            if c.len == 0 {
                return bad(format!("sequence {} has no new tokens", c.seq_id));
            }
            if !seen.insert(c.seq_id) {
                return bad(format!("sequence {} appears twice in one call", c.seq_id));
            }
            let end = c.past as usize + c.len as usize;
            if end > MAX_POSITIONS {
                return bad(format!(
                    "sequence {} would reach position {end}, beyond the limit of {MAX_POSITIONS}",
                    c.seq_id
                ));
            }
            if c.blocks.len() > MAX_POSITIONS {
                return bad(format!(
                    "sequence {} has a block table of {} blocks, beyond the limit of {MAX_POSITIONS}",
                    c.seq_id,
                    c.blocks.len()
                ));
            }
            rows += c.len as usize;
        }
        if r.kv_block_size == 0 && !r.seqs.is_empty() {
            return bad("kv_block_size must be positive".into());
        }
        if rows != hidden.rows as usize {
            return bad(format!(
                "the chunks hold {rows} tokens but hidden has {} rows",
                hidden.rows
            ));
        }
        let x = wire::decode_finite(hidden).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let chunks = r
            .seqs
            .iter()
            .map(|c| SeqChunk {
                id: c.seq_id,
                past: c.past as usize,
                len: c.len as usize,
                blocks: c.blocks.clone(),
                block_size: r.kv_block_size as usize,
            })
            .collect();
        Ok((x, chunks))
    }

    fn poisoned(&self) -> Status {
        Status::internal(format!("attention-worker {}: shard lock poisoned", self.id))
    }
}

#[tonic::async_trait]
impl AttentionService for AttentionWorker {
    #[tracing::instrument(
        level = "debug",
        name = "attention_forward",
        skip_all,
        fields(
            worker = %self.id,
            layer = req.get_ref().layer,
            seqs = req.get_ref().seqs.len(),
            rows = req.get_ref().hidden.as_ref().map_or(0, |t| t.rows),
        )
    )]
    async fn forward(
        &self,
        req: Request<AttentionRequest>,
    ) -> Result<Response<AttentionResponse>, Status> {
        let r = req.into_inner();
        let (x, chunks) = self.check_forward(&r)?;
        let rows = x.len() / (self.hidden as usize).max(1);
        let out_dtype = match Dtype::try_from(r.output_dtype) {
            Ok(Dtype::Bf16) => Dtype::Bf16,
            _ => Dtype::F32,
        };
        let (shard, layer, cols) = (self.shard.clone(), r.layer as usize, self.hidden as usize);
        let poisoned = self.poisoned();
        let parent = tracing::Span::current();
        let res = tokio::task::spawn_blocking(move || {
            let _span = tracing::debug_span!(parent: &parent, "shard_forward").entered();
            let t0 = Instant::now();
            let mut g = shard.lock().map_err(|_| poisoned)?;
            g.release(&r.release_first);
            let partial = g
                .forward(layer, &x, &chunks)
                .map_err(|e| Status::failed_precondition(e.to_string()))?;
            drop(g);
            Ok::<_, Status>(AttentionResponse {
                partial: Some(wire::encode(&partial, rows, cols, out_dtype)),
                compute_us: t0.elapsed().as_micros() as u64,
            })
        })
        .await
        .map_err(|e| Status::internal(format!("attention task failed: {e}")))??;
        Ok(Response::new(res))
    }

    #[tracing::instrument(
        level = "debug",
        name = "attention_release",
        skip_all,
        fields(worker = %self.id, all = req.get_ref().all, seqs = req.get_ref().seq_ids.len())
    )]
    async fn release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let r = req.into_inner();
        let (shard, poisoned) = (self.shard.clone(), self.poisoned());
        // The lock may be held by a Forward in progress: wait off the async threads.
        tokio::task::spawn_blocking(move || {
            let mut g = shard.lock().map_err(|_| poisoned)?;
            if r.all {
                g.release_all();
            } else {
                g.release(&r.seq_ids);
            }
            Ok::<_, Status>(())
        })
        .await
        .map_err(|e| Status::internal(format!("release task failed: {e}")))??;
        Ok(Response::new(ReleaseResponse {}))
    }

    #[tracing::instrument(level = "trace", name = "attention_health", skip_all, fields(worker = %self.id))]
    async fn health(
        &self,
        _req: Request<HealthRequest>,
    ) -> Result<Response<AttentionHealthResponse>, Status> {
        let st = self.shard.lock().map_err(|_| self.poisoned())?.stats();
        Ok(Response::new(AttentionHealthResponse {
            worker_id: self.id.clone(),
            ready: true,
            shard: self.index,
            of: self.of,
            num_layers: self.num_layers,
            hidden_size: self.hidden,
            kv_block_size: st.block_size as u32,
            kv_blocks_total: st.blocks_total as u64,
            kv_blocks_free: st.blocks_free as u64,
            sequences: st.sequences as u32,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use epserve_core::model::attention::HeadShard;
    use epserve_core::model::kv_cache::KvDtype;
    use epserve_proto::pb::SeqChunk as WireChunk;
    use std::path::Path;

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    fn worker() -> Result<AttentionWorker> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/f32");
        let shard = AttentionShard::load_dir(
            &dir,
            HeadShard { index: 0, of: 2 },
            1 << 20,
            4,
            KvDtype::F32,
        )?;
        Ok(AttentionWorker::new("att".into(), shard))
    }

    /// A valid request: sequence 7, positions 0..3 of layer 1.
    fn request(w: &AttentionWorker) -> AttentionRequest {
        let h = w.hidden as usize;
        let x: Vec<f32> = (0..3 * h).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        AttentionRequest {
            layer: 1,
            seqs: vec![WireChunk {
                seq_id: 7,
                past: 0,
                len: 3,
                blocks: vec![2],
            }],
            hidden: Some(wire::encode(&x, 3, h, Dtype::F32)),
            release_first: vec![],
            output_dtype: Dtype::F32 as i32,
            kv_block_size: 4,
        }
    }

    async fn call(
        w: &AttentionWorker,
        r: AttentionRequest,
    ) -> std::result::Result<AttentionResponse, Status> {
        w.forward(Request::new(r)).await.map(|r| r.into_inner())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_forwards_are_invalid_arguments_and_the_worker_keeps_serving() -> Result<()> {
        let w = worker()?;
        let good = request(&w);
        let ok = call(&w, good.clone()).await?;
        assert_eq!(ok.partial.as_ref().map(|t| t.rows), Some(3));
        let h = w.hidden;
        type Edit = Box<dyn Fn(&mut AttentionRequest)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("missing hidden", Box::new(|r| r.hidden = None)),
            ("layer 3 does not exist", Box::new(|r| r.layer = 3)),
            (
                "layer 4294967295 does not exist",
                Box::new(|r| r.layer = u32::MAX),
            ),
            (
                "columns",
                Box::new(move |r| {
                    if let Some(t) = r.hidden.as_mut() {
                        t.cols = h + 1;
                    }
                }),
            ),
            (
                "exceed the limit",
                Box::new(|r| {
                    if let Some(t) = r.hidden.as_mut() {
                        t.rows = (MAX_FORWARD_ROWS + 1) as u32;
                    }
                }),
            ),
            ("unknown output dtype", Box::new(|r| r.output_dtype = 9)),
            (
                "no new tokens",
                Box::new(|r| {
                    r.seqs[0].len = 0;
                }),
            ),
            (
                "appears twice",
                Box::new(|r| {
                    r.seqs = vec![
                        WireChunk {
                            seq_id: 7,
                            past: 0,
                            len: 1,
                            blocks: vec![2],
                        },
                        WireChunk {
                            seq_id: 7,
                            past: 1,
                            len: 2,
                            blocks: vec![2],
                        },
                    ];
                }),
            ),
            (
                "beyond the limit",
                Box::new(|r| {
                    r.seqs[0].past = u32::MAX;
                }),
            ),
            (
                "kv_block_size must be positive",
                Box::new(|r| r.kv_block_size = 0),
            ),
            (
                "block table of",
                Box::new(|r| r.seqs[0].blocks = vec![0; MAX_POSITIONS + 1]),
            ),
            (
                "chunks hold 4 tokens",
                Box::new(|r| {
                    r.seqs[0].len = 4;
                }),
            ),
            (
                "chunks hold 3 tokens but hidden has 2 rows",
                Box::new(|r| {
                    if let Some(t) = r.hidden.as_mut() {
                        t.rows = 2;
                    }
                }),
            ),
            (
                "bytes, expected",
                Box::new(|r| {
                    if let Some(t) = r.hidden.as_mut() {
                        t.data.truncate(t.data.len() - 4);
                    }
                }),
            ),
            (
                "unsupported tensor dtype",
                Box::new(|r| {
                    if let Some(t) = r.hidden.as_mut() {
                        t.dtype = 77;
                    }
                }),
            ),
            (
                "non-finite",
                Box::new(|r| {
                    if let Some(t) = r.hidden.as_mut() {
                        let mut d = t.data.to_vec();
                        d[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
                        t.data = d.into();
                    }
                }),
            ),
            (
                "non-finite",
                Box::new(|r| {
                    if let Some(t) = r.hidden.as_mut() {
                        let mut d = t.data.to_vec();
                        let n = d.len();
                        d[n - 4..].copy_from_slice(&f32::NEG_INFINITY.to_le_bytes());
                        t.data = d.into();
                    }
                }),
            ),
        ];
        for (want, edit) in &cases {
            let mut r = good.clone();
            edit(&mut r);
            match call(&w, r).await {
                Err(s) => {
                    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{want}: {s:?}");
                    assert!(
                        s.message().contains(want),
                        "'{want}' not in: {}",
                        s.message()
                    );
                }
                Ok(_) => panic!("{want}: accepted"),
            }
            // The same step again (the shard truncates to `past`): same output.
            let again = call(&w, good.clone()).await?;
            assert_eq!(again.partial, ok.partial, "after '{want}'");
        }
        Ok(())
    }
}
