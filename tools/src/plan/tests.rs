//! `epserve plan` arithmetic against numbers worked out by hand for
//! Qwen3-30B-A3B and Mixtral-8x7B (their hub config.json, written to temp dirs).

use super::*;

/// Qwen3-30B-A3B's config.json as on the hub.
const QWEN3_30B_A3B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
  "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
  "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
  "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "hidden_act": "silu",
  "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": null,
  "use_sliding_window": false, "max_window_layers": 48, "attention_bias": false
}"#;

/// Mixtral-8x7B-v0.1's config.json as on the hub.
const MIXTRAL_8X7B: &str = r#"{
  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
  "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "hidden_act": "silu",
  "bos_token_id": 1, "eos_token_id": 2
}"#;

/// Writes `config` to a temp dir and reads it the way `epserve plan` does.
fn shape_of(config: &str) -> ModelShape {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("config.json"), config).expect("write config");
    let cfg = ModelConfig::from_dir(dir.path()).expect("config parses");
    let raw = read_raw(dir.path()).expect("raw config");
    ModelShape::from_config(&cfg, &raw)
}

fn assumptions(expert_dtype: ExpertDtype, kv_dtype: KvDtype) -> Assumptions {
    Assumptions {
        expert_dtype,
        kv_dtype,
        context_len: 1024,
        rtt_s: 100e-6,
        flow_bps: 5e9,
        mem_bw_efficiency: 0.8,
        wire_dtype: WireDtype::Bf16,
        cold: ColdTier::default(),
    }
}

fn close(got: f64, want: f64, rel: f64) {
    assert!(
        (got - want).abs() <= rel * want.abs(),
        "got {got}, want {want} (±{rel} relative)"
    );
}

#[test]
fn qwen3_30b_a3b_bytes_and_parameters() {
    let m = shape_of(QWEN3_30B_A3B);
    assert_eq!(
        (m.layers, m.moe_layers, m.experts, m.top_k),
        (48, 48, 128, 8)
    );
    // One expert: gate + up (2048→768) and down (768→2048) = 3·2048·768.
    assert_eq!(m.expert_params(), 4_718_592);
    assert_eq!(m.expert_bytes(ExpertDtype::Bf16), 9_437_184); // 9 MiB
    // int8: one byte per weight + an f32 scale per output row (768 + 768 + 2048 rows).
    assert_eq!(m.expert_bytes(ExpertDtype::Int8), 4_718_592 + 4 * 3_584);
    // Attention per layer: q 2048×4096, k and v 2048×512, o 4096×2048.
    assert_eq!(
        m.attn_params_per_layer,
        8_388_608 + 2 * 1_048_576 + 8_388_608
    );
    assert_eq!(m.attention_params(), 905_969_664);
    assert_eq!(m.router_params(), 48 * 128 * 2048);
    assert_eq!(m.embedding_params(), 151_936 * 2048);
    assert_eq!(m.lm_head_params(), 151_936 * 2048);
    // Experts: 48 layers × 128 × 4,718,592.
    assert_eq!(m.all_expert_params(), 28_991_029_248);
    // 30.5 B in all, 3.35 B active (Qwen's card: 30.5B / 3.3B).
    assert_eq!(m.total_params(), 30_531_911_680);
    assert_eq!(
        m.active_params(),
        905_969_664 + 48 * 8 * 4_718_592 + 12_582_912 + 2 * 311_164_928
    );
    assert_eq!(m.active_params(), 3_352_821_760);
    // KV per token: 48 layers × (k + v) × 4 heads × 128 × 2 bytes = 96 KiB
    // (each head in its plane: value rows of 256 B, not padded).
    assert_eq!((m.kv_widths, m.kv_cache_heads), ((512, 512), 4));
    assert_eq!(m.kv_bytes_per_token(KvDtype::Bf16), 98_304);
    assert_eq!(m.kv_bytes_per_token(KvDtype::F32), 196_608);
    assert_eq!(m.kv_bytes_for_context(1000, KvDtype::Bf16), 98_304_000);
}

#[test]
fn mixtral_8x7b_bytes_and_parameters() {
    let m = shape_of(MIXTRAL_8X7B);
    assert_eq!((m.layers, m.moe_layers, m.experts, m.top_k), (32, 32, 8, 2));
    assert_eq!(m.moe_width, 14_336);
    assert_eq!(m.expert_params(), 3 * 4096 * 14_336);
    assert_eq!(m.expert_bytes(ExpertDtype::Bf16), 352_321_536); // 336 MiB
    assert_eq!(
        m.expert_bytes(ExpertDtype::Int8),
        176_160_768 + 4 * (2 * 14_336 + 4096)
    );
    // Attention per layer: q and o 4096×4096, k and v 4096×1024.
    assert_eq!(m.attention_params(), 32 * (2 * 16_777_216 + 2 * 4_194_304));
    // 46.7 B in all, 12.9 B active (Mistral's figures).
    assert_eq!(m.total_params(), 46_702_526_464);
    assert_eq!(m.active_params(), 12_879_659_008);
    // KV per token: 32 layers × 2 × 8 heads × 128 × 2 bytes = 128 KiB.
    assert_eq!(m.kv_bytes_per_token(KvDtype::Bf16), 131_072);
}

