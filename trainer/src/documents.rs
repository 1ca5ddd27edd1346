//! Document datasets for training: rows of JSONL or Parquet holding plain `text`
//! (continued pre-training), `prompt` + `response`, or chat `messages` (instruction
//! tuning), turned into text segments that carry loss or not, and packed token streams
//! cut into training rows where attention and loss stay inside each document.
//!
//! Pure: a row's JSON in, [`Record`]s and [`Segment`]s out; token ids in, [`Packed`] rows
//! out. Tokenizing and reading files is the executor's (regatta-torch).

use serde_json::Value;

/// The target id that carries no loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// Why a row or a chat template cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DocumentError {
    /// The row is not an object with one of the known shapes.
    #[error("{0}")]
    Row(String),
    /// The chat template is missing, does not parse or does not render.
    #[error("chat template: {0}")]
    Template(String),
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, or whatever the template knows.
    pub role: String,
    /// The message's text.
    pub content: String,
}

/// What one dataset row holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// Plain text: every token carries loss.
    Text(String),
    /// A prompt and its response: only the response carries loss.
    Instruction {
        /// The prompt.
        prompt: String,
        /// The response the model learns.
        response: String,
    },
    /// A conversation: only the assistant messages carry loss.
    Chat(Vec<Message>),
}

fn text_field(object: &serde_json::Map<String, Value>, field: &str) -> Result<Option<String>, DocumentError> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(DocumentError::Row(format!(
            "`{field}` must be a string, not {}",
            short(other)
        ))),
    }
}

fn short(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(60) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

impl Record {
    /// Reads a row: `messages` (a list of `{role, content}`), else `prompt` with
    /// `response`, else `text`. Empty text is refused: it would train on nothing.
    pub fn parse(value: &Value) -> Result<Self, DocumentError> {
        let object = value
            .as_object()
            .ok_or_else(|| DocumentError::Row(format!("a row must be a JSON object, not {}", short(value))))?;
        if let Some(messages) = object.get("messages").filter(|v| !v.is_null()) {
            return Self::chat(messages);
        }
        let prompt = text_field(object, "prompt")?;
        let response = text_field(object, "response")?;
        match (prompt, response) {
            (Some(prompt), Some(response)) if !response.is_empty() => {
                return Ok(Self::Instruction { prompt, response })
            }
            (Some(_), Some(_)) => return Err(DocumentError::Row("`response` is empty".into())),
            (Some(_), None) => return Err(DocumentError::Row("`prompt` has no `response` beside it".into())),
            (None, Some(_)) => return Err(DocumentError::Row("`response` has no `prompt` beside it".into())),
            (None, None) => {}
        }
        match text_field(object, "text")? {
            Some(text) if !text.is_empty() => Ok(Self::Text(text)),
            Some(_) => Err(DocumentError::Row("`text` is empty".into())),
            None => Err(DocumentError::Row(
                "no `text`, `prompt`/`response` or `messages` field".into(),
            )),
        }
    }

    fn chat(messages: &Value) -> Result<Self, DocumentError> {
        let list = messages
            .as_array()
            .ok_or_else(|| DocumentError::Row(format!("`messages` must be a list, not {}", short(messages))))?;
        let mut out = Vec::with_capacity(list.len());
        for (i, message) in list.iter().enumerate() {
            let field = |name: &str| {
                message
                    .get(name)
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| {
                        DocumentError::Row(format!(
                            "messages[{i}] needs a string `{name}` (got {})",
                            short(message)
                        ))
                    })
            };
            out.push(Message {
                role: field("role")?,
                content: field("content")?,
            });
        }
        if !out.iter().any(|m| m.role == "assistant") {
            return Err(DocumentError::Row(
                "`messages` has no assistant message: nothing to learn".into(),
            ));
        }
        Ok(Self::Chat(out))
    }
}

/// A piece of a document's text and whether its tokens carry loss.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    /// The text.
    pub text: String,
    /// Whether the model learns to produce it.
    pub loss: bool,
}

impl Segment {
    fn new(text: impl Into<String>, loss: bool) -> Self {
        Self {
            text: text.into(),
            loss,
        }
    }
}

