//! The main job: a local cluster (head and 2 workers as processes) runs a quick actor and
//! object workload, then fine-tunes a real pretrained model (SmolLM2-135M-Instruct from its
//! GGUF file) with LoRA and ZeRO-3 over 2 ranks on facts shipped in the binary, scores a
//! held-out split and answers its questions before and after with a pool of scorer actors,
//! and prints a report. `--model builtin` trains the built-in GPT from scratch instead
//! (ZeRO-2, no download).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use clap::Args;

use crate::finetune::FineTuneOptions;
use crate::kinds::{Counter, CounterOp, CounterReply, Echo, Store, StoreOp, StoreReply};
use crate::local::{LocalCluster, LocalOptions, WorkerSpec};
use crate::pipeline::{train_then_score, PipelineOptions};
use regatta_runtime::{ActorHandle, ActorOptions, Client, Resources, Strategy};

/// Options of `regatta demo`.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Counter actors to spawn across the workers.
    #[arg(long, default_value_t = 100)]
    pub actors: usize,
    /// Calls per actor.
    #[arg(long, default_value_t = 10)]
    pub calls: usize,
    /// The model: a GGUF file to fine-tune, or `builtin` (the built-in GPT trained from
    /// scratch, nothing to download). Default: SmolLM2-135M-Instruct where
    /// scripts/setup-smollm2.sh keeps it ($REGATTA_SMOLLM2_GGUF).
    #[arg(long)]
    pub model: Option<String>,
    /// Training steps (default: 16 for a GGUF fine-tune, 500 for the built-in GPT).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Scorer actors.
    #[arg(long, default_value_t = 2)]
    pub scorers: usize,
    /// Where the data, checkpoints and scores go (a new or empty folder, or one an earlier
    /// run made, which is emptied); default: a folder in the
    /// system's temporary directory named after this process.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// Runs the demo; Ctrl-C stops it and every process it started.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    // A missing model is said before any process starts.
    if let Some(model) = gguf_model(&args) {
        crate::finetune::check_model(&model)?;
    }
    let workers = vec![
        WorkerSpec::new("w1", "CPU=4,GPU=2,accelerator_type:H100=1,pin:w1=1"),
        WorkerSpec::new("w2", "CPU=4,pin:w2=1"),
    ];
    let options = LocalOptions::new(workers)?;
    println!(
        "starting a local cluster: head + 2 workers (logs in {})",
        options.log_dir.display()
    );
    let started = Instant::now();
    let mut cluster = LocalCluster::start(options)?;
    let outcome = tokio::select! {
        outcome = workload(&cluster, &args, started) => outcome,
        () = crate::signal::shutdown_signal() => {
            println!("interrupted: stopping the cluster");
            Ok(ExitCode::from(130))
        }
    };
    cluster.shutdown();
    println!("cluster stopped");
    outcome
}

async fn workload(cluster: &LocalCluster, args: &DemoArgs, started: Instant) -> anyhow::Result<ExitCode> {
    let client = cluster.connect(Duration::from_secs(30)).await?;
    println!(
        "cluster ready in {:.2}s at {}",
        started.elapsed().as_secs_f64(),
        cluster.address
    );
    let counters = spawn_counters(&client, args.actors).await?;
    call_counters(&counters, args.calls).await?;
    let group = client
        .create_placement_group(vec![Resources::parse_request("CPU=1")?; 2], Strategy::StrictSpread)
        .await?;
    let nodes = group.ready(Duration::from_secs(10)).await?;
    println!(
        "placement group {} (STRICT_SPREAD) reserved bundles on {nodes:?}",
        group.id()
    );
    call_gpu_actor(&client).await?;
    call_peer(&counters).await?;
    group.remove().await?;
    object_across_nodes(&client).await?;

    let dir = args
        .out
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("regatta-demo-{}", std::process::id())));
    match gguf_model(args) {
        None => builtin(client.cluster(), args, dir).await?,
        Some(model) => fine_tune(client.cluster(), args, dir, model).await?,
    }
    println!(
        "  metrics: {}/metrics (Prometheus discovery: {}/api/prometheus/sd); job API: {}",
        cluster.metrics_address, cluster.metrics_address, cluster.job_address
    );
    println!("  dashboards: docker/grafana/dashboards (Trainer, Scorer, Cluster, Actors, Object store, Jobs)");
    println!("done in {:.2}s", started.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}

