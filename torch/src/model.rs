//! Models as the ZeRO engine sees them: a sequence of blocks, each a function of its own
//! parameters and the previous block's output. The engine owns the parameters (flattened
//! per block, sharded by the ZeRO stage) and hands a block views of them when it runs, so
//! stage 3 can gather one block at a time. `gpt::Gpt` is the built-in model; a user's own tch
//! model implements [`LayeredModel`] the same way.

use std::collections::HashMap;
use std::sync::Arc;

use regatta_trainer::LoraConfig;
use tch::{Device, Kind, Tensor};

use crate::attention::{Kernel, Segments};
use crate::error::{Error, Result};
use crate::packed::{LinearGroup, PackedWeights};

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Uniform in `[-bound, bound]` (PEFT's `kaiming_uniform_(a=sqrt(5))` for LoRA's A is
    /// `bound = 1 / sqrt(fan_in)`).
    Uniform(f64),
}

/// One parameter of a block.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// Its name in checkpoints (Hugging Face / PyTorch style, dots).
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its initial values.
    pub init: Init,
    /// The parameter of an earlier block this one is (tied embeddings): it has no storage
    /// of its own, is not saved, and its gradient adds to the other's.
    pub tied_to: Option<String>,
    /// Loaded but never trained: no gradient, no optimizer state (a LoRA run's base).
    pub frozen: bool,
}

impl ParamSpec {
    /// A parameter with storage of its own.
    pub fn new(name: impl Into<String>, shape: &[i64], init: Init) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            init,
            tied_to: None,
            frozen: false,
        }
    }

    /// The same parameter, frozen.
    pub fn frozen(self) -> Self {
        Self { frozen: true, ..self }
    }

    /// A parameter that is `source` (same shape).
    pub fn tied(name: impl Into<String>, shape: &[i64], source: impl Into<String>) -> Self {
        Self {
            tied_to: Some(source.into()),
            ..Self::new(name, shape, Init::Zeros)
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<i64>() as usize
    }

    /// Whether weight decay applies: matrices do; norms and biases (vectors) do not.
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// What every block of one forward pass shares besides the hidden states: each token's
/// position (restarting at 0 for each packed document) and, for packed batches, which
/// positions a token may attend to. Models add their own per-batch tensors (rotary
/// tables) in [`Model::prepare`].
pub struct Batch {
    /// Position of every token, `[batch, time]`, int64.
    pub positions: Tensor,
    /// `[batch, 1, time, time]`, true where a query may attend to a key (causal and inside
    /// its document); `None`: plain causal attention, or packed documents attended by
    /// `segments` without a mask (FlashAttention's variable-length kernel on CUDA).
    pub mask: Option<Tensor>,
    /// Packed rows' documents as cumulative lengths (host data; see `attention`).
    pub segments: Option<Segments>,
    /// Tensors the model derived from the above.
    pub derived: Vec<Tensor>,
    /// Set when the forward runs against a KV cache: where the new tokens' keys and values
    /// go and which cached ones each row attends to; `mask` is then `[batch, 1, time,
    /// keys]` over those keys.
    pub kv: Option<KvStep>,
    /// Set while training with dropout: the seed of this forward's masks (the same for a
    /// block's recomputation, so backward sees the forward's masks).
    pub dropout_seed: Option<u64>,
    /// Set for inference on the CPU: the weights packed once in oneDNN's layout, used by
    /// [`Batch::linear`] in place of libtorch's `linear` (the same values).
    pub packed: Option<Arc<PackedWeights>>,
}

/// The shape of a model's attention cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Decoder layers (one key and one value cache each).
    pub layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// A query sees only this many most recent keys (Mistral's sliding window).
    pub sliding_window: Option<usize>,
}

/// The caches one cached forward reads and writes: per layer, keys and values of every
/// token slot (`[slots, kv_heads, head_dim]`, shared with the cache that owns them), the
/// slots the batch's new tokens are written to (`[batch * time]`) and the slots each row
/// attends to, in position order (`[batch, keys]`).
pub struct KvStep {
    /// Keys per layer.
    pub keys: Vec<Tensor>,
    /// Values per layer.
    pub values: Vec<Tensor>,
    /// Slots of the new tokens, row-major over `[batch, time]`.
    pub write: Tensor,
    /// Slots of the keys each row attends to.
    pub read: Tensor,
    /// How many of each row's `read` slots are real (`[batch]`, int64).
    pub lengths: Tensor,
    /// Whether attention may read the cache in place ([`KvStep::rope_store_and_attend`]).
    pub in_place: bool,
    /// Set when the step's tokens are packed into one row (`[1, tokens]`) rather than
    /// padded into `[batch, time]`: row `r`'s tokens are `offsets[r]..offsets[r + 1]`
    /// (`[batch + 1]`, int64), `write` and the positions run over the packed tokens. Only
    /// [`KvStep::rope_store_and_attend`] reads such a step; the caller sets it where that
    /// fits ([`KvStep::packs`]).
    pub offsets: Option<Tensor>,
}

/// The most new tokens per row for which attention reads the cache in place
/// ([`KvStep::rope_store_and_attend`]): decodes, and prompt chunks of short prompts, which
/// then go packed with no padding at all; longer chunks (a long prompt's prefill) go padded,
/// gather and take libtorch's flash kernel, whose products beat per-key dot products there.
pub const PAGED_MAX_TIME: i64 = 64;

