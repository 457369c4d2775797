//! `dice kernelbench` as a user runs it on the formula golden's tiny checkpoint (whose answers
//! hold no valid code: the path is what is tested), resumed and started over; `dice report`
//! setting its run beside a `dice eval` run of the examples; and refinement over turns, with
//! the tiny checkpoint (local and served) and against a scripted endpoint, killed mid-turn.

use crate::common::{dice, path_arg};
use crate::example_runs::problem2_candidates;
use crate::tiny_server::TinyServer;
use dice_eval::Store;
use dice_test_support::checkpoint::{formula_tiny, FORMULA_TINY};
use dice_test_support::{examples_dir, shared_build_cache};
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `dice kernelbench` on level 1 of the examples, 8 new tokens per answer of the tiny model.
fn kernelbench(run: &Path, extra: &[&str]) -> Output {
    kernelbench_from(&["--model", path_arg(formula_tiny())], run, extra)
}

/// `dice kernelbench` on level 1 of the examples, 8 new tokens per answer of `source`'s model
/// (`--model DIR`, or `--endpoint URL --model-name NAME`).
fn kernelbench_from(source: &[&str], run: &Path, extra: &[&str]) -> Output {
    let examples_tree = examples_dir().join("kernelbench");
    let cache = shared_build_cache();
    let mut args = vec!["kernelbench"];
    args.extend(source);
    args.extend([
        "--kernelbench",
        path_arg(&examples_tree),
        "--levels",
        "1",
        "--device",
        "cpu",
        "--max-new-tokens",
        "8",
        "--no-stop",
        "--build-cache",
        path_arg(&cache),
        "--run",
        path_arg(run),
    ]);
    args.extend(extra);
    dice(&args)
}

