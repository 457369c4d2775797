//! `dice tokenize` and `dice detokenize`: a model directory's tokenizer and chat template from
//! the command line.

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use dice_model::chat::ChatMessage;
use dice_model::{ChatTemplate, SdarTokenizer};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OutputFormat {
    /// Token ids separated by commas.
    Plain,
    /// `{"text": <the exact text tokenized>, "ids": [...]}`.
    Json,
}

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["text", "text_file"]))]
pub(crate) struct TokenizeArgs {
    /// Model directory with tokenizer.json, or vocab.json + merges.txt + tokenizer_config.json
    /// (and chat_template.jinja or a chat_template in tokenizer_config.json for --chat).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Text to tokenize, used exactly as given.
    #[arg(long, value_name = "TEXT")]
    pub text: Option<String>,
    /// File whose bytes are the text (no newline translation, no trimming; must be UTF-8).
    #[arg(long, value_name = "FILE")]
    pub text_file: Option<PathBuf>,
    /// Treat the text as one user message and render it with the model's chat template and
    /// the generation prompt (`<|im_start|>assistant\n`) before tokenizing.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message placed before the user message.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub system: Option<String>,
    /// With --chat: render with enable_thinking=false, which appends an empty
    /// `<think>\n\n</think>\n\n` block after the generation prompt.
    #[arg(long, requires = "chat")]
    pub no_thinking: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Plain)]
    pub format: OutputFormat,
}

#[derive(Debug, Args)]
pub(crate) struct DetokenizeArgs {
    /// Model directory with the tokenizer files (as for `dice tokenize`).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Token ids separated by commas, e.g. 151644,872,198.
    #[arg(long, value_name = "IDS", value_delimiter = ',', num_args = 1.., required = true)]
    pub ids: Vec<u32>,
    /// Drop special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <|MASK|>, ...); non-special
    /// added tokens such as <think> are kept.
    #[arg(long)]
    pub skip_special: bool,
}

/// JSON output; a struct so that `text` comes before `ids`.
#[derive(serde::Serialize)]
struct TokenizeOutput<'a> {
    text: &'a str,
    ids: &'a [u32],
}

fn read_text(a: &TokenizeArgs) -> Result<String> {
    match (&a.text, &a.text_file) {
        (Some(text), _) => Ok(text.clone()),
        (None, Some(path)) => {
            let bytes =
                std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            String::from_utf8(bytes).map_err(|e| {
                anyhow::anyhow!(
                    "{} is not valid UTF-8 (invalid byte at offset {}); convert it to UTF-8 first",
                    path.display(),
                    e.utf8_error().valid_up_to()
                )
            })
        }
        (None, None) => anyhow::bail!("give the text with --text or --text-file"),
    }
}

fn chat_text(a: &TokenizeArgs, user: &str) -> Result<String> {
    let template = ChatTemplate::from_dir(&a.model)?;
    let mut messages = Vec::new();
    if let Some(system) = &a.system {
        messages.push(ChatMessage::new("system", system));
    }
    messages.push(ChatMessage::new("user", user));
    let kwargs = if a.no_thinking {
        serde_json::json!({"enable_thinking": false})
    } else {
        serde_json::json!({})
    };
    template.render(&messages, true, &kwargs)
}

pub(crate) fn run_tokenize(a: TokenizeArgs) -> Result<()> {
    let tokenizer = SdarTokenizer::from_dir(&a.model)?;
    let text = read_text(&a)?;
    let text = if a.chat { chat_text(&a, &text)? } else { text };
    let ids = tokenizer.encode(&text)?;
    let out = match a.format {
        OutputFormat::Plain => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        OutputFormat::Json => serde_json::to_string(&TokenizeOutput {
            text: &text,
            ids: &ids,
        })?,
    };
    println!("{out}");
    Ok(())
}

/// Prints the decoded text exactly, without a trailing newline.
pub(crate) fn run_detokenize(a: DetokenizeArgs) -> Result<()> {
    let tokenizer = SdarTokenizer::from_dir(&a.model)?;
    let text = tokenizer.decode(&a.ids, a.skip_special)?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}
