//! `regatta score`: scores a JSONL or Parquet dataset with a trainer checkpoint on a pool of scorer
//! actors, on the cluster at `--address` (or `REGATTA_ADDRESS`) or on a local cluster
//! started for the run.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use regatta_runtime::Cluster;
use regatta_scorer::{Progress, ScoreConfig, ScoreRun};

use super::common::on_cluster;
use super::common::TokenArgs;
use crate::local::WorkerSpec;

/// Options of `regatta score`; flags override the config file.
#[derive(Args, Debug, Clone)]
pub struct ScoreArgs {
    /// A score.toml (see docs/SCORING.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Input (path or URL): JSONL, `{"id": ..., "text": ...}` per line, or a `.parquet` file
    /// with `id` and `text` columns.
    #[arg(long)]
    pub input: Option<String>,
    /// A trainer checkpoint directory, a Hugging Face folder, a GGUF file, or a TorchScript
    /// file (.pt, .ts, .torchscript).
    #[arg(long)]
    pub model: Option<String>,
    /// A LoRA adapter (PEFT folder or LoRA checkpoint) applied to --model without merging.
    #[arg(long)]
    pub adapter: Option<String>,
    /// How the base under --adapter is held: auto (as the adapter was trained), none, nf4
    /// or fp4 (QLoRA's 4 bits) or int8.
    #[arg(long)]
    pub adapter_base: Option<regatta_scorer::AdapterBase>,
    /// With --adapter-base nf4 or fp4: quantize the absmax values again (8 bits).
    #[arg(long)]
    pub double_quant: bool,
    /// Output directory.
    #[arg(long)]
    pub output: Option<String>,
    /// Scorer actors.
    #[arg(long)]
    pub actors: Option<usize>,
    /// Rows per batch.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Partitions (default: four per actor).
    #[arg(long)]
    pub partitions: Option<usize>,
    /// Tokens generated per row (with --generate: the default a row's `params` may
    /// override, 256 when unset; without: a greedy continuation beside the scores).
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// Generate continuations of each row's `prompt`, `text` or chat `messages` with the
    /// KV cache and continuous batching, instead of scoring `text`.
    #[arg(long)]
    pub generate: bool,
    /// Sampling temperature (0: greedy).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Nucleus sampling's probability mass (1: off).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Sample from the k most likely tokens only (0: off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Seed of the rows' random streams (each row's stream also depends on its id).
    #[arg(long)]
    pub seed: Option<u64>,
    /// A string that ends a row's text (repeat for several).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Write each generated token's log-probability.
    #[arg(long)]
    pub logprobs: bool,
    /// Sequences each actor decodes together.
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Each actor's KV cache budget in MiB (default: 90% of its GPU's memory less the
    /// weights, or a quarter of the host's available memory on the CPU).
    #[arg(long)]
    pub kv_cache_mb: Option<u64>,
    /// Compute every row's prompt in full: no sharing of the KV cache blocks of a prefix
    /// rows have in common (prefix caching is on by default).
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// On CUDA, launch every decode step's kernels one by one instead of replaying the
    /// step as a captured CUDA graph (graphs are on by default).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// On the CPU, multiply by libtorch's own `linear` instead of float32 weights packed
    /// once for oneDNN (packing is on by default; it holds a second copy of the weights).
    #[arg(long)]
    pub no_packed_weights: bool,
    /// Longest token sequence a TorchScript model takes (required with one).
    #[arg(long)]
    pub context: Option<usize>,
    /// Print the summary as one JSON line at the end.
    #[arg(long)]
    pub json: bool,
    /// Workers of the local cluster (without --address).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// The cluster to use; without it a local cluster runs for the duration.
    #[arg(long, env = "REGATTA_ADDRESS")]
    pub address: Option<String>,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
}

