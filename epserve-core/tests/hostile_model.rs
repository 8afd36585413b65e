//! Hostile model folders: fuzzed safetensors headers and offsets, config.json
//! with absurd sizes, tokenizer.json garbage. Each must end in a clear error
//! (or a consistent store), never a panic or a huge allocation. Property
//! tests run a bounded number of cases in the normal `cargo test`.

use std::path::{Path, PathBuf};

use epserve_core::config::ModelConfig;
use epserve_core::loader::tokenizer::Tokenizer;
use epserve_core::loader::weights::WeightStore;
use proptest::prelude::*;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_a/f32")
}

/// A safetensors file: 8-byte little-endian header length, header, data.
fn st_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

/// Opens a folder holding only `model.safetensors` = `bytes`; every tensor
/// the store then lists must be readable within the file.
fn open_weights(bytes: &[u8]) -> Result<usize, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    std::fs::write(dir.path().join("model.safetensors"), bytes).map_err(|e| e.to_string())?;
    let ws = WeightStore::open(dir.path()).map_err(|e| e.to_string())?;
    let names: Vec<String> = ws.names().iter().map(|s| s.to_string()).collect();
    for n in &names {
        let shape = ws.shape_of(n).map(|s| s.to_vec()).unwrap_or_default();
        // Unsupported dtypes are an error, not a panic.
        let _ = ws.get(n, &shape);
    }
    Ok(names.len())
}

#[test]
fn safetensors_hostile_headers() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty file", vec![]),
        ("short length prefix", vec![1, 2, 3]),
        ("header length u64::MAX", u64::MAX.to_le_bytes().to_vec()),
        ("header length past the file", {
            let mut v = 1000u64.to_le_bytes().to_vec();
            v.extend_from_slice(b"{}");
            v
        }),
        (
            "header length 200 MB",
            (200u64 << 20).to_le_bytes().to_vec(),
        ),
        ("header not JSON", st_file("not json at all", &[])),
        ("header a list", st_file("[1, 2, 3]", &[])),
        ("header invalid UTF-8", {
            let mut v = 4u64.to_le_bytes().to_vec();
            v.extend_from_slice(&[0xff, 0xfe, 0xfd, 0xfc]);
            v
        }),
        (
            "offsets past the data",
            st_file(
                r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#,
                &[0; 4],
            ),
        ),
        (
            "offsets reversed",
            st_file(
                r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}"#,
                &[0; 4],
            ),
        ),
        (
            "negative offset",
            st_file(
                r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}"#,
                &[0; 4],
            ),
        ),
        (
            "offset u64::MAX",
            st_file(
                r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [18446744073709551615, 18446744073709551615]}}"#,
                &[0; 4],
            ),
        ),
        (
            "shape × dtype ≠ bytes",
            st_file(
                r#"{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}"#,
                &[0; 4],
            ),
        ),
        (
            "shape product overflows",
            st_file(
                r#"{"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 4]}}"#,
                &[0; 4],
            ),
        ),
        (
            "terabyte shape",
            st_file(
                r#"{"w": {"dtype": "BF16", "shape": [1000000, 1000000], "data_offsets": [0, 4]}}"#,
                &[0; 4],
            ),
        ),
        (
            "unknown dtype",
            st_file(
                r#"{"w": {"dtype": "F1024", "shape": [1], "data_offsets": [0, 4]}}"#,
                &[0; 4],
            ),
        ),
        (
            "overlapping tensors",
            st_file(
                r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
                &[0; 4],
            ),
        ),
        (
            "hole between tensors",
            st_file(
                r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}"#,
                &[0; 12],
            ),
        ),
        (
            "missing data_offsets",
            st_file(r#"{"w": {"dtype": "F32", "shape": [1]}}"#, &[0; 4]),
        ),
        (
            "metadata not strings",
            st_file(r#"{"__metadata__": {"a": 1}}"#, &[]),
        ),
        (
            "deep nesting",
            st_file(
                &format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
                &[],
            ),
        ),
    ];
    for (name, bytes) in &cases {
        let r = open_weights(bytes);
        assert!(r.is_err(), "{name}: accepted: {r:?}");
        let e = r.err().unwrap_or_default();
        assert!(
            e.contains("model.safetensors"),
            "{name}: the error names the file: {e}"
        );
    }
    // A sane one still opens.
    let ok = st_file(
        r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
        &[0; 4],
    );
    assert_eq!(open_weights(&ok), Ok(1));
}

#[test]
fn index_json_hostile() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text) in [
        (
            "escaping shard name",
            r#"{"weight_map": {"w": "../../etc/passwd"}}"#,
        ),
        (
            "missing shard",
            r#"{"weight_map": {"w": "nope.safetensors"}}"#,
        ),
        ("not JSON", "{{{"),
        ("weight_map a list", r#"{"weight_map": []}"#),
    ] {
        std::fs::write(dir.path().join("model.safetensors.index.json"), text).expect("write");
        let r = WeightStore::open(dir.path());
        assert!(r.is_err(), "{name}: accepted");
    }
}

