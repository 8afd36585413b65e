//! Which quantized checkpoints epserve accepts: [`check_quantization`] reads
//! a `quantization_config` and refuses the schemes no loader implements.

/// Checks a `quantization_config`: `compressed-tensors` is accepted only in
/// the scheme epserve loads (what llm-compressor writes for W8A8 INT8, e.g.
/// RedHatAI's Qwen3-30B-A3B-quantized.w8a8): format `int-quantized`, weights
/// 8-bit symmetric int per output channel, input activations absent or 8-bit
/// int dynamic per token. Int8 weights become the int8 packed experts as they
/// are; other int8 layers (attention, dense MLPs) are dequantized at load.
/// Other quantization methods are left to the loaders that know them (GPT-OSS
/// `mxfp4`); the message says what is not supported.
pub fn check_quantization(q: &serde_json::Value) -> std::result::Result<(), String> {
    use serde_json::Value;
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    if method != "compressed-tensors" {
        return Ok(());
    }
    let format = q.get("format").and_then(Value::as_str).unwrap_or("");
    if format != "int-quantized" {
        return Err(format!(
            "quantization_config: compressed-tensors format '{format}' is not supported \
             (only 'int-quantized': int8 W8A8)"
        ));
    }
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or("quantization_config: compressed-tensors without config_groups")?;
    for (name, g) in groups {
        let field = |a: &Value, k: &str| a.get(k).cloned().unwrap_or(Value::Null);
        let w = g.get("weights").filter(|w| !w.is_null()).ok_or_else(|| {
            format!("quantization_config.config_groups.{name}: no `weights` scheme")
        })?;
        let ok_w = field(w, "type") == "int"
            && field(w, "num_bits") == 8
            && field(w, "symmetric") == true
            && field(w, "strategy") == "channel"
            && field(w, "group_size").is_null();
        if !ok_w {
            return Err(format!(
                "quantization_config.config_groups.{name}.weights: only 8-bit symmetric int \
                 per-channel weights are supported, got {w}"
            ));
        }
        if let Some(a) = g.get("input_activations").filter(|a| !a.is_null()) {
            let ok_a = field(a, "type") == "int"
                && field(a, "num_bits") == 8
                && field(a, "dynamic") == true
                && field(a, "strategy") == "token";
            if !ok_a {
                return Err(format!(
                    "quantization_config.config_groups.{name}.input_activations: only dynamic \
                     per-token 8-bit int activations are supported, got {a}"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod quantization_tests {
    use super::check_quantization;

    #[test]
    fn compressed_tensors_w8a8_is_accepted_and_others_refused() {
        let mut q = serde_json::json!({
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {"group_0": {
                "weights": {"type": "int", "num_bits": 8, "symmetric": true,
                            "strategy": "channel", "group_size": null},
                "input_activations": {"type": "int", "num_bits": 8, "symmetric": true,
                                      "dynamic": true, "strategy": "token"}
            }}
        });
        assert_eq!(check_quantization(&q), Ok(()));
        q["config_groups"]["group_0"]["weights"]["num_bits"] = 4.into();
        assert!(check_quantization(&q).is_err_and(|m| m.contains("8-bit")));
        q["config_groups"]["group_0"]["weights"]["num_bits"] = 8.into();
        q["config_groups"]["group_0"]["input_activations"]["dynamic"] = false.into();
        assert!(check_quantization(&q).is_err_and(|m| m.contains("dynamic")));
        q["format"] = "float-quantized".into();
        assert!(check_quantization(&q).is_err_and(|m| m.contains("float-quantized")));
        assert_eq!(
            check_quantization(&serde_json::json!({"quant_method": "mxfp4"})),
            Ok(())
        );
    }
}
