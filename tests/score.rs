#![allow(clippy::unwrap_used)]
//! The scorer across real worker processes: 3 scorer actors over 2 workers score 100,000
//! rows with a checkpoint the trainer wrote; a worker SIGKILLed mid-run still leaves every
//! row id exactly once with the same scores as a single-actor run; a driver killed mid-run
//! and started again skips finished partitions; malformed rows land in errors files.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use regatta_scorer::{from_parquet, ScoreConfig, ScoreRun, ScoredRow};
use support::{temp_dir, TestCluster};

const ROWS: usize = 100_000;
const MALFORMED: [&str; 3] = [
    r#"{"id": "bad-text", "text": 17}"#,
    r#"{"text": "no id here"}"#,
    r#"{"id": "broken", "text": "unterminated"#,
];

fn regatta() -> Command {
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
    assert!(
        binary.with_file_name("regatta-torch-rank").is_file(),
        "regatta-torch-rank is not built next to regatta: run `cargo build --workspace` (scripts/test.sh does)"
    );
    Command::new(binary)
}

/// A small checkpoint, written by the trainer.
fn checkpoint(dir: &Path) -> String {
    let ckpt = dir.join("ckpt");
    let status = regatta()
        .args([
            "train",
            "--steps",
            "10",
            "--world-size",
            "1",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ])
        .args(["--data", &format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"))])
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stdout));
    ckpt.to_string_lossy().into_owned()
}

