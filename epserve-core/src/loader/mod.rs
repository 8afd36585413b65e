//! Reading a Hugging Face model folder: weights, where each architecture
//! keeps its tensors, tokenizer and chat template, generation defaults.

pub mod generation;
pub mod names;
pub mod progress;
pub mod tokenizer;
pub mod weights;
