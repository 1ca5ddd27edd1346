//! Generation with a paged KV cache and continuous batching: the tensor half of
//! [`regatta_scorer::generate`]. The batcher decides which sequences run, which prompt
//! chunks are prefilled and which cache slots each token uses; this module owns the cache
//! tensors, turns a step's work into at most two forwards (every decoding sequence in one,
//! prompt chunks in the other), reads the logits of each sequence's last token, and picks
//! tokens with the row's own random stream.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use regatta_scorer::generate::{
    auto_kv_cache_bytes, choose, mem_available, stop_at, Batcher, BatcherConfig, Choice, Feed, Finish, FreeMemory,
    GenStats, GenerationSetup, RowStream, SamplingParams,
};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::graphs::{CudaGraph, Pool};
use crate::model::{Batch, KvLayout, KvStep, Model};

/// How often progress figures are reported while generating.
const STATS_EVERY: Duration = Duration::from_millis(500);

/// Keys and values of every token slot, per layer: `[slots, kv_heads, head_dim]`.
pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
}

impl KvCache {
    /// Bytes one token occupies in the cache (keys and values of every layer).
    pub fn bytes_per_token(layout: &KvLayout, kind: Kind) -> u64 {
        2 * (layout.layers * layout.kv_heads * layout.head_dim) as u64 * kind.elt_size_in_bytes() as u64
    }

