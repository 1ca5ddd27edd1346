//! The tokenizer files a GGUF header's vocabulary makes: `tokenizer.json` for a byte-level
//! BPE vocabulary (`tokenizer.ggml.model = gpt2`: SmolLM, Llama 3, Qwen2) or a
//! SentencePiece-style one (`llama`: Llama 2, Mistral v0.1-0.3, TinyLlama), the latter the
//! very file `transformers` 5.24 builds from the same metadata
//! (`integrations/gguf/gguf_tokenizer_mapping.py`), and `tokenizer_config.json` (special
//! tokens, chat template).

use std::cmp::Ordering;
use std::collections::HashMap;

use serde_json::{json, Map, Value as Json};

use super::{GgufError, GgufHeader, Value};

/// Token types of a GGUF vocabulary (llama.cpp's `llama_token_type`).
const TOKEN_NORMAL: u64 = 1;
const TOKEN_CONTROL: u64 = 3;
const TOKEN_USER_DEFINED: u64 = 4;

/// Llama 3's pre-tokenizer pattern (llama.cpp's `llama-bpe`).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer pattern: Llama 3's with single digits.
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// SentencePiece's stand-in for a space.
const METASPACE: &str = "\u{2581}";
/// The special tokens `transformers`' `LlamaTokenizer` adds on its own (its defaults for
/// BOS, EOS and UNK), in its order, whatever the file names.
const LLAMA_DEFAULT_SPECIALS: [&str; 3] = ["<s>", "</s>", "<unk>"];

/// `tokenizer_config.json`: the special tokens' texts, whether BOS is added (llama.cpp adds
/// it to a SentencePiece vocabulary that does not say otherwise) and the chat template.
pub(super) fn tokenizer_config(header: &GgufHeader) -> Json {
    let tokens = header.get("tokenizer.ggml.tokens").and_then(Value::as_array);
    let text = |key: &str| {
        let id = header.get(key).and_then(Value::as_u64)?;
        tokens?.get(id as usize)?.as_str().map(str::to_string)
    };
    let mut out = Map::new();
    for (field, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(t) = text(key) {
            out.insert(field.into(), json!(t));
        }
    }
    let sentencepiece = header.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("llama");
    match header.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool) {
        Some(add) => {
            out.insert("add_bos_token".into(), json!(add));
        }
        None if sentencepiece => {
            out.insert("add_bos_token".into(), json!(true));
        }
        None => {}
    }
    if let Some(template) = header.get("tokenizer.chat_template").and_then(Value::as_str) {
        out.insert("chat_template".into(), json!(template));
    }
    Json::Object(out)
}

/// `tokenizer.json` for the vocabulary `tokenizer.ggml.model` names.
pub(super) fn tokenizer_json(header: &GgufHeader) -> Result<Json, GgufError> {
    let model = header
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or_else(|| GgufError::Unsupported("the file carries no tokenizer (tokenizer.ggml.model)".into()))?;
    match model {
        "gpt2" => byte_level_json(header),
        "llama" => sentencepiece_json(header),
        other => Err(GgufError::Unsupported(format!(
            "tokenizer.ggml.model {other:?} is not read; Regatta reads gpt2 (byte-level BPE) and llama (SentencePiece-style BPE); set data.tokenizer to the model's tokenizer.json"
        ))),
    }
}

/// A metadata array of strings.
fn strings(header: &GgufHeader, key: &str) -> Result<Vec<String>, GgufError> {
    let list = header
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            problem: "is missing or not an array".into(),
        })?;
    list.iter()
        .map(|v| v.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            problem: "must hold strings".into(),
        })
}

/// Each token's id, refusing a token listed twice.
fn token_ids(tokens: &[String]) -> Result<HashMap<&str, usize>, GgufError> {
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(id, t)| (t.as_str(), id)).collect();
    if ids.len() != tokens.len() {
        return Err(GgufError::Metadata {
            key: "tokenizer.ggml.tokens".into(),
            problem: "holds the same token twice".into(),
        });
    }
    Ok(ids)
}

/// Each token's type (`tokenizer.ggml.token_type`; normal where the file says nothing).
fn token_types(header: &GgufHeader, count: usize) -> Vec<u64> {
    let listed = header.get("tokenizer.ggml.token_type").and_then(Value::as_array);
    (0..count)
        .map(|id| {
            listed
                .and_then(|l| l.get(id))
                .and_then(Value::as_u64)
                .unwrap_or(TOKEN_NORMAL)
        })
        .collect()
}

/// A boolean setting, `default` when absent.
fn flag(header: &GgufHeader, key: &str, default: bool) -> Result<bool, GgufError> {
    match header.get(key) {
        None => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            problem: format!("must be a boolean, not {v:?}"),
        }),
    }
}

