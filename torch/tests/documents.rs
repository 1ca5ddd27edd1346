#![allow(clippy::unwrap_used)]
//! Document datasets as a rank loads them: JSONL and Parquet rows of plain text, prompt
//! and response, and chat messages rendered with a chat template, packed into rows whose
//! loss falls only on what the model must learn.

use std::path::{Path, PathBuf};

use regatta_torch::{DataSource, RankData, TextTokenizer};
use regatta_trainer::DataFormat;
use regatta_trainer::TokenizerSettings;
use regatta_trainer::IGNORE_INDEX;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("regatta-documents-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tokenizer() -> TextTokenizer {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tokenizer.json");
    TextTokenizer::from_json(&std::fs::read(path).unwrap(), "data/tokenizer.json").unwrap()
}

fn settings() -> TokenizerSettings {
    TokenizerSettings::from_json(&serde_json::json!({
        "eos_token": "</s>", "add_bos_token": false, "chat_template": CHATML,
    }))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn load(
    path: &Path,
    format: DataFormat,
    context: usize,
    partitions: usize,
    which: &[usize],
) -> regatta_torch::Result<RankData> {
    let (tokenizer, settings) = (tokenizer(), settings());
    let source = DataSource {
        path: path.to_str().unwrap(),
        format,
        tokenizer: &tokenizer,
        settings: &settings,
        holdout: None,
    };
    runtime().block_on(RankData::load(&source, context, partitions, which))
}

/// The target ids that carry loss in every row of `data`, in order.
fn learned(data: &RankData) -> Vec<i64> {
    let rows = data.sequences()[0];
    let (_, targets, documents) = data.batch(0, rows);
    assert!(documents.is_some(), "document rows carry document numbers");
    Vec::<i64>::try_from(targets.view(-1))
        .unwrap()
        .into_iter()
        .filter(|t| *t != IGNORE_INDEX)
        .collect()
}

fn encode(text: &str) -> Vec<i64> {
    tokenizer().encode(text.as_bytes()).unwrap()
}

#[test]
fn only_responses_and_assistant_turns_carry_loss() {
    let dir = temp_dir("loss");
    let rows = [
        serde_json::json!({"prompt": "What is two and two?", "response": " Four."}),
        serde_json::json!({"messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Green."}]}),
    ];
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    let path = dir.join("sft.jsonl");
    std::fs::write(&path, text).unwrap();
    // One row per document fits: the context is longer than each.
    let data = load(&path, DataFormat::Auto, 8, 1, &[0]).unwrap();
    let mut expected = Vec::new();
    for piece in [" Four.", "</s>", "Blue.<|im_end|>\n", "Green.<|im_end|>\n"] {
        expected.extend(encode(piece));
    }
    // A target is never the first token of a document, and the stream is cut into rows of
    // 8 with the tail dropped: compare what the rows cover.
    let got = learned(&data);
    assert!(!got.is_empty());
    let prompt_tokens = encode("What is two and two?");
    assert!(
        got.windows(prompt_tokens.len()).all(|w| w != prompt_tokens.as_slice()),
        "prompt tokens must carry no loss"
    );
    assert_eq!(got, expected[..got.len()], "learned tokens are the responses, in order");
    assert!(got.len() + 8 > expected.len(), "at most one row's tail is dropped");
}

#[test]
fn parquet_rows_load_like_the_same_jsonl_rows() {
    let dir = temp_dir("parquet");
    let texts: Vec<String> = (0..40)
        .map(|i| format!("Document number {i} talks about the sea and ships."))
        .collect();
    let jsonl: String = texts
        .iter()
        .map(|t| format!("{}\n", serde_json::json!({"text": t})))
        .collect();
    std::fs::write(dir.join("docs.jsonl"), jsonl).unwrap();
    let rows: Vec<(String, Option<String>)> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (i.to_string(), Some(t.clone())))
        .collect();
    let parquet = regatta_scorer::rows_to_parquet(&rows, 7).unwrap();
    std::fs::write(dir.join("docs.parquet"), &parquet).unwrap();
    let a = load(&dir.join("docs.jsonl"), DataFormat::Auto, 16, 1, &[0]).unwrap();
    let b = load(&dir.join("docs.parquet"), DataFormat::Auto, 16, 1, &[0]).unwrap();
    assert_eq!(a.sequences(), b.sequences());
    let (ta, ya, da) = a.batch(0, a.sequences()[0]);
    let (tb, yb, db) = b.batch(0, b.sequences()[0]);
    assert!(ta.equal(&tb) && ya.equal(&yb) && da.unwrap().equal(&db.unwrap()));
    // Two partitions split the documents between them and together hold them all.
    let halves: Vec<usize> = (0..2)
        .map(|p| {
            load(&dir.join("docs.parquet"), DataFormat::Auto, 16, 2, &[p])
                .unwrap()
                .sequences()[0]
        })
        .collect();
    assert!(halves.iter().all(|n| *n > 0));
    assert!(
        halves.iter().sum::<usize>() + 2 >= a.sequences()[0],
        "{halves:?} vs {:?}",
        a.sequences()
    );
}

