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

use regatta_trainer::config::OptimizerConfig;
use regatta_trainer::{FlatLayout, ZeroStage};
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
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Target tokens the loss averaged over (every rank and micro-batch).
    pub target_tokens: u64,
}

/// Bytes of training state this rank holds, from the tensors themselves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Parameters kept between steps.
    pub parameters: u64,
    /// Gradients kept (stage 1 keeps full ones; 2 and 3 keep none between steps).
    pub gradients: u64,
    /// Master weights and both AdamW moments.
    pub optimizer: u64,
}

/// A parameter's initial values: a pure function of the seed and the parameter's name
/// (splitmix64 and Box-Muller), so every rank, thread and libtorch build starts the same
/// way without sharing libtorch's global generator.
pub fn initial_values(spec: &ParamSpec, seed: u64) -> Vec<f32> {
    let n = spec.numel();
    let std = match spec.init {
        Init::Zeros => return vec![0.0; n],
        Init::Ones => return vec![1.0; n],
        Init::Normal(std) => std,
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
}

/// Where a tied parameter's storage is: (block, index among the block's stored specs).
type Source = (usize, usize);

/// Sum of the cross-entropy of every target token (float32).
pub fn token_loss_sum(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = logits.size()[logits.dim() - 1];
    logits
        .reshape([-1, vocab])
        .to_kind(Kind::Float)
        .cross_entropy_loss::<Tensor>(&targets.reshape([-1]), None, Reduction::Sum, IGNORE, 0.0)
}

/// One rank of a ZeRO group.
pub struct Engine {
    model: Box<dyn Model>,
    specs: Vec<Vec<ParamSpec>>,
    /// Per block, per spec: `Ok(slot)` when stored in the block's buffer, or the source of
    /// a tied one.
    stored: Vec<Vec<std::result::Result<usize, Source>>>,
    layouts: Vec<FlatLayout>,
    /// Per block, the shape of each stored parameter (by slot).
    shapes: Vec<Vec<Vec<i64>>>,
    settings: EngineSettings,
    coll: Timed,
    step: u64,
    full: Vec<Option<Tensor>>,
    master: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// 1 where weight decay applies, per block shard.
    decay: Vec<Tensor>,
    full_grads: Vec<Option<Tensor>>,
    grad_shards: Vec<Option<Tensor>>,
}

/// A block's parameters as leaves of one backward: the flat buffer and the tied
/// parameters it borrowed.
struct Leaves {
    flat: Tensor,
    tied: Vec<(Source, Tensor)>,
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
        let mut where_stored: HashMap<String, Source> = HashMap::new();
        let mut stored = Vec::with_capacity(specs.len());
        let mut layouts = Vec::with_capacity(specs.len());
        for (b, block) in specs.iter().enumerate() {
            let mut slots = Vec::new();
            let mut sizes = Vec::new();
            for spec in block {
                match &spec.tied_to {
                    None => {
                        where_stored.insert(spec.name.clone(), (b, sizes.len()));
                        slots.push(Ok(sizes.len()));
                        sizes.push((spec.name.clone(), spec.numel()));
                    }
                    Some(source) => {
                        let found = where_stored.get(source).copied().filter(|(sb, _)| *sb < b);
                        let found = found.ok_or_else(|| {
                            Error::Invalid(format!(
                                "{} is tied to {source}, which no earlier block holds",
                                spec.name
                            ))
                        })?;
                        slots.push(Err(found));
                    }
                }
            }
            stored.push(slots);
            layouts.push(FlatLayout::new(&sizes, world));
        }
        let mut master = Vec::with_capacity(specs.len());
        let mut decay = Vec::with_capacity(specs.len());
        for (b, layout) in layouts.iter().enumerate() {
            let flat = Tensor::zeros([layout.padded as i64], (Kind::Float, Device::Cpu));
            let mask = Tensor::zeros([layout.padded as i64], (Kind::Float, Device::Cpu));
            let own = specs[b].iter().filter(|s| s.tied_to.is_none());
            for (spec, slot) in own.zip(&layout.tensors) {
                let values = init(spec)?;
                if values.size() != spec.shape {
                    return Err(Error::Invalid(format!(
                        "initial values of {} have shape {:?}, not {:?}",
                        spec.name,
                        values.size(),
                        spec.shape
                    )));
                }
                let region = |t: &Tensor| t.narrow(0, slot.offset as i64, slot.numel as i64);
                region(&flat).copy_(&values.to_kind(Kind::Float).view(-1));
                if spec.decays() {
                    let _ = region(&mask).fill_(1.0);
                }
            }
            let range = layout.shard_range(rank);
            let shard = |t: &Tensor| {
                t.narrow(0, range.start as i64, range.len() as i64)
                    .to_device(settings.device)
                    .copy()
            };
            master.push(shard(&flat));
            decay.push(shard(&mask));
        }
        let blocks = specs.len();
        let shapes = specs
            .iter()
            .map(|block| {
                block
                    .iter()
                    .filter(|s| s.tied_to.is_none())
                    .map(|s| s.shape.clone())
                    .collect()
            })
            .collect();
        let mut engine = Self {
            model,
            specs,
            stored,
            layouts,
            shapes,
            settings,
            coll: Timed::new(coll),
            step: 0,
            full: (0..blocks).map(|_| None).collect(),
            exp_avg: master.iter().map(Tensor::zeros_like).collect(),
            exp_avg_sq: master.iter().map(Tensor::zeros_like).collect(),
            master,
            decay,
            full_grads: (0..blocks).map(|_| None).collect(),
            grad_shards: (0..blocks).map(|_| None).collect(),
        };
        engine.refresh_full()?;
        Ok(engine)
    }

    /// Steps done.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Real (unpadded) parameters of the model.
    pub fn parameter_count(&self) -> u64 {
        self.layouts.iter().map(|l| l.numel as u64).sum()
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

    /// Stages 1 and 2 keep full parameters: rebuilt from every rank's master slice.
    fn refresh_full(&mut self) -> Result<()> {
        if self.three() {
            return Ok(());
        }
        for block in 0..self.master.len() {
            let full = self.coll.all_gather(&self.master[block])?;
            self.full[block] = Some(full.to_kind(self.settings.compute));
        }
        Ok(())
    }

    /// A block's full flat parameters in the compute type.
    fn block_params(&mut self, block: usize) -> Result<Tensor> {
        match &self.full[block] {
            Some(full) => Ok(full.shallow_clone()),
            None => Ok(self
                .coll
                .all_gather(&self.master[block])?
                .to_kind(self.settings.compute)),
        }
    }

    fn slot_view(&self, block: usize, slot: usize, flat: &Tensor) -> Tensor {
        let s = &self.layouts[block].tensors[slot];
        flat.narrow(0, s.offset as i64, s.numel as i64)
            .view(self.shapes[block][slot].as_slice())
    }

    /// The block's parameters as leaves (`grad`: whether they require gradients).
    fn leaves(&mut self, block: usize, grad: bool) -> Result<Leaves> {
        let flat = self.block_params(block)?.detach().set_requires_grad(grad);
        let mut tied = Vec::new();
        let sources: Vec<Source> = self.stored[block].iter().filter_map(|s| s.err()).collect();
        for (source_block, slot) in sources {
            let source_flat = self.block_params(source_block)?;
            let view = self
                .slot_view(source_block, slot, &source_flat)
                .detach()
                .set_requires_grad(grad);
            tied.push(((source_block, slot), view));
        }
        Ok(Leaves { flat, tied })
    }

    fn views(&self, block: usize, leaves: &Leaves) -> Vec<Tensor> {
        let mut tied = leaves.tied.iter();
        self.stored[block]
            .iter()
            .map(|s| match s {
                Ok(slot) => self.slot_view(block, *slot, &leaves.flat),
                Err(_) => tied
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
        let mut grad_bytes = 0;
        for m in micro {
            let (loss, held) = self.accumulate(m, count)?;
            local_loss += loss;
            grad_bytes = held;
        }
        let loss = self.sum_over_ranks(local_loss)? / count;
        let grad_norm = self.apply_adamw()?;
        Ok(StepOutcome {
            loss,
            collective_secs: self.coll.take_spent().as_secs_f64(),
            grad_bytes,
            grad_norm,
            target_tokens: count as u64,
        })
    }

    /// Forward and backward of one micro-batch, adding the gradients of its loss sum
    /// divided by `count` to the held ones. Returns its loss sum and the gradient bytes held.
    fn accumulate(&mut self, m: &MicroBatch, count: f64) -> Result<(f64, u64)> {
        let blocks = self.specs.len();
        let recompute = self.three() || self.settings.activation_checkpointing;
        let device = self.settings.device;
        let tokens = m.tokens.to_device(device);
        let targets = m.targets.to_device(device);
        let mut batch = m.batch(device);
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
        let mut grad_bytes = 0;
        for block in (0..blocks).rev() {
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
            let mut wrt = vec![leaves.flat.shallow_clone()];
            wrt.extend(leaves.tied.iter().map(|(_, t)| t.shallow_clone()));
            wrt.extend(input.iter().map(Tensor::shallow_clone));
            let grads = Tensor::f_run_backward(&[&target], &wrt, false, false)?;
            let grad = grads[0].to_kind(Kind::Float);
            for (i, (source, _)) in leaves.tied.iter().enumerate() {
                let g = grads[1 + i].to_kind(Kind::Float);
                let sum = match pending.remove(source) {
                    Some(earlier) => earlier + g,
                    None => g,
                };
                pending.insert(*source, sum);
            }
            let here: Vec<Source> = pending.keys().filter(|(b, _)| *b == block).copied().collect();
            for source in here {
                if let Some(g) = pending.remove(&source) {
                    let mut region = self.slot_view(source.0, source.1, &grad);
                    let _ = tch::no_grad(|| region.g_add_(&g));
                }
            }
            grad_out = grads.get(1 + leaves.tied.len()).map(Tensor::shallow_clone);
            grad_bytes += self.hold_gradient(block, grad)?;
        }
        Ok((loss_sum, grad_bytes))
    }

    /// Adds a block's gradient to the held ones (stage 1: full; 2 and 3: this rank's
    /// reduced slice). Returns the bytes held for the block.
    fn hold_gradient(&mut self, block: usize, grad: Tensor) -> Result<u64> {
        let (slot, grad) = if self.settings.stage == ZeroStage::One {
            (&mut self.full_grads[block], grad)
        } else {
            let shard = self.coll.reduce_scatter(&grad)?;
            (&mut self.grad_shards[block], shard)
        };
        let total = match slot.take() {
            Some(held) => held + grad,
            None => grad,
        };
        let held = bytes(&total);
        *slot = Some(total);
        Ok(held)
    }

    /// Clips by the global norm and updates the master slices; returns the norm before
    /// clipping.
    fn apply_adamw(&mut self) -> Result<f64> {
        self.step += 1;
        let o = self.settings.optimizer.clone();
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - o.beta1.powi(t), 1.0 - o.beta2.powi(t));
        let lr = o.lr_at(self.step, self.settings.steps);
        let mut shards = Vec::with_capacity(self.master.len());
        for block in 0..self.master.len() {
            let missing = || Error::Invalid(format!("no gradient for block {block}"));
            let grad = match self.settings.stage {
                ZeroStage::One => {
                    let full = self.full_grads[block].take().ok_or_else(missing)?;
                    self.coll.reduce_scatter(&full)?
                }
                _ => self.grad_shards[block].take().ok_or_else(missing)?,
            };
            shards.push(grad);
        }
        let local: f64 = shards
            .iter()
            .map(|g| g.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]))
            .sum();
        let norm = self.sum_over_ranks(local)?.sqrt();
        let clip = if o.max_grad_norm > 0.0 {
            (o.max_grad_norm / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        for (block, grad) in shards.into_iter().enumerate() {
            let grad = grad * clip;
            let (master, m, v) = tch::no_grad(|| {
                let m = &self.exp_avg[block] * o.beta1 + &grad * (1.0 - o.beta1);
                let v = &self.exp_avg_sq[block] * o.beta2 + (&grad * &grad) * (1.0 - o.beta2);
                let denom = (&v / bc2).sqrt() + o.eps;
                let keep = (&self.decay[block] * (-lr * o.weight_decay)) + 1.0;
                let master = &self.master[block] * keep - (&m / bc1) / denom * lr;
                (master, m, v)
            });
            self.master[block] = master;
            self.exp_avg[block] = m;
            self.exp_avg_sq[block] = v;
        }
        self.refresh_full()?;
        Ok(norm)
    }

    /// Bytes of state held now.
    pub fn held(&self) -> Held {
        let optimizer = self
            .master
            .iter()
            .chain(&self.exp_avg)
            .chain(&self.exp_avg_sq)
            .map(bytes)
            .sum();
        let parameters = if self.three() {
            self.master.iter().map(bytes).sum()
        } else {
            self.full.iter().flatten().map(bytes).sum()
        };
        let gradients = self
            .full_grads
            .iter()
            .chain(&self.grad_shards)
            .flatten()
            .map(bytes)
            .sum();
        Held {
            parameters,
            gradients,
            optimizer,
        }
    }

    /// This rank's optimizer state (master slice and moments per block), on the CPU.
    pub fn optimizer_state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for block in 0..self.master.len() {
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
        let device = self.settings.device;
        for block in 0..self.master.len() {
            let expected = self.layouts[block].shard_len() as i64;
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
                Ok(tensor.to_kind(Kind::Float).to_device(device))
            };
            let (master, m, v) = (take("master")?, take("exp_avg")?, take("exp_avg_sq")?);
            self.master[block] = master;
            self.exp_avg[block] = m;
            self.exp_avg_sq[block] = v;
        }
        self.step = step;
        self.refresh_full()
    }

    /// One block's stored parameters by name, fp32 on the CPU (a collective: every rank
    /// calls it; only this block is gathered).
    pub fn gather_block(&mut self, block: usize) -> Result<Vec<(String, Tensor)>> {
        let full = self.coll.all_gather(&self.master[block])?.to_device(Device::Cpu);
        let names: Vec<String> = self.specs[block]
            .iter()
            .filter(|s| s.tied_to.is_none())
            .map(|s| s.name.clone())
            .collect();
        Ok(names
            .into_iter()
            .enumerate()
            .map(|(slot, name)| (name, self.slot_view(block, slot, &full).copy()))
            .collect())
    }

    /// Every stored parameter by name with its real shape, fp32 on the CPU (a collective;
    /// the whole model at once: for tests and small models).
    pub fn consolidated(&mut self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for block in 0..self.specs.len() {
            out.extend(self.gather_block(block)?);
        }
        Ok(out)
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
