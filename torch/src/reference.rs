//! The plain single-process training loop the ZeRO engine is proven against: the model's
//! parameters as libtorch variables, one forward over the whole global batch, libtorch's
//! own autograd (`backward`), `clip_grad_norm` and libtorch's `AdamW` (weight decay only
//! on matrices, as the engine does). It shares nothing with [`crate::engine`] but the
//! model's forward.

use regatta_trainer::OptimizerConfig;
use tch::nn::{self, OptimizerConfig as _};
use tch::{Device, Kind, Tensor};

use crate::engine::{token_loss_sum, MicroBatch, IGNORE_INDEX};
use std::collections::HashMap;

use crate::error::Result;
use crate::model::{arrange, Batch, Model, ParamSpec};

/// Tensors by name.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Trains `model` from `init`'s weights for one step per entry of `steps` (each a global
/// batch, as micro-batches concatenated into one forward); returns each step's loss and the
/// final weights (trained parameters, by name; frozen ones never change and are not returned).
pub fn plain_run(
    model: &dyn Model,
    init: &mut dyn FnMut(&ParamSpec) -> Result<Tensor>,
    steps: &[Vec<MicroBatch>],
    optimizer: &OptimizerConfig,
) -> Result<(Vec<f64>, NamedTensors)> {
    let (store, stored, frozen) = variables(model, init)?;
    let by_name: HashMap<String, Tensor> = stored
        .iter()
        .chain(&frozen)
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let params = arrange(model, &by_name)?;
    let mut opt = adamw(&store, model, optimizer)?;
    let total = steps.len() as u64;
    let mut losses = Vec::with_capacity(steps.len());
    for (step, micro) in steps.iter().enumerate() {
        let (tokens, targets, mut batch) = global_batch(micro);
        model.prepare(&mut batch);
        opt.zero_grad();
        let mut hidden = tokens.shallow_clone();
        for (block, p) in params.iter().enumerate() {
            hidden = model.forward(block, p, &hidden, &batch);
        }
        let count = targets.ne(IGNORE_INDEX).sum(Kind::Float);
        let loss = token_loss_sum(&hidden, &targets) / count;
        loss.backward();
        if optimizer.max_grad_norm > 0.0 {
            opt.clip_grad_norm(optimizer.max_grad_norm);
        }
        opt.set_lr(optimizer.lr_at(step as u64 + 1, total));
        opt.step();
        losses.push(loss.double_value(&[]));
    }
    let weights = stored.into_iter().map(|(name, t)| (name, t.detach().copy())).collect();
    Ok((losses, weights))
}

/// The model's parameters from `init`: trained ones as variables of a store (group 0:
/// weight decay, 1: none), frozen ones as plain tensors.
fn variables(
    model: &dyn Model,
    init: &mut dyn FnMut(&ParamSpec) -> Result<Tensor>,
) -> Result<(nn::VarStore, NamedTensors, NamedTensors)> {
    let store = nn::VarStore::new(Device::Cpu);
    let root = store.root();
    let mut stored = Vec::new();
    let mut frozen = Vec::new();
    for spec in model.blocks().iter().flatten().filter(|s| s.tied_to.is_none()) {
        let values = init(spec)?.to_kind(Kind::Float);
        if spec.frozen {
            // Not a variable: no gradient, no optimizer state.
            frozen.push((spec.name.clone(), values));
            continue;
        }
        let group = if spec.decays() { 0 } else { 1 };
        // VarStore names may not hold dots.
        let var = root.set_group(group).var_copy(&spec.name.replace('.', "_"), &values);
        stored.push((spec.name.clone(), var));
    }
    Ok((store, stored, frozen))
}

/// libtorch's AdamW over the store's variables, weight decay on the decaying group only.
fn adamw(store: &nn::VarStore, model: &dyn Model, optimizer: &OptimizerConfig) -> Result<nn::Optimizer> {
    let mut opt = nn::AdamW {
        beta1: optimizer.beta1,
        beta2: optimizer.beta2,
        wd: optimizer.weight_decay,
        eps: optimizer.eps,
        amsgrad: false,
    }
    .build(store, optimizer.lr)?;
    // A group exists once a variable is in it (a LoRA run's adapters are all matrices).
    let blocks = model.blocks();
    let trained = || blocks.iter().flatten().filter(|s| s.tied_to.is_none() && !s.frozen);
    if trained().any(|s| s.decays()) {
        opt.set_weight_decay_group(0, optimizer.weight_decay);
    }
    if trained().any(|s| !s.decays()) {
        opt.set_weight_decay_group(1, 0.0);
    }
    Ok(opt)
}

/// A step's micro-batches as one batch: tokens, targets and the batch (packed when the
/// micro-batches carry documents).
fn global_batch(micro: &[MicroBatch]) -> (Tensor, Tensor, Batch) {
    let cat = |pick: &dyn Fn(&MicroBatch) -> Tensor| Tensor::cat(&micro.iter().map(pick).collect::<Vec<_>>(), 0);
    let tokens = cat(&|m| m.tokens.shallow_clone());
    let targets = cat(&|m| m.targets.shallow_clone());
    let batch = match micro.first().and_then(|m| m.documents.as_ref()) {
        Some(_) => Batch::packed(
            &cat(&|m| {
                m.documents
                    .as_ref()
                    .map_or_else(|| m.tokens.zeros_like(), Tensor::shallow_clone)
            }),
            true,
        ),
        None => Batch::plain(&tokens),
    };
    (tokens, targets, batch)
}