fn fixture_config() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("config.json")).expect("config");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn config_absurd_sizes_are_refused_by_name() {
    for (field, value) in [
        ("num_hidden_layers", 1_000_000_000_000u64),
        ("hidden_size", 1 << 40),
        ("vocab_size", 1 << 40),
        ("max_position_embeddings", 1_000_000_000_000_000),
        ("num_experts", 1 << 32),
        ("num_attention_heads", 1 << 30),
        ("moe_intermediate_size", 1 << 40),
        ("intermediate_size", 1 << 40),
        ("head_dim", 1 << 30),
        ("num_experts_per_tok", 1 << 30),
    ] {
        let mut c = fixture_config();
        c[field] = serde_json::json!(value);
        let e = ModelConfig::from_json_str(&c.to_string(), Path::new("config.json"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains(field), "{field} = {value}: {e}");
    }
    // vocab × hidden beyond 2^36 elements, each alone under its cap.
    let mut c = fixture_config();
    c["vocab_size"] = serde_json::json!(1 << 24);
    c["hidden_size"] = serde_json::json!(1 << 17);
    assert!(ModelConfig::from_json_str(&c.to_string(), Path::new("config.json")).is_err());
    // Negative and fractional sizes are JSON type errors.
    for bad in [
        serde_json::json!(-1),
        serde_json::json!(1.5),
        serde_json::json!("64"),
    ] {
        let mut c = fixture_config();
        c["hidden_size"] = bad;
        assert!(ModelConfig::from_json_str(&c.to_string(), Path::new("config.json")).is_err());
    }
}

#[test]
fn absurd_config_with_real_weights_fails_cleanly() {
    // The fixture's weights with a config that claims far bigger sizes: the
    // load ends in an error, not an abort on a terabyte allocation.
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(fixture()).expect("fixture") {
        let p = entry.expect("entry").path();
        if let Some(name) = p.file_name() {
            std::fs::copy(&p, dir.path().join(name)).expect("copy");
        }
    }
    for (field, value) in [
        ("max_position_embeddings", 1u64 << 24),
        ("num_hidden_layers", 4096),
        ("num_local_experts", 65536),
        ("vocab_size", 1 << 24),
    ] {
        let mut c = fixture_config();
        c[field] = serde_json::json!(value);
        std::fs::write(dir.path().join("config.json"), c.to_string()).expect("write");
        // max_position_embeddings alone allocates nothing up front: fine to load.
        let r = epserve_core::engine::Engine::load(dir.path());
        if field != "max_position_embeddings" {
            assert!(r.is_err(), "{field} = {value}: loaded");
        }
    }
}

#[test]
fn tokenizer_garbage_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("binary", (0u8..=255).collect()),
        ("not an object", b"[1, 2, 3]".to_vec()),
        ("empty object", b"{}".to_vec()),
        (
            "model missing",
            br#"{"version": "1.0", "added_tokens": []}"#.to_vec(),
        ),
        (
            "unknown model type",
            br#"{"model": {"type": "Quantum", "vocab": {}}}"#.to_vec(),
        ),
        (
            "vocab id u32::MAX",
            br#"{"model": {"type": "WordLevel", "vocab": {"a": 4294967295}, "unk_token": "a"}}"#
                .to_vec(),
        ),
        (
            "merges referencing nothing",
            br#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["x y"]}}"#.to_vec(),
        ),
        ("deep nesting", deep.into_bytes()),
        ("invalid UTF-8", vec![b'{', 0xff, 0xfe, b'}']),
    ];
    for (name, bytes) in &cases {
        std::fs::write(dir.path().join("tokenizer.json"), bytes).expect("write");
        let r = std::panic::catch_unwind(|| Tokenizer::from_dir(dir.path()).map(|_| ()));
        match r {
            Err(_) => panic!("{name}: panicked"),
            Ok(Ok(())) => {
                // Some odd files are valid tokenizers; that is fine.
            }
            Ok(Err(e)) => assert!(e.to_string().contains("tokenizer"), "{name}: {e}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random bytes as a safetensors file: an error, never a panic.
    #[test]
    fn safetensors_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = open_weights(&bytes);
    }

    /// Plausible headers with random dtypes, shapes and offsets: either an
    /// error, or a store whose every tensor lies inside the file.
    #[test]
    fn safetensors_random_headers(
        dtype in prop::sample::select(vec!["F32", "BF16", "F16", "I8", "U8", "F64", "BOOL", "XX"]),
        shape in proptest::collection::vec(0u64..70_000, 0..4),
        begin in prop_oneof![0u64..64, any::<u64>()],
        len in prop_oneof![0u64..64, any::<u64>()],
        data_len in 0usize..128,
    ) {
        let shape: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        let header = format!(
            r#"{{"t": {{"dtype": "{dtype}", "shape": [{}], "data_offsets": [{begin}, {}]}}}}"#,
            shape.join(","),
            begin.wrapping_add(len)
        );
        let _ = open_weights(&st_file(&header, &vec![0u8; data_len]));
    }

    /// Any size field set to any value: a config or a clear error, quickly.
    #[test]
    fn config_random_sizes(
        field in prop::sample::select(vec![
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "moe_intermediate_size", "num_experts", "num_experts_per_tok", "sliding_window",
        ]),
        value in prop_oneof![0u64..10, 0u64..100_000, any::<u64>()],
    ) {
        let mut c = fixture_config();
        c[field] = serde_json::json!(value);
        let t0 = std::time::Instant::now();
        let _ = ModelConfig::from_json_str(&c.to_string(), Path::new("config.json"));
        prop_assert!(t0.elapsed() < std::time::Duration::from_secs(2));
    }

    /// Random JSON-ish text as config.json: never a panic.
    #[test]
    fn config_random_text(text in "\\PC{0,200}") {
        let _ = ModelConfig::from_json_str(&text, Path::new("config.json"));
    }
}

#[test]
fn every_fixture_config_is_within_the_caps() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let mut n = 0;
    for model in std::fs::read_dir(&root).expect("fixtures") {
        let model = model.expect("entry").path();
        for variant in ["bf16", "f32"] {
            let dir = model.join(variant);
            if dir.join("config.json").is_file() {
                let r = ModelConfig::from_dir(&dir);
                assert!(r.is_ok(), "{}: {:?}", dir.display(), r.err());
                n += 1;
            }
        }
    }
    assert!(n > 0);
}