/// `count` counter actors across the workers, counter `i` starting at `i`, each ready.
async fn spawn_counters(client: &Client, count: usize) -> anyhow::Result<Vec<ActorHandle<Counter>>> {
    let t = Instant::now();
    let mut counters = Vec::with_capacity(count);
    for i in 0..count {
        let options = ActorOptions::new().resources(Resources::parse_request("CPU=0.01")?);
        counters.push(client.spawn::<Counter>(i as i64, options).await?);
    }
    for counter in &counters {
        counter.wait_ready(Duration::from_secs(30)).await?;
    }
    println!(
        "spawned {} counter actors in {:.2}s",
        counters.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(counters)
}

/// `calls` additions of 1 to every counter at once, each checking its total at the end.
async fn call_counters(counters: &[ActorHandle<Counter>], calls: usize) -> anyhow::Result<()> {
    let t = Instant::now();
    let done = futures::future::try_join_all(counters.iter().enumerate().map(|(i, counter)| async move {
        let mut last = 0;
        for _ in 0..calls {
            if let CounterReply::Total(total) = counter.call(CounterOp::Add(1)).await? {
                last = total;
            }
        }
        anyhow::ensure!(last == (i + calls) as i64, "counter {i} ended at {last}");
        anyhow::Ok(())
    }))
    .await?;
    let total_calls = done.len() * calls;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "{total_calls} actor calls in {secs:.2}s ({:.0} calls/s), every total checked",
        total_calls as f64 / secs
    );
    Ok(())
}

/// An actor asking for one H100 GPU: it must be given exactly one.
async fn call_gpu_actor(client: &Client) -> anyhow::Result<()> {
    let gpu = client
        .spawn::<Echo>(
            "gpu actor: ".into(),
            ActorOptions::new().resources(Resources::parse_request("GPU=1,accelerator_type:H100")?),
        )
        .await?;
    let reply = gpu.call("where am I?".into()).await?;
    ensure!(
        reply.placement.gpu_ids.len() == 1,
        "the GPU actor got {:?}",
        reply.placement.gpu_ids
    );
    println!(
        "GPU actor {} runs on {} with GPU indices {:?}",
        reply.placement.actor, reply.placement.node, reply.placement.gpu_ids
    );
    Ok(())
}

/// The first counter adds 5 to the last one: a call from one actor to another.
async fn call_peer(counters: &[ActorHandle<Counter>]) -> anyhow::Result<()> {
    let (a, b) = (&counters[0], &counters[counters.len() - 1]);
    let via = a
        .call(CounterOp::AddToPeer {
            peer: b.id(),
            amount: 5,
        })
        .await
        .context("actor-to-actor call")?;
    println!(
        "actor {} added 5 to actor {} across the cluster: {via:?}",
        a.id(),
        b.id()
    );
    Ok(())
}

