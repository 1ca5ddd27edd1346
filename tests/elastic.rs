#![allow(clippy::unwrap_used)]
//! Elastic training on the streaming loader, with real head, worker and executor
//! processes. Token accounting: a run on 2 ranks stopped mid-epoch, resumed on 3
//! (`regatta train --world-size 3 --resume`), stopped, resumed on 1 to the end of the
//! epoch trains on every document exactly once, as the ranks' ledgers show. Elastic: a
//! `min_workers = 2, max_workers = 3` run loses a SIGKILLed worker, continues on 2 from
//! the last checkpoint, grows back to 3 at a checkpoint once a worker returns, and still
//! trains on every document once with a finite loss.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use regatta_trainer::{ScalingConfig, TrainConfig, TrainEvent, TrainerGroup};
use support::{run_json, temp_dir, TestCluster};

fn require_executor() {
    let regatta = PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
    assert!(
        regatta.with_file_name("regatta-torch-rank").is_file(),
        "regatta-torch-rank is not built next to {}: run `cargo build --workspace` (scripts/test.sh does)",
        regatta.display()
    );
}

/// `files` JSONL files of `per_file` documents each under `dir/corpus`; returns every
/// document's key (`url@byte offset`, as the ledger names documents).
fn write_corpus(dir: &Path, files: usize, per_file: usize) -> Vec<String> {
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    let words = [
        "sea", "ship", "wind", "harbour", "sail", "rope", "tide", "gull", "mast", "keel",
    ];
    let mut keys = Vec::new();
    for f in 0..files {
        let mut body = String::new();
        for d in 0..per_file {
            let n = f * per_file + d;
            let text: Vec<&str> = (0..8 + n % 25).map(|i| words[(n * 7 + i * 3) % words.len()]).collect();
            keys.push(format!("{}/part-{f}.jsonl@{}", corpus.display(), body.len()));
            body.push_str(&format!(
                "{}\n",
                serde_json::json!({"id": n, "text": format!("{n}: {}", text.join(" "))})
            ));
        }
        std::fs::write(corpus.join(format!("part-{f}.jsonl")), body).unwrap();
    }
    keys.sort();
    keys
}

/// The documents the ranks trained on, from their ledgers: for each step, the lines of
/// the latest attempt that ran it (a step redone after a restart supersedes the lost
/// attempt's lines).
fn ledger_documents(ledger: &Path) -> Vec<String> {
    let mut by_step: BTreeMap<u64, (u64, Vec<String>)> = BTreeMap::new();
    let mut lines = Vec::new();
    for entry in std::fs::read_dir(ledger).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines() {
            let mut parts = line.splitn(3, '\t');
            let attempt: u64 = parts.next().unwrap().parse().unwrap();
            let step: u64 = parts.next().unwrap().parse().unwrap();
            lines.push((attempt, step, parts.next().unwrap().to_string()));
        }
    }
    for (attempt, step, _) in &lines {
        let entry = by_step.entry(*step).or_insert((*attempt, Vec::new()));
        entry.0 = entry.0.max(*attempt);
    }
    for (attempt, step, key) in lines {
        let entry = by_step.get_mut(&step).unwrap();
        if entry.0 == attempt {
            entry.1.push(key);
        }
    }
    let mut documents: Vec<String> = by_step.into_values().flat_map(|(_, keys)| keys).collect();
    documents.sort();
    documents
}

fn assert_exactly_once(seen: &[String], expected: &[String]) {
    let mut repeated = seen.to_vec();
    repeated.dedup();
    let doubles: Vec<&String> = seen
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| &w[0])
        .take(5)
        .collect();
    assert!(doubles.is_empty(), "documents trained on twice: {doubles:?}");
    let missing: Vec<&String> = expected
        .iter()
        .filter(|k| seen.binary_search(k).is_err())
        .take(5)
        .collect();
    assert!(missing.is_empty(), "documents never trained on: {missing:?}");
    assert_eq!(seen, expected);
}

/// A small GPT on the corpus under `dir`: a global batch of 6 sequences (2 ranks x 3
/// micro-batches of 1), one epoch, a checkpoint every 4 steps, ledgers under `dir/ledger`.
fn toml(dir: &Path) -> String {
    format!(
        r#"
world_size = 2
micro_batch_size = 1
gradient_accumulation = 3
steps = 100000
threads = 1
[model]
layers = 1
width = 16
heads = 2
context = 32
[optimizer]
warmup_steps = 0
[data]
shards = 6
epochs = 1
ledger = "{ledger}"
[[data.sources]]
path = "{corpus}"
[checkpoint]
interval = 4
dir = "{ckpt}"
"#,
        ledger = dir.join("ledger").display(),
        corpus = dir.join("corpus").display(),
        ckpt = dir.join("ckpt").display(),
    )
}

