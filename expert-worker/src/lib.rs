//! The expert-worker role: holds a subset of a model's experts and runs them
//! for the coordinator. The gRPC service, etcd registration and core pinning
//! arrive with the cluster work; what exists now is loading a chosen subset of
//! experts from a model folder into an executor.

use std::path::Path;

use epserve_core::Result;
use epserve_core::config::ModelConfig;
use epserve_core::loader::weights::WeightStore;
use epserve_core::model::moe::LocalExperts;

/// Loads the experts `(layer, expert)` for which `keep` holds from `dir`.
/// Expert weights stay memory-mapped; nothing else of the model is read.
pub fn load_experts(
    dir: &Path,
    keep: impl Fn(usize, usize) -> bool,
) -> Result<(ModelConfig, LocalExperts)> {
    let cfg = ModelConfig::from_dir(dir)?;
    let ws = WeightStore::open(dir)?;
    let experts = LocalExperts::load_filtered(&cfg, &ws, keep)?;
    Ok((cfg, experts))
}
