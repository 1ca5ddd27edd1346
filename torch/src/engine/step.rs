//! A training step: micro-batches forward and backward block by block (with ZeRO-3's
//! gathers and recomputation), gradients reduced and held by kind, then AdamW on this
//! rank's slice.

use super::*;

impl Engine {
    /// One optimizer step over this rank's micro-batches (a collective: every rank calls it
    /// with the same number of micro-batches).
    pub fn train_step(&mut self, micro: &[MicroBatch]) -> Result<StepOutcome> {
        let local_targets: i64 = micro
            .iter()
            .map(|m| m.targets.ne(IGNORE_INDEX).sum(Kind::Int64).int64_value(&[]))
            .sum();
        let count = self.sum_over_ranks(local_targets as f64)?.round();
        if count < 1.0 {
            return Err(Error::Invalid(
                "no target token in this step's batch on any rank (every label is -100)".into(),
            ));
        }
        // Summed on the device: one host sync for the step's loss, not one per micro-batch.
        let mut local_loss: Option<Tensor> = None;
        let mut grad_bytes = (0, 0);
        for (k, m) in micro.iter().enumerate() {
            // Dropout masks: a function of the run's seed, the step and the micro-batch, so a
            // resumed run draws what an uninterrupted one would.
            let salt = (self.step << 16 | k as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
            let (loss, held) = self.accumulate(m, count, self.settings.seed ^ salt)?;
            local_loss = Some(match local_loss {
                Some(sum) => sum + loss,
                None => loss,
            });
            grad_bytes = held;
        }
        self.coll.settle()?;
        let local_loss = local_loss.map_or(0.0, |t| t.double_value(&[]));
        let loss = self.sum_over_ranks(local_loss)? / count;
        let grad_norm = self.apply_adamw()?;
        // The new parameters' gathers complete inside the step they belong to (their time
        // counts here, and a failure ends this step).
        self.coll.settle()?;
        Ok(StepOutcome {
            loss,
            collective_secs: self.coll.take_spent().as_secs_f64(),
            grad_bytes: grad_bytes.0,
            host_grad_bytes: grad_bytes.1,
            grad_norm,
            target_tokens: count as u64,
        })
    }

    /// The validation loss over every rank's micro-batches: forward only, without dropout
    /// or gradients, block by block (gathering parameters at ZeRO-3). A collective: every
    /// rank calls it with the same number of micro-batches. Returns the mean loss per
    /// target token and the target tokens of all ranks (0 and NaN when none has one).
    pub fn eval_loss(&mut self, micro: &[MicroBatch]) -> Result<(f64, u64)> {
        let device = self.settings.device;
        let kernel = self.model.attention_kernel(device, self.settings.compute);
        let mut local = Tensor::zeros([], (Kind::Double, device));
        let mut local_count = 0i64;
        for m in micro {
            let targets = m.targets.to_device(device);
            let mut batch = m.batch(device, kernel);
            self.model.prepare(&mut batch);
            let mut hidden = m.tokens.to_device(device);
            for block in 0..self.specs.len() {
                let leaves = self.leaves(block, false)?;
                self.prefetch(block + 1)?;
                let views = self.views(block, &leaves);
                hidden = tch::no_grad(|| self.model.forward(block, &views, &hidden, &batch));
            }
            // The loss by chunks of rows, as training computes it (no f32 copy of all logits).
            local += token_loss_sum_chunked(&hidden, &targets);
            // Counted on the host's copy: no device sync inside the loop.
            local_count += m.targets.ne(IGNORE_INDEX).sum(Kind::Int64).int64_value(&[]);
        }
        self.release_quantized();
        self.coll.settle()?;
        let sum = self.sum_over_ranks(local.double_value(&[]))?;
        let count = self.sum_over_ranks(local_count as f64)?.round();
        let mean = if count >= 1.0 { sum / count } else { f64::NAN };
        let _ = self.coll.take_spent();
        Ok((mean, count as u64))
    }

    /// Forward and backward of one micro-batch, adding the gradients of its loss sum
    /// divided by `count` to the held ones. Returns its loss sum and the gradient bytes
    /// held (all, and of those on the host).
    fn accumulate(&mut self, m: &MicroBatch, count: f64, dropout_seed: u64) -> Result<(Tensor, (u64, u64))> {
        let blocks = self.specs.len();
        let recompute = self.three() || self.settings.activation_checkpointing;
        let device = self.settings.device;
        let tokens = m.tokens.to_device(device);
        let targets = m.targets.to_device(device);
        let kernel = self.model.attention_kernel(device, self.settings.compute);
        let mut batch = m.batch(device, kernel);
        batch.dropout_seed = Some(dropout_seed);
        self.model.prepare(&mut batch);
        let mut forward = self.forward(&tokens, &batch, recompute)?;
        // Backward, block by block from the last.
        let mut backward = Backward {
            grad_out: None,
            pending: HashMap::new(),
            loss_sum: Tensor::zeros([], (Kind::Double, device)),
            held: (0, 0),
        };
        for block in (0..blocks).rev() {
            // A frozen first block needs no backward at all (nothing before it).
            if block == 0 && !self.trains(block) {
                break;
            }
            let (leaves, input, out) = self.block_graph(block, recompute, &mut forward, &batch)?;
            let target = backward.target(&out, &targets, count, block + 1 == blocks)?;
            self.backward_block(block, &leaves, input, &target, &mut backward)?;
        }
        self.release_quantized();
        self.land_gradients()?;
        Ok((backward.loss_sum, backward.held))
    }

    /// The forward of a micro-batch through every block: keeps each block's input
    /// (`recompute`) or its whole graph.
    fn forward(&mut self, tokens: &Tensor, batch: &Batch, recompute: bool) -> Result<Forward> {
        let blocks = self.specs.len();
        let mut inputs = Vec::with_capacity(blocks);
        let mut saved = Vec::with_capacity(blocks);
        let mut hidden = tokens.shallow_clone();
        for block in 0..blocks {
            if recompute {
                inputs.push(hidden.shallow_clone());
                if block + 1 < blocks {
                    let leaves = self.leaves(block, false)?;
                    // The next block's gather runs while this one computes.
                    self.prefetch(block + 1)?;
                    let views = self.views(block, &leaves);
                    hidden = tch::no_grad(|| self.model.forward(block, &views, &hidden, batch));
                }
            } else {
                let leaves = self.leaves(block, true)?;
                let input = if block == 0 {
                    hidden.shallow_clone()
                } else {
                    hidden.detach().set_requires_grad(true)
                };
                let out = self.model.forward(block, &self.views(block, &leaves), &input, batch);
                hidden = out.shallow_clone();
                saved.push((leaves, (block > 0).then_some(input), out));
            }
        }
        Ok(Forward { inputs, saved, hidden })
    }

    /// Whether backward must reach a block's parameters: it trains some of its own or a
    /// tied one it borrowed.
    fn trains(&self, block: usize) -> bool {
        !self.train[block].is_empty()
            || self.slots[block]
                .iter()
                .any(|s| matches!(s, Slot::Tied((_, Store::Train(_)))))
    }

    /// A block's leaves, its input as a leaf (none for the first block) and its output with
    /// the graph between them: recomputed from the kept input, or the one the forward saved.
    fn block_graph(
        &mut self,
        block: usize,
        recompute: bool,
        forward: &mut Forward,
        batch: &Batch,
    ) -> Result<(Leaves, Option<Tensor>, Tensor)> {
        if recompute {
            let leaves = self.leaves(block, true)?;
            if block > 0 {
                self.prefetch(block - 1)?;
            }
            let input = (block > 0).then(|| forward.inputs[block].detach().set_requires_grad(true));
            let x = input.as_ref().unwrap_or(&forward.inputs[0]);
            let out = self.model.forward(block, &self.views(block, &leaves), x, batch);
            Ok((leaves, input, out))
        } else {
            forward
                .saved
                .pop()
                .ok_or_else(|| Error::Invalid("backward ran past the saved blocks".into()))
        }
    }

    /// A block's backward from `target`: its own gradient held, its tied parameters'
    /// gradients pending until their source block, its input's gradient for the block before.
    fn backward_block(
        &mut self,
        block: usize,
        leaves: &Leaves,
        input: Option<Tensor>,
        target: &Tensor,
        backward: &mut Backward,
    ) -> Result<()> {
        let mut wrt = leaves.trained();
        let trained = wrt.len();
        wrt.extend(input.iter().map(Tensor::shallow_clone));
        let grads = Tensor::f_run_backward(&[target], &wrt, false, false)?;
        let own = leaves.own.len();
        let grad = self.flat_gradient(block, &grads[..own], self.settings.device);
        backward.pend_tied(leaves, &grads[own..]);
        self.add_pending(block, &grad, &mut backward.pending);
        backward.grad_out = grads.get(trained).map(Tensor::shallow_clone);
        if !self.train[block].is_empty() {
            let (bytes, on_host) = self.hold_gradient(block, grad)?;
            backward.held.0 += bytes;
            backward.held.1 += on_host;
        }
        Ok(())
    }

    /// Adds the pending gradients of this block's tied-to parameters into its gradient.
    fn add_pending(&self, block: usize, grad: &Tensor, pending: &mut HashMap<Source, Tensor>) {
        let here: Vec<Source> = pending.keys().filter(|(b, _)| *b == block).copied().collect();
        for source in here {
            if let (Some(g), Store::Train(slot)) = (pending.remove(&source), source.1) {
                let mut region = self.train[block].view(slot, grad);
                let _ = tch::no_grad(|| region.g_add_(&g));
            }
        }
    }

    /// A block's own trained parameters' gradients as one flat float32 buffer in the
    /// block's layout (parameters one after another, padding zero); a parameter backward
    /// did not reach gets zeros.
    fn flat_gradient(&self, block: usize, grads: &[Tensor], device: Device) -> Tensor {
        let layout = &self.train[block].layout;
        if grads.is_empty() {
            return Tensor::zeros([0], (Kind::Float, device));
        }
        let mut parts: Vec<Tensor> = layout
            .tensors
            .iter()
            .zip(grads)
            .map(|(slot, g)| {
                if g.defined() {
                    g.reshape([-1]).to_kind(Kind::Float)
                } else {
                    Tensor::zeros([slot.numel as i64], (Kind::Float, device))
                }
            })
            .collect();
        let padding = layout.padded - layout.numel;
        if padding > 0 {
            parts.push(Tensor::zeros([padding as i64], (Kind::Float, device)));
        }
        Tensor::cat(&parts, 0)
    }

    /// Adds a block's gradient to the held ones (stage 1: full, on the device; 2 and 3:
    /// this rank's reduced slice, moved to the host with optimizer offload). Returns the
    /// bytes held for the block, and of those on the host.
    fn hold_gradient(&mut self, block: usize, grad: Tensor) -> Result<(u64, u64)> {
        let (slot, grad) = if self.settings.stage == ZeroStage::One {
            (&mut self.full_grads[block], grad)
        } else {
            let shard = moved(&self.coll.reduce_scatter(&grad)?, self.host);
            if self.host != self.settings.device {
                // Copied to pinned host memory without blocking; added after the sync.
                let held = bytes(&shard);
                self.arriving.push((block, shard));
                return Ok((held, held));
            }
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
                    moved(&self.coll.reduce_scatter(&full)?, self.host)
                }
                _ => self.grad_shards[block].take().ok_or_else(missing)?,
            };
            shards.push(Some(grad));
        }
        // The shards complete (collectives, copies to the host) before they are read, and
        // with offload the device has read the master slices the host updates next.
        self.host_sync()?;
        // Squares summed where the shards are, then read once (not one host sync a block).
        let squares: Vec<Tensor> = shards
            .iter()
            .flatten()
            .map(|g| g.pow_tensor_scalar(2).sum(Kind::Double))
            .collect();
        let same_device = squares.windows(2).all(|w| w[0].device() == w[1].device());
        let local: f64 = if squares.is_empty() {
            0.0
        } else if same_device {
            Tensor::stack(&squares, 0).sum(Kind::Double).double_value(&[])
        } else {
            squares.iter().map(|t| t.double_value(&[])).sum()
        };
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

