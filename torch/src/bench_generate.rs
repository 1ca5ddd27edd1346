//! `regatta-torch-rank bench-generate MODEL THREADS`: output tokens/s of KV-cache generation
//! with continuous batching at batch limits 1, 8, 32 and 128, beside this machine's own
//! limits measured in the same run: memory bandwidth (a large tensor copy) gives the
//! batch-1 decode bound, weight bytes ÷ bandwidth; GEMM FLOP/s at the model's shapes gives
//! the compute bound, 2 × parameters FLOPs a token. Also the old path (one row at a time,
//! the whole window recomputed per token) for the speed-up. Prints one line per figure.

use std::collections::HashMap;
use std::time::Instant;

use regatta_scorer::{GenerationSetup, RowStream, SamplingParams};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::executor::matmul_flops_per_sec;
use crate::generate::{Generator, Prepared};
use crate::hf::{model_from_config, HfModel};
use crate::model::{arrange, logits, parameter_count, Model};

/// Batch limits measured.
pub const BATCH_LIMITS: [usize; 4] = [1, 8, 32, 128];
/// Tokens generated per row.
const OUTPUT_TOKENS: usize = 32;

/// A model, its weights per block and its context.
type Loaded = (Box<dyn Model>, Vec<Vec<Tensor>>, usize);

/// A model folder, or a Llama-family `config.json` initialised at random.
fn load(model: &str) -> Result<Loaded> {
    load_on(model, Kind::Float, Device::Cpu)
}

/// [`load`] with the weights in `kind` on `device` (a bf16 file read as bf16, never
/// widened on the way).
fn load_on(model: &str, kind: Kind, device: Device) -> Result<Loaded> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let context_of = |json: &serde_json::Value| {
        json.get("max_position_embeddings")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(2048) as usize
    };
    if model.ends_with(".json") {
        let text = std::fs::read(model).map_err(|e| Error::Invalid(format!("cannot read {model}: {e}")))?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| Error::Invalid(format!("{model} is not JSON: {e}")))?;
        let built = model_from_config(&json, model)?;
        tch::manual_seed(7);
        let mut stored = HashMap::new();
        for spec in built.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
            let tensor = Tensor::randn(spec.shape.as_slice(), (Kind::Float, Device::Cpu)) * 0.02;
            stored.insert(spec.name, tensor.to_kind(kind).to_device(device));
        }
        let params = arrange(built.as_ref(), &stored)?;
        return Ok((built, params, context_of(&json)));
    }
    let cwd = std::env::current_dir()?;
    let hf = runtime.block_on(HfModel::open(&regatta_object_store::absolute(model, &cwd)))?;
    let built = hf.model()?;
    hf.check(built.as_ref())?;
    let mut stored = HashMap::new();
    for spec in built.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
        let tensor = runtime.block_on(hf.read_as(&spec, kind))?;
        stored.insert(spec.name, tensor.to_device(device));
    }
    let params = arrange(built.as_ref(), &stored)?;
    Ok((built, params, context_of(hf.config_json())))
}

/// Bytes per second of a large copy, counting what is read and what is written.
fn memory_bandwidth() -> f64 {
    let elements = 64 << 20; // 256 MiB of f32
    let source = Tensor::ones([elements], (Kind::Float, Device::Cpu));
    let mut target = Tensor::zeros([elements], (Kind::Float, Device::Cpu));
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        target.copy_(&source);
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * 4.0 * elements as f64 / best
}

/// Prompts of 32 to 96 tokens (a fixed mix), `rows` of them.
fn prompts(rows: usize, vocab: usize) -> Vec<Prepared> {
    (0..rows)
        .map(|i| Prepared {
            prompt: (0..32 + (i * 37) % 65)
                .map(|t| ((t * 131 + i * 17) % vocab.max(1)) as i64)
                .collect(),
            params: SamplingParams {
                max_new_tokens: OUTPUT_TOKENS,
                ..SamplingParams::default()
            },
            stream: RowStream::new(0, &i.to_string()),
        })
        .collect()
}

