#![allow(clippy::unwrap_used)]
//! LoRA and ZeRO-Offload. Adapters against `peft` on fixtures it made
//! (`scripts/make-lora-fixtures.py`: PEFT's logits unmerged and merged, its file layout);
//! LoRA training over 2 ranks at every ZeRO stage against the plain libtorch reference
//! (autograd, libtorch's AdamW over the adapters only); optimizer offload against the same
//! run without it. The ranks are threads talking through the in-memory ring.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use regatta_torch::checkpoint::adapter_files;
use regatta_torch::collective::{CpuCollective, TensorCollective};
use regatta_torch::merge_adapter;
use regatta_torch::tch::{self, Device, Kind, Tensor};
use regatta_torch::Adapter;
use regatta_torch::{arrange, dropout, logits};
use regatta_torch::{builtin_model, reference_run, HfModel, Model};
use regatta_torch::{initial_weights, open_run_model, step_batches, take_stored_quantized};
use regatta_torch::{Engine, EngineSettings, Held};
use regatta_trainer::{memory_ring, LoraConfig, Offload, RingCollective, TrainConfig, ZeroConfig, ZeroStage};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("regatta-lora-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The fixture's base with its PEFT adapter applied (unmerged), and the PEFT reference.
/// A model, its parameters per block, and the PEFT reference tensors by name.
type Loaded = (Box<dyn Model>, Vec<Vec<Tensor>>, HashMap<String, Tensor>);

fn load_with_adapter(name: &str, adapter: &Path) -> Loaded {
    let rt = runtime();
    let hf = rt.block_on(HfModel::open(fixture(name).to_str().unwrap())).unwrap();
    let adapter = rt.block_on(Adapter::open(adapter.to_str().unwrap())).unwrap();
    let mut model = hf.model().unwrap();
    model.set_lora(&adapter.config).unwrap();
    adapter.check(model.as_ref()).unwrap();
    let mut stored = HashMap::new();
    for spec in model.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
        let tensor = match adapter.tensors.get(&spec.name) {
            Some(t) => t.shallow_clone(),
            None => rt.block_on(hf.read(&spec)).unwrap(),
        };
        stored.insert(spec.name.clone(), tensor);
    }
    let params = arrange(model.as_ref(), &stored).unwrap();
    let reference = Tensor::read_safetensors(fixture(&format!("{name}-lora/lora-reference.safetensors")))
        .unwrap()
        .into_iter()
        .collect();
    (model, params, reference)
}

