//! `regatta bench train`: tokens per second, step time and model FLOPs utilisation of a
//! model trained with ZeRO-2 over 1, 2 and 3 ranks (one worker process each, on CPU), and
//! the scaling efficiency against one rank. Each rank keeps the same batch (weak scaling),
//! so perfect scaling multiplies tokens/s by the number of ranks. MFU is measured against
//! the machine's own matrix-multiply peak, timed in the same run by libtorch at the model's
//! weight shapes with every core (`regatta-torch-rank peak`).

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use regatta_trainer::{StepReport, TrainConfig, TrainEvent, TrainerGroup};

use super::measure::mean_spread;
use crate::cli::train::local_workers;
use crate::local::{LocalCluster, LocalOptions};

/// The run for `world` ranks: the built-in GPT, or `model` (a Hugging Face folder, or a
/// `config.json` file to initialise a Llama-family model from).
fn config(world: usize, quick: bool, model: Option<&str>) -> anyhow::Result<TrainConfig> {
    config_on(world, quick, model, "cpu")
}

/// [`config`] on `device` (`cpu`, or `cuda`: one GPU per rank, granted as `GPU = 1`).
fn config_on(world: usize, quick: bool, model: Option<&str>, device: &str) -> anyhow::Result<TrainConfig> {
    let mut config = TrainConfig {
        device: device.to_string(),
        ..TrainConfig::default()
    };
    if device == "cuda" {
        config.resources.insert("GPU".to_string(), 1.0);
    }
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
    match model {
        Some(file) if file.ends_with(".json") => {
            let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {file}"))?;
            config.model.config = Some(serde_json::from_str(&text).with_context(|| format!("{file} is not JSON"))?);
        }
        Some(path) => config.model.path = path.to_string(),
        None => {}
    }
    config.resolve_paths(&std::env::current_dir()?);
    config.validate().map_err(anyhow::Error::msg)?;
    Ok(config)
}

/// Trains `config` on a local cluster started for it (one worker per rank) and returns
/// the step reports after the first `warmup` steps.
async fn timed_steps(config: TrainConfig, warmup: usize) -> anyhow::Result<Vec<StepReport>> {
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
    Ok(timed)
}

