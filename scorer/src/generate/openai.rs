//! OpenAI's Batch API file formats, so a file made for OpenAI's batch endpoint runs as is:
//! input lines `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
//! "/v1/completions", "body": {...}}` become prompt rows, and each row's result is written
//! as an output line (`custom_id`, `response.body.choices[]`, `usage`) or an error line in
//! the batch error format. Pure: JSON values in and out.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::{ChatMessage, Prompt, PromptRow};
use crate::partition::RowError;

/// Which endpoint a row addressed (it decides the response's shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `/v1/chat/completions`: `messages` in, `choices[].message` out.
    Chat,
    /// `/v1/completions`: `prompt` in, `choices[].text` out.
    Completions,
}

/// What an OpenAI row's answer needs besides the generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpenAiRow {
    /// The endpoint it addressed.
    pub endpoint: Endpoint,
    /// The `model` it named: accepted whatever it is (the run's model answers every row)
    /// and echoed in the response.
    pub model: Option<String>,
}

/// Body keys understood; any other is refused by name.
const BODY_KEYS: [&str; 11] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "logprobs",
    "n",
];

/// Whether a JSON line is in OpenAI's batch input format (it has a `custom_id`).
pub fn is_openai_row(value: &Value) -> bool {
    value.get("custom_id").is_some()
}

/// Parses one OpenAI batch input line into a prompt row (`custom_id` as its id, the body's
/// settings as its `params`) and what its answer needs.
pub fn parse_openai_row(value: &Value, offset: u64) -> Result<(PromptRow, OpenAiRow), RowError> {
    let custom_id = match value.get("custom_id") {
        Some(Value::String(id)) if !id.is_empty() => id.clone(),
        _ => {
            return Err(RowError {
                id: None,
                offset,
                reason: "`custom_id` must be a non-empty string".into(),
            })
        }
    };
    let fail = |reason: String| RowError {
        id: Some(custom_id.clone()),
        offset,
        reason,
    };
    let endpoint = endpoint(value, &fail)?;
    let body = body(value, &fail)?;
    let prompt = prompt(endpoint, body, &fail)?;
    let model = body.get("model").and_then(Value::as_str).map(str::to_string);
    Ok((
        PromptRow {
            id: custom_id,
            prompt,
            params: sampling_params(body),
            openai: None,
        },
        OpenAiRow { endpoint, model },
    ))
}

/// The endpoint a line addresses: its `url`, by `POST` (the only method served).
fn endpoint(value: &Value, fail: &impl Fn(String) -> RowError) -> Result<Endpoint, RowError> {
    if let Some(method) = value.get("method") {
        if method != "POST" {
            return Err(fail(format!("`method` must be \"POST\", not {method}")));
        }
    }
    match value.get("url").and_then(Value::as_str) {
        Some("/v1/chat/completions") => Ok(Endpoint::Chat),
        Some("/v1/completions") => Ok(Endpoint::Completions),
        Some(other) => Err(fail(format!(
            "`url` {other:?} is not served: use \"/v1/chat/completions\" or \"/v1/completions\""
        ))),
        None => Err(fail(
            "no `url` (\"/v1/chat/completions\" or \"/v1/completions\")".into(),
        )),
    }
}

/// A line's `body`: an object with only keys understood ([`BODY_KEYS`]), asking for one
/// choice.
fn body<'v>(value: &'v Value, fail: &impl Fn(String) -> RowError) -> Result<&'v Map<String, Value>, RowError> {
    let Some(Value::Object(body)) = value.get("body") else {
        return Err(fail("no `body` object".into()));
    };
    let unknown: Vec<&str> = body
        .keys()
        .map(String::as_str)
        .filter(|k| !BODY_KEYS.contains(k))
        .collect();
    if !unknown.is_empty() {
        return Err(fail(format!(
            "unsupported body key(s) {}; supported: {}",
            unknown.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "),
            BODY_KEYS.join(", ")
        )));
    }
    if let Some(n) = body.get("n") {
        if n != 1 {
            return Err(fail(format!("`n` must be 1 (one choice per row), not {n}")));
        }
    }
    Ok(body)
}

/// The prompt of a body: chat `messages` or a completion's `prompt` string.
fn prompt(
    endpoint: Endpoint,
    body: &Map<String, Value>,
    fail: &impl Fn(String) -> RowError,
) -> Result<Prompt, RowError> {
    match endpoint {
        Endpoint::Chat => {
            let messages = body
                .get("messages")
                .ok_or_else(|| fail("a chat row needs `messages`".into()))?;
            let messages: Vec<ChatMessage> = serde_json::from_value(messages.clone()).map_err(|e| {
                fail(format!(
                    "`messages` must be a list of {{\"role\", \"content\"}} strings: {e}"
                ))
            })?;
            if messages.is_empty() {
                return Err(fail("`messages` is empty".into()));
            }
            Ok(Prompt::Chat(messages))
        }
        Endpoint::Completions => match body.get("prompt") {
            Some(Value::String(text)) if !text.is_empty() => Ok(Prompt::Text(text.clone())),
            Some(Value::String(_)) => Err(fail("`prompt` is empty".into())),
            Some(other) => Err(fail(format!("`prompt` must be one string, not {other}"))),
            None => Err(fail("a completions row needs `prompt`".into())),
        },
    }
}

/// A body's sampling settings as a row's `params` (OpenAI's names mapped to ours; a
/// single stop string made a list); `None` when it sets none.
fn sampling_params(body: &Map<String, Value>) -> Option<Value> {
    let mut params = Map::new();
    if let Some(max) = body.get("max_completion_tokens").or_else(|| body.get("max_tokens")) {
        params.insert("max_new_tokens".into(), max.clone());
    }
    for key in ["temperature", "top_p", "seed", "logprobs"] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            params.insert(key.into(), v.clone());
        }
    }
    match body.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            params.insert("stop".into(), json!([s]));
        }
        Some(list) => {
            params.insert("stop".into(), list.clone());
        }
    }
    (!params.is_empty()).then_some(Value::Object(params))
}

