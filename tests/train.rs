#![allow(clippy::unwrap_used)]
//! The trainer group across real worker processes: ZeRO stages 1-3 over 2 and 3 ranks
//! against the single-process AdamW reference, recovery from a SIGKILLed worker through
//! the last checkpoint, the trainer's metrics on the nodes' /metrics, and clear errors on
//! bad input. Ranks run in `regatta-torch-rank` executors next to the `regatta` binary
//! (built by `cargo build --workspace`, which needs libtorch: scripts/setup-libtorch.sh).

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use regatta_trainer::{TrainConfig, TrainEvent, TrainerGroup};
use support::{http_get, run_json, start_moto, temp_dir, TestCluster};

fn bin_dir() -> PathBuf {
    let regatta = PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
    let dir = regatta.parent().unwrap().to_path_buf();
    assert!(
        dir.join("regatta-torch-rank").is_file(),
        "regatta-torch-rank is not built next to {}: run `cargo build --workspace` with LIBTORCH set \
         (scripts/test.sh does both)",
        regatta.display()
    );
    dir
}

fn corpus() -> String {
    format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"))
}

/// A model whose parameter count divides by neither 2 nor 3.
const SMALL: &str = r#"
steps = 5
micro_batch_size = 1
gradient_accumulation = 2
[model]
layers = 2
width = 25
heads = 5
context = 17
"#;

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("train.toml");
    std::fs::write(&path, format!("{text}\n[data]\npath = \"{}\"\n", corpus())).unwrap();
    path
}

