//! A SentencePiece-style GGUF vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral
//! v0.1-0.3, TinyLlama) becomes the `tokenizer.json` `transformers` builds from the same file.
//! The fixture, by `scripts/make-gguf-sp-fixture.py`, holds that `tokenizer.json` and the ids
//! `transformers` gives sample texts (spaces, a leading space, newlines, characters the
//! vocabulary lacks, added tokens) with the text it decodes them to.

use std::path::{Path, PathBuf};

use regatta_trainer::gguf::{GgufHeader, GgufModel};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../torch/tests/fixtures/gguf")
        .join(name)
}

#[test]
fn a_sentencepiece_gguf_vocabulary_tokenizes_as_transformers_does() {
    let bytes = std::fs::read(fixture("sp-tokenizer.gguf")).unwrap();
    let header = GgufHeader::parse(&bytes, bytes.len() as u64).unwrap();
    let model = GgufModel::from_header(&header).unwrap();
    let json = model.tokenizer.unwrap();
    let expected: Value = serde_json::from_slice(&std::fs::read(fixture("sp-tokenizer.json")).unwrap()).unwrap();
    let reference = &expected["tokenizer"];
    for part in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
        "model",
    ] {
        assert_eq!(json[part], reference[part], "{part} differs from transformers'");
    }
    assert_eq!(&json, reference);

    let tokenizer = tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap();
    let samples = expected["samples"].as_array().unwrap();
    assert!(samples.len() >= 6);
    for sample in samples {
        let text = sample["text"].as_str().unwrap();
        let ids: Vec<u32> = sample["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap() as u32)
            .collect();
        let encoding = tokenizer.encode(text, false).unwrap();
        assert_eq!(encoding.get_ids(), ids, "{text:?}");
        assert_eq!(
            tokenizer.decode(&ids, false).unwrap(),
            sample["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
    // Byte fallback is exercised: `日` is not in the vocabulary, its UTF-8 bytes are.
    let cjk = samples
        .iter()
        .find(|s| s["text"].as_str().unwrap().contains('日'))
        .unwrap();
    let byte_e6 = reference["model"]["vocab"]["<0xE6>"].clone();
    assert!(cjk["ids"].as_array().unwrap().contains(&byte_e6));

    assert_eq!(model.tokenizer_config["bos_token"], "<s>");
    assert_eq!(model.tokenizer_config["add_bos_token"], true);
}
