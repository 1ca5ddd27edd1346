//! A ZeRO-2 trainer group from Rust: two ranks on two workers train the built-in GPT on
//! the corpus shipped with Regatta, with a checkpoint at the end.
//!
//! ```text
//! scripts/setup-libtorch.sh && cargo build --release --workspace --examples
//! ./target/release/examples/train
//! ```
//!
//! The ranks run in `regatta-torch-rank` executors next to the `regatta` binary. Set
//! `REGATTA_ADDRESS` (and `REGATTA_TOKEN`) to train on a running cluster instead.

use std::process::ExitCode;

use regatta::local::{connect_or_start, WorkerSpec};
use regatta_trainer::{TrainConfig, TrainEvent, TrainerGroup};

fn main() -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train example failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let (_local, client) =
        connect_or_start(vec![WorkerSpec::new("w1", "CPU=1"), WorkerSpec::new("w2", "CPU=1")]).await?;
    let dir = std::env::temp_dir().join(format!("regatta-train-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, regatta::pipeline::CORPUS)?;

    let mut config = TrainConfig::default(); // the built-in GPT: 2 layers, width 64, context 64
    config.data.path = corpus.to_string_lossy().into_owned();
    config.world_size = 2;
    config.zero_stage = regatta_trainer::ZeroStage::Two;
    config.steps = 60;
    config.checkpoint.dir = dir.join("checkpoints").to_string_lossy().into_owned();
    config.checkpoint.interval = 30;
    let summary = TrainerGroup::new(client.cluster().clone(), config)?
        .run(|event| match event {
            TrainEvent::Step(step) if step.step % 10 == 0 => {
                println!(
                    "step {:3}  loss {:.4}  {:.0} tokens/s",
                    step.step, step.loss, step.tokens_per_sec
                )
            }
            TrainEvent::Checkpoint { step, url, .. } => println!("checkpoint at step {step}: {url}"),
            _ => {}
        })
        .await?;
    let (first, last) = (summary.losses[&1], summary.losses[&60]);
    anyhow::ensure!(last < first, "the loss did not go down: {first} -> {last}");
    println!(
        "loss {first:.3} -> {last:.3}; checkpoints in {}",
        dir.join("checkpoints").display()
    );
    Ok(())
}