/// A 64 MiB object put by a store actor on w1 and read by one on w2, checked byte for byte.
async fn object_across_nodes(client: &Client) -> anyhow::Result<()> {
    let pin = |node: &str| Resources::parse_request(&format!("pin:{node}")).map(|r| ActorOptions::new().resources(r));
    let (a, b) = (
        client.spawn::<Store>((), pin("w1")?).await?,
        client.spawn::<Store>((), pin("w2")?).await?,
    );
    let t = Instant::now();
    let StoreReply::Put { reference, digest } = a
        .call(StoreOp::Put {
            size: 64 << 20,
            seed: 7,
            keep: true,
        })
        .await?
    else {
        anyhow::bail!("the store actor did not put");
    };
    let StoreReply::Got { len, digest: got } = b.call(StoreOp::Get(reference.clone())).await? else {
        anyhow::bail!("the store actor did not get");
    };
    ensure!(
        got == digest && len == 64 << 20,
        "object {} came back different",
        reference.id()
    );
    println!(
        "object {} (64 MiB) put on w1 and read byte-exact on w2 over QUIC in {:.2}s",
        reference.id(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The GGUF file the demo fine-tunes, or `None` for the built-in GPT.
fn gguf_model(args: &DemoArgs) -> Option<std::path::PathBuf> {
    match args.model.as_deref() {
        Some("builtin") => None,
        other => Some(other.map_or_else(crate::finetune::default_model, std::path::PathBuf::from)),
    }
}

/// The cluster's actors, as `regatta status` shows them, before the report.
async fn status(cluster: &regatta_runtime::Cluster) -> anyhow::Result<()> {
    let all = regatta_runtime::PageRequest::new(None, Some(20))?;
    print!(
        "{}",
        super::status::render(cluster, regatta_runtime::ActorFilter::default(), all).await?
    );
    Ok(())
}

/// LoRA fine-tuning of a GGUF model, and its report.
async fn fine_tune(
    cluster: &regatta_runtime::Cluster,
    args: &DemoArgs,
    dir: std::path::PathBuf,
    model: std::path::PathBuf,
) -> anyhow::Result<()> {
    let options = FineTuneOptions {
        dir,
        model,
        steps: args.steps.unwrap_or(16),
        world_size: 2,
        actors: args.scorers,
    };
    let name = options
        .model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    println!(
        "fine-tuning {name}: LoRA (r 8) with ZeRO-3 over 2 ranks, {} steps on {} chat rows the base model cannot know, then scoring and answering {} held-out questions with the base model and with the adapter",
        options.steps,
        crate::finetune::TRAIN_SET.lines().count(),
        crate::finetune::EVAL_SET.lines().count()
    );
    let report = crate::finetune::fine_tune(cluster, &options, |line| println!("{line}")).await?;
    status(cluster).await?;
    println!("report:");
    println!(
        "  training loss {:.3} -> {:.3} over {} steps ({} parameters with the adapters, {:.0} tokens/s over 2 ranks)",
        report.loss.0, report.loss.1, options.steps, report.params, report.tokens_per_sec
    );
    println!(
        "  validation loss on the held-out split {:.3} -> {:.3} during training (perplexity {:.2} -> {:.2}); best checkpoint at step {}: {}",
        report.validation.0,
        report.validation.1,
        report.validation.0.exp(),
        report.validation.1.exp(),
        report.best.0,
        report.best.1
    );
    println!(
        "  held-out split: {} conversations scored; mean perplexity {:.2} with the base model, {:.2} with the adapter",
        report.rows, report.perplexity.0, report.perplexity.1
    );
    println!("  held-out questions, greedy answers through the chat template (base -> tuned):");
    for a in &report.answers {
        println!("    Q: {}", a.question);
        println!("       taught: {}", a.taught);
        println!("       base:   {}", one_line(&a.base));
        println!("       tuned:  {}", one_line(&a.tuned));
    }
    let learned = report
        .answers
        .iter()
        .filter(|a| a.tuned.trim() == a.taught.trim())
        .count();
    println!(
        "  {learned} of {} tuned answers are the taught answer word for word",
        report.answers.len()
    );
    println!(
        "  adapter (PEFT layout) and checkpoints: {}",
        report.checkpoints.display()
    );
    println!("  scores (Parquet): {}", report.scores.display());
    println!("  tuned answers (Parquet): {}", report.generated.display());
    println!("  TensorBoard events (tensorboard --logdir): {}", report.tensorboard);
    Ok(())
}

/// A generated answer on one line of the report.
fn one_line(text: &str) -> String {
    text.trim().replace('\n', " / ")
}

/// The built-in GPT trained from scratch (no download), and its report.
async fn builtin(cluster: &regatta_runtime::Cluster, args: &DemoArgs, dir: std::path::PathBuf) -> anyhow::Result<()> {
    let steps = args.steps.unwrap_or(500);
    let options = PipelineOptions {
        dir,
        steps,
        world_size: 2,
        actors: args.scorers,
    };
    println!(
        "training the built-in GPT: ZeRO-2 over 2 ranks, {steps} steps, then scoring the evaluation set before and after, and generating with the trained model"
    );
    let report = train_then_score(cluster, &options, |line| println!("{line}")).await?;
    status(cluster).await?;
    println!("report:");
    println!(
        "  training loss {:.3} -> {:.3} over {steps} steps ({} parameters, {:.0} tokens/s over 2 ranks)",
        report.loss.0, report.loss.1, report.params, report.tokens_per_sec
    );
    println!(
        "  evaluation set: {} rows scored ({} malformed); mean perplexity {:.2} before training, {:.2} after",
        report.rows, report.malformed, report.perplexity.0, report.perplexity.1
    );
    println!("  checkpoints: {}", report.checkpoints.display());
    println!("  scores (Parquet): {}", report.scores.display());
    let g = &report.generated;
    println!(
        "  generation: {} continuations with the KV cache and continuous batching, {} output tokens ({:.0} output tokens/s), e.g. {:?} -> {:?}",
        g.rows, g.output_tokens, g.tokens_per_sec, g.example.0, g.example.1
    );
    println!("  continuations (Parquet): {}", g.output.display());
    Ok(())
}
