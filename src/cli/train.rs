//! `regatta train`: trains the built-in GPT with a ZeRO trainer group, on the cluster at
//! `--address` (or `REGATTA_ADDRESS`, set for submitted jobs) or on a local cluster started
//! for the run and stopped after.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Args;
use regatta_runtime::Cluster;
use regatta_trainer::{TrainConfig, TrainEvent, TrainSummary, TrainerGroup};

use super::common::on_cluster;
use super::common::TokenArgs;
use crate::local::WorkerSpec;

/// Options of `regatta train`; flags override the config file.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// A train.toml (every field has a default; see docs/TRAINING.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Ranks.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// ZeRO stage: 1, 2 or 3.
    #[arg(long, value_parser = parse_stage)]
    pub zero_stage: Option<regatta_trainer::ZeroStage>,
    /// A Hugging Face model folder (local or s3://...) to fine-tune.
    #[arg(long)]
    pub model: Option<String>,
    /// Optimizer steps.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sequences per rank and micro-batch.
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Micro-batches per optimizer step (global batch = micro-batch x this x world size).
    #[arg(long)]
    pub gradient_accumulation: Option<usize>,
    /// The token dataset (a text file: a path, file:// or s3:// URL).
    #[arg(long)]
    pub data: Option<String>,
    /// Where checkpoints go: a directory or s3://bucket/prefix.
    #[arg(long)]
    pub checkpoint_dir: Option<String>,
    /// Steps between checkpoints.
    #[arg(long)]
    pub checkpoint_interval: Option<u64>,
    /// Continue from the newest checkpoint in the checkpoint directory.
    #[arg(long)]
    pub resume: bool,
    /// Restarts from the last checkpoint after a lost rank.
    #[arg(long)]
    pub max_failures: Option<u32>,
    /// Train LoRA adapters of this rank (the rest of [lora] from the file, or its defaults:
    /// alpha 32, every projection) on the frozen model.
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// Keep optimizer state in host memory and run AdamW there (ZeRO-Offload).
    #[arg(long)]
    pub offload_optimizer: bool,
    /// The cluster to use; without it a local cluster runs for the duration.
    #[arg(long, env = "REGATTA_ADDRESS")]
    pub address: Option<String>,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
    /// Print a progress line every this many steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Print the summary as one JSON object (losses by step, last step's report).
    #[arg(long)]
    pub json: bool,
}

fn parse_stage(text: &str) -> Result<regatta_trainer::ZeroStage, regatta_trainer::Error> {
    let number: u8 = text
        .parse()
        .map_err(|_| regatta_trainer::Error::Config(format!("{text:?} is not a ZeRO stage; use 1, 2 or 3")))?;
    regatta_trainer::ZeroStage::try_from(number)
}

impl TrainArgs {
    /// The configuration: the file (or the defaults), then the flags.
    pub fn config(&self) -> anyhow::Result<TrainConfig> {
        let mut config = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
                TrainConfig::from_toml(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
            }
            None => TrainConfig::default(),
        };
        if let Some(v) = self.zero_stage {
            config.zero_stage = v;
        }
        if let Some(v) = self.steps {
            config.steps = v;
        }
        if let Some(v) = self.micro_batch_size {
            config.micro_batch_size = v;
        }
        if let Some(v) = self.gradient_accumulation {
            config.gradient_accumulation = v;
        }
        if let Some(v) = &self.model {
            config.model.path = v.clone();
        }
        if let Some(v) = &self.data {
            config.data.path = v.clone();
        }
        if let Some(v) = &self.checkpoint_dir {
            config.checkpoint.dir = v.clone();
        }
        if let Some(v) = self.checkpoint_interval {
            config.checkpoint.interval = v;
        }
        if let Some(v) = self.max_failures {
            config.max_failures = v;
        }
        if let Some(rank) = self.lora_rank {
            let lora = config.lora.get_or_insert_with(Default::default);
            lora.rank = rank;
        }
        if self.offload_optimizer {
            config.zero.offload_optimizer = regatta_trainer::Offload::Cpu;
        }
        config.checkpoint.resume |= self.resume;
        if let Some(world) = self.world_size {
            // A streaming run keeps its global batch on another number of ranks (gradient
            // accumulation adapts) unless the accumulation is given too.
            config = if config.streaming() && self.gradient_accumulation.is_none() {
                config.rescale(world).map_err(anyhow::Error::msg)?
            } else {
                TrainConfig {
                    world_size: world,
                    ..config
                }
            };
        }
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}

