//! `AttentionService`: decode the layer input, run this shard's heads with
//! its KV cache, return the partial output projection.

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
        let hidden = r
            .hidden
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("missing hidden"))?;
        if hidden.cols != self.hidden {
            return Err(Status::invalid_argument(format!(
                "hidden has {} columns; the model's hidden size is {}",
                hidden.cols, self.hidden
            )));
        }
        let x = wire::decode(hidden).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let chunks: Vec<SeqChunk> = r
            .seqs
            .iter()
            .map(|c| SeqChunk {
                id: c.seq_id,
                past: c.past as usize,
                len: c.len as usize,
            })
            .collect();
        let rows: usize = chunks.iter().map(|c| c.len).sum();
        if rows != hidden.rows as usize {
            return Err(Status::invalid_argument(format!(
                "the chunks hold {rows} tokens but hidden has {} rows",
                hidden.rows
            )));
        }
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
