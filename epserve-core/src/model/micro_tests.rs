//! The staged layer loop: splitting a step into micro-batches, with experts
//! finishing eagerly or later on another thread, gives the logits of one
//! batch; faults and router traces keep their batch rows.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::attn_shard::LocalShards;
use super::*;
use crate::experts::{LoadOptions, execute_combined, load_executor};
use crate::moe::{Dispatched, ExpertExecutor, PendingDispatch, RowFault};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
        .join("f32")
}

/// Experts computed on a thread of their own, collected at `wait` (as a
/// remote dispatcher's would be), optionally reporting row 0 of every
/// dispatch as lost.
struct Deferred {
    executor: Arc<dyn ExpertExecutor>,
    fault_first_row: bool,
}

impl Dispatcher for Deferred {
    fn submit(
        &self,
        layer: usize,
        x: Arc<[f32]>,
        hidden: usize,
        routing: Arc<Routing>,
    ) -> Result<PendingDispatch> {
        let executor = self.executor.clone();
        let fault = self.fault_first_row;
        let job = std::thread::spawn(move || -> Result<Dispatched> {
            let y = execute_combined(executor.as_ref(), layer, &x, hidden, &routing)?;
            Ok(Dispatched {
                y,
                faults: if fault {
                    vec![RowFault {
                        row: 0,
                        message: format!("layer {layer}"),
                        degraded: false,
                    }]
                } else {
                    Vec::new()
                },
                timing: None,
            })
        });
        Ok(PendingDispatch::later(move || {
            job.join()
                .unwrap_or_else(|_| Err(Error::Dispatch("expert thread panicked".into())))
        }))
    }
}

fn model_with(dir: &Path, deferred: bool, fault: bool, shards: Option<usize>) -> Result<Model> {
    let cfg = ModelConfig::from_dir(dir)?;
    let ws = WeightStore::open(dir)?;
    let executor = load_executor(&cfg, &ws, &LoadOptions::default())?;
    let dispatcher: Arc<dyn Dispatcher> = if deferred {
        Arc::new(Deferred {
            executor,
            fault_first_row: fault,
        })
    } else {
        Arc::new(LocalDispatcher::new(executor))
    };
    let attention: Option<Arc<dyn AttentionBackend>> = match shards {
        Some(of) => Some(Arc::new(LocalShards::load(dir, of, 1 << 22, 4)?)),
        None => None,
    };
    Model::from_store_with(cfg, &ws, dispatcher, attention)
}

/// Three sequences (a chunked prefill, a short prompt, a longer one), then
/// two decode steps, split into `n` micro-batches; every position's logits,
/// the router traces and the faults of each step.
fn run(model: &Model, n: usize) -> Result<Vec<ForwardOutput>> {
    let vocab = model.config.vocab_size as u32;
    let toks: Vec<u32> = (0..60u32).map(|i| (i * 37 + 11) % vocab).collect();
    let mut pool = model.pool_for_tokens(512, KvDtype::F32);
    let mut caches = [model.new_cache(), model.new_cache(), model.new_cache()];
    let steps: [[&[u32]; 3]; 4] = [
        [&toks[0..6], &toks[20..22], &toks[40..49]],
        [&toks[6..11], &toks[22..23], &toks[49..50]],
        [&toks[11..12], &toks[23..24], &toks[50..51]],
        [&toks[12..13], &toks[24..25], &toks[51..52]],
    ];
    let mut out = Vec::new();
    for step in steps {
        let [c0, c1, c2] = &mut caches;
        let mut seqs = [
            SeqInput {
                tokens: step[0],
                cache: c0,
                logits: true,
            },
            SeqInput {
                tokens: step[1],
                cache: c1,
                logits: true,
            },
            SeqInput {
                tokens: step[2],
                cache: c2,
                logits: true,
            },
        ];
        out.push(model.forward_micro(&mut seqs, &mut pool, LogitsMode::All, true, n)?);
    }
    Ok(out)
}

