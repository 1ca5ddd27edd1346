//! `regatta bench`: Regatta's counterparts of `ray microbenchmark` cases, printed in Ray's
//! line format (`<case> per second <value> +- <spread>`) so the two outputs line up.

mod dashboard;
mod data;
mod measure;
mod objects;
mod runtime;
mod scale;
mod score;
mod train;

pub use measure::{loopback_tcp_gbps, mean_spread, memcpy_gbps, peak_rss_bytes, rss_bytes};

use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Args;

/// Options of `regatta bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Which cases: `actors`, `objects`, `cluster`, `train`, `score`, `generate`, `data`,
    /// `dashboard`, `scale`, or `all` (the first five).
    #[arg(default_value = "all")]
    pub suite: String,
    /// Trials per case (mean and standard deviation are printed).
    #[arg(long, default_value_t = 3)]
    pub trials: usize,
    /// Small counts (a smoke run for tests, not for figures).
    #[arg(long)]
    pub quick: bool,
    /// `train` and `generate`: a Hugging Face model folder (local or URL), or a
    /// `config.json` file of a Llama-family model to initialise randomly; default: the
    /// built-in GPT for `train`, data/bench-llama-110m.json for `generate`.
    #[arg(long)]
    pub model: Option<String>,
    /// `train`: compare full fine-tuning with LoRA adapters of this rank (ZeRO-3, 2 ranks).
    #[arg(long)]
    pub lora: Option<usize>,
    /// `train`: compare with the optimizer state offloaded to the host (ZeRO-3, 2 ranks).
    #[arg(long)]
    pub offload: bool,
    /// `train`: `cpu`, or `cuda` (one GPU per rank, MFU against the GPU's own bf16 GEMM
    /// rate at the model's shapes, measured in the same run).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// `objects`: the head's `--object-fanout` (network pulls of one object a holder
    /// serves at once; 0: every node pulls from the holder), to compare broadcasts.
    #[arg(long)]
    pub object_fanout: Option<usize>,
    /// `data`: the corpus size in GB (made once under ~/.cache/regatta).
    #[arg(long, default_value_t = 2.0)]
    pub data_gb: f64,
    /// `data`: seconds each source is read.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// `scale`: simulated nodes.
    #[arg(long, default_value_t = 1_000)]
    pub nodes: usize,
    /// `scale`: actors spawned on them (CPU=1 each).
    #[arg(long, default_value_t = 100_000)]
    pub actors: usize,
    /// `scale`: placement groups held at once.
    #[arg(long, default_value_t = 10_000)]
    pub groups: usize,
    /// `scale`: simulator processes the nodes are shared among.
    #[arg(long, default_value_t = 4)]
    pub processes: usize,
    /// `scale`: run the head with `--no-cluster-state` (its state in memory only), to
    /// see what writing every change to disk costs.
    #[arg(long)]
    pub no_cluster_state: bool,
}

/// Runs the benchmark suite on local clusters started from this binary.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let suites: Vec<&str> = match args.suite.as_str() {
        "all" => vec!["cluster", "actors", "objects", "train", "score"],
        one @ ("actors" | "objects" | "cluster" | "train" | "score" | "generate" | "data" | "dashboard" | "scale") => {
            vec![one]
        }
        other => {
            bail!(
                "unknown benchmark suite '{other}'; use actors, objects, cluster, train, score, generate, data, dashboard, scale or all"
            )
        }
    };
    let trials = args.trials.max(1);
    for suite in suites {
        let outcome = tokio::select! {
            outcome = run_suite(suite, trials, &args) => outcome,
            () = crate::signal::shutdown_signal() => {
                // The dashboard suite is a blocking loop in this process with nothing to
                // clean up: end the process rather than wait for it.
                if suite == "dashboard" {
                    std::process::exit(130);
                }
                return Ok(ExitCode::from(130));
            }
        };
        outcome?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_suite(suite: &str, trials: usize, args: &BenchArgs) -> anyhow::Result<()> {
    let (quick, model) = (args.quick, args.model.as_deref());
    if suite == "cluster" {
        return runtime::cluster_start(trials).await;
    }
    if suite == "train" && (args.lora.is_some() || args.offload) {
        return train::variants(trials, quick, model, args.lora, args.offload).await;
    }
    if suite == "train" {
        return train::train(trials, quick, model, &args.device).await;
    }
    if suite == "score" {
        return score::score(trials, quick).await;
    }
    if suite == "generate" {
        return generate(model);
    }
    if suite == "dashboard" {
        // On a blocking thread, so that Ctrl-C is still seen while it runs.
        return tokio::task::spawn_blocking(move || dashboard::dashboard(trials, quick)).await?;
    }
    if suite == "scale" {
        let mut bench = if quick {
            scale::ScaleBench::quick()
        } else {
            scale::ScaleBench {
                nodes: args.nodes,
                actors: args.actors,
                groups: args.groups,
                processes: args.processes,
                durable: true,
            }
        };
        bench.durable = !args.no_cluster_state;
        return scale::scale(&bench).await;
    }
    if suite == "data" {
        let bench = data::DataBench {
            gigabytes: if args.quick { 0.05 } else { args.data_gb },
            seconds: if args.quick { 5.0 } else { args.seconds },
            shards: 64,
        };
        return tokio::task::block_in_place(|| data::run(&bench));
    }
    let mut cluster = if suite == "objects" {
        objects::start_objects(quick, args.object_fanout)?
    } else {
        runtime::start_cluster()?
    };
    let outcome = match suite {
        "actors" => runtime::actors(&cluster, trials, quick).await,
        _ => objects::objects(&cluster, trials, quick).await,
    };
    cluster.shutdown();
    outcome
}

/// KV-cache generation in the executor (the one binary that links libtorch), with every
/// core: output tokens/s at batch limits 1 to 128 beside the machine's bounds.
fn generate(model: Option<&str>) -> anyhow::Result<()> {
    let executor = regatta_runtime::executor::executor_path(None).map_err(anyhow::Error::msg)?;
    let model = model.unwrap_or("data/bench-llama-110m.json");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let status = std::process::Command::new(&executor)
        .args(["bench-generate", model, &cores.to_string()])
        .status()
        .with_context(|| format!("cannot run {}", executor.display()))?;
    anyhow::ensure!(status.success(), "the generation benchmark failed ({status})");
    Ok(())
}
