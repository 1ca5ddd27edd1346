//! The ZeRO engine: one rank's parameters, gradients and AdamW state, and one training
//! step (several micro-batches) over a [`Model`].
//!
//! Every block's parameters (tied ones excluded: they are views of an earlier block's) are
//! flattened into one contiguous buffer padded to a multiple of the world size; rank r owns
//! slice r of each buffer. AdamW keeps fp32 master weights and both moments for the owned
//! slices only (every stage). Stage 1 also holds full gradients and reduce-scatters them
//! before the update; stage 2 reduce-scatters each block's gradients as soon as backward
//! produces them and keeps only its slice; stage 3 also holds only its slice of the
//! parameters and all-gathers a block's parameters just before the block runs forward, and
//! again for its backward (recomputing the block), releasing them after. After the update,
//! stages 1 and 2 all-gather the new parameters.
//!
//! The loss of a step is the sum of every target token's cross-entropy over every rank and
//! micro-batch, divided by the number of target tokens (labels of -100 carry none), so
//! gradient accumulation over k micro-batches of b equals one batch of kb and the world
//! size never changes the mathematics. Gradients are clipped by their global norm,
//! computed from every rank's shard, as `clip_grad_norm_` defines it.
//!
//! Backward runs block by block from the last: each block's vector-Jacobian product gives
//! the gradient of its flat parameters, of the tied parameters it borrowed (added to their
//! owner's gradient when backward reaches the owner) and of its input, which feeds the
//! block before.

use std::collections::HashMap;
use std::ops::Range;

use regatta_trainer::config::OptimizerConfig;
use regatta_trainer::{FlatLayout, Offload, ZeroConfig, ZeroStage};
use tch::{Device, Kind, Reduction, Tensor};

use crate::collective::{TensorCollective, Timed};
use crate::error::{Error, Result};
use crate::model::{Batch, Init, Model, ParamSpec};

/// The target id that carries no loss.
pub use regatta_trainer::documents::IGNORE;

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// Mean loss over every rank's batch.
    pub loss: f64,
    /// Seconds in collectives.
    pub collective_secs: f64,
    /// Bytes of gradients held at the end of backward.
    pub grad_bytes: u64,
    /// Of `grad_bytes`, in host memory (optimizer offload).
    pub host_grad_bytes: u64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Target tokens the loss averaged over (every rank and micro-batch).
    pub target_tokens: u64,
}

/// Bytes of training state this rank holds, from the tensors themselves: each kind in
/// all, and of that what lies in host memory rather than on the compute device (ZeRO-Offload;
/// on a CPU run the compute device is host memory too, and only offloaded state counts as host).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Parameters kept between steps (trained and frozen).
    pub parameters: u64,
    /// Gradients kept (stage 1 keeps full ones; 2 and 3 keep none between steps).
    pub gradients: u64,
    /// Master weights and both AdamW moments.
    pub optimizer: u64,
    /// Of `parameters`, on the host.
    pub host_parameters: u64,
    /// Of `gradients`, on the host.
    pub host_gradients: u64,
    /// Of `optimizer`, on the host.
    pub host_optimizer: u64,
    /// Of `parameters`, frozen ones (a LoRA run's base).
    pub frozen_parameters: u64,
}

