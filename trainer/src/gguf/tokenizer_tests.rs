//! Unit tests of the GGUF tokenizer builder (`tokenizer.rs`).

use super::super::tests::file;
use super::*;

/// What `tokenizer.json` a SentencePiece vocabulary makes; `extra` adds or replaces keys.
fn sentencepiece(
    tokens: &[&str],
    types: &[i64],
    scores: &[f64],
    extra: &[(&'static str, Value)],
) -> Result<Json, GgufError> {
    let mut meta = vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(tokens.iter().map(|t| Value::String(t.to_string())).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.iter().map(|t| Value::Int(*t)).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(scores.iter().map(|s| Value::Float(*s)).collect()),
        ),
    ];
    for (key, value) in extra {
        meta.retain(|(k, _)| k != key);
        meta.push((key, value.clone()));
    }
    let bytes = file(&meta);
    tokenizer_json(&GgufHeader::parse(&bytes, bytes.len() as u64).expect("parse"))
}

/// `(id, content, special)` of each added token.
fn added(json: &Json) -> Vec<(u64, String, bool)> {
    let list = json["added_tokens"].as_array().expect("added_tokens");
    list.iter()
        .map(|t| {
            assert_eq!(t["normalized"], false);
            let content = t["content"].as_str().expect("content").to_string();
            (
                t["id"].as_u64().expect("id"),
                content,
                t["special"].as_bool().expect("special"),
            )
        })
        .collect()
}

fn pairs(list: &[[&str; 2]]) -> Json {
    json!(list)
}

// Expected values here are what transformers 5.24 builds from the same metadata.

#[test]
fn merges_recovered_from_scores_follow_transformers_order() {
    let tokens = ["<unk>", "a", "b", "▁", "ab", "ba", "▁a", "▁b", "aba", "abab"];
    let json = sentencepiece(
        &tokens,
        &[2, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        &[0., 0., 0., 0., -1., -1., -1., -1., -2., -1.],
        &[("tokenizer.ggml.unknown_token_id", Value::Uint(0))],
    )
    .expect("tokenizer");
    let expected = [
        ["aba", "b"],
        ["ab", "ab"],
        ["a", "b"],
        ["b", "a"],
        ["▁", "a"],
        ["▁", "b"],
        ["ab", "a"],
        ["a", "ba"],
    ];
    assert_eq!(json["model"]["merges"], pairs(&expected));
    // `<s>` and `</s>` are LlamaTokenizer's own: absent from the vocabulary, they take the next ids.
    let want = [(0, "<unk>", true), (10, "<s>", true), (11, "</s>", true)];
    assert_eq!(added(&json), want.map(|(i, c, s)| (i, c.to_string(), s)));
    // No BOS named: none added, though add_bos_token defaults to true.
    assert_eq!(
        json["post_processor"]["single"],
        json!([{"Sequence": {"id": "A", "type_id": 0}}])
    );
}

#[test]
fn listed_merges_win_over_scores() {
    let tokens = ["<unk>", "<s>", "</s>", "a", "b", "▁", "ab", "▁a"];
    let json = sentencepiece(
        &tokens,
        &[2, 3, 3, 1, 1, 1, 1, 1],
        &[0., 0., 0., -5., -6., -4., -1., -2.],
        &[
            (
                "tokenizer.ggml.merges",
                Value::Array(vec![Value::String("▁ a".into()), Value::String("a b".into())]),
            ),
            ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
            ("tokenizer.ggml.bos_token_id", Value::Uint(1)),
        ],
    )
    .expect("tokenizer");
    assert_eq!(json["model"]["merges"], pairs(&[["▁", "a"], ["a", "b"]]));
    assert_eq!(json["post_processor"]["special_tokens"], json!({}));
}

#[test]
fn added_tokens_are_flagged_as_transformers_flags_them() {
    // A user-defined BOS stays not special; an EOS added after each sequence.
    let tokens = ["<bos>", "a", "b", "▁", "ab", "▁a", "<u>"];
    let json = sentencepiece(
        &tokens,
        &[4, 1, 1, 1, 1, 1, 4],
        &[0., -5., -6., -4., -1., -2., 0.],
        &[
            ("tokenizer.ggml.bos_token_id", Value::Uint(0)),
            ("tokenizer.ggml.eos_token_id", Value::Uint(6)),
            ("tokenizer.ggml.add_eos_token", Value::Bool(true)),
        ],
    )
    .expect("tokenizer");
    let want = [
        (0, "<bos>", false),
        (6, "<u>", false),
        (7, "<s>", true),
        (8, "</s>", true),
        (9, "<unk>", true),
    ];
    assert_eq!(added(&json), want.map(|(i, c, s)| (i, c.to_string(), s)));
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let sequence = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    assert_eq!(
        json["post_processor"]["pair"],
        json!([
            special("<bos>", 0),
            sequence("A", 0),
            special("<u>", 0),
            special("<bos>", 1),
            sequence("B", 1),
            special("<u>", 1)
        ])
    );
    assert_eq!(json["post_processor"]["special_tokens"]["<u>"]["ids"], json!([6]));

    // USER_DEFINED overrides LlamaTokenizer's own `<s>`; a NORMAL `<unk>` and a named PAD are special.
    let tokens = ["<unk>", "<s>", "</s>", "a", "b", "▁", "ab", "▁a", "<pad>"];
    let json = sentencepiece(
        &tokens,
        &[1, 4, 3, 1, 1, 1, 1, 1, 1],
        &[0., 0., 0., -5., -6., -4., -1., -2., 0.],
        &[
            ("tokenizer.ggml.bos_token_id", Value::Uint(1)),
            ("tokenizer.ggml.padding_token_id", Value::Uint(8)),
        ],
    )
    .expect("tokenizer");
    let want = [
        (0, "<unk>", true),
        (1, "<s>", false),
        (2, "</s>", true),
        (8, "<pad>", true),
    ];
    assert_eq!(added(&json), want.map(|(i, c, s)| (i, c.to_string(), s)));
}

#[test]
fn bad_sentencepiece_metadata_is_refused_by_key() {
    let tokens = ["<unk>", "a", "b", "ab"];
    let (types, scores) = ([2, 1, 1, 1], [0., -1., -2., -3.]);
    let cases: [(&str, Value); 4] = [
        ("tokenizer.ggml.scores", Value::String("none".into())),
        (
            "tokenizer.ggml.merges",
            Value::Array(vec![Value::String("a b c".into())]),
        ),
        ("tokenizer.ggml.bos_token_id", Value::Uint(99)),
        ("tokenizer.ggml.add_bos_token", Value::String("yes".into())),
    ];
    for (key, value) in cases {
        let err = sentencepiece(&tokens, &types, &scores, &[(key, value)]).expect_err(key);
        assert!(
            matches!(&err, GgufError::Metadata { key: k, .. } if k == key),
            "{key}: {err}"
        );
    }
    let err = sentencepiece(&["a", "a"], &[1, 1], &[0., 0.], &[]).expect_err("twice");
    assert!(err.to_string().contains("the same token twice"), "{err}");
}

#[test]
fn a_sentencepiece_vocabulary_adds_bos_unless_it_says_otherwise() {
    let config = |extra: Vec<(&str, Value)>| {
        let mut meta = vec![("tokenizer.ggml.model", Value::String("llama".into()))];
        meta.extend(extra);
        let bytes = file(&meta);
        tokenizer_config(&GgufHeader::parse(&bytes, bytes.len() as u64).expect("parse"))
    };
    assert_eq!(config(vec![])["add_bos_token"], true);
    assert_eq!(
        config(vec![("tokenizer.ggml.add_bos_token", Value::Bool(false))])["add_bos_token"],
        false
    );
    let bytes = file(&[("tokenizer.ggml.model", Value::String("gpt2".into()))]);
    let byte_level = tokenizer_config(&GgufHeader::parse(&bytes, bytes.len() as u64).expect("parse"));
    assert!(byte_level.get("add_bos_token").is_none());
}
