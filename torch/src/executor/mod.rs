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
use regatta_trainer::{
    FromExecutor, LinkOptions, RankSetup, RingCollective, RingLinkBuilder, StepReport, ToExecutor, SECRET_ENV,
};
use tch::{Device, Kind, Tensor};

use bytes::Bytes;

use crate::checkpoint::{self, Manifest, SaveSpec};
use crate::collective::{CpuCollective, Solo, TensorCollective};
use crate::data::{DataSource, RankData, TextTokenizer};
use crate::engine::{seeded, Engine, EngineSettings, MicroBatch};
use crate::error::Error;
use crate::hf::{model_from_config, HfModel};
use crate::model::{Gpt, Model, ParamSpec};
use crate::stream::{Loader, LoaderSpec};
use regatta_object_store::Place;
use regatta_trainer::documents::TokenizerSettings;
use regatta_trainer::eval::{improves, rank_batches, EvalReport, Side};

/// Largest weight shard a checkpoint writes.
pub const SHARD_BYTES: u64 = 2 << 30;

pub use crate::reference::NamedTensors;

/// Makes the model a run trains when `[model]` names no Hugging Face model, for the
/// tokenizer's vocabulary.
pub type ModelFactory = dyn Fn(&TrainConfig, usize) -> Box<dyn Model>;

/// The built-in GPT for a configuration and vocabulary.
pub fn builtin_model(config: &TrainConfig, vocab: usize) -> Box<dyn Model> {
    Box::new(Gpt::new(config.model.clone(), vocab))
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure {
            fatal: !error.is_transient(),
            reason: error.to_string(),
        }
    }
}

/// The `tokenizer.json` a run uses: `data.tokenizer`, else the model folder's (a GGUF
/// model file is its own tokenizer), else none (bytes are tokens).
pub fn tokenizer_spec(config: &TrainConfig) -> String {
    if !config.data.tokenizer.is_empty() {
        config.data.tokenizer.clone()
    } else if crate::hf::is_gguf(&config.model.path) {
        config.model.path.clone()
    } else if !config.model.path.is_empty() {
        format!("{}/tokenizer.json", config.model.path.trim_end_matches('/'))
    } else {
        String::new()
    }
}

/// The model a run trains, the folder its first weights come from (none: seeded random
/// weights) and the files its checkpoints copy (tokenizer and generation settings).
pub struct RunModel {
    /// The model.
    pub model: Box<dyn Model>,
    /// The Hugging Face folder it loads from.
    pub source: Option<HfModel>,
    /// Files copied into checkpoints.
    pub side_files: Vec<(String, Bytes)>,
    /// The tokenizer.
    pub tokenizer: std::sync::Arc<TextTokenizer>,
    /// Special tokens and chat template (`tokenizer_config.json` beside the tokenizer).
    pub settings: TokenizerSettings,
}

impl RunModel {
    /// Partitions `which` of `partitions` of the run's dataset, tokenized by this model's
    /// tokenizer into sequences of the run's context.
    /// With `eval.split`, the held-out rows are left out.
    pub async fn data(&self, config: &TrainConfig, partitions: usize, which: &[usize]) -> Result<RankData, Error> {
        let source = DataSource {
            path: &config.data.path,
            format: config.data.format,
            tokenizer: &self.tokenizer,
            settings: &self.settings,
            holdout: config.eval.as_ref().and_then(|e| e.holdout(config.seed, Side::Train)),
        };
        RankData::load(&source, config.model.context, partitions, which).await
    }

    /// The validation rows of `[eval]` (all of them: each rank evaluates its share of
    /// them by [`regatta_trainer::eval::rank_batches`]) and how many are used
    /// (`eval.max_rows` at most); `None` without `[eval]`.
    pub async fn eval_data(&self, config: &TrainConfig) -> Result<Option<(RankData, usize)>, Error> {
        let Some(eval) = &config.eval else {
            return Ok(None);
        };
        let source = if eval.path.is_empty() {
            DataSource {
                path: &config.data.path,
                format: config.data.format,
                tokenizer: &self.tokenizer,
                settings: &self.settings,
                holdout: eval.holdout(config.seed, Side::Eval),
            }
        } else {
            DataSource {
                path: &eval.path,
                format: regatta_trainer::DataFormat::Auto,
                tokenizer: &self.tokenizer,
                settings: &self.settings,
                holdout: None,
            }
        };
        let data = RankData::load(&source, config.model.context, 1, &[0])
            .await
            .map_err(|e| match e {
                Error::Dataset(problem) => Error::Dataset(format!("validation data ([eval]): {problem}")),
                other => other,
            })?;
        let rows = data.sequences()[0].min(eval.max_rows);
        Ok(Some((data, rows)))
    }
}