#[test]
fn sliding_window_caps_the_kv_of_long_contexts() {
    let m =
        shape_of(&MIXTRAL_8X7B.replace(r#""sliding_window": null"#, r#""sliding_window": 4096"#));
    let per_token = m.kv_bytes_per_token(KvDtype::Bf16);
    assert_eq!(
        m.kv_bytes_for_context(2048, KvDtype::Bf16),
        2048 * per_token
    );
    assert_eq!(
        m.kv_bytes_for_context(8192, KvDtype::Bf16),
        4096 * per_token
    );
}

#[test]
fn latent_attention_shapes_from_the_raw_config() {
    // MLA ranks are read from config.json directly (DeepSeek-V3's numbers on a
    // Qwen3 skeleton, to check the formula alone): q through a 1536 rank, the
    // cache holds the 512 latent + 64 RoPE dims per token per layer.
    let cfg =
        ModelConfig::from_json_str(QWEN3_30B_A3B, Path::new("config.json")).expect("config parses");
    let raw: serde_json::Value = serde_json::json!({
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128
    });
    let m = ModelShape::from_config(&cfg, &raw);
    let (h, n) = (2048, 32);
    let q = h * 1536 + 1536 * n * (128 + 64);
    let kv = h * (512 + 64) + 512 * n * (128 + 128);
    assert_eq!(m.attn_params_per_layer, q + kv + n * 128 * h);
    assert_eq!(m.kv_bytes_per_token(KvDtype::Bf16), 48 * 576 * 2);
}

#[test]
fn experts_touched_grow_as_one_minus_miss_to_the_batch() {
    close(expected_touched(128, 8, 1), 8.0, 1e-12);
    // 128 · (1 − (15/16)²) = 15.5
    close(expected_touched(128, 8, 2), 15.5, 1e-12);
    close(expected_touched(128, 8, 64), 125.942_349_267, 1e-9);
    close(expected_touched(8, 2, 1), 2.0, 1e-12);
    // 8 · (1 − (3/4)²) = 3.5
    close(expected_touched(8, 2, 2), 3.5, 1e-12);
    close(expected_touched(8, 2, 1000), 8.0, 1e-9);
}

#[test]
fn instance_table() {
    let c8g = Instance::lookup("c8g.16xlarge").expect("known");
    assert_eq!((c8g.vcpus, c8g.mem_gib, c8g.net_gbps), (64, 128.0, 30.0));
    // 64 of Graviton4's 96 cores: 64/96 of 12 × DDR5-5600 × 8 B = 358.4 GB/s.
    close(c8g.peak_bandwidth(), 358.4e9, 1e-12);
    // 64 vCPU less reservedSystemCPUs 0-1 less the DaemonSets' 250m, in whole
    // CPUs; 128 GiB × 0.97 less 255 + 11 × 737 MiB kube-reserved, 100 MiB
    // eviction and the DaemonSets' 256 MiB.
    assert_eq!(c8g.max_pods(), 737);
    assert_eq!(c8g.allocatable_cpu_millis(), 62_000);
    assert_eq!((c8g.pod_cpus(), c8g.pod_memory_gib()), (61, 115));
    let c7g4 = Instance::lookup("c7g.4xlarge").expect("known");
    assert_eq!(c7g4.max_pods(), 234);
    assert_eq!((c7g4.pod_cpus(), c7g4.pod_memory_gib()), (13, 27));
    let c7g = Instance::lookup("c7g.16xlarge").expect("known");
    close(c7g.peak_bandwidth(), 307.2e9, 1e-12);
    let r8g = Instance::lookup("r8g.48xlarge").expect("known");
    assert_eq!((r8g.vcpus, r8g.mem_gib), (192, 1536.0));
    close(r8g.peak_bandwidth(), 1075.2e9, 1e-12);
    let m7g = Instance::lookup("m7g.metal").expect("known");
    assert_eq!((m7g.vcpus, m7g.mem_gib), (64, 256.0));
    let err = Instance::lookup("c6i.16xlarge").expect_err("not Graviton 3/4");
    assert!(err.to_string().contains("c8g"), "{err}");
    assert!(Instance::lookup("c7g.24xlarge").is_err());
}

#[test]
fn mixtral_decode_step_by_hand() {
    // Mixtral-8x7B, 2 expert-workers, attention in the coordinator, batch 1,
    // bf16 weights and KV, c8g.16xlarge (286.72 GB/s at 80% of 358.4), 30 Gbps.
    let m = shape_of(MIXTRAL_8X7B);
    let inst = Instance::lookup("c8g.16xlarge").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::Bf16);
    let layout = Layout {
        expert_workers: 2,
        attention_workers: 0,
    };
    let e = estimate(&m, &inst, &a, layout, 1);
    let bw = 286.72e9;
    // Coordinator: attention 2 × 1,342,177,280 B + KV 1024 × 131,072 B + router
    // and lm_head 2 × (1,048,576 + 131,072,000) B + one 8 KiB embedding row.
    let coord = 2_684_354_560.0 + 134_217_728.0 + 264_241_152.0 + 8_192.0;
    close(e.coordinator_s, coord / bw, 1e-9);
    // Two experts touched, one per worker: 32 layers × one 336 MiB expert.
    close(e.experts_touched, 2.0, 1e-12);
    close(e.experts_s, 32.0 * 352_321_536.0 / bw, 1e-9);
    // A token's 2 experts land on 2 · (1 − ½²) = 1.5 workers on average: 32 ×
    // 1.5 × 8 KiB out; the NIC's 3.75 GB/s would carry it, but each worker's
    // half goes over its own TCP flow of 5 Gbps (0.625 GB/s), the tighter cap.
    close(e.network_s, 32.0 * 1.5 * 8192.0 / 2.0 / 0.625e9, 1e-9);
    close(e.latency_s, 32.0 * 100e-6, 1e-12);
    close(e.step_s(), 0.053588201371, 1e-9);
    close(e.tokens_per_s(), 18.660824107, 1e-8);
    assert_eq!(e.bound(), "experts");
}

#[test]
fn the_wire_dtype_sizes_each_direction() {
    let m = shape_of(QWEN3_30B_A3B);
    let inst = Instance::lookup("c8g.16xlarge").expect("known");
    let layout = Layout {
        expert_workers: 4,
        attention_workers: 0,
    };
    let net = |wire| {
        let a = Assumptions {
            wire_dtype: wire,
            ..assumptions(ExpertDtype::Bf16, KvDtype::Bf16)
        };
        estimate(&m, &inst, &a, layout, 16).network_s
    };
    let (bf16, f32_, int8) = (
        net(WireDtype::Bf16),
        net(WireDtype::F32),
        net(WireDtype::Int8),
    );
    // f32 doubles both directions; int8 halves what goes out but the
    // combined sums come back in bf16, which then bounds the link.
    close(f32_, 2.0 * bf16, 1e-12);
    close(int8, bf16, 1e-12);
    assert!(WireDtype::Int8.out_bytes(m.hidden) < WireDtype::Bf16.out_bytes(m.hidden) / 1.9);
}

#[test]
fn qwen3_plan_reaches_the_target_with_the_fewest_nodes() {
    let m = shape_of(QWEN3_30B_A3B);
    let inst = Instance::lookup("c8g.16xlarge").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::F32);
    let plan = make_plan(&m, &inst, &a, 500.0, 64).expect("plans");
    assert!(plan.reachable);
    assert!(plan.at_batch.tokens_per_s() >= 500.0);
    // (115 − 4) GiB of room / (48 layers × 9 MiB) = 263 slots per layer.
    assert_eq!(plan.slot_capacity, 263);
    let l = plan.layout;
    let nodes = l.expert_workers + l.attention_workers;
    // No layout with fewer worker nodes reaches it (every one fits in memory here).
    for workers in 1..nodes {
        for shards in [0, 1, 2, 4] {
            if workers + shards < nodes {
                let fewer = Layout {
                    expert_workers: workers,
                    attention_workers: shards,
                };
                let tps = estimate(&m, &inst, &a, fewer, 64).tokens_per_s();
                assert!(tps < 500.0, "{fewer:?} gives {tps}");
            }
        }
    }
    assert_eq!(
        4 % l.attention_workers.max(1),
        0,
        "shards divide 4 KV heads"
    );
    if l.expert_workers > 1 {
        // ceil(128 · 9/8 / W) slots each; beyond one per expert they are redundant.
        let slots = 144u64.div_ceil(l.expert_workers);
        assert_eq!(plan.slots_per_worker, slots);
        assert_eq!(plan.redundant_per_layer, slots * l.expert_workers - 128);
    }
    assert_eq!(plan.table.first().map(|e| e.batch), Some(1));
    assert_eq!(plan.table.last().map(|e| e.batch), Some(256));
}

