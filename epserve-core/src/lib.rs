//! epserve's core library: what every role shares. Layers, each depending only
//! on the ones above it in this list:
//!
//! - [`config`]: `config.json` → validated [`config::ModelConfig`]
//! - [`tensor`], [`loader`]: memory-mapped safetensors, tokenizer, chat template
//! - [`kernels`]: linear, norms, activations; the MoE micro-kernels and their tiers
//! - [`experts`]: packed bf16/int8 experts and the fast expert executor
//! - [`model`]: attention, router / experts / combine, the decoder
//! - [`sampling`], [`engine`]: logits → tokens, the generate loop

pub mod config;
pub mod detok;
pub mod engine;
pub mod eplb;
pub mod error;
pub mod experts;
pub mod kernels;
pub mod loader;
pub mod model;
pub mod placement;
pub mod sampling;
pub mod tensor;

pub use error::{Error, Result};
