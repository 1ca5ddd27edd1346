//! The Llama family as a [`Model`]: `LlamaForCausalLM` (Llama 2/3, with Llama 3 rope
//! scaling), `MistralForCausalLM` and `Qwen2ForCausalLM`, with grouped-query attention
//! through libtorch's `scaled_dot_product_attention`, RMSNorm, rotary embeddings in
//! `transformers`' rotate-half convention and tied or untied embeddings. Parameter names
//! are the Hugging Face ones, so weights load from and save to `safetensors` files that
//! `transformers` reads.
//!
//! Blocks: the embedding, one per decoder layer, then the final norm with the LM head.

use regatta_trainer::{LlamaConfig, RopeScaling};
use std::collections::HashMap;

use regatta_trainer::{BaseQuantization, LoraConfig, PROJECTIONS};
use tch::{Device, Kind, Tensor};

use crate::attention::{self, Kernel, Segments};
use crate::model::{dropout, matmul_flops_per_token, Batch, Init, KvLayout, Model, ParamSpec};
use crate::packed::LinearGroup;
use crate::quant::QuantWeight;

/// The embedding's name, which a tied LM head points at.
const EMBED: &str = "model.embed_tokens.weight";

/// A Llama-family decoder.
#[derive(Clone, Debug)]
pub struct Llama {
    config: LlamaConfig,
    /// The `config.json` it came from (written back into checkpoints).
    json: serde_json::Value,
    inv_freq: Vec<f32>,
    /// `inv_freq` on each device a forward ran on, made once: a host-to-device copy
    /// each forward would cost a copy a step and cannot be part of a captured CUDA graph.
    inv_freq_on: OnDevice,
    /// Adapters on the targeted projections; the base is then frozen.
    lora: Option<LoraConfig>,
    /// QLoRA: the base's projection weights in 4 bits, by name (held here, not by the
    /// engine: every rank holds the whole quantized base).
    quantized: HashMap<String, QuantWeight>,
}

/// A tensor's copies on each device it was used on (a clone starts empty).
#[derive(Default)]
struct OnDevice(std::sync::Mutex<Vec<Tensor>>);

impl Clone for OnDevice {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for OnDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnDevice")
    }
}

/// Rotary inverse frequencies, with the config's scaling (as `transformers` computes them).
pub fn inverse_frequencies(config: &LlamaConfig) -> Vec<f32> {
    let dim = config.head_dim;
    (0..dim / 2)
        .map(|i| {
            let base = 1.0 / config.rope_theta.powf((2 * i) as f64 / dim as f64);
            let scaled = match config.rope_scaling {
                RopeScaling::Default => base,
                RopeScaling::Linear { factor } => base / factor,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: old,
                } => {
                    let wavelen = 2.0 * std::f64::consts::PI / base;
                    if wavelen < old / high_freq_factor {
                        base
                    } else if wavelen > old / low_freq_factor {
                        base / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * base / factor + smooth * base
                    }
                }
            };
            scaled as f32
        })
        .collect()
}

impl Llama {
    /// A model for a parsed config; `json` is the `config.json` it was parsed from.
    pub fn new(config: LlamaConfig, json: serde_json::Value) -> Self {
        let inv_freq = inverse_frequencies(&config);
        Self {
            config,
            json,
            inv_freq,
            inv_freq_on: OnDevice::default(),
            lora: None,
            quantized: HashMap::new(),
        }
    }

    /// The typed config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// A base parameter: frozen when the model carries adapters.
    fn base(&self, spec: ParamSpec) -> ParamSpec {
        if self.lora.is_some() {
            spec.frozen()
        } else {
            spec
        }
    }