/// A parameter's first values: read from the model folder, or drawn from `seed` when there
/// is none or the parameter is a new LoRA adapter (A uniform as PEFT draws it, B zero).
pub async fn initial_weights(source: Option<&HfModel>, spec: &ParamSpec, seed: u64) -> Result<Tensor, Error> {
    match source {
        Some(hf) if !regatta_trainer::lora::is_adapter(&spec.name) => hf.read(spec).await,
        _ => Ok(seeded(spec, seed)),
    }
}

/// Opens the model and tokenizer `config` names (a folder, a config, or `make_model`'s).
pub async fn open_run_model(config: &TrainConfig, make_model: &ModelFactory) -> Result<RunModel, Error> {
    // The model folder first: a wrong path is named as a missing model, not a tokenizer.
    let hf = if config.model.path.is_empty() {
        None
    } else {
        Some(HfModel::open(&config.model.path).await?)
    };
    let spec = tokenizer_spec(config);
    let (tokenizer, settings) = if crate::hf::is_gguf(&spec) {
        // The model file itself when it is the tokenizer: its header is read once.
        let opened;
        let file = match hf.as_ref().filter(|h| h.is_gguf() && config.data.tokenizer.is_empty()) {
            Some(model) => model,
            None => {
                opened = HfModel::open(&spec).await?;
                &opened
            }
        };
        gguf_tokenizer(file).await?
    } else {
        let tokenizer = TextTokenizer::load(&spec).await.map_err(|e| match e {
            Error::Storage(problem) => Error::ModelFile {
                path: spec.clone(),
                problem,
            },
            other => other,
        })?;
        (tokenizer, tokenizer_settings(&spec).await?)
    };
    let (mut model, source, mut side_files) = if let Some(hf) = hf {
        let model = hf.model()?;
        hf.check(model.as_ref())?;
        let side = hf.side_files().await?;
        (model, Some(hf), side)
    } else if let Some(json) = &config.model.config {
        (model_from_config(json, "model.config")?, None, Vec::new())
    } else {
        (make_model(config, tokenizer.vocab()), None, Vec::new())
    };
    if let Some(lora) = &config.lora {
        model.set_lora(lora)?;
    }
    if tokenizer.vocab() > model.vocab() {
        return Err(Error::ModelFile {
            path: if spec.is_empty() {
                "the byte tokenizer".into()
            } else {
                spec.clone()
            },
            problem: format!(
                "has {} tokens but the model embeds only {}; use the model's own tokenizer.json",
                tokenizer.vocab(),
                model.vocab()
            ),
        });
    }
    if source.is_none() && !config.data.tokenizer.is_empty() {
        side_files.push((
            "tokenizer.json".into(),
            crate::data::tokenizer_json(&config.data.tokenizer).await?,
        ));
    }
    Ok(RunModel {
        model,
        source,
        side_files,
        tokenizer: std::sync::Arc::new(tokenizer),
        settings,
    })
}

/// The tokenizer and the special tokens and chat template a GGUF file's metadata makes.
async fn gguf_tokenizer(file: &HfModel) -> Result<(TextTokenizer, TokenizerSettings), Error> {
    let missing = |name: &str| Error::ModelFile {
        path: file.url().to_string(),
        problem: format!("makes no {name}"),
    };
    let tokenizer = file
        .file("tokenizer.json")
        .await?
        .ok_or_else(|| missing("tokenizer.json"))?;
    let config = file
        .file("tokenizer_config.json")
        .await?
        .ok_or_else(|| missing("tokenizer_config.json"))?;
    let json: serde_json::Value = serde_json::from_slice(&config).map_err(|e| Error::ModelFile {
        path: file.url().to_string(),
        problem: format!("makes a tokenizer_config.json that is not JSON: {e}"),
    })?;
    Ok((
        TextTokenizer::from_json(&tokenizer, file.url())?,
        TokenizerSettings::from_json(&json),
    ))
}