/// The numbers of the "Document number N " texts the rows of `data` hold.
fn document_numbers(data: &RankData) -> std::collections::BTreeSet<usize> {
    let (inputs, _, _) = data.batch(0, data.sequences()[0]);
    let ids = Vec::<i64>::try_from(inputs.view(-1)).unwrap();
    let text = tokenizer().decode(&ids);
    text.split("Document number ")
        .skip(1)
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect()
}

#[test]
fn a_held_out_split_puts_every_row_on_one_side() {
    use regatta_trainer::eval::{Holdout, Side};
    let dir = temp_dir("split");
    let texts: Vec<String> = (0..200).map(|i| format!("Document number {i} is here.")).collect();
    let jsonl: String = texts
        .iter()
        .map(|t| format!("{}\n", serde_json::json!({"text": t})))
        .collect();
    std::fs::write(dir.join("docs.jsonl"), jsonl).unwrap();
    let rows: Vec<(String, Option<String>)> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (i.to_string(), Some(t.clone())))
        .collect();
    std::fs::write(
        dir.join("docs.parquet"),
        regatta_scorer::rows_to_parquet(&rows, 7).unwrap(),
    )
    .unwrap();
    let (tokenizer, settings) = (tokenizer(), settings());
    for name in ["docs.jsonl", "docs.parquet"] {
        let path = dir.join(name);
        let side = |side: Side, partitions: usize, p: usize| {
            let source = DataSource {
                path: path.to_str().unwrap(),
                format: DataFormat::Auto,
                tokenizer: &tokenizer,
                settings: &settings,
                holdout: Some(Holdout {
                    fraction: 0.2,
                    seed: 3,
                    side,
                }),
            };
            runtime()
                .block_on(RankData::load(&source, 16, partitions, &[p]))
                .unwrap()
        };
        let held = document_numbers(&side(Side::Eval, 1, 0));
        // Training over two partitions, as two ranks read it.
        let trained: std::collections::BTreeSet<usize> = (0..2)
            .flat_map(|p| document_numbers(&side(Side::Train, 2, p)))
            .collect();
        assert!(
            held.is_disjoint(&trained),
            "{name}: {:?}",
            held.intersection(&trained).collect::<Vec<_>>()
        );
        // Each load drops at most its last row's tail: at most a document or two a side.
        assert!(
            held.len() + trained.len() + 4 >= 200,
            "{name}: {} + {}",
            held.len(),
            trained.len()
        );
        assert!(
            (20..=60).contains(&held.len()),
            "{name}: {} held out of 200",
            held.len()
        );
    }
}

#[test]
fn bad_rows_are_errors_that_name_the_file_and_the_row() {
    let dir = temp_dir("bad");
    let path = dir.join("bad.jsonl");
    std::fs::write(&path, "{\"text\": \"fine\"}\n{\"prompt\": \"no response\"}\n").unwrap();
    let error = load(&path, DataFormat::Auto, 4, 1, &[0]).err().unwrap().to_string();
    assert!(
        error.contains("bad.jsonl") && error.contains("byte 17") && error.contains("no `response`"),
        "{error}"
    );
    std::fs::write(&path, "{\"text\": \"fine\"}\nnot json\n").unwrap();
    let error = load(&path, DataFormat::Auto, 4, 1, &[0]).err().unwrap().to_string();
    assert!(error.contains("not valid JSON"), "{error}");
    let chat = dir.join("chat.jsonl");
    std::fs::write(
        &chat,
        "{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\"}]}\n",
    )
    .unwrap();
    let (tokenizer, none) = (tokenizer(), TokenizerSettings::default());
    let source = DataSource {
        path: chat.to_str().unwrap(),
        format: DataFormat::Jsonl,
        tokenizer: &tokenizer,
        settings: &none,
        holdout: None,
    };
    let error = runtime()
        .block_on(RankData::load(&source, 4, 1, &[0]))
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("chat_template"), "{error}");
    let not_parquet = dir.join("x.parquet");
    std::fs::write(&not_parquet, "plain text").unwrap();
    let error = load(&not_parquet, DataFormat::Auto, 4, 1, &[0])
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("not a readable Parquet file"), "{error}");
}
