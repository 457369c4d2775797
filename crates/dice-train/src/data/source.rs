//! Where SFT records come from and what they say: LlamaFactory's `dataset_info.json` entries
//! (alpaca or sharegpt formatting, `columns` and `tags` mappings) and plain JSON / JSON Lines
//! files, turned into conversations as LlamaFactory's converters turn them.

use anyhow::{bail, ensure, Context, Result};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt;
use std::path::{Path, PathBuf};

/// Where a record is: its file, the line it starts on and, in a JSON array, its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    /// 1-based line the record starts on.
    pub line: usize,
    /// 1-based index of the record in a JSON array; `None` in JSON Lines, where the line says it.
    pub array_index: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} line {}", self.file.display(), self.line)?;
        if let Some(index) = self.array_index {
            write!(f, " (record {index})")?;
        }
        Ok(())
    }
}

/// One record of a dataset file: a JSON object and where it is.
#[derive(Debug, Clone)]
pub struct Record {
    pub location: Location,
    pub fields: Map<String, Value>,
}

/// Column names of an alpaca dataset (LlamaFactory's `DatasetAttr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlpacaColumns {
    pub prompt: Option<String>,
    pub query: Option<String>,
    pub response: String,
    pub history: Option<String>,
    pub system: Option<String>,
    pub tools: Option<String>,
}

/// Column names and role tags of a sharegpt dataset (LlamaFactory's `DatasetAttr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharegptColumns {
    pub messages: String,
    pub system: Option<String>,
    pub tools: Option<String>,
    pub role_tag: String,
    pub content_tag: String,
    pub user_tag: Option<String>,
    pub assistant_tag: Option<String>,
    pub observation_tag: Option<String>,
    pub function_tag: Option<String>,
    pub system_tag: Option<String>,
}

impl Default for SharegptColumns {
    /// LlamaFactory's defaults: `conversations` of `{"from": "human" | "gpt" | ..., "value": ...}`.
    fn default() -> Self {
        Self {
            messages: "conversations".into(),
            system: None,
            tools: None,
            role_tag: "from".into(),
            content_tag: "value".into(),
            user_tag: Some("human".into()),
            assistant_tag: Some("gpt".into()),
            observation_tag: Some("observation".into()),
            function_tag: Some("function_call".into()),
            system_tag: Some("system".into()),
        }
    }
}

/// How a dataset's records are laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Formatting {
    Alpaca(AlpacaColumns),
    Sharegpt(SharegptColumns),
}

/// One dataset: its name, its files (read in this order) and their layout.
#[derive(Debug, Clone)]
pub struct DatasetSpec {
    pub name: String,
    pub files: Vec<PathBuf>,
    pub formatting: Formatting,
}

/// Speaker of a message, as LlamaFactory's `Role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
    Observation,
    Function,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

/// A record as LlamaFactory's converters leave it: a system text and alternating turns,
/// prompt turns at even indices and the responses at odd ones, ending with a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    pub system: String,
    pub messages: Vec<Message>,
}

/// Why a record yields no sample. The first four are the records LlamaFactory skips with a
/// warning; the last is `truncate_mode: drop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DropReason {
    /// An alpaca record whose response column is missing or null.
    NoResponse,
    /// A sharegpt record without turns (or with only a system turn).
    NoTurns,
    /// A sharegpt turn whose role is unknown or out of the user/assistant alternation.
    RoleOrder,
    /// A sharegpt conversation with an odd number of turns (it does not end with a response).
    TurnCount,
    /// Longer than the cutoff after block padding.
    TooLong,
}

impl DropReason {
    pub fn describe(self) -> &'static str {
        match self {
            DropReason::NoResponse => "without a response",
            DropReason::NoTurns => "without turns",
            DropReason::RoleOrder => "with roles out of the user/assistant order",
            DropReason::TurnCount => "without a final response turn",
            DropReason::TooLong => "longer than the cutoff",
        }
    }
}

/// What a record converts to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Converted {
    Sample(Conversation),
    Dropped(DropReason),
}