/// The `tokenizer_config.json` beside the tokenizer at `spec`, when there is one.
async fn tokenizer_settings(spec: &str) -> Result<TokenizerSettings, Error> {
    if spec.is_empty() {
        return Ok(TokenizerSettings::default());
    }
    let (place, _) = Place::file(spec).map_err(Error::Storage)?;
    let Some(bytes) = place.get_opt("tokenizer_config.json").await.map_err(Error::Storage)? else {
        return Ok(TokenizerSettings::default());
    };
    let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
        path: format!("{}/tokenizer_config.json", place.url()),
        problem: format!("is not valid JSON: {e}"),
    })?;
    Ok(TokenizerSettings::from_json(&json))
}

/// The micro-batches a process takes at `step` from `data` (each of its partitions gives
/// `micro_batch_size` sequences per micro-batch).
pub fn step_batches(config: &TrainConfig, data: &RankData, step: u64) -> Vec<MicroBatch> {
    let (micro, accum) = (config.micro_batch_size, config.gradient_accumulation);
    (0..accum as u64)
        .map(|k| {
            let (tokens, targets, documents) = data.batch((step * accum as u64 + k) * micro as u64, micro);
            MicroBatch {
                tokens,
                targets,
                documents,
            }
        })
        .collect()
}

/// A rank's failure: `fatal` when retrying cannot help.
#[derive(Debug)]
pub struct Failure {
    /// Why.
    pub reason: String,
    /// Bad inputs rather than a lost peer.
    pub fatal: bool,
}

fn fatal(reason: impl ToString) -> Failure {
    Failure {
        reason: reason.to_string(),
        fatal: true,
    }
}