    /// Extends the cache to `slots` token slots, keeping what the present ones hold.
    pub fn grow(&mut self, slots: usize) {
        for cache in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let size = cache.size();
            let extra = slots as i64 - size[0];
            if extra > 0 {
                let more = Tensor::zeros([extra, size[1], size[2]], (cache.kind(), cache.device()));
                *cache = Tensor::cat(&[&*cache, &more], 0);
            }
        }
    }

    /// A cache of `slots` token slots.
    pub fn new(layout: &KvLayout, slots: usize, kind: Kind, device: Device) -> Self {
        let shape = [slots as i64, layout.kv_heads as i64, layout.head_dim as i64];
        let make = || {
            (0..layout.layers)
                .map(|_| Tensor::zeros(shape, (kind, device)))
                .collect()
        };
        Self {
            keys: make(),
            values: make(),
        }
    }
}

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
        let kind = params
            .first()
            .and_then(|block| block.first())
            .map(Tensor::kind)
            .unwrap_or(Kind::Float);
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
    ) -> Result<Vec<std::result::Result<Output, String>>> {
        Ok(self.run_timed(rows, text, on_stats)?.0)
    }

    /// [`Generator::run`], also saying where the time went.
    pub fn run_timed(
        &self,
        rows: &[Prepared],
        text: &dyn Fn(&[i64]) -> String,
        on_stats: &mut dyn FnMut(GenStats),
    ) -> Result<(Vec<std::result::Result<Output, String>>, Timings)> {
        let mut session = self.session()?;
        let sequences: Vec<std::result::Result<usize, String>> =
            rows.iter().map(|row| session.add(row.clone())).collect();
        let mut done = HashMap::new();
        while !session.is_idle() {
            done.extend(session.step(text, on_stats)?);
        }
        session.report(on_stats);
        let results = sequences
            .into_iter()
            .map(|seq| {
                seq.and_then(|seq| {
                    done.remove(&seq)
                        .ok_or_else(|| "the row's generation is missing".to_string())
                })
            })
            .collect();
        Ok((results, session.timings()))
    }

    /// A generation rows can join at any step ([`Session::add`]) while others run: the
    /// cache grows with the rows' needs up to the budget and is kept between them, so a
    /// stream of rows keeps the batch full.
    pub fn session(&self) -> Result<Session<'_, 'a>> {
        let budget = self.blocks();
        if budget == 0 {
            return Err(Error::Invalid(format!(
                "a KV cache of {} bytes holds no block of {} tokens ({} bytes a token); raise the budget",
                self.kv_cache_bytes,
                self.setup.block_tokens,
                KvCache::bytes_per_token(&self.layout, self.kind)
            )));
        }
        let block_tokens = self.setup.block_tokens.max(1);
        Ok(Session {
            generator: self,
            // The scratch block only: blocks are added as rows need them.
            cache: KvCache::new(&self.layout, block_tokens, self.kind, self.device),
            batcher: Batcher::new(BatcherConfig {
                block_tokens,
                blocks: 0,
                max_running: self.setup.max_batch,
                prefill_tokens: self.setup.prefill_tokens,
                context: self.context,
                eos: self.eos.clone(),
                prefix_caching: self.setup.prefix_caching,
            }),
            budget,
            rows: HashMap::new(),
            timings: Timings::default(),
            reported: Instant::now(),
            new_tokens: 0,
            fixed: FixedShapes::default(),
        })
    }

    /// One forward of `feeds` (padded into `[rows, time]`) against the cache; returns, for
    /// each row, what `wants` asks of its last fed token's logits: nothing, the greedy token
    /// chosen where the logits are (on the GPU only a token and a log-probability cross to
    /// the host, not a vocabulary of floats), or the logits themselves on the CPU.
    fn forward(&self, cache: &KvCache, feeds: &[Feed], wants: &[Want]) -> Result<Vec<Picked>> {
        let rows = feeds.len() as i64;
        let time = feeds.iter().map(|f| f.tokens.len()).max().unwrap_or(1) as i64;
        let keys = feeds.iter().map(|f| f.read.len()).max().unwrap_or(1) as i64;
        let block_tokens = self.setup.block_tokens.max(1) as i64;
        let (mut tokens, mut positions, mut write, mut read) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut lengths = Vec::with_capacity(feeds.len());
        let mut last = Vec::with_capacity(feeds.len());
        for (r, feed) in feeds.iter().enumerate() {
            let n = feed.tokens.len() as i64;
            // Padding writes go to the scratch block (slots 0..block_tokens) and reads of
            // padding keys are masked.
            for t in 0..time {
                let real = t < n;
                tokens.push(if real { feed.tokens[t as usize] } else { 0 });
                positions.push(if real { feed.positions[t as usize] } else { 0 });
                write.push(if real { feed.write[t as usize] } else { t % block_tokens });
            }
            read.extend_from_slice(&feed.read);
            read.extend(std::iter::repeat_n(0, keys as usize - feed.read.len()));
            lengths.push(feed.read.len() as i64);
            last.push(r as i64 * time + n - 1);
        }
        let device = self.device;
        let int = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        let tokens = int(&tokens).view([rows, time]);
        let positions = int(&positions).view([rows, time]);
        let last = int(&last);
        let logits = self.logits(
            cache,
            &tokens,
            &positions,
            &int(&lengths),
            &int(&write),
            &int(&read).view([rows, keys]),
            Some(&last),
        );
        pick(&logits, wants)
    }

    /// The forward of `tokens` `[rows, time]` at `positions` against the cache: their keys
    /// and values written to slots `write` (`[rows * time]`), each row attending to the
    /// slots `read` (`[rows, keys]`) of which its first `lengths` are real. Returns the
    /// logits `[rows, vocab]` of each row's token at flat index `last` (`[rows]`; `None`:
    /// time is 1). Device ops only, no host data: what a CUDA graph captures.
    #[allow(clippy::too_many_arguments)]
    fn logits(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        positions: &Tensor,
        lengths: &Tensor,
        write: &Tensor,
        read: &Tensor,
        last: Option<&Tensor>,
    ) -> Tensor {
        let (rows, time) = tokens.size2().expect("tokens are [rows, time]");
        let keys = read.size()[1];
        let device = tokens.device();
        // Query at position p sees keys 0..=p of its own row (and, with a sliding window,
        // only the last `window` of them); a padding query sees key 0.
        let key_index = Tensor::arange(keys, (Kind::Int64, device)).view([1, 1, 1, keys]);
        let query_position = positions.view([rows, 1, time, 1]);
        let mut mask = key_index
            .le_tensor(&query_position)
            .logical_and(&key_index.lt_tensor(&lengths.view([rows, 1, 1, 1])));
        if let Some(window) = self.layout.sliding_window {
            mask = mask.logical_and(&key_index.gt_tensor(&(&query_position - window as i64)));
        }
        let mut batch = Batch {
            positions: positions.shallow_clone(),
            mask: Some(mask),
            segments: None,
            derived: Vec::new(),
            kv: Some(KvStep {
                keys: cache.keys.iter().map(Tensor::shallow_clone).collect(),
                values: cache.values.iter().map(Tensor::shallow_clone).collect(),
                write: write.shallow_clone(),
                read: read.shallow_clone(),
            }),
            dropout_seed: None,
        };
        self.model.prepare(&mut batch);
        let last_block = self.params.len() - 1;
        let logits = tch::no_grad(|| {
            let mut hidden = tokens.shallow_clone();
            for (block, params) in self.params.iter().enumerate().take(last_block) {
                hidden = self.model.forward(block, params, &hidden, &batch);
            }
            // Only each row's last token needs logits: the head runs on those alone.
            let width = hidden.size()[2];
            let picked = match last {
                Some(last) => hidden.view([rows * time, width]).index_select(0, last),
                None => hidden.view([rows * time, width]),
            }
            .view([rows, 1, width]);
            self.model
                .forward(last_block, &self.params[last_block], &picked, &batch)
        });
        logits.view([rows, -1])
    }

    /// A decode step (every feed one token) run in a fixed shape: rows and keys padded up
    /// to powers of two, inputs copied into that shape's tensors, and on CUDA the shape's
    /// graph replayed (captured at its first use). Greedy rows take the token the graph
    /// chose; sampling rows (and rows whose logits are kept) get their logits from the
    /// graph's output, to choose on the host. `None`: this step cannot run so (graphs off,
    /// or not a decode step).
    fn fixed_forward(
        &self,
        fixed: &mut FixedShapes,
        cache: &KvCache,
        feeds: &[Feed],
        wants: &[Want],
    ) -> Option<Result<Vec<Picked>>> {
        if self.decode == DecodeMode::Eager || fixed.off.is_some() {
            return None;
        }
        if feeds.iter().any(|f| f.tokens.len() != 1) || wants.contains(&Want::Nothing) {
            return None;
        }
        let rows = feeds.len().max(1).next_power_of_two() as i64;
        let block_tokens = self.setup.block_tokens.max(1) as i64;
        let longest = feeds.iter().map(|f| f.read.len()).max().unwrap_or(1);
        let keys = longest.max(block_tokens as usize).next_power_of_two() as i64;
        // Graphs hold the cache tensors they were captured with: a grown cache is new ones.
        let slots = cache.keys.first().map_or(0, |k| k.size()[0]);
        if fixed.slots != slots {
            fixed.shapes.clear();
            fixed.pool = None;
            fixed.slots = slots;
        }
        // The inputs as one host buffer, one copy to the device: tokens, positions, write
        // slots, lengths (each [rows]), then the read slots [rows, keys].
        let (r, k) = (rows as usize, keys as usize);
        let mut host = vec![0i64; 4 * r + r * k];
        for i in 0..r {
            match feeds.get(i) {
                Some(feed) => {
                    host[i] = feed.tokens[0];
                    host[r + i] = feed.positions[0];
                    host[2 * r + i] = feed.write[0];
                    host[3 * r + i] = feed.read.len() as i64;
                    host[4 * r + i * k..4 * r + i * k + feed.read.len()].copy_from_slice(&feed.read);
                }
                // A padding row: token 0 at position 0, written to a scratch slot, reading
                // scratch slot 0.
                None => {
                    host[2 * r + i] = i as i64 % block_tokens;
                    host[3 * r + i] = 1;
                }
            }
        }
        let host = Tensor::from_slice(&host);
        let result = (|| -> Result<(Vec<f64>, Tensor)> {
            let shape = match fixed.shapes.entry((rows, keys)) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let inputs = Tensor::zeros([(4 * r + r * k) as i64], (Kind::Int64, self.device));
                    let mut shape = FixedShape {
                        inputs,
                        output: None,
                        graph: None,
                    };
                    // The capture's eager run does this step's work: it needs the inputs.
                    shape.inputs.copy_(&host);
                    if let DecodeMode::Graphs(ordinal) = self.decode {
                        let (graph, pool, output) = CudaGraph::capture(ordinal, fixed.pool, &mut || {
                            Ok(self.fixed_step(cache, &shape.inputs, rows, keys))
                        })?;
                        fixed.pool = Some(pool);
                        fixed.captured += 1;
                        shape.graph = Some(graph);
                        shape.output = Some(output);
                    }
                    e.insert(shape)
                }
            };
            shape.inputs.copy_(&host);
            let (chosen, logits) = match &shape.graph {
                Some(graph) => {
                    graph.replay()?;
                    let (chosen, logits) = shape
                        .output
                        .as_ref()
                        .ok_or_else(|| Error::CudaGraph("a captured graph has no output".into()))?;
                    (chosen.shallow_clone(), logits.shallow_clone())
                }
                None => self.fixed_step(cache, &shape.inputs, rows, keys),
            };
            Ok((Vec::<f64>::try_from(chosen.to_device(Device::Cpu))?, logits))
        })();
        let (out, logits) = match result {
            Ok(out) => out,
            Err(Error::CudaGraph(reason)) => {
                // Eager from here on: slower, not wrong.
                eprintln!("regatta: CUDA graphs off, decoding eagerly: {reason}");
                fixed.off = Some(reason);
                fixed.shapes.clear();
                return None;
            }
            Err(e) => return Some(Err(e)),
        };
        fixed.steps += 1;
        let mut picked: Vec<Picked> = wants
            .iter()
            .enumerate()
            .map(|(i, want)| match want {
                Want::Greedy { logprob } => Picked::Token {
                    token: out[i] as i64,
                    logprob: if *logprob { out[r + i] } else { 0.0 },
                },
                _ => Picked::Nothing,
            })
            .collect();
        let full: Vec<i64> = (0..wants.len() as i64)
            .filter(|&i| wants[i as usize] == Want::Logits)
            .collect();
        if !full.is_empty() {
            match host_logits(&logits, &full) {
                Ok(rows) => {
                    for (&i, row) in full.iter().zip(rows) {
                        picked[i as usize] = Picked::Logits(row);
                    }
                }
                Err(e) => return Some(Err(e)),
            }
        }
        Some(Ok(picked))
    }

    /// One fixed-shape decode step from the packed `inputs` (see [`Self::fixed_forward`]):
    /// returns `[2 * rows]` f64, each row's greedy token then its log-probability, and the
    /// logits `[rows, vocab]` they were chosen from.
    fn fixed_step(&self, cache: &KvCache, inputs: &Tensor, rows: i64, keys: i64) -> (Tensor, Tensor) {
        let part = |i: i64| inputs.narrow(0, i * rows, rows);
        let tokens = part(0).view([rows, 1]);
        let positions = part(1).view([rows, 1]);
        let read = inputs.narrow(0, 4 * rows, rows * keys).view([rows, keys]);
        let logits = self.logits(cache, &tokens, &positions, &part(3), &part(2), &read, None);
        let (tokens, logprobs) = greedy(&logits);
        (Tensor::cat(&[tokens.to_kind(Kind::Double), logprobs], 0), logits)
    }
}