/// Datasets to train on: the `names` of a `dataset_info.json` (a file, or a folder holding
/// one) in the order given, then plain `files` in the order given. They are concatenated, as
/// LlamaFactory's `mix_strategy: concat` does.
pub fn select_datasets(
    files: &[PathBuf],
    dataset_info: Option<&Path>,
    names: &[String],
) -> Result<Vec<DatasetSpec>> {
    let mut specs = match dataset_info {
        Some(info) => DatasetSpec::from_dataset_info(info, names)?,
        None if names.is_empty() => Vec::new(),
        None => bail!(
            "datasets are named ({}) but no dataset_info.json is given",
            names.join(", ")
        ),
    };
    for file in files {
        specs.push(DatasetSpec::from_file(file)?);
    }
    ensure!(
        !specs.is_empty(),
        "no training data: give data files or named datasets"
    );
    Ok(specs)
}

/// Keys of a `dataset_info.json` entry that point outside local files.
const REMOTE_KEYS: [&str; 4] = ["hf_hub_url", "ms_hub_url", "om_hub_url", "script_url"];

fn optional_string(entry: &Map<String, Value>, key: &str, what: &str) -> Result<Option<String>> {
    match entry.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => bail!("{what}: \"{key}\" must be a string, got {other}"),
    }
}

/// A mapping's value for `key`: LlamaFactory sets every attribute from the mapping when the
/// mapping is present, so a key the mapping omits is unset, not its default.
fn mapped(
    mapping: Option<&Map<String, Value>>,
    key: &str,
    default: Option<&str>,
    what: &str,
) -> Result<Option<String>> {
    match mapping {
        Some(mapping) => optional_string(mapping, key, what),
        None => Ok(default.map(str::to_string)),
    }
}

fn object<'v>(
    entry: &'v Map<String, Value>,
    key: &str,
    what: &str,
) -> Result<Option<&'v Map<String, Value>>> {
    match entry.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(map)) => Ok(Some(map)),
        Some(other) => bail!("{what}: \"{key}\" must be an object, got {other}"),
    }
}

impl DatasetSpec {
    /// The datasets `names` of a `dataset_info.json`; `path` is the file or the folder holding
    /// it. `file_name` is relative to that folder and may name a folder, whose files are read
    /// in name order.
    pub fn from_dataset_info(path: &Path, names: &[String]) -> Result<Vec<DatasetSpec>> {
        let file = if path.is_dir() {
            path.join("dataset_info.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        let info: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", file.display()))?;
        let info = info.as_object().with_context(|| {
            format!("{}: expected an object of datasets by name", file.display())
        })?;
        let dir = file.parent().unwrap_or(Path::new(""));
        ensure!(
            !names.is_empty(),
            "{}: name the datasets to use",
            file.display()
        );
        names
            .iter()
            .map(|name| {
                let what = format!("{} dataset \"{name}\"", file.display());
                let entry = info.get(name).and_then(Value::as_object).with_context(|| {
                    let known: Vec<&str> = info.keys().map(String::as_str).collect();
                    format!(
                        "{}: no dataset \"{name}\" (it defines: {})",
                        file.display(),
                        known.join(", ")
                    )
                })?;
                Self::from_entry(name, entry, dir, &what)
            })
            .collect()
    }