fn lost(reason: impl ToString) -> Failure {
    Failure {
        reason: reason.to_string(),
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
    // Name the device the rank ran on (a CUDA out-of-memory or a vanished GPU reads as
    // `on cuda:0 (NVIDIA H100 80GB HBM3): ...`), once it was picked.
    let reason = match RANK_DEVICE.get() {
        Some(device) => format!("on {device}: {}", failure.reason),
        None => failure.reason,
    };
    eprintln!("rank failed: {reason}");
    emit(&FromExecutor::Failed {
        reason,
        fatal: failure.fatal,
    });
    ExitCode::from(1)
}

/// The device this executor's rank runs on, as failures name it.
static RANK_DEVICE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn run_rank(setup: RankSetup, rx: &mpsc::Receiver<ToExecutor>, make_model: &ModelFactory) -> Result<(), Failure> {
    let config = setup.config.clone();
    let (rank, world) = (setup.rank, setup.world);
    tch::set_num_threads(config.threads as i32);
    let device = crate::cuda::pick_device(&config.device, &setup.gpus).map_err(fatal)?;
    let _ = RANK_DEVICE.set(crate::cuda::device_label(device));
    let compute = crate::cuda::training_kind(device).map_err(fatal)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| fatal(format!("cannot start a runtime: {e}")))?;
    let run_model = runtime.block_on(open_run_model(&config, make_model))?;
    let vocab = run_model.model.vocab();
    let place = if config.checkpoint.dir.is_empty() {
        None
    } else {
        Some(Place::dir(&config.checkpoint.dir).map_err(fatal)?)
    };
    let manifest = match (&place, setup.resume) {
        (Some(place), true) => runtime.block_on(checkpoint::latest(place))?,
        _ => None,
    };
    if let Some(conflict) = manifest.as_ref().and_then(|m| m.resume_conflict(&config, vocab)) {
        return Err(fatal(conflict));
    }
    let start_step = manifest.as_ref().map_or(0, |m| m.step);
    let per_rank = config.per_rank_batch();
    let mut feed = if config.streaming() {
        let plan = std::sync::Arc::new(runtime.block_on(crate::stream::plan(&config.data, config.seed))?);
        let (state, after) = match (&place, &manifest) {
            (Some(place), Some(m)) => {
                let (state, lasts) = checkpoint::loader_state(&runtime, place, m, &plan)?;
                // The round-robin continues where this rank left it on the same world size.
                let after = if m.world == world {
                    lasts.get(rank).copied().flatten()
                } else {
                    None
                };
                (state, after)
            }
            _ => (plan.start(), None),
        };
        let spec = LoaderSpec {
            shards: regatta_trainer::stream::rank_shards(plan.shards, world, rank),
            plan,
            state,
            context: config.model.context,
            prefetch: config.data.prefetch,
            after,
        };
        let settings = std::sync::Arc::new(run_model.settings.clone());
        let loader = Loader::start(spec, run_model.tokenizer.clone(), settings, runtime.handle().clone())?;
        let ledger = if config.data.ledger.is_empty() {
            None
        } else {
            Some(Ledger::open(&config.data.ledger, rank, world, setup.attempt).map_err(fatal)?)
        };
        Feed::Stream(Box::new(StreamFeed {
            loader,
            ledger,
            reported: 0,
        }))
    } else {
        Feed::Fixed(
            runtime
                .block_on(run_model.data(&config, world, &[rank]))
                .map_err(fatal)?,
        )
    };
    let validation = runtime.block_on(run_model.eval_data(&config)).map_err(fatal)?;
    let nccl = device.is_cuda() && world > 1;
    let nccl_id = if nccl && rank == 0 {
        Some(regatta_trainer::hex::encode(&crate::nccl::unique_id().map_err(fatal)?))
    } else {
        None
    };
    let builder = if world > 1 && !nccl {
        let bind = format!("{}:0", setup.host)
            .parse()
            .map_err(|e| fatal(format!("bad host {}: {e}", setup.host)))?;
        let secret = std::env::var(SECRET_ENV).map_err(|_| fatal(format!("{SECRET_ENV} is not set")))?;
        let _guard = runtime.enter();
        Some(RingLinkBuilder::bind(bind, &secret, LinkOptions::from_env()).map_err(fatal)?)
    } else {
        None
    };
    let addr = match &builder {
        Some(b) => b.address().map_err(fatal)?.to_string(),
        None => String::new(),
    };
    let params = crate::model::parameter_count(run_model.model.as_ref());
    emit(&FromExecutor::Bound {
        addr,
        params,
        start_step,
        // What the run's first line shows: where, in which dtype, with which attention.
        device: format!(
            "{} {}, attention {}",
            format!("{device:?}").to_lowercase(),
            format!("{compute:?}").to_lowercase(),
            run_model.model.attention_kernel(device, compute).name()
        ),
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
        let id = regatta_trainer::hex::decode(nccl_id.as_deref().unwrap_or_default())
            .ok_or_else(|| fatal("malformed NCCL id"))?;
        Box::new(crate::nccl::NcclCollective::join(&id, rank, world).map_err(lost)?)
    } else {
        let builder = builder.ok_or_else(|| fatal("no ring endpoint"))?;
        let link = runtime.block_on(builder.connect(&next)).map_err(lost)?;
        let (to_next, from_previous) = link.transports();
        eprintln!("rank {rank}: ring link to the next rank by {to_next}, from the previous by {from_previous}");
        Box::new(CpuCollective::new(Box::new(RingCollective::new(rank, world, link))))
    };
    let settings = EngineSettings {
        stage: config.zero_stage,
        optimizer: config.optimizer.clone(),
        steps: config.steps,
        device,
        compute,
        activation_checkpointing: config.activation_checkpointing,
        offload: config.zero.clone(),
        seed: config.seed,
    };
    let RunModel {
        model,
        source,
        side_files,
        ..
    } = run_model;
    let seed = config.seed;
    // Checkpoints write the weights in the source folder's dtype (bf16 stays bf16).
    let weights_kind = source.as_ref().map_or(Kind::Float, HfModel::weights_kind);
    let mut init = |spec: &ParamSpec| runtime.block_on(initial_weights(source.as_ref(), spec, seed));
    let mut engine = Engine::new(model, coll, settings, &mut init)?;
    if let (Some(place), Some(m)) = (&place, &manifest) {
        checkpoint::restore(&runtime, place, &mut engine, rank, world, m)?;
        eprintln!("rank {rank}: resumed from the checkpoint at step {}", m.step);
    }
    let flops_per_token = engine.model().flops_per_token(config.model.context);
    // MFU on CUDA against this card's own bf16 GEMM rate at the model's shapes, measured
    // now (not a datasheet constant).
    let peak_flops = device.is_cuda().then(|| {
        matmul_flops_per_sec_on(
            engine.model(),
            config.micro_batch_size * config.model.context,
            device,
            compute,
        )
    });
    if let Some(peak) = peak_flops {
        eprintln!(
            "rank {rank}: measured GEMM peak at the model's shapes on {device:?} {compute:?}: {:.1} TFLOP/s",
            peak / 1e12
        );
    }
    let streaming = config.streaming();
    let keep_best = config.checkpoint.keep_best;
    // The lowest validation loss of a checkpoint so far (a resumed run continues the
    // earlier attempt's).
    let best = std::cell::Cell::new(match (&place, keep_best && setup.resume) {
        (Some(place), true) => runtime.block_on(checkpoint::best(place))?.and_then(|m| m.eval_loss),
        _ => None,
    });
    let save = |engine: &mut Engine,
                done: u64,
                place: &Place,
                loader: Option<(String, Bytes)>,
                eval_loss: Option<f64>|
     -> Result<(), Failure> {
        let manifest = Manifest {
            step: done,
            world,
            zero_stage: config.zero_stage,
            model: config.model.clone(),
            vocab,
            tokenizer: tokenizer_spec(&config),
            params: engine.parameter_count(),
            positions: vec![done * per_rank as u64; world],
            loader_files: if streaming {
                (0..world).map(|r| checkpoint::loader_file(r, world)).collect()
            } else {
                Vec::new()
            },
            files: (0..world)
                .map(|r| format!("optim-rank-{r}-of-{world}.safetensors"))
                .chain(
                    (0..world)
                        .filter(|_| streaming)
                        .map(|r| checkpoint::loader_file(r, world)),
                )
                .chain(match &config.lora {
                    None => vec!["config.json".to_string()],
                    Some(lora) => {
                        let mut files = vec![
                            regatta_trainer::lora::ADAPTER_CONFIG.to_string(),
                            regatta_trainer::lora::ADAPTER_WEIGHTS.to_string(),
                        ];
                        if lora.merge_on_save {
                            files.push(format!("{}/config.json", checkpoint::MERGED));
                        }
                        files
                    }
                })
                .chain(["manifest.json".to_string()])
                .collect(),
            data: config.data.clone(),
            lora: config.lora.clone(),
            micro_batch_size: config.micro_batch_size,
            gradient_accumulation: config.gradient_accumulation,
            eval_loss,
        };
        let spec = SaveSpec {
            manifest,
            side_files: &side_files,
            shard_bytes: SHARD_BYTES,
            loader,
            weights_kind,
        };
        let url = checkpoint::save(&runtime, place, engine, rank, world, spec)?;
        let is_best = keep_best && eval_loss.is_some_and(|loss| improves(best.get(), loss));
        if is_best {
            best.set(eval_loss);
        }
        if rank == 0 {
            if is_best {
                let pointer = Bytes::from(checkpoint::step_dir(done));
                runtime
                    .block_on(place.put(checkpoint::BEST, pointer))
                    .map_err(|e| lost(format!("cannot write the best-checkpoint pointer: {e}")))?;
            }
            emit(&FromExecutor::Checkpoint {
                step: done,
                url,
                best: is_best,
            });
        }
        Ok(())
    };
    // Validation of this rank's share of the rows; rank 0 reports the loss of all ranks.
    let validate = |engine: &mut Engine, done: u64| -> Result<Option<f64>, Failure> {
        let Some((data, rows)) = &validation else {
            return Ok(None);
        };
        let micro: Vec<MicroBatch> = rank_batches(*rows, world, rank, config.micro_batch_size)
            .iter()
            .map(|picks| {
                let (tokens, targets, documents) = data.rows(picks);
                MicroBatch {
                    tokens,
                    targets,
                    documents,
                }
            })
            .collect();
        let (loss, tokens) = engine.eval_loss(&micro)?;
        if !loss.is_finite() {
            return Err(fatal(format!(
                "the validation loss at step {done} is {loss} over {tokens} target tokens: the validation rows carry \
                 no loss or the model diverged"
            )));
        }
        if rank == 0 {
            emit(&FromExecutor::Eval(EvalReport {
                step: done,
                loss,
                tokens,
            }));
        }
        Ok(Some(loss))
    };
    if start_step == 0 {
        // The model before training: the first point of the validation curve.
        let eval_loss = validate(&mut engine, 0)?;
        if let (Some(place), None, true) = (&place, &manifest, config.checkpoint.initial) {
            save(&mut engine, 0, place, feed.saved(rank, world)?, eval_loss)?;
        }
    }
    let mut last = start_step;
    for step in start_step..config.steps {
        if step == start_step && config.data.epochs.is_some() && !feed.data_left(&mut engine)? {
            // Resumed from the checkpoint written when the data ran out.
            eprintln!("rank {rank}: the checkpoint at step {step} ends the data's epochs");
            break;
        }
        let (batches, keys) = feed.batches(&config, step)?;
        let started = Instant::now();
        let outcome = engine.train_step(&batches)?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        let held = engine.held();
        let tokens_per_sec = config.tokens_per_step() as f64 / secs;
        let mfu = peak_flops.map(|peak| flops_per_token * tokens_per_sec / world as f64 / peak);
        // This step's peaks (reset after reading, so each step reports its own).
        let memory = match device {
            Device::Cuda(ordinal) => crate::shim::cuda_memory(ordinal, true).ok(),
            _ => None,
        };
        emit(&FromExecutor::Step(StepReport {
            step: step + 1,
            loss: outcome.loss,
            step_secs: secs,
            tokens_per_sec,
            collective_secs: outcome.collective_secs,
            param_bytes: held.parameters,
            grad_bytes: outcome.grad_bytes,
            optimizer_bytes: held.optimizer,
            host_param_bytes: held.host_parameters,
            host_grad_bytes: outcome.host_grad_bytes,
            host_optimizer_bytes: held.host_optimizer,
            frozen_param_bytes: held.frozen_parameters,
            mfu,
            lr: config.lr_at(step + 1),
            grad_norm: outcome.grad_norm,
            cuda_peak_allocated_bytes: memory.map(|m| m.peak_allocated),
            cuda_peak_reserved_bytes: memory.map(|m| m.peak_reserved),
        }));
        let done = step + 1;
        last = done;
        let data_over = feed.after_step(done, keys, config.data.epochs.is_some(), &mut engine)?;
        let checkpoint_now =
            place.is_some() && (done % config.checkpoint.interval == 0 || done == config.steps || data_over);
        let validate_now = config
            .eval
            .as_ref()
            .is_some_and(|e| e.due(done, config.steps) || data_over || (keep_best && checkpoint_now));
        let eval_loss = if validate_now {
            validate(&mut engine, done)?
        } else {
            None
        };
        if let (Some(place), true) = (&place, checkpoint_now) {
            save(&mut engine, done, place, feed.saved(rank, world)?, eval_loss)?;
        }
        if data_over {
            eprintln!(
                "rank {rank}: every source has had its {} epoch(s) at step {done}",
                config.data.epochs.unwrap_or(0)
            );
            break;
        }
    }
    emit(&FromExecutor::Finished { steps: last });
    // Let the agent read the last lines before the pipes close.
    std::thread::sleep(Duration::from_millis(50));
    Ok(())
}

/// Where a rank's batches come from.
enum Feed {
    /// `data.path`: a fixed partition per rank.
    Fixed(RankData),
    /// `[[data.sources]]`: the streaming loader.
    Stream(Box<StreamFeed>),
}

struct StreamFeed {
    loader: Loader,
    ledger: Option<Ledger>,
    /// Skipped rows reported one by one so far.
    reported: u64,
}

/// Skipped rows a rank reports one by one; past these, one report a step.
const SKIPPED_REPORTS: u64 = 100;

/// Where a rank writes which documents it trained on: `attempt<TAB>step<TAB>document`
/// lines in `rank-R-of-N-attempt-A.tsv`. A step redone after a restart appears again
/// under a later attempt, which supersedes the earlier lines of that step.
struct Ledger {
    out: std::io::BufWriter<std::fs::File>,
    attempt: u64,
}

impl Ledger {
    fn open(dir: &str, rank: usize, world: usize, attempt: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = std::path::Path::new(dir).join(format!("rank-{rank}-of-{world}-attempt-{attempt}.tsv"));
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            out: std::io::BufWriter::new(file),
            attempt,
        })
    }

    fn write(&mut self, step: u64, keys: &[String]) -> std::io::Result<()> {
        for key in keys {
            writeln!(self.out, "{}\t{step}\t{key}", self.attempt)?;
        }
        self.out.flush()
    }
}