    /// Adds the gradient slices copied to the host during backward to the held ones,
    /// after one sync for all of them.
    fn land_gradients(&mut self) -> Result<()> {
        if self.arriving.is_empty() {
            return Ok(());
        }
        self.host_sync()?;
        for (block, shard) in std::mem::take(&mut self.arriving) {
            let total = match self.grad_shards[block].take() {
                Some(mut held) => {
                    let _ = tch::no_grad(|| held.g_add_(&shard));
                    held
                }
                None => shard,
            };
            self.grad_shards[block] = Some(total);
        }
        Ok(())
    }
}

/// What a micro-batch's forward keeps for its backward.
struct Forward {
    /// Recomputing: each block's input.
    inputs: Vec<Tensor>,
    /// Not recomputing: each block's leaves, input leaf (none for the first) and output.
    saved: Vec<(Leaves, Option<Tensor>, Tensor)>,
    /// The last block's output (recomputing: its input), held until the micro-batch ends
    /// as the step always held it (dropping it sooner would free the logits earlier, a
    /// change of its own).
    #[allow(dead_code)]
    hidden: Tensor,
}

/// A micro-batch's backward as it goes from the last block to the first.
struct Backward {
    /// The gradient by the input of the block just done: the upstream gradient of the
    /// block below it.
    grad_out: Option<Tensor>,
    /// Tied parameters' gradients, summed (float32) until their source block's backward.
    pending: HashMap<Source, Tensor>,
    /// The micro-batch's loss sum (set at the last block).
    loss_sum: Tensor,
    /// Gradient bytes held, and of those on the host.
    held: (u64, u64),
}

