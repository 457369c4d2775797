//! `dice model`: model folders and what runs them. `init` writes a deterministic checkpoint of
//! any config ([`dice_model::init`]); `kernels` compiles our CUDA kernels into the kernel cache
//! ([`dice_model::precompile_kernels`]).

use anyhow::{bail, Result};
use clap::{Args, Subcommand, ValueEnum};
use dice_model::init::{InitWeights, ModelInit};
use dice_model::{kernel_cache_folder, precompile_kernels, SdarConfig, KERNEL_CACHE_ENV};
use std::path::PathBuf;

#[derive(Subcommand)]
pub(crate) enum ModelCommand {
    /// Write a complete bf16 model folder of a config, with formula or seeded random weights.
    #[command(after_help = "\
Writes into OUT: config.json (CONFIG's architecture, torch_dtype bfloat16), the weights in bf16
as model.safetensors (past 4 GiB: Hugging Face shards model-0000N-of-0000M.safetensors and
model.safetensors.index.json), and the tokenizer files, chat_template.jinja and
generation_config.json found in TOKENIZER. Every file is written under a temporary name and
renamed into place. The folder loads like any checkpoint (dice generate --model OUT, dice serve).

Weights:
  formula  element i of tensor NAME comes from a hash of (NAME, i): the weights of the formula
           golden (tests/data/sdar/golden/formula/weights.json gives the formula and the
           checksums); the same for every run, on every machine
  random   normal(0, initializer_range) matrices and unit norm weights, as the reference
           initialises a model, from a counter-based generator seeded by --seed

Examples:
  dice model init --config tests/data/sdar/golden/formula/config.json --weights formula \\
      --tokenizer tests/data/sdar --out tiny/
  dice model init --config tests/data/sdar/configs/sdar-4b.json --weights random --seed 1 \\
      --tokenizer tests/data/sdar --out sdar-4b-random/")]
    Init(InitArgs),
    /// Compile our CUDA kernels for a GPU architecture into the kernel cache, ahead of the runs.
    #[command(after_help = "\
Every GPU command compiles the kernels it uses with NVRTC on first use and keeps the cubins in
the kernel cache: DICE_KERNEL_CACHE (a folder, or `off`), else $XDG_CACHE_HOME/dice/kernels,
else ~/.cache/dice/kernels. This command fills the cache ahead of time, on any machine with the
CUDA build of dice (NVRTC needs no GPU): the kernels of the decoding forward, the training layer
and AdamW, and the attention kernels for the head dims of the configs given. A folder filled
here and copied to a GPU machine's cache spares its first run the compilation.

Examples:
  dice model kernels --config tests/data/sdar/configs/sdar-1.7b.json --arch 9.0
  DICE_KERNEL_CACHE=carry/kernels dice model kernels --config sdar-4b.json --config sdar-8b.json")]
    Kernels(KernelsArgs),
}

#[derive(Args)]
pub(crate) struct KernelsArgs {
    /// A model config.json whose head dim the attention kernels are compiled for (repeatable).
    #[arg(long, value_name = "FILE", required = true)]
    pub config: Vec<PathBuf>,
    /// The GPU's compute capability, MAJOR.MINOR (9.0: H100 and H200; 8.0: A100).
    #[arg(long, value_name = "MAJOR.MINOR", default_value = "9.0", value_parser = parse_arch)]
    pub arch: (i32, i32),
}

fn parse_arch(s: &str) -> Result<(i32, i32), String> {
    s.split_once('.')
        .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)))
        .filter(|&(major, minor): &(i32, i32)| major >= 8 && (0..10).contains(&minor))
        .ok_or_else(|| {
            format!("{s} is not a compute capability of 8.0 or newer (9.0 for an H100 or H200)")
        })
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum WeightsArg {
    /// The formula golden's weights (a function of tensor name and element index).
    Formula,
    /// Normal(0, initializer_range) matrices and unit norm weights, seeded by --seed.
    Random,
}

#[derive(Args)]
pub(crate) struct InitArgs {
    /// The model's config.json (an SDAR config: model_type "sdar").
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Where the weights come from.
    #[arg(long, value_enum, value_name = "KIND")]
    pub weights: WeightsArg,
    /// Seed of --weights random [default: 0].
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// A folder with the tokenizer (tokenizer.json, or vocab.json + merges.txt +
    /// tokenizer_config.json), whose tokenizer, chat template and generation settings are copied.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: PathBuf,
    /// The model folder to write (created if needed; it must be empty unless --force).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Write into a folder that holds files already: the model's files are replaced, others kept.
    #[arg(long)]
    pub force: bool,
}

pub(crate) fn run(command: ModelCommand) -> Result<()> {
    match command {
        ModelCommand::Init(args) => init(args),
        ModelCommand::Kernels(args) => kernels(args),
    }
}

fn kernels(args: KernelsArgs) -> Result<()> {
    let mut head_dims = Vec::new();
    for path in &args.config {
        let head_dim = SdarConfig::from_path(path)?.head_dim;
        if !head_dims.contains(&head_dim) {
            head_dims.push(head_dim);
        }
    }
    let Some(folder) = kernel_cache_folder() else {
        bail!("{KERNEL_CACHE_ENV} is `off`: there is no kernel cache to fill");
    };
    for kernel in precompile_kernels(&head_dims, args.arch)? {
        let options: String = kernel.options.iter().map(|o| format!(" {o}")).collect();
        let state = if kernel.cached {
            "cached already"
        } else {
            "compiled"
        };
        println!("{}{options} ({}): {state}", kernel.what, kernel.target);
    }
    println!("kernel cache: {}", folder.display());
    Ok(())
}

fn init(args: InitArgs) -> Result<()> {
    let weights = match (args.weights, args.seed) {
        (WeightsArg::Formula, Some(_)) => {
            bail!("--seed applies to --weights random only (formula weights have no seed)")
        }
        (WeightsArg::Formula, None) => InitWeights::Formula,
        (WeightsArg::Random, seed) => InitWeights::Random {
            seed: seed.unwrap_or(0),
        },
    };
    let config = SdarConfig::from_path(&args.config)?;
    let written = ModelInit {
        tokenizer: Some(&args.tokenizer),
        overwrite: args.force,
        ..ModelInit::new(&config, weights)
    }
    .write(&args.out)?;
    println!(
        "wrote {} ({} parameters, {:.1} MB of bf16 weights): {}",
        args.out.display(),
        written.parameters,
        written.weight_bytes as f64 / 1e6,
        written.files.join(", ")
    );
    Ok(())
}
