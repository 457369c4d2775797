//! Batch generation: many prompts, each sample with its own seed, answered by engines on this
//! machine (each with its own copy of the model, dealt the requests in turn) or by an
//! OpenAI-compatible endpoint (several requests in flight). Answers are handed over as they
//! finish, whichever engine or request finishes them, so that a caller can store each at once.

use crate::client::{Answer, ApiClient, CompletionSettings};
use crate::engine::{Completion, Engine, EngineConfig, Event, Request};
use crate::params::DecodeParams;
use crate::sdar::SdarDecoder;
use crate::text::TextCodec;
use anyhow::{anyhow, ensure, Context, Result};
use candle_core::{DType, Device};
use dice_model::chat::ChatMessage;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;

/// One prompt to answer once.
#[derive(Clone, Debug)]
pub struct Job<K> {
    /// What the answer is filed under.
    pub key: K,
    /// The conversation before `text`, with [`PromptStyle::Chat`]: user and assistant messages
    /// in turn, a user's first (the earlier turns of a multi-turn refinement). Empty for a
    /// one-turn prompt, and always with [`PromptStyle::Raw`].
    pub history: Vec<ChatMessage>,
    /// The (last) user message, or with [`PromptStyle::Raw`] the whole prompt.
    pub text: String,
    /// Which sample of its prompt this is: it decodes with [`DecodeParams::for_sample`].
    pub sample: usize,
}

impl<K> Job<K> {
    /// The chat messages of [`PromptStyle::Chat`]: the history, then `text` as the user's.
    fn messages(&self) -> Vec<ChatMessage> {
        let mut messages = self.history.clone();
        messages.push(ChatMessage::new("user", &self.text));
        messages
    }
}

/// How a job's text becomes the model's prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptStyle {
    /// Chat messages (the job's history, then its text as the user's), rendered with the chat
    /// template (`/chat/completions` of an endpoint).
    Chat,
    /// The whole prompt, used as is (`/completions` of an endpoint).
    Raw,
}

/// Where jobs are answered.
pub enum Generator {
    Local(LocalEngines),
    Endpoint {
        client: ApiClient,
        /// Requests in flight at once.
        concurrency: usize,
    },
}

/// Decoding engines on this machine, each with its own copy of a model folder's model.
pub struct LocalEngines {
    pub model_dir: PathBuf,
    pub dtype: DType,
    /// The devices the engines run on, in turn.
    pub devices: Vec<Device>,
    /// How many engines [default: one per device]; more engines than devices share them.
    /// Answers do not depend on it: every job decodes with its own seed.
    pub engines: Option<usize>,
    /// Sequences each engine decodes at once.
    pub max_batch: usize,
}

impl Generator {
    /// Answers every job with `params` (seeded for the job's sample), handing each answer to
    /// `store` as it finishes. The first error, of generation or of `store`, ends the batch.
    pub fn run<K: Send>(
        &self,
        params: &DecodeParams,
        style: PromptStyle,
        jobs: Vec<Job<K>>,
        store: impl FnMut(K, Answer) -> Result<()>,
    ) -> Result<()> {
        ensure!(
            style == PromptStyle::Chat || jobs.iter().all(|job| job.history.is_empty()),
            "a raw prompt has no conversation: earlier turns need the chat style"
        );
        match self {
            Generator::Local(engines) => engines.run(params, style, jobs, store),
            Generator::Endpoint {
                client,
                concurrency,
            } => run_endpoint(client, *concurrency, params, style, jobs, store),
        }
    }
}

/// `samples` answers to one prompt, in sample order.
pub fn generate_samples(
    generator: &Generator,
    params: &DecodeParams,
    style: PromptStyle,
    text: &str,
    samples: usize,
) -> Result<Vec<Answer>> {
    let jobs = (0..samples)
        .map(|sample| Job {
            key: sample,
            history: Vec::new(),
            text: text.to_string(),
            sample,
        })
        .collect();
    let mut answers = BTreeMap::new();
    generator.run(params, style, jobs, |sample, answer| {
        answers.insert(sample, answer);
        Ok(())
    })?;
    Ok(answers.into_values().collect())
}

