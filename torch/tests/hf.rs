#![allow(clippy::unwrap_used)]
//! Regatta's Llama-family models against Hugging Face `transformers`, on fixtures that
//! `scripts/make-hf-fixtures.py` made with it (randomly initialised Llama with Llama 3
//! rope scaling and sharded weights, Mistral with one KV head, Qwen2 with q/k/v biases and
//! tied embeddings): logits, loss and every parameter's gradient; checkpoints in Hugging
//! Face layout; packed documents; gradient accumulation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use regatta_torch::checkpoint::{self, Manifest, SaveSpec};
use regatta_torch::collective::Solo;
use regatta_torch::token_loss_sum;
use regatta_torch::{arrange, logits};
use regatta_torch::{tch, Batch, Engine, EngineSettings, HfModel, MicroBatch, Model};
use regatta_trainer::OptimizerConfig;
use regatta_trainer::IGNORE_INDEX;
use regatta_trainer::{TrainConfig, ZeroStage};
use tch::{Device, Kind, Tensor};

const FIXTURES: [&str; 3] = ["llama", "mistral", "qwen2"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn reference(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixture(name).join("reference.safetensors"))
        .unwrap()
        .into_iter()
        .collect()
}

/// The model of a folder with its weights as leaves that require gradients (tied
/// parameters share their source's tensor); returns the stored leaves by name too.
fn load(dir: &Path) -> (Box<dyn Model>, Vec<Vec<Tensor>>, Vec<(String, Tensor)>) {
    let rt = runtime();
    let hf = rt.block_on(HfModel::open(dir.to_str().unwrap())).unwrap();
    let model = hf.model().unwrap();
    hf.check(model.as_ref()).unwrap();
    let stored: Vec<(String, Tensor)> = model
        .blocks()
        .into_iter()
        .flatten()
        .filter(|spec| spec.tied_to.is_none())
        .map(|spec| {
            let t = rt.block_on(hf.read(&spec)).unwrap().set_requires_grad(true);
            (spec.name, t)
        })
        .collect();
    let by_name: HashMap<String, Tensor> = stored.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    let params = arrange(model.as_ref(), &by_name).unwrap();
    (model, params, stored)
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

#[test]
fn logits_loss_and_every_gradient_match_transformers() {
    tch::set_num_threads(1);
    for name in FIXTURES {
        let expected = reference(name);
        let (model, params, stored) = load(&fixture(name));
        let ids = &expected["input_ids"];
        let labels = &expected["labels"];
        let out = logits(model.as_ref(), &params, ids);
        let logit_diff = max_abs(&(&out - &expected["logits"]));
        assert!(logit_diff < 1e-4, "{name}: logits differ by {logit_diff}");
        // transformers shifts: position t predicts label t + 1.
        let time = ids.size()[1];
        let targets = labels.narrow(1, 1, time - 1);
        let count = targets.ne(IGNORE_INDEX).sum(Kind::Float);
        let loss = token_loss_sum(&out.narrow(1, 0, time - 1), &targets) / count;
        let loss_diff = (loss.double_value(&[]) - expected["loss"].double_value(&[0])).abs();
        assert!(loss_diff < 1e-5, "{name}: loss differs by {loss_diff}");
        loss.backward();
        let mut seen = 0;
        for (pname, leaf) in &stored {
            let want = &expected[&format!("grad.{pname}")];
            let got = leaf.grad();
            assert_eq!(got.size(), want.size(), "{name}: {pname}");
            let relative = max_abs(&(&got - want)) / max_abs(want).max(1e-12);
            assert!(
                relative < 1e-4,
                "{name}: gradient of {pname} differs by {relative} (relative)"
            );
            seen += 1;
        }
        let expected_grads = expected.keys().filter(|k| k.starts_with("grad.")).count();
        assert_eq!(seen, expected_grads, "{name}: every parameter's gradient is compared");
    }
}

#[test]
fn a_changed_document_changes_nothing_in_the_next_one_of_a_packed_row() {
    tch::set_num_threads(1);
    let (model, params, _) = load(&fixture("llama"));
    let run = |tokens: &[i64], documents: &[i64]| {
        let tokens = Tensor::from_slice(tokens).view([1, -1]);
        let mut batch = Batch::packed(&Tensor::from_slice(documents).view([1, -1]), true);
        model.prepare(&mut batch);
        let mut hidden = tokens;
        for (block, p) in params.iter().enumerate() {
            hidden = model.forward(block, p, &hidden, &batch);
        }
        hidden.detach()
    };
    let docs = [0i64, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1];
    let a = run(&[5, 6, 7, 8, 9, 40, 41, 42, 43, 44, 45], &docs);
    let b = run(&[100, 200, 300, 301, 302, 40, 41, 42, 43, 44, 45], &docs);
    let first = |t: &Tensor| t.narrow(1, 0, 5);
    let second = |t: &Tensor| t.narrow(1, 5, 6);
    assert!(
        max_abs(&(first(&a) - first(&b))) > 1e-3,
        "the changed document's logits change"
    );
    assert!(
        max_abs(&(second(&a) - second(&b))) < 1e-6,
        "the next document's logits do not change"
    );
    // And the second document reads exactly as if it stood alone (positions restart).
    let alone = run(&[40, 41, 42, 43, 44, 45], &[0; 6]);
    assert!(max_abs(&(second(&a) - alone)) < 1e-5);
}

/// Packed rows attended by segments, without the dense mask (how CUDA runs them, with
/// FlashAttention's variable-length kernel; here one document at a time), give the masked
/// path's logits and gradients, on every fixture (Mistral's sliding window included).
#[test]
fn packed_rows_without_a_dense_mask_equal_the_masked_path() {
    tch::set_num_threads(1);
    for name in FIXTURES {
        let (model, params, stored) = load(&fixture(name));
        let tokens = Tensor::from_slice(&[
            5i64, 6, 7, 8, 9, 40, 41, 42, 43, 44, 45, 46, 3, 4, 11, 12, 13, 14, 15, 16,
        ])
        .view([2, 10]);
        let documents =
            Tensor::from_slice(&[0i64, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3]).view([2, 10]);
        let run = |dense: bool| {
            let mut batch = Batch::packed(&documents, dense);
            assert_eq!(batch.mask.is_some(), dense);
            model.prepare(&mut batch);
            let mut hidden = tokens.shallow_clone();
            for (block, p) in params.iter().enumerate() {
                hidden = model.forward(block, p, &hidden, &batch);
            }
            let loss = hidden.square().mean(Kind::Float);
            let grads = Tensor::run_backward(
                &[loss],
                &stored.iter().map(|(_, t)| t).collect::<Vec<_>>(),
                false,
                false,
            );
            (hidden.detach(), grads)
        };
        let (masked, masked_grads) = run(true);
        let (segmented, segmented_grads) = run(false);
        let diff = max_abs(&(&masked - &segmented));
        assert!(diff < 1e-5, "{name}: logits differ by {diff}");
        for ((pname, _), (a, b)) in stored.iter().zip(masked_grads.iter().zip(&segmented_grads)) {
            let diff = max_abs(&(a - b));
            assert!(diff < 1e-5, "{name}: gradient of {pname} differs by {diff}");
        }
    }
}

fn settings(steps: u64) -> EngineSettings {
    EngineSettings {
        stage: ZeroStage::Two,
        optimizer: OptimizerConfig {
            max_grad_norm: 0.0,
            ..OptimizerConfig::default()
        },
        steps,
        device: Device::Cpu,
        compute: Kind::Float,
        activation_checkpointing: false,
        offload: Default::default(),
        seed: 0,
    }
}

fn engine_from(dir: &Path, settings: EngineSettings) -> Engine {
    let rt = runtime();
    let hf = rt.block_on(HfModel::open(dir.to_str().unwrap())).unwrap();
    let model = hf.model().unwrap();
    let mut init = |spec: &regatta_torch::ParamSpec| rt.block_on(hf.read(spec));
    Engine::new(model, Box::new(Solo), settings, &mut init).unwrap()
}

fn sequences(rows: i64, seed: i64) -> (Tensor, Tensor) {
    let all = (Tensor::arange(rows * 17, (Kind::Int64, Device::Cpu)) * 7 + seed * 13).remainder(509) + 3;
    let all = all.view([rows, 17]);
    (all.narrow(1, 0, 16).copy(), all.narrow(1, 1, 16).copy())
}

#[test]
fn four_micro_batches_of_b_equal_one_batch_of_4b() {
    tch::set_num_threads(1);
    let (tokens, targets) = sequences(8, 1);
    // A prompt: no loss on the first tokens of every row.
    let _ = targets.narrow(1, 0, 3).fill_(IGNORE_INDEX);
    let whole = vec![MicroBatch {
        tokens: tokens.shallow_clone(),
        targets: targets.shallow_clone(),
        documents: None,
    }];
    let parts: Vec<MicroBatch> = (0..4)
        .map(|i| MicroBatch {
            tokens: tokens.narrow(0, 2 * i, 2),
            targets: targets.narrow(0, 2 * i, 2),
            documents: None,
        })
        .collect();
    for name in ["llama", "qwen2"] {
        let mut one = engine_from(&fixture(name), settings(2));
        let mut four = engine_from(&fixture(name), settings(2));
        for _ in 0..2 {
            let a = one.train_step(&whole).unwrap();
            let b = four.train_step(&parts).unwrap();
            assert!((a.loss - b.loss).abs() < 1e-5, "{name}: {} vs {}", a.loss, b.loss);
            assert_eq!(a.target_tokens, 8 * 13);
        }
        let (wa, wb) = (one.consolidated().unwrap(), four.consolidated().unwrap());
        for ((n, a), (_, b)) in wa.iter().zip(&wb) {
            assert!(max_abs(&(a - b)) < 1e-5, "{name}: {n}");
        }
    }
}

/// How CUDA trains (bf16 compute over f32 master weights, bf16 gathers at stage 3, the
/// chunked loss on bf16 logits), run on the CPU: packed rows train within bf16's rounding
/// of the f32 run, at stages 2 and 3.
#[test]
fn bf16_compute_with_packed_rows_trains_like_f32() {
    tch::set_num_threads(1);
    let (tokens, targets) = sequences(4, 3);
    let documents = Tensor::from_slice(&[0i64, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1])
        .view([1, 16])
        .repeat([4, 1]);
    let batch = || {
        vec![MicroBatch {
            tokens: tokens.shallow_clone(),
            targets: targets.shallow_clone(),
            documents: Some(documents.shallow_clone()),
        }]
    };
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let run = |compute: Kind| {
            let mut engine = engine_from(
                &fixture("llama"),
                EngineSettings {
                    stage,
                    compute,
                    ..settings(3)
                },
            );
            let losses: Vec<f64> = (0..3).map(|_| engine.train_step(&batch()).unwrap().loss).collect();
            (losses, engine.consolidated().unwrap())
        };
        let (f32_losses, f32_weights) = run(Kind::Float);
        let (bf16_losses, bf16_weights) = run(Kind::BFloat16);
        for (a, b) in f32_losses.iter().zip(&bf16_losses) {
            assert!(
                (a - b).abs() < 0.02 * a.abs(),
                "{stage:?}: loss {b} in bf16 vs {a} in f32"
            );
        }
        assert!(f32_losses != bf16_losses, "{stage:?}: bf16 computed exactly as f32");
        assert!(
            bf16_losses[2] < bf16_losses[0],
            "{stage:?}: bf16 does not train: {bf16_losses:?}"
        );
        for ((name, a), (_, b)) in f32_weights.iter().zip(&bf16_weights) {
            assert_eq!(b.kind(), Kind::Float, "{name}: master weights stay f32");
            let diff = max_abs(&(a - b));
            assert!(diff < 0.02, "{stage:?}: {name} differs by {diff}");
        }
    }
}