    /// A projection's parameters: weight `[out, in]`, the bias when it has one, then the
    /// adapter's A `[r, in]` and B `[out, r]` when it is targeted.
    fn projection_specs(&self, specs: &mut Vec<ParamSpec>, module: &str, (out, inp): (i64, i64), bias: bool) {
        let proj = module.rsplit('.').next().unwrap_or(module);
        // A quantized base weight is the model's own (see `quantized_specs`).
        if !self.quantized_base() {
            specs.push(self.base(ParamSpec::new(
                format!("{module}.weight"),
                &[out, inp],
                Init::Normal(0.02),
            )));
        }
        if bias {
            specs.push(self.base(ParamSpec::new(format!("{module}.bias"), &[out], Init::Zeros)));
        }
        if let Some(lora) = self.lora.as_ref().filter(|l| l.targets(proj)) {
            let r = lora.rank as i64;
            let bound = 1.0 / (inp as f64).sqrt();
            specs.push(ParamSpec::new(
                format!("{module}.lora_A.weight"),
                &[r, inp],
                Init::Uniform(bound),
            ));
            specs.push(ParamSpec::new(
                format!("{module}.lora_B.weight"),
                &[out, r],
                Init::Zeros,
            ));
        }
    }

    /// Whether the base's projections are held quantized (QLoRA).
    fn quantized_base(&self) -> bool {
        self.lora
            .as_ref()
            .is_some_and(|l| l.base_quantization != BaseQuantization::None)
    }

    /// A projection weight's name.
    fn projection_weight(layer: usize, proj: usize) -> String {
        let module = if proj < 4 { "self_attn" } else { "mlp" };
        format!("model.layers.{layer}.{module}.{}.weight", PROJECTIONS[proj])
    }

    fn layer_specs(&self, layer: usize) -> Vec<ParamSpec> {
        let c = &self.config;
        let (d, i) = (c.hidden_size as i64, c.intermediate_size as i64);
        let (q, kv) = (
            (c.num_attention_heads * c.head_dim) as i64,
            (c.num_key_value_heads * c.head_dim) as i64,
        );
        let n = |name: &str| format!("model.layers.{layer}.{name}");
        let mut specs = vec![self.base(ParamSpec::new(n("input_layernorm.weight"), &[d], Init::Ones))];
        for (proj, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            self.projection_specs(&mut specs, &n(&format!("self_attn.{proj}")), (out, d), c.qkv_bias);
        }
        self.projection_specs(&mut specs, &n("self_attn.o_proj"), (d, q), false);
        specs.push(self.base(ParamSpec::new(n("post_attention_layernorm.weight"), &[d], Init::Ones)));
        self.projection_specs(&mut specs, &n("mlp.gate_proj"), (i, d), false);
        self.projection_specs(&mut specs, &n("mlp.up_proj"), (i, d), false);
        self.projection_specs(&mut specs, &n("mlp.down_proj"), (d, i), false);
        specs
    }

    /// `x W^T + b`, plus `scale * B(A(dropout(x)))` when `proj` carries an adapter; takes
    /// the projection's parameters from `next` in [`Self::projection_specs`] order.
    fn linear(
        &self,
        next: &mut std::slice::Iter<Tensor>,
        proj: usize,
        x: &Tensor,
        batch: &Batch,
        layer: usize,
    ) -> Tensor {
        let mut take = || {
            next.next()
                .expect("a Llama layer block holds every parameter its specs list")
        };
        let dequantized;
        let weight = if self.quantized_base() {
            let name = Self::projection_weight(layer, proj);
            let held = self
                .quantized
                .get(&name)
                .unwrap_or_else(|| panic!("the quantized base has no {name}: the engine loads every one first"));
            dequantized = held.dequantize(x.kind());
            &dequantized
        } else {
            take()
        };
        let bias = if self.config.qkv_bias && proj < 3 {
            Some(take())
        } else {
            None
        };
        let base = batch.linear(x, weight, bias);
        match self.lora.as_ref().filter(|l| l.targets(PROJECTIONS[proj])) {
            Some(lora) => {
                let (a, b) = (take(), take());
                let input = match batch.dropout_seed {
                    Some(seed) if lora.dropout > 0.0 => dropout(
                        x,
                        lora.dropout,
                        seed ^ ((layer as u64) << 8 | proj as u64).wrapping_mul(0x9e37_79b9),
                    ),
                    _ => x.shallow_clone(),
                };
                base + input.linear::<Tensor>(a, None).linear::<Tensor>(b, None) * lora.scale()
            }
            None => base,
        }
    }

