//! An OpenAI-compatible HTTP server (`/v1/completions`, `/v1/chat/completions` with
//! server-sent-event streaming, `/v1/models`) in front of one engine thread.
//!
//! A request's `n` choices decode side by side in the engine's batch, choice `i` seeded with
//! `seed + i`. `max_tokens` is a bound, as the API promises: the block holding the last token
//! allowed is cut there (finish reason `length`), unless the request carries the
//! [`WHOLE_BLOCKS`] header, as `dice generate --endpoint` sends to get what local decoding
//! gives. Beside OpenAI's fields a request may set `top_k`, `strategy` (a remasking strategy's
//! name) and `threshold` (of the threshold strategies); what it leaves out comes from the
//! server's defaults.

use crate::client::WHOLE_BLOCKS;
use crate::engine::{Completion, Engine, Event, Request, RequestId};
use crate::model::BlockDiffusionModel;
use crate::params::{DecodeParams, DecodeSettings};
use crate::strategy::Strategy;
use crate::text::TextCodec;
use anyhow::{anyhow, Context, Result};
use dice_model::chat::ChatMessage;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct ServeOptions {
    /// Name reported by `/v1/models` and in responses.
    pub model_name: String,
    /// Decoding settings of a request that does not override them.
    pub defaults: DecodeParams,
    /// Stop after answering this many requests (for tests and one-off jobs).
    pub max_requests: Option<usize>,
}

enum Reply {
    Tokens(Vec<u32>),
    Done(Completion),
    /// The request was refused (a client error).
    Rejected(String),
    /// The engine failed while decoding it.
    Failed(String),
}

/// Where the replies of one choice go: the request's channel, tagged with the choice's index.
struct Route {
    choice: usize,
    reply: Sender<(usize, Reply)>,
}

impl Route {
    fn send(&self, reply: Reply) {
        // The receiver is gone once its handler stopped waiting (an error answered already).
        let _ = self.reply.send((self.choice, reply));
    }
}

struct Job {
    request: Request,
    route: Route,
}

/// The most choices one request may ask for (OpenAI's own limit).
const MAX_CHOICES: usize = 128;

/// Serves requests from `http` until `max_requests` have been received and answered (or
/// forever).
pub fn serve<M>(
    http: tiny_http::Server,
    engine: Engine<M>,
    codec: TextCodec,
    options: ServeOptions,
) -> Result<()>
where
    M: BlockDiffusionModel + Send + 'static,
    M::Cache: Send,
{
    let (jobs, inbox) = channel::<Job>();
    let engine_thread = std::thread::spawn(move || engine_loop(engine, inbox));
    let context = Arc::new(Handler {
        codec,
        options,
        jobs,
        next_id: AtomicU64::new(0),
    });
    let mut handlers = Vec::new();
    let mut received = 0usize;
    while context
        .options
        .max_requests
        .is_none_or(|max| received < max)
    {
        let request = http
            .recv()
            .context("the HTTP server stopped accepting requests")?;
        received += 1;
        let context = Arc::clone(&context);
        handlers.push(std::thread::spawn(move || context.handle(request)));
        handlers.retain(|h| !h.is_finished());
    }
    for handler in handlers {
        let _ = handler.join();
    }
    drop(context);
    engine_thread
        .join()
        .map_err(|_| anyhow!("the engine thread panicked"))
}

fn engine_loop<M: BlockDiffusionModel>(mut engine: Engine<M>, inbox: Receiver<Job>) {
    let mut routes: HashMap<RequestId, Route> = HashMap::new();
    loop {
        if !engine.has_work() {
            match inbox.recv() {
                Ok(job) => submit(&mut engine, &mut routes, job),
                Err(_) => return,
            }
        }
        while let Ok(job) = inbox.try_recv() {
            submit(&mut engine, &mut routes, job);
        }
        match engine.step() {
            Ok(events) => {
                for event in events {
                    route(&mut routes, event);
                }
            }
            Err(e) => {
                let message = format!("{e:#}");
                tracing::error!("decoding failed: {message}");
                for id in engine.abort_all() {
                    if let Some(route) = routes.remove(&id) {
                        route.send(Reply::Failed(message.clone()));
                    }
                }
            }
        }
    }
}

