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
//!
//! Its parts: where parameters are stored and how a rank's state starts (`storage`),
//! initial values from the seed (`init`), the loss and its gradient (`loss`), a training
//! step (`step`), AdamW (`adamw`), and what an engine holds and hands out (`state`).

mod adamw;
mod init;
mod loss;
mod quantized;
mod state;
mod step;
mod storage;

pub use adamw::{adamw_update, AdamwStep};
pub use init::seeded;
pub use loss::{token_loss_and_grad, token_loss_sum, token_loss_sum_chunked};

use std::collections::HashMap;
use std::ops::Range;

use regatta_trainer::OptimizerConfig;
use regatta_trainer::{Offload, ZeroConfig, ZeroStage};
use tch::{Device, Kind, Tensor};

use crate::attention::Kernel;
use crate::collective::{Pending, TensorCollective, Timed};
use crate::error::{Error, Result};
use crate::model::{Batch, Model, ParamSpec};
use quantized::QuantShard;
use storage::{Flat, Initial, Layout, Slot, Source, Store};

/// The target id that carries no loss.
pub(crate) use regatta_trainer::IGNORE_INDEX;

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

fn bytes(tensor: &Tensor) -> u64 {
    (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64
}

/// One micro-batch: inputs and targets `[batch, time]` (targets of [`IGNORE_INDEX`] carry no
/// loss) and, for packed rows, each token's document number.
pub struct MicroBatch {
    /// Input token ids.
    pub tokens: Tensor,
    /// The token each position must predict, or [`IGNORE_INDEX`].
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
    /// Gradient slices on their way to host memory (optimizer offload on a GPU): copied
    /// without blocking, added to `grad_shards` after the micro-batch's one sync.
    arriving: Vec<(usize, Tensor)>,
    /// Stage 3 over a backend whose collectives overlap compute: the gathers started for
    /// the block that runs next (trained, frozen), taken when it runs.
    prefetched: Vec<(Option<Pending>, Option<Pending>)>,
    /// ZeRO-3's slices of a QLoRA base, by block.
    quant_shards: Vec<Option<QuantShard>>,
    /// The block whose quantized weights are gathered now.
    installed: Option<usize>,
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

/// `tensor` on `device`, copied without blocking the host where a GPU is at either end
/// (into pinned memory when the copy goes to the host: libtorch pins a non-blocking
/// device-to-host copy's output). A host copy must be read only after a sync
/// ([`Engine::host_sync`]); a host source must not change until the device has read it.
fn moved(tensor: &Tensor, device: Device) -> Tensor {
    if tensor.device() == device {
        tensor.shallow_clone()
    } else if device.is_cuda() || tensor.device().is_cuda() {
        tensor.to_device_(device, tensor.kind(), true, false)
    } else {
        tensor.to_device(device)
    }
}

impl Engine {
    /// A rank whose weights start as `init` gives them (float32, the spec's shape; called
    /// for every stored parameter in block order, the same on every rank).
    pub fn new(
        mut model: Box<dyn Model>,
        coll: Box<dyn TensorCollective>,
        settings: EngineSettings,
        init: &mut dyn FnMut(&ParamSpec) -> Result<Tensor>,
    ) -> Result<Self> {
        let specs = model.blocks();
        let (world, rank) = (coll.world(), coll.rank());
        // A QLoRA base: each projection weight read, quantized and held by the model, one
        // at a time (the float weight is dropped before the next is read); at ZeRO-3 each
        // block's are then packed and sliced, so a rank holds its share of the base.
        let slice = settings.stage == ZeroStage::Three && world > 1;
        let mut quant_shards = Vec::with_capacity(specs.len());
        for block in 0..specs.len() {
            for spec in model.quantized_block(block) {
                if model.holds_quantized(&spec.name) {
                    // Taken as a folder stored it (executor::take_stored_quantized).
                    continue;
                }
                let weight = init(&spec)?;
                model.set_quantized(&spec, &weight, settings.device)?;
            }
            quant_shards.push(if slice {
                QuantShard::of_block(model.as_mut(), block, world, rank)
            } else {
                None
            });
        }
        let device = settings.device;
        let host = if settings.offload.offload_optimizer == Offload::Cpu {
            Device::Cpu
        } else {
            device
        };
        let layout = Layout::plan(&specs, world)?;
        let Initial { master, decay, frozen } = Initial::new(&specs, &layout, &settings, rank, host, init)?;
        let Layout {
            slots,
            train,
            frozen_flat,
        } = layout;
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
            arriving: Vec::new(),
            prefetched: (0..blocks).map(|_| (None, None)).collect(),
            quant_shards,
            installed: None,
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
        let quantized: u64 = self.model.quantized_specs().iter().map(|s| s.numel() as u64).sum();
        self.train
            .iter()
            .chain(&self.frozen_flat)
            .map(|f| f.layout.numel as u64)
            .sum::<u64>()
            + quantized
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
        // Gathers started before the update hold the old values.
        for pair in &mut self.prefetched {
            *pair = (None, None);
        }
        let (device, compute) = (self.settings.device, self.settings.compute);
        for block in 0..self.master.len() {
            if self.train[block].is_empty() {
                continue;
            }
            if !self.three() {
                let full = self.coll.all_gather(&moved(&self.master[block], device))?;
                self.full[block] = Some(full.to_kind(compute));
            } else if self.settings.offload.offload_optimizer == Offload::Cpu && !self.offload_params() {
                self.param_shards[block] = Some(moved(&self.master[block], device).to_kind(compute));
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
        if let Some(pending) = self.prefetched[block].0.take() {
            return pending.wait();
        }
        let shard = self.trained_shard(block);
        self.coll.all_gather(&shard)
    }

    /// This rank's slice of a block's trained parameters in the compute type, on the
    /// device (stage 3). Gathered in the compute type: a bf16 gather moves half the bytes
    /// of an f32 one, and rounding each element before or after the gather is the same.
    fn trained_shard(&self, block: usize) -> Tensor {
        let (device, compute) = (self.settings.device, self.settings.compute);
        match &self.param_shards[block] {
            Some(shard) => shard.to_kind(compute),
            None => moved(&self.master[block], device).to_kind(compute),
        }
    }

    /// Stage 3 over collectives that overlap compute: starts gathering `block`'s
    /// parameters now, so they arrive while the block before it computes. Every rank
    /// prefetches the same blocks in the same order (collectives must match).
    fn prefetch(&mut self, block: usize) -> Result<()> {
        if !self.three() || !self.coll.overlaps() || block >= self.specs.len() {
            return Ok(());
        }
        let (device, compute) = (self.settings.device, self.settings.compute);
        if self.prefetched[block].0.is_none() && !self.train[block].is_empty() {
            let shard = self.trained_shard(block);
            self.prefetched[block].0 = Some(self.coll.all_gather_start(&shard)?);
        }
        if self.prefetched[block].1.is_none() && !self.frozen_flat[block].is_empty() {
            let shard = moved(&self.frozen[block], device).to_kind(compute);
            self.prefetched[block].1 = Some(self.coll.all_gather_start(&shard)?);
        }
        Ok(())
    }

    /// A block's full flat frozen parameters in the compute type, on the device.
    fn frozen_params(&mut self, block: usize) -> Result<Tensor> {
        let (device, compute) = (self.settings.device, self.settings.compute);
        if !self.three() || self.frozen_flat[block].is_empty() {
            return Ok(self.frozen[block].shallow_clone());
        }
        if let Some(pending) = self.prefetched[block].1.take() {
            return pending.wait();
        }
        let shard = moved(&self.frozen[block], device).to_kind(compute);
        self.coll.all_gather(&shard)
    }

    /// The block's parameters as leaves (`grad`: whether trained ones require gradients).
    fn leaves(&mut self, block: usize, grad: bool) -> Result<Leaves> {
        self.install_quantized(block)?;
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
