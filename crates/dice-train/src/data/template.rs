//! LlamaFactory's `qwen3` template as the reference trains with it (spec §5.4): the string
//! slots of `template.py`, each slot tokenized on its own (`_convert_elements_to_ids`), and the
//! `ReasoningTemplate` rule with `enable_thinking` on: a response without think tags gets the
//! empty thought `<think>\n\n</think>\n\n` prepended, and it carries loss.

use super::source::{Conversation, Role};
use anyhow::{bail, Result};
use dice_model::SdarTokenizer;

const SYSTEM_SLOT: &str = "<|im_start|>system\n{{content}}<|im_end|>\n";
const USER_SLOT: &str = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n";
const ASSISTANT_SLOT: &str = "{{content}}<|im_end|>\n";
const OBSERVATION_SLOT: &str =
    "<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
/// The thought words `("<think>\n", "\n</think>\n\n")` around an empty thought.
const EMPTY_THOUGHT: &str = "<think>\n\n</think>\n\n";
const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// One encoded sample: token ids and which of them carry loss (their label is their own id,
/// unshifted; the others are labelled -100).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub input_ids: Vec<u32>,
    pub trained: Vec<bool>,
}

impl Sample {
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Labels as the reference's collator sees them: the id where trained, else -100.
    pub fn labels(&self) -> impl Iterator<Item = i64> + '_ {
        self.input_ids
            .iter()
            .zip(&self.trained)
            .map(|(&id, &trained)| if trained { i64::from(id) } else { -100 })
    }

    fn push(&mut self, ids: &[u32], trained: bool) {
        self.input_ids.extend_from_slice(ids);
        self.trained.extend(std::iter::repeat_n(trained, ids.len()));
    }
}

/// Encodes conversations with the `qwen3` training template.
pub struct Qwen3Encoder<'t> {
    tokenizer: &'t SdarTokenizer,
    empty_thought: Vec<u32>,
}

/// `StringFormatter.apply`: the first `{{content}}` of the slot becomes `content`; the user
/// slot is also given `idx`, so a literal `{{idx}}` in a user message becomes the turn index.
fn fill(slot: &str, content: &str, idx: Option<usize>) -> String {
    let filled = slot.replacen("{{content}}", content, 1);
    match idx {
        Some(idx) => filled.replacen("{{idx}}", &idx.to_string(), 1),
        None => filled,
    }
}

impl<'t> Qwen3Encoder<'t> {
    pub fn new(tokenizer: &'t SdarTokenizer) -> Result<Self> {
        let empty_thought = tokenizer.encode(EMPTY_THOUGHT)?;
        Ok(Self {
            tokenizer,
            empty_thought,
        })
    }

    pub fn tokenizer(&self) -> &SdarTokenizer {
        self.tokenizer
    }

    /// Token ids and loss mask of a conversation, as `encode_multiturn` and
    /// `_encode_data_example` build them without truncation: prompt turns unlabelled, every
    /// response labelled.
    pub fn encode(&self, conversation: &Conversation) -> Result<Sample> {
        let mut sample = Sample {
            input_ids: Vec::new(),
            trained: Vec::new(),
        };
        for (i, pair) in conversation.messages.chunks(2).enumerate() {
            let [prompt, response] = pair else {
                bail!("a conversation must end with a response turn");
            };
            let mut prompt_ids = Vec::new();
            if i == 0 && !conversation.system.is_empty() {
                prompt_ids =
                    self.tokenizer
                        .encode(&fill(SYSTEM_SLOT, &conversation.system, None))?;
            }
            let prompt_text = match prompt.role {
                Role::User => fill(USER_SLOT, &prompt.content, Some(i)),
                Role::Observation => fill(OBSERVATION_SLOT, &prompt.content, None),
                role => bail!("turn {}: a {role:?} turn cannot be a prompt", 2 * i + 1),
            };
            prompt_ids.extend(self.tokenizer.encode(&prompt_text)?);
            if response.role != Role::Assistant {
                bail!("turn {}: function-call turns are not supported", 2 * i + 2);
            }
            sample.push(&prompt_ids, false);
            let content = &response.content;
            if !content.contains(THINK_OPEN) && !content.contains(THINK_CLOSE) {
                sample.push(&self.empty_thought, true);
            }
            sample.push(
                &self
                    .tokenizer
                    .encode(&fill(ASSISTANT_SLOT, content, None))?,
                true,
            );
        }
        Ok(sample)
    }
}