    /// Projections `first..first + count` (consecutive, taking one input) as one packed
    /// product where the batch holds them as a group (see [`Model::linear_groups`]): their
    /// outputs, with `next` moved past their parameters. `None`, nothing taken: one by one.
    fn grouped(
        &self,
        next: &mut std::slice::Iter<Tensor>,
        first: usize,
        count: usize,
        x: &Tensor,
        batch: &Batch,
    ) -> Option<Vec<Tensor>> {
        if self.lora.is_some() {
            return None;
        }
        let outs = batch.linear_group(x, next.as_slice().first()?)?;
        let biased = |proj: usize| usize::from(self.config.qkv_bias && proj < 3);
        let taken: usize = (first..first + count).map(|proj| 1 + biased(proj)).sum();
        next.nth(taken - 1);
        Some(outs)
    }

    /// A layer block's weights (and biases) of projections `first..first + count`, where
    /// the block holds nothing else between them (no adapters, a float base).
    fn projection_group(&self, block: &[Tensor], first: usize, count: usize) -> Option<LinearGroup> {
        if self.lora.is_some() {
            return None;
        }
        let biased = |proj: usize| self.config.qkv_bias && proj < 3;
        // [input norm, q (+bias), k (+bias), v (+bias), o, post norm, gate, up, down].
        let start = |proj: usize| {
            let before: usize = (0..proj).map(|p| 1 + usize::from(biased(p))).sum();
            1 + before + usize::from(proj >= 4)
        };
        let mut group = LinearGroup {
            weights: Vec::new(),
            biases: Vec::new(),
        };
        for proj in first..first + count {
            let at = start(proj);
            group.weights.push(block.get(at)?.shallow_clone());
            if biased(proj) {
                group.biases.push(block.get(at + 1)?.shallow_clone());
            }
        }
        Some(group)
    }