#[test]
fn mixtral_on_small_nodes_is_sized_by_memory() {
    // c8g.4xlarge: 32 GiB, pods 28 GiB, 24 GiB for experts; one expert of every
    // layer is 32 × 336 MiB = 10.5 GiB, so 2 per worker and 4 workers for 8.
    let m = shape_of(MIXTRAL_8X7B);
    let inst = Instance::lookup("c8g.4xlarge").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::Bf16);
    let plan = make_plan(&m, &inst, &a, 1.0, 64).expect("plans");
    assert_eq!(plan.slot_capacity, 2);
    assert_eq!(plan.layout.expert_workers, 4);
    assert_eq!(plan.slots_per_worker, 2);
    assert_eq!(plan.redundant_per_layer, 0);
    // int8 halves the experts: 4 per worker, 2 workers.
    let a8 = assumptions(ExpertDtype::Int8, KvDtype::Bf16);
    let plan8 = make_plan(&m, &inst, &a8, 1.0, 64).expect("plans");
    assert_eq!(plan8.slot_capacity, 4);
    assert_eq!(plan8.layout.expert_workers, 2);
}

#[test]
fn a_cluster_capped_below_the_experts_gets_a_cold_tier() {
    // Mixtral on c8g.4xlarge needs 4 workers (2 experts of 8 each); capped
    // at 2, each holds 2 of its 4 and packs the others on use.
    let m = shape_of(MIXTRAL_8X7B);
    let inst = Instance::lookup("c8g.4xlarge").expect("known");
    let full = make_plan(
        &m,
        &inst,
        &assumptions(ExpertDtype::Bf16, KvDtype::Bf16),
        1.0,
        1,
    )
    .expect("plans");
    assert_eq!(full.held_fraction, 1.0);
    assert!(
        full.table
            .iter()
            .all(|e| e.cold_s == 0.0 && e.hit_rate == 1.0)
    );
    let mut a = assumptions(ExpertDtype::Bf16, KvDtype::Bf16);
    a.cold = ColdTier {
        max_expert_workers: Some(2),
        zipf: 0.0,
        ..ColdTier::default()
    };
    let plan = make_plan(&m, &inst, &a, 1.0, 1).expect("plans");
    assert_eq!(plan.layout.expert_workers, 2);
    assert_eq!(plan.slots_per_worker, 4);
    assert_eq!(plan.held_fraction, 0.5);
    assert_eq!(plan.redundant_per_layer, 0);
    // Uniform routing, batch 1: half the uses hit; the 4 cold experts are
    // each touched with probability 2/8, half of them per worker, every
    // layer: read at 1 GB/s and packed on the pod's vCPUs.
    let e = &plan.at_batch;
    close(e.hit_rate, 0.5, 1e-12);
    let bytes = m.expert_bytes(ExpertDtype::Bf16) as f64;
    let vcpus = f64::from(inst.pod_cpus());
    let want = 32.0 * (4.0 * 0.25 / 2.0) * bytes * (1.0 / 1e9 + 1.0 / (4e9 * vcpus));
    close(e.cold_s, want, 1e-9);
    assert_eq!(e.bound(), "cold tier");
    let report = render_report(&m, &inst, &a, &plan, 1.0, 1);
    assert!(
        report.contains("cold tier   the experts need 4 expert-workers; capped at 2"),
        "{report}"
    );
    let args = PlanArgs {
        model: Some(PathBuf::from("/models/Mixtral")),
        instance: "c8g.4xlarge".into(),
        target_output_tps: Some(1.0),
        expert_dtype: ExpertDtype::Bf16,
        kv_dtype: KvDtype::Bf16,
        batch: 1,
        context_len: 1024,
        rtt_us: 100.0,
        flow_gbps: 5.0,
        mem_bw_efficiency: 0.8,
        dispatch_dtype: WireDtype::Bf16,
        helm_values: None,
        node_model: false,
        simulate: false,
        nodes: None,
        attention_workers: 0,
        zipf: 0.0,
        redundant: 0,
        sim_steps: 20,
        seed: 0,
        calibration: None,
        dispatch_metrics: None,
        phase_metrics: vec![],
        overlap_metrics: vec![],
        max_expert_workers: Some(2),
        cold_read_gbps: 1.0,
        pack_gbps_per_vcpu: 4.0,
    };
    let values = helm_values(&m, &inst, &a, &plan, &args);
    assert!(values.contains("  expertMemory: \""), "{values}");
    // Skew: the held (hottest) half takes more of the uses.
    let (hit, cold) = cold_tier_touch(8, 4.0, 2, 1.0, 1);
    let h = |n: usize| (1..=n).map(|r| 1.0 / r as f64).sum::<f64>();
    close(hit, h(4) / h(8), 1e-12);
    close(
        cold,
        (5..=8).map(|r| 2.0 / r as f64 / h(8)).sum::<f64>(),
        1e-12,
    );
    assert_eq!(cold_tier_touch(8, 8.0, 2, 1.0, 64), (1.0, 0.0));
}

