#![allow(clippy::unwrap_used)]
//! ZeRO stages 1, 2 and 3 against the plain single-process libtorch reference (autograd,
//! `clip_grad_norm`, libtorch's AdamW), on the built-in GPT and on Hugging Face Llama and
//! Qwen2 (tied embeddings) fixtures, with gradient accumulation and clipping on, and the
//! ranks as threads of this process talking through the in-memory ring (the multi-process version,
//! over QUIC between worker processes, is in the workspace's tests/train.rs).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use regatta_torch::collective::{CollResult, CpuCollective, Landing, Pending, TensorCollective};
use regatta_torch::{builtin_model, reference_run, tch};
use regatta_torch::{open_run_model, step_batches};
use regatta_torch::{seeded, Engine, EngineSettings, Held};
use regatta_trainer::{memory_ring, RingCollective, TrainConfig, ZeroStage};

fn corpus(dir: &std::path::Path) -> String {
    let path = dir.join("corpus.txt");
    let mut text = String::new();
    for i in 0..400 {
        text.push_str(&format!(
            "line {i}: the quick brown fox {} jumps over {} lazy dogs.\n",
            i * 7 % 13,
            i % 5
        ));
    }
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

#[derive(Clone, Copy, Debug)]
enum Subject {
    /// The built-in GPT, whose parameter count divides by neither 2 nor 3.
    Gpt,
    /// A fixture made by transformers (tests/fixtures/NAME), with the 512-token tokenizer.
    Fixture(&'static str),
}

fn config(data: String, subject: Subject, stage: u8, world: usize) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.data.path = data;
    config.zero_stage = ZeroStage::try_from(stage).unwrap();
    config.world_size = world;
    config.micro_batch_size = 1;
    config.gradient_accumulation = 2;
    // Small enough that clipping acts.
    config.optimizer.max_grad_norm = 0.5;
    config.optimizer.warmup_steps = 2;
    match subject {
        Subject::Gpt => {
            config.model.layers = 2;
            config.model.width = 25;
            config.model.heads = 5;
            config.model.context = 17;
            config.steps = 6;
        }
        Subject::Fixture(name) => {
            config.model.path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
            config.data.tokenizer = format!("{}/../data/tokenizer.json", env!("CARGO_MANIFEST_DIR"));
            config.model.context = 16;
            config.steps = 3;
        }
    }
    config
}

struct RankRun {
    losses: Vec<f64>,
    norms: Vec<f64>,
    weights: Vec<(String, tch::Tensor)>,
    held: Held,
    grad_bytes: u64,
    blocks: usize,
}

/// The CPU ring dressed as a backend with a stream of its own: gathers start at once (the
/// values are what NCCL's would be) but land only when waited for, and it says it
/// overlaps, so the engine prefetches. Counts the landings.
struct Streamlike {
    inner: CpuCollective,
    landed: Arc<AtomicUsize>,
}

struct CountedLanding(Arc<AtomicUsize>);

impl Landing for CountedLanding {
    fn order_compute(&self) -> CollResult<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl TensorCollective for Streamlike {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce(&mut self, input: &tch::Tensor) -> CollResult<tch::Tensor> {
        self.inner.all_reduce(input)
    }
    fn reduce_scatter(&mut self, input: &tch::Tensor) -> CollResult<tch::Tensor> {
        self.inner.reduce_scatter(input)
    }
    fn all_gather(&mut self, input: &tch::Tensor) -> CollResult<tch::Tensor> {
        self.inner.all_gather(input)
    }
    fn broadcast(&mut self, input: &tch::Tensor, root: usize) -> CollResult<tch::Tensor> {
        self.inner.broadcast(input, root)
    }
    fn barrier(&mut self) -> CollResult<()> {
        self.inner.barrier()
    }
    fn all_gather_start(&mut self, input: &tch::Tensor) -> CollResult<Pending> {
        let out = self.inner.all_gather(input)?;
        Ok(Pending::landing(out, Box::new(CountedLanding(self.landed.clone()))))
    }
    fn overlaps(&self) -> bool {
        true
    }
}

fn run_ranks(config: &TrainConfig) -> Vec<RankRun> {
    run_ranks_with(config, None)
}

/// `landed`: run over [`Streamlike`] (prefetching), counting the gathers that landed.
fn run_ranks_with(config: &TrainConfig, landed: Option<Arc<AtomicUsize>>) -> Vec<RankRun> {
    let world = config.world_size;
    let links = memory_ring(world);
    let handles: Vec<_> = links
        .into_iter()
        .enumerate()
        .map(|(rank, link)| {
            let config = config.clone();
            let landed = landed.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let run_model = runtime.block_on(open_run_model(&config, &builtin_model)).unwrap();
                let data = runtime.block_on(run_model.data(&config, world, &[rank])).unwrap();
                let ring = CpuCollective::new(Box::new(RingCollective::new(rank, world, link)));
                let coll: Box<dyn TensorCollective> = match landed {
                    Some(landed) => Box::new(Streamlike { inner: ring, landed }),
                    None => Box::new(ring),
                };
                let settings = EngineSettings {
                    stage: config.zero_stage,
                    optimizer: config.optimizer.clone(),
                    steps: config.steps,
                    device: tch::Device::Cpu,
                    compute: tch::Kind::Float,
                    activation_checkpointing: false,
                    offload: Default::default(),
                    seed: 0,
                };
                let source = run_model.source;
                let mut init = |spec: &regatta_torch::ParamSpec| match &source {
                    Some(hf) => runtime.block_on(hf.read(spec)),
                    None => Ok(seeded(spec, config.seed)),
                };
                let mut engine = Engine::new(run_model.model, coll, settings, &mut init).unwrap();
                let blocks = engine.specs().len();
                let (mut losses, mut norms) = (Vec::new(), Vec::new());
                let mut grad_bytes = 0;
                for step in 0..config.steps {
                    let outcome = engine.train_step(&step_batches(&config, &data, step)).unwrap();
                    losses.push(outcome.loss);
                    norms.push(outcome.grad_norm);
                    grad_bytes = outcome.grad_bytes;
                }
                let held = engine.held();
                let weights = engine.consolidated().unwrap();
                RankRun {
                    losses,
                    norms,
                    weights,
                    held,
                    grad_bytes,
                    blocks,
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn max_difference(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            assert_eq!(ta.size(), tb.size(), "{na}");
            (ta - tb).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

#[test]
fn stage_three_prefetching_the_next_block_trains_exactly_as_gathering_on_demand() {
    tch::set_num_threads(1);
    let dir = std::env::temp_dir().join(format!("regatta-zero-prefetch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = corpus(&dir);
    // The GPT and Qwen2 (its LM head is the embedding: a tied gather out of order).
    for subject in [Subject::Gpt, Subject::Fixture("qwen2")] {
        let config = config(data.clone(), subject, 3, 2);
        let plain = run_ranks(&config);
        let landed = Arc::new(AtomicUsize::new(0));
        let prefetched = run_ranks_with(&config, Some(landed.clone()));
        // Every block but the first is prefetched in forward and in backward, every
        // micro-batch of every step, on both ranks.
        let blocks = plain[0].blocks;
        let micro = (config.steps * config.gradient_accumulation as u64) as usize;
        assert!(
            landed.load(Ordering::SeqCst) >= 2 * micro * 2 * (blocks - 2),
            "{subject:?}: {} prefetched gathers landed",
            landed.load(Ordering::SeqCst)
        );
        for (a, b) in plain.iter().zip(&prefetched) {
            // The same values gathered at other moments: bit for bit the same run (a
            // gather kept across the update would show here as stale parameters).
            assert_eq!(a.losses, b.losses, "{subject:?}");
            assert_eq!(a.norms, b.norms, "{subject:?}");
            assert_eq!(max_difference(&a.weights, &b.weights), 0.0, "{subject:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_stage_matches_the_plain_libtorch_reference_and_holds_a_world_th() {
    tch::set_num_threads(1);
    let dir = std::env::temp_dir().join(format!("regatta-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = corpus(&dir);
    for subject in [Subject::Gpt, Subject::Fixture("llama"), Subject::Fixture("qwen2")] {
        for world in [2usize, 3] {
            let (ref_losses, ref_weights) =
                reference_run(&config(data.clone(), subject, 1, world), world, &builtin_model).unwrap();
            assert!(
                ref_losses.last().unwrap() < &(ref_losses[0] - 0.05),
                "{subject:?}: the reference learns: {ref_losses:?}"
            );
            let total: i64 = ref_weights.iter().map(|(_, t)| t.numel() as i64).sum();
            if matches!(subject, Subject::Gpt) {
                assert_ne!(
                    total % world as i64,
                    0,
                    "the parameter count must not divide by the world"
                );
            }
            let full_bytes = total as u64 * 4;
            for zero in 1..=3u8 {
                let runs = run_ranks(&config(data.clone(), subject, zero, world));
                for run in &runs {
                    let what = format!("{subject:?} world {world} stage {zero}");
                    assert!(run.norms[0] > 0.5, "{what}: clipping acts (norms {:?})", run.norms);
                    for (step, (a, b)) in run.losses.iter().zip(&ref_losses).enumerate() {
                        assert!((a - b).abs() < 1e-5, "{what} step {step}: {a} vs {b}");
                    }
                    let diff = max_difference(&run.weights, &ref_weights);
                    assert!(diff < 1e-5, "{what}: parameters differ by {diff}");
                    // A world-th each (plus at most world - 1 padding elements per block).
                    let slack = run.blocks as u64 * 4 * world as u64;
                    let optimizer_share = run.held.optimizer * world as u64;
                    assert!(
                        optimizer_share >= 3 * full_bytes && optimizer_share <= 3 * (full_bytes + slack * world as u64),
                        "{what}: optimizer {} bytes of {}",
                        run.held.optimizer,
                        3 * full_bytes
                    );
                    let share = |bytes: u64| bytes * world as u64 <= full_bytes + slack * world as u64;
                    match zero {
                        1 => assert!(run.grad_bytes >= full_bytes && run.held.parameters >= full_bytes),
                        2 => assert!(
                            share(run.grad_bytes) && run.held.parameters >= full_bytes,
                            "{what}: grads"
                        ),
                        _ => assert!(
                            share(run.grad_bytes) && share(run.held.parameters),
                            "{what}: grads and params"
                        ),
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trained_weights_score_held_out_rows_better_than_initial_ones() {
    use regatta_torch::Scorer;
    use regatta_torch::TextTokenizer;
    let mut config = TrainConfig::default();
    config.data.path = format!("{}/../data/corpus.txt", env!("CARGO_MANIFEST_DIR"));
    config.model.layers = 1;
    config.model.width = 32;
    config.model.context = 32;
    config.steps = 80;
    config.micro_batch_size = 8;
    let model = builtin_model(&config, 256);
    let initial: Vec<(String, tch::Tensor)> = model
        .blocks()
        .into_iter()
        .flatten()
        .map(|spec| (spec.name.clone(), seeded(&spec, config.seed)))
        .collect();
    let (losses, trained) = reference_run(&config, 1, &builtin_model).unwrap();
    let eval = std::fs::read_to_string(format!("{}/../data/eval.jsonl", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let texts: Vec<String> = eval
        .lines()
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(line).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let mean_perplexity = |weights: Vec<(String, tch::Tensor)>| {
        let by_name: std::collections::HashMap<_, _> = weights.into_iter().collect();
        let model = builtin_model(&config, 256);
        let params = regatta_torch::arrange(model.as_ref(), &by_name).unwrap();
        let scorer = Scorer::from_model(
            model,
            params,
            config.model.context,
            TextTokenizer::Bytes,
            tch::Device::Cpu,
            None,
        );
        let rows: Vec<_> = texts.iter().map(|t| scorer.tokenize(t).unwrap()).collect();
        let scored = scorer.score(&rows, 0).unwrap();
        scored.iter().map(|s| s.perplexity).sum::<f64>() / scored.len() as f64
    };
    let (before, after) = (mean_perplexity(initial), mean_perplexity(trained));
    eprintln!("held-out perplexity {before:.1} -> {after:.1}");
    assert!(
        after < 0.5 * before,
        "perplexity {before:.1} -> {after:.1} (loss {losses:?})"
    );
}
