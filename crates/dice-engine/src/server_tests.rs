//! The server over HTTP on loopback, in front of the test model: `max_tokens` bounds what is
//! returned (whole blocks when asked for), `n` choices decode side by side (streamed too), each
//! as it decodes alone, and an empty `messages` list is refused with a message that says so.

use super::*;
use crate::engine::EngineConfig;
use crate::sampling::SamplingParams;
use crate::test_model::HashModel;
use std::path::Path;
use std::thread::JoinHandle;

/// Five prompt tokens: blocks of 4 end 3 and 7 tokens into the answer.
const PROMPT: [u32; 5] = [5, 9, 2, 7, 11];

fn engine() -> Engine<HashModel> {
    let config = EngineConfig {
        max_batch: 4,
        max_seq_len: 128,
        max_prefill_tokens: 64,
    };
    Engine::new(HashModel::default(), config).unwrap()
}

/// The SDAR tokenizer and chat template of the test data (the test model's ids are bytes).
fn codec() -> TextCodec {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/sdar");
    TextCodec::from_dir(&dir).unwrap()
}

/// A server answering `requests` requests with DICE's evaluation settings; its API base.
fn start(requests: usize) -> (String, JoinHandle<Result<()>>) {
    let http = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let base = format!("http://{}/v1", http.server_addr().to_ip().unwrap());
    let options = ServeOptions {
        model_name: "test".into(),
        defaults: DecodeParams::dice_eval(64),
        max_requests: Some(requests),
    };
    let server = std::thread::spawn(move || serve(http, engine(), codec(), options));
    (base, server)
}

fn post(url: &str, body: &Value) -> (u16, String) {
    post_with(url, body, &[])
}

fn post_with(url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, String) {
    let mut request = ureq::post(url).config().http_status_as_error(false).build();
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut response = request.send_json(body).unwrap();
    let text = response.body_mut().read_to_string().unwrap();
    (response.status().as_u16(), text)
}

fn local(params: DecodeParams) -> Completion {
    let request = Request {
        prompt: PROMPT.to_vec(),
        params,
    };
    engine().generate(vec![request]).unwrap().remove(0)
}

fn ids(value: &Value) -> Vec<u32> {
    serde_json::from_value(value.clone()).unwrap()
}

#[test]
fn max_tokens_bounds_the_answer_and_its_usage() {
    let full = local(DecodeParams::dice_eval(6));
    assert_eq!(
        full.token_ids.len(),
        7,
        "the block holding token 6 ends at 7"
    );
    let (base, server) = start(2);
    let body = json!({"prompt": PROMPT, "max_tokens": 6});
    let (status, text) = post(&format!("{base}/completions"), &body);
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let choice = &answer["choices"][0];
    assert_eq!(ids(&choice["token_ids"]), full.token_ids[..6]);
    assert_eq!(ids(&choice["trace"]), full.trace[..6]);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(
        choice["text"],
        codec().completion_text(&full.token_ids[..6]).unwrap()
    );
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11})
    );

    let whole = [(WHOLE_BLOCKS, "true")];
    let (status, text) = post_with(&format!("{base}/completions"), &body, &whole);
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(ids(&answer["choices"][0]["token_ids"]), full.token_ids);
    assert_eq!(answer["usage"]["completion_tokens"], 7);
    server.join().unwrap().unwrap();
}

#[test]
fn n_choices_decode_as_samples_plain_and_streamed() {
    let sample = |seed| {
        local(DecodeParams {
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
            exact_max: true,
            seed,
            ..DecodeParams::dice_eval(8)
        })
    };
    let expected = [sample(7), sample(8)];
    assert_ne!(expected[0].token_ids, expected[1].token_ids);
    let (base, server) = start(2);
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2});
    let (status, text) = post(&format!("{base}/completions"), &body);
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, (choice, expected)) in choices.iter().zip(&expected).enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(ids(&choice["token_ids"]), expected.token_ids);
    }
    assert_eq!(answer["usage"]["completion_tokens"], 16);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, events) = post(&format!("{base}/completions"), &streamed);
    assert_eq!(status, 200, "{events}");
    let data: Vec<&str> = events
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let mut texts = [String::new(), String::new()];
    let mut finished = [None, None];
    for event in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        assert!(
            finished[index].is_none(),
            "text after the end of choice {index}"
        );
        texts[index].push_str(choice["text"].as_str().unwrap());
        finished[index] = choice["finish_reason"].as_str().map(str::to_string);
    }
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(texts[i], choice["text"].as_str().unwrap());
        assert_eq!(finished[i].as_deref(), Some("length"));
    }
    server.join().unwrap().unwrap();
}

#[test]
fn empty_messages_are_refused_with_what_is_wrong() {
    let (base, server) = start(1);
    let (status, text) = post(
        &format!("{base}/chat/completions"),
        &json!({"model": "test", "messages": []}),
    );
    assert_eq!(status, 400);
    assert!(text.contains("`messages` must not be empty"), "{text}");
    server.join().unwrap().unwrap();
}
