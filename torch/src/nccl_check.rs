//! `regatta-torch-rank nccl-check`: the NCCL backend on one GPU (a step of the GPU proof).
//!
//! A lent GPU host has one GPU, and NCCL refuses two ranks on one device, so this checks
//! what one GPU can show: a group of one on the communication stream, every collective in
//! f32 and bf16 with its input made by compute just before and its result read by compute
//! just after (a missing event in either direction reads stale memory and shows as a
//! difference); the device time the timing events measure; how much of a collective
//! hides behind compute started after it; a group of two whose second rank never comes,
//! which must end at the join timeout with the cause, not hang; and ZeRO-3 training over
//! that group (stage-3 prefetch, asynchronous pinned offload copies) against the same
//! training with no collective at all.

use std::time::{Duration, Instant};

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::collective::{Solo, TensorCollective};
use crate::engine::{seeded, Engine, EngineSettings, MicroBatch};
use crate::error::{Error, Result};
use crate::nccl::{unique_id, NcclCollective, NcclTimeouts};
use regatta_trainer::{Offload, ZeroConfig, ZeroStage};

/// One collective, checked.
#[derive(Debug, Serialize)]
pub struct CollectiveCheck {
    /// all_reduce, all_gather, reduce_scatter or broadcast.
    pub op: &'static str,
    /// Element type moved.
    pub dtype: String,
    /// Elements in the input.
    pub elements: i64,
    /// Largest difference from the input (a group of one returns it unchanged).
    pub max_abs_diff: f64,
    /// Device time of the collective (its timing events).
    pub device_ms: f64,
}

/// Collectives started before compute and waited for after it.
#[derive(Debug, Serialize)]
pub struct Overlap {
    /// What the compute was: GEMMs (which compete with a group of one's device copy for
    /// the same SMs and memory) or a chain of small kernels (launch-bound: the device has
    /// room, so a collective on a concurrent stream runs in it).
    pub compute: &'static str,
    /// Collectives started.
    pub collectives: usize,
    /// The compute alone (host clock around it and a sync).
    pub compute_ms: f64,
    /// The collective alone.
    pub collective_ms: f64,
    /// Both, the collective started first.
    pub together_ms: f64,
    /// Of the shorter of the two, the share hidden behind the other.
    pub hidden: f64,
}

/// A group whose other rank never joins.
#[derive(Debug, Serialize)]
pub struct JoinTimeout {
    /// The join timeout set.
    pub limit_s: f64,
    /// How long the join took to fail.
    pub waited_s: f64,
    /// Its error, or `None` if it (wrongly) succeeded.
    pub error: Option<String>,
    /// Whether that error is the join's timeout (not another cause).
    pub timed_out: bool,
}

/// ZeRO-3 over the NCCL group of one against the same run with no collective.
#[derive(Debug, Serialize)]
pub struct EngineCompare {
    /// What ran.
    pub run: String,
    /// Losses over NCCL (prefetching, on the communication stream).
    pub nccl_losses: Vec<f64>,
    /// Losses with no collective at all.
    pub solo_losses: Vec<f64>,
    /// Largest relative difference.
    pub max_rel_diff: f64,
    /// Device seconds in collectives per step over NCCL.
    pub nccl_collective_secs: Vec<f64>,
    /// Seconds per step, NCCL then solo (the last step).
    pub step_secs: (f64, f64),
}

/// The whole check.
#[derive(Debug, Serialize)]
pub struct NcclCheck {
    /// Every part passed.
    pub ok: bool,
    /// What failed.
    pub failures: Vec<String>,
    /// Per collective and dtype.
    pub collectives: Vec<CollectiveCheck>,
    /// Collectives beside compute.
    pub overlap: Vec<Overlap>,
    /// The missing rank.
    pub join_timeout: Option<JoinTimeout>,
    /// Training over the group.
    pub engine: Vec<EngineCompare>,
}