impl KvStep {
    /// Stores layer `layer`'s new keys and values (`[batch, kv_heads, time, head_dim]`)
    /// in their slots and returns the keys and values the queries attend to,
    /// `[batch, kv_heads, keys, head_dim]`.
    pub fn store_and_read(&self, layer: usize, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        let (batch, heads, _, dim) = k.size4().expect("keys are [batch, heads, time, dim]");
        let keys = self.read.size()[1];
        self.store(layer, k, v);
        let exchange = |cache: &Tensor, new: &Tensor| {
            cache
                .index_select(0, &self.read.view([-1]))
                .view([batch, keys, heads, dim])
                .transpose(1, 2)
                .to_kind(new.kind())
        };
        (exchange(&self.keys[layer], k), exchange(&self.values[layer], v))
    }

    /// Stores layer `layer`'s new keys and values (`[batch, kv_heads, time, head_dim]`) in
    /// their slots.
    fn store(&self, layer: usize, k: &Tensor, v: &Tensor) {
        let (batch, heads, time, dim) = k.size4().expect("keys are [batch, heads, time, dim]");
        for (cache, new) in [(&self.keys[layer], k), (&self.values[layer], v)] {
            let rows = new
                .transpose(1, 2)
                .reshape([batch * time, heads, dim])
                .to_kind(cache.kind());
            let _ = cache.shallow_clone().index_copy_(0, &self.write, &rows);
        }
    }

    /// Rotates layer `layer`'s new queries and keys by `cos`/`sin` (`[batch, 1, time,
    /// head_dim]`), stores the keys and values in their slots and attends the queries at
    /// `positions` (`[batch, time]`) to each row's cached keys where they lie, in one call
    /// (`shim::rope_paged_attention`): no per-layer rotation ops, head transposes or gather
    /// of every row's keys. The projections as they come, `q` `[batch, time, heads *
    /// head_dim]`, `k` and `v` `[batch, time, kv_heads * head_dim]`. Float32 on the CPU, at
    /// most [`PAGED_MAX_TIME`] new tokens a row; returns `[batch, heads, time, head_dim]`.
    /// `None` (nothing stored): elsewhere, where rotation, [`KvStep::store_and_read`] and
    /// SDPA apply. `window`: Mistral's sliding window.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_store_and_attend(
        &self,
        layer: usize,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (cos, sin): (&Tensor, &Tensor),
        positions: &Tensor,
        window: Option<usize>,
        scale: f64,
    ) -> Option<Tensor> {
        let cache = &self.keys[layer];
        let fits = self.in_place
            && q.device() == Device::Cpu
            && [q, k, v, cos, sin].iter().all(|t| t.kind() == Kind::Float)
            && cache.kind() == Kind::Float
            && (self.offsets.is_some() || q.size().get(1).is_some_and(|&time| time <= PAGED_MAX_TIME));
        if !fits {
            // Packed tokens have no padded layout to fall back to: the caller packs only
            // where this fits.
            assert!(
                self.offsets.is_none(),
                "layer {layer}'s packed step does not fit the in-place kernel"
            );
            return None;
        }
        let attended = crate::shim::rope_paged_attention(&crate::shim::PagedLayer {
            query: q,
            key: k,
            value: v,
            cos,
            sin,
            key_cache: cache,
            value_cache: &self.values[layer],
            write: &self.write,
            read: &self.read,
            lengths: &self.lengths,
            positions,
            offsets: self.offsets.as_ref(),
            window: window.map(|w| w as i64),
            scale,
        })
        // The slots and lengths are the engine's own bookkeeping: a refusal here is a bug.
        .unwrap_or_else(|e| panic!("paged attention refused layer {layer}'s step: {e}"));
        Some(attended)
    }
}

impl KvStep {
    /// Whether a step of rows with these new-token counts (`chunks`) may go packed
    /// ([`KvStep::offsets`]) through the in-place kernel: float32 on the CPU, in-place
    /// attention allowed, and no row longer than [`PAGED_MAX_TIME`] (a longer prompt chunk
    /// goes padded through libtorch's flash kernel, whose products beat per-key dot
    /// products there).
    pub fn packs(in_place: bool, device: Device, kind: Kind, chunks: impl IntoIterator<Item = usize>) -> bool {
        in_place
            && device == Device::Cpu
            && kind == Kind::Float
            && chunks.into_iter().all(|n| (1..=PAGED_MAX_TIME as usize).contains(&n))
    }
}

