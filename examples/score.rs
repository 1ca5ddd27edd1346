//! Batch scoring from Rust: a checkpoint directory (from `regatta train` or the train
//! example) scores the evaluation set shipped with Regatta on a pool of scorer actors,
//! one Parquet file per partition.
//!
//! ```text
//! ./target/release/regatta train --steps 100 --checkpoint-dir /tmp/ckpt
//! ./target/release/examples/score /tmp/ckpt
//! ```
//!
//! Set `REGATTA_ADDRESS` (and `REGATTA_TOKEN`) to score on a running cluster instead.

use std::process::ExitCode;

use regatta::local::{connect_or_start, WorkerSpec};
use regatta_scorer::{from_parquet, ScoreConfig, ScoreRun};

fn main() -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("score example failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let Some(checkpoint) = std::env::args().nth(1) else {
        anyhow::bail!("usage: score CHECKPOINT_DIR (a directory `regatta train --checkpoint-dir` wrote)");
    };
    let (_local, client) =
        connect_or_start(vec![WorkerSpec::new("w1", "CPU=2"), WorkerSpec::new("w2", "CPU=2")]).await?;
    let dir = std::env::temp_dir().join(format!("regatta-score-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let input = dir.join("eval.jsonl");
    std::fs::write(&input, regatta::pipeline::EVAL_SET)?;
    let output = dir.join("scores");
    let config = ScoreConfig {
        input: input.to_string_lossy().into_owned(),
        model: checkpoint,
        output: output.to_string_lossy().into_owned(),
        actors: 2,
        batch_size: 16,
        max_new_tokens: 12,
        ..ScoreConfig::default()
    };
    let done = ScoreRun::new(client.cluster().clone(), config)
        .map_err(anyhow::Error::msg)?
        .run(|p| println!("partitions {}/{}, rows {}", p.partitions_done, p.partitions, p.rows))
        .await
        .map_err(anyhow::Error::msg)?;
    let first = from_parquet(std::fs::read(output.join("part-00000.parquet"))?.into()).map_err(anyhow::Error::msg)?;
    if let Some(row) = first.first() {
        println!(
            "{}: perplexity {:.2}, continues with {:?}",
            row.id, row.perplexity, row.generated
        );
    }
    println!("scored {} rows into {}", done.rows, output.display());
    Ok(())
}
