//! The OpenAI-compatible server on loopback with the formula golden's tiny checkpoint:
//! `/v1/models`, a chat completion, the same chat completion streamed, a text completion; all
//! equal to local decoding.

use candle_core::{DType, Device};
use dice_engine::{
    serve, DecodeParams, Engine, EngineConfig, Request, SdarDecoder, ServeOptions, TextCodec,
};
use dice_model::chat::ChatMessage;
use dice_test_support::checkpoint::formula_tiny;
use serde_json::{json, Value};

fn engine() -> Engine<SdarDecoder> {
    let model = SdarDecoder::load(formula_tiny(), DType::F32, &Device::Cpu, 4).unwrap();
    let config = EngineConfig {
        max_batch: 4,
        max_seq_len: 256,
        max_prefill_tokens: 4096,
    };
    Engine::new(model, config).unwrap()
}

fn post(url: &str, body: &Value) -> String {
    let mut response = ureq::post(url).send_json(body).unwrap();
    assert_eq!(response.status().as_u16(), 200);
    response.body_mut().read_to_string().unwrap()
}

#[test]
fn chat_streamed_and_plain_completions_match_local_generation() {
    let message = "Write a kernel.";
    let params = DecodeParams {
        stop_ids: vec![151645, 151643],
        ..DecodeParams::dice_eval(20)
    };
    let codec = TextCodec::from_dir(formula_tiny()).unwrap();
    let prompt = codec
        .chat_prompt_ids(&[ChatMessage::new("user", message)])
        .unwrap();
    let local = engine()
        .generate(vec![Request {
            prompt,
            params: params.clone(),
        }])
        .unwrap()
        .remove(0);
    let local_text = codec.completion_text(&local.token_ids).unwrap();

    let http = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let base = format!("http://{}/v1", http.server_addr().to_ip().unwrap());
    let options = ServeOptions {
        model_name: "tiny".into(),
        defaults: params,
        max_requests: Some(5),
    };
    let server = std::thread::spawn(move || serve(http, engine(), codec, options));

    let models: Value = serde_json::from_str(
        &ureq::get(format!("{base}/models"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");

    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": message}], "max_tokens": 20});
    let plain: Value =
        serde_json::from_str(&post(&format!("{base}/chat/completions"), &chat)).unwrap();
    assert_eq!(
        plain["choices"][0]["message"]["content"],
        local_text.as_str()
    );
    assert_eq!(plain["choices"][0]["trace"], json!(local.trace));

    let mut streamed_request = chat.clone();
    streamed_request["stream"] = json!(true);
    let events = post(&format!("{base}/chat/completions"), &streamed_request);
    let data: Vec<&str> = events
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        chunks.len() >= 3,
        "one event per block expected, got {}",
        chunks.len()
    );
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, local_text);
    assert!(chunks.last().unwrap()["choices"][0]["finish_reason"].is_string());

    let raw = json!({"model": "tiny", "prompt": "<|im_start|>user\nWrite a kernel.<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 20, "temperature": 0});
    let completion: Value =
        serde_json::from_str(&post(&format!("{base}/completions"), &raw)).unwrap();
    assert_eq!(completion["choices"][0]["text"], local_text.as_str());

    let mut refused = ureq::post(format!("{base}/completions"))
        .config()
        .http_status_as_error(false)
        .build()
        .send_json(json!({"prompt": "x", "stop": ["\n"]}))
        .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    assert!(refused
        .body_mut()
        .read_to_string()
        .unwrap()
        .contains("stop strings"));

    server.join().unwrap().unwrap();
}