impl Batch {
    /// `x Wᵀ + bias`: through the packed copy of `weight` where this batch carries one,
    /// else libtorch's `linear`.
    pub fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
        self.packed
            .as_ref()
            .and_then(|packed| packed.linear(x, weight, bias))
            .unwrap_or_else(|| x.linear(weight, bias))
    }

    /// The outputs of the packed group that starts with `first` for input `x`, by one
    /// product; `None` where this batch holds no such group.
    pub fn linear_group(&self, x: &Tensor, first: &Tensor) -> Option<Vec<Tensor>> {
        self.packed.as_ref()?.linear_group(x, first)
    }

    /// Unpacked rows: positions 0, 1, 2, ... and causal attention. Sizes are derived with
    /// tensor ops only, so a traced export accepts any `[batch, time]`.
    pub fn plain(tokens: &Tensor) -> Self {
        Self {
            positions: tokens.ones_like().cumsum(1, Kind::Int64) - 1,
            mask: None,
            segments: None,
            derived: Vec::new(),
            kv: None,
            dropout_seed: None,
            packed: None,
        }
    }

    /// Packed rows: `documents[b, t]` numbers the document token t of row b belongs to;
    /// positions restart at each document and attention stays inside it. The documents
    /// are kept as [`Segments`]; the dense `[batch, 1, time, time]` mask is built only
    /// with `dense_mask` (models whose kernel needs it: see `Model::attention_kernel`).
    pub fn packed(documents: &Tensor, dense_mask: bool) -> Self {
        let documents = documents.to_kind(Kind::Int64);
        let time = documents.size()[1];
        let flat = documents.to_device(tch::Device::Cpu).contiguous().view([-1]);
        let ids = Vec::<i64>::try_from(&flat).expect("an int64 CPU tensor converts to Vec<i64>");
        let segments = Some(Segments::from_documents(&ids, time as usize));
        let device = documents.device();
        let index = Tensor::arange(time, (Kind::Int64, device));
        // A document's first token: its index; carried forward with a running maximum.
        let changed = documents
            .narrow(1, 1, time - 1)
            .ne_tensor(&documents.narrow(1, 0, time - 1));
        let starts = Tensor::cat(&[documents.narrow(1, 0, 1).ones_like().to_kind(Kind::Bool), changed], 1);
        let start_index = index.unsqueeze(0).expand_as(&documents) * starts.to_kind(Kind::Int64);
        let (first, _) = start_index.cummax(1);
        let positions = index.unsqueeze(0) - first;
        let mask = dense_mask.then(|| {
            let same = documents.unsqueeze(2).eq_tensor(&documents.unsqueeze(1));
            let causal = Tensor::ones([time, time], (Kind::Bool, device)).tril(0);
            same.logical_and(&causal).unsqueeze(1)
        });
        Self {
            positions,
            mask,
            segments,
            derived: Vec::new(),
            kv: None,
            dropout_seed: None,
            packed: None,
        }
    }

    /// Moves the batch's tensors to `device`.
    pub fn to_device(self, device: tch::Device) -> Self {
        Self {
            positions: self.positions.to_device(device),
            mask: self.mask.map(|m| m.to_device(device)),
            segments: self.segments,
            derived: self.derived.into_iter().map(|t| t.to_device(device)).collect(),
            kv: self.kv,
            dropout_seed: self.dropout_seed,
            packed: self.packed,
        }
    }
}

