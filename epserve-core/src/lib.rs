//! epserve's core library: what every role shares. Layers, each depending only
//! on the ones above it in this list:
//!
//! - [`error`]: the one error type
//! - [`config`]: `config.json` → validated [`config::ModelConfig`]
//! - [`tensor`]: weights as the model reads them (mmapped or owned)
//! - [`loader`]: safetensors, where each architecture keeps its tensors,
//!   tokenizer and chat template, generation defaults
//! - [`mem`]: huge pages for the large buffers (packed weights, KV cache),
//!   glibc malloc tuned for a step's transient buffers
//! - [`kernels`]: linear, norms, activations; the MoE micro-kernels and their tiers
//! - [`moe`]: the MoE contracts (`Routing`, the `Dispatcher` and
//!   `ExpertExecutor` traits, `SKIP_SLOT`, `combine`, `top_k_indices`) and
//!   `GatedMlp`, what every expert is
//! - [`experts`]: the expert executors: packed bf16/int8 and the portable
//!   `LocalExperts`
//! - [`model`]: attention, router / shared expert / MoE block, the decoder
//! - [`sampling`]: logits → tokens
//! - [`engine`], [`detok`]: the generate loop, streaming detokenization
//! - [`profile`]: per-phase time of forward passes (`epserve bench step`)
//! - [`placement`], [`eplb`]: which worker holds which expert, and rebalancing it
#![deny(clippy::print_stdout)]

pub mod config;
pub mod detok;
pub mod engine;
pub mod eplb;
pub mod error;
pub mod experts;
pub mod kernels;
pub mod loader;
pub mod mem;
pub mod model;
pub mod moe;
pub mod placement;
pub mod profile;
pub mod sampling;
pub mod structured;
pub mod tensor;

pub use error::{Error, Result};