fn succeeded(out: &Output) -> String {
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

fn stored_keys(run: &Path) -> Vec<(u32, u32, u32)> {
    let store = Store::open(&run.join("dice.db")).unwrap();
    let mut keys: Vec<_> = store
        .samples()
        .unwrap()
        .iter()
        .map(|s| (s.level, s.problem_id, s.sample_id))
        .collect();
    keys.sort();
    keys
}

#[test]
fn runs_end_to_end_resumes_and_starts_over() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let stdout = succeeded(&kernelbench(&run, &["--samples", "2"]));
    assert!(stdout.contains("evaluated 4 samples"), "{stdout}");
    assert!(stdout.contains("| Exec | 0.0% | 0.0% |"), "{stdout}");
    assert_eq!(
        stored_keys(&run),
        [(1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1)]
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    let level1 = &report["runs"][0]["levels"]["1"];
    assert_eq!(
        (level1["problems"].as_u64(), level1["samples"].as_u64()),
        (Some(2), Some(4))
    );
    assert_eq!(report["runs"][0]["label"], FORMULA_TINY);
    assert!(std::fs::read_to_string(run.join("report.md"))
        .unwrap()
        .contains("## Level 1"));
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert_eq!(html.matches("<svg").count(), 3);

    let candidates = std::fs::read(run.join("candidates.jsonl")).unwrap();
    let again = kernelbench(&run, &["--samples", "2"]);
    let stdout = succeeded(&again);
    assert!(
        text(&again.stderr).contains("every candidate is in the run folder already"),
        "{}",
        text(&again.stderr)
    );
    assert!(stdout.contains("evaluated 0 samples"), "{stdout}");
    assert!(
        stdout.contains("4 samples were already in the store"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read(run.join("candidates.jsonl")).unwrap(),
        candidates
    );

    let changed = kernelbench(&run, &["--samples", "2", "--seed", "5"]);
    assert!(!changed.status.success());
    let err = text(&changed.stderr);
    assert!(err.contains("other settings (seed)"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let stdout = succeeded(&kernelbench(&run, &["--seed", "5", "--force"]));
    assert!(stdout.contains("evaluated 2 samples"), "{stdout}");
    assert_eq!(stored_keys(&run), [(1, 1, 0), (1, 2, 0)]);
}

#[test]
fn report_sets_a_kernelbench_run_beside_an_eval_run() {
    let _judging = crate::common::away_from_hostile_programs();
    let dir = tempfile::tempdir().unwrap();
    let generated = dir.path().join("generated");
    succeeded(&kernelbench(&generated, &[]));
    let judged = dir.path().join("judged");
    let candidates = problem2_candidates(dir.path());
    let examples_tree = examples_dir().join("kernelbench");
    let cache = shared_build_cache();
    succeeded(&dice(&[
        "eval",
        path_arg(&candidates),
        "--kernelbench",
        path_arg(&examples_tree),
        "--run",
        path_arg(&judged),
        "--build-cache",
        path_arg(&cache),
        "--timeout",
        "20",
        "--perf-trials",
        "4",
    ]));
    let (a, b) = (path_arg(&generated), path_arg(&judged));
    // What the judge found, for a failure's reader: the report counts a deceptive sample 0 out.
    let judged_samples = Store::open(&judged.join("dice.db"))
        .unwrap()
        .samples()
        .unwrap();
    for sample in &judged_samples {
        eprintln!(
            "judged sample {}/{}: {:?} deceptive={} flags={:?} speedup={:?} {:?}",
            sample.problem_id,
            sample.sample_id,
            sample.verdict,
            sample.deceptive,
            sample.flags,
            sample.speedup,
            sample.message
        );
    }

    let md = succeeded(&dice(&["report", a, b]));
    assert!(
        md.contains(&format!(
            "| metric | {a} **raw** | {a} robust | {b} **raw** | {b} robust |"
        )),
        "{md}"
    );
    // Problem 2's sample 0 is correct, problem 1 has no candidate in the eval run.
    assert!(
        md.contains("| Exec | 0.0% | 0.0% | 50.0% | 50.0% |"),
        "{md}"
    );

    let html_path = dir.path().join("side-by-side.html");
    let out = dice(&[
        "report",
        a,
        b,
        "--format",
        "html",
        "-o",
        path_arg(&html_path),
    ]);
    succeeded(&out);
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert_eq!(html.matches("<svg").count(), 3);
    assert!(html.contains(&format!("<th colspan=\"2\">{b}</th>")));

    for (args, expected) in [
        (vec!["report", a, b, "--format", "csv"], "takes one run"),
        (
            vec!["report", a, b, "--fast-p", "1"],
            "--fast-p applies to one run",
        ),
        (
            vec!["report", a, path_arg(dir.path())],
            "has no dice results",
        ),
    ] {
        let out = dice(&args);
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(
            err.contains(expected) && err.trim().lines().count() == 1,
            "{err}"
        );
    }
}

/// An OpenAI-compatible endpoint that answers each chat request by its turn (counted from its
/// messages): the first with `first`, later ones with `then`, each program in a code block.
/// It keeps every request's body; with `hold_turn_2` it leaves the second request of turn 2
/// unanswered and says so on `held`.
struct ScriptedEndpoint {
    server: Arc<tiny_http::Server>,
    base: String,
    requests: Arc<Mutex<Vec<Value>>>,
    held: Receiver<()>,
}

impl ScriptedEndpoint {
    fn start(first: String, then: String, hold_turn_2: bool) -> ScriptedEndpoint {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let base = format!("http://{}/v1", server.server_addr().to_ip().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (tell, held) = channel();
        let (serving, seen) = (server.clone(), requests.clone());
        std::thread::spawn(move || {
            let mut unanswered = Vec::new();
            let mut turn_2 = 0;
            for mut request in serving.incoming_requests() {
                let mut text = String::new();
                request.as_reader().read_to_string(&mut text).unwrap();
                let body: Value = serde_json::from_str(&text).unwrap();
                let turn = body["messages"].as_array().unwrap().len().div_ceil(2);
                seen.lock().unwrap().push(body);
                if turn == 2 {
                    turn_2 += 1;
                    if hold_turn_2 && turn_2 == 2 {
                        unanswered.push(request);
                        let _ = tell.send(());
                        continue;
                    }
                }
                let program = if turn == 1 { &first } else { &then };
                let answer = json!({"choices": [{
                    "message": {"role": "assistant", "content": format!("```python\n{program}\n```")},
                    "finish_reason": "stop",
                }]});
                request
                    .respond(tiny_http::Response::from_string(answer.to_string()))
                    .unwrap();
            }
        });
        ScriptedEndpoint {
            server,
            base,
            requests,
            held,
        }
    }

    /// The requests of `turn` so far.
    fn requests_of_turn(&self, turn: usize) -> Vec<Value> {
        let requests = self.requests.lock().unwrap();
        requests
            .iter()
            .filter(|r| r["messages"].as_array().unwrap().len().div_ceil(2) == turn)
            .cloned()
            .collect()
    }
}

impl Drop for ScriptedEndpoint {
    fn drop(&mut self) {
        self.server.unblock();
    }
}

/// The program of an example candidate of problem 1 (`examples/candidates.jsonl`).
fn example_program(sample_id: u64) -> String {
    let all = std::fs::read_to_string(examples_dir().join("candidates.jsonl")).unwrap();
    all.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|c| c["problem_id"] == 1 && c["sample_id"] == sample_id)
        .and_then(|c| c["code"].as_str().map(str::to_string))
        .unwrap()
}

/// The arguments of `dice kernelbench --turns 3` on problem 1 of the examples, two samples
/// each, against `endpoint`; the target speedup is out of reach, so that every turn is taken.
fn three_turns_args<'a>(
    endpoint: &'a str,
    tree: &'a Path,
    run: &'a Path,
    cache: &'a Path,
) -> Vec<&'a str> {
    vec![
        "kernelbench",
        "--endpoint",
        endpoint,
        "--model-name",
        "scripted",
        "--kernelbench",
        path_arg(tree),
        "--levels",
        "1",
        "--problems",
        "1",
        "--samples",
        "2",
        "--turns",
        "3",
        "--target-speedup",
        "1000",
        "--device",
        "cpu",
        "--build-cache",
        path_arg(cache),
        "--timeout",
        "20",
        "--perf-trials",
        "4",
        "--run",
        path_arg(run),
    ]
}

fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

/// Against a scripted endpoint whose first answer mismatches (a leaky ReLU) and whose later
/// answers are right: killed mid-turn 2 and run again, it judges nothing twice, the second
/// turn's prompts hold the first turn's feedback, three turns are stored and the report counts
/// the fix at turn 2, also beside the run's first turn alone.
#[test]
fn three_turns_against_a_scripted_endpoint_resume_after_a_kill_and_count_the_fix() {
    let _judging = crate::common::away_from_hostile_programs();
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (tree, cache) = (examples_dir().join("kernelbench"), shared_build_cache());
    let (wrong, fixed) = (example_program(1), example_program(0));

    // Killed while turn 2 is generated: one of its two answers stored, the other asked for.
    let endpoint = ScriptedEndpoint::start(wrong.clone(), fixed.clone(), true);
    let log = dir.path().join("killed.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(three_turns_args(&endpoint.base, &tree, &run, &cache))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    while endpoint
        .held
        .recv_timeout(Duration::from_millis(100))
        .is_err()
    {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "dice kernelbench ended ({status}) before turn 2: {}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
    }
    let turn_2 = run.join("turn-2");
    let deadline = Instant::now() + Duration::from_secs(60);
    while line_count(&turn_2.join("candidates.jsonl")) < 1 {
        assert!(
            Instant::now() < deadline,
            "turn 2's first answer is not stored"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(endpoint.requests_of_turn(1).len(), 2);
    assert_eq!(stored_keys(&run), [(1, 1, 0), (1, 1, 1)]);
    assert!(!turn_2.join("dice.db").exists());

    let endpoint = ScriptedEndpoint::start(wrong.clone(), fixed.clone(), false);
    let stdout = succeeded(&dice(&three_turns_args(
        &endpoint.base,
        &tree,
        &run,
        &cache,
    )));
    // Nothing asked or judged twice: turn 1 is stored, one answer of turn 2 too.
    assert!(endpoint.requests_of_turn(1).is_empty());
    let second = endpoint.requests_of_turn(2);
    assert_eq!(second.len(), 1);
    assert_eq!(endpoint.requests_of_turn(3).len(), 2);
    // Each turn's account begins a line `turn T:`.
    let lines = format!("\n{stdout}");
    let turns: Vec<&str> = lines.split("\nturn ").skip(1).collect();
    assert_eq!(turns.len(), 3, "{stdout}");
    assert!(turns[0].starts_with("1:\nevaluated 0 samples"), "{stdout}");
    assert!(
        turns[0].contains("2 samples were already in the store"),
        "{stdout}"
    );
    assert!(
        turns[1].starts_with("2:\nevaluated 2 samples: correct 2"),
        "{stdout}"
    );
    assert!(
        turns[2].starts_with("3:\nevaluated 2 samples: correct 2"),
        "{stdout}"
    );
    for turn in ["turn-2", "turn-3"] {
        assert_eq!(stored_keys(&run.join(turn)), [(1, 1, 0), (1, 1, 1)]);
    }

    // The second turn's prompt: the problem, the first answer, the judge's feedback on it.
    let messages = second[0]["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    assert!(messages[0]["content"]
        .as_str()
        .unwrap()
        .contains("class Model"));
    assert!(messages[1]["content"]
        .as_str()
        .unwrap()
        .contains("leaky_relu_bug(x)"));
    let feedback = messages[2]["content"].as_str().unwrap();
    assert!(
        feedback.contains("output mismatch: max abs error")
            && feedback.contains("Fix the program."),
        "{feedback}"
    );
    let stored_feedback = std::fs::read_to_string(turn_2.join("feedback.jsonl")).unwrap();
    assert_eq!(stored_feedback.lines().count(), 2);
    assert!(
        stored_feedback.contains("output mismatch"),
        "{stored_feedback}"
    );
    let third = &endpoint.requests_of_turn(3)[0];
    let last = third["messages"].as_array().unwrap().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        last.contains("correct, speedup") && last.contains("Make it faster"),
        "{last}"
    );

    // The report counts the fix at turn 2: sample 0 correct from then on, both samples fixed.
    assert!(
        stdout.contains("### Level 1, turn by turn: scripted"),
        "{stdout}"
    );
    assert!(stdout.contains("| 1 | 2 | 0.0% |"), "{stdout}");
    assert!(stdout.contains("| 2 | 2 | 100.0% |"), "{stdout}");
    assert!(stdout.contains("| 2 (100.0%) | – | – |"), "{stdout}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    let rows = report["runs"][0]["levels"]["1"]["turns"]
        .as_array()
        .unwrap();
    let fixed: Vec<u64> = rows.iter().map(|r| r["fixed"].as_u64().unwrap()).collect();
    assert_eq!(fixed, [0, 2, 0]);

    // One turn beside three: the run's first turn alone, as a run of one turn has it.
    let once = dir.path().join("once");
    std::fs::create_dir(&once).unwrap();
    std::fs::copy(run.join("dice.db"), once.join("dice.db")).unwrap();
    let md = succeeded(&dice(&["report", path_arg(&once), path_arg(&run)]));
    assert!(
        md.contains("| Exec | 0.0% | 0.0% | 100.0% | 100.0% |"),
        "{md}"
    );
    assert!(
        md.contains(&format!("turn by turn: {}", path_arg(&run))),
        "{md}"
    );
    let one = succeeded(&dice(&["report", path_arg(&run)]));
    assert!(one.contains("### Level 1, turn by turn"), "{one}");
}

/// `--turns 3` with `--model` and against `dice serve` of the same tiny checkpoint: the
/// conversations (answers without code, then the judge's "no program" feedback) go through the
/// chat template alike, and every turn is stored with the same answers.
#[test]
fn three_turns_with_the_model_and_against_dice_serve_agree() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local");
    succeeded(&kernelbench(&local, &["--turns", "3"]));
    let mut server = TinyServer::start(6);
    let served = dir.path().join("served");
    let stdout = succeeded(&kernelbench_from(
        &["--endpoint", &server.endpoint, "--model-name", "tiny"],
        &served,
        &["--turns", "3"],
    ));
    assert!(server.wait_for_exit().success());
    assert!(stdout.contains("| 3 | 2 | 0.0% |"), "{stdout}");
    for turn in ["", "turn-2", "turn-3"] {
        let answers = |run: &Path| -> Vec<Value> {
            std::fs::read_to_string(run.join(turn).join("candidates.jsonl"))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let (mut a, mut b) = (answers(&local), answers(&served));
        let key = |c: &Value| c["problem_id"].as_u64();
        a.sort_by_key(key);
        b.sort_by_key(key);
        assert_eq!(a.len(), 2, "{turn}");
        assert_eq!(a, b, "{turn}");
        assert_eq!(stored_keys(&local.join(turn)), [(1, 1, 0), (1, 2, 0)]);
    }
    let feedback = std::fs::read_to_string(local.join("turn-3/feedback.jsonl")).unwrap();
    assert!(feedback.contains("no program"), "{feedback}");
}