/// Output tokens/s of the old path: one row, the whole window through the model per token.
fn old_path(model: &dyn Model, params: &[Vec<Tensor>], row: &Prepared) -> f64 {
    let mut sequence = row.prompt.clone();
    let start = Instant::now();
    for _ in 0..OUTPUT_TOKENS {
        let input = Tensor::from_slice(&sequence).view([1, -1]);
        let out = tch::no_grad(|| logits(model, params, &input));
        sequence.push(
            out.get(0)
                .get(sequence.len() as i64 - 1)
                .argmax(0, false)
                .int64_value(&[]),
        );
    }
    OUTPUT_TOKENS as f64 / start.elapsed().as_secs_f64()
}

/// Runs the benchmark and prints its lines.
pub fn bench_generate(model_path: &str, threads: usize) -> Result<()> {
    tch::set_num_threads(threads.max(1) as i32);
    let (model, params, context) = load(model_path)?;
    let parameters = parameter_count(model.as_ref());
    let weight_bytes = 4.0 * parameters as f64;
    let bandwidth = memory_bandwidth();
    // The best of a decode-sized and a prefill-sized product: the machine's peak at these shapes.
    let peak = matmul_flops_per_sec(model.as_ref(), 128).max(matmul_flops_per_sec(model.as_ref(), 512));
    let memory_bound = bandwidth / weight_bytes;
    // What libtorch's matrix-vector products reach on their own at batch 1 (every weight
    // matrix applied to one token): how much of the batch-1 gap is the kernels'.
    let gemv_rate = matmul_flops_per_sec(model.as_ref(), 1) / (2.0 * parameters as f64);
    let compute_bound = peak / (2.0 * parameters as f64);
    println!(
        "model {model_path}: {parameters} parameters ({:.1} MB fp32), {threads} threads, prompts 32-96 tokens, {OUTPUT_TOKENS} output tokens a row",
        weight_bytes / 1e6
    );
    println!(
        "machine: memory bandwidth {:.2} GB/s (copy, read + write) -> batch-1 decode bound {memory_bound:.1} tokens/s; \
         GEMM {:.1} GFLOP/s at the model's shapes (128 or 512 rows) -> compute bound {compute_bound:.1} tokens/s",
        bandwidth / 1e9,
        peak / 1e9
    );
    println!(
        "libtorch matrix-vector products alone (batch 1, every weight once): {gemv_rate:.1} tokens/s = {:.2} GB/s of weights = {:.1}% of the memory bound",
        gemv_rate * weight_bytes / 1e9,
        100.0 * gemv_rate / memory_bound
    );
    let mut batch_one = 0.0;
    for limit in BATCH_LIMITS {
        let rows = prompts((2 * limit).max(4), model.vocab());
        let setup = GenerationSetup {
            kv_cache_bytes: Some(2 << 30),
            max_batch: limit,
            prefill_tokens: 1024,
            ..GenerationSetup::default()
        };
        let generator = Generator::new(model.as_ref(), &params, setup, context, Vec::new(), Device::Cpu)?;
        let start = Instant::now();
        let (outputs, timings) = generator.run_timed(&rows, &|_| String::new(), &mut |_| {})?;
        let seconds = start.elapsed().as_secs_f64();
        let tokens: usize = outputs
            .iter()
            .filter_map(|o| o.as_ref().ok())
            .map(|o| o.tokens.len())
            .sum();
        let rate = tokens as f64 / seconds;
        // The bounds are about decoding: a decode step reads every weight once and spends
        // 2 FLOPs per parameter for each sequence in it.
        let decode_rate = timings.decode_tokens as f64 / timings.decode_seconds.max(1e-9);
        let prefill_rate = timings.prefill_tokens as f64 / timings.prefill_seconds.max(1e-9);
        if limit == 1 {
            batch_one = rate;
        }
        println!(
            "generate batch limit {limit:>3}: {} rows, {rate:.1} output tokens/s end to end; decode {decode_rate:.1} tokens/s = \
             {:.1}% of the memory bound, {:.1}% of the compute bound; prefill {prefill_rate:.1} prompt tokens/s = {:.1}% of the compute bound",
            rows.len(),
            100.0 * decode_rate / memory_bound,
            100.0 * decode_rate / compute_bound,
            100.0 * prefill_rate / compute_bound
        );
    }
    let rows = prompts(3, model.vocab());
    let old: f64 = rows.iter().map(|r| old_path(model.as_ref(), &params, r)).sum::<f64>() / rows.len() as f64;
    println!(
        "old path (one row, whole window per token): {old:.1} output tokens/s; the KV cache at batch limit 1 is {:.1}x faster end to end",
        batch_one / old
    );
    Ok(())
}