fn submit<M: BlockDiffusionModel>(
    engine: &mut Engine<M>,
    routes: &mut HashMap<RequestId, Route>,
    job: Job,
) {
    match engine.submit(job.request) {
        Ok(id) => {
            routes.insert(id, job.route);
        }
        Err(e) => job.route.send(Reply::Rejected(format!("{e:#}"))),
    }
}

fn route(routes: &mut HashMap<RequestId, Route>, event: Event) {
    match event {
        Event::Tokens { id, tokens } => {
            if let Some(route) = routes.get(&id) {
                route.send(Reply::Tokens(tokens));
            }
        }
        Event::Finished(completion) => {
            if let Some(route) = routes.remove(&completion.id) {
                route.send(Reply::Done(completion));
            }
        }
    }
}

struct Handler {
    codec: TextCodec,
    options: ServeOptions,
    jobs: Sender<Job>,
    next_id: AtomicU64,
}

/// An API error: HTTP status and message.
struct ApiError(u16, String);

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        ApiError(400, format!("{e:#}"))
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Api {
    Completions,
    Chat,
}

impl Api {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completions, _) => "text_completion",
        }
    }
}

/// A generation request accepted by the engine, waiting for the replies of its choices.
struct Pending {
    api: Api,
    id: String,
    prompt_len: usize,
    choices: usize,
    replies: Receiver<(usize, Reply)>,
}

impl Handler {
    fn handle(&self, mut request: tiny_http::Request) {
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let method = request.method().clone();
        let api = match (method, path.as_str()) {
            (tiny_http::Method::Get, "/v1/models") => {
                log_send_error(respond_json(request, 200, &self.models()));
                return;
            }
            (tiny_http::Method::Post, "/v1/completions") => Api::Completions,
            (tiny_http::Method::Post, "/v1/chat/completions") => Api::Chat,
            (_, other) => {
                let message = format!(
                    "no route {other}: use /v1/models, /v1/completions or /v1/chat/completions"
                );
                log_send_error(respond_error(request, ApiError(404, message)));
                return;
            }
        };
        let (pending, stream) = match self.start(&mut request, api) {
            Ok(started) => started,
            Err(e) => {
                log_send_error(respond_error(request, e));
                return;
            }
        };
        let sent = if stream {
            self.stream(request, pending)
        } else {
            match self.wait(&pending) {
                Ok(body) => respond_json(request, 200, &body),
                Err(e) => respond_error(request, e),
            }
        };
        log_send_error(sent);
    }

    fn models(&self) -> Value {
        json!({"object": "list", "data": [{"id": self.options.model_name, "object": "model", "owned_by": "dice"}]})
    }

    /// Parses a generation request and hands it to the engine; also says whether to stream.
    fn start(
        &self,
        request: &mut tiny_http::Request,
        api: Api,
    ) -> Result<(Pending, bool), ApiError> {
        let mut body = String::new();
        request
            .as_reader()
            .read_to_string(&mut body)
            .map_err(|e| ApiError(400, format!("cannot read the request body: {e}")))?;
        let body: Value = serde_json::from_str(&body)
            .map_err(|e| ApiError(400, format!("the request body is not JSON: {e}")))?;
        let prompt = self.prompt_ids(&body, api)?;
        let whole_blocks = request
            .headers()
            .iter()
            .any(|h| h.field.equiv(WHOLE_BLOCKS) && h.value.as_str().eq_ignore_ascii_case("true"));
        let params = request_params(&body, &self.options.defaults, whole_blocks)?;
        let choices = choice_count(&body)?;
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let (reply, replies) = channel();
        let prompt_len = prompt.len();
        for choice in 0..choices {
            let job = Job {
                request: Request {
                    prompt: prompt.clone(),
                    params: params.for_sample(choice),
                },
                route: Route {
                    choice,
                    reply: reply.clone(),
                },
            };
            self.jobs
                .send(job)
                .map_err(|_| ApiError(503, "the engine has stopped".into()))?;
        }
        let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
        let id = format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        Ok((
            Pending {
                api,
                id,
                prompt_len,
                choices,
                replies,
            },
            stream,
        ))
    }