impl Backward {
    /// What a block's backward differentiates: its output times its upstream gradient,
    /// which for the last block is the loss's own (by chunks, no f32 copy of the whole
    /// logits), the loss sum kept.
    fn target(&mut self, out: &Tensor, targets: &Tensor, count: f64, last: bool) -> Result<Tensor> {
        if last {
            let (sum, upstream) = token_loss_and_grad(out, targets, 1.0 / count);
            self.loss_sum = sum;
            Ok((out * upstream).sum(Kind::Float))
        } else {
            let upstream = self
                .grad_out
                .take()
                .ok_or_else(|| Error::Invalid("a block's output gradient is missing".into()))?;
            Ok((out * upstream).sum(Kind::Float))
        }
    }

    /// Adds a block's tied trained parameters' gradients (`grads`, in the leaves' order) to
    /// the pending ones of their sources.
    fn pend_tied(&mut self, leaves: &Leaves, grads: &[Tensor]) {
        let tied_trained = leaves
            .tied
            .iter()
            .filter(|((_, store), _)| matches!(store, Store::Train(_)));
        for (i, (source, _)) in tied_trained.enumerate() {
            let g = grads[i].to_kind(Kind::Float);
            let sum = match self.pending.remove(source) {
                Some(earlier) => earlier + g,
                None => g,
            };
            self.pending.insert(*source, sum);
        }
    }
}
