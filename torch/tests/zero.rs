#![allow(clippy::unwrap_used)]
//! ZeRO stages 1, 2 and 3 against the single-process AdamW reference, with the ranks as
//! threads of this process talking through the in-memory ring (the multi-process version,
//! over QUIC between worker processes, is in the workspace's tests/train.rs).

use regatta_torch::collective::{CpuCollective, TensorCollective};
use regatta_torch::data::RankData;
use regatta_torch::engine::{stage, Engine, Held};
use regatta_torch::{builtin_model, reference_run, tch};
use regatta_trainer::{memory_ring, RingCollective, TrainConfig};

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

fn config(data: String, stage: u8, world: usize) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.data.path = data;
    config.model.layers = 2;
    config.model.width = 25;
    config.model.heads = 5;
    config.model.context = 17;
    config.zero_stage = stage;
    config.world_size = world;
    config.batch_size = 6;
    config.steps = 6;
    config
}

struct RankRun {
    losses: Vec<f64>,
    weights: Vec<(String, tch::Tensor)>,
    held: Held,
    grad_bytes: u64,
}

fn run_ranks(config: &TrainConfig) -> Vec<RankRun> {
    let world = config.world_size;
    let links = memory_ring(world);
    let handles: Vec<_> = links
        .into_iter()
        .enumerate()
        .map(|(rank, link)| {
            let config = config.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let bytes = regatta_torch::data::TextTokenizer::Bytes;
                let data = runtime
                    .block_on(RankData::load(
                        &config.data.path,
                        &bytes,
                        config.model.context,
                        world,
                        &[rank],
                    ))
                    .unwrap();
                let coll: Box<dyn TensorCollective> =
                    Box::new(CpuCollective::new(Box::new(RingCollective::new(rank, world, link))));
                let mut engine = Engine::new(
                    builtin_model(&config, 256),
                    coll,
                    stage(config.zero_stage).unwrap(),
                    config.optimizer.clone(),
                    tch::Device::Cpu,
                    tch::Kind::Float,
                    config.seed,
                )
                .unwrap();
                let b = config.per_rank_batch();
                let mut losses = Vec::new();
                let mut grad_bytes = 0;
                for step in 0..config.steps {
                    let (x, y) = data.batch(step * b as u64, b);
                    let outcome = engine.train_step(&x, &y).unwrap();
                    losses.push(outcome.loss);
                    grad_bytes = outcome.grad_bytes;
                }
                let held = engine.held();
                let weights = engine.consolidated().unwrap();
                RankRun {
                    losses,
                    weights,
                    held,
                    grad_bytes,
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
fn every_stage_matches_the_single_process_reference_and_holds_a_world_th() {
    tch::set_num_threads(1);
    let dir = std::env::temp_dir().join(format!("regatta-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = corpus(&dir);
    for world in [2usize, 3] {
        let (ref_losses, ref_weights) = reference_run(&config(data.clone(), 1, world), world, &builtin_model).unwrap();
        assert!(
            ref_losses.last().unwrap() < &(ref_losses[0] - 0.1),
            "the reference learns: {ref_losses:?}"
        );
        let total: i64 = ref_weights.iter().map(|(_, t)| t.numel() as i64).sum();
        assert_ne!(
            total % world as i64,
            0,
            "the parameter count must not divide by the world"
        );
        let full_bytes = total as u64 * 4;
        for zero in 1..=3u8 {
            let runs = run_ranks(&config(data.clone(), zero, world));
            for run in &runs {
                for (step, (a, b)) in run.losses.iter().zip(&ref_losses).enumerate() {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "world {world} stage {zero} step {step}: {a} vs {b}"
                    );
                }
                let diff = max_difference(&run.weights, &ref_weights);
                assert!(diff < 1e-5, "world {world} stage {zero}: parameters differ by {diff}");
                // Optimizer state is a world-th (plus at most world - 1 padding elements per block).
                let slack = 3 * 4 * world as u64 * 4;
                let optimizer_share = run.held.optimizer * world as u64;
                assert!(
                    optimizer_share >= 3 * full_bytes && optimizer_share <= 3 * full_bytes + slack * world as u64,
                    "world {world} stage {zero}: optimizer {} bytes of {}",
                    run.held.optimizer,
                    3 * full_bytes
                );
                let share = |bytes: u64| bytes * world as u64 <= full_bytes + slack * world as u64;
                match zero {
                    1 => assert!(run.grad_bytes >= full_bytes && run.held.parameters >= full_bytes),
                    2 => assert!(
                        share(run.grad_bytes) && run.held.parameters >= full_bytes,
                        "stage 2 grads"
                    ),
                    _ => assert!(
                        share(run.grad_bytes) && share(run.held.parameters),
                        "stage 3 grads and params"
                    ),
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The engine's AdamW is PyTorch's: the same steps as tch's own `nn::AdamW` on a tiny
/// linear model (one block: the logits are `x @ w.T + b`).
struct Linear;

impl regatta_torch::LayeredModel for Linear {
    fn blocks(&self) -> Vec<Vec<regatta_torch::ParamSpec>> {
        vec![vec![
            regatta_torch::ParamSpec {
                name: "w".into(),
                shape: vec![3, 4],
                init: regatta_torch::Init::Normal(0.5),
            },
            regatta_torch::ParamSpec {
                name: "b".into(),
                shape: vec![3],
                init: regatta_torch::Init::Normal(0.5),
            },
        ]]
    }
    fn forward(&self, _block: usize, p: &[tch::Tensor], input: &tch::Tensor) -> tch::Tensor {
        input.linear(&p[0], Some(&p[1]))
    }
    fn loss(&self, output: &tch::Tensor, targets: &tch::Tensor) -> tch::Tensor {
        output.cross_entropy_for_logits(targets)
    }
    fn flops_per_token(&self) -> f64 {
        0.0
    }
}

#[test]
fn the_engines_adamw_matches_libtorchs() {
    use tch::nn::OptimizerConfig;
    let mut opt = TrainConfig::default().optimizer;
    opt.lr = 0.05;
    opt.weight_decay = 0.1;
    opt.warmup_steps = 0;
    let mut engine = Engine::new(
        Box::new(Linear),
        Box::new(regatta_torch::collective::Solo),
        stage(1).unwrap(),
        opt.clone(),
        tch::Device::Cpu,
        tch::Kind::Float,
        3,
    )
    .unwrap();
    let start = engine.consolidated().unwrap();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let w = vs.root().var_copy("w", &start[0].1);
    let b = vs.root().var_copy("b", &start[1].1);
    let mut adamw = tch::nn::AdamW {
        beta1: opt.beta1,
        beta2: opt.beta2,
        wd: opt.weight_decay,
        eps: opt.eps,
        amsgrad: false,
    }
    .build(&vs, opt.lr)
    .unwrap();
    let x = tch::Tensor::from_slice(&[0.5f32, -1.0, 2.0, 0.1, 1.5, 0.3, -0.7, 0.9]).view([2, 4]);
    let y = tch::Tensor::from_slice(&[2i64, 0]);
    for _ in 0..5 {
        engine.train_step(&x, &y).unwrap();
        let loss = x.linear(&w, Some(&b)).cross_entropy_for_logits(&y);
        adamw.backward_step(&loss);
    }
    let ours = engine.consolidated().unwrap();
    let diff = (&ours[0].1 - &w)
        .abs()
        .max()
        .double_value(&[])
        .max((&ours[1].1 - &b).abs().max().double_value(&[]));
    assert!(diff < 1e-6, "the engine's AdamW differs from libtorch's by {diff}");
    assert!(
        (&ours[0].1 - &start[0].1).abs().max().double_value(&[]) > 0.01,
        "the weights moved"
    );
}

#[test]
fn trained_weights_score_held_out_rows_better_than_initial_ones() {
    use regatta_torch::data::TextTokenizer;
    use regatta_torch::score::Scorer;
    let mut config = TrainConfig::default();
    config.data.path = format!("{}/../data/corpus.txt", env!("CARGO_MANIFEST_DIR"));
    config.model.layers = 1;
    config.model.width = 32;
    config.model.context = 32;
    config.steps = 80;
    config.batch_size = 8;
    let initial = Engine::new(
        builtin_model(&config, 256),
        Box::new(regatta_torch::collective::Solo),
        stage(1).unwrap(),
        config.optimizer.clone(),
        tch::Device::Cpu,
        tch::Kind::Float,
        config.seed,
    )
    .unwrap()
    .consolidated()
    .unwrap();
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
    let mean_perplexity = |weights| {
        let scorer = Scorer::from_weights(
            config.model.clone(),
            256,
            weights,
            TextTokenizer::Bytes,
            tch::Device::Cpu,
        )
        .unwrap();
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
