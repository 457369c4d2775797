//! `dice generate`: block-diffusion generation on this machine (a prompt file, or KernelBench
//! candidates for `dice eval`), or through an OpenAI-compatible endpoint.

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use dice_bench::{prompt::problem_prompt, KernelBench};
use dice_engine::{
    default_stop_ids, ApiAnswer, ApiClient, Completion, CompletionSettings, DecodeParams, Engine,
    EngineConfig, Event, Overflow, Request, SamplingParams, SdarDecoder, Strategy, TextCodec,
};
use dice_model::chat::ChatMessage;
use indicatif::ProgressBar;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;

/// Decoding settings; the defaults are DICE's KernelBench evaluation (spec §4.7).
#[derive(Args, Clone, Debug)]
pub struct DecodeArgs {
    /// Remasking strategy: low_confidence_static, low_confidence_dynamic, sequential or entropy_bounded.
    #[arg(long, default_value = "low_confidence_static")]
    pub strategy: String,
    /// Tokens per diffusion block.
    #[arg(long, default_value_t = 4)]
    pub block_length: usize,
    /// Denoising steps per block.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Keep the k most likely tokens (1 = greedy, 0 = all).
    #[arg(long, default_value_t = 1)]
    pub top_k: usize,
    /// Logits are divided by this before sampling.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Confidence threshold of low_confidence_dynamic (default 0.9) or entropy bound of
    /// entropy_bounded (default 0.35).
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
    pub fn params(&self, model_dir: Option<&Path>) -> Result<DecodeParams> {
        let threshold = self.threshold.unwrap_or(match self.strategy.as_str() {
            "entropy_bounded" => 0.35,
            _ => 0.9,
        });
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
        let params = DecodeParams {
            block_length: self.block_length,
            steps: self.steps,
            strategy: Strategy::from_name(&self.strategy, threshold)?,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
            },
            max_new_tokens: self.max_new_tokens,
            exact_max: self.exact_max,
            stop_ids,
            seed: self.seed,
            overflow: if self.reference_overflow {
                Overflow::Reference
            } else {
                Overflow::Clamp
            },
        };
        params.validate()?;
        Ok(params)
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
    Fp16,
}

const NO_CUDA: &str =
    "cannot use CUDA (is this binary built with `--features cuda` and is a GPU visible?)";

impl DeviceKind {
    pub fn device(self) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => dice_model::device::cuda_device(0).context(NO_CUDA),
        }
    }

    /// The CPU, or every visible GPU.
    fn all(self) -> Result<Vec<Device>> {
        match self {
            DeviceKind::Cpu => Ok(vec![Device::Cpu]),
            DeviceKind::Cuda => dice_model::device::cuda_devices().context(NO_CUDA),
        }
    }
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::Fp16 => DType::F16,
        }
    }
}

/// Where the model runs.
#[derive(Args, Clone, Debug)]
pub struct RuntimeArgs {
    /// cuda needs a binary built with `--features cuda`.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Compute dtype (DICE's evaluation used fp16, RL rollouts bf16).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DTypeArg,
    /// Sequences decoded at once (per engine).
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
}

/// How many engines decode a batch job, and where.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Decoding engines, each with its own copy of the model, dealt requests in turn [default:
    /// one per visible GPU with --device cuda, one on the CPU]. More engines than GPUs share the
    /// GPUs in turn. Outputs do not depend on it: every request decodes with its own seed.
    #[arg(long, value_name = "N")]
    pub engines: Option<usize>,
}

impl RuntimeArgs {
    /// The device of each engine of a batch job.
    fn engine_devices(&self, engines: &EngineArgs) -> Result<Vec<Device>> {
        let devices = self.device.all()?;
        let count = engines.engines.unwrap_or(devices.len()).max(1);
        Ok(devices.iter().cycle().take(count).cloned().collect())
    }

    /// The model of `dir` set up for `block_length`, with its tokenizer and chat template.
    pub fn load(&self, dir: &Path, block_length: usize) -> Result<(SdarDecoder, TextCodec)> {
        let model = self.model_on(dir, &self.device.device()?, block_length)?;
        Ok((model, TextCodec::from_dir(dir)?))
    }