    fn wait(&self, pending: &Pending) -> Result<Value, ApiError> {
        let mut completions = BTreeMap::new();
        while completions.len() < pending.choices {
            if let (index, Reply::Done(completion)) = next_reply(&pending.replies)? {
                completions.insert(index, completion);
            }
        }
        let mut choices = Vec::new();
        let mut generated = 0;
        for (index, completion) in completions {
            let text = self
                .codec
                .completion_text(&completion.token_ids)
                .map_err(|e| ApiError(500, format!("{e:#}")))?;
            generated += completion.token_ids.len();
            let mut choice = json!({"index": index, "finish_reason": completion.finish_reason.name(),
                "logprobs": null, "token_ids": completion.token_ids, "trace": completion.trace});
            match pending.api {
                Api::Chat => choice["message"] = json!({"role": "assistant", "content": text}),
                Api::Completions => choice["text"] = json!(text),
            }
            choices.push(choice);
        }
        let (p, n) = (pending.prompt_len, generated);
        Ok(json!({
            "id": pending.id,
            "object": pending.api.object(false),
            "created": unix_time(),
            "model": self.options.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n},
        }))
    }

    fn prompt_ids(&self, body: &Value, api: Api) -> Result<Vec<u32>, ApiError> {
        match api {
            Api::Chat => {
                let messages = body
                    .get("messages")
                    .ok_or_else(|| ApiError(400, "`messages` is required".into()))?;
                let messages: Vec<ChatMessage> =
                    serde_json::from_value(messages.clone()).map_err(|e| {
                        ApiError(
                            400,
                            format!("`messages` must be a list of {{role, content}} strings: {e}"),
                        )
                    })?;
                if messages.is_empty() {
                    return Err(ApiError(
                        400,
                        "`messages` must not be empty: give at least one {role, content} message"
                            .into(),
                    ));
                }
                Ok(self.codec.chat_prompt_ids(&messages)?)
            }
            Api::Completions => match body.get("prompt") {
                Some(Value::String(text)) => Ok(self.codec.raw_prompt_ids(text)?),
                Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => Ok(self
                    .codec
                    .raw_prompt_ids(items[0].as_str().unwrap_or_default())?),
                Some(Value::Array(items))
                    if !items.is_empty() && items.iter().all(Value::is_u64) =>
                {
                    Ok(items
                        .iter()
                        .filter_map(Value::as_u64)
                        .map(|t| t as u32)
                        .collect())
                }
                _ => Err(ApiError(
                    400,
                    "`prompt` must be a string or a list of token ids".into(),
                )),
            },
        }
    }

    /// Server-sent events, one per committed block of a choice, each written as an HTTP chunk
    /// and flushed at once; the first reply is awaited before the headers so that a refused
    /// request still gets an error status.
    fn stream(&self, request: tiny_http::Request, pending: Pending) -> std::io::Result<()> {
        let first = match next_reply(&pending.replies) {
            Ok(reply) => reply,
            Err(e) => return respond_error(request, e),
        };
        let mut out = request.into_writer();
        write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )?;
        let created = unix_time();
        let chunk = |index: usize, delta: &str, finish: Option<&str>| {
            let choice = match pending.api {
                Api::Chat => {
                    json!({"index": index, "delta": {"content": delta}, "finish_reason": finish})
                }
                Api::Completions => {
                    json!({"index": index, "text": delta, "finish_reason": finish})
                }
            };
            json!({"id": pending.id, "object": pending.api.object(true), "created": created,
                   "model": self.options.model_name, "choices": [choice]})
        };
        if pending.api == Api::Chat {
            for index in 0..pending.choices {
                let mut opening = chunk(index, "", None);
                opening["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                send_event(&mut out, &opening.to_string())?;
            }
        }
        // Per choice: the tokens so far and the text sent of them.
        let mut tokens = vec![Vec::new(); pending.choices];
        let mut sent = vec![String::new(); pending.choices];
        let mut unfinished = pending.choices;
        let mut reply = Ok(first);
        loop {
            match reply {
                Ok((index, Reply::Tokens(new))) => {
                    tokens[index].extend(new);
                    let text = self
                        .codec
                        .completion_text(&tokens[index])
                        .unwrap_or_default();
                    if let Some(delta) = unsent(&text, &mut sent[index], false) {
                        send_event(&mut out, &chunk(index, &delta, None).to_string())?;
                    }
                }
                Ok((index, Reply::Done(completion))) => {
                    let text = self
                        .codec
                        .completion_text(&completion.token_ids)
                        .unwrap_or_default();
                    let delta = unsent(&text, &mut sent[index], true).unwrap_or_default();
                    let finish = completion.finish_reason.name();
                    send_event(&mut out, &chunk(index, &delta, Some(finish)).to_string())?;
                    unfinished -= 1;
                    if unfinished == 0 {
                        send_event(&mut out, "[DONE]")?;
                        break;
                    }
                }
                Ok((_, Reply::Rejected(m) | Reply::Failed(m))) | Err(ApiError(_, m)) => {
                    send_event(&mut out, &json!({"error": {"message": m}}).to_string())?;
                    break;
                }
            }
            reply = next_reply(&pending.replies);
        }
        write!(out, "0\r\n\r\n")?;
        out.flush()
    }
}

