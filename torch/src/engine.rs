//! The ZeRO engine: one rank's parameters, gradients and AdamW state, and one training
//! step over a [`LayeredModel`].
//!
//! Every block's parameters are flattened into one contiguous buffer padded to a multiple
//! of the world size; rank r owns slice r of each buffer. AdamW keeps fp32 master weights
//! and both moments for the owned slices only (every stage). Stage 1 also holds full
//! gradients and reduce-scatters them after backward; stage 2 reduce-scatters each block's
//! gradients as soon as backward produces them and keeps only its slice; stage 3 also
//! holds only its slice of the parameters and all-gathers a block's parameters just before
//! the block runs forward, and again for its backward (recomputing the block), releasing
//! them after. After the update, stages 1 and 2 all-gather the new parameters.
//!
//! Backward runs block by block from the last: each block's vector-Jacobian product gives
//! the gradient of its flat parameters and of its input, which feeds the block before.

use regatta_trainer::config::OptimizerConfig;
use regatta_trainer::{FlatLayout, ZeroStage};
use tch::{Device, Kind, Tensor};

use crate::collective::{TensorCollective, Timed};
use crate::model::{Init, LayeredModel, ParamSpec};

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// Mean loss over every rank's batch.
    pub loss: f64,
    /// Seconds in collectives.
    pub collective_secs: f64,
    /// Bytes of gradients held at the end of backward.
    pub grad_bytes: u64,
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

