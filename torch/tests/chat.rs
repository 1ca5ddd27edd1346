#![allow(clippy::unwrap_used)]
//! Chat rows as `transformers` renders and tokenizes them, on fixtures that
//! `scripts/make-chat-fixtures.py` made with `apply_chat_template`: four real templates
//! (SmolLM2's ChatML from its GGUF file, Llama 3's, Qwen2's, Mistral's), each conversation's
//! text with and without the generation prompt, its token ids (the whole text tokenized at
//! once) and which tokens lie in the assistant turns (the loss mask), or the template's
//! refusal.

use std::path::{Path, PathBuf};

use regatta_torch::{encode_record, TextTokenizer};
use regatta_trainer::{Message, Record, TokenizerSettings};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The real SmolLM2-135M-Instruct GGUF file (scripts/setup-smollm2.sh fetches it).
fn smollm2() -> PathBuf {
    let path = std::env::var_os("REGATTA_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache/regatta/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup-smollm2.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

/// The tokenizer and settings a fixture names: its folder's files, or SmolLM2's GGUF.
fn tokenizer(name: &str) -> (TextTokenizer, TokenizerSettings) {
    let (tokenizer, config) = if name == "smollm2" {
        let path = smollm2();
        let rt = runtime();
        let model = rt
            .block_on(regatta_torch::HfModel::open(path.to_str().unwrap()))
            .unwrap();
        let tokenizer = rt.block_on(model.file("tokenizer.json")).unwrap().unwrap();
        let config = rt.block_on(model.file("tokenizer_config.json")).unwrap().unwrap();
        (tokenizer.to_vec(), config.to_vec())
    } else {
        let folder = fixtures().join(name);
        (
            std::fs::read(folder.join("tokenizer.json")).unwrap(),
            std::fs::read(folder.join("tokenizer_config.json")).unwrap(),
        )
    };
    (
        TextTokenizer::from_json(&tokenizer, name).unwrap(),
        TokenizerSettings::from_json(&serde_json::from_slice(&config).unwrap()),
    )
}

fn check(name: &str) {
    let (tokenizer, settings) = tokenizer(name);
    let cases: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(fixtures().join(name).join("expected.json")).unwrap()).unwrap();
    assert!(cases.len() >= 4, "{name}: {} cases", cases.len());
    for case in cases {
        let label = format!("{name}/{}", case["name"].as_str().unwrap());
        let record = Record::parse(&serde_json::json!({"messages": case["messages"]})).unwrap();
        let Record::Chat(messages) = &record else {
            panic!("{label}: not a chat")
        };
        if let Some(refusal) = case["error"].as_str() {
            let error = settings.chat_text(messages).unwrap_err().to_string();
            assert!(error.contains(refusal), "{label}: {error}");
            assert!(encode_record(&tokenizer, &settings, &record).is_err(), "{label}");
            continue;
        }
        assert_eq!(
            settings.chat_text(messages).unwrap(),
            case["text"].as_str().unwrap(),
            "{label}"
        );
        let asked: &[Message] = &messages[..messages.len() - 1];
        assert_eq!(
            settings.chat_prompt(asked).unwrap(),
            case["prompt"].as_str().unwrap(),
            "{label}: the generation prompt"
        );
        let document = encode_record(&tokenizer, &settings, &record).unwrap();
        let ids: Vec<i64> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(document.tokens, ids, "{label}: token ids");
        let loss: Vec<bool> = serde_json::from_value(case["loss"].clone()).unwrap();
        let learned = |mask: &[bool]| -> String {
            let ids: Vec<i64> = ids.iter().zip(mask).filter(|(_, l)| **l).map(|(i, _)| *i).collect();
            tokenizer.decode(&ids)
        };
        assert_eq!(
            document.loss,
            loss,
            "{label}: the loss mask (learned {:?}, expected {:?})",
            learned(&document.loss),
            learned(&loss)
        );
        assert!(loss.iter().any(|l| *l) && !loss.iter().all(|l| *l), "{label}");
    }
}

#[test]
fn smollm2_chatml_from_its_gguf_renders_and_tokenizes_as_transformers() {
    check("smollm2");
}

#[test]
fn llama3_template_renders_and_tokenizes_as_transformers() {
    check("llama3");
}

#[test]
fn qwen2_template_renders_and_tokenizes_as_transformers() {
    check("qwen2");
}

#[test]
fn mistral_template_renders_tokenizes_and_refuses_as_transformers() {
    check("mistral");
}