#[test]
fn activation_checkpointing_recomputes_blocks_to_the_same_loss_and_weights() {
    tch::set_num_threads(1);
    let (tokens, targets) = sequences(4, 2);
    let batch = || {
        vec![MicroBatch {
            tokens: tokens.shallow_clone(),
            targets: targets.shallow_clone(),
            documents: None,
        }]
    };
    let mut kept = engine_from(&fixture("mistral"), settings(3));
    let mut recomputed = engine_from(
        &fixture("mistral"),
        EngineSettings {
            activation_checkpointing: true,
            ..settings(3)
        },
    );
    for _ in 0..3 {
        let (a, b) = (
            kept.train_step(&batch()).unwrap(),
            recomputed.train_step(&batch()).unwrap(),
        );
        assert!((a.loss - b.loss).abs() < 1e-6, "{} vs {}", a.loss, b.loss);
    }
    let (wa, wb) = (kept.consolidated().unwrap(), recomputed.consolidated().unwrap());
    assert_eq!(wa.len(), wb.len());
    for ((n, a), (_, b)) in wa.iter().zip(&wb) {
        assert!(max_abs(&(a - b)) < 1e-6, "{n}");
    }
}

fn dtype_and_shapes(dir: &Path) -> Vec<(String, String, Vec<i64>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        if !file.starts_with("model") || !file.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (name, info) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let shape = info["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_i64().unwrap())
                .collect();
            out.push((name.clone(), info["dtype"].as_str().unwrap().to_string(), shape));
        }
    }
    out.sort();
    out
}