    fn from_entry(name: &str, entry: &Map<String, Value>, dir: &Path, what: &str) -> Result<Self> {
        if let Some(key) = REMOTE_KEYS.iter().find(|k| entry.contains_key(**k)) {
            bail!(
                "{what}: \"{key}\" datasets are not supported; download it and set \"file_name\""
            );
        }
        if entry.get("ranking").and_then(Value::as_bool) == Some(true) {
            bail!("{what}: a ranking (preference) dataset is not supervised fine-tuning data");
        }
        if entry.get("num_samples").is_some_and(|v| !v.is_null()) {
            bail!("{what}: \"num_samples\" is not supported; select the records in the file");
        }
        let file_name = optional_string(entry, "file_name", what)?
            .with_context(|| format!("{what}: \"file_name\" is missing"))?;
        let files = dataset_files(&dir.join(file_name))?;
        let formatting = optional_string(entry, "formatting", what)?;
        let columns = object(entry, "columns", what)?;
        let tags = object(entry, "tags", what)?;
        let col = |key: &str, default: Option<&str>| mapped(columns, key, default, what);
        let formatting = match formatting.as_deref().unwrap_or("alpaca") {
            "alpaca" => Formatting::Alpaca(AlpacaColumns {
                prompt: col("prompt", Some("instruction"))?,
                query: col("query", Some("input"))?,
                response: col("response", Some("output"))?
                    .with_context(|| format!("{what}: \"columns\" has no \"response\""))?,
                history: col("history", None)?,
                system: col("system", None)?,
                tools: col("tools", None)?,
            }),
            "sharegpt" => {
                let defaults = SharegptColumns::default();
                let tag = |key: &str, default: &Option<String>| {
                    mapped(tags, key, default.as_deref(), what)
                };
                Formatting::Sharegpt(SharegptColumns {
                    messages: col("messages", Some(&defaults.messages))?
                        .with_context(|| format!("{what}: \"columns\" has no \"messages\""))?,
                    system: col("system", None)?,
                    tools: col("tools", None)?,
                    role_tag: tag("role_tag", &Some(defaults.role_tag))?
                        .with_context(|| format!("{what}: \"tags\" has no \"role_tag\""))?,
                    content_tag: tag("content_tag", &Some(defaults.content_tag))?
                        .with_context(|| format!("{what}: \"tags\" has no \"content_tag\""))?,
                    user_tag: tag("user_tag", &defaults.user_tag)?,
                    assistant_tag: tag("assistant_tag", &defaults.assistant_tag)?,
                    observation_tag: tag("observation_tag", &defaults.observation_tag)?,
                    function_tag: tag("function_tag", &defaults.function_tag)?,
                    system_tag: tag("system_tag", &defaults.system_tag)?,
                })
            }
            other => bail!("{what}: formatting \"{other}\" is not supported (alpaca or sharegpt)"),
        };
        Ok(Self {
            name: name.to_string(),
            files,
            formatting,
        })
    }

    /// A plain JSON / JSON Lines file, its layout told by its first record: `messages`
    /// (role/content messages), `conversations` (sharegpt), `instruction` (alpaca) or
    /// `prompt` + `response`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let records = read_records(path)?;
        let first = &records[0];
        let has = |key: &str| first.fields.contains_key(key);
        let formatting = if has("messages") {
            Formatting::Sharegpt(SharegptColumns {
                messages: "messages".into(),
                system: Some("system".into()),
                tools: None,
                role_tag: "role".into(),
                content_tag: "content".into(),
                user_tag: Some("user".into()),
                assistant_tag: Some("assistant".into()),
                observation_tag: Some("tool".into()),
                function_tag: None,
                system_tag: Some("system".into()),
            })
        } else if has("conversations") {
            Formatting::Sharegpt(SharegptColumns::default())
        } else if has("instruction") {
            Formatting::Alpaca(AlpacaColumns {
                prompt: Some("instruction".into()),
                query: Some("input".into()),
                response: "output".into(),
                history: Some("history".into()),
                system: Some("system".into()),
                tools: None,
            })
        } else if has("prompt") && has("response") {
            Formatting::Alpaca(AlpacaColumns {
                prompt: Some("prompt".into()),
                query: None,
                response: "response".into(),
                history: None,
                system: Some("system".into()),
                tools: None,
            })
        } else {
            bail!(
                "{}: cannot tell the layout: records need \"messages\", \"conversations\", \
                 \"instruction\" + \"output\" or \"prompt\" + \"response\" (or describe the file \
                 in a dataset_info.json)",
                first.location
            );
        };
        Ok(Self {
            name: path.display().to_string(),
            files: vec![path.to_path_buf()],
            formatting,
        })
    }

    /// Every record of the dataset's files, in order.
    pub fn read(&self) -> Result<Vec<Record>> {
        let mut records = Vec::new();
        for file in &self.files {
            records.extend(read_records(file)?);
        }
        Ok(records)
    }

    /// The conversation of `record`, or why LlamaFactory would skip it; malformed records
    /// (a column of the wrong type, a message without a role) are errors naming the record.
    pub fn convert(&self, record: &Record) -> Result<Converted> {
        let at = &record.location;
        match &self.formatting {
            Formatting::Alpaca(columns) => convert_alpaca(columns, record)
                .with_context(|| format!("{at}: dataset \"{}\"", self.name)),
            Formatting::Sharegpt(columns) => convert_sharegpt(columns, record)
                .with_context(|| format!("{at}: dataset \"{}\"", self.name)),
        }
    }
}

