//! A client of OpenAI-compatible chat / text completion APIs, for autoregressive baselines
//! and for talking to `dice serve`: retries with exponential backoff on 429, 5xx and
//! connection errors.

use anyhow::{bail, Context, Result};
use dice_model::chat::ChatMessage;
use serde::Serialize;
use serde_json::{json, Value};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionSettings {
    pub max_tokens: usize,
    pub temperature: f32,
    /// 1 = greedy (sent as `temperature: 0`); 0 = off; otherwise sent as the `top_k`
    /// extension that vLLM and `dice serve` understand.
    pub top_k: usize,
    pub top_p: f32,
    pub seed: Option<u64>,
    /// Ask `dice serve` for the whole block holding the last token allowed, as local decoding
    /// gives it, rather than the answer cut at `max_tokens` (sent as the [`WHOLE_BLOCKS`]
    /// header, which other servers ignore).
    pub whole_blocks: bool,
}

/// The header of a request that wants whole blocks (value `true`): an extension outside the
/// body, where no OpenAI-compatible server refuses what it does not know.
pub const WHOLE_BLOCKS: &str = "Dice-Whole-Blocks";

pub struct ApiClient {
    agent: ureq::Agent,
    base: String,
    model_name: String,
    api_key: Option<String>,
    max_retries: u32,
    first_backoff: Duration,
}

/// One generated answer: its text and, from a local engine or `dice serve`, its token ids and
/// trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Answer {
    pub token_ids: Option<Vec<u32>>,
    pub text: String,
    pub trace: Option<Vec<u32>>,
    pub finish_reason: Option<String>,
}

const MAX_BACKOFF: Duration = Duration::from_secs(60);

impl ApiClient {
    /// `endpoint` is the API base, e.g. `http://127.0.0.1:8000/v1`.
    pub fn new(endpoint: &str, model_name: &str, api_key: Option<String>) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(3600)))
            .build()
            .into();
        ApiClient {
            agent,
            base: endpoint.trim_end_matches('/').to_string(),
            model_name: model_name.to_string(),
            api_key,
            max_retries: 6,
            first_backoff: Duration::from_secs(1),
        }
    }

    /// Retries after a retryable failure: `max_retries` more attempts, waiting `first_backoff`,
    /// then twice as long each time (at most a minute).
    pub fn with_retries(mut self, max_retries: u32, first_backoff: Duration) -> Self {
        self.max_retries = max_retries;
        self.first_backoff = first_backoff;
        self
    }

    /// A conversation (user and assistant messages, the last a user's) through
    /// `/chat/completions`.
    pub fn chat(&self, messages: &[ChatMessage], settings: &CompletionSettings) -> Result<Answer> {
        let mut body = self.body(settings);
        body["messages"] = json!(messages);
        let answer = self.post("chat/completions", &body, settings.whole_blocks)?;
        let choice = &answer["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .context("the chat completion has no choices[0].message.content")?;
        Ok(parse_answer(text, choice))
    }

    /// A raw prompt through `/completions`.
    pub fn complete(&self, prompt: &str, settings: &CompletionSettings) -> Result<Answer> {
        let mut body = self.body(settings);
        body["prompt"] = json!(prompt);
        let answer = self.post("completions", &body, settings.whole_blocks)?;
        let choice = &answer["choices"][0];
        let text = choice["text"]
            .as_str()
            .context("the completion has no choices[0].text")?;
        Ok(parse_answer(text, choice))
    }

    fn body(&self, s: &CompletionSettings) -> Value {
        let mut body =
            json!({"model": self.model_name, "max_tokens": s.max_tokens, "top_p": s.top_p});
        if s.top_k == 1 {
            body["temperature"] = json!(0.0);
        } else {
            body["temperature"] = json!(s.temperature);
            if s.top_k > 1 {
                body["top_k"] = json!(s.top_k);
            }
        }
        if let Some(seed) = s.seed {
            body["seed"] = json!(seed);
        }
        body
    }

    fn post(&self, route: &str, body: &Value, whole_blocks: bool) -> Result<Value> {
        let url = format!("{}/{route}", self.base);
        let mut wait = self.first_backoff;
        let mut attempt = 0;
        loop {
            let failure = match self.try_post(&url, body, whole_blocks) {
                Ok(Outcome::Answer(value)) => return Ok(value),
                Ok(Outcome::Refused(status, text)) => {
                    bail!("{url} answered {status}: {}", text.trim())
                }
                Ok(Outcome::Retry(reason)) | Err(reason) => reason,
            };
            if attempt >= self.max_retries {
                bail!("{url} failed {} times, last: {failure}", attempt + 1);
            }
            tracing::warn!("{url}: {failure}; retrying in {wait:?}");
            std::thread::sleep(wait);
            wait = (wait * 2).min(MAX_BACKOFF);
            attempt += 1;
        }
    }

    fn try_post(&self, url: &str, body: &Value, whole_blocks: bool) -> Result<Outcome, String> {
        let mut request = self.agent.post(url);
        if let Some(key) = &self.api_key {
            request = request.header("Authorization", &format!("Bearer {key}"));
        }
        if whole_blocks {
            request = request.header(WHOLE_BLOCKS, "true");
        }
        let mut response = request
            .send_json(body)
            .map_err(|e| format!("request failed: {e}"))?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("cannot read the answer: {e}"))?;
        if status == 429 || status >= 500 {
            return Ok(Outcome::Retry(format!("status {status}: {}", text.trim())));
        }
        if !(200..300).contains(&status) {
            return Ok(Outcome::Refused(status, text));
        }
        serde_json::from_str(&text)
            .map(Outcome::Answer)
            .map_err(|e| format!("the answer is not JSON ({e})"))
    }
}

enum Outcome {
    Answer(Value),
    Retry(String),
    Refused(u16, String),
}

fn parse_answer(text: &str, choice: &Value) -> Answer {
    let ids = |key: &str| {
        choice[key].as_array().map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|v| v as u32)
                .collect()
        })
    };
    Answer {
        text: text.to_string(),
        token_ids: ids("token_ids"),
        trace: ids("trace"),
        finish_reason: choice["finish_reason"].as_str().map(str::to_string),
    }
}