/// The text and id of the token a `tokenizer.ggml.*_token_id` key names, if it names one.
fn named_token<'a>(
    header: &GgufHeader,
    key: &str,
    tokens: &'a [String],
) -> Result<Option<(&'a str, usize)>, GgufError> {
    let Some(v) = header.get(key) else {
        return Ok(None);
    };
    let id = v.as_u64().and_then(|id| usize::try_from(id).ok());
    let token = id.and_then(|id| Some((tokens.get(id)?.as_str(), id)));
    token.map(Some).ok_or_else(|| GgufError::Metadata {
        key: key.into(),
        problem: format!("is {v:?}, not the id of one of the {} tokens", tokens.len()),
    })
}

/// `tokenizer.json` for a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`), with
/// the pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_json(header: &GgufHeader) -> Result<Json, GgufError> {
    let tokens = strings(header, "tokenizer.ggml.tokens")?;
    let merges = strings(header, "tokenizer.ggml.merges")?;
    token_ids(&tokens)?;
    let types = token_types(header, tokens.len());
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (token, kind)) in tokens.iter().zip(types).enumerate() {
        vocab.insert(token.clone(), json!(id));
        if kind == TOKEN_CONTROL || kind == TOKEN_USER_DEFINED {
            added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": kind == TOKEN_USER_DEFINED, "special": kind == TOKEN_CONTROL,
            }));
        }
    }
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let pre = header
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let (pre_tokenizer, ignore_merges) = match pre {
        "default" | "gpt2" | "gpt-2" => (byte_level(true), false),
        "smollm" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            false,
        ),
        "llama-bpe" | "llama3" => (
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]}),
            true,
        ),
        "qwen2" => (
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_PATTERN), byte_level(false)]}),
            false,
        ),
        other => {
            return Err(GgufError::Unsupported(format!(
                "pre-tokenizer {other:?} (tokenizer.ggml.pre) is not known; Regatta builds default, smollm, llama-bpe and qwen2; set data.tokenizer to the model's tokenizer.json"
            )))
        }
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": byte_level(true),
        "decoder": byte_level(true),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
        },
    }))
}

/// `tokenizer.json` for a SentencePiece-style vocabulary (`tokenizer.ggml.model = llama`), as
/// `transformers`' `LlamaTokenizer` makes it: BPE with byte fallback, `▁` for spaces and one
/// prepended to the text (`Metaspace`, prepend scheme `first`), merges from the file or
/// recovered from the pieces' scores. Like `transformers`, it prepends the space whatever
/// `tokenizer.ggml.add_space_prefix` says (llama.cpp honours that flag; real Llama and
/// Mistral files set it true or leave it out).
fn sentencepiece_json(header: &GgufHeader) -> Result<Json, GgufError> {
    let tokens = strings(header, "tokenizer.ggml.tokens")?;
    let ids = token_ids(&tokens)?;
    let types = token_types(header, tokens.len());
    let listed = match header.get("tokenizer.ggml.merges") {
        Some(_) => Some(strings(header, "tokenizer.ggml.merges")?),
        None => None,
    };
    let merges = match &listed {
        Some(listed) => split_merges(listed)?,
        None => merges_from_scores(&tokens, &ids, &scores(header, tokens.len())?),
    };
    let bos = named_token(header, "tokenizer.ggml.bos_token_id", &tokens)?;
    let eos = named_token(header, "tokenizer.ggml.eos_token_id", &tokens)?;
    let named = [
        bos,
        eos,
        named_token(header, "tokenizer.ggml.unknown_token_id", &tokens)?,
        named_token(header, "tokenizer.ggml.padding_token_id", &tokens)?,
    ];
    let add_bos = flag(header, "tokenizer.ggml.add_bos_token", true)?;
    let add_eos = flag(header, "tokenizer.ggml.add_eos_token", false)?;
    let vocab: Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), json!(id)))
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": sentencepiece_added_tokens(&tokens, &ids, &types, &named),
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": METASPACE, "prepend_scheme": "first", "split": false},
        "post_processor": template(bos.filter(|_| add_bos), eos.filter(|_| add_eos)),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": METASPACE}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    }))
}

/// `tokenizer.ggml.merges` entries (`"a b"`) as pairs.
fn split_merges(listed: &[String]) -> Result<Vec<[&str; 2]>, GgufError> {
    listed
        .iter()
        .enumerate()
        .map(|(i, merge)| match merge.split(' ').collect::<Vec<_>>()[..] {
            [left, right] => Ok([left, right]),
            _ => Err(GgufError::Metadata {
                key: "tokenizer.ggml.merges".into(),
                problem: format!("entry {i}, {merge:?}, is not two tokens split by one space"),
            }),
        })
        .collect()
}