#[test]
fn a_run_stopped_and_resumed_on_3_then_1_ranks_trains_on_every_document_once() {
    require_executor();
    let dir = temp_dir("elastic-accounting");
    let expected = write_corpus(&dir, 8, 30);
    let config = dir.join("train.toml");
    std::fs::write(&config, toml(&dir)).unwrap();
    let config = config.to_str().unwrap();
    let first = run_json(&["train", "--config", config, "--steps", "10", "--json"]);
    assert_eq!(first["steps"], 10);
    // The global batch (6 sequences) stays: 3 ranks take 2 micro-batches each.
    let second = run_json(&[
        "train",
        "--config",
        config,
        "--world-size",
        "3",
        "--resume",
        "--steps",
        "25",
        "--json",
    ]);
    assert_eq!(second["steps"], 25);
    let last = run_json(&["train", "--config", config, "--world-size", "1", "--resume", "--json"]);
    let steps = last["steps"].as_u64().unwrap();
    assert!(steps > 40 && steps < 100_000, "the epoch ended at step {steps}");
    let losses: Vec<f64> = last["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().unwrap())
        .collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert_exactly_once(&ledger_documents(&dir.join("ledger")), &expected);
    // A world size that cannot keep the global batch is refused with the ones that can.
    let output = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["train", "--config", config, "--world-size", "4", "--resume"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("allowed world sizes: [1, 2, 3, 6]"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_shrinks_the_run_and_a_returning_one_grows_it_back_without_losing_a_document() {
    require_executor();
    let dir = temp_dir("elastic-scaling");
    let expected = write_corpus(&dir, 10, 40);
    let mut config = TrainConfig::from_toml(&toml(&dir)).unwrap().rescale(3).unwrap();
    config.checkpoint.interval = 5;
    config.scaling = Some(ScalingConfig {
        min_workers: 2,
        max_workers: 3,
        replacement_timeout_secs: 3,
    });
    config.max_failures = 3;
    config.stall_timeout_secs = 60;
    let mut cluster = TestCluster::start(&[("w1", "CPU=1"), ("w2", "CPU=1"), ("w3", "CPU=1")]).await;
    let handle = cluster.client.cluster().clone();
    let local = &mut cluster.local;
    let mut events = Vec::new();
    let mut killed: Option<usize> = None;
    let mut returned = false;
    let mut rank2_node = None;
    let summary = TrainerGroup::new(handle, config)
        .unwrap()
        .run(|event| {
            match event {
                TrainEvent::Started { nodes, attempt: 0, .. } => rank2_node = Some(nodes[2].clone()),
                TrainEvent::Step(step) if step.step >= 12 && killed.is_none() => {
                    let node = rank2_node.clone().expect("started before stepping");
                    let index = node.trim_start_matches('w').parse::<usize>().unwrap() - 1;
                    local.kill_worker(index).unwrap();
                    killed = Some(index);
                }
                TrainEvent::Rescaled { from: 3, to: 2, .. } if !returned => {
                    local.restart_worker(killed.expect("a worker was killed")).unwrap();
                    returned = true;
                }
                _ => {}
            }
            events.push(event.clone());
        })
        .await
        .expect("the elastic run finishes");
    let rescales: Vec<(usize, usize)> = events
        .iter()
        .filter_map(|e| match e {
            TrainEvent::Rescaled { from, to, .. } => Some((*from, *to)),
            _ => None,
        })
        .collect();
    assert_eq!(rescales, vec![(3, 2), (2, 3)], "{events:?}");
    assert_eq!((summary.world, summary.rescales, summary.failures), (3, 2, 1));
    let worlds: Vec<usize> = events
        .iter()
        .filter_map(|e| match e {
            TrainEvent::Started { world, .. } => Some(*world),
            _ => None,
        })
        .collect();
    assert_eq!(worlds, vec![3, 2, 3], "{events:?}");
    assert!(summary.losses.values().all(|l| l.is_finite()), "{:?}", summary.losses);
    assert_exactly_once(&ledger_documents(&dir.join("ledger")), &expected);
    let _ = std::fs::remove_dir_all(&dir);
}
