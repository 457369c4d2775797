//! `dice generate`: block-diffusion generation on this machine (a prompt file, or KernelBench
//! candidates for `dice eval`), or through an OpenAI-compatible endpoint. The flags map onto
//! `dice_engine`'s batch generation (`dice_pipeline` for KernelBench candidates).

use super::args::{candle_device, candle_devices, DTypeArg, EndpointArgs, SamplingArgs};
use anyhow::{ensure, Context, Result};
use clap::{Args, ValueEnum};
use dice_engine::{
    default_stop_ids, generate_samples, Answer, DecodeParams, DecodeSettings, Generator,
    LocalEngines, Overflow, PromptStyle, SdarDecoder, Strategy, TextCodec,
};
use dice_eval::Device;
use dice_pipeline::{generate_candidates, CandidateRun, Progress};
use indicatif::ProgressBar;
use serde_json::json;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Decoding settings; the defaults are DICE's KernelBench evaluation (spec §4.7).
#[derive(Args, Clone, Debug)]
pub(crate) struct DecodeArgs {
    /// Remasking strategy: which masked positions of a block take their token in a step.
    #[arg(long, value_enum, default_value_t = Strategy::LowConfidenceStatic)]
    pub strategy: Strategy,
    /// Tokens per diffusion block.
    #[arg(long, default_value_t = 4)]
    pub block_length: usize,
    /// Denoising steps per block.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Threshold of low_confidence_dynamic (confidence) or entropy_bounded (entropy bound), in
    /// place of the strategy's default (see --strategy); the other strategies ignore it.
    #[arg(long)]
    pub threshold: Option<f32>,
    /// Generation ends with the block holding the N-th new token.
    #[arg(long, default_value_t = 4096)]
    pub max_new_tokens: usize,
    /// Cut the output to exactly --max-new-tokens tokens.
    #[arg(long)]
    pub exact_max: bool,
    /// Never stop before the token limit (DICE's evaluation does this).
    #[arg(long, conflicts_with = "stop_ids")]
    pub no_stop: bool,
    /// Stop ids (comma-separated), e.g. 151643 as in RL rollouts; default: the eos ids of the
    /// model folder's generation_config.json.
    #[arg(long, value_delimiter = ',')]
    pub stop_ids: Vec<u32>,
    /// Seed of the first sample; sample i uses seed + i.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Reproduce the reference when a step's schedule exceeds the masks left (it rewrites the
    /// lowest unmasked positions, prompt tokens included) instead of unmasking what is left.
    #[arg(long)]
    pub reference_overflow: bool,
}

impl DecodeArgs {
    /// The decoding parameters; stop ids default to the model folder's eos ids.
    pub(crate) fn params(&self, model_dir: Option<&Path>) -> Result<DecodeParams> {
        let stop_ids = if self.no_stop {
            Vec::new()
        } else if !self.stop_ids.is_empty() {
            self.stop_ids.clone()
        } else {
            match model_dir {
                Some(dir) => default_stop_ids(dir)?,
                None => Vec::new(),
            }
        };
        let settings = DecodeSettings {
            strategy: Some(self.strategy),
            threshold: self.threshold,
            block_length: Some(self.block_length),
            steps: Some(self.steps),
            temperature: Some(self.sampling.temperature),
            top_k: Some(self.sampling.top_k),
            top_p: Some(self.sampling.top_p),
            max_new_tokens: Some(self.max_new_tokens),
            exact_max: Some(self.exact_max),
            stop_ids: Some(stop_ids),
            seed: Some(self.seed),
            overflow: Some(if self.reference_overflow {
                Overflow::Reference
            } else {
                Overflow::Clamp
            }),
        };
        settings.over(&DecodeParams::dice_eval(self.max_new_tokens))
    }
}

/// Where the model runs.
#[derive(Args, Clone, Debug)]
pub(crate) struct RuntimeArgs {
    /// Where the model runs; cuda needs a binary built with `--features cuda`.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Compute dtype (DICE's evaluation used fp16, RL rollouts bf16).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DTypeArg,
    /// Sequences decoded at once (per engine).
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
}

/// How many engines decode a batch job, and where.
#[derive(Args, Clone, Debug)]
pub(crate) struct EngineArgs {
    /// Decoding engines, each with its own copy of the model, dealt requests in turn [default:
    /// one per visible GPU with --device cuda, one on the CPU]. More engines than GPUs share the
    /// GPUs in turn. Outputs do not depend on it: every request decodes with its own seed.
    #[arg(long, value_name = "N")]
    pub engines: Option<usize>,
}

impl RuntimeArgs {
    /// The model of `dir` set up for `block_length`, with its tokenizer and chat template.
    pub(crate) fn load(&self, dir: &Path, block_length: usize) -> Result<(SdarDecoder, TextCodec)> {
        let model = SdarDecoder::load(
            dir,
            self.dtype.dtype(),
            &candle_device(self.device)?,
            block_length,
        )?;
        Ok((model, TextCodec::from_dir(dir)?))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
pub(crate) enum OutputFormat {
    Json,
    Text,
}

/// What answers the prompts: a model folder on this machine or an OpenAI-compatible endpoint.
#[derive(Args, Clone, Debug)]
pub(crate) struct ModelSourceArgs {
    /// Model folder (config.json, safetensors, tokenizer files); or --endpoint instead.
    #[arg(
        long,
        required_unless_present = "endpoint",
        conflicts_with = "endpoint"
    )]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub api: EndpointArgs,
}