impl Feed {
    /// The micro-batches of `step` and the documents that start in them.
    fn batches(&mut self, config: &TrainConfig, step: u64) -> Result<(Vec<MicroBatch>, Vec<String>), Failure> {
        match self {
            Self::Fixed(data) => Ok((step_batches(config, data, step), Vec::new())),
            Self::Stream(feed) => {
                let rows = feed.loader.take(config.per_rank_batch())?;
                let keys = rows.iter().flat_map(|r| r.keys.iter().cloned()).collect();
                Ok((
                    stream_batches(&rows, config.micro_batch_size, config.model.context),
                    keys,
                ))
            }
        }
    }

    /// After step `done`: the ledger, skipped rows reported; with `epochs`, whether every
    /// rank's shards are exhausted (a collective).
    fn after_step(&mut self, done: u64, keys: Vec<String>, epochs: bool, engine: &mut Engine) -> Result<bool, Failure> {
        let Self::Stream(feed) = self else {
            return Ok(false);
        };
        if let Some(ledger) = &mut feed.ledger {
            ledger
                .write(done, &keys)
                .map_err(|e| fatal(format!("cannot write the data ledger: {e}")))?;
        }
        let skipped = feed.loader.take_skipped();
        for s in &skipped {
            eprintln!("data: skipped {}", s.what);
        }
        let one_by_one = (SKIPPED_REPORTS.saturating_sub(feed.reported) as usize).min(skipped.len());
        for s in &skipped[..one_by_one] {
            emit(&FromExecutor::Skipped {
                what: s.what.clone(),
                count: 1,
            });
        }
        feed.reported += one_by_one as u64;
        if let Some(first) = skipped.get(one_by_one) {
            emit(&FromExecutor::Skipped {
                what: first.what.clone(),
                count: (skipped.len() - one_by_one) as u64,
            });
        }
        if !epochs {
            return Ok(false);
        }
        Ok(!self.data_left(engine)?)
    }

