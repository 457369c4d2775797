//! Each input layout through a `dataset_info.json`: alpaca, sharegpt, plain prompt/response
//! and role/content messages, encoded with the qwen3 training template; records LlamaFactory
//! skips are counted with their reason; bad data is an error naming the file and line.

use crate::common::*;
use dice_model::chat::ChatMessage;
use dice_model::ChatTemplate;
use dice_train::data::source::Converted;
use dice_train::data::{
    select_datasets, DatasetSpec, DropReason, PackOptions, PackedDataset, Qwen3Encoder,
};
use std::path::{Path, PathBuf};

/// Token ids and labels of a sample.
type Encoded = (Vec<u32>, Vec<i64>);

/// Per record of dataset `name`: its ids and labels, or why it is skipped.
fn encode_dataset(name: &str) -> Vec<Result<Encoded, DropReason>> {
    let tokenizer = tokenizer();
    let encoder = Qwen3Encoder::new(&tokenizer).unwrap();
    let specs =
        DatasetSpec::from_dataset_info(&fixture("dataset_info.json"), &[name.to_string()]).unwrap();
    let spec = &specs[0];
    spec.read()
        .unwrap()
        .iter()
        .map(|record| match spec.convert(record).unwrap() {
            Converted::Sample(conversation) => {
                let sample = encoder.encode(&conversation).unwrap();
                Ok((sample.input_ids.clone(), sample.labels().collect()))
            }
            Converted::Dropped(reason) => Err(reason),
        })
        .collect()
}

/// Ids and labels of prompt/response pieces: prompts labelled -100, responses by their ids.
fn turns(pieces: &[(&[u32], bool)]) -> Encoded {
    let mut ids = Vec::new();
    let mut labels = Vec::new();
    for &(piece, trained) in pieces {
        ids.extend_from_slice(piece);
        labels.extend(
            piece
                .iter()
                .map(|&id| if trained { i64::from(id) } else { -100 }),
        );
    }
    (ids, labels)
}

/// X → Y, the single-turn sample every layout can express.
fn x_to_y() -> Encoded {
    turns(&[
        (&user_turn(&[X]), false),
        (&EMPTY_THOUGHT, true),
        (&assistant_turn(&[Y]), true),
    ])
}

const SYSTEM_S: [u32; 6] = [IM_START, 8948, NEWLINE, 50, IM_END, NEWLINE];
/// `<think>\nZ\n</think>\n\n` followed by Y: a response with its own thought.
const THOUGHT_Z: [u32; 6] = [151667, NEWLINE, Z, NEWLINE, 151668, 271];

#[test]
fn alpaca_joins_instruction_and_input_and_puts_the_system_first() {
    let system_prompt = [SYSTEM_S.to_vec(), user_turn(&[X, NEWLINE, Z])].concat();
    assert_eq!(
        encode_dataset("alpaca_demo"),
        [
            Ok(x_to_y()),
            Ok(turns(&[
                (&system_prompt, false),
                (&EMPTY_THOUGHT, true),
                (&assistant_turn(&[Y]), true),
            ])),
        ]
    );
}

#[test]
fn sharegpt_trains_every_response_and_skips_broken_conversations() {
    let first_prompt = [SYSTEM_S.to_vec(), user_turn(&[X])].concat();
    assert_eq!(
        encode_dataset("sharegpt_demo"),
        [
            Ok(turns(&[
                (&first_prompt, false),
                (&EMPTY_THOUGHT, true),
                (&assistant_turn(&[Y]), true),
                (&user_turn(&[Z]), false),
                (&THOUGHT_Z, true),
                (&assistant_turn(&[Y]), true),
            ])),
            Err(DropReason::RoleOrder),
            Err(DropReason::TurnCount),
        ]
    );
}

#[test]
fn plain_prompt_response_records_map_through_columns() {
    assert_eq!(
        encode_dataset("prompt_response_demo"),
        [
            Ok(x_to_y()),
            Ok(turns(&[
                (&user_turn(&[X]), false),
                (&THOUGHT_Z, true),
                (&assistant_turn(&[Y]), true),
            ])),
            Err(DropReason::NoResponse),
        ]
    );
}

#[test]
fn role_content_messages_map_through_tags() {
    assert_eq!(encode_dataset("messages_demo"), [Ok(x_to_y())]);
}

#[test]
fn the_training_text_is_what_the_chat_template_renders_for_the_finished_turn() {
    let tokenizer = tokenizer();
    let (ids, _) = x_to_y();
    let template = ChatTemplate::from_dir(&sdar_dir()).unwrap();
    let messages = [
        ChatMessage::new("user", "X"),
        ChatMessage::new("assistant", "Y"),
    ];
    let rendered = template
        .render(&messages, false, &serde_json::Value::Null)
        .unwrap();
    assert_eq!(tokenizer.decode(&ids, false).unwrap(), rendered);
}