/// Which ZeRO stage a number names.
pub fn stage(number: u8) -> Result<ZeroStage, String> {
    match number {
        1 => Ok(ZeroStage::One),
        2 => Ok(ZeroStage::Two),
        3 => Ok(ZeroStage::Three),
        other => Err(format!("ZeRO stage {other} does not exist; use 1, 2 or 3")),
    }
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

fn bytes(tensor: &Tensor) -> u64 {
    (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64
}

/// One rank of a ZeRO group.
pub struct Engine {
    model: Box<dyn LayeredModel>,
    specs: Vec<Vec<ParamSpec>>,
    layouts: Vec<FlatLayout>,
    stage: ZeroStage,
    coll: Timed,
    device: Device,
    compute: Kind,
    opt: OptimizerConfig,
    step: u64,
    full: Vec<Option<Tensor>>,
    master: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    full_grads: Vec<Option<Tensor>>,
    grad_shards: Vec<Option<Tensor>>,
}

impl Engine {
    /// A rank with freshly initialised weights (the same on every rank for a seed).
    pub fn new(
        model: Box<dyn LayeredModel>,
        coll: Box<dyn TensorCollective>,
        stage: ZeroStage,
        opt: OptimizerConfig,
        device: Device,
        compute: Kind,
        seed: u64,
    ) -> Result<Self, String> {
        let specs = model.blocks();
        let world = coll.world();
        let rank = coll.rank();
        let layouts: Vec<FlatLayout> = specs
            .iter()
            .map(|block| {
                let sizes: Vec<(String, usize)> = block.iter().map(|p| (p.name.clone(), p.numel())).collect();
                FlatLayout::new(&sizes, world)
            })
            .collect();
        let mut master = Vec::with_capacity(specs.len());
        for (block, layout) in specs.iter().zip(&layouts) {
            let flat = Tensor::zeros([layout.padded as i64], (Kind::Float, Device::Cpu));
            for (spec, slot) in block.iter().zip(&layout.tensors) {
                let values = initial_values(spec, seed);
                flat.narrow(0, slot.offset as i64, slot.numel as i64)
                    .copy_(&Tensor::from_slice(&values));
            }
            let range = layout.shard_range(rank);
            master.push(
                flat.narrow(0, range.start as i64, range.len() as i64)
                    .to_device(device)
                    .copy(),
            );
        }
        let blocks = specs.len();
        let mut engine = Self {
            model,
            specs,
            layouts,
            stage,
            coll: Timed::new(coll),
            device,
            compute,
            opt,
            step: 0,
            full: (0..blocks).map(|_| None).collect(),
            exp_avg: master.iter().map(Tensor::zeros_like).collect(),
            exp_avg_sq: master.iter().map(Tensor::zeros_like).collect(),
            master,
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
    pub fn model(&self) -> &dyn LayeredModel {
        self.model.as_ref()
    }

    /// Stages 1 and 2 keep full parameters: rebuilt from every rank's master slice.
    fn refresh_full(&mut self) -> Result<(), String> {
        if self.stage == ZeroStage::Three {
            return Ok(());
        }
        for block in 0..self.master.len() {
            let full = self.coll.all_gather(&self.master[block])?;
            self.full[block] = Some(full.to_kind(self.compute));
        }
        Ok(())
    }

    /// A block's full flat parameters in the compute type.
    fn block_params(&mut self, block: usize) -> Result<Tensor, String> {
        match &self.full[block] {
            Some(full) => Ok(full.shallow_clone()),
            None => Ok(self.coll.all_gather(&self.master[block])?.to_kind(self.compute)),
        }
    }

    fn views(&self, block: usize, flat: &Tensor) -> Vec<Tensor> {
        self.specs[block]
            .iter()
            .zip(&self.layouts[block].tensors)
            .map(|(spec, slot)| {
                flat.narrow(0, slot.offset as i64, slot.numel as i64)
                    .view(spec.shape.as_slice())
            })
            .collect()
    }

    /// One optimizer step on this rank's batch (`tokens` and `targets`: `[batch, time]`).
    pub fn train_step(&mut self, tokens: &Tensor, targets: &Tensor) -> Result<StepOutcome, String> {
        let blocks = self.specs.len();
        let world = self.coll.world() as f64;
        let three = self.stage == ZeroStage::Three;
        let tokens = tokens.to_device(self.device);
        let targets = targets.to_device(self.device);
        // Forward. Stage 3 keeps only each block's input and recomputes in backward.
        let mut inputs = Vec::with_capacity(blocks);
        let mut saved = Vec::with_capacity(blocks);
        let mut hidden = tokens.shallow_clone();
        for block in 0..blocks {
            if three {
                inputs.push(hidden.shallow_clone());
                if block + 1 < blocks {
                    let params = self.block_params(block)?;
                    let views = self.views(block, &params);
                    hidden = tch::no_grad(|| self.model.forward(block, &views, &hidden));
                }
            } else {
                let params = self.block_params(block)?.detach().set_requires_grad(true);
                let input = if block == 0 {
                    hidden.shallow_clone()
                } else {
                    hidden.detach().set_requires_grad(true)
                };
                let out = self.model.forward(block, &self.views(block, &params), &input);
                hidden = out.shallow_clone();
                saved.push((params, (block > 0).then_some(input), out));
            }
        }
        // Backward, block by block from the last.
        let mut grad_out: Option<Tensor> = None;
        let mut local_loss = 0.0;
        let mut grad_bytes = 0;
        for block in (0..blocks).rev() {
            let (params, input, out) = if three {
                let params = self.block_params(block)?.set_requires_grad(true);
                let input = (block > 0).then(|| inputs[block].detach().set_requires_grad(true));
                let x = input.as_ref().unwrap_or(&inputs[0]);
                let out = self.model.forward(block, &self.views(block, &params), x);
                (params, input, out)
            } else {
                saved.pop().ok_or("backward ran past the saved blocks")?
            };
            let target = if block + 1 == blocks {
                let loss = self.model.loss(&out, &targets);
                local_loss = loss.double_value(&[]);
                loss
            } else {
                let upstream = grad_out.take().ok_or("a block's output gradient is missing")?;
                (&out * upstream).sum(Kind::Float)
            };
            let mut wrt = vec![params.shallow_clone()];
            wrt.extend(input.iter().map(Tensor::shallow_clone));
            let grads = Tensor::f_run_backward(&[&target], &wrt, false, false).map_err(|e| e.to_string())?;
            let grad = grads[0].to_kind(Kind::Float) / world;
            grad_out = grads.get(1).map(Tensor::shallow_clone);
            if self.stage == ZeroStage::One {
                grad_bytes += bytes(&grad);
                self.full_grads[block] = Some(grad);
            } else {
                let shard = self.coll.reduce_scatter(&grad)?;
                grad_bytes += bytes(&shard);
                self.grad_shards[block] = Some(shard);
            }
        }
        let loss_sum = self
            .coll
            .all_reduce(&Tensor::from_slice(&[local_loss as f32]).to_device(self.device))?;
        let loss = loss_sum.double_value(&[0]) / world;
        self.apply_adamw()?;
        Ok(StepOutcome {
            loss,
            collective_secs: self.coll.take_spent().as_secs_f64(),
            grad_bytes,
        })
    }

    fn apply_adamw(&mut self) -> Result<(), String> {
        self.step += 1;
        let o = self.opt.clone();
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - o.beta1.powi(t), 1.0 - o.beta2.powi(t));
        let lr = o.lr_at(self.step);
        for block in 0..self.master.len() {
            let grad = match self.stage {
                ZeroStage::One => {
                    let full = self.full_grads[block].as_ref().ok_or("no gradient for a block")?;
                    self.coll.reduce_scatter(full)?
                }
                _ => self.grad_shards[block].take().ok_or("no gradient for a block")?,
            };
            let (master, m, v) = tch::no_grad(|| {
                let m = &self.exp_avg[block] * o.beta1 + &grad * (1.0 - o.beta1);
                let v = &self.exp_avg_sq[block] * o.beta2 + (&grad * &grad) * (1.0 - o.beta2);
                let denom = (&v / bc2).sqrt() + o.eps;
                let decayed = &self.master[block] * (1.0 - lr * o.weight_decay);
                let master = decayed - (&m / bc1) / denom * lr;
                (master, m, v)
            });
            self.master[block] = master;
            self.exp_avg[block] = m;
            self.exp_avg_sq[block] = v;
        }
        self.refresh_full()
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
        let parameters = if self.stage == ZeroStage::Three {
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
    pub fn load_optimizer_state(&mut self, tensors: Vec<(String, Tensor)>, step: u64) -> Result<(), String> {
        let mut by_name: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
        for block in 0..self.master.len() {
            let expected = self.layouts[block].shard_len() as i64;
            let mut take = |name: &str| {
                let key = format!("block{block}.{name}");
                let tensor = by_name
                    .remove(&key)
                    .ok_or_else(|| format!("the checkpoint has no {key}"))?;
                if tensor.size() != [expected] {
                    return Err(format!(
                        "{key} has shape {:?}, this model and world size need [{expected}]",
                        tensor.size()
                    ));
                }
                Ok(tensor.to_kind(Kind::Float).to_device(self.device))
            };
            let (master, m, v) = (take("master")?, take("exp_avg")?, take("exp_avg_sq")?);
            self.master[block] = master;
            self.exp_avg[block] = m;
            self.exp_avg_sq[block] = v;
        }
        self.step = step;
        self.refresh_full()
    }

    /// Every parameter by name with its real shape, fp32 on the CPU (a collective at
    /// stage 3: every rank calls it).
    pub fn consolidated(&mut self) -> Result<Vec<(String, Tensor)>, String> {
        let mut out = Vec::new();
        for block in 0..self.specs.len() {
            let full = self.coll.all_gather(&self.master[block])?.to_device(Device::Cpu);
            for (spec, slot) in self.specs[block].iter().zip(&self.layouts[block].tensors) {
                let tensor = full
                    .narrow(0, slot.offset as i64, slot.numel as i64)
                    .view(spec.shape.as_slice())
                    .copy();
                out.push((spec.name.clone(), tensor));
            }
        }
        Ok(out)
    }

    /// Waits for every rank.
    pub fn barrier(&mut self) -> Result<(), String> {
        self.coll.barrier()
    }

    /// Sums a scalar over ranks.
    pub fn sum_over_ranks(&mut self, value: f64) -> Result<f64, String> {
        let t = Tensor::from_slice(&[value as f32]).to_device(self.device);
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