    /// Whether any rank has a row of data left (a collective; `data.path` always has).
    fn data_left(&mut self, engine: &mut Engine) -> Result<bool, Failure> {
        let Self::Stream(feed) = self else {
            return Ok(true);
        };
        let more = if feed.loader.has_more() { 1.0 } else { 0.0 };
        Ok(engine.sum_over_ranks(more)? > 0.5)
    }

    /// This rank's loader state file for a checkpoint.
    fn saved(&self, rank: usize, world: usize) -> Result<Option<(String, Bytes)>, Failure> {
        let Self::Stream(feed) = self else {
            return Ok(None);
        };
        let saved = checkpoint::SavedShards {
            fingerprint: feed.loader.fingerprint(),
            shards: feed.loader.states(),
            last_shard: feed.loader.last_shard(),
        };
        let bytes = serde_json::to_vec(&saved).map_err(|e| fatal(format!("cannot encode the loader state: {e}")))?;
        Ok(Some((checkpoint::loader_file(rank, world), Bytes::from(bytes))))
    }
}

/// Streaming rows as micro-batches of `micro` rows (the documents tensor keeps attention
/// inside each document).
pub fn stream_batches(rows: &[crate::stream::Row], micro: usize, context: usize) -> Vec<MicroBatch> {
    rows.chunks(micro.max(1))
        .map(|chunk| {
            let shape = [chunk.len() as i64, context as i64];
            let tensor = |pick: fn(&crate::stream::Row) -> &Vec<i64>| {
                let flat: Vec<i64> = chunk.iter().flat_map(|r| pick(r).iter().copied()).collect();
                Tensor::from_slice(&flat).view(shape)
            };
            MicroBatch {
                tokens: tensor(|r| &r.inputs),
                targets: tensor(|r| &r.targets),
                documents: Some(tensor(|r| &r.documents)),
            }
        })
        .collect()
}