/// What `regatta-torch-rank generate-ids` reads: prompts as token ids and how to continue
/// them (greedy), so a peer tokenizing the same text runs exactly the same rows.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdsJob {
    /// Prompt token ids, one list per row.
    pub prompts: Vec<Vec<i64>>,
    /// Tokens generated per row at most.
    pub max_new_tokens: usize,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// libtorch threads.
    pub threads: usize,
    /// Token ids that end a row.
    #[serde(default)]
    pub eos: Vec<i64>,
    /// KV cache budget in MiB (default 2048).
    #[serde(default)]
    pub kv_cache_mb: Option<u64>,
    /// `cpu` (the default) or `cuda`: on CUDA the weights and the KV cache are bf16 (f16
    /// before Ampere), as `regatta score` has them.
    #[serde(default = "cpu")]
    pub device: String,
    /// Whether rows share the cache blocks of a common prefix (default true).
    #[serde(default = "yes")]
    pub prefix_caching: bool,
    /// Token slots per cache block (default: `GenerationSetup`'s).
    #[serde(default)]
    pub block_tokens: Option<usize>,
    /// Whether CUDA replays decode steps as graphs (default true; ignored on the CPU).
    #[serde(default = "yes")]
    pub cuda_graphs: bool,
    /// Whether float32 weights on the CPU are packed once in oneDNN's layout (default
    /// true; see `GenerationSetup::packed_weights`).
    #[serde(default = "yes")]
    pub packed_weights: bool,
    /// Whether CPU decode steps attend to the cache in place (default true; see
    /// `GenerationSetup::paged_attention`).
    #[serde(default = "yes")]
    pub paged_attention: bool,
    /// Sampling temperature (default 0: greedy); with `top_p` and `seed`, each row drawing
    /// from its own random stream (row `i` is stream `i` of `seed`).
    #[serde(default)]
    pub temperature: f64,
    /// Nucleus cut (default 1: none).
    #[serde(default = "one")]
    pub top_p: f64,
    /// Seed of the rows' random streams.
    #[serde(default)]
    pub seed: u64,
}

fn one() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

fn cpu() -> String {
    "cpu".into()
}

/// What it prints: every row's tokens and where the time went.
#[derive(Debug, serde::Serialize)]
pub struct IdsOutcome {
    /// Generated token ids per row (an end-of-sequence token included).
    pub outputs: Vec<Vec<i64>>,
    /// Seconds to open the model folder and read its weights.
    pub load_seconds: f64,
    /// Seconds generating (prefill and decode, cache set-up included).
    pub generate_seconds: f64,
    /// Seconds in decode forwards.
    pub decode_seconds: f64,
    /// Tokens those decode forwards produced.
    pub decode_tokens: u64,
    /// Seconds in prefill forwards.
    pub prefill_seconds: f64,
    /// Prompt tokens prefilled.
    pub prefill_tokens: u64,
    /// Prompt tokens found in cached blocks instead (prefix caching).
    pub cached_tokens: u64,
    /// Decode steps replayed from CUDA graphs.
    pub graph_steps: u64,
    /// CUDA graphs captured.
    pub graphs_captured: u64,
    /// Why CUDA graphs were not used (none asked, on the CPU, or a failure), if so.
    pub graphs_off: Option<String>,
    /// Where it ran: `cpu` or `cuda:N`.
    pub device: String,
    /// Weight matrices packed for a CPU kernel (panels or oneDNN's layout) (0: libtorch's `linear` throughout).
    pub packed_matrices: usize,
    /// Bytes those packed copies take.
    pub packed_bytes: u64,
    /// The CUDA caching allocator's peak allocated bytes (0 on the CPU).
    pub peak_allocated_bytes: u64,
    /// Its peak reserved bytes (0 on the CPU).
    pub peak_reserved_bytes: u64,
}

