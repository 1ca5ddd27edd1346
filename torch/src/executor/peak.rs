//! What the machine's matrix multiplies reach at a model's own shapes: the peak a run's
//! model FLOPs utilisation is measured against, and `regatta bench`'s GEMM figure.

use std::time::Instant;

use regatta_trainer::TrainConfig;
use tch::{Device, Kind, Tensor};

use super::{open_run_model, ModelFactory};
use crate::error::Error;
use crate::model::Model;

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
    // A QLoRA base's projections multiply dequantized, at the same shapes.
    for spec in &crate::model::weight_specs(model) {
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