    /// The model of `dir` on `device`, set up for `block_length`.
    fn model_on(&self, dir: &Path, device: &Device, block_length: usize) -> Result<SdarDecoder> {
        SdarDecoder::load(dir, self.dtype.dtype(), device, block_length)
            .with_context(|| format!("cannot load the model in {}", dir.display()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
pub enum OutputFormat {
    Json,
    Text,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model folder (config.json, safetensors, tokenizer files).
    #[arg(long, required_unless_present = "endpoint")]
    pub model: Option<PathBuf>,
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
    /// OpenAI-compatible API base (e.g. http://127.0.0.1:8000/v1) instead of a local model.
    #[arg(long, requires = "model_name", conflicts_with = "model")]
    pub endpoint: Option<String>,
    /// Model name sent to the endpoint.
    #[arg(long)]
    pub model_name: Option<String>,
    /// Environment variable holding the endpoint's API key.
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// Requests in flight at once against the endpoint.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub engines: EngineArgs,
}

/// One prompt to generate for, and where its answers go.
struct Job {
    key: JobKey,
    /// The user message, or the whole prompt with `--raw`.
    text: String,
    seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum JobKey {
    Sample(usize),
    Candidate {
        level: u32,
        problem_id: u32,
        sample_id: u32,
    },
}

/// One answer, local or remote.
struct Answer {
    text: String,
    token_ids: Option<Vec<u32>>,
    trace: Option<Vec<u32>>,
    finish_reason: Option<String>,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    ensure!(a.samples > 0, "--samples must be at least 1");
    let params = a.decode.params(a.model.as_deref())?;
    let jobs = jobs(&a)?;
    let mut sink = Sink::new(&a)?;
    let jobs: Vec<Job> = jobs.into_iter().filter(|j| !sink.done(&j.key)).collect();
    if jobs.is_empty() {
        eprintln!("nothing to generate: every candidate is already in the run folder");
        return sink.finish(a.format);
    }
    sink.expect(jobs.len());
    match &a.endpoint {
        Some(endpoint) => run_remote(&a, endpoint, &params, jobs, &mut sink)?,
        None => {
            let dir = a
                .model
                .as_deref()
                .context("--model is required without --endpoint")?;
            run_local(&a, dir, &params, jobs, &mut sink)?
        }
    }
    sink.finish(a.format)
}

fn jobs(a: &GenerateArgs) -> Result<Vec<Job>> {
    let seeds = |i: usize| a.decode.seed.wrapping_add(i as u64);
    if let Some(path) = &a.prompt_file {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read the prompt file {}", path.display()))?;
        let text = String::from_utf8(bytes)
            .with_context(|| format!("the prompt file {} is not UTF-8 text", path.display()))?;
        return Ok((0..a.samples)
            .map(|i| Job {
                key: JobKey::Sample(i),
                text: text.clone(),
                seed: seeds(i),
            })
            .collect());
    }
    let dir = a
        .kernelbench
        .as_deref()
        .context("give --prompt-file or --kernelbench")?;
    ensure!(!a.raw, "--raw applies to --prompt-file only");
    let level = a.level.context("--kernelbench needs --level")?;
    let bench = KernelBench::open(dir)?;
    let scan = bench.scan_level(level)?;
    let wanted = a.problems.as_deref().map(parse_ids).transpose()?;
    let mut jobs = Vec::new();
    for problem in scan.problems {
        if wanted
            .as_ref()
            .is_some_and(|w| !w.contains(&problem.problem_id))
        {
            continue;
        }
        let text = problem_prompt(&problem)?;
        for sample_id in 0..a.samples as u32 {
            jobs.push(Job {
                key: JobKey::Candidate {
                    level,
                    problem_id: problem.problem_id,
                    sample_id,
                },
                text: text.clone(),
                seed: seeds(sample_id as usize),
            });
        }
    }
    if let Some(wanted) = wanted {
        let found: BTreeSet<u32> = jobs
            .iter()
            .filter_map(|j| match j.key {
                JobKey::Candidate { problem_id, .. } => Some(problem_id),
                JobKey::Sample(_) => None,
            })
            .collect();
        let missing: Vec<String> = wanted.difference(&found).map(u32::to_string).collect();
        ensure!(
            missing.is_empty(),
            "level {level} has no valid problem {}",
            missing.join(", ")
        );
    }
    Ok(jobs)
}

/// `1-100`, `3`, `1,5,7-9`.
fn parse_ids(spec: &str) -> Result<BTreeSet<u32>> {
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

fn run_local(
    a: &GenerateArgs,
    dir: &Path,
    params: &DecodeParams,
    jobs: Vec<Job>,
    sink: &mut Sink,
) -> Result<()> {
    let codec = TextCodec::from_dir(dir)?;
    let mut requests = Vec::new();
    for job in jobs {
        let prompt = if a.raw {
            codec.raw_prompt_ids(&job.text)?
        } else {
            codec.chat_prompt_ids(&[ChatMessage::new("user", &job.text)])?
        };
        requests.push((
            job.key,
            Request {
                prompt,
                params: DecodeParams {
                    seed: job.seed,
                    ..params.clone()
                },
            },
        ));
    }
    let b = params.block_length;
    let max_seq_len = requests
        .iter()
        .map(|(_, r)| (r.prompt.len() + params.max_new_tokens).div_ceil(b) * b)
        .max()
        .unwrap_or(b);
    let devices = a.runtime.engine_devices(&a.engines)?;
    let mut shares: Vec<Vec<(JobKey, Request)>> = devices.iter().map(|_| Vec::new()).collect();
    let engines = shares.len();
    for (i, request) in requests.into_iter().enumerate() {
        shares[i % engines].push(request);
    }
    let (finished, completions) = channel();
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = devices
            .into_iter()
            .zip(shares)
            .filter(|(_, share)| !share.is_empty())
            .map(|(device, share)| {
                let finished = finished.clone();
                let runtime = &a.runtime;
                scope.spawn(move || -> Result<()> {
                    let model = runtime.model_on(dir, &device, b)?;
                    let config = EngineConfig {
                        max_batch: runtime.max_batch.clamp(1, share.len()),
                        max_seq_len,
                        ..EngineConfig::default()
                    };
                    decode(Engine::new(model, config)?, share, &finished)
                })
            })
            .collect();
        drop(finished);
        // Answers are stored as they come, whichever engine finishes them.
        for (key, completion) in completions {
            sink.record(key, local_answer(&codec, completion)?)?;
        }
        for worker in workers {
            worker.join().expect("a decoding engine panicked")?;
        }
        Ok(())
    })
}

/// Runs `requests` through `engine`, sending each completion with its job as it finishes.
fn decode(
    mut engine: Engine<SdarDecoder>,
    requests: Vec<(JobKey, Request)>,
    finished: &Sender<(JobKey, Completion)>,
) -> Result<()> {
    let mut keys = BTreeMap::new();
    for (key, request) in requests {
        keys.insert(engine.submit(request)?, key);
    }
    while engine.has_work() {
        for event in engine.step()? {
            if let Event::Finished(completion) = event {
                let key = keys
                    .remove(&completion.id)
                    .context("a completion of an unknown request")?;
                // The receiver is gone only when storing failed; that error is reported there.
                if finished.send((key, completion)).is_err() {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

fn local_answer(codec: &TextCodec, completion: Completion) -> Result<Answer> {
    Ok(Answer {
        text: codec.completion_text(&completion.token_ids)?,
        finish_reason: Some(
            match completion.finish_reason {
                dice_engine::FinishReason::Stop => "stop",
                dice_engine::FinishReason::Length => "length",
            }
            .to_string(),
        ),
        token_ids: Some(completion.token_ids),
        trace: Some(completion.trace),
    })
}

fn run_remote(
    a: &GenerateArgs,
    endpoint: &str,
    params: &DecodeParams,
    jobs: Vec<Job>,
    sink: &mut Sink,
) -> Result<()> {
    ensure!(a.concurrency > 0, "--concurrency must be at least 1");
    let api_key =
        match &a.api_key_env {
            Some(var) => Some(std::env::var(var).with_context(|| {
                format!("environment variable {var} (--api-key-env) is not set")
            })?),
            None => None,
        };
    let model_name = a
        .model_name
        .as_deref()
        .context("--endpoint needs --model-name")?;
    let client = ApiClient::new(endpoint, model_name, api_key);
    let queue = Mutex::new(jobs.into_iter().collect::<VecDeque<Job>>());
    let (results, answers) = channel::<(JobKey, Result<ApiAnswer>)>();
    let settings = |seed: u64| CompletionSettings {
        max_tokens: params.max_new_tokens,
        temperature: params.sampling.temperature,
        top_k: params.sampling.top_k,
        top_p: params.sampling.top_p,
        seed: Some(seed),
    };
    std::thread::scope(|scope| -> Result<()> {
        for _ in 0..a.concurrency {
            let results = results.clone();
            let (queue, client, settings) = (&queue, &client, &settings);
            scope.spawn(move || loop {
                let Some(job) = queue.lock().expect("queue lock").pop_front() else {
                    break;
                };
                let answer = if a.raw {
                    client.complete(&job.text, &settings(job.seed))
                } else {
                    client.chat(&job.text, &settings(job.seed))
                };
                if results.send((job.key, answer)).is_err() {
                    break;
                }
            });
        }
        drop(results);
        for (key, answer) in answers {
            let answer = answer?;
            sink.record(
                key,
                Answer {
                    text: answer.text,
                    token_ids: answer.token_ids,
                    trace: answer.trace,
                    finish_reason: answer.finish_reason,
                },
            )?;
        }
        Ok(())
    })
    .inspect_err(|_| queue.lock().expect("queue lock").clear())
}

/// Where answers go: collected for stdout, or appended to RUN/candidates.jsonl one line at a
/// time (so an interrupted run resumes where it stopped).
enum Sink {
    Stdout(BTreeMap<JobKey, Answer>),
    Candidates {
        file: std::fs::File,
        done: BTreeSet<JobKey>,
        progress: ProgressBar,
    },
}

impl Sink {
    fn new(a: &GenerateArgs) -> Result<Self> {
        let Some(run) = &a.run else {
            ensure!(a.kernelbench.is_none(), "--kernelbench needs --run");
            return Ok(Sink::Stdout(BTreeMap::new()));
        };
        ensure!(
            a.kernelbench.is_some(),
            "--run applies to --kernelbench generation"
        );
        std::fs::create_dir_all(run)
            .with_context(|| format!("cannot create the run folder {}", run.display()))?;
        let path = run.join("candidates.jsonl");
        let done = existing_candidates(&path)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Sink::Candidates {
            file,
            done,
            progress: ProgressBar::no_length(),
        })
    }

    fn done(&self, key: &JobKey) -> bool {
        matches!(self, Sink::Candidates { done, .. } if done.contains(key))
    }

    /// Shows progress over the `count` candidates still to write.
    fn expect(&mut self, count: usize) {
        if let Sink::Candidates { progress, .. } = self {
            progress.set_length(count as u64);
        }
    }

    fn record(&mut self, key: JobKey, answer: Answer) -> Result<()> {
        match (self, key) {
            (Sink::Stdout(answers), key) => {
                answers.insert(key, answer);
            }
            (
                Sink::Candidates {
                    file,
                    done,
                    progress,
                },
                JobKey::Candidate {
                    level,
                    problem_id,
                    sample_id,
                },
            ) => {
                let line = json!({
                    "level": level, "problem_id": problem_id, "sample_id": sample_id,
                    "completion": answer.text, "token_ids": answer.token_ids,
                    "trace": answer.trace, "finish_reason": answer.finish_reason,
                });
                writeln!(file, "{line}")
                    .and_then(|()| file.flush())
                    .context("cannot append to candidates.jsonl")?;
                done.insert(key);
                progress.inc(1);
            }
            (Sink::Candidates { .. }, JobKey::Sample(_)) => {
                bail!("a prompt-file sample cannot go to a run folder")
            }
        }
        Ok(())
    }

    fn finish(self, format: OutputFormat) -> Result<()> {
        let answers = match self {
            Sink::Stdout(answers) => answers,
            Sink::Candidates { progress, .. } => {
                progress.finish();
                return Ok(());
            }
        };
        let mut out = std::io::stdout().lock();
        match format {
            OutputFormat::Json => {
                let samples: Vec<Value> = answers
                    .into_values()
                    .map(|a| {
                        json!({"token_ids": a.token_ids, "text": a.text, "trace": a.trace,
                               "finish_reason": a.finish_reason})
                    })
                    .collect();
                writeln!(out, "{}", json!({ "samples": samples }))?;
            }
            OutputFormat::Text => {
                for answer in answers.into_values() {
                    writeln!(out, "{}", answer.text)?;
                }
            }
        }
        Ok(())
    }
}

/// Keys of the candidates already in `path` (an absent file has none).
fn existing_candidates(path: &Path) -> Result<BTreeSet<JobKey>> {
    let mut done = BTreeSet::new();
    if !path.exists() {
        return Ok(done);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let value: Value = serde_json::from_str(line).with_context(|| {
            format!(
                "{}:{}: not a JSON line; fix or remove it to resume",
                path.display(),
                n + 1
            )
        })?;
        let field = |k: &str| {
            value[k]
                .as_u64()
                .map(|v| v as u32)
                .with_context(|| format!("{}:{}: missing `{k}`", path.display(), n + 1))
        };
        done.insert(JobKey::Candidate {
            level: field("level")?,
            problem_id: field("problem_id")?,
            sample_id: field("sample_id")?,
        });
    }
    Ok(done)
}