/// Local workers for a run: one per rank, each declaring the per-rank resources.
pub fn local_workers(config: &TrainConfig) -> Vec<WorkerSpec> {
    let resources: Vec<String> = config.resources.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let resources = if resources.is_empty() {
        "CPU=1".to_string()
    } else {
        resources.join(",")
    };
    let workers = config.scaling.as_ref().map_or(config.world_size, |s| s.max_workers);
    (0..workers)
        .map(|i| WorkerSpec::new(&format!("w{}", i + 1), &resources))
        .collect()
}

/// Runs `regatta train`.
pub async fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    let config = args.config()?;
    let workers = local_workers(&config);
    // Cancelling the run removes its placement group from a background task.
    let args = &args;
    on_cluster(args.address.as_deref(), &args.token, workers, |cluster| async move {
        train(&cluster, config, args).await
    })
    .await
}

/// What a rank holds by kind, on the device and on the host: `device p 1.2M g 0.3M o 3.6M
/// host p 0 g 0 o 0` (MiB; parameters include frozen ones).
pub fn held(s: &regatta_trainer::StepReport) -> String {
    let mib = |bytes: u64| {
        if bytes == 0 {
            "0".to_string()
        } else {
            format!("{:.1}M", bytes as f64 / (1 << 20) as f64)
        }
    };
    format!(
        "device p {} g {} o {}  host p {} g {} o {}",
        mib(s.param_bytes - s.host_param_bytes.min(s.param_bytes)),
        mib(s.grad_bytes - s.host_grad_bytes.min(s.grad_bytes)),
        mib(s.optimizer_bytes - s.host_optimizer_bytes.min(s.optimizer_bytes)),
        mib(s.host_param_bytes),
        mib(s.host_grad_bytes),
        mib(s.host_optimizer_bytes)
    )
}

/// A GPU step's MFU and CUDA memory peaks (`  MFU 41.2%  cuda peak 31.4G alloc 36.0G
/// reserved`), empty on the CPU.
pub fn gpu_figures(s: &regatta_trainer::StepReport) -> String {
    let mut out = String::new();
    if let Some(mfu) = s.mfu {
        out.push_str(&format!("  MFU {:.1}%", 100.0 * mfu));
    }
    if let (Some(allocated), Some(reserved)) = (s.cuda_peak_allocated_bytes, s.cuda_peak_reserved_bytes) {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        out.push_str(&format!(
            "  cuda peak {:.1}G alloc {:.1}G reserved",
            gib(allocated),
            gib(reserved)
        ));
    }
    out
}

/// One line for an event, as the job log shows it.
pub fn describe(event: &TrainEvent, config: &TrainConfig, log_every: u64) -> Option<String> {
    match event {
        TrainEvent::Started {
            attempt,
            start_step,
            params,
            nodes,
            device,
            world,
        } => Some(format!(
            "training: {params} parameters{}, ZeRO-{}{} over {} ranks on {} ({device}){}",
            config
                .lora
                .as_ref()
                .map(|l| format!(" with LoRA adapters (r {}, alpha {}) on {}", l.rank, l.alpha, l.targeted().join(", ")))
                .unwrap_or_default(),
            config.zero_stage,
            match (config.zero.offload_optimizer, config.zero.offload_params) {
                (regatta_trainer::Offload::Cpu, regatta_trainer::Offload::Cpu) => " (optimizer and parameters offloaded to CPU)",
                (regatta_trainer::Offload::Cpu, _) => " (optimizer offloaded to CPU)",
                _ => "",
            },
            world,
            nodes.join(", "),
            if *attempt > 0 || *start_step > 0 {
                format!(", attempt {}, from step {start_step}", attempt + 1)
            } else {
                String::new()
            }
        )),
        TrainEvent::Step(s) if s.step % log_every.max(1) == 0 || s.step == config.steps || s.step == 1 => {
            Some(format!(
                "step {}/{}  loss {:.4}  {:.0} tokens/s  step {:.3}s  collectives {:.3}s  {}{}",
                s.step,
                config.steps,
                s.loss,
                s.tokens_per_sec,
                s.step_secs,
                s.collective_secs,
                held(s),
                gpu_figures(s)
            ))
        }
        TrainEvent::Checkpoint { step, url, best } => Some(format!(
            "checkpoint at step {step}: {url}{}",
            if *best { " (best so far: the `best` pointer names it)" } else { "" }
        )),
        TrainEvent::Eval(e) => Some(format!(
            "validation at step {}/{}  loss {:.4}  perplexity {:.2}  ({} tokens)",
            e.step,
            config.steps,
            e.loss,
            e.perplexity(),
            e.tokens
        )),
        TrainEvent::Rescaled { from, to, reason } => Some(format!(
            "world size {from} -> {to} ({reason}); gradient accumulation {} -> {}, global batch {} sequences",
            config.rescale(*from).map_or(0, |c| c.gradient_accumulation),
            config.rescale(*to).map_or(0, |c| c.gradient_accumulation),
            config.global_batch()
        )),
        TrainEvent::Skipped { rank, what, count: 1 } => Some(format!("rank {rank} skipped a dataset row: {what}")),
        TrainEvent::Skipped { rank, what, count } => Some(format!(
            "rank {rank} skipped {count} dataset rows this step (each is in the rank's log), the first: {what}"
        )),
        TrainEvent::Restarting {
            rank,
            reason,
            failures,
            max_failures,
        } => Some(format!(
            "rank {rank} lost ({reason}); restarting from the last checkpoint (failure {failures} of at most {max_failures})"
        )),
        _ => None,
    }
}

