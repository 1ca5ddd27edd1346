#![allow(clippy::unwrap_used)]
//! `regatta score --generate` across real worker processes, on the Qwen2 fixture model
//! (a Hugging Face folder that `transformers` made): a seeded sampled run writes every
//! row's text the same with 1 actor and with 3, a worker SIGKILLed mid-generation still
//! leaves every row exactly once with the same texts, rows with bad settings or prompts
//! too long for the context land in the errors file, and a rerun with other sampling
//! settings on the same output is refused.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regatta_scorer::{generated_from_parquet, GeneratedRow, ScoreConfig, ScoreRun};
use support::{temp_dir, TestCluster};

const ROWS: usize = 240;

fn model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("torch/tests/fixtures/qwen2")
        .to_string_lossy()
        .into_owned()
}

/// Prompts from the corpus in `prompt` or `text`, some with their own `params`; three rows
/// that must fail: a temperature out of range, an unknown setting, a prompt longer than
/// the model's 128-token context.
fn dataset(dir: &Path) -> (PathBuf, usize) {
    let corpus = std::fs::read_to_string(format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let mut text = String::new();
    for i in 0..ROWS {
        let start = (i * 7919) % (words.len() - 40);
        let prompt = words[start..start + 3 + i % 17].join(" ");
        let row = match i % 4 {
            0 => serde_json::json!({"id": format!("g{i:04}"), "prompt": prompt}),
            1 => serde_json::json!({"id": format!("g{i:04}"), "text": prompt, "params": {"max_new_tokens": 6}}),
            2 => {
                serde_json::json!({"id": format!("g{i:04}"), "prompt": prompt, "params": {"temperature": 0, "logprobs": true}})
            }
            _ => serde_json::json!({"id": format!("g{i:04}"), "prompt": prompt, "params": {"top_k": 5, "seed": 99}}),
        };
        text.push_str(&row.to_string());
        text.push('\n');
    }
    let bad = [
        serde_json::json!({"id": "hot", "prompt": "a b c", "params": {"temperature": -2}}),
        serde_json::json!({"id": "beam", "prompt": "a b c", "params": {"num_beams": 4}}),
        serde_json::json!({"id": "long", "prompt": words[..400].join(" ")}),
    ];
    for row in &bad {
        text.push_str(&row.to_string());
        text.push('\n');
    }
    let path = dir.join("prompts.jsonl");
    std::fs::write(&path, text).unwrap();
    (path, bad.len())
}

fn config(input: &Path, output: &Path, actors: usize) -> ScoreConfig {
    ScoreConfig {
        input: input.to_string_lossy().into_owned(),
        model: model(),
        output: output.to_string_lossy().into_owned(),
        actors,
        partitions: 12,
        generate: true,
        max_new_tokens: 16,
        temperature: 0.9,
        top_p: 0.95,
        seed: 5,
        max_batch: 8,
        kv_cache_mb: Some(4),
        prefill_tokens: 24,
        ..ScoreConfig::default()
    }
}

/// Every generated row by id, asserting no id appears twice.
fn outputs(dir: &Path) -> BTreeMap<String, GeneratedRow> {
    let mut rows = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".parquet") {
            for row in generated_from_parquet(std::fs::read(entry.path()).unwrap().into()).unwrap() {
                let id = row.id.clone();
                assert!(rows.insert(id.clone(), row).is_none(), "{id} appears twice");
            }
        }
    }
    rows
}

fn errors(dir: &Path) -> String {
    support::errors_text(dir)
}