#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub source: ModelSourceArgs,
    /// File holding the user message (rendered with the chat template), read as is.
    #[arg(
        long,
        conflicts_with = "kernelbench",
        required_unless_present = "kernelbench"
    )]
    pub prompt_file: Option<PathBuf>,
    /// The prompt file is the whole prompt text, used without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// KernelBench folder: generate candidates for `dice eval` with the one-shot prompt.
    #[arg(long, requires_all = ["level", "run"])]
    pub kernelbench: Option<PathBuf>,
    /// KernelBench level (1-4).
    #[arg(long)]
    pub level: Option<u32>,
    /// Problem ids, e.g. `1-100` or `1,5,7-9` (default: all of the level).
    #[arg(long)]
    pub problems: Option<String>,
    /// Run folder; candidates go to RUN/candidates.jsonl (what is there already is skipped).
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// json: {"samples": [{token_ids, text, trace, finish_reason}]}; text: the texts only.
    #[arg(long, value_enum, default_value = "json")]
    pub format: OutputFormat,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub engines: EngineArgs,
}

pub(crate) fn run(a: GenerateArgs) -> Result<()> {
    ensure!(a.samples > 0, "--samples must be at least 1");
    let params = a.decode.params(a.source.model.as_deref())?;
    let generator = a.source.generator(&a.runtime, &a.engines)?;
    let Some(dir) = &a.kernelbench else {
        ensure!(a.run.is_none(), "--run applies to --kernelbench generation");
        let path = a
            .prompt_file
            .as_deref()
            .context("give --prompt-file or --kernelbench")?;
        let style = if a.raw {
            PromptStyle::Raw
        } else {
            PromptStyle::Chat
        };
        let answers = generate_samples(&generator, &params, style, &read_prompt(path)?, a.samples)?;
        return print_answers(&answers, a.format);
    };
    ensure!(!a.raw, "--raw applies to --prompt-file only");
    let run = CandidateRun {
        kernelbench: dir.clone(),
        level: a.level.context("--kernelbench needs --level")?,
        problems: a.problems.as_deref().map(parse_ids).transpose()?,
        samples: u32::try_from(a.samples).context("--samples is too large")?,
        run: a.run.clone().context("--kernelbench needs --run")?,
    };
    let progress = ProgressBar::no_length();
    generate_candidates(&generator, &params, &run, |event| match event {
        Progress::Planned(0) => {
            eprintln!("nothing to generate: every candidate is already in the run folder");
        }
        Progress::Planned(count) => progress.set_length(count as u64),
        Progress::Stored => progress.inc(1),
    })?;
    progress.finish();
    Ok(())
}

impl ModelSourceArgs {
    /// The local engines, or the endpoint, the flags name.
    pub(crate) fn generator(
        &self,
        runtime: &RuntimeArgs,
        engines: &EngineArgs,
    ) -> Result<Generator> {
        if let Some(endpoint) = self.api.generator()? {
            return Ok(endpoint);
        }
        let model_dir = self
            .model
            .clone()
            .context("--model is required without --endpoint")?;
        Ok(Generator::Local(LocalEngines {
            model_dir,
            dtype: runtime.dtype.dtype(),
            devices: candle_devices(runtime.device)?,
            engines: engines.engines,
            max_batch: runtime.max_batch,
        }))
    }

    /// What reports call the model: the endpoint's model name, or the model folder's name.
    pub(crate) fn name(&self) -> Result<String> {
        if self.api.endpoint.is_some() {
            return Ok(self.api.model_name()?.to_string());
        }
        let dir = self
            .model
            .as_deref()
            .context("--model is required without --endpoint")?;
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        Ok(dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        ))
    }
}

fn read_prompt(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read the prompt file {}", path.display()))?;
    String::from_utf8(bytes)
        .with_context(|| format!("the prompt file {} is not UTF-8 text", path.display()))
}

fn print_answers(answers: &[Answer], format: OutputFormat) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match format {
        OutputFormat::Json => writeln!(out, "{}", json!({ "samples": answers }))?,
        OutputFormat::Text => {
            for answer in answers {
                writeln!(out, "{}", answer.text)?;
            }
        }
    }
    Ok(())
}

/// `1-100`, `3`, `1,5,7-9`.
pub(crate) fn parse_ids(spec: &str) -> Result<BTreeSet<u32>> {
    let mut ids = BTreeSet::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("`{part}` in --problems is not an id or a range like 1-100");
        match part.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi): (u32, u32) = (
                    lo.trim().parse().with_context(bad)?,
                    hi.trim().parse().with_context(bad)?,
                );
                ensure!(lo <= hi, "range `{part}` in --problems is empty");
                ids.extend(lo..=hi);
            }
            None => {
                ids.insert(part.parse().with_context(bad)?);
            }
        }
    }
    ensure!(!ids.is_empty(), "--problems names no problem");
    Ok(ids)
}