/// Generation (greedy unless the job sets a temperature) for token-id prompts with a model folder: the engine alone, for the
/// side-by-side with `transformers.generate` (scripts/bench-vs-hf.sh).
pub fn generate_ids(model_path: &str, job: &IdsJob) -> Result<IdsOutcome> {
    tch::set_num_threads(job.threads.max(1) as i32);
    // `pick_device` reads anything but `cpu` and `cuda` as `auto`: a typo would run on the CPU.
    if !matches!(job.device.as_str(), "cpu" | "cuda") {
        return Err(Error::Invalid(format!(
            "device must be cpu or cuda, not {:?}",
            job.device
        )));
    }
    job.sampling().validate().map_err(|e| Error::Invalid(e.to_string()))?;
    let device = crate::cuda::pick_device(&job.device, &[])?;
    let sync = || {
        if let Device::Cuda(ordinal) = device {
            tch::Cuda::synchronize(ordinal as i64);
        }
    };
    let started = Instant::now();
    let (model, params, context) = load_on(model_path, crate::cuda::inference_kind(device), device)?;
    let setup = job.setup();
    let params = crate::generate::generation_layout(params, &setup, device);
    // Making the generator packs the weights (where it does): part of loading.
    let generator = Generator::new(model.as_ref(), &params, setup, context, job.eos.clone(), device)?;
    sync();
    let load_seconds = started.elapsed().as_secs_f64();
    let rows = job.rows();
    let (packed_matrices, packed_bytes) = generator.packed_weights();
    let started = Instant::now();
    let (outputs, timings) = generator.run_timed(&rows, &|_| String::new(), &mut |_| {})?;
    sync();
    let generate_seconds = started.elapsed().as_secs_f64();
    let memory = match device {
        Device::Cuda(ordinal) => Some(crate::shim::cuda_memory(ordinal, false)?),
        _ => None,
    };
    let outputs = outputs
        .into_iter()
        .enumerate()
        .map(|(i, o)| {
            o.map(|o| o.tokens)
                .map_err(|reason| Error::Invalid(format!("row {i}: {reason}")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(IdsOutcome {
        outputs,
        load_seconds,
        generate_seconds,
        decode_seconds: timings.decode_seconds,
        decode_tokens: timings.decode_tokens,
        prefill_seconds: timings.prefill_seconds,
        prefill_tokens: timings.prefill_tokens,
        cached_tokens: timings.cached_tokens,
        graph_steps: timings.graph_steps,
        graphs_captured: timings.graphs_captured,
        graphs_off: timings.graphs_off.clone(),
        device: crate::cuda::device_label(device),
        packed_matrices,
        packed_bytes,
        peak_allocated_bytes: memory.map_or(0, |m| m.peak_allocated),
        peak_reserved_bytes: memory.map_or(0, |m| m.peak_reserved),
    })
}

impl IdsJob {
    /// How every row is continued.
    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }

    /// The rows: row `i` is its prompt with stream `i` of the seed.
    fn rows(&self) -> Vec<Prepared> {
        self.prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| Prepared {
                prompt: prompt.clone(),
                params: self.sampling(),
                stream: RowStream::new(self.seed, &i.to_string()),
            })
            .collect()
    }

    /// The generator's settings (a 2 GiB cache unless the job sets one).
    fn setup(&self) -> GenerationSetup {
        GenerationSetup {
            kv_cache_bytes: Some(self.kv_cache_mb.unwrap_or(2048) << 20),
            max_batch: self.max_batch.max(1),
            prefill_tokens: 1024,
            prefix_caching: self.prefix_caching,
            cuda_graphs: self.cuda_graphs,
            packed_weights: self.packed_weights,
            paged_attention: self.paged_attention,
            block_tokens: self
                .block_tokens
                .unwrap_or(GenerationSetup::default().block_tokens)
                .max(1),
        }
    }
}