fn assert_same_texts(dir: &Path, reference: &BTreeMap<String, GeneratedRow>) {
    let rows = outputs(dir);
    assert_eq!(rows.len(), ROWS, "every row exactly once");
    for (id, row) in &rows {
        // Rows share batches with whatever other rows are in flight (partitions overlap
        // in an actor's batch), so log-probabilities agree to float noise, not bit for bit.
        let expected = &reference[id];
        let strip = |r: &GeneratedRow| GeneratedRow {
            token_logprobs: None,
            ..r.clone()
        };
        assert_eq!(strip(row), strip(expected), "{id}");
        if let (Some(got), Some(want)) = (&row.token_logprobs, &expected.token_logprobs) {
            assert_eq!(got.len(), want.len(), "{id}");
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() < 1e-4, "{id}: log-probabilities {a} and {b}");
            }
        } else {
            assert_eq!(row.token_logprobs.is_some(), expected.token_logprobs.is_some(), "{id}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_generation_is_the_same_with_1_and_3_actors_and_survives_a_killed_worker() {
    let dir = temp_dir("generate");
    let (input, bad) = dataset(&dir);
    let mut cluster = TestCluster::start(&[("w1", "CPU=3"), ("w2", "CPU=3")]).await;
    let handle = cluster.client.cluster().clone();

    let reference_dir = dir.join("one-actor");
    let done = ScoreRun::new(handle.clone(), config(&input, &reference_dir, 1))
        .unwrap()
        .run(|_| {})
        .await
        .unwrap();
    assert_eq!((done.rows, done.errors), (ROWS as u64, bad as u64));
    let reference = outputs(&reference_dir);
    assert_eq!(reference.len(), ROWS);
    assert_eq!(
        done.output_tokens,
        reference.values().map(|r| r.generated_tokens as u64).sum::<u64>()
    );
    for (id, row) in &reference {
        let n: usize = id[1..].parse().unwrap();
        let limit = if n % 4 == 1 { 6 } else { 16 };
        assert!(row.generated_tokens >= 1 && row.generated_tokens <= limit, "{row:?}");
        assert!(row.prompt_tokens >= 3, "{row:?}");
        match row.finish_reason.as_str() {
            "length" => assert_eq!(row.generated_tokens, limit, "{row:?}"),
            "eos" => {}
            other => panic!("finish reason {other} without stop strings: {row:?}"),
        }
        let logprobs = row.token_logprobs.as_ref();
        assert_eq!(logprobs.is_some(), n % 4 == 2, "{row:?}");
        if let Some(list) = logprobs {
            assert_eq!(list.len() as i64, row.generated_tokens);
            assert!(list.iter().all(|l| *l <= 0.0));
        }
    }
    let errors = errors(&reference_dir);
    assert!(
        errors.contains(r#""id":"hot""#) && errors.contains("temperature must be 0..=100"),
        "{errors}"
    );
    assert!(errors.contains("unknown key `num_beams`"), "{errors}");
    assert!(
        errors.contains(r#""id":"long""#) && errors.contains("context is 128"),
        "{errors}"
    );

    let three_dir = dir.join("three-actors");
    ScoreRun::new(handle.clone(), config(&input, &three_dir, 3))
        .unwrap()
        .run(|_| {})
        .await
        .unwrap();
    assert_same_texts(&three_dir, &reference);

    // Three actors over two workers; w2 is SIGKILLed once two partitions are done.
    let killed_dir = dir.join("killed");
    let mut killed = false;
    let local = &mut cluster.local;
    let run = ScoreRun::new(handle.clone(), config(&input, &killed_dir, 3)).unwrap();
    let generating = run.run(|progress| {
        if !killed && progress.partitions_done >= 2 {
            local.kill_worker(1).unwrap();
            killed = true;
        }
    });
    let done = tokio::time::timeout(Duration::from_secs(600), generating)
        .await
        .expect("the run finishes within 10 minutes")
        .expect("the run finishes without w2");
    assert!(killed);
    assert!(
        done.retries >= 1,
        "a partition of the killed worker was retried: {done:?}"
    );
    assert_same_texts(&killed_dir, &reference);

    // Other sampling settings on the same output are refused before anything is written.
    let mut other = config(&input, &reference_dir, 1);
    other.temperature = 0.5;
    let error = ScoreRun::new(handle, other)
        .unwrap()
        .run(|_| {})
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("generation settings"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_batch_file_runs_as_is_and_answers_in_openais_output_and_error_formats() {
    let dir = temp_dir("generate-openai");
    let mut lines = Vec::new();
    for i in 0..12 {
        let line = if i % 3 == 0 {
            serde_json::json!({"custom_id": format!("c{i}"), "method": "POST", "url": "/v1/completions",
                "body": {"model": "gpt-4o-mini", "prompt": format!("the river {i}"), "max_tokens": 5, "stop": "\n"}})
        } else {
            serde_json::json!({"custom_id": format!("c{i}"), "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": format!("tell me about {i}")}],
                         "max_tokens": 6, "temperature": 0}})
        };
        lines.push(line.to_string());
    }
    lines.push(
        serde_json::json!({"custom_id": "bad-key", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}})
        .to_string(),
    );
    lines.push(
        serde_json::json!({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}).to_string(),
    );
    let input = dir.join("batch.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    // The fixture model with a ChatML template, for the chat rows.
    let model_dir = dir.join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    for entry in std::fs::read_dir(model()).unwrap().flatten() {
        std::fs::copy(entry.path(), model_dir.join(entry.file_name())).unwrap();
    }
    let settings_path = model_dir.join("tokenizer_config.json");
    let mut settings: serde_json::Value = serde_json::from_slice(&std::fs::read(&settings_path).unwrap()).unwrap();
    settings["chat_template"] = serde_json::Value::String(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}\
         {% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
            .into(),
    );
    std::fs::write(&settings_path, settings.to_string()).unwrap();
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let out = dir.join("out");
    let mut c = config(&input, &out, 1);
    c.model = model_dir.to_string_lossy().into_owned();
    c.partitions = 3;
    c.temperature = 0.0;
    let done = ScoreRun::new(cluster.client.cluster().clone(), c)
        .unwrap()
        .run(|_| {})
        .await
        .unwrap();
    assert_eq!((done.rows, done.errors), (12, 2));
    let parquet = outputs(&out);
    let mut answered = BTreeMap::new();
    let mut refused = BTreeMap::new();
    for entry in std::fs::read_dir(&out).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        let target = if name.ends_with(".openai.jsonl") {
            &mut answered
        } else if name.ends_with(".openai-errors.jsonl") {
            &mut refused
        } else {
            continue;
        };
        for line in text.lines() {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            let id = value["custom_id"].as_str().unwrap().to_string();
            assert!(target.insert(id.clone(), value).is_none(), "{id} answered twice");
        }
    }
    assert_eq!(answered.len(), 12);
    for (id, line) in &answered {
        let body = &line["response"]["body"];
        let row = &parquet[id];
        let choice = &body["choices"][0];
        let n: usize = id[1..].parse().unwrap();
        let text = if n % 3 == 0 {
            assert_eq!(body["object"], "text_completion");
            &choice["text"]
        } else {
            assert_eq!(body["object"], "chat.completion");
            assert_eq!(choice["message"]["role"], "assistant");
            &choice["message"]["content"]
        };
        assert_eq!(text.as_str(), Some(row.generated.as_str()), "{id}");
        assert_eq!(body["model"], "gpt-4o-mini", "the row's model is echoed");
        assert_eq!(body["usage"]["completion_tokens"], row.generated_tokens);
        assert_eq!(body["usage"]["prompt_tokens"], row.prompt_tokens);
        let expected = if row.finish_reason == "length" {
            "length"
        } else {
            "stop"
        };
        assert_eq!(choice["finish_reason"], expected, "{id}");
        assert!(row.generated_tokens <= if n % 3 == 0 { 5 } else { 6 });
    }
    assert_eq!(refused.keys().collect::<Vec<_>>(), vec!["bad-key", "bad-url"]);
    assert!(refused["bad-key"]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("`presence_penalty`"));
    assert!(refused["bad-url"]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not served"));
    assert_eq!(refused["bad-key"]["response"], serde_json::Value::Null);
    let _ = std::fs::remove_dir_all(&dir);
}