/// 100,000 rows cut from the corpus (varied lengths) with malformed lines among them.
fn dataset(dir: &Path) -> String {
    let corpus = std::fs::read_to_string(format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let mut text = String::new();
    for i in 0..ROWS {
        let start = (i * 7919) % (words.len() - 20);
        let len = 2 + i % 9;
        let row = serde_json::json!({"id": format!("r{i:06}"), "text": words[start..start + len].join(" ")});
        text.push_str(&row.to_string());
        text.push('\n');
        if i % 30_000 == 10_000 {
            text.push_str(MALFORMED[i / 30_000]);
            text.push('\n');
        }
    }
    let path = dir.join("rows.jsonl");
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn config(input: &str, model: &str, output: &Path, actors: usize) -> ScoreConfig {
    ScoreConfig {
        input: input.into(),
        model: model.into(),
        output: output.to_string_lossy().into_owned(),
        actors,
        batch_size: 256,
        partitions: 24,
        max_new_tokens: 0,
        ..ScoreConfig::default()
    }
}

/// Every scored row by id, asserting no id appears twice.
fn outputs(dir: &Path) -> BTreeMap<String, ScoredRow> {
    let mut rows = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".parquet") {
            for row in from_parquet(std::fs::read(entry.path()).unwrap().into()).unwrap() {
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

fn assert_complete(dir: &Path, reference: &BTreeMap<String, ScoredRow>) {
    let rows = outputs(dir);
    assert_eq!(rows.len(), ROWS, "every row exactly once");
    for (id, row) in &rows {
        let expected = &reference[id];
        assert_eq!(row.tokens, expected.tokens, "{id}");
        let diff = (row.log_likelihood - expected.log_likelihood).abs();
        assert!(
            diff < 1e-3 * expected.log_likelihood.abs().max(1.0),
            "{id}: {row:?} vs {expected:?}"
        );
    }
    let errors = errors(dir);
    assert_eq!(errors.lines().count(), MALFORMED.len(), "{errors}");
    assert!(
        errors.contains(r#""id":"bad-text""#) && errors.contains("must be a string"),
        "{errors}"
    );
    assert!(
        errors.contains("no `id` field") && errors.contains("not valid JSON"),
        "{errors}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_worker_loses_no_row_and_a_restarted_driver_skips_finished_partitions() {
    let dir = temp_dir("score");
    let model = checkpoint(&dir);
    let input = dataset(&dir);
    let mut cluster = TestCluster::start(&[("w1", "CPU=3"), ("w2", "CPU=3")]).await;
    let handle = cluster.client.cluster().clone();

    // The single-actor reference.
    let reference_dir = dir.join("reference");
    let done = ScoreRun::new(handle.clone(), config(&input, &model, &reference_dir, 1))
        .unwrap()
        .run(|_| {})
        .await
        .unwrap();
    assert_eq!((done.rows, done.errors), (ROWS as u64, MALFORMED.len() as u64));
    let reference = outputs(&reference_dir);
    assert_eq!(reference.len(), ROWS);
    assert!(reference.values().all(|r| r.perplexity > 1.0 && r.log_likelihood < 0.0));
    // The run reported itself to the head's dashboard as it went: every partition, the
    // rows and the malformed ones, and its end.
    let runs = match handle.view(regatta::ViewQuery::Runs).await.unwrap() {
        regatta::View::Runs(runs) => runs,
        other => panic!("not runs: {other:?}"),
    };
    let scored = runs
        .iter()
        .find(|r| r.kind == "score")
        .unwrap_or_else(|| panic!("no score run: {runs:?}"));
    assert!(scored.finished, "{scored:?}");
    assert_eq!(scored.last["partitions_done"], scored.last["partitions"], "{scored:?}");
    assert_eq!(scored.last["rows"], ROWS as f64, "{scored:?}");
    assert_eq!(scored.last["errors"], MALFORMED.len() as f64, "{scored:?}");
    assert_eq!(scored.last["failed"], 0.0, "{scored:?}");
    assert!(scored.last["rows_per_sec"] > 0.0, "{scored:?}");

    // Three actors over two workers; w2 is SIGKILLed once a third of the partitions are done.
    let killed_dir = dir.join("killed");
    let mut killed = false;
    let local = &mut cluster.local;
    let run = ScoreRun::new(handle.clone(), config(&input, &model, &killed_dir, 3)).unwrap();
    let scoring = run.run(|progress| {
        if !killed && progress.partitions_done >= 8 {
            local.kill_worker(1).unwrap();
            killed = true;
        }
    });
    // The run takes about 20 s here; a hang must fail the test, not stall the suite.
    let done = tokio::time::timeout(Duration::from_secs(600), scoring)
        .await
        .expect("the run finishes within 10 minutes")
        .expect("the run finishes without w2");
    assert!(killed);
    assert!(
        done.retries >= 1,
        "a partition of the killed worker was retried: {done:?}"
    );
    assert_complete(&killed_dir, &reference);

    // A driver killed mid-run, then started again on the same output.
    let restarted_dir = dir.join("restarted");
    let address = cluster.local.address.clone();
    let token = cluster.local.token.clone();
    let cli = |dir: &Path| {
        let mut command = regatta();
        command
            .args([
                "score",
                "--input",
                &input,
                "--model",
                &model,
                "--output",
                dir.to_str().unwrap(),
            ])
            .args([
                "--actors",
                "2",
                "--batch-size",
                "256",
                "--partitions",
                "24",
                "--address",
                &address,
            ])
            .env("REGATTA_TOKEN", &token);
        command
    };
    let mut driver = cli(&restarted_dir).stdout(std::process::Stdio::null()).spawn().unwrap();
    support::eventually("some partitions written", Duration::from_secs(120), || async {
        let written = std::fs::read_dir(&restarted_dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".parquet"))
                    .count()
            })
            .unwrap_or(0);
        (written >= 4).then_some(())
    })
    .await;
    driver.kill().unwrap();
    driver.wait().unwrap();
    let output = cli(&restarted_dir).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let skipped: usize = stdout
        .split(" partitions skipped")
        .next()
        .and_then(|s| s.rsplit(", ").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no skipped count in:\n{stdout}"));
    assert!(skipped >= 4, "{stdout}");
    assert_complete(&restarted_dir, &reference);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parquet_input_is_partitioned_by_row_group_and_scores_like_jsonl_and_like_torchscript() {
    let dir = temp_dir("score-parquet");
    let model = checkpoint(&dir);
    let corpus = std::fs::read_to_string(format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let rows: Vec<(String, Option<String>)> = (0..3_000)
        .map(|i| {
            let text = (i != 1234).then(|| words[(i * 31) % 5000..(i * 31) % 5000 + 3 + i % 5].join(" "));
            (format!("p{i:05}"), text)
        })
        .collect();
    // Two row groups for three actors: the groups are cut into row ranges.
    let parquet = dir.join("rows.parquet");
    std::fs::write(&parquet, regatta_scorer::rows_to_parquet(&rows, 1_500).unwrap()).unwrap();
    let jsonl = dir.join("rows.jsonl");
    let mut text = String::new();
    for (id, row) in rows.iter().filter(|(_, t)| t.is_some()) {
        text.push_str(&serde_json::json!({"id": id, "text": row}).to_string());
        text.push('\n');
    }
    std::fs::write(&jsonl, text).unwrap();

    let cluster = TestCluster::start(&[("w1", "CPU=2"), ("w2", "CPU=2")]).await;
    let handle = cluster.client.cluster().clone();
    let run = |input: &Path, out: &Path| {
        let mut config = config(input.to_str().unwrap(), &model, out, 3);
        config.partitions = 6;
        ScoreRun::new(handle.clone(), config).unwrap()
    };
    let from_parquet_dir = dir.join("from-parquet");
    let done = run(&parquet, &from_parquet_dir).run(|_| {}).await.unwrap();
    assert_eq!((done.rows, done.errors, done.partitions), (2_999, 1, 6), "{done:?}");
    let manifest = std::fs::read_to_string(from_parquet_dir.join("_manifest.json")).unwrap();
    assert!(manifest.contains("\"group\": 1"), "{manifest}");
    let errors = errors(&from_parquet_dir);
    assert!(
        errors.contains(r#""id":"p01234""#) && errors.contains("`text` is null") && errors.contains(r#""offset":1234"#),
        "{errors}"
    );

    // The same output with another layout or model would skip the wrong rows: refused.
    let mut other = config(parquet.to_str().unwrap(), &model, &from_parquet_dir, 3);
    other.partitions = 4;
    let err = ScoreRun::new(handle.clone(), other)
        .unwrap()
        .run(|_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, regatta_scorer::Error::Output(_)), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("holds the output of another run") && err.contains("6 partitions"),
        "{err}"
    );

    let from_jsonl_dir = dir.join("from-jsonl");
    run(&jsonl, &from_jsonl_dir).run(|_| {}).await.unwrap();
    let (a, b) = (outputs(&from_parquet_dir), outputs(&from_jsonl_dir));
    assert_eq!(a.len(), 2_999);
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (id, row) in &a {
        assert_eq!(row.tokens, b[id].tokens, "{id}");
        assert!(
            (row.log_likelihood - b[id].log_likelihood).abs() < 1e-3,
            "{id}: {row:?} vs {:?}",
            b[id]
        );
    }

    // The same checkpoint exported as TorchScript scores the same.
    let exported = dir.join("model.pt");
    let export = Command::new(PathBuf::from(env!("CARGO_BIN_EXE_regatta")).with_file_name("regatta-torch-rank"))
        .args(["export", &model, exported.to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&export.stdout);
    assert!(
        export.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&export.stderr)
    );
    assert!(said.contains("--context 64"), "{said}");
    let script_dir = dir.join("from-torchscript");
    let mut script_config = config(parquet.to_str().unwrap(), exported.to_str().unwrap(), &script_dir, 2);
    let err = ScoreRun::new(handle.clone(), script_config.clone())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("needs `context`"), "{err}");
    script_config.context = 64;
    ScoreRun::new(handle.clone(), script_config)
        .unwrap()
        .run(|_| {})
        .await
        .unwrap();
    let c = outputs(&script_dir);
    assert_eq!(c.len(), 2_999);
    for (id, row) in &a {
        assert_eq!(row.tokens, c[id].tokens, "{id}");
        assert!(
            (row.log_likelihood - c[id].log_likelihood).abs() < 1e-3,
            "{id}: {row:?} vs {:?}",
            c[id]
        );
    }

    // Not Parquet, or no text column: a clear error before any actor starts.
    let fake = dir.join("fake.parquet");
    std::fs::write(&fake, b"{\"id\": 1}\n").unwrap();
    let err = run(&fake, &dir.join("out-fake")).run(|_| {}).await.unwrap_err();
    assert!(matches!(err, regatta_scorer::Error::Input(_)), "{err:?}");
    let err = err.to_string();
    assert!(err.contains("is not a readable Parquet file"), "{err}");
    let scored = dir.join("scored.parquet");
    std::fs::write(
        &scored,
        std::fs::read(from_parquet_dir.join("part-00000.parquet")).unwrap(),
    )
    .unwrap();
    let err = run(&scored, &dir.join("out-scored")).run(|_| {}).await.unwrap_err();
    assert!(matches!(err, regatta_scorer::Error::Input(_)), "{err:?}");
    let err = err.to_string();
    assert!(err.contains("has no `text` column"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
