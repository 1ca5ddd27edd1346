//! A rank's life: open its model, data and the checkpoint it resumes from, bind an endpoint
//! and announce it, join the group's collective, build the engine, then train, validate
//! and checkpoint step by step until the run's last step or the end of its data.

use std::cell::Cell;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::eval::{rank_batches, EvalReport};
use regatta_trainer::TrainConfig;
use regatta_trainer::{
    Binding, FromExecutor, LinkOptions, RankSetup, RingCollective, RingLinkBuilder, StepReport, ToExecutor, SECRET_ENV,
};
use tch::{Device, Kind};
use tokio::runtime::Runtime;

use super::feed::Feed;
use super::{
    emit, fatal, initial_weights, lost, matmul_flops_per_sec_on, open_run_model, take_stored_quantized, Failure,
    ModelFactory, RunModel, RANK_DEVICE,
};
use crate::checkpoint::{self, Manifest};
use crate::collective::{CpuCollective, Solo, TensorCollective};
use crate::data::RankData;
use crate::engine::{Engine, EngineSettings, MicroBatch};
use crate::hf::HfModel;
use crate::model::ParamSpec;

mod save;

/// Runs the rank `setup` describes to its last step; `rx` brings the agent's later lines.
pub(super) fn run_rank(
    setup: RankSetup,
    rx: &mpsc::Receiver<ToExecutor>,
    make_model: &ModelFactory,
) -> Result<(), Failure> {
    let (rank, run_model, mut feed) = Rank::open(&setup, make_model)?;
    let endpoint = rank.bind(&setup.host)?;
    rank.announce(&endpoint, &run_model)?;
    let coll = rank.connect(endpoint, rx)?;
    let mut engine = rank.build_engine(run_model, coll)?;
    let pace = rank.measure_pace(&engine);
    rank.best.set(rank.earlier_best()?);
    let last = rank.train(&mut engine, &mut feed, &pace)?;
    emit(&FromExecutor::Finished { steps: last });
    // Let the agent read the last lines before the pipes close.
    std::thread::sleep(Duration::from_millis(50));
    Ok(())
}

/// What a rank holds from its setup to its last step, beside its engine and its feed.
struct Rank {
    config: TrainConfig,
    rank: usize,
    world: usize,
    /// Whether the run continues from its newest checkpoint.
    resume: bool,
    device: Device,
    /// The dtype training computes in on `device`.
    compute: Kind,
    runtime: Runtime,
    /// `checkpoint.dir`, when the run writes checkpoints.
    place: Option<Place>,
    /// The checkpoint this rank resumes from.
    resume_from: Option<Manifest>,
    /// The validation rows of `[eval]` and how many of them are used.
    validation: Option<(RankData, usize)>,
    /// The model's vocabulary.
    vocab: usize,
    /// Sequences this rank trains on a step.
    per_rank: usize,
    /// Files every checkpoint copies (tokenizer and generation settings).
    side_files: Vec<(String, Bytes)>,
    /// Checkpoints write the weights in the source folder's dtype (bf16 stays bf16).
    weights_kind: Kind,
    /// The lowest validation loss of a checkpoint so far (a resumed run continues the
    /// earlier attempt's).
    best: Cell<Option<f64>>,
}

/// How a rank reaches its peers once the agent says who they are.
struct Endpoint {
    /// The group's collective is NCCL's (CUDA ranks of a group of several).
    nccl: bool,
    /// The NCCL unique id rank 0 makes for the group.
    nccl_id: Option<String>,
    /// The bound ring endpoint (CPU ranks of a group of several).
    ring: Option<RingLinkBuilder>,
}

/// What a step's model FLOPs utilisation is measured with.
struct Pace {
    /// The model's training FLOPs per token at the run's context.
    flops_per_token: f64,
    /// This card's GEMM rate at the model's shapes (CUDA only).
    peak_flops: Option<f64>,
}

impl Pace {
    /// The utilisation of a step at `tokens_per_sec` over `world` ranks.
    fn mfu(&self, tokens_per_sec: f64, world: usize) -> Option<f64> {
        self.peak_flops
            .map(|peak| self.flops_per_token * tokens_per_sec / world as f64 / peak)
    }
}

