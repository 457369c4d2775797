//! The API client retries 429 / 5xx / connection failures with backoff and gives up on other
//! refusals at once.

use dice_engine::{ApiClient, ChatMessage, CompletionSettings};
use serde_json::{json, Value};
use std::time::Duration;

fn settings() -> CompletionSettings {
    CompletionSettings {
        max_tokens: 8,
        temperature: 1.0,
        top_k: 1,
        top_p: 1.0,
        seed: Some(3),
        whole_blocks: false,
    }
}

/// Answers each request with the next (status, body) and returns the request bodies.
fn scripted_server(answers: Vec<(u16, String)>) -> (String, std::thread::JoinHandle<Vec<Value>>) {
    let http = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let base = format!("http://{}/v1", http.server_addr().to_ip().unwrap());
    let handle = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for (status, body) in answers {
            let mut request = http.recv().unwrap();
            let mut text = String::new();
            request.as_reader().read_to_string(&mut text).unwrap();
            seen.push(serde_json::from_str(&text).unwrap());
            request
                .respond(tiny_http::Response::from_string(body).with_status_code(status))
                .unwrap();
        }
        seen
    });
    (base, handle)
}

#[test]
fn retries_overload_and_server_errors_then_succeeds() {
    let ok = json!({"choices": [{"message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]});
    let (base, server) = scripted_server(vec![
        (503, "busy".into()),
        (429, "slow down".into()),
        (200, ok.to_string()),
    ]);
    let client =
        ApiClient::new(&base, "m", Some("key".into())).with_retries(3, Duration::from_millis(5));
    let answer = client
        .chat(&[ChatMessage::new("user", "hi")], &settings())
        .unwrap();
    assert_eq!(answer.text, "hello");
    assert_eq!(answer.finish_reason.as_deref(), Some("stop"));
    let seen = server.join().unwrap();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[0]["messages"][0]["content"], "hi");
    assert_eq!(
        seen[0]["temperature"], 0.0,
        "top-k 1 is sent as greedy temperature 0"
    );
    assert_eq!(seen[0]["seed"], 3);
}

#[test]
fn a_client_error_is_not_retried() {
    let (base, server) = scripted_server(vec![(400, "{\"error\": \"bad model\"}".into())]);
    let client = ApiClient::new(&base, "m", None).with_retries(3, Duration::from_millis(5));
    let error = client.complete("x", &settings()).unwrap_err().to_string();
    assert!(
        error.contains("400") && error.contains("bad model"),
        "{error}"
    );
    assert_eq!(server.join().unwrap().len(), 1);
}

#[test]
fn connection_failures_are_retried_then_reported() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let client = ApiClient::new(&format!("http://127.0.0.1:{port}/v1"), "m", None)
        .with_retries(2, Duration::from_millis(5));
    let error = client
        .chat(&[ChatMessage::new("user", "x")], &settings())
        .unwrap_err()
        .to_string();
    assert!(error.contains("failed 3 times"), "{error}");
}