/// The files a `file_name` stands for: itself, or the files of a folder in name order.
fn dataset_files(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        ensure!(path.exists(), "{} does not exist", path.display());
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in
        std::fs::read_dir(path).with_context(|| format!("cannot list {}", path.display()))?
    {
        let entry = entry.with_context(|| format!("cannot list {}", path.display()))?;
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        if entry.path().is_file() && !hidden {
            files.push(entry.path());
        }
    }
    files.sort();
    ensure!(!files.is_empty(), "{} holds no data files", path.display());
    Ok(files)
}

/// Newlines in `bytes`.
fn newlines(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b == b'\n').count()
}

fn as_object(value: Value, location: &Location) -> Result<Map<String, Value>> {
    match value {
        Value::Object(map) => Ok(map),
        other => bail!(
            "{location}: a record must be a JSON object, got {}",
            kind(&other)
        ),
    }
}

/// Records of a JSON file: an array of objects, or JSON Lines (one object per line), told
/// apart by the first character as the `datasets` JSON loader does.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    if let Some(ext @ ("csv" | "parquet" | "arrow" | "txt")) =
        path.extension().and_then(|e| e.to_str())
    {
        bail!(
            "{}: .{ext} files are not supported; convert the data to JSON or JSON Lines",
            path.display()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let offset = e.utf8_error().valid_up_to();
        anyhow::anyhow!(
            "{} line {}: the file is not valid UTF-8",
            path.display(),
            newlines(&e.as_bytes()[..offset]) + 1
        )
    })?;
    let location = |line, array_index| Location {
        file: path.to_path_buf(),
        line,
        array_index,
    };
    let mut records = Vec::new();
    if text.trim_start().starts_with('[') {
        let raw: Vec<&RawValue> = serde_json::from_str(&text).map_err(|e| {
            anyhow::anyhow!("{} line {}: invalid JSON: {e}", path.display(), e.line())
        })?;
        // Records come in file order: count lines from one record to the next.
        let (mut line, mut counted) = (1, 0);
        for (i, value) in raw.into_iter().enumerate() {
            let offset = value.get().as_ptr() as usize - text.as_ptr() as usize;
            line += newlines(&text.as_bytes()[counted..offset]);
            counted = offset;
            let location = location(line, Some(i + 1));
            let value: Value =
                serde_json::from_str(value.get()).expect("a parsed JSON value parses again");
            let fields = as_object(value, &location)?;
            records.push(Record { location, fields });
        }
    } else {
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let location = location(n + 1, None);
            let value: Value = serde_json::from_str(line).map_err(|e| {
                if serde_json::from_str::<Value>(&text).is_ok() {
                    anyhow::anyhow!(
                        "{}: expected a JSON array of records or JSON Lines (one record per line), \
                         found one JSON value over several lines",
                        path.display()
                    )
                } else {
                    anyhow::anyhow!("{location}: invalid JSON: {e}")
                }
            })?;
            let fields = as_object(value, &location)?;
            records.push(Record { location, fields });
        }
    }
    ensure!(!records.is_empty(), "{} holds no records", path.display());
    Ok(records)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A string field that may be absent or null.
fn text_field<'r>(fields: &'r Map<String, Value>, column: &str) -> Result<Option<&'r str>> {
    match fields.get(column) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => bail!("\"{column}\" must be a string, got {}", kind(other)),
    }
}

/// A field that must be absent, null or empty: tool descriptions change the system prompt in
/// a way this encoder does not reproduce.
fn no_tools(fields: &Map<String, Value>, column: Option<&str>) -> Result<()> {
    let Some(column) = column else {
        return Ok(());
    };
    match fields.get(column) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s.is_empty() => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => Ok(()),
        Some(_) => bail!("\"{column}\": tool descriptions are not supported"),
    }
}