    /// `transformers`' `LlamaRMSNorm`: `weight * (x / rms(x))`, computed in float32 and
    /// cast back to `x`'s kind before the weight. For float32 input and weight libtorch's
    /// `rms_norm` gives the same values and gradients bit for bit in one call (a decode
    /// step's 61 norms, one dispatch each instead of six); for other kinds it rounds
    /// differently (weight applied before the cast), so they take the ops one by one.
    /// (That one call still runs six kernels inside libtorch; a generation step on the CPU
    /// takes [`Self::fused_norm`]'s single pass instead.)
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, batch: &Batch) -> Tensor {
        if let Some((_, normed)) = self.fused_norm(x, None, weight, batch) {
            return normed;
        }
        let kind = x.kind();
        if kind == Kind::Float && weight.kind() == Kind::Float {
            let width = x.size().last().copied().expect("a hidden state has a width");
            return x.rms_norm([width], Some(weight), self.config.rms_norm_eps);
        }
        let x = x.to_kind(Kind::Float);
        let variance = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = &x * (variance + self.config.rms_norm_eps).rsqrt();
        weight * normed.to_kind(kind)
    }

    /// `residual + x` (where given) and its RMSNorm, in one pass per row by the shim
    /// (`shim::rms_norm`), where that fits: a generation step (the batch reads a KV cache)
    /// on float32 contiguous CPU tensors outside autograd. `None`: the caller's libtorch
    /// ops serve it. Only generation: the shim agrees with libtorch to ~1e-7, not bit for
    /// bit, and every other forward (training, scoring, a checkpoint's logits) must give
    /// the same values whether or not its weights take gradients.
    fn fused_norm(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        weight: &Tensor,
        batch: &Batch,
    ) -> Option<(Tensor, Tensor)> {
        batch.kv.as_ref()?;
        let fits = |t: &Tensor| {
            t.kind() == Kind::Float && t.device() == Device::Cpu && !t.requires_grad() && t.is_contiguous()
        };
        if !fits(x) || !fits(weight) || !residual.is_none_or(fits) {
            return None;
        }
        let (sum, normed) = crate::shim::rms_norm(x, residual, weight, self.config.rms_norm_eps).ok()?;
        Some((sum.unwrap_or_else(|| x.shallow_clone()), normed))
    }

    fn layer(&self, layer: usize, p: &[Tensor], x: &Tensor, batch: &Batch) -> Tensor {
        let c = &self.config;
        let (heads, kv_heads, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let mut next = p.iter();
        let norm_in = next.next().expect("a Llama layer block starts with its input norm");
        let h = self.rms_norm(x, norm_in, batch);
        // [batch, time, n_heads * hd], as the projections give them.
        let (q, k, v) = match self.grouped(&mut next, 0, 3, &h, batch).as_deref() {
            Some([q, k, v]) => (q.shallow_clone(), k.shallow_clone(), v.shallow_clone()),
            _ => {
                let mut project = |proj: usize| self.linear(&mut next, proj, &h, batch, layer);
                (project(0), project(1), project(2))
            }
        };
        let (cos, sin) = (&batch.derived[0], &batch.derived[1]);
        let (cos, sin) = (cos.to_kind(q.kind()), sin.to_kind(q.kind()));
        let scale = 1.0 / (hd as f64).sqrt();
        if let Some(kv) = &batch.kv {
            let projected = (&q, &k, &v);
            if let Some(attended) = kv.rope_store_and_attend(
                layer,
                projected,
                (&cos, &sin),
                &batch.positions,
                c.sliding_window,
                scale,
            ) {
                return self.finish_layer(&mut next, x, &attended, batch, layer);
            }
        }
        let heads_of = |t: &Tensor, n_heads: i64| t.unflatten(-1, [n_heads, hd]).transpose(1, 2);
        let (q, k, v) = (heads_of(&q, heads), heads_of(&k, kv_heads), heads_of(&v, kv_heads));
        let q = &q * &cos + rotate_half(&q) * &sin;
        let k = &k * &cos + rotate_half(&k) * &sin;
        if let Some(attended) = self.attend_without_mask(&q, &k, &v, batch, scale) {
            return self.finish_layer(&mut next, x, &attended, batch, layer);
        }
        let (k, v, mask) = match &batch.kv {
            // The cached path's mask already holds causality, lengths and the window.
            Some(kv) => {
                let (k, v) = kv.store_and_read(layer, &k, &v);
                (k, v, batch.mask.as_ref().map(Tensor::shallow_clone))
            }
            None => {
                let mask = batch.mask.as_ref().map(|m| self.windowed(m));
                let causal_window = match (&mask, c.sliding_window) {
                    (None, Some(_)) => Some(self.windowed(&causal(&q))),
                    _ => None,
                };
                (k, v, mask.or(causal_window))
            }
        };
        let attended = match (&batch.kv, &mask) {
            (Some(_), Some(mask)) if kv_heads != heads => grouped_attention(&q, &k, &v, mask, kv_heads, scale),
            _ => Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                mask.as_ref(),
                0.0,
                mask.is_none(),
                scale,
                kv_heads != heads,
            ),
        };
        self.finish_layer(&mut next, x, &attended, batch, layer)
    }

    /// The rest of a layer after attention: output projection, residual, MLP.
    fn finish_layer(
        &self,
        next: &mut std::slice::Iter<Tensor>,
        x: &Tensor,
        attended: &Tensor,
        batch: &Batch,
        layer: usize,
    ) -> Tensor {
        let attended = attended.transpose(1, 2).flatten(2, 3);
        let projected = self.linear(next, 3, &attended, batch, layer);
        let norm_post = next.next().expect("a Llama layer block holds its post-attention norm");
        let (h, m) = self
            .fused_norm(&projected, Some(x), norm_post, batch)
            .unwrap_or_else(|| {
                let h = x + projected;
                let m = self.rms_norm(&h, norm_post, batch);
                (h, m)
            });
        let (gate, up) = match self.grouped(next, 4, 2, &m, batch).as_deref() {
            Some([gate, up]) => (gate.shallow_clone(), up.shallow_clone()),
            _ => (
                self.linear(next, 4, &m, batch, layer),
                self.linear(next, 5, &m, batch, layer),
            ),
        };
        let activated = if gate.requires_grad() || up.requires_grad() {
            gate.silu() * up
        } else {
            // Outside autograd the product goes into silu's output: one allocation (and,
            // at a prefill's thousand tokens, its page faults) fewer a layer.
            let mut activated = gate.silu();
            let _ = activated.g_mul_(&up);
            activated
        };
        let mlp = self.linear(next, 6, &activated, batch, layer);
        h + mlp
    }

    /// Attention by segments where the batch carries no dense mask: packed documents (or
    /// plain rows under a sliding window) through FlashAttention's variable-length kernel
    /// on CUDA, or one document at a time where that kernel does not fit. `None`: the
    /// masked or plain causal path applies (a cached forward, a dense mask, or plain rows).
    fn attend_without_mask(&self, q: &Tensor, k: &Tensor, v: &Tensor, batch: &Batch, scale: f64) -> Option<Tensor> {
        if batch.kv.is_some() || batch.mask.is_some() {
            return None;
        }
        let window = self.config.sliding_window;
        let rows;
        let segments = match (&batch.segments, window) {
            (Some(segments), _) => segments,
            (None, Some(_)) => {
                let size = q.size();
                rows = Segments::rows(size[0] as usize, size[2] as usize);
                &rows
            }
            (None, None) => return None,
        };
        let kernel = Kernel::choose(q.device(), q.kind(), self.config.head_dim);
        Some(match kernel {
            Kernel::FlashVarlen => attention::flash_varlen(q, k, v, segments, scale, window).unwrap_or_else(|e| {
                panic!(
                    "FlashAttention's variable-length kernel failed on {:?} {:?}: {e}",
                    q.device(),
                    q.kind()
                )
            }),
            Kernel::DenseMask => attention::per_document(q, k, v, segments, scale, window),
        })
    }

    /// A sliding window (Mistral) narrows a mask to the last `window` keys.
    fn windowed(&self, mask: &Tensor) -> Tensor {
        match self.config.sliding_window {
            Some(window) => {
                let time = mask.size()[mask.dim() - 1];
                let recent = Tensor::ones([time, time], (Kind::Bool, mask.device())).triu(-(window as i64 - 1));
                mask.logical_and(&recent)
            }
            None => mask.shallow_clone(),
        }
    }
}

