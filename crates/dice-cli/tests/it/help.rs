//! `dice --help` and every subcommand's `--help` describe every subcommand, argument and flag.
//!
//! The crate is a binary without a library to hand out its clap tree, so the test reads the
//! help a user reads: it walks the `Commands:` sections down from `dice --help` and requires of
//! every entry of the `Commands:`, `Arguments:` and `Options:` sections some words of its own
//! beside clap's notes (`[default: …]`, `[possible values: …]`).

use std::process::Command;

/// Notes clap appends to a description by itself.
const CLAP_NOTES: [&str; 5] = [
    "[default: ",
    "[possible values: ",
    "[env: ",
    "[aliases: ",
    "[short aliases: ",
];

/// An entry of a help section: `--device <DEVICE>` and whatever text the help gives it.
#[derive(Debug)]
struct Entry {
    section: String,
    spec: String,
    description: String,
}

impl Entry {
    /// The description up to clap's notes, without the listed possible values.
    fn own_words(&self) -> &str {
        let end = CLAP_NOTES
            .iter()
            .filter_map(|note| self.description.find(note))
            .min()
            .unwrap_or(self.description.len());
        self.description[..end].trim()
    }
}

/// The entries of a help text, in both of clap's layouts: the description on the entry's line
/// (continued on lines indented to its column) or on the lines below it, indented further.
fn entries(help: &str) -> Vec<Entry> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut section = None;
    let mut in_possible_values = false;
    for line in help.lines() {
        let text = line.trim();
        if text.is_empty() {
            in_possible_values = false;
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        if indent == 0 {
            section = ["Commands:", "Arguments:", "Options:"]
                .contains(&text)
                .then(|| text.trim_end_matches(':').to_string());
            continue;
        }
        let Some(section) = &section else {
            continue;
        };
        // Entries start at column 2 (6 for long-only flags); descriptions lie further right.
        if indent <= 6 {
            let (spec, description) = text.split_once("  ").unwrap_or((text, ""));
            entries.push(Entry {
                section: section.clone(),
                spec: spec.to_string(),
                description: description.trim().to_string(),
            });
            in_possible_values = false;
        } else if text == "Possible values:" {
            in_possible_values = true;
        } else if let (false, Some(entry)) = (in_possible_values, entries.last_mut()) {
            entry.description.push(' ');
            entry.description.push_str(text);
        }
    }
    entries
}

fn help(command: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_dice"))
        .args(command)
        .arg("--help")
        .output()
        .expect("the dice binary runs");
    assert!(
        out.status.success(),
        "dice {} --help: {}",
        command.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

#[test]
fn every_command_argument_and_flag_has_help() {
    let mut seen = Vec::new();
    let mut undescribed = Vec::new();
    let mut commands = vec![Vec::<String>::new()];
    while let Some(command) = commands.pop() {
        for entry in entries(&help(&command)) {
            let name = format!("dice {} {}", command.join(" "), entry.spec);
            if entry.own_words().is_empty() {
                undescribed.push(name.clone());
            }
            if entry.section == "Commands" && entry.spec != "help" {
                let mut sub = command.clone();
                sub.push(entry.spec.clone());
                commands.push(sub);
            }
            seen.push(name);
        }
    }
    // The walk reached the leaves (and did not pass for want of entries).
    for flag in [
        "dice eval --device <DEVICE>",
        "dice bench golden --dtype <DTYPE>",
    ] {
        assert!(
            seen.iter().any(|s| s == flag),
            "{flag} not seen in {seen:#?}"
        );
    }
    assert!(
        undescribed.is_empty(),
        "entries of --help without a description:\n{}",
        undescribed.join("\n")
    );
}

#[test]
fn entries_without_words_of_their_own_are_found_in_both_layouts() {
    let same_line = "\
Usage: dice eval [OPTIONS]

Arguments:
  [CANDIDATES]...  Candidate files, folders of kernel files, or
                   JSONL files

Options:
      --device <DEVICE>         [default: cpu] [possible values: cpu, cuda]
      --tolerance <TOL>         atol = rtol of the correctness check
                                [default: 0.01]
  -h, --help                    Print help

Examples:
  dice eval runs/ --run out/
";
    let next_line = "\
Options:
      --format <FORMAT>
          Possible values:
          - text: One line per problem
          - json: A JSON array
          \n          [default: text]

      --level <L>
          Only this level

  -h, --help
          Print help (see a summary with '-h')
";
    let described = |help: &str| -> Vec<(String, bool)> {
        entries(help)
            .iter()
            .map(|e| (e.spec.clone(), !e.own_words().is_empty()))
            .collect()
    };
    let expected = |pairs: &[(&str, bool)]| -> Vec<(String, bool)> {
        pairs.iter().map(|&(s, d)| (s.to_string(), d)).collect()
    };
    assert_eq!(
        described(same_line),
        expected(&[
            ("[CANDIDATES]...", true),
            ("--device <DEVICE>", false),
            ("--tolerance <TOL>", true),
            ("-h, --help", true),
        ])
    );
    assert_eq!(
        described(next_line),
        expected(&[
            ("--format <FORMAT>", false),
            ("--level <L>", true),
            ("-h, --help", true),
        ])
    );
}
