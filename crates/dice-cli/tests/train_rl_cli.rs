//! `dice train rl --dry-run` on DICE's released task files (tests/data/dice) with the SDAR
//! tokenizer of tests/data/sdar: the tasks per level, the prompt lengths and the curriculum.

mod common;

use std::process::Output;

fn dry_run(args: &[&str]) -> Output {
    let data = common::test_data();
    let tokenizer = data.join("sdar");
    common::dice(
        &[
            &[
                "train",
                "rl",
                "--model",
                common::path_arg(&tokenizer),
                "--dry-run",
            ],
            args,
        ]
        .concat(),
    )
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "dice failed: {}", common::stderr(out));
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn the_end_to_end_file_reads_with_the_reference_curriculum() {
    let tasks = common::test_data().join("dice/end_to_end_kernel_generation_4000.json");
    let text = stdout(&dry_run(&[
        "--tasks",
        common::path_arg(&tasks),
        "--stage",
        "e2e",
    ]));
    assert!(text.contains("tasks: 4000 from"), "{text}");
    assert!(
        text.contains("tasks per level: 0: 1, 1: 590, 2: 3407, 3: 2"),
        "{text}"
    );
    assert!(
        text.contains("100 steps (1.60 passes over the tasks)"),
        "{text}"
    );
    // Spec bicrl §3: step 10 draws 15 level-1 and 49 level-2 tasks, steps 11–62 level 2 only.
    assert!(
        text.contains("step 10: 15 × level 1, 49 × level 2"),
        "{text}"
    );
    assert!(text.contains("steps 11–62: 64 × level 2"), "{text}");
}

#[test]
fn the_infilling_file_reads_with_its_scaffolds() {
    let tasks = common::test_data().join("dice/kernel_infilling_evaluation.json");
    let text = stdout(&dry_run(&[
        "--tasks",
        common::path_arg(&tasks),
        "--stage",
        "infill",
    ]));
    assert!(text.contains("tasks: 99 from"), "{text}");
    assert!(text.contains("0 longer than max_prompt_len 2000"), "{text}");
    assert!(text.contains("20 steps"), "{text}");

    let e2e = common::test_data().join("dice/end_to_end_kernel_generation_4000.json");
    let out = dry_run(&["--tasks", common::path_arg(&e2e), "--stage", "infill"]);
    assert!(!out.status.success());
    assert!(
        common::stderr(&out).contains("missing `prefix`"),
        "{}",
        common::stderr(&out)
    );
}