/// The next reply, with refusals and failures as errors.
fn next_reply(replies: &Receiver<(usize, Reply)>) -> Result<(usize, Reply), ApiError> {
    match replies.recv() {
        Ok((_, Reply::Rejected(m))) => Err(ApiError(400, m)),
        Ok((_, Reply::Failed(m))) => Err(ApiError(500, m)),
        Ok(reply) => Ok(reply),
        Err(_) => Err(ApiError(500, "the engine stopped".into())),
    }
}

/// The part of `text` not streamed yet. A trailing U+FFFD may be half of a character whose
/// remaining bytes come with the next block, so it is held back until `last`.
fn unsent(text: &str, sent: &mut String, last: bool) -> Option<String> {
    let stable = if last {
        text
    } else {
        text.trim_end_matches('\u{FFFD}')
    };
    let delta = stable.strip_prefix(sent.as_str())?;
    if delta.is_empty() {
        return None;
    }
    let delta = delta.to_string();
    sent.push_str(&delta);
    Some(delta)
}

fn send_event(out: &mut impl Write, data: &str) -> std::io::Result<()> {
    let payload = format!("data: {data}\n\n");
    write!(out, "{:x}\r\n{payload}\r\n", payload.len())?;
    out.flush()
}

fn log_send_error(result: std::io::Result<()>) {
    if let Err(e) = result {
        tracing::warn!("cannot send the response: {e}");
    }
}

fn respond_error(
    request: tiny_http::Request,
    ApiError(status, message): ApiError,
) -> std::io::Result<()> {
    respond_json(
        request,
        status,
        &json!({"error": {"message": message, "type": "invalid_request_error"}}),
    )
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn respond_json(request: tiny_http::Request, status: u16, body: &Value) -> std::io::Result<()> {
    let header =
        tiny_http::Header::from_bytes("Content-Type", "application/json").expect("valid header");
    request.respond(
        tiny_http::Response::from_string(body.to_string())
            .with_status_code(status)
            .with_header(header),
    )
}

/// The request's overrides of the server defaults. OpenAI's `temperature: 0` means greedy
/// (top-k 1); a positive temperature without `top_k` samples from the full distribution.
/// `max_tokens` cuts the answer there, or with `whole_blocks` ends it with the block holding
/// that token.
fn request_params(
    body: &Value,
    defaults: &DecodeParams,
    whole_blocks: bool,
) -> Result<DecodeParams, ApiError> {
    let mut settings = DecodeSettings::default();
    if let Some(max) = number(body, "max_tokens")?.or(number(body, "max_completion_tokens")?) {
        settings.max_new_tokens = Some(max as usize);
        settings.exact_max = Some(!whole_blocks);
    }
    if let Some(t) = number(body, "temperature")? {
        if t == 0.0 {
            settings.temperature = Some(1.0);
            settings.top_k = Some(1);
        } else {
            settings.temperature = Some(t as f32);
            settings.top_k = Some(0);
        }
    }
    if let Some(k) = number(body, "top_k")? {
        settings.top_k = Some(if k < 0.0 { 0 } else { k as usize });
    }
    settings.top_p = number(body, "top_p")?.map(|p| p as f32);
    settings.seed = number(body, "seed")?.map(|seed| seed as u64);
    settings.threshold = number(body, "threshold")?.map(|t| t as f32);
    settings.strategy = match body.get("strategy") {
        None | Some(Value::Null) => None,
        Some(Value::String(name)) => Some(name.parse::<Strategy>()?),
        Some(_) => return Err(ApiError(400, "`strategy` must be a strategy's name".into())),
    };
    match body.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => return Err(ApiError(
            400,
            "stop strings are not supported; stop token ids are set with `dice serve --stop-ids`"
                .into(),
        )),
    }
    Ok(settings.over(defaults)?)
}

