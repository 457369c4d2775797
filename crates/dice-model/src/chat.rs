//! Chat template rendering (spec §5.3) with minijinja, configured like transformers renders
//! templates (`trim_blocks`, `lstrip_blocks`, Python string methods via pycompat,
//! `raise_exception`).

use anyhow::{Context, Result};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

const TEMPLATE_NAME: &str = "chat_template";

pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// The template of a checkpoint directory: `chat_template.jinja`, else the `chat_template`
    /// string of `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let file = dir.join("chat_template.jinja");
        let source = if file.exists() {
            std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?
        } else {
            let config_path = dir.join("tokenizer_config.json");
            let text = std::fs::read_to_string(&config_path).with_context(|| {
                format!(
                    "{} has no chat_template.jinja and no readable tokenizer_config.json",
                    dir.display()
                )
            })?;
            let config: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
            config
                .get("chat_template")
                .and_then(Value::as_str)
                .with_context(|| format!("{} has no chat_template", config_path.display()))?
                .to_string()
        };
        Self::new(source)
    }

    pub fn new(source: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .context("the chat template does not parse")?;
        Ok(Self { env })
    }

    /// Renders `messages`; `kwargs` (a JSON object, e.g. `{"enable_thinking": false}`) become
    /// extra template variables, as keyword arguments of `apply_chat_template` do.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &Value,
    ) -> Result<String> {
        let mut context = serde_json::Map::new();
        if let Some(extra) = kwargs.as_object() {
            context.extend(extra.clone());
        } else if !kwargs.is_null() {
            anyhow::bail!("chat template arguments must be a JSON object, got {kwargs}");
        }
        context.insert("messages".into(), serde_json::to_value(messages)?);
        context.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        let template = self.env.get_template(TEMPLATE_NAME)?;
        template
            .render(minijinja::Value::from_serialize(&context))
            .context("cannot render the chat template")
    }
}
