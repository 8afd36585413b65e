//! `generation_config.json`: end-of-sequence ids and sampling defaults.

use std::path::Path;

use serde::Deserialize;

use crate::config::raw::OneOrMany;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Default, Deserialize)]
struct Raw {
    bos_token_id: Option<OneOrMany>,
    eos_token_id: Option<OneOrMany>,
    do_sample: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    max_new_tokens: Option<usize>,
}

/// Generation defaults a model folder ships.
#[derive(Debug, Clone, Default)]
pub struct GenerationConfig {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub do_sample: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<usize>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` if present (absent → defaults).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let raw: Raw = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(GenerationConfig {
            bos_token_id: raw.bos_token_id.and_then(|b| b.to_vec().first().copied()),
            eos_token_ids: raw.eos_token_id.map(|e| e.to_vec()).unwrap_or_default(),
            do_sample: raw.do_sample.unwrap_or(false),
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k,
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
            max_new_tokens: raw.max_new_tokens,
        })
    }
}
