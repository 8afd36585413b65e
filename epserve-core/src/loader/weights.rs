//! Safetensors loading: a single `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped; tensors are handed out as
//! [`Weight`] windows into the mapping, checked against the expected shape.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::tensor::{DType, SharedMmap, Weight};

struct Entry {
    file: usize,
    dtype: std::result::Result<DType, String>,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// A channel-wise int8 matrix `[rows, cols]` with one scale per row:
/// `W[r, c] ≈ data[r·cols + c] · scales[r]`.
#[derive(Debug, Clone)]
pub struct I8Matrix {
    pub data: Vec<i8>,
    pub scales: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl I8Matrix {
    /// Row `r`'s int8 values.
    pub fn row(&self, r: usize) -> &[i8] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// `q · scale`, row-major f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.data.len());
        for r in 0..self.rows {
            let s = self.scales[r];
            v.extend(self.row(r).iter().map(|&q| q as f32 * s));
        }
        v
    }
}

/// All tensors of a model folder, by name.
pub struct WeightStore {
    dir: PathBuf,
    files: Vec<(PathBuf, SharedMmap)>,
    entries: HashMap<String, Entry>,
}

#[derive(Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

impl WeightStore {
    /// Opens and maps every safetensors file of the model folder `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let names: Vec<String> = if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let idx: Index = serde_json::from_str(&text).map_err(|e| Error::Json {
                path: index_path.clone(),
                message: e.to_string(),
            })?;
            let set: BTreeSet<String> = idx.weight_map.into_values().collect();
            set.into_iter().collect()
        } else if single.is_file() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(Error::MissingFile {
                path: single,
                what: "weights: model.safetensors or model.safetensors.index.json",
            });
        };
        let mut store = WeightStore {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            entries: HashMap::new(),
        };
        for name in names {
            if name.contains('/') || name.contains("..") {
                return Err(Error::config(
                    &index_path,
                    format!("weight file name '{name}' escapes the model folder"),
                ));
            }
            store.add_file(&dir.join(&name))?;
        }
        Ok(store)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        if !path.is_file() {
            return Err(Error::MissingFile {
                path: path.to_path_buf(),
                what: "weight shard listed in model.safetensors.index.json",
            });
        }
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only and the model files are not expected
        // to change while the server runs (as in every mmap-based loader); a
        // concurrent truncation would be an operator error, not memory we write.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let shared = SharedMmap::new(mmap);
        let st = SafeTensors::deserialize(shared.bytes()).map_err(|e| Error::CorruptWeights {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        // The header is checked by the safetensors crate (size, JSON, offsets
        // contiguous and inside the file, shape × dtype = bytes); check again
        // here what this store relies on, so that a hostile file can only
        // ever be an error.
        let file_len = shared.bytes().len();
        let base = shared.bytes().as_ptr() as usize;
        let file_idx = self.files.len();
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                StDtype::F32 => Ok(DType::F32),
                StDtype::BF16 => Ok(DType::BF16),
                StDtype::F16 => Ok(DType::F16),
                other => Err(format!("{other:?}")),
            };
            let data = view.data();
            let elems = view
                .shape()
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d));
            let offset = (data.as_ptr() as usize).wrapping_sub(base);
            if elems.is_none() || offset > file_len || data.len() > file_len - offset {
                return Err(Error::CorruptWeights {
                    path: path.to_path_buf(),
                    message: format!("tensor '{name}': shape or offsets out of range"),
                });
            }
            self.entries.insert(
                name,
                Entry {
                    file: file_idx,
                    dtype,
                    shape: view.shape().to_vec(),
                    offset,
                    len: data.len(),
                },
            );
        }
        super::progress::file_mapped(file_len as u64);
        self.files.push((path.to_path_buf(), shared));
        Ok(())
    }

    /// Bytes of all weight files mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.files.iter().map(|(_, m)| m.bytes().len() as u64).sum()
    }

    /// The model folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Names of all tensors (sorted), for diagnostics.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Shape of a tensor, if present.
    pub fn shape_of(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// The entry of `name`, its file and mapping, checked against `shape`.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<(&Entry, &PathBuf, &SharedMmap)> {
        let e = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            dir: self.dir.clone(),
            tensor: name.to_string(),
        })?;
        let (path, map) = &self.files[e.file];
        if e.shape != shape {
            return Err(Error::ShapeMismatch {
                path: path.clone(),
                tensor: name.to_string(),
                actual: e.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok((e, path, map))
    }

    /// A tensor with the given shape, or an error naming the file and tensor.
    /// Channel-wise int8 weights (compressed-tensors W8A8 checkpoints) come
    /// back dequantized to f32 (`q · scale`); the expert loader takes them as
    /// int8 instead ([`get_i8_channelwise`](Self::get_i8_channelwise)).
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        let (e, path, map) = self.entry(name, shape)?;
        if matches!(&e.dtype, Err(d) if d == "I8")
            && let Some(m) = self.get_i8_channelwise(name, shape)?
        {
            return Ok(Weight::from_f32(shape.to_vec(), &m.dequantize()));
        }
        let dtype = e.dtype.clone().map_err(|d| Error::UnsupportedDtype {
            path: path.clone(),
            tensor: name.to_string(),
            dtype: d,
        })?;
        Ok(Weight::from_mmap(
            map,
            dtype,
            e.shape.clone(),
            e.offset,
            e.len,
        ))
    }

    /// A channel-wise int8 matrix as compressed-tensors stores it: an `I8`
    /// tensor `name` (`…weight`, `[out, in]`) beside an f32/bf16/f16
    /// `…weight_scale` of shape `[out, 1]` or `[out]` (symmetric: no zero
    /// point). `Ok(None)` when `name` is a float tensor; an error naming the
    /// tensor for any other int8 layout. `-128` is clamped to `-127` (the int8
    /// kernels' symmetric range; at most one quantization step).
    pub fn get_i8_channelwise(&self, name: &str, shape: &[usize]) -> Result<Option<I8Matrix>> {
        let (e, path, map) = self.entry(name, shape)?;
        match &e.dtype {
            Ok(_) => return Ok(None),
            Err(d) if d == "I8" => {}
            Err(d) => {
                return Err(Error::UnsupportedDtype {
                    path: path.clone(),
                    tensor: name.to_string(),
                    dtype: d.clone(),
                });
            }
        }
        let bad = |why: String| Error::UnsupportedDtype {
            path: path.clone(),
            tensor: name.to_string(),
            dtype: format!(
                "I8 ({why}; only compressed-tensors channel-wise symmetric int8 is supported)"
            ),
        };
        let stem = name
            .strip_suffix("weight")
            .filter(|_| shape.len() == 2)
            .ok_or_else(|| bad("not a 2-D `weight`".into()))?;
        if self.contains(&format!("{stem}weight_zero_point")) {
            return Err(bad("asymmetric: has a weight_zero_point".into()));
        }
        let sname = format!("{stem}weight_scale");
        let sshape = self
            .shape_of(&sname)
            .ok_or_else(|| bad(format!("no {sname}")))?
            .to_vec();
        if sshape != [shape[0], 1] && sshape != [shape[0]] {
            return Err(bad(format!(
                "{sname} has shape {sshape:?}, expected [{}, 1] (one scale per output channel)",
                shape[0]
            )));
        }
        let scales = self.get(&sname, &sshape)?.to_f32_vec();
        if let Some(s) = scales.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
            return Err(bad(format!("{sname} holds {s}")));
        }
        let raw = &map.bytes()[e.offset..e.offset + e.len];
        Ok(Some(I8Matrix {
            data: raw.iter().map(|&b| (b as i8).max(-127)).collect(),
            scales,
            rows: shape[0],
            cols: shape[1],
        }))
    }

    /// A 1-D tensor converted to f32 (norm weights, biases).
    pub fn get_vec(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.get(name, &[len])?.to_f32_vec())
    }

    /// The raw bytes of a `U8` tensor of the given shape (MXFP4 blocks and scales).
    pub fn get_u8(&self, name: &str, shape: &[usize]) -> Result<&[u8]> {
        let (e, path, map) = self.entry(name, shape)?;
        match &e.dtype {
            Err(d) if d == "U8" || d == "I8" => Ok(&map.bytes()[e.offset..e.offset + e.len]),
            other => Err(Error::UnsupportedDtype {
                path: path.clone(),
                tensor: name.to_string(),
                dtype: match other {
                    Ok(d) => format!("{d:?} (expected U8)"),
                    Err(d) => format!("{d} (expected U8)"),
                },
            }),
        }
    }

    /// Like [`get`](Self::get) but `None` when the tensor is absent.
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Weight>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}