/// The plain single-process reference ([`crate::reference::plain_run`]: libtorch autograd
/// and AdamW, no ZeRO engine) on the global batch every rank of a `partitions`-rank layout
/// would see, from the same initial weights. Returns the loss of every step and the final
/// weights.
pub fn reference_run(
    config: &TrainConfig,
    partitions: usize,
    make_model: &ModelFactory,
) -> Result<(Vec<f64>, NamedTensors), Error> {
    tch::set_num_threads(config.threads as i32);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let run_model = runtime.block_on(open_run_model(config, make_model))?;
    let which: Vec<usize> = (0..partitions).collect();
    let data = runtime.block_on(run_model.data(config, partitions, &which))?;
    let steps: Vec<Vec<MicroBatch>> = (0..config.steps).map(|s| step_batches(config, &data, s)).collect();
    let seed = config.seed;
    let source = run_model.source;
    let mut init = |spec: &ParamSpec| runtime.block_on(initial_weights(source.as_ref(), spec, seed));
    crate::reference::plain_run(run_model.model.as_ref(), &mut init, &steps, &config.optimizer)
}

/// What the machine's matrix multiplies reach at a model's shapes, for model FLOPs
/// utilisation: the peak MFU is measured against, not a datasheet constant.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GemmPeak {
    /// FLOP/s of libtorch matmuls at the model's weight shapes, `tokens` rows each (f32 on
    /// the CPU, the training dtype on CUDA).
    pub flops_per_sec: f64,
    /// Threads libtorch used.
    pub threads: usize,
    /// Rows of each product (micro-batch × context).
    pub tokens: usize,
    /// The model's training FLOPs per token at the run's context.
    pub model_flops_per_token: f64,
    /// The model's parameters.
    pub parameters: u64,
    /// Where the products ran: `cpu`, or `cuda:N` (in the dtype training computes in there).
    pub device: String,
    /// CUDA devices this process sees (0 on the CPU).
    pub cuda_devices: usize,
}