impl LocalEngines {
    fn run<K: Send>(
        &self,
        params: &DecodeParams,
        style: PromptStyle,
        jobs: Vec<Job<K>>,
        mut store: impl FnMut(K, Answer) -> Result<()>,
    ) -> Result<()> {
        let codec = TextCodec::from_dir(&self.model_dir)?;
        let requests = jobs
            .into_iter()
            .map(|job| {
                let prompt = match style {
                    PromptStyle::Raw => codec.raw_prompt_ids(&job.text)?,
                    PromptStyle::Chat => codec.chat_prompt_ids(&job.messages())?,
                };
                let params = params.for_sample(job.sample);
                Ok((job.key, Request { prompt, params }))
            })
            .collect::<Result<Vec<_>>>()?;
        let b = params.block_length;
        let max_seq_len = requests
            .iter()
            .map(|(_, r)| (r.prompt.len() + params.max_new_tokens).div_ceil(b) * b)
            .max()
            .unwrap_or(b);
        let devices = self.engine_devices()?;
        let mut shares: Vec<Vec<(K, Request)>> = devices.iter().map(|_| Vec::new()).collect();
        let engines = shares.len();
        for (i, request) in requests.into_iter().enumerate() {
            shares[i % engines].push(request);
        }
        let (dir, dtype, max_batch) = (&self.model_dir, self.dtype, self.max_batch);
        let (finished, completions) = channel();
        std::thread::scope(|scope| -> Result<()> {
            let workers: Vec<_> = devices
                .into_iter()
                .zip(shares)
                .filter(|(_, share)| !share.is_empty())
                .map(|(device, share)| {
                    let finished = finished.clone();
                    scope.spawn(move || -> Result<()> {
                        let model = SdarDecoder::load(dir, dtype, &device, b)?;
                        let config = EngineConfig {
                            max_batch: max_batch.clamp(1, share.len()),
                            max_seq_len,
                            ..EngineConfig::default()
                        };
                        decode(Engine::new(model, config)?, share, &finished)
                    })
                })
                .collect();
            drop(finished);
            for (key, completion) in completions {
                store(key, local_answer(&codec, completion)?)?;
            }
            for worker in workers {
                worker
                    .join()
                    .map_err(|_| anyhow!("a decoding engine panicked"))??;
            }
            Ok(())
        })
    }

    /// The device of each engine.
    fn engine_devices(&self) -> Result<Vec<Device>> {
        ensure!(!self.devices.is_empty(), "no device to run the model on");
        let count = self.engines.unwrap_or(self.devices.len()).max(1);
        Ok(self.devices.iter().cycle().take(count).cloned().collect())
    }
}

/// Runs `requests` through `engine`, sending each completion with its key as it finishes.
fn decode<K>(
    mut engine: Engine<SdarDecoder>,
    requests: Vec<(K, Request)>,
    finished: &Sender<(K, Completion)>,
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
        finish_reason: Some(completion.finish_reason.name().to_string()),
        token_ids: Some(completion.token_ids),
        trace: Some(completion.trace),
    })
}

fn run_endpoint<K: Send>(
    client: &ApiClient,
    concurrency: usize,
    params: &DecodeParams,
    style: PromptStyle,
    jobs: Vec<Job<K>>,
    mut store: impl FnMut(K, Answer) -> Result<()>,
) -> Result<()> {
    let queue = Mutex::new(jobs.into_iter().collect::<VecDeque<_>>());
    let (results, answers) = channel::<(K, Result<Answer>)>();
    std::thread::scope(|scope| -> Result<()> {
        for _ in 0..concurrency.max(1) {
            let results = results.clone();
            let queue = &queue;
            scope.spawn(move || loop {
                let Some(job) = queue.lock().expect("queue lock").pop_front() else {
                    break;
                };
                let settings = completion_settings(&params.for_sample(job.sample));
                let answer = match style {
                    PromptStyle::Raw => client.complete(&job.text, &settings),
                    PromptStyle::Chat => client.chat(&job.messages(), &settings),
                };
                // The receiver is gone only when storing failed: no more requests.
                if results.send((job.key, answer)).is_err() {
                    break;
                }
            });
        }
        drop(results);
        for (key, answer) in answers {
            store(key, answer?)?;
        }
        Ok(())
    })
}

/// What an OpenAI-compatible API takes of `params`.
fn completion_settings(params: &DecodeParams) -> CompletionSettings {
    CompletionSettings {
        max_tokens: params.max_new_tokens,
        temperature: params.sampling.temperature,
        top_k: params.sampling.top_k,
        top_p: params.sampling.top_p,
        seed: Some(params.seed),
        whole_blocks: !params.exact_max,
    }
}