#[test]
fn a_checkpoint_reloads_with_identical_logits_and_the_fixtures_names_shapes_and_dtypes() {
    tch::set_num_threads(1);
    let rt = runtime();
    for name in FIXTURES {
        let dir = std::env::temp_dir().join(format!("regatta-hf-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut engine = engine_from(&fixture(name), settings(1));
        train_one_step(&mut engine);
        // Small shards: the trained model is written in several files with an index.
        let step_dir = save_step(&rt, &mut engine, &fixture(name), &dir, 100_000, Kind::Float);
        assert!(
            step_dir.join("model.safetensors.index.json").is_file(),
            "{name}: sharded with an index"
        );
        assert!(step_dir.join("tokenizer.json").is_file() && step_dir.join("config.json").is_file());
        assert_eq!(dtype_and_shapes(&step_dir), dtype_and_shapes(&fixture(name)), "{name}");
        // Reloaded by the checkpoint reader: the same logits as the engine's weights.
        let (model, params, _) = load(&step_dir);
        let ids = &reference(name)["input_ids"];
        let reloaded = logits(model.as_ref(), &params, ids);
        let weights: HashMap<String, Tensor> = engine.consolidated().unwrap().into_iter().collect();
        let direct = arrange(engine.model(), &weights).unwrap();
        let fresh = logits(engine.model(), &direct, ids);
        assert_eq!(max_abs(&(reloaded - fresh)), 0.0, "{name}: identical logits");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// One optimizer step on two fixed unpacked rows.
fn train_one_step(engine: &mut Engine) {
    let (tokens, targets) = sequences(2, 3);
    engine
        .train_step(&[MicroBatch {
            tokens,
            targets,
            documents: None,
        }])
        .unwrap();
}

/// Writes `engine`'s checkpoint at step 1 into `dir` (side files from `source`), with the
/// weights in `kind`; returns the step folder.
fn save_step(
    rt: &tokio::runtime::Runtime,
    engine: &mut Engine,
    source: &Path,
    dir: &Path,
    shard_bytes: u64,
    kind: Kind,
) -> PathBuf {
    let place = regatta_object_store::Place::dir(dir.to_str().unwrap()).unwrap();
    let hf = rt.block_on(HfModel::open(source.to_str().unwrap())).unwrap();
    let side = rt.block_on(hf.side_files()).unwrap();
    let config = TrainConfig::default();
    let manifest = Manifest {
        step: 1,
        world: 1,
        zero_stage: ZeroStage::Two,
        model: config.model.clone(),
        vocab: 512,
        tokenizer: String::new(),
        params: engine.parameter_count(),
        positions: vec![2],
        loader_files: Vec::new(),
        files: Vec::new(),
        data: config.data.clone(),
        lora: None,
        micro_batch_size: 2,
        gradient_accumulation: 1,
        eval_loss: None,
    };
    let spec = SaveSpec {
        manifest,
        side_files: &side,
        shard_bytes,
        loader: None,
        weights_kind: kind,
    };
    let url = checkpoint::save(rt, &place, engine, 0, 1, spec).unwrap();
    assert!(url.ends_with("step-00000001"), "{url}");
    dir.join("step-00000001")
}

/// A bf16 model's checkpoint stays bf16: its weights are the f32 master weights rounded
/// to bf16, `config.json` says bfloat16, and it reads back as such.
#[test]
fn a_bf16_models_checkpoint_is_written_in_bf16() {
    tch::set_num_threads(1);
    let rt = runtime();
    let root = std::env::temp_dir().join(format!("regatta-hf-bf16-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // The llama fixture converted to bf16 (one file, no index), as save_pretrained in bf16
    // would hold it.
    let source = root.join("model");
    std::fs::create_dir_all(&source).unwrap();
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("llama").join(file), source.join(file)).unwrap();
    }
    let (_, _, stored) = load(&fixture("llama"));
    let bytes = regatta_torch::encode_safetensors_as(&stored, Kind::BFloat16).unwrap();
    std::fs::write(source.join("model.safetensors"), &bytes).unwrap();
    let hf = rt.block_on(HfModel::open(source.to_str().unwrap())).unwrap();
    assert_eq!(hf.weights_kind(), Kind::BFloat16);
    let f32_hf = rt.block_on(HfModel::open(fixture("llama").to_str().unwrap())).unwrap();
    assert_eq!(f32_hf.weights_kind(), Kind::Float);

    let mut engine = engine_from(&source, settings(1));
    train_one_step(&mut engine);
    let step_dir = save_step(
        &rt,
        &mut engine,
        &source,
        &root.join("ckpt"),
        1 << 30,
        hf.weights_kind(),
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let (dtypes, _): (Vec<String>, Vec<_>) = dtype_and_shapes(&step_dir).into_iter().map(|(_, d, s)| (d, s)).unzip();
    assert!(dtypes.iter().all(|d| d == "BF16"), "{dtypes:?}");
    let written = rt.block_on(HfModel::open(step_dir.to_str().unwrap())).unwrap();
    assert_eq!(written.weights_kind(), Kind::BFloat16);
    let master: HashMap<String, Tensor> = engine.consolidated().unwrap().into_iter().collect();
    let model = written.model().unwrap();
    for spec in model.blocks().into_iter().flatten().filter(|s| s.tied_to.is_none()) {
        let read = rt.block_on(written.read_as(&spec, Kind::BFloat16)).unwrap();
        assert_eq!(read.kind(), Kind::BFloat16);
        let want = master[&spec.name].to_kind(Kind::BFloat16);
        assert!(
            read.equal(&want),
            "{}: not the master weights rounded to bf16",
            spec.name
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn bad_model_folders_name_the_file_and_the_problem() {
    let rt = runtime();
    let dir = std::env::temp_dir().join(format!("regatta-hf-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let open = |d: &Path| {
        rt.block_on(HfModel::open(d.to_str().unwrap()))
            .err()
            .map(|e| e.to_string())
    };
    let error = open(&dir).unwrap();
    assert!(error.contains("has no config.json"), "{error}");
    let config = std::fs::read_to_string(fixture("qwen2").join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let error = open(&dir).unwrap();
    assert!(
        error.contains("model.safetensors") && error.contains("cannot be read"),
        "{error}"
    );
    std::fs::write(dir.join("model.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk").unwrap();
    let error = open(&dir).unwrap();
    assert!(error.contains("not a safetensors file"), "{error}");
    // Weights of another shape than config.json implies.
    std::fs::copy(
        fixture("qwen2").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"intermediate_size\": 160", "\"intermediate_size\": 128"),
    )
    .unwrap();
    let hf = rt.block_on(HfModel::open(dir.to_str().unwrap())).unwrap();
    let error = hf.check(hf.model().unwrap().as_ref()).unwrap_err().to_string();
    assert!(
        error.contains("mlp.gate_proj.weight") && error.contains("[160, 64]") && error.contains("[128, 64]"),
        "{error}"
    );
    std::fs::write(
        dir.join("config.json"),
        config.replace("Qwen2ForCausalLM", "GPTNeoXForCausalLM"),
    )
    .unwrap();
    let hf = rt.block_on(HfModel::open(dir.to_str().unwrap())).unwrap();
    let error = hf.model().err().unwrap().to_string();
    assert!(
        error.contains("GPTNeoXForCausalLM") && error.contains("config.json"),
        "{error}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_scorer_reads_a_model_folder_and_scores_as_transformers_logits_imply() {
    tch::set_num_threads(1);
    use regatta_torch::Scorer;
    use regatta_torch::TextTokenizer;
    let rt = runtime();
    // f32 as transformers computed the fixture; bf16 (how CUDA scores) within its rounding:
    // 8 bits of mantissa on every weight and activation, log-probabilities taken in f32.
    for (name, kind, tolerance) in FIXTURES
        .iter()
        .flat_map(|name| [(*name, Kind::Float, 1e-3), (*name, Kind::BFloat16, 0.02)])
    {
        let hf = rt.block_on(HfModel::open(fixture(name).to_str().unwrap())).unwrap();
        let tokenizer = rt
            .block_on(TextTokenizer::load(
                fixture(name).join("tokenizer.json").to_str().unwrap(),
            ))
            .unwrap();
        let scorer = rt
            .block_on(Scorer::from_folder(&hf, None, 0, tokenizer, (Device::Cpu, kind), None))
            .unwrap();
        assert_eq!(scorer.context(), 128, "{name}: max_position_embeddings");
        let expected = reference(name);
        let ids: Vec<i64> = Vec::<i64>::try_from(expected["input_ids"].get(1)).unwrap();
        let scored = scorer.score(&[(ids.clone(), false)], 0).unwrap();
        let log_probs = expected["logits"].get(1).log_softmax(-1, Kind::Double);
        let want: f64 = (0..ids.len() - 1)
            .map(|t| log_probs.double_value(&[t as i64, ids[t + 1]]))
            .sum();
        let got = scored[0].log_likelihood;
        assert!(
            (got - want).abs() < tolerance,
            "{name} in {kind:?}: log-likelihood {got} vs transformers' {want}"
        );
        if kind == Kind::BFloat16 {
            // Computed in bf16 for real, not silently in f32.
            assert!((got - want).abs() > 1e-5, "{name}: bf16 scored exactly as f32 ({got})");
        }
    }
}

/// MFU's FLOPs: 6 per weight of every matrix a token meets (the LM head included, the
/// embedding lookup not), 4 for a frozen one (a LoRA base), plus attention's.
#[test]
fn training_flops_count_matrices_not_lookups_and_4n_for_a_frozen_base() {
    let (mut model, _, _) = load(&fixture("llama"));
    // Two layers of hidden 64 (4 heads of 16, 2 KV heads), MLP 160, vocab 512, untied.
    let per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 160);
    let matrices = 2 * per_layer + 512 * 64;
    let attention = 12 * 2 * 4 * 16 * 32;
    assert_eq!(model.flops_per_token(32), (6 * matrices + attention) as f64);
    let lora = regatta_trainer::LoraConfig {
        rank: 4,
        target_modules: vec!["q_proj".into(), "v_proj".into()],
        ..Default::default()
    };
    model.set_lora(&lora).unwrap();
    // Every base weight, the LM head included, is frozen in a LoRA run (as PEFT does).
    let adapters = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4);
    assert_eq!(
        model.flops_per_token(32),
        (4 * matrices + 6 * adapters + attention) as f64
    );
}
