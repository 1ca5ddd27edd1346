//! The rank executor: the process a rank actor launches. It reads [`ToExecutor`] lines on
//! stdin and writes [`FromExecutor`] lines on stdout (logs go to stderr). It exits when its
//! stdin closes, so it never outlives the agent that launched it, even after a SIGKILL.
//!
//! A user's own model runs through [`executor_main`] in their own binary, passed to
//! `TrainerGroup::executor`.

use std::io::{BufRead, Write};
use std::panic::AssertUnwindSafe;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use regatta_trainer::config::TrainConfig;
use regatta_trainer::{FromExecutor, QuicLinkBuilder, RankSetup, RingCollective, StepReport, ToExecutor, SECRET_ENV};
use tch::{Device, Kind};

use crate::checkpoint::{self, Manifest};
use crate::collective::{CpuCollective, Solo, TensorCollective};
use crate::data::{RankData, TextTokenizer};
use crate::engine::{stage, Engine};
use crate::model::{Gpt, LayeredModel};
use regatta_object_store::Place;

/// Peak dense bf16 FLOP/s assumed for the MFU estimate (an H100 SXM).
pub const PEAK_FLOPS: f64 = 989e12;

/// Tensors by name, as checkpoints hold them.
pub type NamedTensors = Vec<(String, tch::Tensor)>;

/// Makes the model a run trains, for the tokenizer's vocabulary.
pub type ModelFactory = dyn Fn(&TrainConfig, usize) -> Box<dyn LayeredModel>;

/// The built-in GPT for a configuration and vocabulary.
pub fn builtin_model(config: &TrainConfig, vocab: usize) -> Box<dyn LayeredModel> {
    Box::new(Gpt::new(config.model.clone(), vocab))
}

/// A rank's failure: `fatal` when retrying cannot help.
#[derive(Debug)]
pub struct Failure {
    /// Why.
    pub reason: String,
    /// Bad inputs rather than a lost peer.
    pub fatal: bool,
}

fn fatal(reason: impl Into<String>) -> Failure {
    Failure {
        reason: reason.into(),
        fatal: true,
    }
}

fn lost(reason: impl Into<String>) -> Failure {
    Failure {
        reason: reason.into(),
        fatal: false,
    }
}

fn emit(event: &FromExecutor) {
    if let Ok(line) = serde_json::to_string(event) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Result<Vec<u8>, String> {
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(|| "malformed NCCL id".to_string())
        })
        .collect()
}

/// The device a rank trains on.
pub fn pick_device(config: &TrainConfig, gpus: &[u32]) -> Result<Device, String> {
    let cuda = tch::Cuda::is_available();
    match config.device.as_str() {
        "cuda" if !cuda => Err(
            "device = \"cuda\" but libtorch sees no CUDA device: run on a GPU node with a CUDA \
                                libtorch on LD_LIBRARY_PATH"
                .into(),
        ),
        "cuda" => Ok(Device::Cuda(0)),
        "auto" if cuda && !gpus.is_empty() => Ok(Device::Cuda(0)),
        _ => Ok(Device::Cpu),
    }
}

/// Runs an executor on stdin/stdout with `make_model`'s model; returns the exit code.
pub fn executor_main(make_model: &ModelFactory) -> ExitCode {
    let (tx, rx) = mpsc::channel::<ToExecutor>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<ToExecutor>(&line) {
                Ok(message) => {
                    if tx.send(message).is_err() {
                        break;
                    }
                }
                Err(e) => eprintln!("ignored a malformed instruction: {e}"),
            }
        }
        // The agent is gone (or closed the pipe): nothing will read what this rank does.
        std::process::exit(3);
    });
    let setup = match rx.recv() {
        Ok(ToExecutor::Setup(setup)) => *setup,
        Ok(other) => {
            emit(&FromExecutor::Failed {
                reason: format!("expected setup first, got {other:?}"),
                fatal: true,
            });
            return ExitCode::from(2);
        }
        Err(_) => return ExitCode::from(2),
    };
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| run_rank(setup, &rx, make_model)));
    let failure = match result {
        Ok(Ok(())) => return ExitCode::SUCCESS,
        Ok(Err(failure)) => failure,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            fatal(format!("the executor panicked: {message}"))
        }
    };
    eprintln!("rank failed: {}", failure.reason);
    emit(&FromExecutor::Failed {
        reason: failure.reason,
        fatal: failure.fatal,
    });
    ExitCode::from(1)
}