fn group_of_one(ordinal: usize) -> Result<NcclCollective> {
    NcclCollective::join(&unique_id()?, 0, 1, ordinal, NcclTimeouts::default())
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

fn collectives(coll: &mut NcclCollective, device: Device, out: &mut NcclCheck) -> Result<()> {
    for kind in [Kind::Float, Kind::BFloat16] {
        // Made by a long GEMM just before each call: a collective that did not wait for
        // compute would read the buffer before the GEMM wrote it.
        let a = Tensor::randn([8192, 8192], (kind, device));
        let make = || a.matmul(&a).view([-1]) / 100.0;
        type Op = fn(&mut NcclCollective, &Tensor) -> Result<Tensor>;
        let ops: [(&str, Op); 4] = [
            ("all_reduce", |c, x| c.all_reduce(x)),
            ("all_gather", |c, x| c.all_gather_start(x)?.wait()),
            ("reduce_scatter", |c, x| c.reduce_scatter(x)),
            ("broadcast", |c, x| c.broadcast(x, 0)),
        ];
        for (op, run) in ops {
            let input = make();
            let result = run(coll, &input)?;
            // Read by compute at once: without the wait it would read the buffer unwritten.
            let diff = max_abs_diff(&result, &input);
            coll.settle()?;
            let device_ms = coll.take_device_time().unwrap_or_default().as_secs_f64() * 1e3;
            if diff != 0.0 {
                out.failures
                    .push(format!("{op} in {kind:?}: the result differs from the input by {diff}"));
            }
            if device_ms <= 0.0 {
                out.failures.push(format!("{op} in {kind:?}: no device time measured"));
            }
            out.collectives.push(CollectiveCheck {
                op,
                dtype: format!("{kind:?}"),
                elements: input.numel() as i64,
                max_abs_diff: diff,
                device_ms,
            });
        }
    }
    Ok(())
}

fn timed(ordinal: usize, work: impl FnOnce() -> Result<()>) -> Result<f64> {
    tch::Cuda::synchronize(ordinal as i64);
    let started = Instant::now();
    work()?;
    tch::Cuda::synchronize(ordinal as i64);
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

fn overlap(coll: &mut NcclCollective, ordinal: usize, device: Device, light: bool) -> Result<Overlap> {
    let a = Tensor::randn([8192, 8192], (Kind::BFloat16, device));
    let small = Tensor::randn([1024], (Kind::Float, device));
    let buffer = Tensor::randn([1 << 28], (Kind::BFloat16, device));
    let compute = |n: usize| {
        if light {
            let mut x = small.shallow_clone();
            for _ in 0..n {
                x *= 1.0001;
            }
            x
        } else {
            let mut x = a.shallow_clone();
            for _ in 0..n {
                x = x.matmul(&a) / 100.0;
            }
            x
        }
    };
    let unit = if light { 200 } else { 1 };
    // Warm both, then time one collective and one unit of compute alone.
    let _ = coll.all_gather_start(&buffer)?.wait()?;
    coll.settle()?;
    let _ = compute(2 * unit);
    let one_collective = timed(ordinal, || {
        let _ = coll.all_gather_start(&buffer)?.wait()?;
        coll.settle()
    })?;
    let one_unit = timed(ordinal, || {
        let _ = compute(4 * unit);
        Ok(())
    })? / 4.0;
    // About 8 collectives' worth of compute, and as many collectives as fit in it.
    let units = ((8.0 * one_collective / one_unit.max(1e-3)).round() as usize).clamp(1, 400);
    let compute_ms = timed(ordinal, || {
        let _ = compute(units * unit);
        Ok(())
    })?;
    let collectives = ((compute_ms / one_collective.max(1e-3)).round() as usize).clamp(1, 16);
    let collective_ms = timed(ordinal, || {
        let started: Vec<_> = (0..collectives)
            .map(|_| coll.all_gather_start(&buffer))
            .collect::<Result<_>>()?;
        for pending in started {
            let _ = pending.wait()?;
        }
        coll.settle()
    })?;
    let together_ms = timed(ordinal, || {
        let started: Vec<_> = (0..collectives)
            .map(|_| coll.all_gather_start(&buffer))
            .collect::<Result<_>>()?;
        let _ = compute(units * unit);
        for pending in started {
            let _ = pending.wait()?;
        }
        coll.settle()
    })?;
    let shorter = compute_ms.min(collective_ms).max(1e-9);
    Ok(Overlap {
        compute: if light {
            "chain of small kernels"
        } else {
            "bf16 GEMMs 8192^3"
        },
        collectives,
        compute_ms,
        collective_ms,
        together_ms,
        hidden: ((compute_ms + collective_ms - together_ms) / shorter).clamp(0.0, 1.0),
    })
}

fn join_timeout(ordinal: usize) -> Result<JoinTimeout> {
    let limit = Duration::from_secs(5);
    let timeouts = NcclTimeouts {
        join: limit,
        ..NcclTimeouts::default()
    };
    let id = unique_id()?;
    let started = Instant::now();
    let joined = NcclCollective::join(&id, 0, 2, ordinal, timeouts);
    let error = joined.err();
    Ok(JoinTimeout {
        limit_s: limit.as_secs_f64(),
        waited_s: started.elapsed().as_secs_f64(),
        timed_out: matches!(&error, Some(Error::CollectiveTimeout { limit: waited, .. }) if *waited == limit),
        error: error.map(|e| e.to_string()),
    })
}

/// A Llama of about 200M parameters, as `config.json` would give it.
fn small_llama() -> Result<Box<dyn crate::model::Model>> {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": false, "hidden_act": "silu"
    });
    let config =
        regatta_trainer::LlamaConfig::from_json(&json, "nccl-check").map_err(|e| Error::Invalid(e.to_string()))?;
    Ok(Box::new(crate::llama::Llama::new(config, json)))
}

