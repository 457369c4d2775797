//! What the audit's tests share: the adversarial suite's folder, and KernelBench problems and the
//! prompt's one-shot example from the repository's test data.

use dice_test_support::{repo_root, test_data};
use std::path::PathBuf;

/// `tests/adversarial` of the repository: hacks, each with the finding it must raise.
pub(crate) fn adversarial_dir() -> PathBuf {
    repo_root().join("tests/adversarial")
}

/// The source of KernelBench problem `level`/`id` from the test data.
pub(crate) fn problem_source(level: u32, id: u32) -> anyhow::Result<String> {
    use anyhow::Context;
    let dir = test_data().join(format!("kernelbench/level{level}"));
    let prefix = format!("{id}_");
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(&prefix) && name.ends_with(".py") {
            return std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()));
        }
    }
    anyhow::bail!("no problem {level}/{id} under {}", dir.display())
}

/// The DICE/KernelBench one-shot example as the prompt shows it: the add `Model` and the
/// elementwise-add `ModelNew`, cut out of the golden level-1 prompt.
pub(crate) fn prompt_example() -> anyhow::Result<(String, String)> {
    let path = test_data().join("sdar/golden/prompts/kernelbench_level1_1.user.txt");
    let prompt = std::fs::read_to_string(&path)?;
    let problem = fenced_after(&prompt, "The example given architecture is:")?;
    let candidate = fenced_after(
        &prompt,
        "The example new arch with custom CUDA kernels looks like this:",
    )?;
    Ok((problem, candidate))
}

fn fenced_after(text: &str, marker: &str) -> anyhow::Result<String> {
    let start = text
        .find(marker)
        .ok_or_else(|| anyhow::anyhow!("marker {marker:?} not in prompt"))?;
    let rest = &text[start..];
    let open = rest
        .find("```")
        .ok_or_else(|| anyhow::anyhow!("no fence after {marker:?}"))?;
    let body = &rest[open + 3..];
    let close = body
        .find("```")
        .ok_or_else(|| anyhow::anyhow!("unclosed fence after {marker:?}"))?;
    // Only the first line carries the prompt's f-string indentation.
    let mut lines = body[..close].lines().skip(1);
    let first = lines.next().unwrap_or("").trim_start();
    Ok(std::iter::once(first)
        .chain(lines)
        .collect::<Vec<_>>()
        .join("\n"))
}