/// The special tokens and chat template of a `tokenizer_config.json`.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSettings {
    /// The beginning-of-sequence token's text.
    pub bos_token: Option<String>,
    /// The end-of-sequence token's text.
    pub eos_token: Option<String>,
    /// Whether the tokenizer puts a BOS token before every text (`add_bos_token`).
    pub add_bos_token: bool,
    /// The Jinja chat template.
    pub chat_template: Option<String>,
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl TokenizerSettings {
    /// Reads a `tokenizer_config.json` (its `chat_template` may be a string or, as some
    /// models ship it, a list of named templates: `default` is taken).
    pub fn from_json(value: &Value) -> Self {
        let chat_template = match value.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        };
        Self {
            bos_token: token_text(value.get("bos_token")),
            eos_token: token_text(value.get("eos_token")),
            add_bos_token: value.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false),
            chat_template,
        }
    }

    /// The segments of a record: BOS (when the tokenizer adds one) and text or prompt
    /// without loss, then the learned text and EOS with loss. Chats go through the
    /// template.
    pub fn segments(&self, record: &Record) -> Result<Vec<Segment>, DocumentError> {
        let bos = || {
            self.bos_token
                .as_ref()
                .filter(|_| self.add_bos_token)
                .map(|b| Segment::new(b.clone(), false))
        };
        let eos = || self.eos_token.as_ref().map(|e| Segment::new(e.clone(), true));
        let out = match record {
            Record::Text(text) => bos()
                .into_iter()
                .chain([Segment::new(text.clone(), true)])
                .chain(eos())
                .collect(),
            Record::Instruction { prompt, response } => bos()
                .into_iter()
                .chain([
                    Segment::new(prompt.clone(), false),
                    Segment::new(response.clone(), true),
                ])
                .chain(eos())
                .collect(),
            Record::Chat(messages) => self.chat_segments(messages)?,
        };
        Ok(out)
    }

    /// The text a model continues for a conversation: the chat template rendered with the
    /// generation prompt added (what `apply_chat_template(..., add_generation_prompt=True)`
    /// gives).
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<String, DocumentError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            DocumentError::Template(
                "rows with `messages` need a chat_template in the model's tokenizer_config.json".into(),
            )
        })?;
        ChatRenderer::new(template, self)?.render(messages, true)
    }

    /// The text of a whole conversation, as `apply_chat_template(..., tokenize=False)`
    /// renders it without a generation prompt (what scoring a chat row reads).
    pub fn chat_text(&self, messages: &[Message]) -> Result<String, DocumentError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            DocumentError::Template(
                "rows with `messages` need a chat_template in the model's tokenizer_config.json".into(),
            )
        })?;
        ChatRenderer::new(template, self)?.render(messages, false)
    }

    /// Renders the conversation one assistant turn at a time: the text up to the turn
    /// with the generation prompt carries no loss, the turn itself does. A template whose
    /// renderings do not extend each other cannot mark the turns and is refused.
    fn chat_segments(&self, messages: &[Message]) -> Result<Vec<Segment>, DocumentError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            DocumentError::Template(
                "rows with `messages` need a chat_template in the model's tokenizer_config.json".into(),
            )
        })?;
        let renderer = ChatRenderer::new(template, self)?;
        let mut segments = Vec::new();
        let mut done = String::new();
        for (i, message) in messages.iter().enumerate() {
            if message.role != "assistant" {
                continue;
            }
            let prompt = renderer.render(&messages[..i], true)?;
            let full = renderer.render(&messages[..=i], false)?;
            let (Some(before), Some(turn)) = (prompt.strip_prefix(&done), full.strip_prefix(&prompt)) else {
                return Err(DocumentError::Template(format!(
                    "rendering messages[..={i}] does not extend the rendering before it, so the assistant's \
                     tokens cannot be told apart"
                )));
            };
            segments.push(Segment::new(before, false));
            segments.push(Segment::new(turn, true));
            done = full;
        }
        let all = renderer.render(messages, false)?;
        if let Some(rest) = all.strip_prefix(&done) {
            segments.push(Segment::new(rest, false));
        }
        segments.retain(|s| !s.text.is_empty());
        Ok(segments)
    }
}

/// A compiled chat template with the environment `transformers` renders it in (blocks
/// trimmed, `raise_exception`, Python string methods).
struct ChatRenderer<'a> {
    env: minijinja::Environment<'static>,
    settings: &'a TokenizerSettings,
}

impl<'a> ChatRenderer<'a> {
    fn new(template: &str, settings: &'a TokenizerSettings) -> Result<Self, DocumentError> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| DocumentError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", template.to_string())
            .map_err(|e| DocumentError::Template(format!("does not parse: {e}")))?;
        Ok(Self { env, settings })
    }

    fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, DocumentError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| DocumentError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.settings.bos_token.clone().unwrap_or_default(),
                eos_token => self.settings.eos_token.clone().unwrap_or_default(),
            })
            .map_err(|e| DocumentError::Template(format!("cannot render: {e:#}")))
    }
}

/// A document as token ids, each marked with whether predicting it carries loss.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Document {
    /// Token ids.
    pub tokens: Vec<i64>,
    /// Per token: whether it is a learning target.
    pub loss: Vec<bool>,
}

impl Document {
    /// Appends a segment's tokens.
    pub fn push(&mut self, tokens: &[i64], loss: bool) {
        self.tokens.extend_from_slice(tokens);
        self.loss.extend(std::iter::repeat_n(loss, tokens.len()));
    }
}

/// Documents concatenated into one stream and cut into rows of `context` inputs: row `k`
/// reads stream tokens `k * context ..= (k + 1) * context` (inputs, then the same shifted
/// by one as targets). Every token knows its document, so attention and loss stay inside
/// it: a target in another document than its input, or marked without loss, is
/// [`IGNORE_INDEX`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Packed {
    context: usize,
    tokens: Vec<i64>,
    loss: Vec<bool>,
    documents: Vec<u32>,
}

/// One training row: inputs, targets and each input's document number.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedRow {
    /// Input ids (`context` of them).
    pub inputs: Vec<i64>,
    /// Target ids, or [`IGNORE_INDEX`].
    pub targets: Vec<i64>,
    /// The document each input belongs to.
    pub documents: Vec<i64>,
}

impl Packed {
    /// Packs `documents` in order for rows of `context` tokens.
    pub fn new(documents: &[Document], context: usize) -> Self {
        let mut packed = Self {
            context: context.max(1),
            ..Self::default()
        };
        for (number, document) in documents.iter().enumerate() {
            packed.tokens.extend_from_slice(&document.tokens);
            packed.loss.extend_from_slice(&document.loss);
            packed
                .documents
                .extend(std::iter::repeat_n(number as u32, document.tokens.len()));
        }
        packed
    }

    /// Rows the stream fills (a last partial row is dropped).
    pub fn rows(&self) -> usize {
        self.tokens.len().saturating_sub(1) / self.context
    }