#[test]
fn unreachable_targets_ask_for_more_deployments() {
    let m = shape_of(MIXTRAL_8X7B);
    let inst = Instance::lookup("c8g.16xlarge").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::Bf16);
    let plan = make_plan(&m, &inst, &a, 1e7, 64).expect("plans");
    assert!(!plan.reachable);
    assert!(plan.deployments > 1);
    let report = render_report(&m, &inst, &a, &plan, 1e7, 64);
    assert!(report.contains("NOT reached"), "{report}");
}

#[test]
fn models_that_do_not_fit_are_refused() {
    let m = shape_of(MIXTRAL_8X7B);
    let inst = Instance::lookup("c8g.medium").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::Bf16);
    let err = make_plan(&m, &inst, &a, 10.0, 64).expect_err("does not fit");
    assert!(err.to_string().contains("does not fit"), "{err}");
    let err = make_plan(&m, &inst, &a, -1.0, 64).expect_err("bad target");
    assert!(err.to_string().contains("target"), "{err}");
}

#[test]
fn helm_values_carry_the_layout() {
    let m = shape_of(QWEN3_30B_A3B);
    let inst = Instance::lookup("c8g.16xlarge").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::F32);
    let plan = make_plan(&m, &inst, &a, 500.0, 64).expect("plans");
    let args = PlanArgs {
        model: Some(PathBuf::from("/models/Qwen3-30B-A3B")),
        instance: "c8g.16xlarge".into(),
        target_output_tps: Some(500.0),
        expert_dtype: ExpertDtype::Bf16,
        kv_dtype: KvDtype::F32,
        batch: 64,
        context_len: 1024,
        rtt_us: 100.0,
        flow_gbps: 5.0,
        mem_bw_efficiency: 0.8,
        dispatch_dtype: WireDtype::Bf16,
        helm_values: None,
        node_model: false,
        simulate: false,
        nodes: None,
        attention_workers: 0,
        zipf: 1.0,
        redundant: 0,
        sim_steps: 20,
        seed: 0,
        calibration: None,
        dispatch_metrics: None,
        phase_metrics: vec![],
        overlap_metrics: vec![],
        max_expert_workers: None,
        cold_read_gbps: 1.0,
        pack_gbps_per_vcpu: 4.0,
    };
    let v = helm_values(&m, &inst, &a, &plan, &args);
    assert!(v.contains("  path: \"Qwen3-30B-A3B\"\n"), "{v}");
    assert!(v.contains("  instanceFamilies: [c8g]\n"), "{v}");
    assert!(v.contains("  instanceSizes: [\"16xlarge\"]\n"), "{v}");
    assert!(
        v.contains(&format!(
            "expertWorkers:\n  # -- Expert-workers, one per node.\n  replicas: {}\n",
            plan.layout.expert_workers
        )),
        "{v}"
    );
    assert!(v.contains("    cpu: 61\n    memory: 115Gi\n"), "{v}");
}

