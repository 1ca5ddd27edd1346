//! `regatta-torch-rank`: a trainer rank's executor (launched by the rank actor; speaks
//! JSON lines on stdin/stdout), and `regatta-torch-rank reference CONFIG PARTITIONS OUT`:
//! the single-process AdamW reference run the ZeRO tests compare against (prints one loss
//! per line, writes the final weights to OUT as safetensors); `regatta-torch-rank score`:
//! a scorer actor's executor; `regatta-torch-rank export CHECKPOINT OUT.pt`: a checkpoint's
//! model as a traced TorchScript module the scorer (or PyTorch) can load;
//! `regatta-torch-rank peak CONFIG THREADS`: libtorch's matmul FLOP/s at the run's model
//! shapes, as JSON (what `regatta bench train` measures MFU against);
//! `regatta-torch-rank bench-generate MODEL THREADS`: KV-cache generation's output tokens/s
//! against the machine's memory and compute bounds (what `regatta bench generate` prints);
//! `regatta-torch-rank merge BASE ADAPTER OUT`: a LoRA adapter merged into its base model,
//! written as a plain Hugging Face folder; `regatta-torch-rank bench-adamw ELEMENTS
//! THREADS`: the host AdamW update's memory traffic against a plain copy, as JSON;
//! `regatta-torch-rank bench-data SPEC_JSON`: the streaming loader's tokens/s and memory
//! with a no-op training step, as JSON (what `regatta bench data` prints);
//! `regatta-torch-rank doctor [--json] [--require-cuda]`: what this host's libtorch, CUDA
//! driver, devices and NCCL are, and whether a rank granted a GPU could use it;
//! `regatta-torch-rank logits MODEL_DIR IDS.safetensors OUT.safetensors [--device D]
//! [--dtype float32|bfloat16]`: a Hugging Face model's logits for the `input_ids` tensor of
//! IDS, written as `logits` (float32), for comparison with `transformers` on the same device;
//! `regatta-torch-rank attention-check [--device D] [--dtype T] [--time N]`: the packed-rows
//! attention kernel against SDPA with the dense mask, forward and backward, as JSON;
//! `regatta-torch-rank nccl-check`: the NCCL backend on the first GPU (collectives on the
//! communication stream, device timing, overlap, a missing rank's join timeout, ZeRO-3 over
//! NCCL against no collective), as JSON; exit 1 when a part fails.

use std::io::Write;
use std::process::ExitCode;

use regatta_torch::{builtin_model, checkpoint, executor_main, gemm_peak, reference_run};
use regatta_trainer::TrainConfig;

fn reference(args: &[String]) -> anyhow::Result<()> {
    let [config, partitions, out] = args else {
        anyhow::bail!("usage: regatta-torch-rank reference CONFIG.toml PARTITIONS OUT.safetensors");
    };
    let text = std::fs::read_to_string(config).map_err(|e| anyhow::anyhow!("cannot read {config}: {e}"))?;
    let mut config = TrainConfig::from_toml(&text)?;
    config.resolve_paths(&std::env::current_dir()?);
    let partitions: usize = partitions
        .parse()
        .map_err(|e| anyhow::anyhow!("bad partition count: {e}"))?;
    let (losses, weights) = reference_run(&config, partitions, &builtin_model)?;
    for loss in losses {
        println!("{loss}");
    }
    let bytes = checkpoint::to_safetensors(&weights)?;
    std::fs::write(out, bytes).map_err(|e| anyhow::anyhow!("cannot write {out}: {e}"))
}

fn merge(args: &[String]) -> anyhow::Result<()> {
    let [base, adapter, out] = args else {
        anyhow::bail!("usage: regatta-torch-rank merge BASE_MODEL_DIR ADAPTER_DIR OUT_DIR");
    };
    let cwd = std::env::current_dir()?;
    let [base, adapter, out] = [base, adapter, out].map(|p| regatta_object_store::absolute(p, &cwd));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let written = runtime.block_on(async {
        let hf = regatta_torch::HfModel::open(&base).await?;
        let adapter = regatta_torch::Adapter::open(&adapter).await?;
        regatta_torch::merge_adapter(&hf, &adapter, &out, regatta_torch::SHARD_BYTES).await
    })?;
    println!("wrote {out}: {}", written.join(", "));
    Ok(())
}

