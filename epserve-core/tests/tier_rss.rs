//! `--expert-memory` held to the process's memory, not only to its own
//! accounting: on a generated Qwen3-MoE checkpoint with 192 MiB of bf16
//! experts, a tiered executor with a budget of a quarter of them serves
//! uniformly routed calls (every expert packed, evicted and packed again)
//! while the process's anonymous RSS (`RssAnon`: its RSS less the page
//! cache of the mapped checkpoint) grows by at most the budget plus a fixed
//! allowance for buffers and threads. Alone in its test binary, so no other
//! test's memory is counted.

use std::io::Write;
use std::sync::Arc;

use epserve_core::config::ModelConfig;
use epserve_core::experts::{LoadOptions, TierOptions, TieredExperts};
use epserve_core::loader::weights::WeightStore;
use epserve_core::moe::ExpertExecutor;

const HIDDEN: usize = 512;
const INTER: usize = 256;
const EXPERTS: usize = 64;
const LAYERS: usize = 4;
const TOP_K: usize = 4;

/// Anonymous resident memory of this process, bytes.
fn rss_anon() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .expect("RssAnon")
        * 1024
}

/// A 64-bit LCG (Knuth's MMIX constants): the upper bits.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 32) as u32
    }
}

/// Writes config.json and model.safetensors (experts only, bf16, small
/// random values) into `dir`, streaming the data.
fn write_model(dir: &std::path::Path) {
    let config = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": HIDDEN, "intermediate_size": 1024, "moe_intermediate_size": INTER,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "num_hidden_layers": LAYERS,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "vocab_size": 256, "attention_bias": false
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    let mut order = Vec::new();
    for l in 0..LAYERS {
        for e in 0..EXPERTS {
            for (proj, shape) in [
                ("gate_proj", [INTER, HIDDEN]),
                ("up_proj", [INTER, HIDDEN]),
                ("down_proj", [HIDDEN, INTER]),
            ] {
                let bytes = shape[0] * shape[1] * 2;
                let name = format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight");
                header.insert(
                    name,
                    serde_json::json!({"dtype": "BF16", "shape": shape,
                        "data_offsets": [offset, offset + bytes]}),
                );
                offset += bytes;
                order.push(bytes);
            }
        }
    }
    let mut h = serde_json::Value::Object(header).to_string();
    while !h.len().is_multiple_of(8) {
        h.push(' ');
    }
    let f = std::fs::File::create(dir.join("model.safetensors")).expect("create");
    let mut w = std::io::BufWriter::new(f);
    w.write_all(&(h.len() as u64).to_le_bytes()).expect("write");
    w.write_all(h.as_bytes()).expect("write");
    let mut rng = Lcg(7);
    let mut chunk = vec![0u8; 1 << 16];
    let total: usize = order.iter().sum();
    let mut left = total;
    while left > 0 {
        let n = left.min(chunk.len());
        for v in chunk[..n].chunks_exact_mut(2) {
            // bf16 in about ±0.03: sign, exponent 2^-6..2^-5, random mantissa.
            let r = rng.next();
            let bits: u16 = ((r & 1) as u16) << 15 | (0x79 << 7) | ((r >> 1) & 0x7f) as u16;
            v.copy_from_slice(&bits.to_le_bytes());
        }
        w.write_all(&chunk[..n]).expect("write");
        left -= n;
    }
    w.flush().expect("flush");
}

#[test]
fn a_quarter_budget_holds_the_process_rss() {
    let dir = tempfile::tempdir().expect("tmp");
    write_model(dir.path());
    let cfg = ModelConfig::from_dir(dir.path()).expect("config");
    let ws = Arc::new(WeightStore::open(dir.path()).expect("weights"));
    let expert_bytes = 3 * HIDDEN * INTER * 2;
    let all = LAYERS * EXPERTS * expert_bytes;
    let budget = all / 4;
    // Inputs and outputs of the calls, allocated before the baseline.
    let rows = 8;
    let mut rng = Lcg(11);
    let x: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| (rng.next() % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    let mut out = vec![0.0f32; rows * TOP_K * HIDDEN];
    let w = vec![0.25f32; rows * TOP_K];
    let base = rss_anon();
    let opts = LoadOptions {
        threads: Some(2),
        ..LoadOptions::default()
    };
    let tier = TierOptions {
        budget,
        ..TierOptions::default()
    };
    let t = TieredExperts::load(&cfg, ws, &opts, &|_, _| true, tier).expect("tiered");
    let warm = rss_anon().saturating_sub(base);
    let mut peak = warm;
    for call in 0..96 {
        // Uniform routing: rows × top-k distinct experts per row.
        let mut ids = Vec::with_capacity(rows * TOP_K);
        for _ in 0..rows {
            let mut pick: Vec<u32> = Vec::with_capacity(TOP_K);
            while pick.len() < TOP_K {
                let e = rng.next() % EXPERTS as u32;
                if !pick.contains(&e) {
                    pick.push(e);
                }
            }
            ids.extend(pick);
        }
        let layer = call % LAYERS;
        t.execute(layer, &x, &ids, &w, TOP_K, &mut out)
            .expect("execute");
        if call % 4 == 3 {
            t.prefetch_idle();
            peak = peak.max(rss_anon().saturating_sub(base));
        }
    }
    let s = t.snapshot();
    // Allowance: the pool's threads and their buffers, the allocator's
    // bookkeeping, the per-call scratch. (Before a miss packed into the
    // buffers of the expert it evicted, freed buffers kept in the allocator's
    // per-thread arenas took this to 23-25 MiB over the budget.)
    let allowance = 8 << 20;
    eprintln!(
        "experts {} MiB, budget {} MiB: RssAnon grew {} MiB after the warm-up, {} MiB at most; {} misses, {} evictions",
        all >> 20,
        budget >> 20,
        warm >> 20,
        peak >> 20,
        s.misses,
        s.evictions
    );
    assert!(
        s.misses > 500 && s.evictions > 500,
        "the calls cycle experts: {s:?}"
    );
    assert!(
        warm >= budget / 2,
        "the warm-up packs up to the budget ({warm} bytes): the measurement sees it"
    );
    assert!(
        peak <= budget + allowance,
        "RssAnon grew {peak} bytes, budget {budget} + allowance {allowance}"
    );
}