/// The fixed decode shapes a session has run, by (rows, keys).
#[derive(Default)]
struct FixedShapes {
    shapes: HashMap<(i64, i64), FixedShape>,
    /// The memory pool the graphs share.
    pool: Option<Pool>,
    /// Cache slots when the shapes were made (a grown cache drops them).
    slots: i64,
    /// Why graphs were turned off (a capture failed, or no library).
    off: Option<String>,
    /// Steps run in a fixed shape.
    steps: u64,
    /// Graphs captured.
    captured: u64,
}

/// One fixed decode shape: its input tensor, and on CUDA its graph and the output the
/// graph writes.
struct FixedShape {
    inputs: Tensor,
    /// The chosen tokens and log-probabilities, and the logits.
    output: Option<(Tensor, Tensor)>,
    graph: Option<CudaGraph>,
}

/// The memory the KV cache may be sized from on `device`: the GPU's total and what this
/// process's caching allocator holds there now (the weights, loaded before), or the host's
/// available memory.
fn free_memory(device: Device) -> Result<FreeMemory> {
    match device {
        Device::Cuda(ordinal) => {
            let total = crate::cuda::total_memory_bytes(ordinal).ok_or_else(|| {
                Error::Invalid(format!(
                    "cannot read cuda:{ordinal}'s memory size to size the KV cache; set kv_cache_mb"
                ))
            })?;
            let held = crate::shim::cuda_memory(ordinal, false)?.reserved;
            let free = crate::cuda::free_memory_bytes(ordinal);
            Ok(FreeMemory::Device { total, held, free })
        }
        _ => {
            let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
            let available = mem_available(&meminfo).ok_or_else(|| {
                Error::Invalid(
                    "cannot read the host's available memory (/proc/meminfo) to size the KV cache; set kv_cache_mb"
                        .into(),
                )
            })?;
            Ok(FreeMemory::Host { available })
        }
    }
}