/// Times the engine's host AdamW update over `elements` fp32 parameters against a plain
/// copy of one such buffer, both with `threads` libtorch threads; prints JSON.
fn bench_adamw(args: &[String]) -> anyhow::Result<()> {
    use regatta_torch::tch::{Device, Kind, Tensor};
    use regatta_torch::{adamw_update, AdamwStep};
    let [elements, threads] = args else {
        anyhow::bail!("usage: regatta-torch-rank bench-adamw ELEMENTS THREADS");
    };
    let n: i64 = elements
        .parse()
        .map_err(|e| anyhow::anyhow!("bad element count: {e}"))?;
    anyhow::ensure!(n >= 1, "ELEMENTS must be at least 1, not {n}");
    let threads: i32 = threads.parse().map_err(|e| anyhow::anyhow!("bad thread count: {e}"))?;
    regatta_torch::tch::set_num_threads(threads.max(1));
    let options = (Kind::Float, Device::Cpu);
    let (mut master, mut m, mut v) = (
        Tensor::randn([n], options),
        Tensor::zeros([n], options),
        Tensor::zeros([n], options),
    );
    // One range: every element decays.
    let decay = std::iter::once(0..n as usize).collect::<Vec<_>>();
    let grads: Vec<Tensor> = (0..6).map(|_| Tensor::randn([n], options)).collect();
    let mut best_update = f64::INFINITY;
    for (step, grad) in grads.into_iter().enumerate() {
        let hyper = AdamwStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            step: step as u64 + 1,
        };
        let started = std::time::Instant::now();
        adamw_update(&mut master, &mut m, &mut v, &decay, grad, &hyper);
        if step > 0 {
            best_update = best_update.min(started.elapsed().as_secs_f64());
        }
    }
    let (source, mut target) = (Tensor::randn([n], options), Tensor::zeros([n], options));
    let mut best_copy = f64::INFINITY;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        target.copy_(&source);
        best_copy = best_copy.min(started.elapsed().as_secs_f64());
    }
    // A fused AdamW must read the gradient, master and both moments and write master and
    // both moments: 28 bytes a parameter. A copy reads 4 and writes 4.
    let adamw_gbps = 28.0 * n as f64 / best_update / 1e9;
    let copy_gbps = 8.0 * n as f64 / best_copy / 1e9;
    println!(
        "{}",
        serde_json::json!({
            "elements": n,
            "threads": threads,
            "update_secs": best_update,
            "adamw_gbps": adamw_gbps,
            "copy_gbps": copy_gbps,
            "fraction_of_copy_bandwidth": adamw_gbps / copy_gbps,
            "parameters_per_sec": n as f64 / best_update,
        })
    );
    Ok(())
}

fn peak(args: &[String]) -> anyhow::Result<()> {
    let [config, threads] = args else {
        anyhow::bail!("usage: regatta-torch-rank peak CONFIG.toml THREADS");
    };
    let text = std::fs::read_to_string(config).map_err(|e| anyhow::anyhow!("cannot read {config}: {e}"))?;
    // `regatta bench train` hands the run's config over as JSON.
    let mut config = if text.trim_start().starts_with('{') {
        let config: TrainConfig = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("train config: {e}"))?;
        config.validate()?;
        config
    } else {
        TrainConfig::from_toml(&text)?
    };
    config.resolve_paths(&std::env::current_dir()?);
    let threads: usize = threads.parse().map_err(|e| anyhow::anyhow!("bad thread count: {e}"))?;
    let peak = gemm_peak(&config, threads, &builtin_model)?;
    println!("{}", serde_json::to_string(&peak)?);
    Ok(())
}