/// FLOP/s of libtorch's float32 matmuls on the CPU, `[rows, in] x [in, out]` at every
/// weight matrix of `model` (tied ones once), best of 5 rounds.
pub fn matmul_flops_per_sec(model: &dyn Model, rows: usize) -> f64 {
    matmul_flops_per_sec_on(model, rows, Device::Cpu, Kind::Float)
}

/// FLOP/s of libtorch's matmuls on `device` in `kind` at `model`'s weight shapes, each
/// distinct shape timed once and counted as often as the model holds it (a 1B model's
/// inputs for every matrix would not fit a GPU beside the run); CUDA is synchronised
/// around each round. Best of 5 rounds after a warm-up.
pub fn matmul_flops_per_sec_on(model: &dyn Model, rows: usize, device: Device, kind: Kind) -> f64 {
    let mut shapes: Vec<((i64, i64), usize)> = Vec::new();
    for spec in model.blocks().iter().flatten() {
        if spec.shape.len() == 2 && spec.tied_to.is_none() {
            let shape = (spec.shape[1], spec.shape[0]);
            match shapes.iter_mut().find(|(s, _)| *s == shape) {
                Some((_, count)) => *count += 1,
                None => shapes.push((shape, 1)),
            }
        }
    }
    let operands: Vec<(Tensor, Tensor, usize)> = shapes
        .iter()
        .map(|((inner, out), count)| {
            let options = (kind, device);
            (
                Tensor::randn([rows as i64, *inner], options),
                Tensor::randn([*inner, *out], options),
                *count,
            )
        })
        .collect();
    let sync = || {
        if let Device::Cuda(ordinal) = device {
            tch::Cuda::synchronize(ordinal as i64);
        }
    };
    let mut best: Vec<f64> = vec![f64::INFINITY; operands.len()];
    for round in 0..6 {
        for (i, (a, b, _)) in operands.iter().enumerate() {
            sync();
            let start = Instant::now();
            let _ = a.matmul(b);
            sync();
            if round > 0 {
                best[i] = best[i].min(start.elapsed().as_secs_f64());
            }
        }
    }
    let (flops, secs) = operands
        .iter()
        .zip(&best)
        .fold((0.0, 0.0), |(f, t), ((a, b, count), best)| {
            let n = *count as f64;
            (
                f + n * 2.0 * (a.size()[0] * a.size()[1] * b.size()[1]) as f64,
                t + n * best,
            )
        });
    flops / f64::max(secs, 1e-9)
}

/// Times libtorch's matmul on the CPU at every weight shape of `config`'s model (inputs of
/// `micro_batch_size × context` rows), with `threads` threads, best of a few rounds.
pub fn gemm_peak(config: &TrainConfig, threads: usize, make_model: &ModelFactory) -> Result<GemmPeak, Error> {
    tch::set_num_threads(threads.max(1) as i32);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let run_model = runtime.block_on(open_run_model(config, make_model))?;
    let model = run_model.model.as_ref();
    let tokens = config.micro_batch_size * config.model.context;
    // On the device the run trains on, in the dtype it computes in there (bf16 on CUDA).
    let device = crate::cuda::pick_device(&config.device, &[])?;
    let (flops_per_sec, cuda_devices) = match device {
        Device::Cuda(_) => (
            matmul_flops_per_sec_on(model, tokens, device, crate::cuda::training_kind(device)?),
            tch::Cuda::device_count().max(0) as usize,
        ),
        _ => (matmul_flops_per_sec(model, tokens), 0),
    };
    Ok(GemmPeak {
        flops_per_sec,
        device: crate::cuda::device_label(device),
        cuda_devices,
        threads: threads.max(1),
        tokens,
        model_flops_per_token: model.flops_per_token(config.model.context),
        parameters: crate::model::parameter_count(model),
    })
}
