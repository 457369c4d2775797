//! Deterministic checkpoints of any [`SdarConfig`], written as a complete model folder in bf16
//! (what `dice model init` does): `config.json`, the weights as `model.safetensors` (or, past
//! [`DEFAULT_MAX_SHARD_BYTES`], Hugging Face shards `model-0000N-of-0000M.safetensors` with
//! `model.safetensors.index.json`), and the tokenizer files, chat template and
//! `generation_config.json` of a tokenizer folder. The folder loads like any checkpoint
//! ([`crate::Sdar::load`]).
//!
//! Two weight sources, both functions of (tensor name, element index) only, so a tensor does not
//! depend on the shards, the threads or the other tensors:
//!
//! - [`InitWeights::Formula`]: the weights of the formula golden
//!   (`tests/data/sdar/golden/formula/weights.json`, bit exact). For element `i` (row-major, from
//!   0) of the tensor named NAME: `h` = FNV-1a 64 of NAME; `z` = the SplitMix64 finaliser of
//!   `h + (i + 1)·γ` (wrapping, `γ = 0x9E3779B97F4A7C15`); `u = z >> 40`;
//!   `t = (2u − (2²⁴ − 1)) / 2²⁴`; keys ending in `norm.weight` get `1 + 0.17·t`, every other
//!   key `0.27·t` (f64, no fused multiply-add), rounded to f32 and then to bf16, both to nearest
//!   even.
//! - [`InitWeights::Random`]: the reference's initialisation, matrices normal(0,
//!   `initializer_range`) and norm weights exactly 1, drawn by a counter-based generator: with
//!   `k` = FNV-1a 64 of NAME xor the first SplitMix64 output of the seed, element `i` is the
//!   Box–Muller normal `√(−2 ln u₁)·cos(2π u₂)` of `u₁ = ((a >> 11) + 1)·2⁻⁵³` and
//!   `u₂ = (b >> 11)·2⁻⁵³`, where `a` and `b` are the SplitMix64 finalisers of
//!   `k + (2i + 1)·γ` and `k + (2i + 2)·γ`. The same seed gives the same weights on a given
//!   platform (`ln` and `cos` come from its math library; bf16 rounding hides their last bits in
//!   all but rare elements).
//!
//! Every file is written under a temporary name in the folder and renamed into place, so a
//! reader sees either the old file or the complete new one.

use crate::config::SdarConfig;
use crate::shards::{write_atomically, write_weights, IndexFile, StoredDType, StoredTensor};
use crate::tokenizer::SdarTokenizer;
use anyhow::{bail, Context, Result};
use half::bf16;
use std::io::Write;
use std::path::Path;

/// Shards start past this many bytes of weights (4 GiB), as Hugging Face checkpoints do.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 4 << 30;

/// The files of a tokenizer folder that a model folder carries: the tokenizer (fast
/// `tokenizer.json` or the vocab + merges it is rebuilt from), the chat template and the
/// generation settings. Those absent from the tokenizer folder are skipped.
pub const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
];

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const NORM_SCALE: f64 = 0.17;
const OTHER_SCALE: f64 = 0.27;

/// Elements generated per buffer while a tensor is written (64 MiB of bf16).
const CHUNK_ELEMENTS: usize = 1 << 25;

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET_BASIS, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// The SplitMix64 finaliser (Steele, Lea and Flood's `mix64` variant 13).
pub fn splitmix64_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The formula's `z` for element `i` of the tensor whose name hashes to `name_hash`; the golden
/// also picks its logit columns with it (`z("logit_columns", j) mod vocab`).
pub fn formula_z(name_hash: u64, i: u64) -> u64 {
    splitmix64_mix(name_hash.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)))
}

/// Where the weights of a new checkpoint come from (module docs: the exact definitions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitWeights {
    /// The formula golden's weights.
    Formula,
    /// Normal(0, `initializer_range`) matrices and unit norm weights, from a seeded
    /// counter-based generator.
    Random { seed: u64 },
}

/// The values of one tensor: element `i` is a function of the tensor's name and `i` alone.
#[derive(Debug, Clone, Copy)]
pub struct TensorValues {
    weights: InitWeights,
    name_hash: u64,
    norm: bool,
    std: f64,
}

impl TensorValues {
    /// The values of tensor `name` of a checkpoint of `config`.
    pub fn new(weights: InitWeights, config: &SdarConfig, name: &str) -> Self {
        let name_hash = fnv1a64(name.as_bytes());
        Self {
            weights,
            name_hash: match weights {
                InitWeights::Formula => name_hash,
                InitWeights::Random { seed } => {
                    name_hash ^ splitmix64_mix(seed.wrapping_add(GOLDEN_GAMMA))
                }
            },
            norm: name.ends_with("norm.weight"),
            std: config.initializer_range,
        }
    }

