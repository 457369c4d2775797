use dice_kernelbench::prompt::{
    assemble_infilled, infilling_prompt, load_infilling_tasks, problem_prompt,
};
use dice_kernelbench::KernelBench;
use dice_test_support::test_data;
use serde_json::Value;
use std::fs;

fn golden(rel: &str) -> String {
    let path = test_data().join("sdar/golden").join(rel);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What the SDAR chat template renders for one user message (checked against `.chat.txt`).
fn chat_one_user_turn(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

#[test]
fn every_golden_prompt_is_reproduced_byte_for_byte() {
    let index: Vec<Value> = serde_json::from_str(&golden("prompts/index.json")).unwrap();
    let kb = KernelBench::open(&test_data().join("kernelbench")).unwrap();
    let tasks =
        load_infilling_tasks(&test_data().join("dice/kernel_infilling_evaluation.json")).unwrap();
    let (mut one_shot, mut infilling) = (0, 0);
    for entry in &index {
        let name = entry["name"].as_str().unwrap();
        if let Some(problem) = entry["problem"].as_str() {
            let (level, file) = problem.split_once('/').unwrap();
            let level: u32 = level.trim_start_matches("level").parse().unwrap();
            let id: u32 = file.split('_').next().unwrap().parse().unwrap();
            let prompt = problem_prompt(&kb.problem(level, id).unwrap()).unwrap();
            let user = golden(entry["user_message"].as_str().unwrap());
            assert!(prompt == user, "{name}: user message differs");
            let chat = golden(entry["chat_text"].as_str().unwrap());
            assert!(
                chat_one_user_turn(&prompt) == chat,
                "{name}: chat text differs"
            );
            one_shot += 1;
        } else {
            let source = entry["source"].as_str().unwrap();
            let index: usize = source
                .split("index ")
                .nth(1)
                .and_then(|s| s.split(' ').next())
                .unwrap()
                .parse()
                .unwrap();
            let prompt = infilling_prompt(&tasks[index]);
            assert!(
                prompt == golden(entry["text"].as_str().unwrap()),
                "{name} differs"
            );
            infilling += 1;
        }
    }
    assert_eq!((one_shot, infilling), (3, 2));
}

#[test]
fn infilling_tasks_reassemble_into_the_reference_program() {
    let path = test_data().join("dice/kernel_infilling_evaluation.json");
    let pairs: Vec<Value> = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    let tasks = load_infilling_tasks(&path).unwrap();
    assert_eq!(tasks.len(), pairs.len());
    for (task, pair) in tasks.iter().zip(&pairs) {
        let program = assemble_infilled(task, task.middle.as_deref().unwrap());
        assert_eq!(
            program,
            pair["cuda_code"].as_str().unwrap(),
            "{}",
            task.origin
        );
        assert_eq!(task.id, pair["id"].as_u64().map(|i| i as u32));
    }
}
