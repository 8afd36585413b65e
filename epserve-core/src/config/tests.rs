//! Tests of [`ModelConfig::from_raw`]: hub and transformers-5 spellings,
//! error messages, and the per-architecture normalisation (Gemma 4 wrapper and
//! per-layer dims, DeepSeek YaRN and grouped routing, Qwen sparse layers).

use super::*;

fn parse(s: &str) -> Result<ModelConfig> {
    ModelConfig::from_json_str(s, Path::new("config.json"))
}

#[test]
fn hub_and_v5_styles_agree() -> Result<()> {
    let hub = parse(
        r#"{"model_type":"qwen3_moe","vocab_size":100,"hidden_size":64,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"moe_intermediate_size":32,
        "intermediate_size":48,"num_experts":7,"num_experts_per_tok":2,"rope_theta":5000.0,
        "torch_dtype":"bfloat16","norm_topk_prob":true}"#,
    )?;
    let v5 = parse(
        r#"{"model_type":"qwen3_moe","vocab_size":100,"hidden_size":64,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"moe_intermediate_size":32,
        "intermediate_size":48,"num_local_experts":7,"num_experts_per_tok":2,
        "rope_parameters":{"rope_theta":5000.0,"rope_type":"default"},"dtype":"bfloat16","norm_topk_prob":true}"#,
    )?;
    assert_eq!(hub.num_experts, v5.num_experts);
    assert_eq!(hub.rope, v5.rope);
    assert_eq!(hub.declared_dtype, v5.declared_dtype);
    Ok(())
}

#[test]
fn unknown_architecture_is_named() {
    let err = parse(r#"{"model_type":"llama","vocab_size":10}"#)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("unsupported model_type 'llama'"), "{err}");
}

#[test]
fn missing_field_is_named() {
    let err = parse(r#"{"model_type":"mixtral","vocab_size":10}"#)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("hidden_size"), "{err}");
}

#[test]
fn gemma4_wrapper_and_hub_layer_dims() -> Result<()> {
    let text = r#"{"model_type":"gemma4_text","vocab_size":100,"hidden_size":32,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"global_head_dim":16,
        "num_global_key_value_heads":1,"attention_k_eq_v":true,"intermediate_size":32,
        "enable_moe_block":true,"num_experts":4,"top_k_experts":2,"moe_intermediate_size":8,
        "hidden_size_per_layer_input":0,"sliding_window":4,
        "layer_types":["sliding_attention","full_attention"],
        "rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":10000.0},
          "full_attention":{"rope_type":"proportional","partial_rotary_factor":0.25,"rope_theta":1000000.0}}}"#;
    let c = parse(&format!(
        r#"{{"model_type":"gemma4","text_config":{text}}}"#
    ))?;
    assert_eq!(c.weight_prefix, "model.language_model");
    assert_eq!(c.num_experts_per_tok, 2);
    let (s, f) = (&c.layers[0], &c.layers[1]);
    assert_eq!(
        (s.head_dim, s.kv_heads, s.v_from_k, s.sliding_window),
        (8, 2, false, Some(4))
    );
    assert_eq!(
        (f.head_dim, f.kv_heads, f.v_from_k, f.sliding_window),
        (16, 1, true, None)
    );
    assert_eq!(
        f.rope.scaling,
        RopeScaling::Proportional {
            factor: 1.0,
            rope_angles: 2
        }
    );
    assert_eq!(c.embed_scale, Some((32f32).sqrt()));
    Ok(())
}

#[test]
fn deepseek_hub_yarn_scales_the_softmax() -> Result<()> {
    let c = parse(
        r#"{"model_type":"deepseek_v3","vocab_size":100,"hidden_size":32,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":4,"intermediate_size":32,"moe_intermediate_size":8,
        "n_routed_experts":8,"num_experts_per_tok":2,"n_group":4,"topk_group":2,"kv_lora_rank":16,
        "q_lora_rank":16,"qk_rope_head_dim":8,"qk_nope_head_dim":8,"v_head_dim":8,"first_k_dense_replace":1,
        "rope_theta":10000.0,"rope_scaling":{"type":"yarn","factor":40,"mscale":1.0,"mscale_all_dim":1.0,
        "beta_fast":32,"beta_slow":1,"original_max_position_embeddings":4096}}"#,
    )?;
    let m = c.mla.clone().expect("mla");
    let ms = 0.1 * (40f64).ln() + 1.0;
    assert!((m.softmax_scale as f64 - (16f64).powf(-0.5) * ms * ms).abs() < 1e-6);
    assert_eq!(c.rope.attention_scaling, 1.0);
    assert!(c.rope.interleaved);
    assert_eq!(c.moe_layers(), vec![1]);
    assert!(matches!(
        c.router,
        RouterKind::GroupedSigmoid {
            n_group: 4,
            topk_group: 2,
            normalize: true,
            ..
        }
    ));
    Ok(())
}

#[test]
fn sparse_step_and_mlp_only_layers() -> Result<()> {
    let c = parse(
        r#"{"model_type":"qwen3_moe","vocab_size":100,"hidden_size":64,"num_hidden_layers":4,
        "num_attention_heads":4,"moe_intermediate_size":32,"intermediate_size":48,
        "num_experts":7,"num_experts_per_tok":2,"decoder_sparse_step":2,"mlp_only_layers":[3]}"#,
    )?;
    assert_eq!(c.moe_layers(), vec![1]);
    Ok(())
}