/// What a step needs of a row's last logits.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    /// Nothing: a prompt chunk that is not the prompt's last.
    Nothing,
    /// The most likely token (ties to the lowest id), and its log-probability when asked.
    Greedy { logprob: bool },
    /// The logits on the CPU (sampling, or kept for tests).
    Logits,
}

/// What [`Generator::forward`] gives back for a row (see [`Want`]).
#[derive(Clone, Debug, PartialEq)]
enum Picked {
    Nothing,
    Token { token: i64, logprob: f64 },
    Logits(Vec<f32>),
}

/// Picks from `logits` (`[rows, vocab]`, on the model's device and in its dtype) what each
/// row wants. Greedy rows are chosen where the logits are, as `choose` would: `argmax`
/// gives the first of equal maxima (the lowest id), and the log-probability is the
/// token's logit less the log-sum-exp of the row, in f64.
fn pick(logits: &Tensor, wants: &[Want]) -> Result<Vec<Picked>> {
    let device = logits.device();
    let rows_where = |keep: &dyn Fn(&Want) -> bool| -> Vec<i64> {
        (0..wants.len() as i64).filter(|&r| keep(&wants[r as usize])).collect()
    };
    let greedy = rows_where(&|w| matches!(w, Want::Greedy { .. }));
    let full = rows_where(&|w| *w == Want::Logits);
    let mut picked = vec![Picked::Nothing; wants.len()];
    if !greedy.is_empty() {
        let chosen = logits.index_select(0, &Tensor::from_slice(&greedy).to_device(device));
        let with_logprob = greedy
            .iter()
            .any(|&r| wants[r as usize] == Want::Greedy { logprob: true });
        let (tokens, logprobs) = greedy_tokens(&chosen, with_logprob);
        let logprobs = match logprobs {
            Some(lp) => Vec::<f64>::try_from(lp.to_device(Device::Cpu))?,
            None => vec![0.0; greedy.len()],
        };
        let tokens = Vec::<i64>::try_from(tokens.to_device(Device::Cpu))?;
        for ((&r, token), logprob) in greedy.iter().zip(tokens).zip(logprobs) {
            let logprob = if wants[r as usize] == (Want::Greedy { logprob: true }) {
                logprob
            } else {
                0.0
            };
            picked[r as usize] = Picked::Token { token, logprob };
        }
    }
    if !full.is_empty() {
        for (&r, row) in full.iter().zip(host_logits(logits, &full)?) {
            picked[r as usize] = Picked::Logits(row);
        }
    }
    Ok(picked)
}