#[test]
fn two_socket_nodes_get_one_expert_worker_per_socket() {
    let m = shape_of(QWEN3_30B_A3B);
    let inst = Instance::lookup("c8g.48xlarge").expect("known");
    assert_eq!(inst.sockets(), 2);
    assert_eq!(
        Instance::lookup("c8g.24xlarge").expect("known").sockets(),
        1
    );
    let a = assumptions(ExpertDtype::Bf16, KvDtype::F32);
    let plan = make_plan(&m, &inst, &a, 500.0, 64).expect("plan");
    let args = PlanArgs {
        model: Some(PathBuf::from("/models/Qwen3-30B-A3B")),
        instance: "c8g.48xlarge".into(),
        target_output_tps: Some(500.0),
        expert_dtype: ExpertDtype::Bf16,
        kv_dtype: KvDtype::F32,
        batch: 64,
        context_len: 1024,
        rtt_us: 100.0,
        flow_gbps: 5.0,
        mem_bw_efficiency: 0.8,
        dispatch_dtype: WireDtype::Bf16,
        helm_values: None,
        node_model: false,
        simulate: false,
        nodes: None,
        attention_workers: 0,
        zipf: 1.0,
        redundant: 0,
        sim_steps: 20,
        seed: 0,
        calibration: None,
        dispatch_metrics: None,
        phase_metrics: vec![],
        overlap_metrics: vec![],
        max_expert_workers: None,
        cold_read_gbps: 1.0,
        pack_gbps_per_vcpu: 4.0,
    };
    let v = helm_values(&m, &inst, &a, &plan, &args);
    let per_socket = inst.pod_cpus() / 2;
    assert!(
        v.contains(&format!("  replicas: {}\n", plan.layout.expert_workers * 2)),
        "{v}"
    );
    assert!(v.contains(&format!("    cpu: {per_socket}\n")), "{v}");
    assert!(v.contains("  antiAffinity: soft\n"), "{v}");
    let report = render_report(&m, &inst, &a, &plan, 500.0, 64);
    assert!(
        report.contains("NUMA        2 sockets per node"),
        "{report}"
    );
}