/// Packed rows of random tokens: two documents a row.
fn batches(steps: usize, rows: i64, time: i64) -> Vec<Vec<MicroBatch>> {
    tch::manual_seed(7);
    (0..steps)
        .map(|_| {
            let tokens = Tensor::randint(32000, [rows, time + 1], (Kind::Int64, Device::Cpu));
            let documents = Tensor::cat(
                &[
                    Tensor::zeros([rows, time / 2], (Kind::Int64, Device::Cpu)),
                    Tensor::ones([rows, time - time / 2], (Kind::Int64, Device::Cpu)),
                ],
                1,
            );
            vec![MicroBatch {
                tokens: tokens.narrow(1, 0, time),
                targets: tokens.narrow(1, 1, time),
                documents: Some(documents),
            }]
        })
        .collect()
}

fn train(
    coll: Box<dyn TensorCollective>,
    device: Device,
    offload: bool,
    steps: &[Vec<MicroBatch>],
) -> Result<(Vec<f64>, Vec<f64>, f64)> {
    let offload = if offload {
        ZeroConfig {
            offload_optimizer: Offload::Cpu,
            offload_params: Offload::Cpu,
        }
    } else {
        ZeroConfig::default()
    };
    let settings = EngineSettings {
        stage: ZeroStage::Three,
        optimizer: Default::default(),
        steps: steps.len() as u64,
        device,
        compute: Kind::BFloat16,
        activation_checkpointing: true,
        offload,
        seed: 0,
    };
    let mut init = |spec: &crate::model::ParamSpec| Ok(seeded(spec, 0));
    let mut engine = Engine::new(small_llama()?, coll, settings, &mut init)?;
    let (mut losses, mut collective, mut last) = (Vec::new(), Vec::new(), 0.0);
    for micro in steps {
        let started = Instant::now();
        let outcome = engine.train_step(micro)?;
        last = started.elapsed().as_secs_f64();
        losses.push(outcome.loss);
        collective.push(outcome.collective_secs);
    }
    Ok((losses, collective, last))
}