fn convert_alpaca(columns: &AlpacaColumns, record: &Record) -> Result<Converted> {
    let fields = &record.fields;
    no_tools(fields, columns.tools.as_deref())?;
    let mut messages = Vec::new();
    if let Some(history) = &columns.history {
        match fields.get(history) {
            None | Some(Value::Null) => {}
            Some(Value::Array(turns)) => {
                for (i, turn) in turns.iter().enumerate() {
                    let pair = turn.as_array().filter(|p| p.len() == 2);
                    let pair = pair.and_then(|p| Some((p[0].as_str()?, p[1].as_str()?)));
                    let (prompt, response) = pair.with_context(|| {
                        format!(
                            "\"{history}\" turn {}: expected [prompt, response] strings",
                            i + 1
                        )
                    })?;
                    messages.push(Message {
                        role: Role::User,
                        content: prompt.into(),
                    });
                    messages.push(Message {
                        role: Role::Assistant,
                        content: response.into(),
                    });
                }
            }
            Some(other) => bail!(
                "\"{history}\" must be an array of [prompt, response] pairs, got {}",
                kind(other)
            ),
        }
    }
    // "prompt\nquery", empty parts left out.
    let mut query = Vec::new();
    for column in [&columns.prompt, &columns.query].into_iter().flatten() {
        if let Some(text) = text_field(fields, column)?.filter(|t| !t.is_empty()) {
            query.push(text);
        }
    }
    messages.push(Message {
        role: Role::User,
        content: query.join("\n"),
    });
    let Some(response) = text_field(fields, &columns.response)? else {
        return Ok(Converted::Dropped(DropReason::NoResponse));
    };
    messages.push(Message {
        role: Role::Assistant,
        content: response.into(),
    });
    let system = match &columns.system {
        Some(column) => text_field(fields, column)?.unwrap_or_default().to_string(),
        None => String::new(),
    };
    Ok(Converted::Sample(Conversation { system, messages }))
}

fn convert_sharegpt(columns: &SharegptColumns, record: &Record) -> Result<Converted> {
    let fields = &record.fields;
    no_tools(fields, columns.tools.as_deref())?;
    let list = match fields.get(&columns.messages) {
        Some(Value::Array(list)) => list,
        None | Some(Value::Null) => bail!("\"{}\" is missing", columns.messages),
        Some(other) => bail!(
            "\"{}\" must be an array of messages, got {}",
            columns.messages,
            kind(other)
        ),
    };
    let mut turns = Vec::with_capacity(list.len());
    for (i, message) in list.iter().enumerate() {
        let what = || format!("\"{}\" message {}", columns.messages, i + 1);
        let message = message
            .as_object()
            .with_context(|| format!("{}: must be an object, got {}", what(), kind(message)))?;
        let role = text_field(message, &columns.role_tag)
            .with_context(what)?
            .with_context(|| format!("{}: \"{}\" is missing", what(), columns.role_tag))?;
        let content = text_field(message, &columns.content_tag)
            .with_context(what)?
            .with_context(|| format!("{}: \"{}\" is missing", what(), columns.content_tag))?;
        turns.push((role, content));
    }
    let is = |tag: &Option<String>, role: &str| tag.as_deref() == Some(role);
    let mut system = String::new();
    if turns
        .first()
        .is_some_and(|(role, _)| is(&columns.system_tag, role))
    {
        system = turns.remove(0).1.to_string();
    } else if let Some(column) = &columns.system {
        system = text_field(fields, column)?.unwrap_or_default().to_string();
    }
    let mut messages = Vec::with_capacity(turns.len());
    for (i, (role, content)) in turns.into_iter().enumerate() {
        // Prompt turns (user, tool output) at even indices, responses (assistant, function
        // call) at odd ones.
        let role = match i % 2 {
            0 if is(&columns.user_tag, role) => Role::User,
            0 if is(&columns.observation_tag, role) => Role::Observation,
            1 if is(&columns.assistant_tag, role) => Role::Assistant,
            1 if is(&columns.function_tag, role) => Role::Function,
            _ => return Ok(Converted::Dropped(DropReason::RoleOrder)),
        };
        messages.push(Message {
            role,
            content: content.to_string(),
        });
    }
    if messages.len() % 2 != 0 {
        return Ok(Converted::Dropped(DropReason::TurnCount));
    }
    if messages.is_empty() {
        return Ok(Converted::Dropped(DropReason::NoTurns));
    }
    Ok(Converted::Sample(Conversation { system, messages }))
}