/// `tokenizer.ggml.scores` as numbers (the merges of a file that lists none come from them).
fn scores(header: &GgufHeader, tokens: usize) -> Result<Vec<f64>, GgufError> {
    let key = "tokenizer.ggml.scores";
    let list = header
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            problem: format!(
                "is missing or not an array; a SentencePiece vocabulary ({tokens} tokens) without tokenizer.ggml.merges needs its scores to order its merges"
            ),
        })?;
    list.iter()
        .map(Value::as_f64)
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| GgufError::Metadata {
            key: key.into(),
            problem: "must hold numbers".into(),
        })
}

/// The merges a SentencePiece vocabulary implies (`transformers`' `generate_merges` with the
/// scores): every split of a token into two tokens of the vocabulary, the splits of one token
/// by the ids of their halves, then all of them by score, longer left half and longer right
/// half first, ties in that order. Tokens past the last score have no merges (Python's `zip`).
fn merges_from_scores<'a>(tokens: &'a [String], ids: &HashMap<&str, usize>, scores: &[f64]) -> Vec<[&'a str; 2]> {
    struct Merge<'a> {
        pair: [&'a str; 2],
        score: f64,
        lengths: (usize, usize),
    }
    let mut merges = Vec::new();
    for (token, &score) in tokens.iter().zip(scores) {
        let mut splits: Vec<(usize, usize, &str, &str)> = token
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (left, right) = token.split_at(at);
                Some((*ids.get(left)?, *ids.get(right)?, left, right))
            })
            .collect();
        splits.sort_by_key(|&(left, right, ..)| (left, right));
        merges.extend(splits.into_iter().map(|(_, _, left, right)| Merge {
            pair: [left, right],
            score,
            lengths: (left.chars().count(), right.chars().count()),
        }));
    }
    // Python's `sorted(..., reverse=True)` keeps equal keys in their order, as a stable
    // sort on the reversed comparison does.
    merges.sort_by(|a, b| {
        b.score
            .partial_cmp(&a.score)
            .unwrap_or(Ordering::Equal)
            .then(b.lengths.cmp(&a.lengths))
    });
    merges.into_iter().map(|m| m.pair).collect()
}

/// The added tokens `transformers` ends with, by id: `LlamaTokenizer`'s own `<s>`, `</s>`
/// and `<unk>` (special; given the next ids if the vocabulary lacks them), then the tokens the
/// file marks CONTROL (special) and USER_DEFINED (not special: this overrides the first
/// step), then the BOS, EOS, UNK and PAD the file names, where not added yet (special).
/// None is normalized.
fn sentencepiece_added_tokens(
    tokens: &[String],
    ids: &HashMap<&str, usize>,
    types: &[u64],
    named: &[Option<(&str, usize)>],
) -> Vec<Json> {
    let mut added: Vec<(&str, usize, bool)> = Vec::new();
    let mut next_id = tokens.len();
    for content in LLAMA_DEFAULT_SPECIALS {
        let id = ids.get(content).copied().unwrap_or_else(|| {
            next_id += 1;
            next_id - 1
        });
        added.push((content, id, true));
    }
    for (kind, special) in [(TOKEN_CONTROL, true), (TOKEN_USER_DEFINED, false)] {
        for (id, token) in tokens.iter().enumerate().filter(|(id, _)| types[*id] == kind) {
            match added.iter_mut().find(|(content, ..)| *content == token.as_str()) {
                Some(seen) => seen.2 = special,
                None => added.push((token, id, special)),
            }
        }
    }
    for &(token, id) in named.iter().flatten() {
        if !added.iter().any(|(content, ..)| *content == token) {
            added.push((token, id, true));
        }
    }
    added.sort_by_key(|&(_, id, _)| id);
    added
        .into_iter()
        .map(|(content, id, special)| {
            json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            })
        })
        .collect()
}

/// The `TemplateProcessing` `transformers` sets: BOS before and EOS after each sequence, where
/// the file adds them.
fn template(bos: Option<(&str, usize)>, eos: Option<(&str, usize)>) -> Json {
    let special = |token: &str, type_id: u32| json!({"SpecialToken": {"id": token, "type_id": type_id}});
    let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let one = |name: &str, type_id: u32| -> Vec<Json> {
        bos.map(|(b, _)| special(b, type_id))
            .into_iter()
            .chain([sequence(name, type_id)])
            .chain(eos.map(|(e, _)| special(e, type_id)))
            .collect()
    };
    let mut special_tokens = Map::new();
    for (token, id) in bos.into_iter().chain(eos) {
        special_tokens.insert(token.into(), json!({"id": token, "ids": [id], "tokens": [token]}));
    }
    let single = one("A", 0);
    let pair: Vec<Json> = single.iter().cloned().chain(one("B", 1)).collect();
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens})
}

#[cfg(test)]
#[path = "tokenizer_tests.rs"]
mod tests;
