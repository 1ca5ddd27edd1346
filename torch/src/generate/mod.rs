//! Generation with a paged KV cache and continuous batching: the tensor half of
//! [`regatta_scorer::generate`]. The batcher decides which sequences run, which prompt
//! chunks are prefilled and which cache slots each token uses; this module owns the cache
//! tensors, turns a step's work into at most two forwards (every decoding sequence in one,
//! prompt chunks in the other), reads the logits of each sequence's last token, and picks
//! tokens with the row's own random stream.
//!
//! Its parts: the cache tensors (`cache`), the forwards a step becomes (`forward`), decode
//! in fixed shapes replayed as CUDA graphs (`fixed_decode`), what a step takes from the
//! logits (`pick`), and a generation in progress, [`Session`] (`session`).

mod cache;
mod fixed_decode;
mod forward;
mod pick;
mod session;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use regatta_scorer::{auto_kv_cache_bytes, Finish, GenStats, GenerationSetup, RowStream, SamplingParams};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::model::{KvLayout, Model};
use crate::packed::PackedWeights;

pub use cache::KvCache;
pub use session::Session;

use cache::free_memory;

/// Whether a generator under `setup` packs weights of `kind` on `device` for its products
/// ([`PackedWeights`]: float32 on the CPU, unless the setup turns it off).
pub fn packs_weights(setup: &GenerationSetup, device: Device, kind: Kind) -> bool {
    setup.packed_weights && device == Device::Cpu && kind == Kind::Float
}

/// The kind a model's weights are held in (its first block's first tensor; float32 for none).
fn weights_kind(params: &[Vec<Tensor>]) -> Kind {
    params
        .first()
        .and_then(|block| block.first())
        .map_or(Kind::Float, Tensor::kind)
}

/// `params` (weights per block, as loaded) laid out for a generator under `setup`: as they
/// are where it packs them (the packed copies serve the products, and packing from the
/// stored `[out, in]` is one transposing copy where [`crate::model::inference_layout`]'s
/// would be a second, ~0.15 s of a SmolLM2-135M load), else in the inference layout.
pub fn generation_layout(params: Vec<Vec<Tensor>>, setup: &GenerationSetup, device: Device) -> Vec<Vec<Tensor>> {
    if packs_weights(setup, device, weights_kind(&params)) {
        params
    } else {
        crate::model::inference_layout(params, device)
    }
}

/// How often progress figures are reported while generating.
const STATS_EVERY: Duration = Duration::from_millis(500);

/// A row ready to generate: its prompt's token ids, settings and random stream.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// Prompt token ids.
    pub prompt: Vec<i64>,
    /// How to generate.
    pub params: SamplingParams,
    /// The row's random stream.
    pub stream: RowStream,
}

/// Why one row has no output while the other rows go on: a row's outcome, not a failure
/// of the generation (which is [`Error`]).
#[derive(Debug, thiserror::Error)]
pub enum RowError {
    /// Its chat messages do not render through the model's chat template.
    #[error(transparent)]
    Chat(regatta_trainer::DocumentError),
    /// Its prompt's text cannot be tokenized.
    #[error(transparent)]
    Tokenize(Error),
    /// It can never run: its prompt is empty or as long as the context, or it needs more
    /// cache than the budget buys (the batcher's refusal, as the batcher says it).
    #[error(transparent)]
    Refused(regatta_scorer::Error),
    /// The session ended without its output.
    #[error("the row's generation is missing")]
    Missing,
}

/// One row's output.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// Generated token ids (an end-of-sequence token included; cut at a stop string).
    pub tokens: Vec<i64>,
    /// Why it ended.
    pub finish: Finish,
    /// Each token's log-probability (empty unless asked for).
    pub logprobs: Vec<f64>,
    /// The logits each token was chosen from (only with [`Generator::keep_logits`]).
    pub logits: Vec<Vec<f32>>,
}

/// Where a run's time went: forwards of single-token decodes and of prompt chunks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// Seconds in decode forwards (sampling included).
    pub decode_seconds: f64,
    /// Tokens those forwards produced.
    pub decode_tokens: u64,
    /// Seconds in prefill forwards (sampling of a prompt's first token included).
    pub prefill_seconds: f64,
    /// Prompt tokens prefilled.
    pub prefill_tokens: u64,
    /// Prompt tokens found in cached blocks instead of prefilled (prefix caching).
    pub cached_tokens: u64,
    /// Decode steps run in a fixed batch shape (replayed CUDA graphs on a GPU).
    pub graph_steps: u64,
    /// CUDA graphs captured (one per batch shape and cache size).
    pub graphs_captured: u64,
    /// Why CUDA graphs were turned off during the run (decode then ran eagerly).
    pub graphs_off: Option<String>,
}

/// How decode steps run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DecodeMode {
    /// Each step's forward as its own kernels, in the step's exact shape.
    Eager,
    /// Decode steps padded to a fixed shape (rows and keys rounded up to powers of two),
    /// without capture: what a graph replays, run as is (tests it on the CPU).
    Fixed,
    /// Fixed shapes, each captured once as a CUDA graph on this device and replayed.
    Graphs(usize),
}