/// Rows `rows` of `logits` (`[rows, vocab]`, any device and dtype) as f32 on the host.
fn host_logits(logits: &Tensor, rows: &[i64]) -> Result<Vec<Vec<f32>>> {
    let chosen = logits
        .index_select(0, &Tensor::from_slice(rows).to_device(logits.device()))
        .to_kind(Kind::Float)
        .to_device(Device::Cpu)
        .contiguous();
    let vocab = chosen.size()[1] as usize;
    let flat = Vec::<f32>::try_from(chosen.view([-1]))?;
    Ok(flat.chunks(vocab.max(1)).map(<[f32]>::to_vec).collect())
}

/// Each row's most likely token (`[rows]`, the lowest id of equal maxima) and its
/// log-probability (`[rows]`, f64: the token's logit less the row's log-sum-exp), chosen
/// where `logits` (`[rows, vocab]`) are.
fn greedy(logits: &Tensor) -> (Tensor, Tensor) {
    let tokens = argmax_tokens(logits);
    let logprobs = logprobs_of(logits, &tokens);
    (tokens.view([-1]), logprobs)
}

/// [`greedy`], the log-probabilities only when asked for.
fn greedy_tokens(logits: &Tensor, logprob: bool) -> (Tensor, Option<Tensor>) {
    let tokens = argmax_tokens(logits);
    let logprobs = logprob.then(|| logprobs_of(logits, &tokens));
    (tokens.view([-1]), logprobs)
}