/// The request's `n`: how many choices to generate for its prompt.
fn choice_count(body: &Value) -> Result<usize, ApiError> {
    match number(body, "n")? {
        None => Ok(1),
        Some(n) if n.fract() == 0.0 && (1.0..=MAX_CHOICES as f64).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError(
            400,
            format!("`n` must be a whole number from 1 to {MAX_CHOICES}, got {n}"),
        )),
    }
}

/// The number in `body[key]`, if it is there and not null.
fn number(body: &Value, key: &str) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError(400, format!("`{key}` must be a number"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(body: Value) -> Result<DecodeParams, ApiError> {
        request_params(&body, &DecodeParams::dice_eval(64), false)
    }

    #[test]
    fn openai_sampling_fields_map_onto_decoding_params() {
        let greedy = params(json!({"temperature": 0, "max_tokens": 9, "seed": 4}))
            .ok()
            .unwrap();
        assert_eq!(greedy.sampling.top_k, 1);
        assert_eq!((greedy.max_new_tokens, greedy.seed), (9, 4));
        let sampled = params(json!({"temperature": 0.7, "top_p": 0.9}))
            .ok()
            .unwrap();
        assert_eq!(sampled.sampling.top_k, 0);
        assert_eq!(sampled.sampling.temperature, 0.7);
        assert_eq!(sampled.sampling.top_p, 0.9);
        let top_k = params(json!({"temperature": 0.7, "top_k": 20}))
            .ok()
            .unwrap();
        assert_eq!(top_k.sampling.top_k, 20);
        let defaults = params(json!({})).ok().unwrap();
        assert_eq!(defaults, DecodeParams::dice_eval(64));
    }

    #[test]
    fn unsupported_fields_are_refused() {
        for body in [json!({"stop": "\n"}), json!({"max_tokens": "many"})] {
            assert_eq!(params(body).err().map(|e| e.0), Some(400));
        }
        assert!(params(json!({"stop": null, "n": 1})).is_ok());
    }

    #[test]
    fn a_request_picks_a_strategy_and_bounds_its_answer() {
        let dynamic = params(json!({"strategy": "low_confidence_dynamic", "threshold": 0.5}))
            .ok()
            .unwrap();
        assert_eq!(
            dynamic.strategy,
            Strategy::LowConfidenceDynamic { threshold: 0.5 }
        );
        let entropy = params(json!({"strategy": "entropy_bounded"})).ok().unwrap();
        assert_eq!(
            entropy.strategy,
            Strategy::EntropyBounded { threshold: 0.35 }
        );
        for body in [json!({"strategy": "random"}), json!({"strategy": 3})] {
            assert_eq!(params(body).err().map(|e| e.0), Some(400));
        }
        let bounded = params(json!({"max_tokens": 9})).ok().unwrap();
        assert!(bounded.exact_max);
        assert!(!params(json!({})).ok().unwrap().exact_max);
        let whole = request_params(
            &json!({"max_tokens": 9}),
            &DecodeParams::dice_eval(64),
            true,
        );
        assert!(!whole.ok().unwrap().exact_max);
    }

    #[test]
    fn n_is_a_whole_number_of_choices() {
        assert_eq!(choice_count(&json!({})).ok(), Some(1));
        assert_eq!(choice_count(&json!({"n": 3})).ok(), Some(3));
        for n in [json!(0), json!(1.5), json!(129), json!("2")] {
            assert_eq!(
                choice_count(&json!({ "n": n })).err().map(|e| e.0),
                Some(400)
            );
        }
    }

    #[test]
    fn streamed_text_holds_back_a_partial_character() {
        let mut sent = String::new();
        assert_eq!(unsent("ab", &mut sent, false).as_deref(), Some("ab"));
        assert_eq!(
            unsent("abc\u{FFFD}", &mut sent, false).as_deref(),
            Some("c")
        );
        assert_eq!(unsent("abcé", &mut sent, false).as_deref(), Some("é"));
        assert_eq!(unsent("abcé", &mut sent, true), None);
        assert_eq!(sent, "abcé");
    }
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod http_tests;