    /// Tokens in the stream.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Row `index` (which must be below [`Packed::rows`]).
    pub fn row(&self, index: usize) -> PackedRow {
        let start = index * self.context;
        let span = start..start + self.context;
        let targets = span
            .clone()
            .map(|i| {
                let same_document = self.documents[i + 1] == self.documents[i];
                if same_document && self.loss[i + 1] {
                    self.tokens[i + 1]
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        PackedRow {
            inputs: self.tokens[span.clone()].to_vec(),
            targets,
            documents: self.documents[span].iter().map(|d| i64::from(*d)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rows_parse_into_their_kind_or_say_what_is_missing() {
        assert_eq!(
            Record::parse(&json!({"text": "hi"})).unwrap(),
            Record::Text("hi".into())
        );
        assert_eq!(
            Record::parse(&json!({"prompt": "q", "response": "a", "id": 3})).unwrap(),
            Record::Instruction {
                prompt: "q".into(),
                response: "a".into()
            }
        );
        let chat = json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]});
        assert!(matches!(Record::parse(&chat).unwrap(), Record::Chat(m) if m.len() == 2));
        let cases = [
            (json!([1]), "JSON object"),
            (json!({"id": 1}), "no `text`"),
            (json!({"text": ""}), "`text` is empty"),
            (json!({"text": 5}), "must be a string"),
            (json!({"prompt": "q"}), "no `response`"),
            (json!({"messages": "x"}), "must be a list"),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages[0] needs a string `content`",
            ),
            (
                json!({"messages": [{"role": "user", "content": "q"}]}),
                "no assistant message",
            ),
        ];
        for (row, expected) in cases {
            let error = Record::parse(&row).unwrap_err().to_string();
            assert!(error.contains(expected), "{row}: {error}");
        }
    }

    fn settings(template: &str) -> TokenizerSettings {
        TokenizerSettings::from_json(&json!({
            "bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": true,
            "chat_template": template,
        }))
    }

    const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}\
        [ASSISTANT] {{ m['content'].strip() + eos_token }}{% else %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endif %}\
        {% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}";

    #[test]
    fn only_assistant_turns_carry_loss_in_a_rendered_chat() {
        let s = settings(TEMPLATE);
        let record = Record::parse(&json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": " 4 "},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"},
        ]}))
        .unwrap();
        let segments = s.segments(&record).unwrap();
        let learned: Vec<&str> = segments.iter().filter(|s| s.loss).map(|s| s.text.as_str()).collect();
        assert_eq!(learned, vec!["4</s>", "6</s>"]);
        let whole: String = segments.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(
            whole,
            "<s>[SYSTEM] be brief\n[USER] 2+2?\n[ASSISTANT] 4</s>[USER] 3+3?\n[ASSISTANT] 6</s>"
        );
    }

    #[test]
    fn a_generation_prompt_ends_with_the_assistant_header() {
        let messages = vec![
            Message {
                role: "system".into(),
                content: "be brief".into(),
            },
            Message {
                role: "user".into(),
                content: "2+2?".into(),
            },
        ];
        let prompt = settings(TEMPLATE).chat_prompt(&messages).unwrap();
        assert_eq!(prompt, "<s>[SYSTEM] be brief\n[USER] 2+2?\n[ASSISTANT] ");
        let error = TokenizerSettings::default().chat_prompt(&messages).unwrap_err();
        assert!(error.to_string().contains("need a chat_template"), "{error}");
    }

    #[test]
    fn templates_that_cannot_mark_turns_or_fail_are_errors() {
        let record = Record::parse(&json!({"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
        .unwrap();
        let none = TokenizerSettings::default().segments(&record).unwrap_err().to_string();
        assert!(none.contains("need a chat_template"), "{none}");
        let raising = settings("{{ raise_exception('roles must alternate') }}");
        let error = raising.segments(&record).unwrap_err().to_string();
        assert!(error.contains("roles must alternate"), "{error}");
        let broken = settings("{% for %}").segments(&record).unwrap_err().to_string();
        assert!(broken.contains("does not parse"), "{broken}");
        // Generation prompt that the full rendering does not start with.
        let odd =
            settings("{% if add_generation_prompt %}GEN{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}");
        let error = odd.segments(&record).unwrap_err().to_string();
        assert!(error.contains("does not extend"), "{error}");
        // The template above is fine.
        assert!(settings(TEMPLATE).segments(&record).is_ok());
    }

    #[test]
    fn text_and_instructions_get_bos_and_eos_and_the_prompt_no_loss() {
        let s = settings(TEMPLATE);
        let segments = s
            .segments(&Record::Instruction {
                prompt: "q".into(),
                response: "a".into(),
            })
            .unwrap();
        let marks: Vec<(&str, bool)> = segments.iter().map(|s| (s.text.as_str(), s.loss)).collect();
        assert_eq!(marks, vec![("<s>", false), ("q", false), ("a", true), ("</s>", true)]);
        let plain = TokenizerSettings::default()
            .segments(&Record::Text("t".into()))
            .unwrap();
        assert_eq!(plain, vec![Segment::new("t", true)]);
    }

    fn doc(tokens: &[i64], loss: &[bool]) -> Document {
        Document {
            tokens: tokens.to_vec(),
            loss: loss.to_vec(),
        }
    }

    #[test]
    fn packed_rows_keep_loss_and_targets_inside_each_document() {
        let docs = [
            doc(&[1, 10, 11, 12], &[false, false, true, true]),
            doc(&[1, 20, 21], &[false, true, true]),
            doc(&[1, 30, 31, 32, 33], &[false; 5]),
        ];
        let packed = Packed::new(&docs, 4);
        assert_eq!((packed.tokens(), packed.rows()), (12, 2));
        let row = packed.row(0);
        assert_eq!(row.inputs, vec![1, 10, 11, 12]);
        // 10 is a prompt token; 11 and 12 are learned; the next document's BOS is not.
        assert_eq!(row.targets, vec![IGNORE_INDEX, 11, 12, IGNORE_INDEX]);
        assert_eq!(row.documents, vec![0, 0, 0, 0]);
        let row = packed.row(1);
        assert_eq!(row.inputs, vec![1, 20, 21, 1]);
        assert_eq!(row.targets, vec![20, 21, IGNORE_INDEX, IGNORE_INDEX]);
        assert_eq!(row.documents, vec![1, 1, 1, 2]);
    }
}