/// Each row's most likely token, `[rows, 1]`. `argmax` takes NaN for the largest value;
/// `choose` never picks one (a row of NaN picks token 0), so NaN counts as -inf here.
fn argmax_tokens(logits: &Tensor) -> Tensor {
    logits.nan_to_num(Some(f64::NEG_INFINITY), None, None).argmax(-1, true)
}

/// The log-probability of each row's `tokens` (`[rows, 1]`), `[rows]` in f64.
fn logprobs_of(logits: &Tensor, tokens: &Tensor) -> Tensor {
    let logits = logits.to_kind(Kind::Double);
    (logits.gather(-1, tokens, false) - logits.logsumexp([-1i64].as_slice(), true)).view([-1])
}

/// A row being generated: its settings and what it produced so far.
struct Live {
    params: SamplingParams,
    stream: RowStream,
    output: Output,
}

/// A generation in progress (see [`Generator::session`]).
pub struct Session<'g, 'a> {
    generator: &'g Generator<'a>,
    cache: KvCache,
    batcher: Batcher,
    /// Blocks the budget buys: the cache never grows past them.
    budget: usize,
    rows: HashMap<usize, Live>,
    timings: Timings,
    reported: Instant,
    new_tokens: u64,
    fixed: FixedShapes,
}

impl Session<'_, '_> {
    /// Queues a row; returns its sequence number, or why it can never run (too long for
    /// the context, or needing more cache than the budget buys). Grows the cache first
    /// when a full batch of the rows not yet finished needs more than it holds (at least
    /// doubling it, so a stream of rows copies the cache a few times, not once per row).
    pub fn add(&mut self, row: Prepared) -> std::result::Result<usize, String> {
        let (length, max_new) = (row.prompt.len(), row.params.max_new_tokens);
        if let Some(reason) = self.batcher.refusal(length, max_new, self.budget) {
            return Err(reason);
        }
        let needed = self.batcher.blocks_for(length, max_new);
        // The new row counts only when it would be in the next full batch.
        let o = self.batcher.occupancy();
        let in_next_batch = o.running + o.waiting < self.batcher.config().max_running;
        self.fit(if in_next_batch { needed } else { 0 }, needed);
        let seq = self.batcher.add(row.prompt, row.params.max_new_tokens)?;
        self.rows.insert(
            seq,
            Live {
                params: row.params,
                stream: row.stream,
                output: Output {
                    tokens: Vec::new(),
                    finish: Finish::Length,
                    logprobs: Vec::new(),
                    logits: Vec::new(),
                },
            },
        );
        Ok(seq)
    }