async fn train(cluster: &Cluster, config: TrainConfig, args: &TrainArgs) -> anyhow::Result<ExitCode> {
    let group = TrainerGroup::new(cluster.clone(), config.clone())?;
    let summary = group
        .run(|event| {
            if let Some(line) = describe(event, &config, args.log_every) {
                println!("{line}");
            }
        })
        .await?;
    report(&summary, &config, args.json)?;
    Ok(ExitCode::SUCCESS)
}

fn report(summary: &TrainSummary, config: &TrainConfig, json: bool) -> anyhow::Result<()> {
    let (Some(first), Some(last)) = (summary.losses.values().next(), summary.last.as_ref()) else {
        bail!("the run finished without reporting a step");
    };
    println!(
        "trained {} steps in {:.1}s: loss {first:.4} -> {:.4}, {:.0} tokens/s, {} restart(s){}{}",
        summary.losses.keys().last().copied().unwrap_or(config.steps),
        summary.seconds,
        last.loss,
        last.tokens_per_sec,
        summary.failures,
        if summary.rescales > 0 {
            format!(
                ", {} world size change(s), ending on {} ranks",
                summary.rescales, summary.world
            )
        } else {
            String::new()
        },
        summary
            .checkpoint
            .as_ref()
            .map(|(step, url)| format!(", checkpoint (step {step}) at {url}"))
            .unwrap_or_default()
    );
    if let (Some((step, first)), Some((_, last))) = (summary.evals.iter().next(), summary.evals.iter().last()) {
        println!(
            "validation loss {first:.4} (step {step}) -> {last:.4}, perplexity {:.2} -> {:.2}{}",
            first.exp(),
            last.exp(),
            summary
                .best
                .as_ref()
                .map(|(step, url)| format!("; best checkpoint (step {step}) at {url}"))
                .unwrap_or_default()
        );
    }
    if let Some(url) = &summary.tensorboard {
        println!("TensorBoard events: {url}");
    }
    if json {
        let value = serde_json::json!({
            "steps": summary.losses.keys().last().copied().unwrap_or(config.steps),
            "world": summary.world,
            "rescales": summary.rescales,
            "losses": summary.losses.values().collect::<Vec<_>>(),
            "failures": summary.failures,
            "params": summary.params,
            "seconds": summary.seconds,
            "checkpoint": summary.checkpoint.as_ref().map(|(_, url)| url),
            "eval_losses": summary.evals.iter().map(|(step, loss)| serde_json::json!({"step": step, "loss": loss})).collect::<Vec<_>>(),
            "best_checkpoint": summary.best.as_ref().map(|(_, url)| url),
            "tensorboard": summary.tensorboard,
            "last": {
                "loss": last.loss,
                "lr": last.lr,
                "grad_norm": last.grad_norm,
                "tokens_per_sec": last.tokens_per_sec,
                "step_secs": last.step_secs,
                "collective_secs": last.collective_secs,
                "param_bytes": last.param_bytes,
                "grad_bytes": last.grad_bytes,
                "optimizer_bytes": last.optimizer_bytes,
                "host_param_bytes": last.host_param_bytes,
                "host_grad_bytes": last.host_grad_bytes,
                "host_optimizer_bytes": last.host_optimizer_bytes,
                "frozen_param_bytes": last.frozen_param_bytes,
                "mfu": last.mfu,
                "cuda_peak_allocated_bytes": last.cuda_peak_allocated_bytes,
                "cuda_peak_reserved_bytes": last.cuda_peak_reserved_bytes,
            },
        });
        println!("{value}");
    }
    Ok(())
}
