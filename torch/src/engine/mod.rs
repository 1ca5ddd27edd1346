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

mod adamw;
mod state;
mod step;

pub use adamw::{adamw_update, AdamwStep};

use std::collections::HashMap;
use std::ops::Range;

use regatta_trainer::config::OptimizerConfig;
use regatta_trainer::{FlatLayout, Offload, ZeroConfig, ZeroStage};
use tch::{Device, Kind, Reduction, Tensor};

use crate::attention::Kernel;
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
    /// The batch on `device`; packed rows carry the dense mask only where `kernel` needs it.
    fn batch(&self, device: Device, kernel: Kernel) -> Batch {
        match &self.documents {
            Some(documents) => Batch::packed(documents, kernel == Kernel::DenseMask).to_device(device),
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

/// [`token_loss_sum`] a chunk of rows at a time (as [`token_loss_and_grad`] chunks them),
/// without gradients: a float64 scalar on the logits' device.
pub fn token_loss_sum_chunked(logits: &Tensor, targets: &Tensor) -> Tensor {
    tch::no_grad(|| {
        let vocab = logits.size()[logits.dim() - 1];
        let flat = logits.reshape([-1, vocab]);
        let targets = targets.reshape([-1]).to_device(flat.device());
        let (rows, chunk_rows) = (flat.size()[0], (LOSS_CHUNK_ELEMENTS / vocab.max(1)).max(1));
        let mut loss = Tensor::zeros([], (Kind::Double, flat.device()));
        let mut start = 0;
        while start < rows {
            let len = chunk_rows.min(rows - start);
            loss += token_loss_sum(&flat.narrow(0, start, len), &targets.narrow(0, start, len)).to_kind(Kind::Double);
            start += len;
        }
        loss
    })
}

/// Elements of f32 logits the loss works on at once (64 MiB): the loss never holds an f32
/// copy of the whole `[batch, time, vocab]` logits, which at bf16 compute would be twice
/// the logits' own size again.
const LOSS_CHUNK_ELEMENTS: i64 = 1 << 24;

/// The sum of the cross-entropy of every target token, and the gradient of that sum times
/// `scale` with respect to `logits` (in the logits' dtype), computed a chunk of rows at a time in f32
/// and without autograd: softmax minus the one-hot target, zero on [`IGNORE`] rows. Equal to
/// autograd through [`token_loss_sum`]; the engine's last block takes the gradient as its
/// upstream. The loss stays a float64 scalar tensor on the logits' device (no host sync).
pub fn token_loss_and_grad(logits: &Tensor, targets: &Tensor, scale: f64) -> (Tensor, Tensor) {
    let vocab = logits.size()[logits.dim() - 1];
    chunked_loss_and_grad(logits, targets, scale, (LOSS_CHUNK_ELEMENTS / vocab.max(1)).max(1))
}

fn chunked_loss_and_grad(logits: &Tensor, targets: &Tensor, scale: f64, chunk_rows: i64) -> (Tensor, Tensor) {
    tch::no_grad(|| {
        let vocab = logits.size()[logits.dim() - 1];
        let flat = logits.reshape([-1, vocab]);
        let targets = targets.reshape([-1]).to_device(flat.device());
        let rows = flat.size()[0];
        let grad = flat.empty_like();
        let mut loss = Tensor::zeros([], (Kind::Double, flat.device()));
        // f32 at least (bf16 logits are widened a chunk at a time), f64 kept as f64.
        let exact = if flat.kind() == Kind::Double {
            Kind::Double
        } else {
            Kind::Float
        };
        let mut start = 0;
        while start < rows {
            let len = chunk_rows.min(rows - start);
            let chunk = flat.narrow(0, start, len).to_kind(exact);
            let target = targets.narrow(0, start, len);
            let valid = target.ne(IGNORE);
            let safe = target.where_scalarother(&valid, 0).unsqueeze(1);
            let log_probs = chunk.log_softmax(-1, exact);
            let picked = log_probs.gather(1, &safe, false).squeeze_dim(1);
            loss += (-picked * valid.to_kind(exact)).sum(Kind::Double);
            let mut probs = log_probs.exp();
            let _ = probs.scatter_add_(1, &safe, &Tensor::full([len, 1], -1.0, (exact, flat.device())));
            let chunk_grad = probs * valid.to_kind(exact).unsqueeze(1) * scale;
            grad.narrow(0, start, len).copy_(&chunk_grad.to_kind(grad.kind()));
            start += len;
        }
        (loss, grad.view(logits.size().as_slice()))
    })
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
    /// One leaf per trained parameter of the block, by slot: views of the block's flat
    /// buffer, each its own autograd leaf, so backward gives each its own gradient instead
    /// of a full-size zero buffer per view (autograd's `narrow` backward) summed into one.
    own: Vec<Tensor>,
    frozen: Tensor,
    tied: Vec<(Source, Tensor)>,
}

impl Leaves {
    /// The leaves backward differentiates against (frozen ones excluded): the block's own
    /// trained parameters in slot order, then its trained tied ones.
    fn trained(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = self.own.iter().map(Tensor::shallow_clone).collect();
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
        // Gathered in the compute type: a bf16 gather moves half the bytes of an f32 one,
        // and rounding each element before or after the gather gives the same values.
        let shard = match &self.param_shards[block] {
            Some(shard) => shard.to_kind(compute),
            None => self.master[block].to_device(device).to_kind(compute),
        };
        self.coll.all_gather(&shard)
    }

    /// A block's full flat frozen parameters in the compute type, on the device.
    fn frozen_params(&mut self, block: usize) -> Result<Tensor> {
        let (device, compute) = (self.settings.device, self.settings.compute);
        if !self.three() || self.frozen_flat[block].is_empty() {
            return Ok(self.frozen[block].shallow_clone());
        }
        let shard = self.frozen[block].to_device(device).to_kind(compute);
        self.coll.all_gather(&shard)
    }

    /// The block's parameters as leaves (`grad`: whether trained ones require gradients).
    fn leaves(&mut self, block: usize, grad: bool) -> Result<Leaves> {
        let flat = self.block_params(block)?.detach();
        let own = (0..self.train[block].layout.tensors.len())
            .map(|slot| self.train[block].view(slot, &flat).detach().set_requires_grad(grad))
            .collect();
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
        Ok(Leaves { own, frozen, tied })
    }

    fn views(&self, block: usize, leaves: &Leaves) -> Vec<Tensor> {
        let mut tied = leaves.tied.iter();
        self.slots[block]
            .iter()
            .map(|s| match s {
                Slot::Own(Store::Train(slot)) => leaves.own[*slot].shallow_clone(),
                Slot::Own(Store::Frozen(slot)) => self.frozen_flat[block].view(*slot, &leaves.frozen),
                Slot::Tied(_) => tied
                    .next()
                    .map(|(_, t)| t.shallow_clone())
                    .expect("leaves hold one tensor per tied parameter"),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunked_loss_and_its_gradient_equal_autograd_through_the_whole_loss() {
        tch::manual_seed(5);
        let logits = Tensor::randn([3, 7, 11], (Kind::Double, Device::Cpu));
        let targets = Tensor::randint(11, [3, 7], (Kind::Int64, Device::Cpu));
        let _ = targets.get(1).get(2).fill_(IGNORE);
        let _ = targets.get(2).get(6).fill_(IGNORE);
        let leaf = logits.detach().set_requires_grad(true);
        let scale = 1.0 / 19.0;
        let sum = token_loss_sum(&leaf, &targets);
        let want = Tensor::run_backward(&[&(&sum * scale)], &[&leaf], false, false).remove(0);
        // Chunks of 4 rows over 21 (the last one short), and one chunk for all.
        for rows in [4, 1000] {
            let (loss, grad) = chunked_loss_and_grad(&logits, &targets, scale, rows);
            let loss = loss.double_value(&[]);
            // token_loss_sum computes in f32, this one in f64 for f64 logits.
            let want_loss = sum.double_value(&[]);
            assert!(
                (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
                "{rows}: loss {loss} vs {want_loss}"
            );
            assert_eq!(grad.size(), logits.size());
            let diff = (&grad.to_kind(Kind::Double) - &want).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "{rows}: gradient differs by {diff}");
        }
        // An ignored row's gradient is zero.
        let (_, grad) = chunked_loss_and_grad(&logits, &targets, scale, 4);
        assert_eq!(grad.get(1).get(2).abs().sum(Kind::Double).double_value(&[]), 0.0);
    }

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