/// A generated row's output line in OpenAI's batch output format.
#[allow(clippy::too_many_arguments)]
pub fn output_line(
    custom_id: &str,
    row: &OpenAiRow,
    model: &str,
    text: &str,
    finish: &str,
    prompt_tokens: u64,
    completion_tokens: u64,
    created: u64,
) -> Value {
    // Regatta's `eos` is OpenAI's `stop` (the model ended the text itself).
    let finish_reason = if finish == "length" { "length" } else { "stop" };
    let model = row.model.as_deref().unwrap_or(model);
    let (object, choice) = match row.endpoint {
        Endpoint::Chat => (
            "chat.completion",
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish_reason}),
        ),
        Endpoint::Completions => (
            "text_completion",
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason}),
        ),
    };
    json!({
        "id": format!("batch_req_{custom_id}"),
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": format!("req_{custom_id}"),
            "body": {
                "id": format!("cmpl-{custom_id}"),
                "object": object,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        },
        "error": null,
    })
}

/// A row that could not be run, as a line of OpenAI's batch error file.
pub fn error_line(error: &RowError) -> Value {
    let custom_id = error.id.clone();
    json!({
        "id": format!("batch_req_{}", custom_id.as_deref().unwrap_or("unknown")),
        "custom_id": custom_id,
        "response": null,
        "error": {"code": "invalid_request", "message": error.reason, "line_offset": error.offset},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: Value) -> Result<(PromptRow, OpenAiRow), RowError> {
        parse_openai_row(&line, 7)
    }

    #[test]
    fn chat_and_completion_rows_become_prompt_rows_with_their_settings() {
        let (row, meta) = parse(
            json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                     "temperature": 0.5, "top_p": 0.9, "stop": "END", "seed": 3, "logprobs": true}}),
        )
        .unwrap();
        assert_eq!(row.id, "a");
        assert_eq!(
            row.prompt,
            Prompt::Chat(vec![ChatMessage {
                role: "user".into(),
                content: "hi".into()
            }])
        );
        assert_eq!(
            row.params,
            Some(
                json!({"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stop": ["END"], "seed": 3, "logprobs": true})
            )
        );
        assert_eq!(
            meta,
            OpenAiRow {
                endpoint: Endpoint::Chat,
                model: Some("gpt-4o-mini".into())
            }
        );
        let (row, meta) = parse(json!({"custom_id": "b", "url": "/v1/completions",
            "body": {"prompt": "Once", "max_completion_tokens": 4, "stop": ["\n", "."]}}))
        .unwrap();
        assert_eq!(row.prompt, Prompt::Text("Once".into()));
        assert_eq!(row.params, Some(json!({"max_new_tokens": 4, "stop": ["\n", "."]})));
        assert_eq!(meta.endpoint, Endpoint::Completions);
    }

    #[test]
    fn bad_rows_are_refused_with_the_reason_and_their_custom_id() {
        let cases = [
            (
                json!({"custom_id": "x", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "a"}], "frequency_penalty": 1}}),
                "`frequency_penalty`",
            ),
            (
                json!({"custom_id": "x", "url": "/v1/embeddings", "body": {}}),
                "is not served",
            ),
            (
                json!({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}}),
                "must be \"POST\"",
            ),
            (
                json!({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}}),
                "one string",
            ),
            (
                json!({"custom_id": "x", "url": "/v1/chat/completions", "body": {"messages": []}}),
                "is empty",
            ),
            (
                json!({"custom_id": "x", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "a"}], "n": 2}}),
                "`n` must be 1",
            ),
            (json!({"custom_id": "x", "url": "/v1/completions"}), "no `body`"),
        ];
        for (line, reason) in cases {
            let error = parse(line).unwrap_err();
            assert!(error.reason.contains(reason), "{error:?}");
            assert_eq!((error.id.as_deref(), error.offset), (Some("x"), 7));
        }
        assert!(parse(json!({"custom_id": 5, "url": "/v1/completions"}))
            .unwrap_err()
            .id
            .is_none());
    }

    #[test]
    fn output_and_error_lines_have_openais_shape() {
        let meta = OpenAiRow {
            endpoint: Endpoint::Chat,
            model: None,
        };
        let line = output_line("a", &meta, "SmolLM2", "Hello", "eos", 5, 2, 1_700_000_000);
        assert_eq!(line["custom_id"], "a");
        assert_eq!(line["response"]["status_code"], 200);
        let body = &line["response"]["body"];
        assert_eq!(
            (body["object"].as_str(), body["model"].as_str()),
            (Some("chat.completion"), Some("SmolLM2"))
        );
        assert_eq!(body["choices"][0]["message"]["content"], "Hello");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})
        );
        let meta = OpenAiRow {
            endpoint: Endpoint::Completions,
            model: Some("m".into()),
        };
        let line = output_line("b", &meta, "SmolLM2", "x", "length", 1, 1, 0);
        assert_eq!(line["response"]["body"]["choices"][0]["text"], "x");
        assert_eq!(line["response"]["body"]["choices"][0]["finish_reason"], "length");
        assert_eq!(line["response"]["body"]["model"], "m");
        let error = error_line(&RowError {
            id: Some("c".into()),
            offset: 3,
            reason: "bad".into(),
        });
        assert_eq!(error["custom_id"], "c");
        assert_eq!(error["response"], Value::Null);
        assert_eq!(error["error"]["message"], "bad");
    }
}
