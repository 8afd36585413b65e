//! Reading a Hugging Face model folder: weights, tokenizer and chat template,
//! generation defaults.

pub mod generation;
pub mod tokenizer;
pub mod weights;