/// The Qwen2 fixture made by transformers (tied embeddings, q/k/v biases) with its
/// 512-token tokenizer; clipping acts on every step.
fn qwen2_config(dir: &Path) -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let path = dir.join("qwen2.toml");
    let text = format!(
        "steps = 3\nmicro_batch_size = 1\ngradient_accumulation = 2\n[model]\npath = \"{root}/torch/tests/fixtures/qwen2\"\ncontext = 16\n\
         [optimizer]\nmax_grad_norm = 0.5\n[data]\npath = \"{}\"\ntokenizer = \"{root}/data/tokenizer.json\"\n",
        corpus()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The Mistral fixture (one KV head) fine-tuned on instruction rows in JSONL: prompt and
/// response pairs and chats rendered with a ChatML template, packed into rows of 16 with
/// attention and loss kept inside each document and off the prompts.
fn mistral_sft_config(dir: &Path) -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let tokenizer = dir.join("tokenizer");
    std::fs::create_dir_all(&tokenizer).unwrap();
    std::fs::copy(format!("{root}/data/tokenizer.json"), tokenizer.join("tokenizer.json")).unwrap();
    let template = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    let settings = serde_json::json!({"eos_token": "</s>", "chat_template": template});
    std::fs::write(tokenizer.join("tokenizer_config.json"), settings.to_string()).unwrap();
    let rows: String = (0..60)
        .map(|i| {
            let row = if i % 2 == 0 {
                serde_json::json!({"prompt": format!("Question {i}: what is {i} plus one?"), "response": format!(" It is {}.", i + 1)})
            } else {
                serde_json::json!({"messages": [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": format!("Say {i} twice.")},
                    {"role": "assistant", "content": format!("{i} {i}")}]})
            };
            format!("{row}\n")
        })
        .collect();
    let data = dir.join("sft.jsonl");
    std::fs::write(&data, rows).unwrap();
    let path = dir.join("mistral-sft.toml");
    let text = format!(
        "steps = 3\nmicro_batch_size = 2\ngradient_accumulation = 2\n[model]\npath = \"{root}/torch/tests/fixtures/mistral\"\ncontext = 16\n\
         [data]\npath = \"{}\"\ntokenizer = \"{}\"\n",
        data.display(),
        tokenizer.join("tokenizer.json").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// name -> (shape, values) of a safetensors file.
fn read_weights(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// The single-process AdamW reference over `partitions` partitions: its loss per step; its
/// final weights go to `weights`.
fn reference_run(bins: &Path, config: &Path, partitions: usize, weights: &Path) -> Vec<f64> {
    let output = Command::new(bins.join("regatta-torch-rank"))
        .args([
            "reference",
            config.to_str().unwrap(),
            &partitions.to_string(),
            weights.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect()
}

#[test]
fn zero_stages_over_worker_processes_match_single_process_adamw() {
    let bins = bin_dir();
    let dir = temp_dir("train-zero");
    let gpt = write_config(&dir, SMALL);
    let qwen2 = qwen2_config(&dir);
    let sft = mistral_sft_config(&dir);
    for (model, config, steps) in [("gpt", &gpt, 5u64), ("qwen2", &qwen2, 3), ("mistral-sft", &sft, 3)] {
        let config_arg = config.to_str().unwrap();
        for world in [2usize, 3] {
            let reference = dir.join(format!("reference-{model}-{world}.safetensors"));
            let ref_losses = reference_run(&bins, config, world, &reference);
            assert_eq!(ref_losses.len() as u64, steps);
            let ref_weights = read_weights(&reference);
            let params: usize = ref_weights.values().map(|(_, v)| v.len()).sum();
            assert!(
                model != "gpt" || (!params.is_multiple_of(2) && !params.is_multiple_of(3)),
                "{params} parameters must not divide by the world"
            );
            let full = (params * 4) as f64;
            for stage in 1..=3u8 {
                let ckpt = dir.join(format!("ckpt-{model}-{world}-{stage}"));
                let summary = run_json(&[
                    "train",
                    "--config",
                    config_arg,
                    "--world-size",
                    &world.to_string(),
                    "--zero-stage",
                    &stage.to_string(),
                    "--checkpoint-dir",
                    ckpt.to_str().unwrap(),
                    "--json",
                ]);
                let losses: Vec<f64> = serde_json::from_value(summary["losses"].clone()).unwrap();
                assert_eq!(losses.len(), ref_losses.len());
                for (step, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "world {world} stage {stage} step {}: {a} vs {b}",
                        step + 1
                    );
                }
                let weights = read_weights(&ckpt.join(format!("step-{steps:08}/model.safetensors")));
                assert_eq!(weights.len(), ref_weights.len());
                let mut worst = 0f32;
                for (name, (shape, values)) in &weights {
                    let (ref_shape, ref_values) = &ref_weights[name];
                    assert_eq!(shape, ref_shape, "{name}");
                    for (a, b) in values.iter().zip(ref_values) {
                        worst = worst.max((a - b).abs());
                    }
                }
                assert!(
                    worst < 1e-5,
                    "world {world} stage {stage}: parameters differ by up to {worst}"
                );
                // What rank 0 actually held, against the full amounts.
                let last = &summary["last"];
                let share = |key: &str| last[key].as_f64().unwrap() * world as f64 / full;
                // Master weights and two moments: 3x the parameters, split (plus padding).
                assert!((share("optimizer_bytes") / 3.0 - 1.0).abs() < 0.01, "{last}");
                let expect_grads = if stage == 1 { world as f64 } else { 1.0 };
                let expect_params = if stage == 3 { 1.0 } else { world as f64 };
                assert!(
                    (share("grad_bytes") / expect_grads - 1.0).abs() < 0.01,
                    "stage {stage}: {last}"
                );
                assert!(
                    (share("param_bytes") / expect_params - 1.0).abs() < 0.01,
                    "stage {stage}: {last}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_inline_config_trains_a_random_llama_over_worker_processes_and_saves_hugging_face_layout() {
    let dir = temp_dir("train-inline");
    let ckpt = dir.join("ckpt");
    let text = format!(
        "steps = 4\nworld_size = 2\nzero_stage = 3\nmicro_batch_size = 2\n[model]\ncontext = 16\n\
         [model.config]\narchitectures = [\"LlamaForCausalLM\"]\nhidden_size = 32\nintermediate_size = 64\n\
         num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\nvocab_size = 300\n\
         tie_word_embeddings = true\n[data]\npath = \"{}\"\n[checkpoint]\ndir = \"{}\"\n",
        corpus(),
        ckpt.display()
    );
    let config = dir.join("inline.toml");
    std::fs::write(&config, text).unwrap();
    let summary = run_json(&["train", "--config", config.to_str().unwrap(), "--json"]);
    let losses: Vec<f64> = serde_json::from_value(summary["losses"].clone()).unwrap();
    assert_eq!(losses.len(), 4, "{summary}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let step = ckpt.join("step-00000004");
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(step.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["architectures"][0], "LlamaForCausalLM");
    let weights = read_weights(&step.join("model.safetensors"));
    assert_eq!(weights["model.layers.1.self_attn.k_proj.weight"].0, vec![16, 32]);
    assert!(!weights.contains_key("lm_head.weight"), "a tied head is not saved");
}

#[test]
fn a_hugging_face_tokenizer_trains_the_same_over_ranks_as_in_one_process() {
    let bins = bin_dir();
    let dir = temp_dir("train-tokenizer");
    let tokenizer = format!("{}/data/tokenizer.json", env!("CARGO_MANIFEST_DIR"));
    let config = dir.join("train.toml");
    std::fs::write(
        &config,
        format!(
            "{SMALL}\n[data]\npath = \"{}\"\ntokenizer = \"{tokenizer}\"\n",
            corpus()
        ),
    )
    .unwrap();
    let ref_losses = reference_run(&bins, &config, 2, &dir.join("reference.safetensors"));
    let ckpt = dir.join("ckpt");
    let summary = run_json(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--world-size",
        "2",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--json",
    ]);
    let losses: Vec<f64> = serde_json::from_value(summary["losses"].clone()).unwrap();
    for (a, b) in losses.iter().zip(&ref_losses) {
        assert!((a - b).abs() < 1e-5, "{losses:?} vs {ref_losses:?}");
    }
    // The model embeds the tokenizer's 512 tokens, not 256 bytes.
    let weights = read_weights(&ckpt.join("step-00000005/model.safetensors"));
    assert_eq!(weights["wte.weight"].0, vec![512, 25]);
    assert!(
        ref_losses[0] > 6.0 && ref_losses[0] < 6.5,
        "about ln(512) at the start: {ref_losses:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// TensorBoard's own reader (`EventAccumulator`, from the test virtualenv that
/// scripts/test.sh fills) on `dir`: every scalar tag with its `(step, value)` points.
fn tensorboard_scalars(dir: &Path) -> BTreeMap<String, Vec<(u64, f64)>> {
    let venv = std::env::var_os("REGATTA_TEST_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/regatta/test-venv")))
        .expect("HOME or REGATTA_TEST_VENV");
    let script = "import json, sys\n\
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
        acc = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n\
        acc.Reload()\n\
        print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}))\n";
    let output = Command::new(venv.join("bin/python"))
        .args(["-c", script, dir.to_str().unwrap()])
        .output()
        .expect("the test virtualenv's python (scripts/test.sh installs tensorboard there)");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The validation set is the training set and one global batch (4 sequences of the byte
/// corpus over 2 ranks), so the validation loss after k steps must equal the loss the
/// plain single-process reference computes at its step k + 1 (same weights, same rows);
/// with a constant learning rate a 4-step reference serves the 3-step run. A second run at
/// a rate high enough that the loss rises after step 2 shows `best` is not just the newest.
#[test]
fn validation_losses_equal_the_reference_and_reach_tensorboard_and_the_best_pointer() {
    let bins = bin_dir();
    let dir = temp_dir("train-eval");
    let corpus_bytes = std::fs::read(corpus()).unwrap();
    let data = dir.join("four-sequences.txt");
    std::fs::write(&data, &corpus_bytes[..4 * 17 + 1]).unwrap();
    let run = |steps: u64, lr: f64| {
        format!(
            "steps = {steps}\nworld_size = 2\nzero_stage = 3\nmicro_batch_size = 2\n\
             [model]\nlayers = 2\nwidth = 25\nheads = 5\ncontext = 17\n\
             [optimizer]\nlr = {lr}\nwarmup_steps = 0\nschedule = \"constant\"\n[data]\npath = \"{}\"\n",
            data.display()
        )
    };
    let reference = dir.join("reference.toml");
    std::fs::write(&reference, run(4, 0.01)).unwrap();
    let ref_losses = reference_run(&bins, &reference, 2, &dir.join("reference.safetensors"));
    let (ckpt, tb) = (dir.join("ckpt"), dir.join("tb"));
    let train = |steps: u64, lr: f64, ckpt: &Path| {
        let config = dir.join("train.toml");
        std::fs::write(
            &config,
            format!(
                "{}[eval]\npath = \"{}\"\ninterval = 1\n[checkpoint]\ndir = \"{}\"\ninterval = 2\nkeep_best = true\n\
                 [logging]\ntensorboard = \"{}\"\n",
                run(steps, lr),
                data.display(),
                ckpt.display(),
                tb.display()
            ),
        )
        .unwrap();
        let summary = run_json(&["train", "--config", config.to_str().unwrap(), "--json"]);
        let evals: Vec<(u64, f64)> = summary["eval_losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
            .collect();
        (summary, evals)
    };
    let (summary, evals) = train(3, 0.01, &ckpt);
    assert_eq!(
        evals.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![0, 1, 2, 3],
        "{summary}"
    );
    for (step, loss) in &evals {
        let expected = ref_losses[*step as usize];
        assert!(
            (loss - expected).abs() < 1e-5,
            "step {step}: {loss} vs the reference's {expected}"
        );
    }
    // Checkpoints at steps 2 and 3 (the last); each validated, and `best` names the lower.
    let at = |step: u64| evals[step as usize].1;
    let best = if at(2) <= at(3) { 2 } else { 3 };
    let pointer = std::fs::read_to_string(ckpt.join("best")).unwrap();
    assert_eq!(pointer.trim(), format!("step-{best:08}"));
    assert!(
        summary["best_checkpoint"].as_str().unwrap().ends_with(&pointer),
        "{summary}"
    );
    for step in [2, 3] {
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ckpt.join(format!("step-{step:08}/manifest.json"))).unwrap())
                .unwrap();
        assert_eq!(manifest["eval_loss"].as_f64(), Some(at(step)));
    }
    // TensorBoard reads back every step's loss and every validation (as float32).
    let scalars = tensorboard_scalars(&tb);
    let losses: Vec<f64> = serde_json::from_value(summary["losses"].clone()).unwrap();
    let trained = &scalars["train/loss"];
    assert_eq!(trained.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2, 3]);
    for ((_, value), loss) in trained.iter().zip(&losses) {
        assert!(
            (value - loss).abs() < 1e-5 * loss.abs().max(1.0),
            "{trained:?} vs {losses:?}"
        );
    }
    let validated = &scalars["eval/loss"];
    assert_eq!(validated.len(), evals.len());
    for ((step, value), (eval_step, loss)) in validated.iter().zip(&evals) {
        assert_eq!(step, eval_step);
        assert!(
            (value - loss).abs() < 1e-5 * loss.abs().max(1.0),
            "{validated:?} vs {evals:?}"
        );
    }
    let lr = &scalars["train/learning_rate"];
    assert!(lr.iter().all(|(_, v)| (v - 0.01).abs() < 1e-7), "{lr:?}");
    for tag in [
        "train/grad_norm",
        "train/tokens_per_sec",
        "train/bytes_per_rank",
        "eval/perplexity",
    ] {
        assert!(
            scalars[tag].iter().all(|(_, v)| v.is_finite() && *v > 0.0),
            "{tag}: {scalars:?}"
        );
    }
    // At a rate of 0.3 the loss rises after step 2: `best` stays on step 2 while `latest`
    // moves to step 4.
    let ckpt = dir.join("ckpt-high-rate");
    let (summary, evals) = train(4, 0.3, &ckpt);
    assert!(
        evals[2].1 < evals[4].1,
        "the run was meant to get worse after step 2: {evals:?}"
    );
    assert_eq!(
        std::fs::read_to_string(ckpt.join("best")).unwrap().trim(),
        "step-00000002"
    );
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap().trim(),
        "step-00000004"
    );
    assert!(
        summary["best_checkpoint"].as_str().unwrap().ends_with("step-00000002"),
        "{summary}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_go_to_s3_and_a_resumed_run_continues_from_the_newest() {
    bin_dir();
    let moto = start_moto("regatta-ckpt").await;
    let dir = temp_dir("train-s3");
    let config = write_config(&dir, SMALL);
    let train = |steps: &str, resume: bool| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_regatta"));
        command
            .args(["train", "--config", config.to_str().unwrap(), "--steps", steps])
            .args([
                "--checkpoint-dir",
                "s3://regatta-ckpt/run",
                "--checkpoint-interval",
                "4",
                "--json",
            ])
            .env("AWS_ENDPOINT_URL", &moto.endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1");
        if resume {
            command.arg("--resume");
        }
        let output = command.output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    };
    let first = train("8", false);
    assert!(
        first.contains("checkpoint at step 8: s3://regatta-ckpt/run/step-00000008"),
        "{first}"
    );
    let second = train("12", true);
    assert!(second.contains("from step 8"), "{second}");
    assert!(
        second.contains("checkpoint at step 12: s3://regatta-ckpt/run/step-00000012"),
        "{second}"
    );
    // The resumed run reports only steps 9-12, and they continue the curve of one run of 12.
    let json = second
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .expect("a JSON summary");
    let summary: serde_json::Value = serde_json::from_str(json).unwrap();
    let resumed: Vec<f64> = serde_json::from_value(summary["losses"].clone()).unwrap();
    assert_eq!(resumed.len(), 4, "{second}");
    let whole = run_json(&["train", "--config", config.to_str().unwrap(), "--steps", "12", "--json"]);
    let whole: Vec<f64> = serde_json::from_value(whole["losses"].clone()).unwrap();
    for (a, b) in resumed.iter().zip(&whole[8..]) {
        assert!((a - b).abs() < 1e-5, "resumed {resumed:?} vs one run {whole:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GGUF model named by an object-store URL: its header is read in growing pieces and each
/// tensor by byte range from S3 (moto), and the run trains exactly as from the local file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gguf_model_by_s3_url_trains_as_the_local_file_does() {
    bin_dir();
    let moto = start_moto("regatta-models").await;
    let local = format!(
        "{}/torch/tests/fixtures/gguf/mistral-q8_0.gguf",
        env!("CARGO_MANIFEST_DIR")
    );
    let put = reqwest::Client::new()
        .put(format!("{}/regatta-models/gguf/mistral-q8_0.gguf", moto.endpoint))
        .body(std::fs::read(&local).unwrap())
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success(), "{}", put.status());
    let dir = temp_dir("train-gguf-s3");
    let rows: String = (0..16)
        .map(|i| {
            format!(
                "{}\n",
                serde_json::json!({"prompt": format!("Count to {i}."), "response": format!(" {i}.")})
            )
        })
        .collect();
    std::fs::write(dir.join("rows.jsonl"), rows).unwrap();
    let train = |model: &str| {
        let config = dir.join("gguf.toml");
        std::fs::write(
            &config,
            format!(
                "steps = 2\nworld_size = 2\nmicro_batch_size = 1\n[model]\npath = \"{model}\"\ncontext = 16\n\
                 [data]\npath = \"{}\"\n",
                dir.join("rows.jsonl").display()
            ),
        )
        .unwrap();
        let output = Command::new(env!("CARGO_BIN_EXE_regatta"))
            .args(["train", "--config", config.to_str().unwrap(), "--json"])
            .env("AWS_ENDPOINT_URL", &moto.endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let json = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .expect("a JSON summary");
        let summary: serde_json::Value = serde_json::from_str(json).unwrap();
        serde_json::from_value::<Vec<f64>>(summary["losses"].clone()).unwrap()
    };
    let from_s3 = tokio::task::block_in_place(|| train("s3://regatta-models/gguf/mistral-q8_0.gguf"));
    let from_disk = tokio::task::block_in_place(|| train(&local));
    assert_eq!(from_s3.len(), 2);
    assert_eq!(from_s3, from_disk, "the same weights, tokenizer and rows");
    assert!(from_s3.iter().all(|l| l.is_finite() && *l > 0.0), "{from_s3:?}");
}

fn recovery_config(checkpoints: &Path) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.data.path = corpus();
    config.world_size = 2;
    config.zero_stage = regatta_trainer::ZeroStage::Two;
    config.steps = 150;
    config.micro_batch_size = 2;
    config.checkpoint.dir = checkpoints.to_string_lossy().into_owned();
    config.checkpoint.interval = 10;
    config.max_failures = 2;
    config.stall_timeout_secs = 60;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_rank_resumes_from_the_checkpoint_with_the_same_loss_curve() {
    bin_dir();
    let dir = temp_dir("train-recovery");
    let mut cluster = TestCluster::start(&[("w1", "CPU=1"), ("w2", "CPU=1"), ("w3", "CPU=1")]).await;
    let handle = cluster.client.cluster().clone();

    let baseline = TrainerGroup::new(handle.clone(), recovery_config(&dir.join("baseline")))
        .unwrap()
        .run(|_| {})
        .await
        .expect("uninterrupted run");
    assert_eq!(baseline.losses.len(), 150);
    assert_eq!(baseline.failures, 0);

    // The trainer's metrics are on the nodes' /metrics, found through the head's discovery.
    let (code, body) = http_get(&cluster.local.metrics_address, "/api/prometheus/sd");
    assert_eq!(code, 200);
    let targets: serde_json::Value = serde_json::from_str(&body).unwrap();
    let mut exported = String::new();
    for group in targets.as_array().unwrap() {
        for target in group["targets"].as_array().unwrap() {
            exported.push_str(&http_get(&format!("http://{}", target.as_str().unwrap()), "/metrics").1);
        }
    }
    for metric in [
        "regatta_train_loss{rank=\"0\"}",
        "regatta_train_step{rank=\"1\"} 150",
        "regatta_train_tokens_per_second{rank=\"0\"}",
        "regatta_train_collective_seconds{rank=\"1\"}",
        "regatta_train_state_bytes{rank=\"0\",state=\"optimizer\"}",
        "regatta_train_host_state_bytes{rank=\"0\",state=\"optimizer\"} 0",
        "regatta_train_checkpoints_total{rank=\"0\"} 15",
    ] {
        assert!(exported.contains(metric), "{metric} missing from:\n{exported}");
    }

    let mut events = Vec::new();
    let mut killed = None;
    let local = &mut cluster.local;
    let mut rank1_node = None;
    let summary = TrainerGroup::new(handle, recovery_config(&dir.join("killed")))
        .unwrap()
        .run(|event| {
            match event {
                TrainEvent::Started { nodes, attempt: 0, .. } => rank1_node = Some(nodes[1].clone()),
                TrainEvent::Step(step) if step.step >= 25 && killed.is_none() => {
                    let node = rank1_node.clone().expect("started before stepping");
                    let index: usize = node.trim_start_matches('w').parse::<usize>().unwrap() - 1;
                    local.kill_worker(index).unwrap();
                    killed = Some(step.step);
                }
                _ => {}
            }
            events.push(event.clone());
        })
        .await
        .expect("the run survives one lost rank");
    let killed = killed.expect("the worker was killed mid-run");
    assert!(killed < 150, "killed at step {killed}, before the end");
    assert_eq!(summary.failures, 1, "{events:?}");
    let resumed_from = events
        .iter()
        .find_map(|e| match e {
            TrainEvent::Started {
                attempt: 1, start_step, ..
            } => Some(*start_step),
            _ => None,
        })
        .expect("a second attempt");
    assert!(
        resumed_from >= 20 && resumed_from % 10 == 0,
        "resumed from step {resumed_from}"
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, TrainEvent::Restarting { rank: 1, .. })),
        "{events:?}"
    );
    // A hole here has been seen about once in five full suites beside a CPU hog (149 of
    // 150): the message says which step and around what, for whoever chases it.
    let missing: Vec<u64> = (1..=150).filter(|s| !summary.losses.contains_key(s)).collect();
    let checkpoints: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            TrainEvent::Checkpoint { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    assert!(
        missing.is_empty(),
        "no loss for steps {missing:?}; killed at step {killed}, resumed from {resumed_from}, checkpoints seen {checkpoints:?}"
    );
    for (step, loss) in &baseline.losses {
        let resumed = summary.losses[step];
        assert!(
            (loss - resumed).abs() < 1e-5,
            "step {step}: {loss} uninterrupted vs {resumed} resumed"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_on_a_driver_stops_its_ranks_on_the_cluster() {
    bin_dir();
    let cluster = TestCluster::start(&[("w1", "CPU=1"), ("w2", "CPU=1")]).await;
    let mut driver = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args([
            "train",
            "--steps",
            "1000000",
            "--data",
            &corpus(),
            "--address",
            &cluster.local.address,
        ])
        .env("REGATTA_TOKEN", &cluster.local.token)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let alive_ranks = || async {
        let status = cluster.client.status().await.unwrap();
        let ranks = status
            .actors
            .iter()
            .filter(|a| a.view.kind == "train-rank" && format!("{:?}", a.view.state) == "Alive")
            .count();
        (ranks, status.groups.len())
    };
    support::eventually("two ranks training", Duration::from_secs(60), || async {
        (alive_ranks().await.0 == 2).then_some(())
    })
    .await;
    let pid = driver.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let status = driver.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    support::eventually("no rank and no group left", Duration::from_secs(30), || async {
        (alive_ranks().await == (0, 0)).then_some(())
    })
    .await;
}

#[test]
fn bad_configs_and_missing_data_fail_fast_with_the_cause() {
    bin_dir();
    let dir = temp_dir("train-bad");
    let typo = dir.join("typo.toml");
    std::fs::write(&typo, "zero_stag = 2\n").unwrap();
    let missing = dir.join("nothing-here.txt");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--config".into(), typo.to_string_lossy().into()],
            "unknown field `zero_stag`",
        ),
        (vec!["--zero-stage".into(), "4".into()], "ZeRO stage 4 does not exist"),
        (
            vec!["--micro-batch-size".into(), "0".into()],
            "micro_batch_size must be 1..=4096",
        ),
        (
            vec!["--model".into(), missing.to_string_lossy().into()],
            "has no config.json",
        ),
        (
            vec![
                "--data".into(),
                missing.to_string_lossy().into(),
                "--steps".into(),
                "3".into(),
            ],
            "nothing-here.txt",
        ),
        // A rank's failure names the device it ran on.
        (
            vec![
                "--data".into(),
                missing.to_string_lossy().into(),
                "--steps".into(),
                "3".into(),
            ],
            "on cpu: ",
        ),
    ];
    for (args, expected) in cases {
        let output = Command::new(env!("CARGO_BIN_EXE_regatta"))
            .arg("train")
            .args(&args)
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(!output.status.success(), "{args:?} succeeded:\n{all}");
        assert!(all.contains(expected), "{args:?}: expected {expected:?} in:\n{all}");
        assert!(!all.contains("panicked"), "{all}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `regatta ca STEP` against the cluster's job API: whether it succeeded, and its output.
fn ca_step(cluster: &TestCluster, step: &str) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["ca", step, "--address", &cluster.local.job_address])
        .env("REGATTA_TOKEN", &cluster.local.token)
        .env_remove("REGATTA_CA_HASH")
        .output()
        .expect("run regatta ca");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authority_rotates_in_the_middle_of_a_training_run_with_no_failed_step() {
    use regatta::local::WorkerSpec;
    bin_dir();
    // Certificates valid 4 s: the rotation can finish 4 s after it starts.
    let cluster = TestCluster::start_specs(
        vec![WorkerSpec::new("w1", "CPU=1"), WorkerSpec::new("w2", "CPU=1")],
        &["--cert-lifetime-secs", "4"],
    )
    .await;
    let mut config = TrainConfig::default();
    config.data.path = corpus();
    config.world_size = 2;
    config.zero_stage = regatta_trainer::ZeroStage::Two;
    config.steps = 400;
    config.micro_batch_size = 2;
    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = events.clone();
    let group = TrainerGroup::new(cluster.client.cluster().clone(), config).unwrap();
    let run = tokio::spawn(async move { group.run(move |event| seen.lock().unwrap().push(event.clone())).await });
    let last_step = || {
        events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                TrainEvent::Step(step) => Some(step.step),
                _ => None,
            })
            .max()
    };
    support::eventually("the run stepping", Duration::from_secs(60), || async { last_step() }).await;
    let (rotated, said) = tokio::task::block_in_place(|| ca_step(&cluster, "rotate"));
    assert!(rotated, "{said}");
    let rotated_at = last_step().unwrap();
    let finished_at = support::eventually("the rotation finishing", Duration::from_secs(30), || async {
        let (finished, _) = tokio::task::block_in_place(|| ca_step(&cluster, "finish"));
        finished.then(|| last_step().unwrap())
    })
    .await;
    let summary = run.await.unwrap().expect("the run survives the rotation");
    let events = events.lock().unwrap().clone();
    assert!(
        finished_at < 400,
        "the run ended before the rotation finished (rotated at step {rotated_at}): make it longer"
    );
    assert_eq!(summary.failures, 0, "{events:?}");
    assert!(
        !events.iter().any(|e| matches!(e, TrainEvent::Restarting { .. })),
        "{events:?}"
    );
    let missing: Vec<u64> = (1..=400).filter(|s| !summary.losses.contains_key(s)).collect();
    assert!(missing.is_empty(), "no loss for steps {missing:?}");
    // Every worker moved to the new authority during the run.
    for node in ["w1", "w2"] {
        let log = cluster.local.log(node);
        assert!(
            log.contains("renewed this process's certificate under the cluster's rotated authorities"),
            "{log}"
        );
    }
}