#[test]
fn an_adapter_from_peft_gives_peft_logits_and_merging_keeps_them() {
    tch::set_num_threads(1);
    for name in ["llama", "qwen2"] {
        let adapter_dir = fixture(&format!("{name}-lora"));
        let (model, params, reference) = load_with_adapter(name, &adapter_dir);
        let ids = &reference["input_ids"];
        let ours = tch::no_grad(|| logits(model.as_ref(), &params, ids));
        let diff = max_abs(&(&ours - &reference["logits"]));
        assert!(diff < 1e-5, "{name}: LoRA logits differ from peft's by {diff}");
        let effect = max_abs(&(&reference["logits"] - &reference["base_logits"]));
        assert!(effect > 0.1, "{name}: the adapter changes the logits ({effect})");

        // Merged into a plain folder (small shards: several files and an index), then
        // loaded as an ordinary model: the same logits.
        let out = temp_dir(&format!("merged-{name}"));
        let rt = runtime();
        let hf = rt.block_on(HfModel::open(fixture(name).to_str().unwrap())).unwrap();
        let adapter = rt.block_on(Adapter::open(adapter_dir.to_str().unwrap())).unwrap();
        let written = rt
            .block_on(merge_adapter(&hf, &adapter, out.to_str().unwrap(), 40_000))
            .unwrap();
        assert!(written.iter().any(|f| f == "config.json") && written.iter().any(|f| f == "tokenizer.json"));
        let merged = rt.block_on(HfModel::open(out.to_str().unwrap())).unwrap();
        let plain = merged.model().unwrap();
        merged.check(plain.as_ref()).unwrap();
        let stored: HashMap<String, Tensor> = plain
            .blocks()
            .into_iter()
            .flatten()
            .filter(|s| s.tied_to.is_none())
            .map(|s| (s.name.clone(), rt.block_on(merged.read(&s)).unwrap()))
            .collect();
        let merged_logits = tch::no_grad(|| logits(plain.as_ref(), &arrange(plain.as_ref(), &stored).unwrap(), ids));
        for (what, expected) in [
            ("unmerged", &reference["logits"]),
            ("merged", &reference["merged_logits"]),
        ] {
            let diff = max_abs(&(&merged_logits - expected));
            assert!(
                diff < 1e-5,
                "{name}: merged weights' logits differ from peft's {what} ones by {diff}"
            );
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn a_bf16_base_merges_in_float32_and_is_written_in_bf16_as_peft_keeps_it() {
    tch::set_num_threads(1);
    let dir = temp_dir("bf16");
    let base = dir.join("base");
    copy_dir(&fixture("llama"), &base);
    for entry in std::fs::read_dir(&base).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") && path.file_name().unwrap() != "generate.safetensors" {
            let tensors: Vec<(String, Tensor)> = Tensor::read_safetensors(&path)
                .unwrap()
                .into_iter()
                .map(|(n, t)| (n, t.to_kind(Kind::BFloat16)))
                .collect();
            Tensor::write_safetensors(&tensors, &path).unwrap();
        }
    }
    let rt = runtime();
    let hf = rt.block_on(HfModel::open(base.to_str().unwrap())).unwrap();
    let adapter = rt
        .block_on(Adapter::open(fixture("llama-lora").to_str().unwrap()))
        .unwrap();
    let out = dir.join("merged");
    rt.block_on(merge_adapter(&hf, &adapter, out.to_str().unwrap(), 1 << 30))
        .unwrap();
    let merged: HashMap<String, Tensor> = Tensor::read_safetensors(out.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let name = "model.layers.1.self_attn.v_proj";
    let original: HashMap<String, Tensor> = (1..=10)
        .flat_map(|i| Tensor::read_safetensors(base.join(format!("model-{i:05}-of-00010.safetensors"))).unwrap())
        .collect();
    let weight = &merged[&format!("{name}.weight")];
    assert_eq!(weight.kind(), Kind::BFloat16);
    let expected = original[&format!("{name}.weight")].to_kind(Kind::Float)
        + adapter.tensors[&format!("{name}.lora_B.weight")].matmul(&adapter.tensors[&format!("{name}.lora_A.weight")])
            * adapter.config.scale();
    // Merged in f32, rounded to bf16 once at the end.
    assert!(weight.equal(&expected.to_kind(Kind::BFloat16)));
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let _ = std::fs::remove_dir_all(&dir);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn bad_adapters_name_the_tensor_and_the_expected_shape() {
    tch::set_num_threads(1);
    let rt = runtime();
    let check = |base: &str, adapter: &Path| -> String {
        let hf = rt.block_on(HfModel::open(fixture(base).to_str().unwrap())).unwrap();
        let opened = match rt.block_on(Adapter::open(adapter.to_str().unwrap())) {
            Ok(a) => a,
            Err(e) => return e.to_string(),
        };
        let mut model = hf.model().unwrap();
        model.set_lora(&opened.config).unwrap();
        opened.check(model.as_ref()).unwrap_err().to_string()
    };
    let dir = temp_dir("bad");
    // adapter_config.json says r = 8, the tensors are rank 4.
    let wrong_rank = dir.join("wrong-rank");
    copy_dir(&fixture("llama-lora"), &wrong_rank);
    let config_path = wrong_rank.join("adapter_config.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    json["r"] = 8.into();
    std::fs::write(&config_path, serde_json::to_vec(&json).unwrap()).unwrap();
    let error = check("llama", &wrong_rank);
    assert!(
        error.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
            && error.contains("has shape [4, 64]")
            && error.contains("[8, 64]"),
        "{error}"
    );
    // A tensor missing.
    let missing = dir.join("missing");
    copy_dir(&fixture("llama-lora"), &missing);
    let weights = missing.join("adapter_model.safetensors");
    let kept: Vec<(String, Tensor)> = Tensor::read_safetensors(&weights)
        .unwrap()
        .into_iter()
        .filter(|(n, _)| !n.contains("layers.1.mlp.up_proj.lora_B"))
        .collect();
    Tensor::write_safetensors(&kept, &weights).unwrap();
    let error = check("llama", &missing);
    assert!(
        error.contains("layers.1.mlp.up_proj.lora_B.weight is missing") && error.contains("[160, 4]"),
        "{error}"
    );
    // Another base: the fixture's config with a narrower MLP and one layer more.
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("llama/config.json")).unwrap()).unwrap();
    json["intermediate_size"] = 96.into();
    let mut other = regatta_torch::model_from_config(&json, "other/config.json").unwrap();
    let adapter = rt
        .block_on(Adapter::open(fixture("llama-lora").to_str().unwrap()))
        .unwrap();
    other.set_lora(&adapter.config).unwrap();
    let error = adapter.check(other.as_ref()).unwrap_err().to_string();
    assert!(
        error.contains("base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight has shape [160, 4]")
            && error.contains("imply [96, 4]"),
        "{error}"
    );
    json["intermediate_size"] = 160.into();
    json["num_hidden_layers"] = 3.into();
    let mut deeper = regatta_torch::model_from_config(&json, "deeper/config.json").unwrap();
    deeper.set_lora(&adapter.config).unwrap();
    let error = adapter.check(deeper.as_ref()).unwrap_err().to_string();
    assert!(error.contains("layers.2.") && error.contains("is missing"), "{error}");
    json["num_hidden_layers"] = 1.into();
    let mut shallower = regatta_torch::model_from_config(&json, "shallower/config.json").unwrap();
    shallower.set_lora(&adapter.config).unwrap();
    let error = adapter.check(shallower.as_ref()).unwrap_err().to_string();
    assert!(
        error.contains("layers.1.") && error.contains("targets a module the base model does not have"),
        "{error}"
    );
    // A tensor that is not an adapter's.
    let foreign = dir.join("foreign");
    copy_dir(&fixture("llama-lora"), &foreign);
    let weights = foreign.join("adapter_model.safetensors");
    let mut all = Tensor::read_safetensors(&weights).unwrap();
    all.push((
        "base_model.model.lm_head.weight".into(),
        Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)),
    ));
    Tensor::write_safetensors(&all, &weights).unwrap();
    let error = check("llama", &foreign);
    assert!(error.contains("lm_head.weight is not a LoRA tensor"), "{error}");
    // Garbage bytes and an unsupported kind of adapter.
    let garbage = dir.join("garbage");
    copy_dir(&fixture("llama-lora"), &garbage);
    std::fs::write(garbage.join("adapter_model.safetensors"), b"not safetensors").unwrap();
    assert!(check("llama", &garbage).contains("not a valid safetensors file"));
    let dora = dir.join("dora");
    copy_dir(&fixture("llama-lora"), &dora);
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dora.join("adapter_config.json")).unwrap()).unwrap();
    json["use_dora"] = true.into();
    std::fs::write(dora.join("adapter_config.json"), serde_json::to_vec(&json).unwrap()).unwrap();
    assert!(check("llama", &dora).contains("use_dora"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_saved_adapter_has_peft_names_shapes_and_config_keys() {
    tch::set_num_threads(1);
    let (model, params, _) = load_with_adapter("llama", &fixture("llama-lora"));
    let lora = model.lora().unwrap().clone();
    let named: Vec<(String, Tensor)> = model
        .blocks()
        .into_iter()
        .flatten()
        .zip(params.into_iter().flatten())
        .map(|(spec, t)| (spec.name, t))
        .collect();
    let files = adapter_files(&lora, "torch/tests/fixtures/llama", &named).unwrap();
    let dir = temp_dir("saved");
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let shapes = |path: PathBuf| -> Vec<(String, Vec<i64>)> {
        let mut all: Vec<_> = Tensor::read_safetensors(path)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.size()))
            .collect();
        all.sort();
        all
    };
    let ours = shapes(dir.join("adapter_model.safetensors"));
    let peft = shapes(fixture("llama-lora/adapter_model.safetensors"));
    assert_eq!(ours, peft, "the same tensor names and shapes as peft's save_pretrained");
    let keys = |path: PathBuf| -> std::collections::BTreeSet<String> {
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        json.as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "peft_version")
            .cloned()
            .collect()
    };
    assert_eq!(
        keys(dir.join("adapter_config.json")),
        keys(fixture("llama-lora/adapter_config.json"))
    );
    // And it reads back as the same adapter.
    let rt = runtime();
    let back = rt.block_on(Adapter::open(dir.to_str().unwrap())).unwrap();
    let peft = rt
        .block_on(Adapter::open(fixture("llama-lora").to_str().unwrap()))
        .unwrap();
    assert_eq!(back.config.rank, peft.config.rank);
    assert_eq!(back.config.scale(), peft.config.scale());
    for (name, t) in &peft.tensors {
        assert!(max_abs(&(t - &back.tensors[name])) == 0.0, "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The mask is hashed a chunk of 4M elements at a time: an element's mask does not depend
/// on the tensor around it, and past the first chunk the rate holds.
#[test]
fn dropout_masks_are_the_same_in_chunks_as_whole() {
    let big = Tensor::ones([5 << 20], (Kind::Float, Device::Cpu));
    let small = Tensor::ones([1000], (Kind::Float, Device::Cpu));
    let a = dropout(&big, 0.25, 7);
    assert_eq!(max_abs(&(a.narrow(0, 0, 1000) - dropout(&small, 0.25, 7))), 0.0);
    let tail = a.narrow(0, 4 << 20, 1 << 20);
    let kept = tail.ne(0.0).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
    assert!((kept - 0.75).abs() < 0.01, "kept {kept} past the first chunk");
    // Past the first chunk the hash goes on from the chunk's offset: not the first
    // chunk's pattern again (two independent masks agree on 0.75² + 0.25² = 62.5%).
    let agree = tail
        .eq_tensor(&a.narrow(0, 0, 1 << 20))
        .to_kind(Kind::Float)
        .mean(Kind::Float)
        .double_value(&[]);
    assert!((agree - 0.625).abs() < 0.01, "agreement {agree} with the first chunk");
    let empty = Tensor::ones([0, 4], (Kind::Float, Device::Cpu));
    assert_eq!(dropout(&empty, 0.25, 7).size(), vec![0, 4]);
}

#[test]
fn dropout_masks_are_a_function_of_the_seed() {
    let x = Tensor::ones([400, 250], (Kind::Float, Device::Cpu));
    let a = dropout(&x, 0.25, 7);
    let kept = a.ne(0.0).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
    assert!((kept - 0.75).abs() < 0.01, "kept {kept}");
    assert!(
        (a.sum(Kind::Float).double_value(&[]) / 100_000.0 - 1.0).abs() < 0.02,
        "scaled by 1/(1-p)"
    );
    assert_eq!(
        max_abs(&(&a - dropout(&x, 0.25, 7))),
        0.0,
        "the same seed, the same mask"
    );
    let other = dropout(&x, 0.25, 8);
    let same = a
        .eq_tensor(&other)
        .to_kind(Kind::Float)
        .mean(Kind::Float)
        .double_value(&[]);
    assert!(same < 0.7, "another seed, another mask ({same} equal)");
}

fn corpus(dir: &Path) -> String {
    let path = dir.join("corpus.txt");
    let text: String = (0..400)
        .map(|i| {
            format!(
                "line {i}: the quick brown fox {} jumps over {} lazy dogs.\n",
                i * 7 % 13,
                i % 5
            )
        })
        .collect();
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn lora_config(data: String, stage: u8, lora: Option<LoraConfig>, zero: ZeroConfig) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.data.path = data;
    config.zero_stage = ZeroStage::try_from(stage).unwrap();
    config.world_size = 2;
    config.micro_batch_size = 1;
    config.gradient_accumulation = 2;
    config.optimizer.max_grad_norm = 0.05;
    config.optimizer.warmup_steps = 1;
    config.optimizer.lr = 1e-2;
    config.model.path = fixture("llama").to_string_lossy().into_owned();
    config.data.tokenizer = format!("{}/../data/tokenizer.json", env!("CARGO_MANIFEST_DIR"));
    config.model.context = 16;
    config.steps = 4;
    config.lora = lora;
    config.zero = zero;
    config
}

struct RankRun {
    losses: Vec<f64>,
    norms: Vec<f64>,
    trained: Vec<(String, Tensor)>,
    frozen: Vec<(String, Tensor)>,
    optimizer_state: Vec<(String, Tensor)>,
    held: Held,
    trained_count: u64,
}

fn run_ranks(config: &TrainConfig) -> Vec<RankRun> {
    let world = config.world_size;
    let handles: Vec<_> = memory_ring(world)
        .into_iter()
        .enumerate()
        .map(|(rank, link)| {
            let config = config.clone();
            std::thread::spawn(move || {
                let rt = runtime();
                let run_model = rt.block_on(open_run_model(&config, &builtin_model)).unwrap();
                let data = rt.block_on(run_model.data(&config, world, &[rank])).unwrap();
                let coll: Box<dyn TensorCollective> =
                    Box::new(CpuCollective::new(Box::new(RingCollective::new(rank, world, link))));
                let settings = EngineSettings {
                    stage: config.zero_stage,
                    optimizer: config.optimizer.clone(),
                    steps: config.steps,
                    device: Device::Cpu,
                    compute: Kind::Float,
                    activation_checkpointing: false,
                    offload: config.zero.clone(),
                    seed: config.seed,
                };
                let source = run_model.source;
                let mut model = run_model.model;
                rt.block_on(take_stored_quantized(model.as_mut(), source.as_ref(), Device::Cpu))
                    .unwrap();
                let mut init =
                    |spec: &regatta_torch::ParamSpec| rt.block_on(initial_weights(source.as_ref(), spec, config.seed));
                let mut engine = Engine::new(model, coll, settings, &mut init).unwrap();
                let (mut losses, mut norms) = (Vec::new(), Vec::new());
                for step in 0..config.steps {
                    let outcome = engine.train_step(&step_batches(&config, &data, step)).unwrap();
                    losses.push(outcome.loss);
                    norms.push(outcome.grad_norm);
                }
                RankRun {
                    losses,
                    norms,
                    held: engine.held(),
                    trained_count: engine.trained_parameter_count(),
                    optimizer_state: engine.optimizer_state(),
                    trained: engine.consolidated().unwrap(),
                    frozen: engine.frozen_consolidated().unwrap(),
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A rank's losses and trained weights equal the reference's within 1e-5.
fn assert_trains_as(what: &str, run: &RankRun, ref_losses: &[f64], ref_weights: &[(String, Tensor)]) {
    for (step, (a, b)) in run.losses.iter().zip(ref_losses).enumerate() {
        assert!((a - b).abs() < 1e-5, "{what} step {step}: {a} vs {b}");
    }
    let diff = max_difference(&run.trained, ref_weights);
    assert!(diff < 1e-5, "{what}: adapters differ from the reference by {diff}");
}

fn max_difference(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            max_abs(&(ta - tb))
        })
        .fold(0.0, f64::max)
}

fn adapters(rank: usize, targets: &[&str]) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        ..LoraConfig::default()
    }
}

#[test]
fn lora_training_over_two_ranks_matches_the_reference_at_every_stage_and_trains_only_adapters() {
    tch::set_num_threads(1);
    let dir = temp_dir("train");
    let data = corpus(&dir);
    let lora = adapters(4, &["all-linear"]);
    let reference_config = lora_config(data.clone(), 1, Some(lora.clone()), ZeroConfig::default());
    let (ref_losses, ref_weights) = reference_run(&reference_config, 2, &builtin_model).unwrap();
    assert_eq!(ref_weights.len(), 2 * 7 * 2, "A and B of 7 projections in 2 layers");
    assert!(
        ref_weights.iter().all(|(n, _)| regatta_trainer::is_adapter(n)),
        "the reference trains adapters only"
    );
    assert!(
        ref_losses[3] < ref_losses[0] - 0.05,
        "the adapters learn: {ref_losses:?}"
    );
    // The base as the folder holds it: never changed by training.
    let rt = runtime();
    let hf = rt.block_on(HfModel::open(fixture("llama").to_str().unwrap())).unwrap();
    let adapter_numel: i64 = ref_weights.iter().map(|(_, t)| t.numel() as i64).sum();
    for stage in 1..=3u8 {
        let runs = run_ranks(&lora_config(
            data.clone(),
            stage,
            Some(lora.clone()),
            ZeroConfig::default(),
        ));
        for (rank, run) in runs.iter().enumerate() {
            let what = format!("stage {stage} rank {rank}");
            assert!(run.norms[1] > 0.05, "{what}: clipping acts ({:?})", run.norms);
            assert_trains_as(&what, run, &ref_losses, &ref_weights);
            assert_eq!(run.trained_count, adapter_numel as u64);
            for (name, t) in &run.frozen {
                let spec = hf
                    .model()
                    .unwrap()
                    .blocks()
                    .into_iter()
                    .flatten()
                    .find(|s| &s.name == name)
                    .unwrap();
                let source = rt.block_on(hf.read(&spec)).unwrap();
                assert!(t.equal(&source), "{what}: base weight {name} changed");
            }
            // Optimizer state: master and both moments of this rank's half of the adapters.
            let state: i64 = run.optimizer_state.iter().map(|(_, t)| t.numel() as i64).sum();
            let blocks = run.optimizer_state.len() as i64 / 3;
            assert!(
                state >= 3 * adapter_numel / 2 && state <= 3 * (adapter_numel / 2 + blocks),
                "{what}: {state} optimizer elements for {adapter_numel} adapter parameters"
            );
            assert_eq!(run.held.optimizer, 4 * state as u64);
            assert!(run.held.frozen_parameters > 0 && run.held.host_optimizer == 0);
        }
    }
    // Dropout: a recomputed block (stage 3) drops what its forward dropped (stage 1 keeps
    // the graph), and dropout changes the run.
    let with_dropout = LoraConfig { dropout: 0.1, ..lora };
    let kept = run_ranks(&lora_config(
        data.clone(),
        1,
        Some(with_dropout.clone()),
        ZeroConfig::default(),
    ));
    let recomputed = run_ranks(&lora_config(data.clone(), 3, Some(with_dropout), ZeroConfig::default()));
    for (a, b) in kept[0].losses.iter().zip(&recomputed[0].losses) {
        assert!((a - b).abs() < 1e-5, "dropout under recomputation: {a} vs {b}");
    }
    assert!(max_difference(&kept[0].trained, &recomputed[0].trained) < 1e-5);
    assert!((kept[0].losses[3] - ref_losses[3]).abs() > 1e-4, "dropout acts");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_on_a_model_with_tied_embeddings_and_biases_matches_the_reference() {
    // Qwen2: the LM head is the (frozen) embedding, q/k/v carry biases.
    tch::set_num_threads(1);
    let dir = temp_dir("qwen2");
    let data = corpus(&dir);
    let qwen2 = |stage: u8| {
        let mut config = lora_config(
            data.clone(),
            stage,
            Some(adapters(2, &["q_proj", "v_proj", "up_proj"])),
            ZeroConfig::default(),
        );
        config.model.path = fixture("qwen2").to_string_lossy().into_owned();
        config
    };
    let (ref_losses, ref_weights) = reference_run(&qwen2(1), 2, &builtin_model).unwrap();
    assert_eq!(ref_weights.len(), 2 * 3 * 2);
    for stage in [1u8, 3] {
        for run in run_ranks(&qwen2(stage)) {
            for (a, b) in run.losses.iter().zip(&ref_losses) {
                assert!((a - b).abs() < 1e-5, "stage {stage}: {a} vs {b}");
            }
            let diff = max_difference(&run.trained, &ref_weights);
            assert!(diff < 1e-5, "stage {stage}: adapters differ by {diff}");
            assert!(
                run.frozen.iter().all(|(n, _)| n != "lm_head.weight"),
                "the tied head is not stored"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn optimizer_offload_gives_the_same_run_with_the_state_on_the_host() {
    tch::set_num_threads(1);
    let dir = temp_dir("offload");
    let data = corpus(&dir);
    let offload = |params: bool| ZeroConfig {
        offload_optimizer: Offload::Cpu,
        offload_params: if params { Offload::Cpu } else { Offload::None },
    };
    let cases = [
        (2u8, None, offload(false)),
        (3, None, offload(false)),
        (3, None, offload(true)),
        (3, Some(adapters(2, &["q_proj", "v_proj"])), offload(true)),
    ];
    for (stage, lora, zero) in cases {
        let what = format!("stage {stage} lora {} {zero:?}", lora.is_some());
        let plain = run_ranks(&lora_config(data.clone(), stage, lora.clone(), ZeroConfig::default()));
        let offloaded = run_ranks(&lora_config(data.clone(), stage, lora, zero.clone()));
        for (a, b) in plain.iter().zip(&offloaded) {
            for (x, y) in a.losses.iter().zip(&b.losses) {
                assert!((x - y).abs() < 1e-6, "{what}: loss {x} vs {y}");
            }
            let diff = max_difference(&a.trained, &b.trained);
            assert!(diff < 1e-6, "{what}: weights differ by {diff}");
            assert_eq!(b.held.host_optimizer, b.held.optimizer, "{what}");
            assert_eq!(a.held.host_optimizer, 0);
            assert_eq!(b.held.optimizer, a.held.optimizer, "{what}: the same state, elsewhere");
            let params_on_host = zero.offload_params == Offload::Cpu;
            assert_eq!(
                b.held.host_parameters == b.held.parameters,
                params_on_host,
                "{what}: {:?}",
                b.held
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Llama fixture with every projection weight replaced by bitsandbytes' round trip of
/// `kind` (`nf4`: NF4 with double quantization, blocks of 64; `int8`: LLM.int8's row-wise
/// bytes of the weight cast to f16; tests/fixtures/qlora, made by
/// scripts/make-qlora-fixtures.py and -2.py): the float model QLoRA's base stands for.
fn dequantized_llama(dir: &Path, kind: &str) -> PathBuf {
    let folder = dir.join(format!("llama-{kind}-dequantized"));
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(fixture("llama").join("config.json"), folder.join("config.json")).unwrap();
    std::fs::copy(
        fixture("qlora").join(format!("llama-{kind}-dequantized.safetensors")),
        folder.join("model.safetensors"),
    )
    .unwrap();
    folder
}

#[test]
fn qlora_on_an_nf4_base_trains_as_lora_on_bitsandbytes_dequantized_base_at_every_stage() {
    tch::set_num_threads(1);
    let dir = temp_dir("qlora");
    let data = corpus(&dir);
    let plain = adapters(4, &["all-linear"]);
    let quantized = LoraConfig {
        base_quantization: regatta_trainer::BaseQuantization::Nf4,
        double_quant: true,
        quant_block_size: 64,
        ..plain.clone()
    };
    // The reference: plain LoRA on the float weights bitsandbytes' dequantization gives.
    let mut reference_config = lora_config(data.clone(), 1, Some(plain.clone()), ZeroConfig::default());
    reference_config.model.path = dequantized_llama(&dir, "nf4").to_string_lossy().into_owned();
    let (ref_losses, ref_weights) = reference_run(&reference_config, 2, &builtin_model).unwrap();
    assert!(
        ref_losses[3] < ref_losses[0] - 0.05,
        "the adapters learn: {ref_losses:?}"
    );
    // What a float base holds, for the memory comparison.
    let float_run = run_ranks(&lora_config(
        data.clone(),
        1,
        Some(plain.clone()),
        ZeroConfig::default(),
    ));
    let float_run3 = run_ranks(&lora_config(data.clone(), 3, Some(plain), ZeroConfig::default()));
    // The 4-bit rounding matters: the float base trains otherwise, so equality below
    // means the base really is the quantized one.
    assert!(
        (float_run[0].losses[0] - ref_losses[0]).abs() > 1e-4,
        "{:?} vs {ref_losses:?}",
        float_run[0].losses
    );
    // Projection weights of the fixture (2 layers, width 64, 4 heads of 16, 2 KV heads, MLP 160).
    let shapes: [i64; 7] = [64 * 64, 32 * 64, 32 * 64, 64 * 64, 160 * 64, 160 * 64, 64 * 160];
    let quantized_bytes: i64 = 2 * shapes
        .iter()
        .map(|n| n / 2 + n / 64 + ((n / 64 + 255) / 256) * 4 + 4)
        .sum::<i64>();
    let float_bytes: i64 = 2 * shapes.iter().sum::<i64>() * 4;
    for stage in 1..=3u8 {
        let runs = run_ranks(&lora_config(
            data.clone(),
            stage,
            Some(quantized.clone()),
            ZeroConfig::default(),
        ));
        for (rank, run) in runs.iter().enumerate() {
            let what = format!("stage {stage} rank {rank}");
            assert_trains_as(&what, run, &ref_losses, &ref_weights);
            // The projections are held in 4 bits (whole on every rank), not in f32.
            assert!(
                run.frozen.iter().all(|(name, _)| !name.ends_with("proj.weight")),
                "{what}: the engine holds no projection weight"
            );
            if stage == 1 {
                assert_eq!(
                    float_run[rank].held.frozen_parameters as i64 - run.held.frozen_parameters as i64,
                    float_bytes - quantized_bytes,
                    "{what}: frozen bytes"
                );
            }
            if stage == 3 {
                // Each rank holds half of every layer's packed codes, absmax codes and
                // nested absmax (padded to whole f32 words of both ranks) and the offsets
                // whole, against half of the float projections.
                let packed: i64 = shapes.iter().map(|n| n / 2 + n / 64 + 4).sum();
                let per_rank = 2 * ((packed + 7) / 8 * 8 / 2 + 7 * 4);
                assert_eq!(
                    float_run3[rank].held.frozen_parameters as i64 - run.held.frozen_parameters as i64,
                    float_bytes / 2 - per_rank,
                    "{what}: a rank's frozen bytes at ZeRO-3"
                );
            }
        }
    }
    // A folder bitsandbytes saved in 4 bits (transformers' save_pretrained, NF4 with double
    // quantization) reads as the float model its dequantization gives: plain LoRA on it is
    // the reference bit for bit, and QLoRA on it takes the stored codes as they are.
    let bnb_folder = fixture("qlora").join("bnb-llama").to_string_lossy().into_owned();
    let mut on_bnb = lora_config(
        data.clone(),
        1,
        Some(adapters(4, &["all-linear"])),
        ZeroConfig::default(),
    );
    on_bnb.model.path = bnb_folder.clone();
    let (bnb_losses, _) = reference_run(&on_bnb, 2, &builtin_model).unwrap();
    assert_eq!(bnb_losses, ref_losses, "LoRA on the 4-bit folder");
    let mut qlora_on_bnb = lora_config(data.clone(), 2, Some(quantized), ZeroConfig::default());
    qlora_on_bnb.model.path = bnb_folder;
    for run in run_ranks(&qlora_on_bnb) {
        for (step, (a, b)) in run.losses.iter().zip(&ref_losses).enumerate() {
            assert!(
                (a - b).abs() < 1e-5,
                "QLoRA on the 4-bit folder, step {step}: {a} vs {b}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_int8_base_trains_as_lora_on_bitsandbytes_int8_dequantized_base() {
    tch::set_num_threads(1);
    let dir = temp_dir("qlora-int8");
    let data = corpus(&dir);
    let plain = adapters(4, &["all-linear"]);
    let quantized = LoraConfig {
        base_quantization: regatta_trainer::BaseQuantization::Int8,
        ..plain.clone()
    };
    let mut reference_config = lora_config(data.clone(), 1, Some(plain.clone()), ZeroConfig::default());
    reference_config.model.path = dequantized_llama(&dir, "int8").to_string_lossy().into_owned();
    let (ref_losses, ref_weights) = reference_run(&reference_config, 2, &builtin_model).unwrap();
    let float_run = run_ranks(&lora_config(
        data.clone(),
        1,
        Some(plain.clone()),
        ZeroConfig::default(),
    ));
    let float_run3 = run_ranks(&lora_config(data.clone(), 3, Some(plain), ZeroConfig::default()));
    // LLM.int8's rounding is finer than NF4's but still moves the loss: equality below
    // means the base really is the 8-bit one.
    assert!(
        (float_run[0].losses[0] - ref_losses[0]).abs() > 1e-6,
        "{:?} vs {ref_losses:?}",
        float_run[0].losses
    );
    // A byte a weight and an f32 scale a row, against 4 bytes a weight.
    let (shapes, rows): ([i64; 7], [i64; 7]) = (
        [64 * 64, 32 * 64, 32 * 64, 64 * 64, 160 * 64, 160 * 64, 64 * 160],
        [64, 32, 32, 64, 160, 160, 64],
    );
    let int8_bytes: i64 = 2 * shapes.iter().zip(rows).map(|(n, r)| n + 4 * r).sum::<i64>();
    let float_bytes: i64 = 2 * shapes.iter().sum::<i64>() * 4;
    // A folder transformers saved with load_in_8bit reads as bitsandbytes' dequantization
    // (plain LoRA on it is the reference bit for bit), and an int8 run takes its codes.
    let bnb_folder = fixture("qlora").join("bnb-llama-int8").to_string_lossy().into_owned();
    let mut on_bnb = lora_config(
        data.clone(),
        1,
        Some(adapters(4, &["all-linear"])),
        ZeroConfig::default(),
    );
    on_bnb.model.path = bnb_folder.clone();
    let (bnb_losses, _) = reference_run(&on_bnb, 2, &builtin_model).unwrap();
    assert_eq!(bnb_losses, ref_losses, "LoRA on the 8-bit folder");
    let mut int8_on_bnb = lora_config(data.clone(), 3, Some(quantized.clone()), ZeroConfig::default());
    int8_on_bnb.model.path = bnb_folder;
    for (rank, run) in run_ranks(&int8_on_bnb).iter().enumerate() {
        assert_trains_as(
            &format!("int8 on the 8-bit folder, rank {rank}"),
            run,
            &ref_losses,
            &ref_weights,
        );
    }
    for stage in [1u8, 3] {
        let runs = run_ranks(&lora_config(
            data.clone(),
            stage,
            Some(quantized.clone()),
            ZeroConfig::default(),
        ));
        for (rank, run) in runs.iter().enumerate() {
            let what = format!("int8 stage {stage} rank {rank}");
            assert_trains_as(&what, run, &ref_losses, &ref_weights);
            let (float, quantized) = if stage == 1 {
                (&float_run[rank], int8_bytes)
            } else {
                // Half of each layer's codes and row scales a rank (they split evenly here).
                (&float_run3[rank], int8_bytes / 2)
            };
            let float_share = if stage == 1 { float_bytes } else { float_bytes / 2 };
            assert_eq!(
                float.held.frozen_parameters as i64 - run.held.frozen_parameters as i64,
                float_share - quantized,
                "{what}: frozen bytes"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
