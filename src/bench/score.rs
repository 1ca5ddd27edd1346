//! `regatta bench score`: rows/s and tokens/s of scoring by number of scorer actors and
//! batch size, on a local cluster of 2 workers, with a checkpoint trained for the purpose.

use std::time::Duration;

use regatta_scorer::{ScoreConfig, ScoreRun};
use regatta_trainer::{TrainConfig, TrainerGroup};

use super::measure::mean_spread;
use crate::local::{LocalCluster, LocalOptions, WorkerSpec};

fn dataset(path: &std::path::Path, rows: usize) -> anyhow::Result<()> {
    let corpus = std::fs::read_to_string(format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR")))?;
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let mut text = String::new();
    for i in 0..rows {
        let start = (i * 7919) % (words.len() - 40);
        let line = serde_json::json!({"id": i, "text": words[start..start + 4 + i % 24].join(" ")});
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(path, text)?;
    Ok(())
}

/// Runs the scoring benchmark and prints one line per figure.
pub async fn score(trials: usize, quick: bool) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("regatta-bench-score-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let rows = if quick { 2_000 } else { 50_000 };
    let input = dir.join("rows.jsonl");
    dataset(&input, rows)?;
    let workers = vec![WorkerSpec::new("w1", "CPU=2"), WorkerSpec::new("w2", "CPU=2")];
    let mut cluster = LocalCluster::start(LocalOptions::new(workers)?)?;
    let outcome = async {
        let client = cluster.connect(Duration::from_secs(30)).await?;
        let mut train = TrainConfig::default();
        train.data.path = format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"));
        train.world_size = 1;
        train.steps = 5;
        train.checkpoint.dir = dir.join("ckpt").to_string_lossy().into_owned();
        TrainerGroup::new(client.cluster().clone(), train)?.run(|_| {}).await?;
        for actors in [1usize, 2] {
            for batch in [32usize, 256] {
                let (mut rates, mut token_rates) = (Vec::new(), Vec::new());
                for trial in 0..trials {
                    let config = ScoreConfig {
                        input: input.to_string_lossy().into_owned(),
                        model: dir.join("ckpt").to_string_lossy().into_owned(),
                        output: dir
                            .join(format!("out-{actors}-{batch}-{trial}"))
                            .to_string_lossy()
                            .into_owned(),
                        actors,
                        batch_size: batch,
                        ..ScoreConfig::default()
                    };
                    let done = ScoreRun::new(client.cluster().clone(), config)
                        .map_err(anyhow::Error::msg)?
                        .run(|_| {})
                        .await
                        .map_err(anyhow::Error::msg)?;
                    anyhow::ensure!(done.rows == rows as u64, "scored {} of {rows} rows", done.rows);
                    rates.push(done.rows as f64 / done.seconds);
                    token_rates.push(done.tokens as f64 / done.seconds);
                }
                let (r, rs) = mean_spread(&rates);
                let (t, ts) = mean_spread(&token_rates);
                println!("score {actors} actor(s) batch {batch} rows per second {r:.2} +- {rs:.2}");
                println!("score {actors} actor(s) batch {batch} tokens per second {t:.2} +- {ts:.2}");
            }
        }
        anyhow::Ok(())
    }
    .await;
    cluster.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}