/// The machine's matmul FLOP/s at the model's shapes with every core, and the model's
/// FLOPs per token, from the executor (the one binary that links libtorch).
fn measure_peak(config: &TrainConfig) -> anyhow::Result<Peak> {
    let executor = regatta_runtime::executor::executor_path(None).map_err(anyhow::Error::msg)?;
    let file = std::env::temp_dir().join(format!("regatta-bench-train-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_vec(config)?)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let output = std::process::Command::new(&executor)
        .args(["peak", path_str(&file)?, &cores.to_string()])
        .output()
        .with_context(|| format!("cannot run {}", executor.display()))?;
    let _ = std::fs::remove_file(&file);
    anyhow::ensure!(
        output.status.success(),
        "measuring the GEMM peak failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let peak: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let field = |name: &str| peak[name].as_f64().with_context(|| format!("no {name} in {peak}"));
    Ok(Peak {
        flops_per_sec: field("flops_per_sec")?,
        flops_per_token: field("model_flops_per_token")?,
        parameters: field("parameters")? as u64,
        device: peak["device"].as_str().unwrap_or("cpu").to_string(),
        cuda_devices: peak["cuda_devices"].as_u64().unwrap_or(0) as usize,
    })
}

/// What `regatta-torch-rank peak` measured.
struct Peak {
    flops_per_sec: f64,
    flops_per_token: f64,
    parameters: u64,
    /// `cpu` or `cuda:N`.
    device: String,
    cuda_devices: usize,
}

fn path_str(path: &Path) -> anyhow::Result<&str> {
    path.to_str().context("a temporary path is not UTF-8")
}

/// Runs the training benchmark and prints one line per figure.
///
/// On `device = "cuda"` each rank takes one GPU of this host (so 1 to 3 ranks as the GPUs
/// allow), and the peak is the device's bf16 GEMM rate at the model's shapes.
pub async fn train(trials: usize, quick: bool, model: Option<&str>, device: &str) -> anyhow::Result<()> {
    let warmup = if quick { 2 } else { 5 };
    let measured = measure_peak(&config_on(1, quick, model, device)?)?;
    let (peak, flops_per_token) = (measured.flops_per_sec, measured.flops_per_token);
    let name = model.map_or("built-in GPT".to_string(), |m| {
        m.rsplit('/').next().unwrap_or(m).to_string()
    });
    println!("train model {name} parameters {}", measured.parameters);
    println!(
        "train machine GEMM peak at the model's shapes on {} GFLOP/s {:.2} +- 0.00",
        measured.device,
        peak / 1e9
    );
    let worlds = if device == "cuda" {
        measured.cuda_devices.clamp(1, 3)
    } else {
        3
    };
    let mut base = None;
    for world in 1..=worlds {
        let mut tokens = Vec::new();
        let mut step_secs = Vec::new();
        let mut collective = Vec::new();
        for _ in 0..trials {
            let config = config_on(world, quick, model, device)?;
            let timed = timed_steps(config, warmup).await?;
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
        let mfu = 100.0 * flops_per_token * tps / peak;
        let mfu_spread = 100.0 * flops_per_token * tps_spread / peak;
        println!("train ZeRO-2 {world} rank(s) MFU percent of the machine's GEMM peak {mfu:.1} +- {mfu_spread:.1}");
        let one = *base.get_or_insert(tps);
        let efficiency = 100.0 * tps / (one * world as f64);
        println!("train ZeRO-2 {world} rank(s) scaling efficiency percent {efficiency:.1} +- 0.0");
    }
    Ok(())
}

/// One variant of `regatta bench train --lora R --offload`.
struct Variant {
    name: String,
    lora: Option<usize>,
    offload: bool,
}

impl Variant {
    /// Full fine-tuning, then with the optimizer offloaded, LoRA of `lora`'s rank, and
    /// both, as asked.
    fn all(lora: Option<usize>, offload: bool) -> Vec<Self> {
        let mut variants = vec![Variant {
            name: "full".into(),
            lora: None,
            offload: false,
        }];
        if offload {
            variants.push(Variant {
                name: "full + offload".into(),
                lora: None,
                offload: true,
            });
        }
        if let Some(rank) = lora {
            variants.push(Variant {
                name: format!("LoRA r{rank}"),
                lora: Some(rank),
                offload: false,
            });
            if offload {
                variants.push(Variant {
                    name: format!("LoRA r{rank} + offload"),
                    lora: Some(rank),
                    offload: true,
                });
            }
        }
        variants
    }

    /// The run of this variant: ZeRO-3 over 2 ranks.
    fn config(&self, quick: bool, model: Option<&str>) -> anyhow::Result<TrainConfig> {
        let mut config = config(2, quick, model)?;
        config.zero_stage = regatta_trainer::ZeroStage::Three;
        if let Some(rank) = self.lora {
            config.lora = Some(regatta_trainer::LoraConfig {
                rank,
                alpha: 2.0 * rank as f64,
                ..Default::default()
            });
        }
        if self.offload {
            config.zero.offload_optimizer = regatta_trainer::Offload::Cpu;
        }
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}

/// Full fine-tuning against LoRA and/or optimizer offload, each over 2 ranks with ZeRO-3 on
/// the same model and batches: tokens/s and the bytes each rank holds, by kind, on the
/// device and on the host (from the tensors, as the step reports give them); then the host
/// AdamW update's memory traffic against a plain copy on this machine
/// (`regatta-torch-rank bench-adamw`).
pub async fn variants(
    trials: usize,
    quick: bool,
    model: Option<&str>,
    lora: Option<usize>,
    offload: bool,
) -> anyhow::Result<()> {
    let warmup = if quick { 2 } else { 5 };
    // Adapters need a Llama-family model: the benchmark's own by default.
    let default_model = format!("{}/data/bench-llama.json", env!("CARGO_MANIFEST_DIR"));
    let model = Some(model.unwrap_or(&default_model));
    let variants = Variant::all(lora, offload);
    let name = model.map_or("built-in GPT".to_string(), |m| {
        m.rsplit('/').next().unwrap_or(m).to_string()
    });
    println!("train model {name}, ZeRO-3 over 2 ranks");
    for variant in &variants {
        let mut tokens = Vec::new();
        let mut last = None;
        for _ in 0..trials {
            let timed = timed_steps(variant.config(quick, model)?, warmup).await?;
            tokens.push(timed.iter().map(|s| s.tokens_per_sec).sum::<f64>() / timed.len() as f64);
            last = timed.last().cloned();
        }
        let (tps, spread) = mean_spread(&tokens);
        println!("train {} tokens per second {tps:.2} +- {spread:.2}", variant.name);
        if let Some(s) = last {
            println!("train {} bytes per rank {}", variant.name, crate::cli::train::held(&s));
        }
    }
    if offload {
        host_adamw(quick)?;
    }
    Ok(())
}

/// The host AdamW update's rate and memory traffic against a plain copy on this machine,
/// from the executor (`regatta-torch-rank bench-adamw`).
fn host_adamw(quick: bool) -> anyhow::Result<()> {
    let executor = regatta_runtime::executor::executor_path(None).map_err(anyhow::Error::msg)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let elements = if quick { 1 << 20 } else { 50_000_000 };
    let output = std::process::Command::new(&executor)
        .args(["bench-adamw", &elements.to_string(), &cores.to_string()])
        .output()
        .with_context(|| format!("cannot run {}", executor.display()))?;
    anyhow::ensure!(
        output.status.success(),
        "bench-adamw failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let figures: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let field = |name: &str| {
        figures[name]
            .as_f64()
            .with_context(|| format!("no {name} in {figures}"))
    };
    println!(
        "train host AdamW over {elements} parameters with {cores} thread(s): {:.1} M parameters/s, {:.2} GB/s of the 28 bytes a parameter a fused update moves, {:.2} of this machine's copy bandwidth ({:.2} GB/s)",
        field("parameters_per_sec")? / 1e6,
        field("adamw_gbps")?,
        field("fraction_of_copy_bandwidth")?,
        field("copy_gbps")?
    );
    Ok(())
}