#[test]
fn plain_files_are_recognised_by_their_fields() {
    let tokenizer = tokenizer();
    let encoder = Qwen3Encoder::new(&tokenizer).unwrap();
    for file in [
        "alpaca.json",
        "prompt_response.jsonl",
        "messages.jsonl",
        "sharegpt.jsonl",
    ] {
        let specs = select_datasets(&[fixture(file)], None, &[]).unwrap();
        let records = specs[0].read().unwrap();
        let Converted::Sample(conversation) = specs[0].convert(&records[0]).unwrap() else {
            panic!("{file}: the first record is a sample");
        };
        if file == "sharegpt.jsonl" {
            assert_eq!(conversation.system, "S");
            assert_eq!(conversation.messages.len(), 4);
        } else {
            let sample = encoder.encode(&conversation).unwrap();
            assert_eq!(sample.input_ids, x_to_y().0, "{file}");
        }
    }
}

#[test]
fn datasets_mix_in_the_order_named_and_skips_are_counted() {
    let tokenizer = tokenizer();
    let encoder = Qwen3Encoder::new(&tokenizer).unwrap();
    let names: Vec<String> = [
        "alpaca_demo",
        "sharegpt_demo",
        "prompt_response_demo",
        "messages_demo",
    ]
    .map(String::from)
    .to_vec();
    // The folder holding dataset_info.json stands for the file.
    let datasets = select_datasets(&[], Some(&fixture("")), &names).unwrap();
    let packed = PackedDataset::build(&datasets, &encoder, &PackOptions::default()).unwrap();
    let stats = packed.stats();
    let counts: Vec<usize> = stats.records.iter().map(|(_, n)| *n).collect();
    assert_eq!(counts, [2, 3, 3, 1]);
    assert_eq!(stats.samples, 6);
    assert_eq!(stats.rows, 1);
    let dropped = |reason| {
        (
            stats.dropped[&reason].count,
            stats.dropped[&reason].first.line,
        )
    };
    assert_eq!(dropped(DropReason::RoleOrder), (1, 2));
    assert_eq!(dropped(DropReason::TurnCount), (1, 3));
    assert_eq!(dropped(DropReason::NoResponse), (1, 4));
    let text = stats.to_string();
    assert!(text.contains("samples      6 packed, 3 dropped"), "{text}");
}

fn error_of(result: anyhow::Result<impl std::fmt::Debug>) -> String {
    format!("{:#}", result.unwrap_err())
}

#[test]
fn bad_records_are_errors_naming_file_and_line() {
    let tokenizer = tokenizer();
    let encoder = Qwen3Encoder::new(&tokenizer).unwrap();
    let bad = fixture("bad.jsonl");
    let datasets = select_datasets(std::slice::from_ref(&bad), None, &[]).unwrap();
    let message = error_of(PackedDataset::build(
        &datasets,
        &encoder,
        &PackOptions::default(),
    ));
    assert!(
        message.contains(&format!("{} line 3", bad.display()))
            && message.contains("\"prompt\" must be a string, got an array"),
        "{message}"
    );
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn malformed_files_are_errors_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let broken = write(
        dir.path(),
        "broken.jsonl",
        "{\"prompt\": \"X\", \"response\": \"Y\"}\n{\"prompt\": \n",
    );
    assert!(error_of(DatasetSpec::from_file(&broken)).contains("broken.jsonl line 2: invalid JSON"));

    let array = write(
        dir.path(),
        "array.json",
        "[\n  {\"prompt\": \"X\", \"response\": \"Y\"},\n  [1, 2]\n]\n",
    );
    let message = error_of(DatasetSpec::from_file(&array));
    assert!(
        message
            .contains("array.json line 3 (record 2): a record must be a JSON object, got an array"),
        "{message}"
    );

    let unknown = write(dir.path(), "unknown.jsonl", "{\"question\": \"X\"}\n");
    assert!(error_of(DatasetSpec::from_file(&unknown))
        .contains("unknown.jsonl line 1: cannot tell the layout"));

    let message = error_of(DatasetSpec::from_dataset_info(
        &fixture("dataset_info.json"),
        &["hub_demo".to_string()],
    ));
    assert!(
        message.contains("\"hf_hub_url\" datasets are not supported"),
        "{message}"
    );
    let message = error_of(DatasetSpec::from_dataset_info(
        &fixture("dataset_info.json"),
        &["missing".to_string()],
    ));
    assert!(message.contains("no dataset \"missing\""), "{message}");
}