/// Writes a model folder's logits for fixed token ids (see the module docs).
fn model_logits(args: &[String]) -> anyhow::Result<()> {
    use regatta_torch::tch::{Device, Kind, Tensor};
    let usage = "usage: regatta-torch-rank logits MODEL_DIR IDS.safetensors OUT.safetensors [--device cpu|cuda] [--dtype float32|bfloat16]";
    let (mut device, mut kind, mut paths) = ("cpu".to_string(), Kind::Float, Vec::new());
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--device" => device = rest.next().ok_or_else(|| anyhow::anyhow!("{usage}"))?.clone(),
            "--dtype" => {
                kind = match rest.next().map(String::as_str) {
                    Some("float32") => Kind::Float,
                    Some("bfloat16") => Kind::BFloat16,
                    other => anyhow::bail!("--dtype takes float32 or bfloat16, not {other:?}"),
                }
            }
            _ => paths.push(arg.clone()),
        }
    }
    let [model_dir, ids, out] = paths.as_slice() else {
        anyhow::bail!("{usage}");
    };
    let device = match regatta_torch::cuda::pick_device(&device, &[])? {
        Device::Cpu if device != "cpu" => anyhow::bail!("--device takes cpu or cuda, not {device:?}"),
        picked => picked,
    };
    let input = Tensor::read_safetensors(ids)
        .map_err(|e| anyhow::anyhow!("cannot read {ids}: {e}"))?
        .into_iter()
        .find_map(|(name, t)| (name == "input_ids").then_some(t))
        .ok_or_else(|| anyhow::anyhow!("{ids} holds no input_ids tensor"))?;
    let cwd = std::env::current_dir()?;
    let model_dir = regatta_object_store::absolute(model_dir, &cwd);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let hf = runtime.block_on(regatta_torch::HfModel::open(&model_dir))?;
    let model = hf.model()?;
    hf.check(model.as_ref())?;
    let mut stored = std::collections::HashMap::new();
    for spec in model.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
        let tensor = runtime.block_on(hf.read_as(&spec, kind))?;
        stored.insert(spec.name, tensor.to_device(device));
    }
    let params = regatta_torch::arrange(model.as_ref(), &stored)?;
    let logits =
        regatta_torch::tch::no_grad(|| regatta_torch::logits(model.as_ref(), &params, &input.to_device(device)));
    let logits = logits.to_kind(Kind::Float).to_device(Device::Cpu);
    Tensor::write_safetensors(&[("logits", &logits)], out).map_err(|e| anyhow::anyhow!("cannot write {out}: {e}"))?;
    println!("wrote {out}: logits {:?} on {device:?} in {kind:?}", logits.size());
    Ok(())
}

/// Checks the packed-rows attention kernel (see the module docs); exit 1 when it is off.
fn attention_check(args: &[String]) -> anyhow::Result<ExitCode> {
    use regatta_torch::tch::Kind;
    let (mut device, mut kind, mut time) = ("cpu".to_string(), None, 2048i64);
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let mut value = || rest.next().ok_or_else(|| anyhow::anyhow!("{arg} takes a value"));
        match arg.as_str() {
            "--device" => device = value()?.clone(),
            "--dtype" => {
                kind = Some(match value()?.as_str() {
                    "float32" => Kind::Float,
                    "bfloat16" => Kind::BFloat16,
                    "float16" => Kind::Half,
                    other => anyhow::bail!("--dtype takes float32, bfloat16 or float16, not {other:?}"),
                })
            }
            "--time" => time = value()?.parse().map_err(|e| anyhow::anyhow!("bad --time: {e}"))?,
            other => anyhow::bail!(
                "usage: regatta-torch-rank attention-check [--device cpu|cuda] [--dtype T] [--time N] (not {other:?})"
            ),
        }
    }
    anyhow::ensure!(time >= 8, "--time must be at least 8");
    let device = regatta_torch::cuda::pick_device(&device, &[])?;
    let kind = kind.unwrap_or(if device.is_cuda() { Kind::BFloat16 } else { Kind::Float });
    let result = regatta_torch::attention_check(device, kind, time);
    println!("{}", serde_json::to_string(&result)?);
    Ok(if result.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Prints the diagnosis; fails with `--require-cuda` where CUDA cannot be used.
fn doctor(args: &[String]) -> anyhow::Result<ExitCode> {
    let (mut json, mut require_cuda) = (false, false);
    for arg in args {
        match arg.as_str() {
            "--json" => json = true,
            "--require-cuda" => require_cuda = true,
            other => anyhow::bail!("usage: regatta-torch-rank doctor [--json] [--require-cuda] (not {other:?})"),
        }
    }
    let diagnosis = regatta_torch::cuda::diagnose();
    let text = if json {
        serde_json::to_string_pretty(&diagnosis)?
    } else {
        diagnosis.to_text()
    };
    // A reader that stops early (`doctor | head`) is not an error worth a panic.
    let _ = writeln!(std::io::stdout(), "{text}");
    Ok(match (&diagnosis.cuda_unusable, require_cuda) {
        (Some(reason), true) => {
            eprintln!("error: --require-cuda: {reason}");
            ExitCode::from(1)
        }
        _ => ExitCode::SUCCESS,
    })
}

/// Says a subcommand's error and exits with `code`.
fn fail(error: impl std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("error: {error}");
    ExitCode::from(code)
}

/// The exit of a subcommand that prints its own output: success, or its error and `code`.
fn exit(result: anyhow::Result<()>, code: u8) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e, code),
    }
}