fn assert_close(name: &str, what: &str, a: &[ForwardOutput], b: &[ForwardOutput]) {
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.rows, y.rows, "{name} {what}");
        let scale = x.logits.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let d = x
            .logits
            .iter()
            .zip(&y.logits)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        // Only kernels whose blocking depends on the row count may sum in
        // another order.
        assert!(
            d <= 1e-4 * scale,
            "{name} {what}: logits differ by {d} (max {scale})"
        );
        assert_eq!(x.router.len(), y.router.len(), "{name} {what}");
        for (r, s) in x.router.iter().zip(&y.router) {
            assert_eq!(r.layer, s.layer);
            assert_eq!(r.routing.num_tokens, s.routing.num_tokens);
        }
    }
}

#[test]
fn micro_batches_give_the_logits_of_one_batch() -> Result<()> {
    // Plain MoE, a shared expert, Gemma 4's parallel feed-forward, MLA with
    // dense layers.
    for name in ["qwen3_moe_a", "qwen2_moe", "gemma4", "deepseek_v3"] {
        let dir = fixture(name);
        let whole = run(&model_with(&dir, false, false, None)?, 1)?;
        for n in [2, 3, 8] {
            let eager = run(&model_with(&dir, false, false, None)?, n)?;
            assert_close(name, &format!("eager, {n} micro-batches"), &whole, &eager);
            let later = run(&model_with(&dir, true, false, None)?, n)?;
            assert_close(
                name,
                &format!("deferred, {n} micro-batches"),
                &whole,
                &later,
            );
        }
    }
    Ok(())
}

#[test]
fn micro_batches_through_attention_shards_give_the_logits_of_one_batch() -> Result<()> {
    let dir = fixture("qwen3_moe_a");
    let whole = run(&model_with(&dir, false, false, None)?, 1)?;
    let split = run(&model_with(&dir, true, false, Some(2))?, 2)?;
    assert_close("qwen3_moe_a", "2 shards, 2 micro-batches", &whole, &split);
    Ok(())
}

#[test]
fn faults_keep_their_batch_rows_across_micro_batches() -> Result<()> {
    let dir = fixture("qwen3_moe_a");
    let model = model_with(&dir, true, true, None)?;
    let rows = |out: &ForwardOutput| {
        let mut r: Vec<usize> = out.faults.iter().map(|f| f.row).collect();
        r.sort_unstable();
        r.dedup();
        r
    };
    // First step: 6 + 2 + 9 rows. One batch: row 0 only; split in three
    // (one sequence each): each sequence's first row.
    let one = run(&model, 1)?;
    assert_eq!(rows(&one[0]), vec![0]);
    let three = run(&model, 3)?;
    assert_eq!(rows(&three[0]), vec![0, 6, 8]);
    Ok(())
}

#[test]
fn splits_balance_tokens_over_whole_sequences() {
    let spans = |lens: &[usize]| -> Vec<SeqSpan> {
        let mut start = 0;
        lens.iter()
            .map(|&len| {
                let s = SeqSpan {
                    start,
                    len,
                    past: 0,
                };
                start += len;
                s
            })
            .collect()
    };
    assert_eq!(split_micro_batches(&spans(&[1; 8]), 2), vec![0..4, 4..8]);
    assert_eq!(
        split_micro_batches(&spans(&[512, 1, 1, 1]), 2),
        vec![0..1, 1..4]
    );
    assert_eq!(
        split_micro_batches(&spans(&[1, 1, 1, 512]), 2),
        vec![0..3, 3..4]
    );
    assert_eq!(split_micro_batches(&spans(&[5, 5]), 4), vec![0..1, 1..2]);
    assert_eq!(split_micro_batches(&spans(&[3]), 2), vec![0..1]);
    assert_eq!(split_micro_batches(&spans(&[2, 2, 2]), 1), vec![0..3]);
    assert!(split_micro_batches(&[], 2).is_empty());
}