impl ScoreArgs {
    /// The configuration: the file, then the flags.
    pub fn config(&self) -> anyhow::Result<ScoreConfig> {
        let mut config = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
                ScoreConfig::from_toml(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
            }
            None => ScoreConfig::default(),
        };
        for (value, field) in [
            (&self.input, &mut config.input),
            (&self.model, &mut config.model),
            (&self.adapter, &mut config.adapter),
        ] {
            if let Some(v) = value {
                *field = v.clone();
            }
        }
        if let Some(v) = self.adapter_base {
            config.adapter_base = v;
        }
        config.double_quant |= self.double_quant;
        if let Some(v) = &self.output {
            config.output = v.clone();
        }
        if let Some(v) = self.actors {
            config.actors = v;
        }
        if let Some(v) = self.batch_size {
            config.batch_size = v;
        }
        if let Some(v) = self.partitions {
            config.partitions = v;
        }
        if let Some(v) = self.max_new_tokens {
            config.max_new_tokens = v;
        }
        if let Some(v) = self.context {
            config.context = v;
        }
        config.generate |= self.generate;
        config.logprobs |= self.logprobs;
        if !self.stop.is_empty() {
            config.stop = self.stop.clone();
        }
        if let Some(v) = self.temperature {
            config.temperature = v;
        }
        if let Some(v) = self.top_p {
            config.top_p = v;
        }
        if let Some(v) = self.top_k {
            config.top_k = v;
        }
        if let Some(v) = self.seed {
            config.seed = v;
        }
        if let Some(v) = self.max_batch {
            config.max_batch = v;
        }
        if let Some(v) = self.kv_cache_mb {
            config.kv_cache_mb = Some(v);
        }
        if self.no_prefix_caching {
            config.prefix_caching = false;
        }
        if self.no_cuda_graphs {
            config.cuda_graphs = false;
        }
        if self.no_packed_weights {
            config.packed_weights = false;
        }
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}

/// One progress line: rows done, rows/s, ETA.
pub fn progress_line(p: &Progress) -> String {
    let rate = p.rows as f64 / p.seconds.max(1e-9);
    let fraction = p.bytes_done as f64 / p.input_bytes.max(1) as f64;
    let eta = if fraction > 0.0 {
        p.seconds * (1.0 - fraction) / fraction
    } else {
        f64::NAN
    };
    let output = if p.output_tokens > 0 {
        format!("  {:.0} output tokens/s", p.output_tokens as f64 / p.seconds.max(1e-9))
    } else {
        String::new()
    };
    format!(
        "partitions {}/{}  rows {}  {:.0} rows/s  {:.0} tokens/s{output}  errors {}  retries {}  ETA {:.0}s",
        p.partitions_done,
        p.partitions,
        p.rows,
        rate,
        p.tokens as f64 / p.seconds.max(1e-9),
        p.errors,
        p.retries,
        eta
    )
}

async fn score(cluster: &Cluster, config: ScoreConfig, json: bool) -> anyhow::Result<ExitCode> {
    let output = config.output.clone();
    let generate = config.generate;
    if generate {
        match config.kv_cache_mb {
            Some(mb) => println!("KV cache budget per actor: {mb} MiB"),
            None => println!(
                "KV cache budget per actor: auto ({:.0}% of its GPU's memory less the weights, or {:.0}% of the \
                 host's available memory on the CPU; each actor's figure is in its node's log)",
                100.0 * regatta_scorer::DEVICE_MEMORY_SHARE,
                100.0 * regatta_scorer::HOST_MEMORY_SHARE
            ),
        }
    }
    let run = ScoreRun::new(cluster.clone(), config).map_err(anyhow::Error::msg)?;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let done = run
        .run(|p| {
            if tty {
                print!("\r{}", progress_line(p));
                let _ = std::io::stdout().flush();
            } else {
                println!("{}", progress_line(p));
            }
        })
        .await
        .map_err(anyhow::Error::msg)?;
    if tty {
        println!();
    }
    if json {
        let summary = serde_json::json!({
            "rows": done.rows,
            "errors": done.errors,
            "skipped_partitions": done.skipped,
            "seconds": done.seconds,
            "output_tokens": done.output_tokens,
            "output": output,
        });
        println!("{summary}");
        return Ok(ExitCode::SUCCESS);
    }
    let verb = if generate { "generated for" } else { "scored" };
    println!(
        "{verb} {} rows ({} malformed, {} partitions skipped as already done) in {:.1}s; output in {output}",
        done.rows, done.errors, done.skipped, done.seconds
    );
    if generate {
        println!(
            "{} output tokens, {:.1} output tokens/s",
            done.output_tokens,
            done.output_tokens as f64 / done.seconds.max(1e-9)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `regatta score`.
pub async fn run(args: ScoreArgs) -> anyhow::Result<ExitCode> {
    let config = args.config()?;
    // Local workers each hold two actors' worth of the per-actor resources.
    let resources: Vec<String> = config
        .resources
        .iter()
        .map(|(k, v)| format!("{k}={}", v * 2.0))
        .collect();
    let workers = (0..args.workers.max(1))
        .map(|i| WorkerSpec::new(&format!("w{}", i + 1), &resources.join(",")))
        .collect();
    let json = args.json;
    on_cluster(args.address.as_deref(), &args.token, workers, |cluster| async move {
        score(&cluster, config, json).await
    })
    .await
}