/// A parameter's initial values: a pure function of the seed and the parameter's name
/// (splitmix64 and Box-Muller), so every rank, thread and libtorch build starts the same
/// way without sharing libtorch's global generator.
pub fn initial_values(spec: &ParamSpec, seed: u64) -> Vec<f32> {
    let n = spec.numel();
    let (std, uniform) = match spec.init {
        Init::Zeros => return vec![0.0; n],
        Init::Ones => return vec![1.0; n],
        Init::Normal(std) => (std, false),
        Init::Uniform(bound) => (bound, true),
    };
    let mut state = spec.name.bytes().fold(seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // A uniform in (0, 1]: never 0, so the logarithm below is finite.
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    if uniform {
        return (0..n).map(|_| ((2.0 * next() - 1.0) * std) as f32).collect();
    }
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let (u1, u2) = (next(), next());
        let radius = (-2.0 * u1.ln()).sqrt() * std;
        let angle = std::f64::consts::TAU * u2;
        out.push((radius * angle.cos()) as f32);
        out.push((radius * angle.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// A parameter's initial values from the seed, as a tensor of its shape.
pub fn seeded(spec: &ParamSpec, seed: u64) -> Tensor {
    Tensor::from_slice(&initial_values(spec, seed)).view(spec.shape.as_slice())
}

fn bytes(tensor: &Tensor) -> u64 {
    (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64
}

/// One micro-batch: inputs and targets `[batch, time]` (targets of [`IGNORE`] carry no
/// loss) and, for packed rows, each token's document number.
pub struct MicroBatch {
    /// Input token ids.
    pub tokens: Tensor,
    /// The token each position must predict, or [`IGNORE`].
    pub targets: Tensor,
    /// `Some` for packed rows: attention stays inside a document.
    pub documents: Option<Tensor>,
}

impl MicroBatch {
    fn batch(&self, device: Device) -> Batch {
        match &self.documents {
            Some(documents) => Batch::packed(&documents.to_device(device)),
            None => Batch::plain(&self.tokens.to_device(device)),
        }
    }
}

/// How an engine trains.
#[derive(Clone, Debug)]
pub struct EngineSettings {
    /// ZeRO stage.
    pub stage: ZeroStage,
    /// AdamW, schedule and clipping.
    pub optimizer: OptimizerConfig,
    /// Steps in the run (the schedule decays over them).
    pub steps: u64,
    /// Where compute runs.
    pub device: Device,
    /// The compute type (float32 on CPU, bfloat16 on GPU; master weights stay float32).
    pub compute: Kind,
    /// Recompute blocks in backward (always at stage 3).
    pub activation_checkpointing: bool,
    /// Where optimizer state and parameters live (ZeRO-Offload).
    pub offload: ZeroConfig,
    /// Seeds the dropout masks (LoRA dropout).
    pub seed: u64,
}

/// Where a parameter's storage is inside its block: the trainable buffer or the frozen one,
/// at a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Store {
    Train(usize),
    Frozen(usize),
}

/// Where a tied parameter's storage is: (block, store of the block it lives in).
type Source = (usize, Store);

/// Each spec of a block: stored in this block, or tied to an earlier block's storage.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Own(Store),
    Tied(Source),
}

/// Sum of the cross-entropy of every target token (float32).
pub fn token_loss_sum(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = logits.size()[logits.dim() - 1];
    logits
        .reshape([-1, vocab])
        .to_kind(Kind::Float)
        .cross_entropy_loss::<Tensor>(&targets.reshape([-1]), None, Reduction::Sum, IGNORE, 0.0)
}

/// One block's flat buffers: which tensors they hold and in what shapes.
struct Flat {
    layout: FlatLayout,
    shapes: Vec<Vec<i64>>,
}

impl Flat {
    fn view(&self, slot: usize, flat: &Tensor) -> Tensor {
        let s = &self.layout.tensors[slot];
        flat.narrow(0, s.offset as i64, s.numel as i64)
            .view(self.shapes[slot].as_slice())
    }

    fn is_empty(&self) -> bool {
        self.layout.padded == 0
    }
}

/// The settings of one AdamW update.
#[derive(Clone, Copy, Debug)]
pub struct AdamwStep {
    /// This step's learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay (where `decay` is 1).
    pub weight_decay: f64,
    /// The step's number, from 1 (bias corrections).
    pub step: u64,
}

/// One AdamW update of flat fp32 buffers in place, as `torch.optim.AdamW` computes it
/// (decoupled weight decay on the `decay` ranges only), in nine whole-buffer libtorch
/// kernels (vectorised, on every intra-op thread; no per-tensor loop, no temporaries:
/// `grad` is the scratch buffer). With ZeRO-Offload every buffer is in host memory.
pub fn adamw_update(
    master: &mut Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    decay: &[Range<usize>],
    mut grad: Tensor,
    s: &AdamwStep,
) {
    let t = s.step.min(i32::MAX as u64) as i32;
    let (bc1, bc2) = (1.0 - s.beta1.powi(t), 1.0 - s.beta2.powi(t));
    tch::no_grad(|| {
        if s.weight_decay > 0.0 {
            for range in decay {
                let _ = master
                    .narrow(0, range.start as i64, range.len() as i64)
                    .g_mul_scalar_(1.0 - s.lr * s.weight_decay);
            }
        }
        // m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        let _ = m.lerp_(&grad, 1.0 - s.beta1);
        let _ = grad.g_mul_(&grad.shallow_clone());
        let _ = v.lerp_(&grad, 1.0 - s.beta2);
        // p <- p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        //    = p - (lr sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2))
        let _ = v.sqrt_out(&grad);
        let _ = grad.g_add_scalar_(s.eps * bc2.sqrt());
        let _ = m.div_out(&grad, &grad.shallow_clone());
        let _ = grad.g_mul_scalar_(-s.lr * bc2.sqrt() / bc1);
        let _ = master.g_add_(&grad);
    });
}

/// One rank of a ZeRO group.
pub struct Engine {
    model: Box<dyn Model>,
    specs: Vec<Vec<ParamSpec>>,
    slots: Vec<Vec<Slot>>,
    /// Per block, the trained parameters' buffer layout.
    train: Vec<Flat>,
    /// Per block, the frozen parameters' buffer layout.
    frozen_flat: Vec<Flat>,
    settings: EngineSettings,
    /// Where optimizer state lives: the device, or the host with `offload_optimizer`.
    host: Device,
    coll: Timed,
    step: u64,
    /// Stages 1 and 2: full trained parameters in the compute type, on the device.
    full: Vec<Option<Tensor>>,
    /// Stage 3 with optimizer offload but not parameter offload: this rank's parameter
    /// slice in the compute type, on the device.
    param_shards: Vec<Option<Tensor>>,
    /// Frozen parameters in the compute type: full (stages 1 and 2) or this rank's slice
    /// (stage 3); on the host with `offload_params`.
    frozen: Vec<Tensor>,
    master: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// Where weight decay applies inside each block's shard (matrices, not norms or biases).
    decay: Vec<Vec<Range<usize>>>,
    full_grads: Vec<Option<Tensor>>,
    grad_shards: Vec<Option<Tensor>>,
}

/// A block's parameters as leaves of one backward: the trained buffer, the frozen one and
/// the tied parameters it borrowed.
struct Leaves {
    flat: Tensor,
    frozen: Tensor,
    tied: Vec<(Source, Tensor)>,
}

impl Leaves {
    /// The leaves backward differentiates against (frozen ones excluded).
    fn trained(&self) -> Vec<Tensor> {
        let mut out = Vec::new();
        if self.flat.numel() > 0 {
            out.push(self.flat.shallow_clone());
        }
        out.extend(
            self.tied
                .iter()
                .filter(|((_, store), _)| matches!(store, Store::Train(_)))
                .map(|(_, t)| t.shallow_clone()),
        );
        out
    }
}

fn pinned(tensor: Tensor, device: Device) -> Tensor {
    if device.is_cuda() && tensor.device() == Device::Cpu {
        tensor.pin_memory(device)
    } else {
        tensor
    }
}

impl Engine {
    /// A rank whose weights start as `init` gives them (float32, the spec's shape; called
    /// for every stored parameter in block order, the same on every rank).
    pub fn new(
        model: Box<dyn Model>,
        coll: Box<dyn TensorCollective>,
        settings: EngineSettings,
        init: &mut dyn FnMut(&ParamSpec) -> Result<Tensor>,
    ) -> Result<Self> {
        let specs = model.blocks();
        let (world, rank) = (coll.world(), coll.rank());
        let device = settings.device;
        let host = if settings.offload.offload_optimizer == Offload::Cpu {
            Device::Cpu
        } else {
            device
        };
        let three = settings.stage == ZeroStage::Three;
        let mut where_stored: HashMap<String, Source> = HashMap::new();
        let mut slots = Vec::with_capacity(specs.len());
        let (mut train, mut frozen_flat) = (Vec::new(), Vec::new());
        for (b, block) in specs.iter().enumerate() {
            let mut block_slots = Vec::new();
            let (mut sizes, mut frozen_sizes) = (Vec::new(), Vec::new());
            let (mut shapes, mut frozen_shapes) = (Vec::new(), Vec::new());
            for spec in block {
                match &spec.tied_to {
                    None => {
                        let store = if spec.frozen {
                            frozen_sizes.push((spec.name.clone(), spec.numel()));
                            frozen_shapes.push(spec.shape.clone());
                            Store::Frozen(frozen_sizes.len() - 1)
                        } else {
                            sizes.push((spec.name.clone(), spec.numel()));
                            shapes.push(spec.shape.clone());
                            Store::Train(sizes.len() - 1)
                        };
                        where_stored.insert(spec.name.clone(), (b, store));
                        block_slots.push(Slot::Own(store));
                    }
                    Some(source) => {
                        let found = where_stored.get(source).copied().filter(|(sb, _)| *sb < b);
                        let found = found.ok_or_else(|| {
                            Error::Invalid(format!(
                                "{} is tied to {source}, which no earlier block holds",
                                spec.name
                            ))
                        })?;
                        block_slots.push(Slot::Tied(found));
                    }
                }
            }
            slots.push(block_slots);
            train.push(Flat {
                layout: FlatLayout::new(&sizes, world),
                shapes,
            });
            frozen_flat.push(Flat {
                layout: FlatLayout::new(&frozen_sizes, world),
                shapes: frozen_shapes,
            });
        }
        let mut master = Vec::with_capacity(specs.len());
        let mut decay = Vec::with_capacity(specs.len());
        let mut frozen = Vec::with_capacity(specs.len());
        for (b, block) in specs.iter().enumerate() {
            let (t, f) = (&train[b].layout, &frozen_flat[b].layout);
            let flat = Tensor::zeros([t.padded as i64], (Kind::Float, Device::Cpu));
            let frozen_full = Tensor::zeros([f.padded as i64], (settings.compute, Device::Cpu));
            for (spec, slot) in block.iter().zip(&slots[b]) {
                let Slot::Own(store) = slot else { continue };
                let values = init(spec)?;
                if values.size() != spec.shape {
                    return Err(Error::Invalid(format!(
                        "initial values of {} have shape {:?}, not {:?}",
                        spec.name,
                        values.size(),
                        spec.shape
                    )));
                }
                let (buffer, place) = match store {
                    Store::Train(i) => (&flat, &t.tensors[*i]),
                    Store::Frozen(i) => (&frozen_full, &f.tensors[*i]),
                };
                let region = |t: &Tensor| t.narrow(0, place.offset as i64, place.numel as i64);
                region(buffer).copy_(&values.to_kind(buffer.kind()).view(-1));
            }
            let range = t.shard_range(rank);
            let shard = |x: &Tensor| {
                let part = x.narrow(0, range.start as i64, range.len() as i64).copy();
                pinned(part.to_device(host), device)
            };
            master.push(shard(&flat));
            // The decaying pieces of this rank's shard, adjacent ones joined.
            let decaying: Vec<bool> = block
                .iter()
                .zip(&slots[b])
                .filter(|(_, slot)| matches!(slot, Slot::Own(Store::Train(_))))
                .map(|(spec, _)| spec.decays())
                .collect();
            let mut ranges: Vec<Range<usize>> = Vec::new();
            for piece in t.pieces(rank).into_iter().filter(|p| decaying[p.tensor]) {
                match ranges.last_mut() {
                    Some(last) if last.end == piece.in_shard.start => last.end = piece.in_shard.end,
                    _ => ranges.push(piece.in_shard),
                }
            }
            decay.push(ranges);
            let frozen_home = if settings.offload.offload_params == Offload::Cpu {
                Device::Cpu
            } else {
                device
            };
            frozen.push(if three {
                let range = f.shard_range(rank);
                let part = frozen_full.narrow(0, range.start as i64, range.len() as i64).copy();
                pinned(part.to_device(frozen_home), device)
            } else {
                frozen_full.to_device(device)
            });
        }
        let blocks = specs.len();
        let mut engine = Self {
            model,
            specs,
            slots,
            train,
            frozen_flat,
            settings,
            host,
            coll: Timed::new(coll),
            step: 0,
            full: (0..blocks).map(|_| None).collect(),
            param_shards: (0..blocks).map(|_| None).collect(),
            frozen,
            exp_avg: master.iter().map(|m| pinned(m.zeros_like(), device)).collect(),
            exp_avg_sq: master.iter().map(|m| pinned(m.zeros_like(), device)).collect(),
            master,
            decay,
            full_grads: (0..blocks).map(|_| None).collect(),
            grad_shards: (0..blocks).map(|_| None).collect(),
        };
        engine.refresh_params()?;
        Ok(engine)
    }

    /// Steps done.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Real (unpadded) parameters of the model, trained and frozen.
    pub fn parameter_count(&self) -> u64 {
        self.train
            .iter()
            .chain(&self.frozen_flat)
            .map(|f| f.layout.numel as u64)
            .sum()
    }

    /// Real parameters that train (a LoRA run: the adapters).
    pub fn trained_parameter_count(&self) -> u64 {
        self.train.iter().map(|f| f.layout.numel as u64).sum()
    }

    /// The model.
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// Blocks, with their parameter specs.
    pub fn specs(&self) -> &[Vec<ParamSpec>] {
        &self.specs
    }

    fn three(&self) -> bool {
        self.settings.stage == ZeroStage::Three
    }

    fn offload_params(&self) -> bool {
        self.settings.offload.offload_params == Offload::Cpu
    }

    /// After an update: stages 1 and 2 rebuild full parameters from every rank's master
    /// slice; stage 3 with the optimizer on the host copies its slice to the device
    /// (unless parameters are offloaded too).
    fn refresh_params(&mut self) -> Result<()> {
        let (device, compute) = (self.settings.device, self.settings.compute);
        for block in 0..self.master.len() {
            if self.train[block].is_empty() {
                continue;
            }
            if !self.three() {
                let full = self.coll.all_gather(&self.master[block].to_device(device))?;
                self.full[block] = Some(full.to_kind(compute));
            } else if self.settings.offload.offload_optimizer == Offload::Cpu && !self.offload_params() {
                self.param_shards[block] = Some(self.master[block].to_device(device).to_kind(compute));
            }
        }
        Ok(())
    }

    /// A block's full flat trained parameters in the compute type, on the device.
    fn block_params(&mut self, block: usize) -> Result<Tensor> {
        let (device, compute) = (self.settings.device, self.settings.compute);
        if self.train[block].is_empty() {
            return Ok(Tensor::zeros([0], (compute, device)));
        }
        if let Some(full) = &self.full[block] {
            return Ok(full.shallow_clone());
        }
        let shard = match &self.param_shards[block] {
            Some(shard) => shard.to_kind(Kind::Float),
            None => self.master[block].to_device(device),
        };
        Ok(self.coll.all_gather(&shard)?.to_kind(compute))
    }

    /// A block's full flat frozen parameters in the compute type, on the device.
    fn frozen_params(&mut self, block: usize) -> Result<Tensor> {
        let (device, compute) = (self.settings.device, self.settings.compute);
        if !self.three() || self.frozen_flat[block].is_empty() {
            return Ok(self.frozen[block].shallow_clone());
        }
        let shard = self.frozen[block].to_device(device).to_kind(Kind::Float);
        Ok(self.coll.all_gather(&shard)?.to_kind(compute))
    }

    fn store_view(&self, block: usize, store: Store, trained: &Tensor, frozen: &Tensor) -> Tensor {
        match store {
            Store::Train(slot) => self.train[block].view(slot, trained),
            Store::Frozen(slot) => self.frozen_flat[block].view(slot, frozen),
        }
    }

    /// The block's parameters as leaves (`grad`: whether trained ones require gradients).
    fn leaves(&mut self, block: usize, grad: bool) -> Result<Leaves> {
        let flat = self.block_params(block)?.detach().set_requires_grad(grad);
        let frozen = self.frozen_params(block)?;
        let mut tied = Vec::new();
        let sources: Vec<Source> = self.slots[block]
            .iter()
            .filter_map(|s| match s {
                Slot::Tied(source) => Some(*source),
                Slot::Own(_) => None,
            })
            .collect();
        for (source_block, store) in sources {
            let view = match store {
                Store::Train(slot) => {
                    let source_flat = self.block_params(source_block)?;
                    self.train[source_block]
                        .view(slot, &source_flat)
                        .detach()
                        .set_requires_grad(grad)
                }
                Store::Frozen(slot) => {
                    let source_flat = self.frozen_params(source_block)?;
                    self.frozen_flat[source_block].view(slot, &source_flat)
                }
            };
            tied.push(((source_block, store), view));
        }
        Ok(Leaves { flat, frozen, tied })
    }

    fn views(&self, block: usize, leaves: &Leaves) -> Vec<Tensor> {
        let mut tied = leaves.tied.iter();
        self.slots[block]
            .iter()
            .map(|s| match s {
                Slot::Own(store) => self.store_view(block, *store, &leaves.flat, &leaves.frozen),
                Slot::Tied(_) => tied
                    .next()
                    .map(|(_, t)| t.shallow_clone())
                    .expect("leaves hold one tensor per tied parameter"),
            })
            .collect()
    }

    /// One optimizer step over this rank's micro-batches (a collective: every rank calls it
    /// with the same number of micro-batches).
    pub fn train_step(&mut self, micro: &[MicroBatch]) -> Result<StepOutcome> {
        let local_targets: i64 = micro
            .iter()
            .map(|m| m.targets.ne(IGNORE).sum(Kind::Int64).int64_value(&[]))
            .sum();
        let count = self.sum_over_ranks(local_targets as f64)?.round();
        if count < 1.0 {
            return Err(Error::Invalid(
                "no target token in this step's batch on any rank (every label is -100)".into(),
            ));
        }
        let mut local_loss = 0.0;
        let mut grad_bytes = (0, 0);
        for (k, m) in micro.iter().enumerate() {
            // Dropout masks: a function of the run's seed, the step and the micro-batch, so a
            // resumed run draws what an uninterrupted one would.
            let salt = (self.step << 16 | k as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
            let (loss, held) = self.accumulate(m, count, self.settings.seed ^ salt)?;
            local_loss += loss;
            grad_bytes = held;
        }
        let loss = self.sum_over_ranks(local_loss)? / count;
        let grad_norm = self.apply_adamw()?;
        Ok(StepOutcome {
            loss,
            collective_secs: self.coll.take_spent().as_secs_f64(),
            grad_bytes: grad_bytes.0,
            host_grad_bytes: grad_bytes.1,
            grad_norm,
            target_tokens: count as u64,
        })
    }

    /// Forward and backward of one micro-batch, adding the gradients of its loss sum
    /// divided by `count` to the held ones. Returns its loss sum and the gradient bytes
    /// held (all, and of those on the host).
    fn accumulate(&mut self, m: &MicroBatch, count: f64, dropout_seed: u64) -> Result<(f64, (u64, u64))> {
        let blocks = self.specs.len();
        let recompute = self.three() || self.settings.activation_checkpointing;
        let device = self.settings.device;
        let tokens = m.tokens.to_device(device);
        let targets = m.targets.to_device(device);
        let mut batch = m.batch(device);
        batch.dropout_seed = Some(dropout_seed);
        self.model.prepare(&mut batch);
        // Forward: keep each block's input (recompute) or its whole graph.
        let mut inputs = Vec::with_capacity(blocks);
        let mut saved = Vec::with_capacity(blocks);
        let mut hidden = tokens.shallow_clone();
        for block in 0..blocks {
            if recompute {
                inputs.push(hidden.shallow_clone());
                if block + 1 < blocks {
                    let leaves = self.leaves(block, false)?;
                    let views = self.views(block, &leaves);
                    hidden = tch::no_grad(|| self.model.forward(block, &views, &hidden, &batch));
                }
            } else {
                let leaves = self.leaves(block, true)?;
                let input = if block == 0 {
                    hidden.shallow_clone()
                } else {
                    hidden.detach().set_requires_grad(true)
                };
                let out = self.model.forward(block, &self.views(block, &leaves), &input, &batch);
                hidden = out.shallow_clone();
                saved.push((leaves, (block > 0).then_some(input), out));
            }
        }
        // Backward, block by block from the last.
        let mut grad_out: Option<Tensor> = None;
        let mut pending: HashMap<Source, Tensor> = HashMap::new();
        let mut loss_sum = 0.0;
        let mut held = (0, 0);
        for block in (0..blocks).rev() {
            let trains = !self.train[block].is_empty()
                || self.slots[block]
                    .iter()
                    .any(|s| matches!(s, Slot::Tied((_, Store::Train(_)))));
            // A frozen first block needs no backward at all (nothing before it).
            if block == 0 && !trains {
                break;
            }
            let (leaves, input, out) = if recompute {
                let leaves = self.leaves(block, true)?;
                let input = (block > 0).then(|| inputs[block].detach().set_requires_grad(true));
                let x = input.as_ref().unwrap_or(&inputs[0]);
                let out = self.model.forward(block, &self.views(block, &leaves), x, &batch);
                (leaves, input, out)
            } else {
                saved
                    .pop()
                    .ok_or_else(|| Error::Invalid("backward ran past the saved blocks".into()))?
            };
            let target = if block + 1 == blocks {
                let sum = token_loss_sum(&out, &targets);
                loss_sum = sum.double_value(&[]);
                sum / count
            } else {
                let upstream = grad_out
                    .take()
                    .ok_or_else(|| Error::Invalid("a block's output gradient is missing".into()))?;
                (&out * upstream).sum(Kind::Float)
            };
            let mut wrt = leaves.trained();
            let trained = wrt.len();
            wrt.extend(input.iter().map(Tensor::shallow_clone));
            let grads = Tensor::f_run_backward(&[&target], &wrt, false, false)?;
            let own = usize::from(leaves.flat.numel() > 0);
            let grad = if own == 1 {
                grads[0].to_kind(Kind::Float)
            } else {
                Tensor::zeros([0], (Kind::Float, device))
            };
            let tied_trained = leaves
                .tied
                .iter()
                .filter(|((_, store), _)| matches!(store, Store::Train(_)));
            for (i, (source, _)) in tied_trained.enumerate() {
                let g = grads[own + i].to_kind(Kind::Float);
                let sum = match pending.remove(source) {
                    Some(earlier) => earlier + g,
                    None => g,
                };
                pending.insert(*source, sum);
            }
            let here: Vec<Source> = pending.keys().filter(|(b, _)| *b == block).copied().collect();
            for source in here {
                if let (Some(g), Store::Train(slot)) = (pending.remove(&source), source.1) {
                    let mut region = self.train[block].view(slot, &grad);
                    let _ = tch::no_grad(|| region.g_add_(&g));
                }
            }
            grad_out = grads.get(trained).map(Tensor::shallow_clone);
            if !self.train[block].is_empty() {
                let (bytes, on_host) = self.hold_gradient(block, grad)?;
                held.0 += bytes;
                held.1 += on_host;
            }
        }
        Ok((loss_sum, held))
    }

    /// Adds a block's gradient to the held ones (stage 1: full, on the device; 2 and 3:
    /// this rank's reduced slice, moved to the host with optimizer offload). Returns the
    /// bytes held for the block, and of those on the host.
    fn hold_gradient(&mut self, block: usize, grad: Tensor) -> Result<(u64, u64)> {
        let (slot, grad) = if self.settings.stage == ZeroStage::One {
            (&mut self.full_grads[block], grad)
        } else {
            let shard = self.coll.reduce_scatter(&grad)?.to_device(self.host);
            (&mut self.grad_shards[block], shard)
        };
        let total = match slot.take() {
            Some(mut held) => {
                let _ = tch::no_grad(|| held.g_add_(&grad));
                held
            }
            None => grad,
        };
        let held = bytes(&total);
        let offloaded =
            self.settings.offload.offload_optimizer == Offload::Cpu && self.settings.stage != ZeroStage::One;
        let on_host = if offloaded { held } else { 0 };
        *slot = Some(total);
        Ok((held, on_host))
    }

    /// Clips by the global norm and updates the master slices in place (AdamW as
    /// `torch.optim.AdamW` computes it, over each block's flat buffer: vectorised libtorch
    /// kernels on the host with offload); returns the norm before clipping.
    fn apply_adamw(&mut self) -> Result<f64> {
        self.step += 1;
        let o = self.settings.optimizer.clone();
        let lr = o.lr_at(self.step, self.settings.steps);
        let mut shards = Vec::with_capacity(self.master.len());
        for block in 0..self.master.len() {
            if self.train[block].is_empty() {
                shards.push(None);
                continue;
            }
            let missing = || Error::Invalid(format!("no gradient for block {block}"));
            let grad = match self.settings.stage {
                ZeroStage::One => {
                    let full = self.full_grads[block].take().ok_or_else(missing)?;
                    self.coll.reduce_scatter(&full)?.to_device(self.host)
                }
                _ => self.grad_shards[block].take().ok_or_else(missing)?,
            };
            shards.push(Some(grad));
        }
        let local: f64 = shards
            .iter()
            .flatten()
            .map(|g| g.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]))
            .sum();
        let norm = self.sum_over_ranks(local)?.sqrt();
        let clip = if o.max_grad_norm > 0.0 {
            (o.max_grad_norm / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        let hyper = AdamwStep {
            lr,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
            step: self.step,
        };
        for (block, grad) in shards.into_iter().enumerate() {
            let Some(mut grad) = grad else { continue };
            if clip < 1.0 {
                let _ = tch::no_grad(|| grad.g_mul_scalar_(clip));
            }
            adamw_update(
                &mut self.master[block],
                &mut self.exp_avg[block],
                &mut self.exp_avg_sq[block],
                &self.decay[block],
                grad,
                &hyper,
            );
        }
        self.refresh_params()?;
        Ok(norm)
    }

    /// Bytes of state held now, by kind and where the configuration places it (on a CPU
    /// run the offloaded state counts as host although the device is host memory too).
    pub fn held(&self) -> Held {
        let sum = |tensors: &mut dyn Iterator<Item = &Tensor>| tensors.map(bytes).sum::<u64>();
        let offload_optimizer = self.settings.offload.offload_optimizer == Offload::Cpu;
        let optimizer = sum(&mut self.master.iter().chain(&self.exp_avg).chain(&self.exp_avg_sq));
        let trained = if self.three() {
            if self.offload_params() || !offload_optimizer {
                // The master slice is the parameter slice (on the host when offloaded).
                sum(&mut self.master.iter())
            } else {
                sum(&mut self.param_shards.iter().flatten())
            }
        } else {
            sum(&mut self.full.iter().flatten())
        };
        let frozen = sum(&mut self.frozen.iter());
        let full_grads = sum(&mut self.full_grads.iter().flatten());
        let grad_shards = sum(&mut self.grad_shards.iter().flatten());
        let on_host = |offloaded: bool, bytes: u64| if offloaded { bytes } else { 0 };
        Held {
            parameters: trained + frozen,
            gradients: full_grads + grad_shards,
            optimizer,
            host_parameters: on_host(self.offload_params(), trained + frozen),
            host_gradients: on_host(offload_optimizer, grad_shards),
            host_optimizer: on_host(offload_optimizer, optimizer),
            frozen_parameters: frozen,
        }
    }

    /// This rank's optimizer state (master slice and moments per block with trained
    /// parameters), on the CPU.
    pub fn optimizer_state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for block in 0..self.master.len() {
            if self.train[block].is_empty() {
                continue;
            }
            for (name, tensor) in [
                ("master", &self.master[block]),
                ("exp_avg", &self.exp_avg[block]),
                ("exp_avg_sq", &self.exp_avg_sq[block]),
            ] {
                out.push((format!("block{block}.{name}"), tensor.to_device(Device::Cpu)));
            }
        }
        out
    }

    /// Restores state written by [`Engine::optimizer_state`] at `step` (a collective: every
    /// rank calls it).
    pub fn load_optimizer_state(&mut self, tensors: Vec<(String, Tensor)>, step: u64) -> Result<()> {
        let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
        let (host, device) = (self.host, self.settings.device);
        for block in 0..self.master.len() {
            if self.train[block].is_empty() {
                continue;
            }
            let expected = self.train[block].layout.shard_len() as i64;
            let mut take = |name: &str| {
                let key = format!("block{block}.{name}");
                let tensor = by_name
                    .remove(&key)
                    .ok_or_else(|| Error::Invalid(format!("the checkpoint has no {key}")))?;
                if tensor.size() != [expected] {
                    return Err(Error::Invalid(format!(
                        "{key} has shape {:?}, this model and world size need [{expected}]",
                        tensor.size()
                    )));
                }
                Ok(pinned(tensor.to_kind(Kind::Float).to_device(host), device))
            };
            let (master, m, v) = (take("master")?, take("exp_avg")?, take("exp_avg_sq")?);
            self.master[block] = master;
            self.exp_avg[block] = m;
            self.exp_avg_sq[block] = v;
        }
        if let Some(extra) = by_name.keys().next() {
            return Err(Error::Invalid(format!(
                "the checkpoint holds {extra}, which this model's trained parameters do not have (was it written with other [lora] settings?)"
            )));
        }
        self.step = step;
        self.refresh_params()
    }

    /// One block's trained parameters by name, fp32 on the CPU (a collective: every rank
    /// calls it; only this block is gathered).
    pub fn gather_block(&mut self, block: usize) -> Result<Vec<(String, Tensor)>> {
        if self.train[block].is_empty() {
            return Ok(Vec::new());
        }
        let shard = self.master[block].to_device(self.settings.device);
        let full = self.coll.all_gather(&shard)?.to_device(Device::Cpu);
        let flat = &self.train[block];
        Ok(flat
            .layout
            .tensors
            .iter()
            .enumerate()
            .map(|(slot, place)| (place.name.clone(), flat.view(slot, &full).copy()))
            .collect())
    }

    /// One block's base parameters with the adapters merged in (each targeted weight plus
    /// `scale * B A`), float32 on the CPU, by the base's names (a collective). For a model
    /// without adapters, the block's parameters.
    pub fn merged_block(&mut self, block: usize) -> Result<Vec<(String, Tensor)>> {
        let trained: HashMap<String, Tensor> = self.gather_block(block)?.into_iter().collect();
        let scale = self.model.lora().map_or(0.0, |l| l.scale());
        let full = self.frozen_params(block)?.to_device(Device::Cpu).to_kind(Kind::Float);
        let flat = &self.frozen_flat[block];
        let mut out: Vec<(String, Tensor)> = Vec::new();
        for spec in self.specs[block].iter().filter(|s| s.tied_to.is_none()) {
            if let Some(t) = trained
                .get(&spec.name)
                .filter(|_| !regatta_trainer::lora::is_adapter(&spec.name))
            {
                out.push((spec.name.clone(), t.shallow_clone()));
                continue;
            }
            let Some(slot) = flat.layout.tensors.iter().position(|t| t.name == spec.name) else {
                continue;
            };
            let weight = flat.view(slot, &full).copy();
            out.push((
                spec.name.clone(),
                crate::lora::merged_weight(&spec.name, weight, &trained, scale),
            ));
        }
        Ok(out)
    }

    /// Every trained parameter by name with its real shape, fp32 on the CPU (a collective;
    /// the whole model at once: for tests and small models).
    pub fn consolidated(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for block in 0..self.specs.len() {
            out.extend(self.gather_block(block)?);
        }
        Ok(out)
    }

    /// Every frozen parameter by name, in the compute type on the CPU (a collective).
    pub fn frozen_consolidated(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for block in 0..self.specs.len() {
            let full = self.frozen_params(block)?.to_device(Device::Cpu);
            let flat = &self.frozen_flat[block];
            out.extend(
                flat.layout
                    .tensors
                    .iter()
                    .enumerate()
                    .map(|(slot, place)| (place.name.clone(), flat.view(slot, &full).copy())),
            );
        }
        Ok(out)
    }

    /// Real elements of each block's trained flat buffer (0: nothing trains in it), the
    /// layout a checkpoint's optimizer slices cut.
    pub fn trained_numels(&self) -> Vec<usize> {
        self.train
            .iter()
            .map(|f| if f.is_empty() { 0 } else { f.layout.numel })
            .collect()
    }

    /// Waits for every rank.
    pub fn barrier(&mut self) -> Result<()> {
        self.coll.barrier()
    }

    /// Sums a scalar over ranks.
    pub fn sum_over_ranks(&mut self, value: f64) -> Result<f64> {
        let t = Tensor::from_slice(&[value as f32]).to_device(self.settings.device);
        Ok(self.coll.all_reduce(&t)?.double_value(&[0]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_values_are_deterministic_and_scaled() {
        let spec = ParamSpec {
            name: "h.0.mlp.c_fc.weight".into(),
            shape: vec![100, 100],
            init: Init::Normal(0.02),
            tied_to: None,
            frozen: false,
        };
        let a = initial_values(&spec, 7);
        assert_eq!(a, initial_values(&spec, 7));
        assert_ne!(a, initial_values(&spec, 8));
        let mean = a.iter().map(|v| f64::from(*v)).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|v| (f64::from(*v) - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(
            mean.abs() < 0.002 && (var.sqrt() - 0.02).abs() < 0.002,
            "mean {mean} std {}",
            var.sqrt()
        );
    }
}
