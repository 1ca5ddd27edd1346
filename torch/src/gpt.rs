//! The built-in GPT-style decoder ([`Gpt`]): the model a run without a model folder
//! trains, over bytes or a tokenizer's ids, and what a checkpoint of one holds
//! (`architectures = [GPT_ARCHITECTURE]` in its `config.json`).

use regatta_trainer::ModelConfig;
use tch::{Kind, Tensor};

use crate::model::{parameter_count, transformer_flops_per_token, Batch, Init, KvLayout, Model, ParamSpec};

/// `architectures` in the `config.json` of a built-in GPT checkpoint.
pub const GPT_ARCHITECTURE: &str = "RegattaGptForCausalLM";

/// The built-in GPT-style decoder: token and position embeddings, pre-norm transformer
/// blocks (causal self-attention and a GELU MLP), a final norm and an untied head.
#[derive(Clone, Debug)]
pub struct Gpt {
    config: ModelConfig,
    vocab: usize,
}

impl Gpt {
    /// A GPT of this shape over `vocab` tokens.
    pub fn new(config: ModelConfig, vocab: usize) -> Self {
        Self { config, vocab }
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The shape and vocabulary of a checkpoint's `config.json`.
    pub fn from_hf_config(config: &serde_json::Value) -> Option<Self> {
        let field = |name: &str| config.get(name).and_then(serde_json::Value::as_u64).map(|n| n as usize);
        Some(Self::new(
            ModelConfig {
                layers: field("layers")?,
                width: field("width")?,
                heads: field("heads")?,
                context: field("context")?,
                ..ModelConfig::default()
            },
            field("vocab_size")?,
        ))
    }

    // Batch and time sizes are never read here (only derived by tensor ops), so a traced
    // TorchScript export of the model accepts any [batch, time].
    fn attention(&self, layer: usize, x: &Tensor, p: &[Tensor], batch: &Batch) -> Tensor {
        let d = self.config.width as i64;
        let heads = self.config.heads as i64;
        let hd = d / heads;
        let qkv = batch.linear(x, &p[0], Some(&p[1]));
        let parts = qkv.split(d, 2);
        let shape = |z: &Tensor| z.unflatten(-1, [heads, hd]).transpose(1, 2);
        let (q, k, v) = (shape(&parts[0]), shape(&parts[1]), shape(&parts[2]));
        let (k, v) = match &batch.kv {
            Some(kv) => kv.store_and_read(layer, &k, &v),
            None => (k, v),
        };
        let scores = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hd as f64).sqrt());
        let blocked = match &batch.mask {
            Some(mask) => mask.logical_not(),
            // [time, time], true above the diagonal.
            None => scores.get(0).get(0).ones_like().triu(1).to_kind(Kind::Bool),
        };
        let weights = scores
            .masked_fill(&blocked, f64::NEG_INFINITY)
            .softmax(-1, scores.kind());
        let attended = weights.matmul(&v).transpose(1, 2).flatten(2, 3);
        batch.linear(&attended, &p[2], Some(&p[3]))
    }
}

fn norm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Tensor {
    let width = *x.size().last().expect("hidden states have a last dimension");
    x.layer_norm([width], Some(weight), Some(bias), 1e-5, false)
}

impl Model for Gpt {
    fn blocks(&self) -> Vec<Vec<ParamSpec>> {
        let (v, d, t) = (self.vocab as i64, self.config.width as i64, self.config.context as i64);
        let std = 0.02;
        let residual_std = 0.02 / (2.0 * self.config.layers as f64).sqrt();
        let mut blocks = vec![vec![
            ParamSpec::new("wte.weight", &[v, d], Init::Normal(std)),
            ParamSpec::new("wpe.weight", &[t, d], Init::Normal(std)),
        ]];
        for layer in 0..self.config.layers {
            let n = |name: &str| format!("h.{layer}.{name}");
            blocks.push(vec![
                ParamSpec::new(n("ln_1.weight"), &[d], Init::Ones),
                ParamSpec::new(n("ln_1.bias"), &[d], Init::Zeros),
                ParamSpec::new(n("attn.c_attn.weight"), &[3 * d, d], Init::Normal(std)),
                ParamSpec::new(n("attn.c_attn.bias"), &[3 * d], Init::Zeros),
                ParamSpec::new(n("attn.c_proj.weight"), &[d, d], Init::Normal(residual_std)),
                ParamSpec::new(n("attn.c_proj.bias"), &[d], Init::Zeros),
                ParamSpec::new(n("ln_2.weight"), &[d], Init::Ones),
                ParamSpec::new(n("ln_2.bias"), &[d], Init::Zeros),
                ParamSpec::new(n("mlp.c_fc.weight"), &[4 * d, d], Init::Normal(std)),
                ParamSpec::new(n("mlp.c_fc.bias"), &[4 * d], Init::Zeros),
                ParamSpec::new(n("mlp.c_proj.weight"), &[d, 4 * d], Init::Normal(residual_std)),
                ParamSpec::new(n("mlp.c_proj.bias"), &[d], Init::Zeros),
            ]);
        }
        blocks.push(vec![
            ParamSpec::new("ln_f.weight", &[d], Init::Ones),
            ParamSpec::new("ln_f.bias", &[d], Init::Zeros),
            ParamSpec::new("lm_head.weight", &[v, d], Init::Normal(std)),
        ]);
        blocks
    }

    fn forward(&self, block: usize, p: &[Tensor], input: &Tensor, batch: &Batch) -> Tensor {
        let last = self.config.layers + 1;
        if block == 0 {
            Tensor::embedding(&p[0], input, -1, false, false)
                + Tensor::embedding(&p[1], &batch.positions, -1, false, false)
        } else if block == last {
            batch.linear(&norm(input, &p[0], &p[1]), &p[2], None)
        } else {
            let h = input + self.attention(block - 1, &norm(input, &p[0], &p[1]), &p[2..6], batch);
            let inner = batch.linear(&norm(&h, &p[6], &p[7]), &p[8], Some(&p[9])).gelu("none");
            let mlp = batch.linear(&inner, &p[10], Some(&p[11]));
            h + mlp
        }
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn flops_per_token(&self, context: usize) -> f64 {
        transformer_flops_per_token(parameter_count(self), self.config.layers, self.config.width, context)
    }

    fn hf_config(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": [GPT_ARCHITECTURE],
            "model_type": "regatta_gpt",
            "layers": self.config.layers,
            "width": self.config.width,
            "heads": self.config.heads,
            "context": self.config.context,
            "vocab_size": self.vocab,
        })
    }

    fn kv_layout(&self) -> Option<KvLayout> {
        Some(KvLayout {
            layers: self.config.layers,
            kv_heads: self.config.heads,
            head_dim: self.config.width / self.config.heads,
            sliding_window: None,
        })
    }
}
