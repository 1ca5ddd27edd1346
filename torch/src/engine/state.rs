//! What an engine holds and hands out: bytes by kind and place, optimizer state for
//! checkpoints (and its reload), whole blocks gathered for saving, and the collective
//! helpers checkpoints and the executor use.

use super::*;

impl Engine {
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
        // A QLoRA base's quantized weights: on the device, whole on every rank or (ZeRO-3)
        // a slice of each block's.
        let frozen = sum(&mut self.frozen.iter()) + self.quantized_held();
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
        let full = self.coll.all_gather(&shard)?;
        let full = self.settled_on_host(&full)?;
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
        let full = self.frozen_params(block)?;
        let full = self.settled_on_host(&full)?.to_kind(Kind::Float);
        let flat = &self.frozen_flat[block];
        let mut out: Vec<(String, Tensor)> = Vec::new();
        for spec in self.specs[block].iter().filter(|s| s.tied_to.is_none()) {
            if let Some(t) = trained
                .get(&spec.name)
                .filter(|_| !regatta_trainer::is_adapter(&spec.name))
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
        // A QLoRA base's projections: dequantized (gathered first at ZeRO-3), plus B A.
        self.install_quantized(block)?;
        for spec in self.model.quantized_block(block) {
            let weight = self
                .model
                .dequantized(&spec.name)
                .ok_or_else(|| Error::Invalid(format!("the quantized base has no {} to merge", spec.name)))?;
            let weight = weight.to_device(Device::Cpu);
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
            let full = self.frozen_params(block)?;
            let full = self.settled_on_host(&full)?;
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
        let sum = self.coll.all_reduce(&t)?;
        self.coll.settle()?;
        Ok(sum.double_value(&[0]))
    }

    /// Once the collectives issued so far have completed (or failed with their cause,
    /// never a hang: [`TensorCollective::settle`]), and with optimizer state on the host,
    /// once the device has finished its asynchronous copies to and from host memory.
    pub(super) fn host_sync(&mut self) -> Result<()> {
        self.coll.settle()?;
        if let Device::Cuda(ordinal) = self.settings.device {
            if self.host == Device::Cpu {
                tch::Cuda::synchronize(ordinal as i64);
            }
        }
        Ok(())
    }

    /// A collective's result copied to the host, after the collectives complete.
    pub(super) fn settled_on_host(&mut self, tensor: &Tensor) -> Result<Tensor> {
        self.coll.settle()?;
        Ok(tensor.to_device(Device::Cpu))
    }
}