    /// Element `i` (row-major).
    pub fn element(&self, i: u64) -> bf16 {
        let value = match self.weights {
            InitWeights::Formula => {
                let u = (formula_z(self.name_hash, i) >> 40) as i64;
                let t = (2 * u - ((1 << 24) - 1)) as f64 / (1u64 << 24) as f64;
                if self.norm {
                    1.0 + NORM_SCALE * t
                } else {
                    OTHER_SCALE * t
                }
            }
            InitWeights::Random { .. } if self.norm => 1.0,
            InitWeights::Random { .. } => {
                let draw = |k: u64| formula_z(self.name_hash, 2 * i + k) >> 11;
                let u1 = (draw(0) + 1) as f64 / (1u64 << 53) as f64;
                let u2 = draw(1) as f64 / (1u64 << 53) as f64;
                self.std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
            }
        };
        bf16::from_f32(value as f32)
    }

    /// Elements `first..first + out.len()`, computed on every core.
    pub fn fill(&self, first: u64, out: &mut [bf16]) {
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let per_thread = out.len().div_ceil(threads).max(1 << 16);
        std::thread::scope(|scope| {
            for (part, values) in out.chunks_mut(per_thread).enumerate() {
                let start = first + (part * per_thread) as u64;
                scope.spawn(move || {
                    for (i, v) in (start..).zip(values.iter_mut()) {
                        *v = self.element(i);
                    }
                });
            }
        });
    }
}

/// A checkpoint to write: the model's shapes, its weights and what goes beside them.
#[derive(Debug, Clone)]
pub struct ModelInit<'a> {
    pub config: &'a SdarConfig,
    pub weights: InitWeights,
    /// The folder whose [`TOKENIZER_FILES`] are copied; without one the model folder holds only
    /// the config and the weights (enough for every forward, not for text).
    pub tokenizer: Option<&'a Path>,
    /// Weights past this many bytes are split into shards.
    pub max_shard_bytes: u64,
    /// Write into a folder that already holds files (replacing the model's files, leaving the
    /// others); otherwise such a folder is refused.
    pub overwrite: bool,
}

/// What [`ModelInit::write`] wrote.
#[derive(Debug, Clone)]
pub struct WrittenModel {
    /// Every file written, relative to the model folder.
    pub files: Vec<String>,
    /// Bytes of the weight files, headers included.
    pub weight_bytes: u64,
    pub parameters: usize,
}

impl<'a> ModelInit<'a> {
    /// A single-file (up to 4 GiB) checkpoint of `config` that refuses a non-empty folder.
    pub fn new(config: &'a SdarConfig, weights: InitWeights) -> Self {
        Self {
            config,
            weights,
            tokenizer: None,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            overwrite: false,
        }
    }

    /// Writes the model folder `out` (created if needed).
    pub fn write(&self, out: &Path) -> Result<WrittenModel> {
        self.config.validate()?;
        if !self.overwrite && folder_has_entries(out)? {
            bail!(
                "{} is not empty: choose a new folder, or overwrite its model files (dice model init --force)",
                out.display()
            );
        }
        if let Some(dir) = self.tokenizer {
            SdarTokenizer::from_dir(dir)
                .with_context(|| format!("{} is not a usable tokenizer folder", dir.display()))?;
        }
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;

        let tensors: Vec<StoredTensor> = self
            .config
            .tensor_shapes()
            .into_iter()
            .map(|(name, shape)| StoredTensor {
                name,
                shape,
                dtype: StoredDType::BF16,
            })
            .collect();
        let weights = write_weights(
            out,
            &tensors,
            self.max_shard_bytes,
            IndexFile::WhenSharded,
            |tensor, w| self.write_values(tensor, w),
        )?;
        let mut files = weights.files;

        let mut config = serde_json::to_value(self.config)?;
        config["torch_dtype"] = "bfloat16".into();
        write_atomically(&out.join("config.json"), |w| {
            serde_json::to_writer_pretty(&mut *w, &config)?;
            writeln!(w)?;
            Ok(())
        })?;
        files.push("config.json".to_string());

        if let Some(dir) = self.tokenizer {
            files.extend(copy_tokenizer_files(dir, out)?);
        }
        Ok(WrittenModel {
            files,
            weight_bytes: weights.bytes,
            parameters: self.config.num_parameters(),
        })
    }

    /// The bf16 little-endian bytes of one tensor, generated a chunk at a time.
    fn write_values(&self, tensor: &StoredTensor, w: &mut dyn Write) -> Result<()> {
        let source = TensorValues::new(self.weights, self.config, &tensor.name);
        let len = tensor.shape.iter().product::<usize>() as u64;
        let mut values = vec![bf16::ZERO; (len as usize).min(CHUNK_ELEMENTS)];
        let mut bytes = Vec::with_capacity(2 * values.len());
        let mut first = 0;
        while first < len {
            let chunk = &mut values[..(len - first).min(CHUNK_ELEMENTS as u64) as usize];
            source.fill(first, chunk);
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            w.write_all(&bytes)?;
            first += chunk.len() as u64;
        }
        Ok(())
    }
}

/// Copies the [`TOKENIZER_FILES`] that `from` has into `to`, each renamed into place; returns
/// their names.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let source = from.join(name);
        if !source.exists() {
            continue;
        }
        let bytes =
            std::fs::read(&source).with_context(|| format!("cannot read {}", source.display()))?;
        write_atomically(&to.join(name), |w| Ok(w.write_all(&bytes)?))?;
        copied.push(name.to_string());
    }
    Ok(copied)
}

fn folder_has_entries(dir: &Path) -> Result<bool> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", dir.display())),
    }
}