fn run_rank(setup: RankSetup, rx: &mpsc::Receiver<ToExecutor>, make_model: &ModelFactory) -> Result<(), Failure> {
    let config = setup.config.clone();
    let (rank, world) = (setup.rank, setup.world);
    tch::set_num_threads(config.threads as i32);
    let device = pick_device(&config, &setup.gpus).map_err(fatal)?;
    let compute = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
    let zero = stage(config.zero_stage).map_err(fatal)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| fatal(format!("cannot start a runtime: {e}")))?;
    let tokenizer = runtime
        .block_on(TextTokenizer::load(&config.data.tokenizer))
        .map_err(fatal)?;
    let vocab = tokenizer.vocab();
    let data = runtime
        .block_on(RankData::load(
            &config.data.path,
            &tokenizer,
            config.model.context,
            world,
            &[rank],
        ))
        .map_err(fatal)?;
    let place = if config.checkpoint.dir.is_empty() {
        None
    } else {
        Some(Place::dir(&config.checkpoint.dir).map_err(fatal)?)
    };
    let model = make_model(&config, vocab);
    let manifest = match (&place, setup.resume) {
        (Some(place), true) => runtime.block_on(checkpoint::latest(place)).map_err(fatal)?,
        _ => None,
    };
    if let Some(m) = &manifest {
        if m.world != world || m.zero_stage != config.zero_stage || m.model != config.model || m.vocab != vocab {
            return Err(fatal(format!(
                "the checkpoint at step {} was written by {} ranks at ZeRO stage {} with model {:?} over {} \
                 tokens; this run has {world} ranks, stage {} and model {:?} over {vocab} tokens",
                m.step, m.world, m.zero_stage, m.model, m.vocab, config.zero_stage, config.model
            )));
        }
    }
    let start_step = manifest.as_ref().map_or(0, |m| m.step);
    let nccl = device.is_cuda() && world > 1;
    let nccl_id = if nccl && rank == 0 {
        Some(hex(&crate::nccl::unique_id().map_err(fatal)?))
    } else {
        None
    };
    let builder = if world > 1 && !nccl {
        let bind = format!("{}:0", setup.host)
            .parse()
            .map_err(|e| fatal(format!("bad host {}: {e}", setup.host)))?;
        let secret = std::env::var(SECRET_ENV).map_err(|_| fatal(format!("{SECRET_ENV} is not set")))?;
        let _guard = runtime.enter();
        Some(QuicLinkBuilder::bind(bind, &secret).map_err(fatal)?)
    } else {
        None
    };
    let addr = match &builder {
        Some(b) => b.local_addr().map_err(fatal)?.to_string(),
        None => String::new(),
    };
    let params = model.blocks().iter().flatten().map(|p| p.numel() as u64).sum();
    emit(&FromExecutor::Bound {
        addr,
        params,
        start_step,
        device: format!("{device:?}").to_lowercase(),
        nccl_id,
    });
    let (next, nccl_id) = match rx.recv() {
        Ok(ToExecutor::Connect { next, nccl_id }) => (next, nccl_id),
        Ok(other) => return Err(fatal(format!("expected connect, got {other:?}"))),
        Err(_) => return Err(lost("the agent went away")),
    };
    let coll: Box<dyn TensorCollective> = if world == 1 {
        Box::new(Solo)
    } else if nccl {
        let id = unhex(nccl_id.as_deref().unwrap_or_default()).map_err(fatal)?;
        Box::new(crate::nccl::NcclCollective::join(&id, rank, world).map_err(lost)?)
    } else {
        let next = next
            .parse()
            .map_err(|e| fatal(format!("bad ring address {next}: {e}")))?;
        let builder = builder.ok_or_else(|| fatal("no ring endpoint"))?;
        let link = runtime.block_on(builder.connect(next)).map_err(lost)?;
        Box::new(CpuCollective::new(Box::new(RingCollective::new(rank, world, link))))
    };
    let mut engine = Engine::new(
        model,
        coll,
        zero,
        config.optimizer.clone(),
        device,
        compute,
        config.seed,
    )
    .map_err(lost)?;
    if let (Some(place), Some(m)) = (&place, &manifest) {
        checkpoint::restore(&runtime, place, &mut engine, rank, m).map_err(|e| {
            if e.contains("link") {
                lost(e)
            } else {
                fatal(e)
            }
        })?;
        eprintln!("rank {rank}: resumed from the checkpoint at step {}", m.step);
    }
    let per_rank = config.per_rank_batch();
    let flops_per_token = engine.model().flops_per_token();
    let save = |engine: &mut Engine, done: u64, place: &Place| -> Result<(), Failure> {
        let manifest = Manifest {
            step: done,
            world,
            zero_stage: config.zero_stage,
            model: config.model.clone(),
            vocab,
            tokenizer: config.data.tokenizer.clone(),
            params: engine.parameter_count(),
            positions: vec![done * per_rank as u64; world],
            files: (0..world)
                .map(|r| format!("optim-rank-{r}-of-{world}.safetensors"))
                .chain(["model.safetensors".to_string(), "manifest.json".to_string()])
                .collect(),
        };
        let url = checkpoint::save(&runtime, place, engine, rank, world, manifest).map_err(lost)?;
        if rank == 0 {
            emit(&FromExecutor::Checkpoint { step: done, url });
        }
        Ok(())
    };
    if let (Some(place), None, true) = (&place, &manifest, config.checkpoint.initial) {
        save(&mut engine, 0, place)?;
    }
    for step in start_step..config.steps {
        let (inputs, targets) = data.batch(step * per_rank as u64, per_rank);
        let started = Instant::now();
        let outcome = engine.train_step(&inputs, &targets).map_err(lost)?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        let held = engine.held();
        let tokens_per_sec = config.tokens_per_step() as f64 / secs;
        let mfu = device
            .is_cuda()
            .then(|| flops_per_token * tokens_per_sec / world as f64 / PEAK_FLOPS);
        emit(&FromExecutor::Step(StepReport {
            step: step + 1,
            loss: outcome.loss,
            step_secs: secs,
            tokens_per_sec,
            collective_secs: outcome.collective_secs,
            param_bytes: held.parameters,
            grad_bytes: outcome.grad_bytes,
            optimizer_bytes: held.optimizer,
            mfu,
        }));
        let done = step + 1;
        if let Some(place) = &place {
            if done % config.checkpoint.interval == 0 || done == config.steps {
                save(&mut engine, done, place)?;
            }
        }
    }
    emit(&FromExecutor::Finished { steps: config.steps });
    // Let the agent read the last lines before the pipes close.
    std::thread::sleep(Duration::from_millis(50));
    Ok(())
}