#[test]
fn the_simulator_matches_the_uniform_plan_without_skew_and_sees_imbalance() {
    let m = shape_of(QWEN3_30B_A3B);
    let inst = Instance::lookup("c8g.16xlarge").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::F32);
    let spec = |zipf: f64, redundant: u64| simulate::SimSpec {
        nodes: 5,
        attention_workers: 0,
        zipf,
        redundant,
        steps: 30,
        seed: 7,
        batches: vec![64],
    };
    let flat = simulate::simulate(&m, &inst, &a, &spec(0.0, 0)).expect("sim");
    // Uniform routing: the slowest of 4 workers is a little slower than the
    // planner's average worker, never faster.
    assert!(flat[0].step_s >= flat[0].uniform_step_s * 0.97, "{flat:?}");
    assert!(flat[0].step_s <= flat[0].uniform_step_s * 1.3, "{flat:?}");
    // Skew unbalances the workers (it also touches fewer distinct experts,
    // so a bandwidth-bound step can even get cheaper); replicas of the hot
    // experts balance them again.
    let skew = simulate::simulate(&m, &inst, &a, &spec(1.2, 0)).expect("sim");
    assert!(
        skew[0].balancedness < flat[0].balancedness - 0.05,
        "{skew:?} vs {flat:?}"
    );
    let replicated = simulate::simulate(&m, &inst, &a, &spec(1.2, 16)).expect("sim");
    assert!(
        replicated[0].balancedness > skew[0].balancedness,
        "{replicated:?} vs {skew:?}"
    );
    let err = simulate::simulate(
        &m,
        &Instance::lookup("c8g.4xlarge").expect("known"),
        &a,
        &simulate::SimSpec {
            nodes: 2,
            ..spec(1.0, 0)
        },
    )
    .expect_err("one 32 GiB worker cannot hold 57 GiB of experts");
    assert!(err.to_string().contains("slots per worker"), "{err}");
}

#[test]
fn placement_packs_replicas_of_hot_experts_on_distinct_workers() {
    let load = [8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0];
    let p = simulate::place(&load, 4, 3, 4);
    let replicas: usize = p.iter().map(Vec::len).sum();
    assert_eq!(replicas, 12);
    assert!(p[0].len() >= 3, "{p:?}");
    for reps in &p {
        let mut r = reps.clone();
        r.dedup();
        assert_eq!(r.len(), reps.len(), "{p:?}");
        assert!(!reps.is_empty());
    }
}

#[test]
fn calibration_replaces_the_assumed_rates() {
    let json = r#"{"kernel": "neon-bf16", "shapes": [], "targets": [],
      "machine": [{"threads": 1, "bandwidth_gbps": 20.0, "fma_peak_gflops": 1.0, "fma_peak_with": "x"},
                  {"threads": 64, "bandwidth_gbps": 256.0, "fma_peak_gflops": 1.0, "fma_peak_with": "x"}],
      "rows": [
        {"shape": "q", "tokens": 1, "dtype": "bf16", "threads": 64, "bandwidth_pct": 80.0, "gflops": 5.0},
        {"shape": "q", "tokens": 16, "dtype": "bf16", "threads": 64, "bandwidth_pct": 90.0, "gflops": 50.0},
        {"shape": "q", "tokens": 256, "dtype": "bf16", "threads": 64, "bandwidth_pct": 10.0, "gflops": 3200.0},
        {"shape": "q", "tokens": 256, "dtype": "int8", "threads": 64, "bandwidth_pct": 10.0, "gflops": 6400.0},
        {"shape": "q", "tokens": 256, "dtype": "bf16", "threads": 1, "bandwidth_pct": 10.0, "gflops": 90.0}]}"#;
    let c = calibrate::Calibration::parse(json, "bench.json").expect("parse");
    assert_eq!(c.threads, 64);
    close(c.decode_share.expect("decode rows"), 0.85, 1e-12);
    close(c.bf16_gflops_per_thread.expect("bf16"), 50.0, 1e-12);
    close(c.int8_gops_per_thread.expect("int8"), 100.0, 1e-12);
    let mut inst = Instance::lookup("c8g.16xlarge").expect("known");
    let mut a = assumptions(ExpertDtype::Bf16, KvDtype::F32);
    c.apply(&mut inst, &mut a);
    // 4 GB/s per vCPU × 64 vCPUs.
    close(inst.peak_bandwidth(), 256e9, 1e-9);
    close(a.mem_bw_efficiency, 0.85, 1e-12);
    close(inst.generation.gflops_bf16_per_vcpu, 50.0, 1e-12);
    assert!(
        c.describe().contains("measured 256.0 GB/s"),
        "{}",
        c.describe()
    );
    assert!(calibrate::Calibration::parse("{}", "x").is_err());
}

