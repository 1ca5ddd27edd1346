//! The Llama family as a [`Model`]: `LlamaForCausalLM` (Llama 2/3, with Llama 3 rope
//! scaling), `MistralForCausalLM` and `Qwen2ForCausalLM`, with grouped-query attention
//! through libtorch's `scaled_dot_product_attention`, RMSNorm, rotary embeddings in
//! `transformers`' rotate-half convention and tied or untied embeddings. Parameter names
//! are the Hugging Face ones, so weights load from and save to `safetensors` files that
//! `transformers` reads.
//!
//! Blocks: the embedding, one per decoder layer, then the final norm with the LM head.

use regatta_trainer::hf::{LlamaConfig, RopeScaling};
use tch::{Kind, Tensor};

use crate::model::{parameter_count, transformer_flops_per_token, Batch, Init, KvLayout, Model, ParamSpec};

/// The embedding's name, which a tied LM head points at.
const EMBED: &str = "model.embed_tokens.weight";

/// A Llama-family decoder.
#[derive(Clone, Debug)]
pub struct Llama {
    config: LlamaConfig,
    /// The `config.json` it came from (written back into checkpoints).
    json: serde_json::Value,
    inv_freq: Vec<f32>,
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
        Self { config, json, inv_freq }
    }

    /// The typed config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn layer_specs(&self, layer: usize) -> Vec<ParamSpec> {
        let c = &self.config;
        let (d, i) = (c.hidden_size as i64, c.intermediate_size as i64);
        let (q, kv) = (
            (c.num_attention_heads * c.head_dim) as i64,
            (c.num_key_value_heads * c.head_dim) as i64,
        );
        let std = 0.02;
        let n = |name: &str| format!("model.layers.{layer}.{name}");
        let mut specs = vec![ParamSpec::new(n("input_layernorm.weight"), &[d], Init::Ones)];
        for (proj, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            specs.push(ParamSpec::new(
                n(&format!("self_attn.{proj}.weight")),
                &[out, d],
                Init::Normal(std),
            ));
            if c.qkv_bias {
                specs.push(ParamSpec::new(
                    n(&format!("self_attn.{proj}.bias")),
                    &[out],
                    Init::Zeros,
                ));
            }
        }
        specs.extend([
            ParamSpec::new(n("self_attn.o_proj.weight"), &[d, q], Init::Normal(std)),
            ParamSpec::new(n("post_attention_layernorm.weight"), &[d], Init::Ones),
            ParamSpec::new(n("mlp.gate_proj.weight"), &[i, d], Init::Normal(std)),
            ParamSpec::new(n("mlp.up_proj.weight"), &[i, d], Init::Normal(std)),
            ParamSpec::new(n("mlp.down_proj.weight"), &[d, i], Init::Normal(std)),
        ]);
        specs
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        let kind = x.kind();
        let x = x.to_kind(Kind::Float);
        let variance = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = &x * (variance + self.config.rms_norm_eps).rsqrt();
        weight * normed.to_kind(kind)
    }

    fn layer(&self, layer: usize, p: &[Tensor], x: &Tensor, batch: &Batch) -> Tensor {
        let c = &self.config;
        let (heads, kv_heads, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let mut next = p.iter();
        let mut take = || {
            next.next()
                .expect("a Llama layer block holds every parameter its specs list")
        };
        let norm_in = take();
        let h = self.rms_norm(x, norm_in);
        let mut project = |n_heads: i64| {
            let weight = take();
            let bias = if c.qkv_bias { Some(take()) } else { None };
            h.linear(weight, bias).unflatten(-1, [n_heads, hd]).transpose(1, 2)
        };
        let (q, k, v) = (project(heads), project(kv_heads), project(kv_heads));
        let (cos, sin) = (&batch.derived[0], &batch.derived[1]);
        let (cos, sin) = (cos.to_kind(q.kind()), sin.to_kind(q.kind()));
        let q = &q * &cos + rotate_half(&q) * &sin;
        let k = &k * &cos + rotate_half(&k) * &sin;
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
        let attended = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            mask.as_ref(),
            0.0,
            mask.is_none(),
            1.0 / (hd as f64).sqrt(),
            kv_heads != heads,
        );
        let o_proj = take();
        let h = x + attended.transpose(1, 2).flatten(2, 3).linear::<Tensor>(o_proj, None);
        let norm_post = take();
        let m = self.rms_norm(&h, norm_post);
        let (gate, up, down) = (take(), take(), take());
        let mlp = (m.linear::<Tensor>(gate, None).silu() * m.linear::<Tensor>(up, None)).linear::<Tensor>(down, None);
        h + mlp
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

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    Tensor::cat(&[-x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1)
}

impl Model for Llama {
    fn blocks(&self) -> Vec<Vec<ParamSpec>> {
        let c = &self.config;
        let (v, d) = (c.vocab_size as i64, c.hidden_size as i64);
        let mut blocks = vec![vec![ParamSpec::new(EMBED, &[v, d], Init::Normal(0.02))]];
        blocks.extend((0..c.num_hidden_layers).map(|layer| self.layer_specs(layer)));
        let head = if c.tie_word_embeddings {
            ParamSpec::tied("lm_head.weight", &[v, d], EMBED)
        } else {
            ParamSpec::new("lm_head.weight", &[v, d], Init::Normal(0.02))
        };
        blocks.push(vec![ParamSpec::new("model.norm.weight", &[d], Init::Ones), head]);
        blocks
    }

    fn prepare(&self, batch: &mut Batch) {
        let device = batch.positions.device();
        let inv_freq = Tensor::from_slice(&self.inv_freq).to_device(device);
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
            self.rms_norm(input, &p[0]).linear::<Tensor>(&p[1], None)
        } else {
            self.layer(block - 1, p, input, batch)
        }
    }

    fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    fn flops_per_token(&self, context: usize) -> f64 {
        let c = &self.config;
        transformer_flops_per_token(
            parameter_count(self),
            c.num_hidden_layers,
            c.num_attention_heads * c.head_dim,
            context,
        )
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