/// Runs the NCCL check on the first GPU (see the module docs); exit 1 when a part fails.
fn nccl_check() -> ExitCode {
    let result = regatta_torch::nccl_check(0);
    println!("{}", serde_json::to_string(&result).unwrap_or_default());
    if result.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Exports a checkpoint as TorchScript (see the module docs).
fn export(args: &[String]) -> ExitCode {
    let [checkpoint, out] = args else {
        eprintln!("usage: regatta-torch-rank export CHECKPOINT_DIR OUT.pt");
        return ExitCode::from(2);
    };
    match regatta_torch::export_torchscript(checkpoint, out) {
        Ok(context) => {
            println!("wrote {out}: a TorchScript module over token ids [batch, time], time up to {context}; score it with --context {context}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e, 1),
    }
}

/// Measures KV-cache generation (see the module docs).
fn bench_generate(args: &[String]) -> ExitCode {
    let (Some(model), Some(threads)) = (args.first(), args.get(1).and_then(|t| t.parse::<usize>().ok())) else {
        eprintln!("usage: regatta-torch-rank bench-generate MODEL_DIR_OR_CONFIG.json THREADS");
        return ExitCode::from(2);
    };
    exit(regatta_torch::bench_generate(model, threads).map_err(Into::into), 1)
}

/// Generates for a job of token ids and prints the outputs and timings as JSON.
fn generate_ids(args: &[String]) -> ExitCode {
    let (Some(model), Some(job)) = (args.first(), args.get(1)) else {
        eprintln!("usage: regatta-torch-rank generate-ids MODEL_DIR JOB.json (prints the outputs and timings as JSON)");
        return ExitCode::from(2);
    };
    match ids_job(model, job) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e, 1),
    }
}

/// Reads the generate-ids job at `job`, runs it over `model` and gives the JSON line.
fn ids_job(model: &str, job: &str) -> anyhow::Result<String> {
    let bytes = std::fs::read(job).map_err(|e| anyhow::anyhow!("cannot read {job}: {e}"))?;
    let spec = serde_json::from_slice::<regatta_torch::IdsJob>(&bytes)
        .map_err(|e| anyhow::anyhow!("{job} is not a generate-ids job: {e}"))?;
    let outcome = regatta_torch::generate_ids(model, &spec)?;
    Ok(serde_json::to_string(&outcome)?)
}

/// Measures the streaming loader (see the module docs).
fn bench_data(args: &[String]) -> ExitCode {
    let spec = match args
        .first()
        .map(|s| serde_json::from_str::<regatta_torch::BenchDataSpec>(s))
    {
        Some(Ok(spec)) => spec,
        Some(Err(e)) => {
            eprintln!("error: bad spec: {e}");
            return ExitCode::from(2);
        }
        None => {
            eprintln!("usage: regatta-torch-rank bench-data SPEC_JSON");
            return ExitCode::from(2);
        }
    };
    match regatta_torch::bench_data(&spec) {
        Ok(result) => {
            println!("{}", serde_json::to_string(&result).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => fail(e, 1),
    }
}

fn main() -> ExitCode {
    regatta_torch::cuda::keep_freed_memory();
    // Before anything asks libtorch about CUDA: see regatta_torch::cuda.
    regatta_torch::cuda::load_libtorch_cuda();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    match args.first().map(String::as_str) {
        None => {
            regatta_runtime::executor::exit_when_orphaned();
            executor_main(&builtin_model)
        }
        Some("score") => {
            regatta_runtime::executor::exit_when_orphaned();
            regatta_torch::score_main()
        }
        Some("logits") => exit(model_logits(rest), 1),
        Some("nccl-check") => nccl_check(),
        Some("attention-check") => attention_check(rest).unwrap_or_else(|e| fail(e, 2)),
        Some("doctor") => doctor(rest).unwrap_or_else(|e| fail(e, 2)),
        Some("export") => export(rest),
        Some("bench-generate") => bench_generate(rest),
        Some("generate-ids") => generate_ids(rest),
        Some("peak") => exit(peak(rest), 2),
        Some("bench-data") => bench_data(rest),
        Some("bench-adamw") => exit(bench_adamw(rest), 2),
        Some("merge") => exit(merge(rest), 1),
        Some("reference") => exit(reference(rest), 2),
        Some(other) => {
            eprintln!("error: unknown argument {other:?}; run without arguments as a rank executor, or `reference`, `score`, `export`, `merge`, `peak`, `bench-generate`, `bench-adamw`, `bench-data`, `doctor`, `logits`, `attention-check`, `nccl-check`");
            ExitCode::from(2)
        }
    }
}