/// Generation with one model.
pub struct Generator<'a> {
    model: &'a dyn Model,
    params: &'a [Vec<Tensor>],
    layout: KvLayout,
    setup: GenerationSetup,
    context: usize,
    eos: Vec<i64>,
    device: Device,
    kind: Kind,
    /// The KV cache budget in bytes (the setup's, or decided from the memory free here).
    kv_cache_bytes: u64,
    keep_logits: bool,
    stats_every: Duration,
    decode: DecodeMode,
    /// The weights packed once in oneDNN's layout (float32 on the CPU, where this
    /// libtorch has oneDNN and the setup allows it).
    packed: Option<Arc<PackedWeights>>,
}

impl<'a> Generator<'a> {
    /// Generation with `model` (weights per block) on `device`, sequences up to `context`
    /// tokens, ending at any of `eos`.
    pub fn new(
        model: &'a dyn Model,
        params: &'a [Vec<Tensor>],
        setup: GenerationSetup,
        context: usize,
        eos: Vec<i64>,
        device: Device,
    ) -> Result<Self> {
        let layout = model.kv_layout().ok_or_else(|| {
            Error::Invalid("this model has no KV cache path; generation needs a Llama-family or GPT model".into())
        })?;
        let kind = weights_kind(params);
        // Packed first: the cache's automatic budget is a share of the memory left after it.
        let packed = packs_weights(&setup, device, kind)
            .then(|| PackedWeights::pack(params, &model.linear_groups(params), setup.max_batch))
            .flatten()
            .map(Arc::new);
        let kv_cache_bytes = match setup.kv_cache_bytes {
            Some(bytes) => bytes,
            None => auto_kv_cache_bytes(free_memory(device)?),
        };
        let decode = match device {
            Device::Cuda(ordinal) if setup.cuda_graphs => DecodeMode::Graphs(ordinal),
            _ => DecodeMode::Eager,
        };
        Ok(Self {
            decode,
            packed,
            kv_cache_bytes,
            model,
            params,
            layout,
            setup,
            context,
            eos,
            device,
            kind,
            keep_logits: false,
            stats_every: STATS_EVERY,
        })
    }

    /// Runs decode steps in the fixed shapes CUDA graphs replay, without capturing
    /// them (on any device): for tests and for measuring the padding's cost.
    pub fn fixed_shape_decode(mut self) -> Self {
        self.decode = DecodeMode::Fixed;
        self
    }

    /// Also return the logits every token was chosen from (for tests).
    pub fn keep_logits(mut self) -> Self {
        self.keep_logits = true;
        self
    }

    /// Report figures at most this often (default: twice a second; zero: every step).
    pub fn stats_every(mut self, every: Duration) -> Self {
        self.stats_every = every;
        self
    }

    /// The KV cache budget in bytes: the setup's, or (unset) a share of the memory this
    /// process found free on its device when the generator was made.
    pub fn kv_cache_bytes(&self) -> u64 {
        self.kv_cache_bytes
    }

    /// Matrices packed for a CPU kernel (the panels or oneDNN's layout) and the bytes they
    /// take (none: every product is libtorch's own `linear`).
    pub fn packed_weights(&self) -> (usize, u64) {
        self.packed.as_ref().map_or((0, 0), |p| (p.len(), p.bytes()))
    }

    /// The kernel the packed matrices are for, where any are.
    pub fn packed_kernel(&self) -> Option<crate::packed::PackKernel> {
        self.packed.as_ref().map(|p| p.kernel())
    }

    /// The cache blocks the budget buys (the scratch block not counted).
    pub fn blocks(&self) -> usize {
        let block_bytes = KvCache::bytes_per_token(&self.layout, self.kind) * self.setup.block_tokens.max(1) as u64;
        (self.kv_cache_bytes / block_bytes.max(1)).saturating_sub(1) as usize
    }

    /// Generates for every row, `max_batch` sequences at a time with continuous batching.
    /// A row that can never run (too long for the context or the cache) gets its reason;
    /// `text` decodes generated tokens (for stop strings); `on_stats` hears progress.
    pub fn run(
        &self,
        rows: &[Prepared],
        text: &dyn Fn(&[i64]) -> String,
        on_stats: &mut dyn FnMut(GenStats),
    ) -> Result<Vec<std::result::Result<Output, RowError>>> {
        Ok(self.run_timed(rows, text, on_stats)?.0)
    }

    /// [`Generator::run`], also saying where the time went.
    pub fn run_timed(
        &self,
        rows: &[Prepared],
        text: &dyn Fn(&[i64]) -> String,
        on_stats: &mut dyn FnMut(GenStats),
    ) -> Result<(Vec<std::result::Result<Output, RowError>>, Timings)> {
        let mut session = self.session()?;
        let sequences: Vec<std::result::Result<usize, RowError>> =
            rows.iter().map(|row| session.add(row.clone())).collect();
        let mut done = HashMap::new();
        while !session.is_idle() {
            done.extend(session.step(text, on_stats)?);
        }
        session.report(on_stats);
        let results = sequences
            .into_iter()
            .map(|seq| seq.and_then(|seq| done.remove(&seq).ok_or(RowError::Missing)))
            .collect();
        Ok((results, session.timings()))
    }
}