/// The plain causal mask `[time, time]` for queries `[batch, heads, time, dim]`.
fn causal(q: &Tensor) -> Tensor {
    let time = q.size()[2];
    Tensor::ones([time, time], (Kind::Bool, q.device())).tril(0)
}

/// Masked attention with grouped key/value heads, without copying keys and values once
/// per query head: the query heads that share a key/value head become extra query rows of
/// it (`[batch, kv_heads, group * time, dim]`, head `h` serving key/value head
/// `h / group` as `transformers`' `repeat_kv` has it), the mask `[batch, 1, time, keys]`
/// repeated for them. Up to 3x faster than libtorch's own grouped-query path on the CPU.
fn grouped_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, kv_heads: i64, scale: f64) -> Tensor {
    let (batch, heads, time, dim) = q.size4().expect("queries are [batch, heads, time, dim]");
    let group = heads / kv_heads;
    let q = q.reshape([batch, kv_heads, group * time, dim]);
    let mask = mask.repeat([1, 1, group, 1]);
    Tensor::scaled_dot_product_attention(&q, k, v, Some(&mask), 0.0, false, scale, false)
        .view([batch, heads, time, dim])
}

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    Tensor::cat(&[-x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1)
}

impl Model for Llama {
    fn blocks(&self) -> Vec<Vec<ParamSpec>> {
        let c = &self.config;
        let (v, d) = (c.vocab_size as i64, c.hidden_size as i64);
        let mut blocks = vec![vec![self.base(ParamSpec::new(EMBED, &[v, d], Init::Normal(0.02)))]];
        blocks.extend((0..c.num_hidden_layers).map(|layer| self.layer_specs(layer)));
        let head = if c.tie_word_embeddings {
            ParamSpec::tied("lm_head.weight", &[v, d], EMBED)
        } else {
            ParamSpec::new("lm_head.weight", &[v, d], Init::Normal(0.02))
        };
        blocks.push(vec![
            self.base(ParamSpec::new("model.norm.weight", &[d], Init::Ones)),
            self.base(head),
        ]);
        blocks
    }

