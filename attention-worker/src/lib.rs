//! The attention-worker role: will hold a tensor-parallel shard (a contiguous
//! range of heads) of every attention layer and its KV cache, serving the
//! coordinator over gRPC. Until the cluster work lands, attention runs in the
//! coordinator's process through `epserve_core::model::attention`.

/// The heads a shard `index` of `of` owns, or an error when the KV heads cannot
/// be split evenly (every shard must hold whole KV-head groups).
pub fn shard_heads(
    num_heads: usize,
    num_kv_heads: usize,
    index: usize,
    of: usize,
) -> Result<std::ops::Range<usize>, String> {
    if of == 0 || index >= of {
        return Err(format!("shard {index} of {of} does not exist"));
    }
    if num_kv_heads % of != 0 {
        return Err(format!(
            "{num_kv_heads} KV heads cannot be split evenly over {of} attention shards"
        ));
    }
    let per = num_heads / of;
    Ok(index * per..(index + 1) * per)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_whole_kv_groups() {
        assert_eq!(shard_heads(8, 4, 1, 2), Ok(4..8));
        assert!(shard_heads(8, 2, 0, 4).is_err());
        assert!(shard_heads(8, 2, 2, 2).is_err());
    }
}