fn engine(ordinal: usize, device: Device, offload: bool) -> Result<EngineCompare> {
    let steps = batches(4, 4, 1024);
    let (nccl_losses, nccl_collective_secs, nccl_secs) =
        train(Box::new(group_of_one(ordinal)?), device, offload, &steps)?;
    let (solo_losses, _, solo_secs) = train(Box::new(Solo), device, false, &steps)?;
    let max_rel_diff = nccl_losses
        .iter()
        .zip(&solo_losses)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
        .fold(0.0, f64::max);
    Ok(EngineCompare {
        run: format!(
            "ZeRO-3 bf16, 200M Llama, 4 steps of 4x1024 packed tokens{}",
            if offload {
                ", optimizer and parameters offloaded (pinned, asynchronous copies)"
            } else {
                ""
            }
        ),
        nccl_losses,
        solo_losses,
        max_rel_diff,
        nccl_collective_secs,
        step_secs: (nccl_secs, solo_secs),
    })
}

/// A part's result; a libtorch panic (an out-of-memory, say) is its error, not the end.
fn part<T>(name: &str, failures: &mut Vec<String>, run: impl FnOnce() -> Result<T>) -> Option<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(Ok(value)) => Some(value),
        Ok(Err(e)) => {
            failures.push(format!("{name}: {e}"));
            None
        }
        Err(panic) => {
            let what = crate::error::panic_text(panic.as_ref());
            failures.push(format!("{name}: {}", what.lines().next().unwrap_or_default()));
            None
        }
    }
}

/// Runs every part on CUDA device `ordinal`; a part that fails is recorded, and the
/// others still run.
pub fn check(ordinal: usize) -> NcclCheck {
    let device = Device::Cuda(ordinal);
    let mut failures = Vec::new();
    let mut collective_checks = Vec::new();
    let mut overlap_seen = Vec::new();
    if let Some(mut coll) = part("a group of one", &mut failures, || group_of_one(ordinal)) {
        let mut found = NcclCheck::empty();
        part("collectives", &mut failures, || {
            collectives(&mut coll, device, &mut found)
        });
        failures.append(&mut found.failures);
        collective_checks = found.collectives;
        for light in [false, true] {
            if let Some(o) = part("overlap", &mut failures, || overlap(&mut coll, ordinal, device, light)) {
                // Beside launch-bound compute, a collective on a stream of its own runs in
                // the gaps; serialised with compute, none of it would hide.
                if light && o.hidden < 0.5 {
                    failures.push(format!(
                        "only {:.0}% of the collectives hid behind launch-bound compute: the communication stream does not run beside compute",
                        o.hidden * 100.0
                    ));
                }
                overlap_seen.push(o);
            }
        }
    }
    let join = part("join timeout", &mut failures, || join_timeout(ordinal));
    if let Some(j) = &join {
        match &j.error {
            None => failures.push("a group of two with one rank formed without the other".into()),
            Some(e) if !j.timed_out => failures.push(format!("the missing rank failed with another cause: {e}")),
            Some(_) if j.waited_s > j.limit_s + 10.0 => failures.push(format!(
                "the join took {:.1} s to fail, limit {} s",
                j.waited_s, j.limit_s
            )),
            Some(_) => {}
        }
    }
    let mut engines = Vec::new();
    for offload in [false, true] {
        if let Some(compare) = part(&format!("engine (offload {offload})"), &mut failures, || {
            engine(ordinal, device, offload)
        }) {
            // NaN fails too.
            if compare.max_rel_diff.is_nan() || compare.max_rel_diff > 2e-3 {
                failures.push(format!(
                    "{}: losses over NCCL differ from the solo run's by {:.2e}",
                    compare.run, compare.max_rel_diff
                ));
            }
            engines.push(compare);
        }
    }
    NcclCheck {
        ok: failures.is_empty(),
        failures,
        collectives: collective_checks,
        overlap: overlap_seen,
        join_timeout: join,
        engine: engines,
    }
}

impl NcclCheck {
    fn empty() -> Self {
        Self {
            ok: false,
            failures: Vec::new(),
            collectives: Vec::new(),
            overlap: Vec::new(),
            join_timeout: None,
            engine: Vec::new(),
        }
    }
}
