//! `config.json` of an SDAR / DICE checkpoint (spec §1).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The architecture fields of an SDAR `config.json`. Unknown keys are ignored; the class
/// defaults of the Python `SDARConfig` are deliberately NOT reproduced (spec §1: always read
/// the file), so every shape-defining field is required.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct SdarConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Diffusion block length; absent in some original HF configs (spec §1), 4 for every DICE model.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// Id of `<|MASK|>`; absent in some original HF configs, 151669 for every DICE model.
    #[serde(default = "default_mask_token_id")]
    pub mask_token_id: u32,
    /// Standard deviation of random initial weights.
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

fn default_hidden_act() -> String {
    "silu".to_string()
}

fn default_initializer_range() -> f64 {
    0.02
}

fn default_block_size() -> usize {
    4
}

fn default_mask_token_id() -> u32 {
    151669
}

impl SdarConfig {
    /// Reads and validates `config.json` (a file, or a checkpoint directory containing it).
    pub fn from_path(path: &Path) -> Result<Self> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read model config {}", file.display()))?;
        let config: Self = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid SDAR config.json", file.display()))?;
        config
            .validate()
            .with_context(|| format!("unsupported model config {}", file.display()))?;
        Ok(config)
    }

    /// Rejects anything this implementation does not compute exactly.
    pub fn validate(&self) -> Result<()> {
        if self.model_type != "sdar" {
            bail!(
                "model_type is {:?}, expected \"sdar\" (only SDAR / DICE block-diffusion checkpoints are supported)",
                self.model_type
            );
        }
        if self.hidden_act != "silu" {
            bail!(
                "hidden_act {:?} is not supported (only silu)",
                self.hidden_act
            );
        }
        if self.attention_bias {
            bail!("attention_bias = true is not supported (SDAR has no projection biases)");
        }
        if self.use_sliding_window {
            bail!("use_sliding_window = true is not supported");
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            bail!("rope_scaling is not supported (SDAR uses plain RoPE, rope_scaling: null)");
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "head_dim {} must be even for rotary embeddings",
                self.head_dim
            );
        }
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if self.block_size == 0 {
            bail!("block_size must be positive");
        }
        Ok(())
    }

    /// Width of the concatenated query heads (`Nq` in spec §1.1; not necessarily `hidden_size`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads (`Nkv`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Every checkpoint tensor with its shape, in the order of spec §1.1.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            shapes.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (
                    format!("{p}.self_attn.q_proj.weight"),
                    vec![self.q_dim(), h],
                ),
                (
                    format!("{p}.self_attn.k_proj.weight"),
                    vec![self.kv_dim(), h],
                ),
                (
                    format!("{p}.self_attn.v_proj.weight"),
                    vec![self.kv_dim(), h],
                ),
                (format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]),
                (format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]),
                (
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![h, self.q_dim()],
                ),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        shapes.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            shapes.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        shapes
    }

    /// Number of parameters of the model, computed from the shapes alone.
    pub fn num_parameters(&self) -> usize {
        self.tensor_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}
