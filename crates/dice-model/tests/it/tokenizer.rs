//! Tokenizer (rebuilt from vocab.json + merges.txt) and chat template against the reference.

use crate::common::*;
use dice_model::chat::ChatMessage;
use dice_model::{ChatTemplate, SdarTokenizer};

fn tokenizer() -> SdarTokenizer {
    SdarTokenizer::from_dir(&test_data().join("sdar")).unwrap()
}

#[test]
fn every_reference_case_encodes_and_decodes_identically() {
    let tok = tokenizer();
    let cases = read_json(&test_data().join("sdar/golden/tokenizer_cases.json"));
    let cases = cases["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let ids = u32s(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), ids, "ids of case {name}");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "decode of {name}"
        );
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap(),
            "skip-special decode of {name}"
        );
    }
}

#[test]
fn spec_token_vectors() {
    let tok = tokenizer();
    assert_eq!(
        tok.encode("<|im_start|>user\nX<|im_end|>\n<|im_start|>assistant\n")
            .unwrap(),
        [151644, 872, 198, 55, 151645, 198, 151644, 77091, 198]
    );
    assert_eq!(
        tok.encode("<think>\n\n</think>\n\n").unwrap(),
        [151667, 271, 151668, 271]
    );
    assert_eq!(tok.encode("<|MASK|>").unwrap(), [151669]);
    assert_eq!(tok.mask_token_id(), Some(151669));
    assert_eq!(tok.eos_token_id(), Some(151643));
    assert_eq!(
        tok.decode(&[151667, 55, 151669, 151643], true).unwrap(),
        "<think>X"
    );
}

#[test]
fn out_of_vocabulary_ids_are_an_error() {
    let err = tokenizer().decode(&[151935], false).unwrap_err();
    assert!(err.to_string().contains("151935"), "{err}");
}

#[test]
fn every_reference_chat_case_renders_identically() {
    let template = ChatTemplate::from_dir(&test_data().join("sdar")).unwrap();
    let cases = read_json(&test_data().join("sdar/golden/chat_template_cases.json"));
    for case in cases.as_array().unwrap() {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let text = template.render(&messages, add, &case["kwargs"]).unwrap();
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "messages {}",
            case["messages"]
        );
    }
}

#[test]
fn assistant_turns_follow_qwen3_rules() {
    let template = ChatTemplate::from_dir(&test_data().join("sdar")).unwrap();
    let messages = [
        ChatMessage::new("user", "a"),
        ChatMessage::new("assistant", "<think>\nr\n</think>\n\nb"),
    ];
    let text = template
        .render(&messages, false, &serde_json::Value::Null)
        .unwrap();
    assert_eq!(text, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nb<|im_end|>\n");
}