/// A model the ZeRO engine trains, checkpoints save and the scorer runs: blocks in
/// forward order, each a function of its own parameters, the previous block's output and
/// the [`Batch`]. The first block takes token ids; the last gives logits `[batch, time,
/// vocab]`. The engine owns the parameters (flattened per block, sharded by the ZeRO
/// stage) and hands a block views of them when it runs, so stage 3 gathers one block at a
/// time.
pub trait Model: Send {
    /// Every block's parameters, in forward order.
    fn blocks(&self) -> Vec<Vec<ParamSpec>>;
    /// Adds the model's per-batch tensors (rotary tables) to `batch`.
    fn prepare(&self, _batch: &mut Batch) {}
    /// Runs block `block` with its parameters in [`Model::blocks`] order.
    fn forward(&self, block: usize, params: &[Tensor], input: &Tensor, batch: &Batch) -> Tensor;
    /// Token ids embedded.
    fn vocab(&self) -> usize;
    /// Training FLOPs per token (forward and backward) at `context` tokens, for MFU.
    fn flops_per_token(&self, context: usize) -> f64;
    /// The `config.json` checkpoints carry (Hugging Face layout).
    fn hf_config(&self) -> serde_json::Value;
    /// The attention cache's shape, for models whose blocks honour [`Batch::kv`] (block
    /// `1 + layer` is decoder layer `layer`); `None`: generation recomputes every window.
    fn kv_layout(&self) -> Option<KvLayout> {
        None
    }
    /// Whether every decoder layer attends through [`KvStep::rope_store_and_attend`], so a
    /// cached step may pack its rows' tokens into one row ([`KvStep::offsets`]) with no
    /// mask; `false`: cached steps go padded, with a mask.
    fn attends_packed(&self) -> bool {
        false
    }
    /// Weights of `params` that take one input and that the forward multiplies as one
    /// group where the batch holds them packed together ([`Batch::linear_group`]).
    fn linear_groups(&self, _params: &[Vec<Tensor>]) -> Vec<LinearGroup> {
        Vec::new()
    }
    /// Adds LoRA adapters ([`Model::blocks`] then lists them, and the base as frozen).
    fn set_lora(&mut self, _lora: &LoraConfig) -> Result<()> {
        Err(Error::Invalid(
            "LoRA adapters need a Llama-family model ([model] path or config); this model has none".into(),
        ))
    }
    /// The adapters' settings, when the model has them.
    fn lora(&self) -> Option<&LoraConfig> {
        None
    }
    /// How packed rows attend on `device` in `kind`: models that honour
    /// [`Batch::segments`] may run without the dense mask.
    fn attention_kernel(&self, _device: tch::Device, _kind: Kind) -> Kernel {
        Kernel::DenseMask
    }
    /// Frozen weights the model holds itself, quantized (QLoRA's base projections): what
    /// to load into [`Model::set_quantized`]. [`Model::blocks`] does not list them.
    fn quantized_specs(&self) -> Vec<ParamSpec> {
        Vec::new()
    }
    /// The quantized weights block `block`'s forward uses (a subset of
    /// [`Model::quantized_specs`]): with the block's own specs, the block's whole weights.
    fn quantized_block(&self, _block: usize) -> Vec<ParamSpec> {
        Vec::new()
    }
    /// Gives up a quantized weight the model holds (a ZeRO-3 rank packs a block's and
    /// keeps its slice; [`Model::put_quantized`] hands it back for the block's turn).
    fn take_quantized(&mut self, _name: &str) -> Option<crate::quant::QuantWeight> {
        None
    }
    /// Holds a quantized weight (one [`Model::take_quantized`] gave up).
    fn put_quantized(&mut self, name: String, _weight: crate::quant::QuantWeight) -> Result<()> {
        Err(Error::Invalid(format!("this model holds no quantized weight ({name})")))
    }
    /// A quantized weight the model holds, dequantized to f32 on its device.
    fn dequantized(&self, _name: &str) -> Option<Tensor> {
        None
    }
    /// Takes one of [`Model::quantized_specs`]'s weights (float, its shape) and holds it
    /// quantized on `device`.
    fn set_quantized(&mut self, spec: &ParamSpec, _weight: &Tensor, _device: Device) -> Result<()> {
        Err(Error::Invalid(format!(
            "this model holds no quantized weight ({})",
            spec.name
        )))
    }
    /// Takes one of [`Model::quantized_specs`]'s weights as a folder stored it quantized
    /// (bitsandbytes' 4 or 8 bits), when that is how the run holds it (same type, and for
    /// 4 bits the same block and double quantization): no quantization again. `false`:
    /// not taken.
    fn take_stored(
        &mut self,
        _spec: &ParamSpec,
        _stored: &regatta_trainer::quant::Stored,
        _device: Device,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Whether the model already holds this quantized weight.
    fn holds_quantized(&self, _name: &str) -> bool {
        false
    }
    /// Bytes of the quantized weights held.
    fn quantized_bytes(&self) -> u64 {
        0
    }
}

/// Logits of every position for token ids `[batch, time]` (unpacked, causal), with
/// parameters given per block.
pub fn logits(model: &dyn Model, params: &[Vec<Tensor>], tokens: &Tensor) -> Tensor {
    let mut batch = Batch::plain(tokens);
    model.prepare(&mut batch);
    let mut hidden = tokens.shallow_clone();
    for (block, block_params) in params.iter().enumerate() {
        hidden = model.forward(block, block_params, &hidden, &batch);
    }
    hidden
}

/// Lays the decoder layers' matrices out for inference on the CPU: each weight `[out, in]`
/// is stored transposed and contiguous (`[in, out]`) and handed back as its transpose, so
/// `linear` multiplies by a plain row-major matrix. libtorch's CPU GEMM is up to 2.8x
/// faster that way at decode batch sizes (SmolLM2's `down_proj` at 16 rows: 169 against
/// 60 GFLOP/s on a 2-core Sapphire Rapids); the values are the same, only the summation
/// order inside the kernel differs. The embedding and the head (the first and last blocks)
/// keep their layout: the head's product is fastest as it is. Other devices: unchanged.
pub fn inference_layout(params: Vec<Vec<Tensor>>, device: Device) -> Vec<Vec<Tensor>> {
    if device != Device::Cpu || params.len() < 3 {
        return params;
    }
    let last = params.len() - 1;
    params
        .into_iter()
        .enumerate()
        .map(|(block, tensors)| {
            if block == 0 || block == last {
                return tensors;
            }
            tensors
                .into_iter()
                .map(|w| {
                    if w.dim() == 2 {
                        w.transpose(0, 1).contiguous().transpose(0, 1)
                    } else {
                        w
                    }
                })
                .collect()
        })
        .collect()
}

/// Every block's parameters from the stored ones by name (a tied parameter is its
/// source's tensor), in [`Model::blocks`] order.
pub fn arrange(model: &dyn Model, stored: &HashMap<String, Tensor>) -> Result<Vec<Vec<Tensor>>> {
    model
        .blocks()
        .iter()
        .map(|block| {
            block
                .iter()
                .map(|spec| {
                    let name = spec.tied_to.as_ref().unwrap_or(&spec.name);
                    stored
                        .get(name)
                        .map(Tensor::shallow_clone)
                        .ok_or_else(|| Error::Invalid(format!("no weights for {name} (parameter {})", spec.name)))
                })
                .collect()
        })
        .collect()
}

/// Inverted dropout with a mask that is a pure function of `seed` and each element's
/// index (a 31-bit integer hash in tensor ops on the tensor's device): the same seed gives
/// the same mask, so a block recomputed for backward drops what its forward dropped.
/// Kept elements are scaled by `1 / (1 - p)`.
pub fn dropout(x: &Tensor, p: f64, seed: u64) -> Tensor {
    const MASK: i64 = 0x7fff_ffff;
    // The hash runs in int64 over at most this many elements at a time: a projection's
    // input on a GPU (16M elements at 8 x 2048 x 1024) would otherwise take 128 MiB of
    // indices and as much again per temporary; the mask itself is one byte an element.
    const CHUNK: i64 = 1 << 22;
    let mix = |h: Tensor, shift: i64, factor: i64| {
        let h = h.bitwise_xor_tensor(&h.bitwise_right_shift_tensor_scalar(shift));
        (h * factor).bitwise_and(MASK)
    };
    let salt = ((seed ^ (seed >> 31) ^ (seed >> 62)) & MASK as u64) as i64;
    let threshold = (p * (1u64 << 31) as f64) as i64;
    let numel = x.numel() as i64;
    if numel == 0 {
        return x.shallow_clone();
    }
    let mut parts = Vec::new();
    let mut start = 0;
    while start < numel {
        let len = CHUNK.min(numel - start);
        let index = Tensor::arange_start(start, start + len, (Kind::Int64, x.device()));
        let h = ((index * 0x9e37_79b1_i64) + salt).bitwise_and(MASK);
        let h = mix(h, 15, 0x2c1b_3c6d);
        let h = mix(h, 12, 0x297a_2d39);
        let h = h.bitwise_xor_tensor(&h.bitwise_right_shift_tensor_scalar(15));
        parts.push(h.ge(threshold));
        start += len;
    }
    let keep = if parts.len() == 1 {
        parts.remove(0)
    } else {
        Tensor::cat(&parts, 0)
    };
    let keep = keep.view(x.size().as_slice());
    x * keep.to_kind(x.kind()) * (1.0 / (1.0 - p))
}

/// Parameters of a model (tied ones counted once).
pub fn parameter_count(model: &dyn Model) -> u64 {
    weight_specs(model)
        .iter()
        .filter(|p| p.tied_to.is_none())
        .map(|p| p.numel() as u64)
        .sum()
}

/// Every weight of the model: the engine's ([`Model::blocks`], in order) and then those
/// the model holds quantized itself ([`Model::quantized_specs`]).
pub fn weight_specs(model: &dyn Model) -> Vec<ParamSpec> {
    let mut specs: Vec<ParamSpec> = model.blocks().into_iter().flatten().collect();
    specs.extend(model.quantized_specs());
    specs
}

/// 6 FLOPs per parameter and token plus attention's score and value products.
pub fn transformer_flops_per_token(params: u64, layers: usize, attention_width: usize, context: usize) -> f64 {
    6.0 * params as f64 + 12.0 * layers as f64 * attention_width as f64 * context as f64
}

/// Training FLOPs per token counted as MFU counts them: each matrix a token meets costs 2
/// FLOPs per weight forward and 4 backward (input and weight gradients), a frozen one 2 + 2
/// (no weight gradient: 4N, not 6N, for a LoRA run's base); the first block's tables are
/// lookups and count nothing unless a later block ties to them (the LM head); vectors
/// (norms, biases) count nothing. Plus attention's `attention_flops` (scores and values).
pub fn matmul_flops_per_token(model: &dyn Model, attention_flops: f64) -> f64 {
    let mut blocks = model.blocks();
    // A quantized base multiplies like any frozen one (dequantized, in the compute dtype).
    blocks.push(model.quantized_specs());
    let weights: f64 = blocks
        .iter()
        .enumerate()
        .flat_map(|(b, block)| block.iter().map(move |spec| (b, spec)))
        .filter(|(b, spec)| spec.shape.len() == 2 && (*b > 0 || spec.tied_to.is_some()))
        .map(|(_, spec)| {
            let numel = spec.shape.iter().product::<i64>() as f64;
            if spec.frozen {
                4.0 * numel
            } else {
                6.0 * numel
            }
        })
        .sum();
    weights + attention_flops
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: every row's keys gathered into a padded batch, repeated per query head,
    /// and libtorch's SDPA under the dense mask the generator builds (causal by position,
    /// below the row's length, inside the window).
    fn gathered(
        q: &Tensor,
        caches: (&Tensor, &Tensor),
        read: &Tensor,
        lengths: &Tensor,
        positions: &Tensor,
        window: Option<i64>,
        scale: f64,
    ) -> Tensor {
        let (rows, heads, time, _) = q.size4().unwrap();
        let keys = read.size()[1];
        let kv_heads = caches.0.size()[1];
        let take = |cache: &Tensor| {
            cache
                .index_select(0, &read.view([-1]))
                .view([rows, keys, kv_heads, -1])
                .transpose(1, 2)
                .repeat_interleave_self_int(heads / kv_heads, Some(1), None)
        };
        let key_index = Tensor::arange(keys, (Kind::Int64, Device::Cpu)).view([1, 1, 1, keys]);
        let query_position = positions.view([rows, 1, time, 1]);
        let mut mask = key_index
            .le_tensor(&query_position)
            .logical_and(&key_index.lt_tensor(&lengths.view([rows, 1, 1, 1])));
        if let Some(window) = window {
            mask = mask.logical_and(&key_index.gt_tensor(&(&query_position - window)));
        }
        Tensor::scaled_dot_product_attention(
            q,
            &take(caches.0),
            &take(caches.1),
            Some(&mask),
            0.0,
            false,
            scale,
            false,
        )
    }

    fn case(heads: i64, kv_heads: i64, dim: i64, time: i64, window: Option<i64>) {
        tch::manual_seed(7);
        let (rows, keys, slots) = (4i64, 11i64, 64i64);
        let opts = (Kind::Float, Device::Cpu);
        let k_cache = Tensor::randn([slots, kv_heads, dim], opts);
        let v_cache = Tensor::randn([slots, kv_heads, dim], opts);
        let q = Tensor::randn([rows, heads, time, dim], opts);
        // Rows of different lengths over shuffled slots; unused read entries point at 0.
        let lengths = [11i64, 4, 9, 1];
        let mut read = Vec::new();
        let mut positions = Vec::new();
        for (r, &length) in lengths.iter().enumerate() {
            read.extend((0..keys).map(|j| {
                if j < length {
                    (j * 5 + r as i64 * 13 + 3) % slots
                } else {
                    0
                }
            }));
            // The row's last `time` positions; a row shorter than that pads with 0s as the
            // generator does.
            positions.extend((0..time).map(|t| (length - time + t).max(0)));
        }
        let read = Tensor::from_slice(&read).view([rows, keys]);
        let lengths = Tensor::from_slice(&lengths);
        let positions = Tensor::from_slice(&positions).view([rows, time]);
        let scale = 1.0 / (dim as f64).sqrt();
        let paged = crate::shim::paged_attention(&q, &k_cache, &v_cache, &read, &lengths, &positions, window, scale)
            .expect("the kernel takes these");
        let reference = gathered(&q, (&k_cache, &v_cache), &read, &lengths, &positions, window, scale);
        assert_eq!(paged.size(), reference.size());
        let worst = (&paged - &reference).abs().max().double_value(&[]);
        assert!(
            worst < 1e-5,
            "heads {heads}/{kv_heads} dim {dim} time {time} window {window:?}: {worst}"
        );
    }

    /// Held by tests that change the kernel's instruction width (a process-wide setting)
    /// or compare two kernel calls bit for bit: tests run on several threads at once.
    static WIDEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn paged_attention_equals_gathered_sdpa() {
        let _width = WIDEST.lock().unwrap_or_else(|p| p.into_inner());
        // Every instruction width this CPU has (plain C++, AVX2, AVX-512, then AVX-512 with
        // the register kernel for head sizes 64 and 128), the default last.
        for widest in [0, 1, 2, 3] {
            crate::shim::paged_attention_widest(widest);
            case(6, 2, 64, 1, None); // grouped query heads, one decode token
            case(4, 4, 64, 1, Some(3)); // a sliding window
            case(6, 3, 20, 3, None); // a head size off the vector width, three new tokens
            case(2, 1, 128, 2, Some(5));
            case(8, 2, 64, 4, None); // four query heads a key/value head, four new tokens
            case(8, 2, 128, 1, None); // a group too wide for the register kernel
            case(3, 1, 40, 1, None); // 40 = 32 + 8: every tail of the wide loops
        }
    }

    /// `transformers`' rotation, by libtorch's ops as the unfused path has it.
    fn rotated(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let half = x.size()[3] / 2;
        let turned = Tensor::cat(&[-x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1);
        x * cos + turned * sin
    }

    #[test]
    fn rope_store_and_attend_equals_rotation_store_and_read_then_sdpa() {
        tch::manual_seed(3);
        let opts = (Kind::Float, Device::Cpu);
        let (rows, heads, kv_heads, dim, slots) = (2i64, 4i64, 2i64, 16i64, 32i64);
        // Row 0 holds 5 tokens (slots 10..15), row 1 holds 3 (slots 20..23); the newest
        // `time` of each are written now.
        for time in [1i64, 3] {
            let cache = || Tensor::randn([slots, kv_heads, dim], opts);
            let (keys, values) = (cache(), cache());
            let (ref_keys, ref_values) = (keys.copy(), values.copy());
            let write: Vec<i64> = [15 - time..15, 23 - time..23].into_iter().flatten().collect();
            let positions: Vec<i64> = [5 - time..5, 3 - time..3].into_iter().flatten().collect();
            let step = |keys: &Tensor, values: &Tensor| KvStep {
                keys: vec![keys.shallow_clone()],
                values: vec![values.shallow_clone()],
                write: Tensor::from_slice(&write),
                read: Tensor::from_slice(&[10i64, 11, 12, 13, 14, 20, 21, 22, 0, 0]).view([rows, 5]),
                lengths: Tensor::from_slice(&[5i64, 3]),
                in_place: true,
                offsets: None,
            };
            let (fused, reference_step) = (step(&keys, &values), step(&ref_keys, &ref_values));
            let positions = Tensor::from_slice(&positions).view([rows, time]);
            // One grouped product's outputs: views a whole group's width apart.
            let width = (heads + 2 * kv_heads) * dim;
            let projected = Tensor::randn([rows, time, width], opts);
            let parts = projected.split_with_sizes([heads * dim, kv_heads * dim, kv_heads * dim], -1);
            let angles = Tensor::rand([rows, 1, time, dim], opts) * 6.0;
            let (cos, sin) = (angles.cos(), angles.sin());
            let paged = fused
                .rope_store_and_attend(
                    0,
                    (&parts[0], &parts[1], &parts[2]),
                    (&cos, &sin),
                    &positions,
                    None,
                    0.25,
                )
                .expect("float32 on the CPU");
            let heads_of = |t: &Tensor, n: i64| t.unflatten(-1, [n, dim]).transpose(1, 2);
            let q = rotated(&heads_of(&parts[0], heads), &cos, &sin);
            let k = rotated(&heads_of(&parts[1], kv_heads), &cos, &sin);
            let v = heads_of(&parts[2], kv_heads);
            let _ = reference_step.store_and_read(0, &k, &v);
            // The rotated keys and the values landed in their slots, rounded as libtorch's
            // ops round them.
            assert!(keys.equal(&ref_keys), "time {time}: stored keys differ");
            assert!(values.equal(&ref_values), "time {time}: stored values differ");
            let reference = gathered(
                &q,
                (&ref_keys, &ref_values),
                &reference_step.read,
                &reference_step.lengths,
                &positions,
                None,
                0.25,
            );
            let worst = (&paged - &reference).abs().max().double_value(&[]);
            assert!(worst < 1e-5, "time {time}: {worst}");
        }
        // Longer chunks and other kinds go the unfused way, storing nothing.
        let (keys, values) = (Tensor::zeros([8, 1, 8], opts), Tensor::zeros([8, 1, 8], opts));
        let step = KvStep {
            keys: vec![keys.shallow_clone()],
            values: vec![values.shallow_clone()],
            write: Tensor::from_slice(&[1i64]),
            read: Tensor::from_slice(&[0i64, 1]).view([1, 2]),
            lengths: Tensor::from_slice(&[2i64]),
            in_place: true,
            offsets: None,
        };
        let x = |time: i64| Tensor::ones([1, time, 8], opts);
        let rot = |time: i64| Tensor::ones([1, 1, time, 8], opts);
        let long = PAGED_MAX_TIME + 1;
        let positions = Tensor::zeros([1, long], (Kind::Int64, Device::Cpu));
        assert!(step
            .rope_store_and_attend(
                0,
                (&x(long), &x(long), &x(long)),
                (&rot(long), &rot(long)),
                &positions,
                None,
                1.0
            )
            .is_none());
        let half = x(1).to_kind(Kind::BFloat16);
        let positions = Tensor::from_slice(&[1i64]).view([1, 1]);
        assert!(step
            .rope_store_and_attend(0, (&half, &x(1), &x(1)), (&rot(1), &rot(1)), &positions, None, 1.0)
            .is_none());
        assert_eq!(keys.abs().sum(Kind::Float).double_value(&[]), 0.0, "nothing stored");
        // A write slot outside the cache is refused before anything is stored.
        let outside = crate::shim::rope_paged_attention(&crate::shim::PagedLayer {
            query: &x(1),
            key: &x(1),
            value: &x(1),
            cos: &rot(1),
            sin: &rot(1),
            key_cache: &keys,
            value_cache: &values,
            write: &Tensor::from_slice(&[8i64]),
            read: &step.read,
            lengths: &step.lengths,
            positions: &positions,
            offsets: None,
            window: None,
            scale: 1.0,
        })
        .expect_err("slot 8 of 8");
        assert!(outside.to_string().contains("outside the cache"), "{outside}");
        assert_eq!(keys.abs().sum(Kind::Float).double_value(&[]), 0.0, "nothing stored");
    }

    #[test]
    fn packed_tokens_attend_as_padded_rows() {
        let _width = WIDEST.lock().unwrap_or_else(|p| p.into_inner());
        tch::manual_seed(5);
        let opts = (Kind::Float, Device::Cpu);
        let (heads, kv_heads, dim, slots) = (6i64, 2i64, 64i64, 32i64);
        let width = (heads + 2 * kv_heads) * dim;
        // Row 0 writes its last 3 of 5 tokens (slots 12..15), row 1 its last of 3 (slot 22);
        // padded, row 1's two padding tokens write the scratch slots 30 and 31.
        let row0 = Tensor::randn([1, 3, width], opts);
        let row1 = Tensor::randn([1, 1, width], opts);
        let angles = Tensor::rand([1, 1, 4, dim], opts) * 6.0;
        let cache = Tensor::randn([slots, kv_heads, dim], opts);
        let step = |offsets: Option<&[i64]>, write: &[i64], keys: &Tensor, values: &Tensor| KvStep {
            keys: vec![keys.shallow_clone()],
            values: vec![values.shallow_clone()],
            write: Tensor::from_slice(write),
            read: Tensor::from_slice(&[10i64, 11, 12, 13, 14, 20, 21, 22, 0, 0]).view([2, 5]),
            lengths: Tensor::from_slice(&[5i64, 3]),
            in_place: true,
            offsets: offsets.map(Tensor::from_slice),
        };
        let (packed_keys, packed_values) = (cache.copy(), cache.copy() * 2.0);
        let packed = step(Some(&[0, 3, 4]), &[12, 13, 14, 22], &packed_keys, &packed_values);
        let tokens = Tensor::cat(&[&row0, &row1], 1);
        let parts = tokens.split_with_sizes([heads * dim, kv_heads * dim, kv_heads * dim], -1);
        let (cos, sin) = (angles.cos(), angles.sin());
        let positions = Tensor::from_slice(&[2i64, 3, 4, 2]);
        let out = packed
            .rope_store_and_attend(
                0,
                (&parts[0], &parts[1], &parts[2]),
                (&cos, &sin),
                &positions,
                None,
                0.125,
            )
            .expect("packed float32 on the CPU");
        assert_eq!(out.size(), [1, heads, 4, dim]);

        let (padded_keys, padded_values) = (cache.copy(), cache.copy() * 2.0);
        let padded = step(None, &[12, 13, 14, 22, 30, 31], &padded_keys, &padded_values);
        let tokens = Tensor::cat(
            &[&row0, &Tensor::cat(&[&row1, &Tensor::zeros([1, 2, width], opts)], 1)],
            0,
        );
        let parts = tokens.split_with_sizes([heads * dim, kv_heads * dim, kv_heads * dim], -1);
        let pad_angles = |a: &Tensor| {
            let second = Tensor::cat(&[a.narrow(2, 3, 1), Tensor::zeros([1, 1, 2, dim], opts)], 2);
            Tensor::cat(&[&a.narrow(2, 0, 3), &second], 0).contiguous()
        };
        let (cos, sin) = (pad_angles(&cos), pad_angles(&sin));
        let positions = Tensor::from_slice(&[2i64, 3, 4, 2, 0, 0]).view([2, 3]);
        let reference = padded
            .rope_store_and_attend(
                0,
                (&parts[0], &parts[1], &parts[2]),
                (&cos, &sin),
                &positions,
                None,
                0.125,
            )
            .expect("padded float32 on the CPU");
        // The same keys in the same slots, and the same outputs for every real token.
        let real = Tensor::from_slice(&[10i64, 11, 12, 13, 14, 20, 21, 22]);
        assert!(packed_keys
            .index_select(0, &real)
            .equal(&padded_keys.index_select(0, &real)));
        assert!(packed_values
            .index_select(0, &real)
            .equal(&padded_values.index_select(0, &real)));
        assert!(out.narrow(2, 0, 3).equal(&reference.narrow(0, 0, 1)), "row 0");
        assert!(
            out.narrow(2, 3, 1).equal(&reference.narrow(0, 1, 1).narrow(2, 0, 1)),
            "row 1"
        );
        // Refused before anything is stored: offsets that fall, one position too few, a read
        // slot outside the cache.
        let parts = Tensor::cat(&[&row0, &row1], 1).split_with_sizes([heads * dim, kv_heads * dim, kv_heads * dim], -1);
        let (keys, values) = (
            Tensor::zeros([slots, kv_heads, dim], opts),
            Tensor::zeros([slots, kv_heads, dim], opts),
        );
        let outside = Tensor::from_slice(&[10i64, 11, 12, 13, 14, 20, 21, 40, 0, 0]).view([2, 5]);
        let good_read = packed.read.shallow_clone();
        let four = Tensor::from_slice(&[2i64, 3, 4, 2]);
        let three = Tensor::from_slice(&[2i64, 3, 4]);
        let (rising, falling) = (Tensor::from_slice(&[0i64, 3, 4]), Tensor::from_slice(&[0i64, 5, 4]));
        for (offsets, positions, read, why) in [
            (&falling, &four, &good_read, "offsets"),
            (&rising, &three, &good_read, "positions"),
            (&rising, &four, &outside, "outside the cache"),
        ] {
            let error = crate::shim::rope_paged_attention(&crate::shim::PagedLayer {
                query: &parts[0],
                key: &parts[1],
                value: &parts[2],
                cos: &angles.cos(),
                sin: &angles.sin(),
                key_cache: &keys,
                value_cache: &values,
                write: &packed.write,
                read,
                lengths: &packed.lengths,
                positions,
                offsets: Some(offsets),
                window: None,
                scale: 0.125,
            })
            .expect_err(why);
            assert!(error.to_string().contains(why), "{why}: {error}");
            let stored =
                keys.abs().sum(Kind::Float).double_value(&[]) + values.abs().sum(Kind::Float).double_value(&[]);
            assert_eq!(stored, 0.0, "{why}: nothing stored");
        }
    }

    #[test]
    fn paged_attention_refuses_bad_slots_and_kinds() {
        let opts = (Kind::Float, Device::Cpu);
        let cache = Tensor::zeros([8, 1, 8], opts);
        let q = Tensor::zeros([1, 1, 1, 8], opts);
        let lengths = Tensor::from_slice(&[2i64]);
        let positions = Tensor::from_slice(&[1i64]).view([1, 1]);
        let outside = Tensor::from_slice(&[0i64, 8]).view([1, 2]);
        let error = crate::shim::paged_attention(&q, &cache, &cache, &outside, &lengths, &positions, None, 1.0)
            .expect_err("slot 8 of 8");
        assert!(error.to_string().contains("outside the cache"), "{error}");
        let read = Tensor::from_slice(&[0i64, 1]).view([1, 2]);
        let doubles = q.to_kind(Kind::Double);
        let error = crate::shim::paged_attention(&doubles, &cache, &cache, &read, &lengths, &positions, None, 1.0)
            .expect_err("float64");
        assert!(error.to_string().contains("float32"), "{error}");
    }
}
