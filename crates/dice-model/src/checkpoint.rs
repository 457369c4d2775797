//! Locating, validating and opening checkpoint weights: single or sharded safetensors
//! (memory-mapped, converted straight to the target device and dtype), trainable `Var`s, or
//! random weights built from a config alone.

use crate::config::SdarConfig;
use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};
use std::path::{Path, PathBuf};

/// The safetensors files of a checkpoint directory: the shards listed by
/// `model.safetensors.index.json` when it exists, else `model.safetensors`.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{} has no weight_map object", index.display()))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for shard in map.values() {
            let shard = shard.as_str().with_context(|| {
                format!("{}: weight_map values must be file names", index.display())
            })?;
            let path = dir.join(shard);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        for f in &files {
            if !f.exists() {
                bail!(
                    "shard {} listed in {} does not exist",
                    f.display(),
                    index.display()
                );
            }
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    bail!(
        "no model.safetensors or model.safetensors.index.json in {}",
        dir.display()
    )
}

/// Opens the checkpoint files memory-mapped and checks that every tensor the config needs is
/// present with the right shape and a supported dtype.
#[allow(unsafe_code)] // memory-mapped checkpoint files
fn open_checked(dir: &Path, config: &SdarConfig) -> Result<(Vec<PathBuf>, MmapedSafetensors)> {
    let files = safetensors_files(dir)?;
    // SAFETY: the files are mapped read-only; modifying them while the model is loaded is
    // outside what this program supports (the same contract as every mmap-based loader).
    let st = unsafe { MmapedSafetensors::multi(&files) }.with_context(|| {
        format!(
            "cannot memory-map the safetensors files of {}",
            dir.display()
        )
    })?;
    for (name, shape) in config.tensor_shapes() {
        let view = st.get(&name).map_err(|_| {
            anyhow::anyhow!("checkpoint {} is missing tensor {name}", dir.display())
        })?;
        if view.shape() != shape.as_slice() {
            bail!(
                "checkpoint {}: tensor {name} has shape {:?}, config.json implies {:?}",
                dir.display(),
                view.shape(),
                shape
            );
        }
        let dtype = DType::try_from(view.dtype()).ok();
        if !matches!(dtype, Some(DType::BF16 | DType::F16 | DType::F32)) {
            bail!(
                "checkpoint {}: tensor {name} has dtype {:?}; only bf16, fp16 and f32 are supported",
                dir.display(),
                view.dtype()
            );
        }
    }
    Ok((files, st))
}

/// A `VarBuilder` over the memory-mapped checkpoint: each tensor is read from the mapping and
/// converted on the target device to `dtype` when first requested (an 8B bf16 checkpoint
/// loaded in bf16 never passes through an f32 copy).
#[allow(unsafe_code)] // memory-mapped checkpoint files
pub fn mmaped_var_builder(
    dir: &Path,
    config: &SdarConfig,
    dtype: DType,
    device: &Device,
) -> Result<VarBuilder<'static>> {
    let (files, _) = open_checked(dir, config)?;
    // SAFETY: see `open_checked`.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device) }
        .with_context(|| format!("cannot open the weights of {}", dir.display()))?;
    Ok(vb)
}

/// Every checkpoint tensor copied into a trainable `Var` of `dtype` on `device`, keyed by its
/// checkpoint name, and a `VarBuilder` that hands those variables to the model.
pub fn trainable_var_builder(
    dir: &Path,
    config: &SdarConfig,
    dtype: DType,
    device: &Device,
) -> Result<(VarMap, VarBuilder<'static>)> {
    let (_, st) = open_checked(dir, config)?;
    let varmap = VarMap::new();
    {
        let mut data = varmap
            .data()
            .lock()
            .expect("a fresh VarMap is not poisoned");
        for (name, _) in config.tensor_shapes() {
            let tensor = st
                .load(&name, device)
                .and_then(|t| t.to_dtype(dtype))
                .with_context(|| format!("cannot load tensor {name} from {}", dir.display()))?;
            data.insert(name, Var::from_tensor(&tensor)?);
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    Ok((varmap, vb))
}

/// Random weights as HF initialises them (normal(0, std) matrices, unit norm weights),
/// generated on the device in slices of at most `CHUNK` elements so that no full-size f32 copy
/// of a large matrix exists (CUDA cannot draw bf16/fp16 normals directly).
struct RandomWeights {
    std: f64,
}

const CHUNK: usize = 1 << 24;

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        shape: Shape,
        _name: &str,
        _hints: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let dims = shape.dims();
        if dims.len() == 1 {
            return Tensor::ones(shape, dtype, device);
        }
        let row: usize = dims[1..].iter().product();
        let rows_per_chunk = (CHUNK / row.max(1)).max(1);
        let mut parts = Vec::new();
        let mut start = 0;
        while start < dims[0] {
            let rows = rows_per_chunk.min(dims[0] - start);
            let mut part_dims = dims.to_vec();
            part_dims[0] = rows;
            parts.push(Tensor::randn(0f32, self.std as f32, part_dims, device)?.to_dtype(dtype)?);
            start += rows;
        }
        Tensor::cat(&parts, 0)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights need a shape for {name}")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

/// A `VarBuilder` producing random weights with standard deviation `std` (HF uses
/// `initializer_range`, 0.02).
pub fn random_var_builder(std: f64, dtype: DType, device: &Device) -> VarBuilder<'static> {
    let backend: Box<dyn SimpleBackend> = Box::new(RandomWeights { std });
    VarBuilder::from_backend(backend, dtype, device.clone())
}