#[test]
fn dispatch_overhead_from_a_metrics_scrape() {
    let text = "# TYPE epserve_dispatch_seconds summary
epserve_dispatch_seconds{layer=\"0\",quantile=\"0.5\"} 0.001
epserve_dispatch_seconds_sum{layer=\"0\"} 0.3
epserve_dispatch_seconds_count{layer=\"0\"} 100
epserve_dispatch_seconds_sum{layer=\"1\"} 0.5
epserve_dispatch_seconds_count{layer=\"1\"} 100
epserve_expert_worker_compute_seconds_sum{worker=\"a\"} 0.2
epserve_expert_worker_compute_seconds_count{worker=\"a\"} 200
";
    // 0.8 s / 200 dispatches = 4 ms, less 1 ms of worker compute.
    close(
        calibrate::dispatch_overhead_s(text).expect("some"),
        3e-3,
        1e-12,
    );
    assert!(calibrate::dispatch_overhead_s("epserve_requests_total 3").is_none());
}

#[test]
fn a_loopback_clusters_workers_share_the_machine() {
    // `--instance local`: every role runs on this machine, so two workers
    // streaming their halves of the touched experts at once take as long as
    // one worker streaming all of them; on separate nodes they take half.
    // Four layers (as scripts/make_bench_model.py builds), so the experts fit
    // in any test machine's memory.
    let m =
        shape_of(&QWEN3_30B_A3B.replace("\"num_hidden_layers\": 48", "\"num_hidden_layers\": 4"));
    assert_eq!(m.moe_layers, 4);
    let a = assumptions(ExpertDtype::Bf16, KvDtype::Bf16);
    let one = Layout {
        expert_workers: 1,
        attention_workers: 0,
    };
    let two = Layout {
        expert_workers: 2,
        attention_workers: 0,
    };
    let local = Instance::local().expect("this machine");
    let l1 = estimate(&m, &local, &a, one, 8);
    let l2 = estimate(&m, &local, &a, two, 8);
    close(l2.experts_s, l1.experts_s, 1e-9);
    let node = Instance::lookup("c8g.16xlarge").expect("known");
    let n1 = estimate(&m, &node, &a, one, 8);
    let n2 = estimate(&m, &node, &a, two, 8);
    close(n2.experts_s, n1.experts_s / 2.0, 1e-9);
    // The simulator agrees with the uniform estimate on a loopback cluster too.
    let spec = simulate::SimSpec {
        nodes: 3,
        attention_workers: 0,
        zipf: 0.0,
        redundant: 0,
        steps: 200,
        seed: 1,
        batches: vec![64],
    };
    let rows = simulate::simulate(&m, &local, &a, &spec).expect("simulates");
    let est = estimate(&m, &local, &a, two, 64);
    // The slowest of two workers is a little above the mean.
    assert!(rows[0].step_s >= est.step_s() * 0.99, "{rows:?} vs {est:?}");
    assert!(rows[0].step_s <= est.step_s() * 1.2, "{rows:?} vs {est:?}");
}

/// A coordinator's /metrics with the step histograms the overlap reads.
fn phase_scrape(steps: f64, step_s: f64, wait_s: f64, worker_s: f64, tokens: f64) -> String {
    format!(
        "# HELP epserve_step_seconds x\n\
         # TYPE epserve_step_seconds histogram\n\
         epserve_step_seconds_bucket{{le=\"+Inf\"}} {steps}\n\
         epserve_step_seconds_sum {}\n\
         epserve_step_seconds_count {steps}\n\
         epserve_step_wait_seconds_sum {}\n\
         epserve_step_wait_seconds_count {steps}\n\
         epserve_expert_worker_compute_seconds_sum{{worker=\"expert-0\"}} {}\n\
         epserve_expert_worker_compute_seconds_count{{worker=\"expert-0\"}} {}\n\
         epserve_batch_size_tokens_sum {}\n\
         epserve_batch_size_tokens_count {steps}\n",
        steps * step_s,
        steps * wait_s,
        steps * worker_s,
        steps * 4.0,
        steps * tokens,
    )
}

#[test]
fn measured_phases_and_overlap_efficiency() {
    // Before: 10 steps of warm-up; after: 110. The run's own 100 steps:
    // S 1.0 s, waits 0.7 s (A 0.3), worker 0.6 s, 400 tokens each.
    let before = phase_scrape(10.0, 2.0, 1.0, 1.0, 100.0);
    // After: the warm-up's totals plus the run's (100 s, 70 s, 60 s, 40,000 tokens).
    let after_text = "epserve_step_seconds_sum 120\nepserve_step_seconds_count 110\n\
         epserve_step_wait_seconds_sum 80\nepserve_expert_worker_compute_seconds_sum{worker=\"a\"} 70\n\
         epserve_batch_size_tokens_sum 41000\n"
        .to_string();
    let sync =
        overlap::Phases::parse(&[("b".into(), before), ("a".into(), after_text)]).expect("parses");
    close(sync.steps, 100.0, 1e-12);
    close(sync.step_s, 1.0, 1e-12);
    close(sync.busy_s, 0.3, 1e-12);
    close(sync.worker_s, 0.6, 1e-12);
    close(sync.rest_s(), 0.1, 1e-9);
    close(sync.tokens_per_step, 400.0, 1e-12);
    // The overlapped run: 0.8 s per 400-token step, 1.25x; ideal 1/0.6.
    let over = overlap::Phases::parse(&[("o".into(), phase_scrape(50.0, 0.8, 0.6, 0.6, 400.0))])
        .expect("parses");
    let o = overlap::Overlap {
        sync: sync.clone(),
        overlapped: Some(over),
    };
    close(o.ideal_speedup(), 1.0 / 0.6, 1e-12);
    close(o.achieved_speedup().expect("both runs"), 1.25, 1e-12);
    close(o.efficiency(), 1.25 * 0.6, 1e-12);
    // Without the overlapped run: the ideal.
    let ideal = overlap::Overlap {
        sync,
        overlapped: None,
    };
    close(ideal.efficiency(), 1.0, 0.0);
    // No steps: a clear error.
    let err = overlap::Phases::parse(&[("x".into(), "# nothing\n".into())]).expect_err("no steps");
    assert!(err.to_string().contains("no scheduler steps"), "{err}");
    assert!(overlap::Phases::parse(&[]).is_err());
}

#[test]
fn ping_pong_prediction_on_planned_nodes() {
    let m = shape_of(QWEN3_30B_A3B);
    let inst = Instance::lookup("c8g.16xlarge").expect("known");
    let a = assumptions(ExpertDtype::Bf16, KvDtype::Bf16);
    let layout = Layout {
        expert_workers: 4,
        attention_workers: 0,
    };
    let o = overlap::Overlap {
        sync: overlap::Phases::parse(&[("s".into(), phase_scrape(10.0, 1.0, 0.7, 0.6, 400.0))])
            .expect("parses"),
        overlapped: None,
    };
    // Batch 1 cannot split.
    let r1 = o.predict(&m, &inst, &a, layout, 1);
    close(r1.split_s, r1.sync_s, 0.0);
    close(r1.auto_s(), r1.sync_s, 0.0);
    for b in [8, 64, 256] {
        let r = o.predict(&m, &inst, &a, layout, b);
        let whole = estimate(&m, &inst, &a, layout, b);
        close(r.sync_s, whole.step_s(), 1e-12);
        close(r.busy_s + r.remote_s, whole.step_s(), 1e-9);
        // The ideal split of two halves: twice the busier half.
        let half = estimate(&m, &inst, &a, layout, b / 2);
        let want = 2.0
            * (half.coordinator_s + half.attention_s)
                .max(half.experts_s + half.cold_s + half.network_s + half.latency_s);
        close(r.split_s, want, 1e-12);
        // auto never loses, and the split can never beat the busier side
        // of the whole batch by more than the halves' sublinearity allows.
        assert!(r.auto_s() <= r.sync_s);
        assert!(r.split_s >= r.busy_s.max(r.remote_s) * 0.999, "{r:?}");
    }
    // A lower efficiency makes the split slower by exactly its inverse.
    let mut eff = o.clone();
    eff.overlapped = Some(
        overlap::Phases::parse(&[("o".into(), phase_scrape(10.0, 0.8, 0.6, 0.6, 400.0))])
            .expect("parses"),
    );
    let e = eff.efficiency();
    assert!(e < 1.0 && e > 0.5, "{e}");
    let r = eff.predict(&m, &inst, &a, layout, 64);
    let ideal = o.predict(&m, &inst, &a, layout, 64);
    close(r.split_s, ideal.split_s / e, 1e-12);
    let text = eff.render(&[r], &inst);
    assert!(text.contains("ping-pong on c8g.16xlarge nodes"), "{text}");
    assert!(text.contains("% of the ideal"), "{text}");
}