/// The single-process reference: AdamW on the full batch (every partition of a
/// `partitions`-rank layout, as the ranks together would see it), from the same initial
/// weights. Returns the loss of every step and the final weights.
pub fn reference_run(
    config: &TrainConfig,
    partitions: usize,
    make_model: &ModelFactory,
) -> Result<(Vec<f64>, NamedTensors), String> {
    tch::set_num_threads(config.threads as i32);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let which: Vec<usize> = (0..partitions).collect();
    let tokenizer = runtime.block_on(TextTokenizer::load(&config.data.tokenizer))?;
    let data = runtime.block_on(RankData::load(
        &config.data.path,
        &tokenizer,
        config.model.context,
        partitions,
        &which,
    ))?;
    let mut engine = Engine::new(
        make_model(config, tokenizer.vocab()),
        Box::new(Solo),
        stage(config.zero_stage)?,
        config.optimizer.clone(),
        Device::Cpu,
        Kind::Float,
        config.seed,
    )?;
    let per_partition = config.batch_size / partitions.max(1);
    let mut losses = Vec::new();
    for step in 0..config.steps {
        let (inputs, targets) = data.batch(step * per_partition as u64, per_partition);
        losses.push(engine.train_step(&inputs, &targets)?.loss);
    }
    Ok((losses, engine.consolidated()?))
}