    fn prepare(&self, batch: &mut Batch) {
        let device = batch.positions.device();
        let inv_freq = {
            let mut held = self.inv_freq_on.0.lock().unwrap_or_else(|p| p.into_inner());
            match held.iter().find(|t| t.device() == device) {
                Some(t) => t.shallow_clone(),
                None => {
                    // Kept for good, one per device: a captured graph reads this tensor.
                    let t = Tensor::from_slice(&self.inv_freq).to_device(device);
                    held.push(t.shallow_clone());
                    t
                }
            }
        };
        // [batch, time, dim / 2] -> [batch, 1, time, dim], as transformers builds them.
        let freqs = batch.positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1);
        batch.derived = vec![emb.cos(), emb.sin()];
    }

    fn forward(&self, block: usize, p: &[Tensor], input: &Tensor, batch: &Batch) -> Tensor {
        let last = self.config.num_hidden_layers + 1;
        if block == 0 {
            Tensor::embedding(&p[0], input, -1, false, false)
        } else if block == last {
            batch.linear(&self.rms_norm(input, &p[0], batch), &p[1], None)
        } else {
            self.layer(block - 1, p, input, batch)
        }
    }

    fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    fn attention_kernel(&self, device: tch::Device, kind: Kind) -> Kernel {
        Kernel::choose(device, kind, self.config.head_dim)
    }

    fn flops_per_token(&self, context: usize) -> f64 {
        let c = &self.config;
        // Scores and the weighted sum, forward (2 x 2) and backward (2 x 4), per layer.
        let attention = 12.0 * (c.num_hidden_layers * c.num_attention_heads * c.head_dim * context) as f64;
        matmul_flops_per_token(self, attention)
    }

    fn hf_config(&self) -> serde_json::Value {
        let mut json = self.json.clone();
        if let Some(object) = json.as_object_mut() {
            object.insert(
                "architectures".into(),
                serde_json::json!([self.config.architecture.class_name()]),
            );
            object
                .entry("model_type")
                .or_insert_with(|| self.config.architecture.model_type().into());
            // Checkpoints hold fp32 master weights.
            object.insert("torch_dtype".into(), "float32".into());
            object.insert("dtype".into(), "float32".into());
        }
        json
    }

    fn set_lora(&mut self, lora: &LoraConfig) -> crate::error::Result<()> {
        lora.validate()
            .map_err(|e| crate::error::Error::Invalid(e.to_string()))?;
        self.lora = Some(lora.clone());
        Ok(())
    }

    fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    fn quantized_specs(&self) -> Vec<ParamSpec> {
        (1..=self.config.num_hidden_layers)
            .flat_map(|block| self.quantized_block(block))
            .collect()
    }

    fn quantized_block(&self, block: usize) -> Vec<ParamSpec> {
        let c = &self.config;
        if !self.quantized_base() || !(1..=c.num_hidden_layers).contains(&block) {
            return Vec::new();
        }
        let (d, i) = (c.hidden_size as i64, c.intermediate_size as i64);
        let (q, kv) = (
            (c.num_attention_heads * c.head_dim) as i64,
            (c.num_key_value_heads * c.head_dim) as i64,
        );
        let shapes = [(q, d), (kv, d), (kv, d), (d, q), (i, d), (i, d), (d, i)];
        shapes
            .iter()
            .enumerate()
            .map(|(proj, (out, inp))| {
                ParamSpec::new(
                    Self::projection_weight(block - 1, proj),
                    &[*out, *inp],
                    Init::Normal(0.02),
                )
                .frozen()
            })
            .collect()
    }

    fn take_quantized(&mut self, name: &str) -> Option<QuantWeight> {
        self.quantized.remove(name)
    }

    fn put_quantized(&mut self, name: String, weight: QuantWeight) -> crate::error::Result<()> {
        if !self.quantized_base() {
            return Err(crate::error::Error::Invalid(format!(
                "{name} is not quantized: [lora] base_quantization is none"
            )));
        }
        self.quantized.insert(name, weight);
        Ok(())
    }

    fn dequantized(&self, name: &str) -> Option<Tensor> {
        self.quantized.get(name).map(|held| held.dequantize(Kind::Float))
    }

    fn set_quantized(&mut self, spec: &ParamSpec, weight: &Tensor, device: Device) -> crate::error::Result<()> {
        let Some(lora) = self.lora.as_ref().filter(|_| self.quantized_base()) else {
            return Err(crate::error::Error::Invalid(format!(
                "{} is not quantized: [lora] base_quantization is none",
                spec.name
            )));
        };
        if weight.size() != spec.shape {
            return Err(crate::error::Error::Invalid(format!(
                "{} has shape {:?}, the model needs {:?}",
                spec.name,
                weight.size(),
                spec.shape
            )));
        }
        let held = match lora.base_quantization.four_bit() {
            Some(kind) => QuantWeight::new(weight, kind, lora.quant_block_size, lora.double_quant, device),
            None => QuantWeight::new_int8(weight, device),
        }
        .map_err(|e| crate::error::Error::Invalid(format!("{}: {e}", spec.name)))?;
        self.quantized.insert(spec.name.clone(), held);
        Ok(())
    }

    fn take_stored(
        &mut self,
        spec: &ParamSpec,
        stored: &regatta_trainer::quant::Stored,
        device: Device,
    ) -> crate::error::Result<bool> {
        use regatta_trainer::quant::{Absmax, Stored};
        let Some(lora) = self.lora.as_ref().filter(|_| self.quantized_base()) else {
            return Ok(false);
        };
        let held = match stored {
            Stored::Four(q) => {
                let double = matches!(q.absmax, Absmax::Double { .. });
                let fits = lora.base_quantization.four_bit() == Some(q.kind)
                    && q.block == lora.quant_block_size
                    && double == lora.double_quant
                    && q.numel == spec.numel();
                fits.then(|| QuantWeight::from_quant(q, spec.shape.clone(), device))
            }
            Stored::Eight(q) => {
                let fits = lora.base_quantization == BaseQuantization::Int8
                    && spec.shape.len() == 2
                    && q.cols as i64 == spec.shape[1]
                    && q.codes.len() == spec.numel();
                fits.then(|| QuantWeight::from_int8(q, spec.shape.clone(), device))
            }
        };
        let taken = held.is_some();
        if let Some(held) = held {
            self.quantized.insert(spec.name.clone(), held);
        }
        Ok(taken)
    }

    fn holds_quantized(&self, name: &str) -> bool {
        self.quantized.contains_key(name)
    }

    fn quantized_bytes(&self) -> u64 {
        self.quantized.values().map(QuantWeight::bytes).sum()
    }

    fn linear_groups(&self, params: &[Vec<Tensor>]) -> Vec<LinearGroup> {
        let layers = params.iter().skip(1).take(self.config.num_hidden_layers);
        layers
            .flat_map(|block| [self.projection_group(block, 0, 3), self.projection_group(block, 4, 2)])
            .flatten()
            .collect()
    }

    fn attends_packed(&self) -> bool {
        true
    }

    fn kv_layout(&self) -> Option<KvLayout> {
        let c = &self.config;
        Some(KvLayout {
            layers: c.num_hidden_layers,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            sliding_window: c.sliding_window,
        })
    }
}
