//! `regatta bench train`: tokens per second and step time of the built-in GPT trained
//! with ZeRO-2 over 1, 2 and 3 ranks (one worker process each, on CPU), and the scaling
//! efficiency against one rank. Each rank keeps the same batch (weak scaling), so perfect
//! scaling multiplies tokens/s by the number of ranks.

use std::time::Duration;

use regatta_trainer::{TrainConfig, TrainEvent, TrainerGroup};

use crate::bench::mean_spread;
use crate::local::{LocalCluster, LocalOptions};
use crate::train_cli::local_workers;

/// Steps timed per run after the warm-up steps.
fn config(world: usize, quick: bool) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.data.path = format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"));
    if let Ok(path) = std::env::var("REGATTA_BENCH_CORPUS") {
        config.data.path = path;
    }
    config.world_size = world;
    config.zero_stage = regatta_trainer::ZeroStage::Two;
    config.micro_batch_size = 4;
    config.steps = if quick { 6 } else { 40 };
    if !quick {
        config.model.layers = 4;
        config.model.width = 128;
        config.model.context = 128;
    }
    config
}

/// Runs the training benchmark and prints one line per figure.
pub async fn train(trials: usize, quick: bool) -> anyhow::Result<()> {
    let warmup = if quick { 2 } else { 5 };
    let mut base = None;
    for world in 1..=3usize {
        let mut tokens = Vec::new();
        let mut step_secs = Vec::new();
        let mut collective = Vec::new();
        for _ in 0..trials {
            let config = config(world, quick);
            let mut cluster = LocalCluster::start(LocalOptions::new(local_workers(&config))?)?;
            let outcome = async {
                let client = cluster.connect(Duration::from_secs(30)).await?;
                let mut steps = Vec::new();
                TrainerGroup::new(client.cluster().clone(), config)?
                    .run(|event| {
                        if let TrainEvent::Step(step) = event {
                            steps.push(step.clone());
                        }
                    })
                    .await?;
                anyhow::Ok(steps)
            }
            .await;
            cluster.shutdown();
            let timed: Vec<_> = outcome?.into_iter().skip(warmup).collect();
            anyhow::ensure!(!timed.is_empty(), "no step was timed");
            let n = timed.len() as f64;
            let secs = timed.iter().map(|s| s.step_secs).sum::<f64>() / n;
            step_secs.push(secs);
            tokens.push(timed.iter().map(|s| s.tokens_per_sec).sum::<f64>() / n);
            collective.push(timed.iter().map(|s| s.collective_secs).sum::<f64>() / n);
        }
        let (tps, tps_spread) = mean_spread(&tokens);
        let (secs, secs_spread) = mean_spread(&step_secs);
        let (coll, coll_spread) = mean_spread(&collective);
        println!("train ZeRO-2 {world} rank(s) tokens per second {tps:.2} +- {tps_spread:.2}");
        println!("train ZeRO-2 {world} rank(s) step seconds {secs:.4} +- {secs_spread:.4}");
        println!("train ZeRO-2 {world} rank(s) collective seconds per step {coll:.4} +- {coll_spread:.4}");
        let one = *base.get_or_insert(tps);
        let efficiency = 100.0 * tps / (one * world as f64);
        println!("train ZeRO-2 {world} rank(s) scaling efficiency percent {efficiency:.1} +- 0.0");
    }
    Ok(())
}
