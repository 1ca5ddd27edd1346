//! Models as the ZeRO engine sees them: a sequence of blocks, each a function of its own
//! parameters and the previous block's output. The engine owns the parameters (flattened
//! per block, sharded by the ZeRO stage) and hands a block views of them when it runs, so
//! stage 3 can gather one block at a time. [`Gpt`] is the built-in model; a user's own tch
//! model implements [`LayeredModel`] the same way.

use regatta_trainer::config::ModelConfig;
use tch::{Kind, Tensor};

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

/// One parameter of a block.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// Its name in checkpoints (PyTorch style, dots).
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its initial values.
    pub init: Init,
}

impl ParamSpec {
    fn new(name: impl Into<String>, shape: &[i64], init: Init) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            init,
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<i64>() as usize
    }
}

/// A model the ZeRO engine can train: blocks in forward order.
pub trait LayeredModel: Send {
    /// Every block's parameters, in forward order.
    fn blocks(&self) -> Vec<Vec<ParamSpec>>;
    /// Runs block `block` on `input` (token ids for the first block, the previous block's
    /// output after) with its parameters, in [`LayeredModel::blocks`] order.
    fn forward(&self, block: usize, params: &[Tensor], input: &Tensor) -> Tensor;
    /// The mean loss of the last block's output against the targets.
    fn loss(&self, output: &Tensor, targets: &Tensor) -> Tensor;
    /// Training FLOPs per token (forward and backward), for the MFU estimate.
    fn flops_per_token(&self) -> f64;
}

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

    /// Logits of every position for token ids `[batch, time]`, with parameters given per
    /// block (as the engine or a checkpoint holds them).
    pub fn logits(&self, params: &[Vec<Tensor>], tokens: &Tensor) -> Tensor {
        let mut hidden = tokens.shallow_clone();
        for (block, block_params) in params.iter().enumerate() {
            hidden = self.forward(block, block_params, &hidden);
        }
        hidden
    }

    // Batch and time sizes are never read here (only derived by tensor ops), so a traced
    // TorchScript export of the model accepts any [batch, time].
    fn attention(&self, x: &Tensor, p: &[Tensor]) -> Tensor {
        let d = self.config.width as i64;
        let heads = self.config.heads as i64;
        let hd = d / heads;
        let qkv = x.linear(&p[0], Some(&p[1]));
        let parts = qkv.split(d, 2);
        let shape = |z: &Tensor| z.unflatten(-1, [heads, hd]).transpose(1, 2);
        let (q, k, v) = (shape(&parts[0]), shape(&parts[1]), shape(&parts[2]));
        let scores = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hd as f64).sqrt());
        // [time, time], true above the diagonal.
        let future = scores.get(0).get(0).ones_like().triu(1).to_kind(Kind::Bool);
        let weights = scores
            .masked_fill(&future, f64::NEG_INFINITY)
            .softmax(-1, scores.kind());
        weights
            .matmul(&v)
            .transpose(1, 2)
            .flatten(2, 3)
            .linear(&p[2], Some(&p[3]))
    }
}

fn norm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Tensor {
    let width = *x.size().last().expect("hidden states have a last dimension");
    x.layer_norm([width], Some(weight), Some(bias), 1e-5, false)
}

impl LayeredModel for Gpt {
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

    fn forward(&self, block: usize, p: &[Tensor], input: &Tensor) -> Tensor {
        let last = self.config.layers + 1;
        if block == 0 {
            // 0, 1, 2, ... along time, derived from the input (see `attention`).
            let positions = input.ones_like().cumsum(1, Kind::Int64) - 1;
            Tensor::embedding(&p[0], input, -1, false, false) + Tensor::embedding(&p[1], &positions, -1, false, false)
        } else if block == last {
            norm(input, &p[0], &p[1]).linear::<Tensor>(&p[2], None)
        } else {
            let h = input + self.attention(&norm(input, &p[0], &p[1]), &p[2..6]);
            let mlp = norm(&h, &p[6], &p[7])
                .linear(&p[8], Some(&p[9]))
                .gelu("none")
                .linear(&p[10], Some(&p[11]));
            h + mlp
        }
    }

    fn loss(&self, output: &Tensor, targets: &Tensor) -> Tensor {
        output
            .view([-1, self.vocab as i64])
            .to_kind(Kind::Float)
            .cross_entropy_for_logits(&targets.view([-1]))
    }

    fn flops_per_token(&self) -> f64 {
        let params: usize = self.blocks().iter().flatten().map(ParamSpec::numel).sum();
        let (l, d, t) = (
            self.config.layers as f64,
            self.config.width as f64,
            self.config.context as f64,
        );
        6.0 * params as f64 + 12.0 * l * d * t
    }
}