impl Rank {
    /// Picks the device, starts the runtime, opens the model, the checkpoint to resume
    /// from, this rank's feed and the validation rows.
    fn open(setup: &RankSetup, make_model: &ModelFactory) -> Result<(Self, RunModel, Feed), Failure> {
        let config = setup.config.clone();
        tch::set_num_threads(config.threads as i32);
        let device = crate::cuda::pick_device(&config.device, &setup.gpus).map_err(fatal)?;
        let _ = RANK_DEVICE.set(crate::cuda::device_label(device));
        let compute = crate::cuda::training_kind(device).map_err(fatal)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| fatal(format!("cannot start a runtime: {e}")))?;
        let mut run_model = runtime.block_on(open_run_model(&config, make_model))?;
        let vocab = run_model.model.vocab();
        let place = if config.checkpoint.dir.is_empty() {
            None
        } else {
            Some(Place::dir(&config.checkpoint.dir).map_err(fatal)?)
        };
        let resume_from = match (&place, setup.resume) {
            (Some(place), true) => runtime.block_on(checkpoint::latest(place))?,
            _ => None,
        };
        if let Some(conflict) = resume_from.as_ref().and_then(|m| m.resume_conflict(&config, vocab)) {
            return Err(fatal(conflict));
        }
        let feed = Feed::open(setup, &run_model, &runtime, place.as_ref().zip(resume_from.as_ref()))?;
        let validation = runtime.block_on(run_model.eval_data(&config)).map_err(fatal)?;
        let rank = Self {
            rank: setup.rank,
            world: setup.world,
            resume: setup.resume,
            device,
            compute,
            place,
            resume_from,
            validation,
            vocab,
            per_rank: config.per_rank_batch(),
            side_files: std::mem::take(&mut run_model.side_files),
            weights_kind: run_model.source.as_ref().map_or(Kind::Float, HfModel::weights_kind),
            best: Cell::new(None),
            runtime,
            config,
        };
        Ok((rank, run_model, feed))
    }

    /// The step this rank starts at: the resumed checkpoint's, else 0.
    fn start_step(&self) -> u64 {
        self.resume_from.as_ref().map_or(0, |m| m.step)
    }

    /// Makes the group's NCCL id (rank 0 of CUDA ranks) or binds the ring endpoint on
    /// `host` (CPU ranks); a rank alone needs neither.
    fn bind(&self, host: &str) -> Result<Endpoint, Failure> {
        let (rank, world) = (self.rank, self.world);
        let nccl = self.device.is_cuda() && world > 1;
        let nccl_id = if nccl && rank == 0 {
            Some(regatta_trainer::hex::encode(&crate::nccl::unique_id().map_err(fatal)?))
        } else {
            None
        };
        let ring = if world > 1 && !nccl {
            let bind = format!("{host}:0")
                .parse()
                .map_err(|e| fatal(format!("bad host {host}: {e}")))?;
            let secret = std::env::var(SECRET_ENV).map_err(|_| fatal(format!("{SECRET_ENV} is not set")))?;
            let _guard = self.runtime.enter();
            Some(RingLinkBuilder::bind(bind, &secret, LinkOptions::from_env()).map_err(fatal)?)
        } else {
            None
        };
        Ok(Endpoint { nccl, nccl_id, ring })
    }

    /// Tells the agent where this rank listens, what it trains, where, and from which step.
    fn announce(&self, endpoint: &Endpoint, run_model: &RunModel) -> Result<(), Failure> {
        let addr = match &endpoint.ring {
            Some(b) => b.address().map_err(fatal)?.to_string(),
            None => String::new(),
        };
        let params = crate::model::parameter_count(run_model.model.as_ref());
        let (device, compute) = (self.device, self.compute);
        emit(&FromExecutor::Bound(Binding {
            addr,
            params,
            start_step: self.start_step(),
            // What the run's first line shows: where, in which dtype, with which attention.
            device: format!(
                "{} {}, attention {}",
                format!("{device:?}").to_lowercase(),
                format!("{compute:?}").to_lowercase(),
                run_model.model.attention_kernel(device, compute).name()
            ),
            nccl_id: endpoint.nccl_id.clone(),
        }));
        Ok(())
    }

    /// Waits for the agent's `Connect` and joins the group's collective.
    fn connect(
        &self,
        endpoint: Endpoint,
        rx: &mpsc::Receiver<ToExecutor>,
    ) -> Result<Box<dyn TensorCollective>, Failure> {
        let (rank, world) = (self.rank, self.world);
        let (next, nccl_id) = match rx.recv() {
            Ok(ToExecutor::Connect { next, nccl_id }) => (next, nccl_id),
            Ok(other) => return Err(fatal(format!("expected connect, got {other:?}"))),
            Err(_) => return Err(lost("the agent went away")),
        };
        let coll: Box<dyn TensorCollective> = if world == 1 {
            Box::new(Solo)
        } else if endpoint.nccl {
            let id = regatta_trainer::hex::decode(nccl_id.as_deref().unwrap_or_default())
                .ok_or_else(|| fatal("malformed NCCL id"))?;
            let ordinal = match self.device {
                tch::Device::Cuda(ordinal) => ordinal,
                other => {
                    return Err(fatal(format!(
                        "NCCL needs a CUDA device, this rank computes on {other:?}"
                    )))
                }
            };
            let timeouts = crate::nccl::NcclTimeouts::from_env().map_err(|e| fatal(e.to_string()))?;
            Box::new(crate::nccl::NcclCollective::join(&id, rank, world, ordinal, timeouts).map_err(lost)?)
        } else {
            let builder = endpoint.ring.ok_or_else(|| fatal("no ring endpoint"))?;
            let link = self.runtime.block_on(builder.connect(&next)).map_err(lost)?;
            let (to_next, from_previous) = link.transports();
            eprintln!("rank {rank}: ring link to the next rank by {to_next}, from the previous by {from_previous}");
            Box::new(CpuCollective::new(Box::new(RingCollective::new(rank, world, link))))
        };
        Ok(coll)
    }

    /// The engine over `run_model`'s model and `coll`, its weights read from the model
    /// folder (or drawn), then restored from the checkpoint this rank resumes from.
    fn build_engine(&self, run_model: RunModel, coll: Box<dyn TensorCollective>) -> Result<Engine, Failure> {
        let config = &self.config;
        let settings = EngineSettings {
            stage: config.zero_stage,
            optimizer: config.optimizer.clone(),
            steps: config.steps,
            device: self.device,
            compute: self.compute,
            activation_checkpointing: config.activation_checkpointing,
            offload: config.zero.clone(),
            seed: config.seed,
        };
        let RunModel { mut model, source, .. } = run_model;
        self.runtime
            .block_on(take_stored_quantized(model.as_mut(), source.as_ref(), self.device))?;
        let seed = config.seed;
        let mut init = |spec: &ParamSpec| self.runtime.block_on(initial_weights(source.as_ref(), spec, seed));
        let mut engine = Engine::new(model, coll, settings, &mut init)?;
        if let (Some(place), Some(m)) = (&self.place, &self.resume_from) {
            let rank = self.rank;
            checkpoint::restore(&self.runtime, place, &mut engine, rank, self.world, m)?;
            eprintln!("rank {rank}: resumed from the checkpoint at step {}", m.step);
        }
        Ok(engine)
    }

    /// The model's FLOPs per token and, on CUDA, this card's own bf16 GEMM rate at the
    /// model's shapes, measured now (not a datasheet constant), for MFU.
    fn measure_pace(&self, engine: &Engine) -> Pace {
        let (config, rank) = (&self.config, self.rank);
        let (device, compute) = (self.device, self.compute);
        let flops_per_token = engine.model().flops_per_token(config.model.context);
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
        Pace {
            flops_per_token,
            peak_flops,
        }
    }

    /// Trains from the start step to the run's last (or to the end of its data's epochs),
    /// validating and checkpointing when due; returns the last step done.
    fn train(&self, engine: &mut Engine, feed: &mut Feed, pace: &Pace) -> Result<u64, Failure> {
        let (config, rank, world) = (&self.config, self.rank, self.world);
        let start_step = self.start_step();
        if start_step == 0 {
            // The model before training: the first point of the validation curve.
            let eval_loss = self.validate(engine, 0)?;
            if let (Some(place), None, true) = (&self.place, &self.resume_from, config.checkpoint.initial) {
                self.save(engine, 0, place, feed.saved(rank, world)?, eval_loss)?;
            }
        }
        let mut last = start_step;
        for step in start_step..config.steps {
            if step == start_step && config.data.epochs.is_some() && !feed.data_left(engine)? {
                // Resumed from the checkpoint written when the data ran out.
                eprintln!("rank {rank}: the checkpoint at step {step} ends the data's epochs");
                break;
            }
            let (batches, keys) = feed.batches(config, step)?;
            self.train_step(engine, &batches, step, pace)?;
            let done = step + 1;
            last = done;
            let data_over = feed.after_step(done, keys, config.data.epochs.is_some(), engine)?;
            let checkpoint_now =
                self.place.is_some() && (done % config.checkpoint.interval == 0 || done == config.steps || data_over);
            let validate_now = config.eval.as_ref().is_some_and(|e| {
                e.due(done, config.steps) || data_over || (config.checkpoint.keep_best && checkpoint_now)
            });
            let eval_loss = if validate_now {
                self.validate(engine, done)?
            } else {
                None
            };
            if let (Some(place), true) = (&self.place, checkpoint_now) {
                self.save(engine, done, place, feed.saved(rank, world)?, eval_loss)?;
            }
            if data_over {
                eprintln!(
                    "rank {rank}: every source has had its {} epoch(s) at step {done}",
                    config.data.epochs.unwrap_or(0)
                );
                break;
            }
        }
        Ok(last)
    }

    /// Trains step `step` on `batches` and reports it: loss, speed, memory, learning rate.
    fn train_step(&self, engine: &mut Engine, batches: &[MicroBatch], step: u64, pace: &Pace) -> Result<(), Failure> {
        let config = &self.config;
        let started = Instant::now();
        let outcome = engine.train_step(batches)?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        let held = engine.held();
        let tokens_per_sec = config.tokens_per_step() as f64 / secs;
        let mfu = pace.mfu(tokens_per_sec, self.world);
        // This step's peaks (reset after reading, so each step reports its own).
        let memory = match self.device {
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
        Ok(())
    }

    /// Validation of this rank's share of the rows after step `done`; rank 0 reports the
    /// loss of all ranks. `None` without `[eval]`.
    fn validate(&self, engine: &mut Engine, done: u64) -> Result<Option<f64>, Failure> {
        let Some((data, rows)) = &self.validation else {
            return Ok(None);
        };
        let (rank, world) = (self.rank, self.world);
        let micro: Vec<MicroBatch> = rank_batches(*rows, world, rank, self.config.micro_batch_size)
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
    }
}