    /// Grows the cache (at least doubling it, never past the budget) when a full batch of
    /// the rows not yet finished, plus `extra` blocks, would need more than it holds, or
    /// when it holds fewer than `at_least` blocks (one row's whole length).
    fn fit(&mut self, extra: usize, at_least: usize) {
        let have = self.batcher.config().blocks;
        let wanted = self.batcher.blocks_wanted() + extra;
        if wanted > have || at_least > have {
            let grown = wanted.max(2 * have).min(self.budget).max(at_least);
            if grown > have {
                let block_tokens = self.batcher.config().block_tokens;
                self.cache.grow((grown + 1) * block_tokens);
                self.batcher.grow(grown);
            }
        }
    }

    /// Whether no row is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.batcher.is_done()
    }

    /// Where the time went so far.
    pub fn timings(&self) -> Timings {
        Timings {
            cached_tokens: self.batcher.cached_tokens(),
            graph_steps: self.fixed.steps,
            graphs_captured: self.fixed.captured,
            graphs_off: self.fixed.off.clone(),
            ..self.timings.clone()
        }
    }

    /// Why CUDA graphs stopped being used in this session (decode then runs eagerly).
    pub fn graphs_off(&self) -> Option<&str> {
        self.fixed.off.as_deref()
    }

    /// Runs one step (decodes and prompt chunks) and returns the rows it finished, by
    /// sequence number. `text` decodes generated tokens (for stop strings); `on_stats`
    /// hears progress at the generator's pace.
    pub fn step(
        &mut self,
        text: &dyn Fn(&[i64]) -> String,
        on_stats: &mut dyn FnMut(GenStats),
    ) -> Result<Vec<(usize, Output)>> {
        let g = self.generator;
        // Rows that moved up the queue may be longer than the ones the cache was sized for.
        self.fit(0, 0);
        let step = self.batcher.schedule();
        if step.is_empty() {
            return Err(Error::Invalid(
                "the batcher planned an empty step with sequences left".into(),
            ));
        }
        let mut finished = Vec::new();
        for (decoding, works) in [(true, &step.decode), (false, &step.prefill)] {
            if works.is_empty() {
                continue;
            }
            let started = Instant::now();
            let feeds: Vec<Feed> = works.iter().map(|w| self.batcher.feed(w)).collect();
            let wants = works
                .iter()
                .map(|w| match self.rows.get(&w.seq) {
                    _ if !w.sample => Want::Nothing,
                    Some(live) if live.params.temperature <= 0.0 && !g.keep_logits => Want::Greedy {
                        logprob: live.params.logprobs,
                    },
                    _ => Want::Logits,
                })
                .collect::<Vec<_>>();
            let fixed = if decoding {
                g.fixed_forward(&mut self.fixed, &self.cache, &feeds, &wants)
            } else {
                None
            };
            let picked = match fixed {
                Some(picked) => picked?,
                None => g.forward(&self.cache, &feeds, &wants)?,
            };
            let seqs: Vec<usize> = works.iter().map(|w| w.seq).collect();
            let sampled = self.choose_sampled(&seqs, &picked)?;
            for ((work, picked), sampled) in works.iter().zip(picked).zip(sampled) {
                let live = self
                    .rows
                    .get_mut(&work.seq)
                    .ok_or_else(|| Error::Invalid("a running sequence has no row".into()))?;
                let choice = match picked {
                    Picked::Nothing => None,
                    Picked::Token { token, logprob } => Some(Choice { token, logprob }),
                    Picked::Logits(logits) => {
                        if g.keep_logits {
                            live.output.logits.push(logits);
                        }
                        sampled
                    }
                };
                if work.sample != choice.is_some() {
                    return Err(Error::Invalid("a sampled row's choice is missing".into()));
                }
                let token = choice.map(|choice| {
                    if live.params.logprobs {
                        live.output.logprobs.push(choice.logprob);
                    }
                    self.new_tokens += 1;
                    choice.token
                });
                if let Some(reason) = self.batcher.advance(work, token) {
                    self.batcher.finish(work.seq, reason);
                } else if token.is_some() && !live.params.stop.is_empty() {
                    // Only a stop string ending in the newest token is new, and one of n
                    // bytes spans at most n tokens: decode that tail (and a few tokens more,
                    // for a character split across tokens), not the whole output each step.
                    let longest = live.params.stop.iter().map(String::len).max().unwrap_or(0);
                    let generated = self.batcher.generated(work.seq);
                    let tail = &generated[generated.len().saturating_sub(longest + 3)..];
                    if stop_at(&text(tail), &live.params.stop).is_some() {
                        self.batcher.finish(work.seq, Finish::Stop);
                    }
                }
                if let Some(reason) = self.batcher.finished(work.seq) {
                    if let Some(mut live) = self.rows.remove(&work.seq) {
                        let out = &mut live.output;
                        out.tokens = self.batcher.generated(work.seq).to_vec();
                        out.finish = reason;
                        out.logprobs.truncate(out.tokens.len());
                        out.logits.truncate(out.tokens.len());
                        finished.push((work.seq, live.output));
                        self.batcher.forget(work.seq);
                    }
                }
            }
            let seconds = started.elapsed().as_secs_f64();
            if decoding {
                self.timings.decode_seconds += seconds;
                self.timings.decode_tokens += works.len() as u64;
            } else {
                self.timings.prefill_seconds += seconds;
                self.timings.prefill_tokens += works.iter().map(|w| (w.end - w.start) as u64).sum::<u64>();
            }
        }
        if self.reported.elapsed() >= g.stats_every {
            self.report(on_stats);
        }
        Ok(finished)
    }

    /// The choices of the rows `picked` brought logits for (the others `None`), each with
    /// its own parameters and random stream. Sorting a vocabulary is most of a sampled step
    /// at large batches (milliseconds a row at 32k tokens), so the rows are spread over
    /// the cores; every row's choice is the same as alone.
    fn choose_sampled(&self, seqs: &[usize], picked: &[Picked]) -> Result<Vec<Option<Choice>>> {
        let mut jobs = Vec::new();
        for (i, (seq, picked)) in seqs.iter().zip(picked).enumerate() {
            if let Picked::Logits(logits) = picked {
                let live = self
                    .rows
                    .get(seq)
                    .ok_or_else(|| Error::Invalid("a running sequence has no row".into()))?;
                jobs.push((
                    i,
                    logits.as_slice(),
                    &live.params,
                    live.stream,
                    self.batcher.generated(*seq).len(),
                ));
            }
        }
        let mut out = vec![None; seqs.len()];
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // At least a few rows a thread: a spawn costs tens of microseconds.
        let threads = cores.min(jobs.len().div_ceil(4)).max(1);
        let per_thread = jobs.len().div_ceil(threads).max(1);
        let chosen: Vec<Vec<(usize, Choice)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = jobs
                .chunks(per_thread)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter()
                            .map(|&(i, logits, params, stream, index)| (i, choose(logits, params, stream, index)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| Error::Invalid("a sampling thread panicked".into()))
                })
                .collect::<Result<_>>()
        })?;
        for (i, choice) in chosen.into_iter().flatten() {
            out[i] = Some(choice);
        }
        Ok(out)
    }

    /// Tells `on_stats` the figures now (and the tokens since the last report).
    pub fn report(&mut self, on_stats: &mut dyn FnMut(GenStats)) {
        let o = self.batcher.occupancy();
        on_stats(GenStats {
            running: o.running,
            waiting: o.waiting,
            max_batch: self.batcher.config().max_running,
            used_blocks: o.used_blocks,
            blocks: o.blocks,
            new_tokens: self.new_tokens,
            preemptions: self.batcher.preemptions(),
            cached_tokens: self.batcher.cached_tokens(),
        });
        self.new_tokens = 0;
        self.reported = Instant::now();
    }
}
