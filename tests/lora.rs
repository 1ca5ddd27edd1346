#![allow(clippy::unwrap_used)]
//! LoRA fine-tuning with ZeRO-3 and optimizer offload across real worker processes, as a
//! user runs it: `regatta train` with `[lora]` and `[zero] offload_optimizer = "cpu"`
//! equals the single-process reference (`regatta-torch-rank reference`), checkpoints hold
//! the adapter in PEFT's layout (and merged weights with `merge_on_save`), a resumed run
//! continues the curve of one run, and `regatta score --model BASE --adapter CKPT` scores
//! as the merged model does (written by the run and by `regatta-torch-rank merge`).

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use regatta_scorer::{from_parquet, generated_from_parquet, ScoredRow};
use support::temp_dir;

fn regatta() -> Command {
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
    assert!(
        binary.with_file_name("regatta-torch-rank").is_file(),
        "regatta-torch-rank is not built next to regatta: run `cargo build --workspace` (scripts/test.sh does)"
    );
    Command::new(binary)
}

fn torch_rank() -> Command {
    Command::new(PathBuf::from(env!("CARGO_BIN_EXE_regatta")).with_file_name("regatta-torch-rank"))
}

fn root() -> &'static str {
    env!("CARGO_MANIFEST_DIR")
}

fn run(command: &mut Command) -> String {
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{command:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn losses(stdout: &str) -> Vec<f64> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .expect("a JSON summary");
    let summary: serde_json::Value = serde_json::from_str(line).unwrap();
    serde_json::from_value(summary["losses"].clone()).unwrap()
}

/// `regatta train --config CONFIG --steps STEPS --json --log-every 1`, resuming when
/// `resume`, and with its checkpoints in `dir/other` rather than the config's unless `ckpt`.
fn train_run(config: &Path, dir: &Path, steps: &str, resume: bool, ckpt: bool) -> String {
    let mut command = regatta();
    command.args([
        "train",
        "--config",
        config.to_str().unwrap(),
        "--steps",
        steps,
        "--json",
    ]);
    command.args(["--log-every", "1"]);
    if resume {
        command.arg("--resume");
    }
    if !ckpt {
        command.args(["--checkpoint-dir", dir.join("other").to_str().unwrap()]);
    }
    run(&mut command)
}

/// `regatta score --actors 1 --input ROWS --output OUT EXTRA...`, and the scores it wrote.
fn score_run(rows: &Path, out: &Path, extra: &[&str]) -> BTreeMap<String, ScoredRow> {
    run(regatta()
        .args(["score", "--actors", "1", "--input", rows.to_str().unwrap()])
        .args(["--output", out.to_str().unwrap()])
        .args(extra));
    scores(out)
}

/// Checks every row of `adapter` scores within 1e-3 of each of `same`; returns how far
/// `other` moved from it at most.
fn agree_and_move(
    adapter: &BTreeMap<String, ScoredRow>,
    same: &[(&str, &BTreeMap<String, ScoredRow>)],
    other: &BTreeMap<String, ScoredRow>,
) -> f64 {
    let mut moved = 0.0f64;
    for (id, row) in adapter {
        for (what, scored) in same {
            let diff = (row.log_likelihood - scored[id].log_likelihood).abs();
            assert!(
                diff < 1e-3,
                "{id}: the adapter unmerged {} vs {what} {}",
                row.log_likelihood,
                scored[id].log_likelihood
            );
        }
        moved = moved.max((row.log_likelihood - other[id].log_likelihood).abs());
    }
    moved
}

fn scores(dir: &Path) -> BTreeMap<String, ScoredRow> {
    let mut rows = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".parquet") {
            for row in from_parquet(std::fs::read(entry.path()).unwrap().into()).unwrap() {
                rows.insert(row.id.clone(), row);
            }
        }
    }
    rows
}

#[test]
fn lora_with_zero3_offload_over_worker_processes_matches_the_reference_resumes_and_scores_with_its_adapter() {
    let dir = temp_dir("lora-e2e");
    let base = format!("{}/torch/tests/fixtures/llama", root());
    let checkpoints = dir.join("ckpt");
    let config = dir.join("train.toml");
    std::fs::write(
        &config,
        format!(
            "zero_stage = 3\nworld_size = 2\nsteps = 6\nmicro_batch_size = 1\ngradient_accumulation = 2\n\
             [model]\npath = \"{base}\"\ncontext = 16\n\
             [lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\", \"down_proj\"]\nmerge_on_save = true\n\
             [zero]\noffload_optimizer = \"cpu\"\n\
             [optimizer]\nlr = 1e-2\nwarmup_steps = 1\nschedule = \"constant\"\nmax_grad_norm = 0.05\n\
             [data]\npath = \"{}/data/corpus.txt\"\ntokenizer = \"{}/data/tokenizer.json\"\n\
             [checkpoint]\ndir = \"{}\"\ninterval = 3\n",
            root(),
            root(),
            checkpoints.display()
        ),
    )
    .unwrap();
    let train = |steps: &str, resume: bool, ckpt: bool| train_run(&config, &dir, steps, resume, ckpt);
    let first = train("3", false, true);
    assert!(
        first.contains("with LoRA adapters (r 4, alpha 8) on q_proj, v_proj, down_proj"),
        "{first}"
    );
    assert!(first.contains("(optimizer offloaded to CPU)"), "{first}");
    // The step log shows the optimizer state on the host, none on the device.
    let step_line = first.lines().find(|l| l.starts_with("step 3/")).unwrap();
    assert!(
        step_line.contains(" o 0  host") && !step_line.ends_with(" o 0"),
        "{step_line}"
    );
    let resumed = train("6", true, true);
    assert!(resumed.contains("from step 3"), "{resumed}");
    let whole = losses(&train("6", false, false));
    let resumed = losses(&resumed);
    assert_eq!(resumed.len(), 3);
    for (a, b) in resumed.iter().zip(&whole[3..]) {
        assert!((a - b).abs() < 1e-5, "resumed {resumed:?} vs one run {whole:?}");
    }
    // The single-process reference: libtorch autograd and AdamW over the adapters only.
    let reference = run(torch_rank().args([
        "reference",
        config.to_str().unwrap(),
        "2",
        dir.join("reference.safetensors").to_str().unwrap(),
    ]));
    let reference: Vec<f64> = reference.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(reference.len(), 6);
    for (a, b) in whole.iter().zip(&reference) {
        assert!((a - b).abs() < 1e-5, "{whole:?} vs reference {reference:?}");
    }
    // Only adapters come out of the reference, and B (which starts at zero) has moved.
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let weights = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names = weights.names();
    assert_eq!(
        names.len(),
        2 * 3 * 2,
        "A and B of 3 projections in 2 layers: {names:?}"
    );
    let b = weights.tensor("model.layers.1.mlp.down_proj.lora_B.weight").unwrap();
    assert!(b
        .data()
        .chunks_exact(4)
        .any(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]).abs() > 1e-4));

    // The checkpoint: the adapter in PEFT's layout, merged weights in a folder of their own
    // (transformers would apply an adapter_config.json beside them again), optimizer slices.
    let step = checkpoints.join("step-00000006");
    assert!(!step.join("config.json").exists() && !step.join("model.safetensors").exists());
    for file in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "merged/config.json",
        "merged/model.safetensors",
        "merged/tokenizer.json",
        "optim-rank-0-of-2.safetensors",
        "optim-rank-1-of-2.safetensors",
        "manifest.json",
        "tokenizer.json",
    ] {
        assert!(step.join(file).is_file(), "{file} in {}", step.display());
    }
    let adapter: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        (adapter["r"].as_u64(), adapter["peft_type"].as_str()),
        (Some(4), Some("LORA"))
    );
    assert_eq!(adapter["base_model_name_or_path"], base.as_str());

    // Scores: base + adapter unmerged, the run's merged weights, and merged by the tool.
    let rows = dir.join("rows.jsonl");
    let text: String = (0..40)
        .map(|i| format!("{}\n", serde_json::json!({"id": format!("r{i:02}"), "text": format!("line {i}: the quick brown fox jumps over {} lazy dogs.", i % 5)})))
        .collect();
    std::fs::write(&rows, text).unwrap();
    let merged = dir.join("merged");
    let said = run(torch_rank().args(["merge", &base, checkpoints.to_str().unwrap(), merged.to_str().unwrap()]));
    assert!(
        said.contains("model.safetensors") && said.contains("config.json"),
        "{said}"
    );
    let score = |tag: &str, extra: &[&str]| score_run(&rows, &dir.join(tag), extra);
    let unmerged = score(
        "unmerged",
        &["--model", &base, "--adapter", checkpoints.to_str().unwrap()],
    );
    let by_run = score("by-run", &["--model", step.to_str().unwrap()]);
    let by_tool = score("by-tool", &["--model", merged.to_str().unwrap()]);
    let plain = score("base", &["--model", &base]);
    assert_eq!(unmerged.len(), 40);
    let moved = agree_and_move(
        &unmerged,
        &[("the run's merged weights", &by_run), ("merge", &by_tool)],
        &plain,
    );
    assert!(moved > 1e-3, "the trained adapter changes the scores ({moved})");
    // Greedy generation with the adapter unmerged equals generation with merged weights.
    let generate = |tag: &str, extra: &[&str]| {
        let out = dir.join(tag);
        run(regatta()
            .args(["score", "--generate", "--max-new-tokens", "6", "--actors", "1"])
            .args(["--input", rows.to_str().unwrap(), "--output", out.to_str().unwrap()])
            .args(extra));
        let mut texts = BTreeMap::new();
        for entry in std::fs::read_dir(&out).unwrap().flatten() {
            if entry.file_name().to_string_lossy().ends_with(".parquet") {
                for row in generated_from_parquet(std::fs::read(entry.path()).unwrap().into()).unwrap() {
                    texts.insert(row.id.clone(), row.generated.clone());
                }
            }
        }
        texts
    };
    let with_adapter = generate(
        "gen-adapter",
        &["--model", &base, "--adapter", checkpoints.to_str().unwrap()],
    );
    assert_eq!(with_adapter.len(), 40);
    assert_eq!(
        with_adapter,
        generate("gen-merged", &["--model", merged.to_str().unwrap()])
    );

    // A LoRA checkpoint without merged weights, scored as a model: the error says what to do.
    std::fs::remove_dir_all(step.join("merged")).unwrap();
    let output = regatta()
        .args([
            "score",
            "--input",
            rows.to_str().unwrap(),
            "--output",
            dir.join("bad").to_str().unwrap(),
        ])
        .args(["--actors", "1", "--model", step.to_str().unwrap()])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success() && said.contains("--adapter"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// LoRA on a quantized GGUF base, as a user runs it: `[model] path` names a Q4_1 `.gguf`
/// file and nothing names a tokenizer, so the run takes the tokenizer and the chat template
/// from the file's metadata for chat rows; the checkpoint carries them beside the adapter;
/// and the adapter scored unmerged on the GGUF base equals the merged weights the run wrote.
#[test]
fn lora_trains_on_a_quantized_gguf_base_with_its_own_tokenizer_and_chat_template() {
    let dir = temp_dir("lora-gguf");
    let base = format!("{}/torch/tests/fixtures/gguf/mistral-q4_1.gguf", root());
    let checkpoints = dir.join("ckpt");
    let data = dir.join("chat.jsonl");
    let rows: String = (0..24)
        .map(|i| {
            let q = format!("What is the code word number {}?", i % 3);
            let a = ["Heron.", "Skiff.", "Tiller."][i % 3];
            format!(
                "{}\n",
                serde_json::json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            )
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let config = dir.join("train.toml");
    std::fs::write(
        &config,
        format!(
            "zero_stage = 3\nworld_size = 2\nsteps = 4\nmicro_batch_size = 2\n\
             [model]\npath = \"{base}\"\ncontext = 48\n\
             [lora]\nrank = 4\nalpha = 8\nmerge_on_save = true\n\
             [optimizer]\nlr = 2e-2\nwarmup_steps = 1\nschedule = \"constant\"\n\
             [data]\npath = \"{}\"\n\
             [checkpoint]\ndir = \"{}\"\ninterval = 4\n",
            data.display(),
            checkpoints.display()
        ),
    )
    .unwrap();
    let out = run(regatta().args([
        "train",
        "--config",
        config.to_str().unwrap(),
        "--json",
        "--log-every",
        "1",
    ]));
    assert!(out.contains("ZeRO-3 over 2 ranks"), "{out}");
    let losses = losses(&out);
    assert_eq!(losses.len(), 4);
    assert!(losses[3] < losses[0], "the loss falls: {losses:?}");

    let step = checkpoints.join("step-00000004");
    for file in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "merged/config.json",
        "merged/model.safetensors",
    ] {
        assert!(step.join(file).is_file(), "{file} in {}", step.display());
    }
    let tokenizer_config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step.join("tokenizer_config.json")).unwrap()).unwrap();
    assert!(tokenizer_config["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    let adapter: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(adapter["base_model_name_or_path"], base.as_str());

    let rows = dir.join("rows.jsonl");
    let text: String = (0..12)
        .map(|i| format!("{}\n", serde_json::json!({"id": format!("r{i:02}"), "text": format!("The code word number {} is {}.", i % 3, ["Heron", "Skiff", "Tiller"][i % 3])})))
        .collect();
    std::fs::write(&rows, text).unwrap();
    let score = |tag: &str, extra: &[&str]| score_run(&rows, &dir.join(tag), extra);
    let unmerged = score(
        "unmerged",
        &["--model", &base, "--adapter", checkpoints.to_str().unwrap()],
    );
    let merged = score("merged", &["--model", checkpoints.to_str().unwrap()]);
    let plain = score("base", &["--model", &base]);
    assert_eq!(unmerged.len(), 12);
    let mut moved = 0.0f64;
    for (id, row) in &unmerged {
        let diff = (row.log_likelihood - merged[id].log_likelihood).abs();
        assert!(
            diff < 1e-3,
            "{id}: adapter on the GGUF base {} vs merged {}",
            row.log_likelihood,
            merged[id].log_likelihood
        );
        moved = moved.max((row.log_likelihood - plain[id].log_likelihood).abs());
    }
    assert!(moved > 1e-3, "the trained adapter changes the scores ({moved})");
    let _ = std::fs::remove_dir_all(&dir);
}

/// QLoRA as a user runs it: `[lora] base_quantization = "nf4"` with double quantization
/// and `merge_on_save`, ZeRO-3 over 2 worker processes. A resumed run continues the curve
/// of one run; the run's merged weights are the base's dequantized weights plus B A, so
/// they score as the checkpoint's adapter does on the base held in 4 bits (`regatta score
/// --adapter CKPT`, whose `adapter_base = "auto"` follows the run), and as
/// `regatta-torch-rank merge` writes them; on the float base the adapter scores otherwise.
#[test]
fn qlora_resumes_merges_on_save_and_its_adapter_scores_on_the_4bit_base_as_its_merged_weights() {
    let dir = temp_dir("qlora-e2e");
    let base = format!("{}/torch/tests/fixtures/llama", root());
    let checkpoints = dir.join("ckpt");
    let config = dir.join("train.toml");
    std::fs::write(
        &config,
        format!(
            "zero_stage = 3\nworld_size = 2\nsteps = 4\nmicro_batch_size = 1\ngradient_accumulation = 2\n\
             [model]\npath = \"{base}\"\ncontext = 16\n\
             [lora]\nrank = 4\nalpha = 8\nmerge_on_save = true\nbase_quantization = \"nf4\"\ndouble_quant = true\n\
             [optimizer]\nlr = 2e-2\nwarmup_steps = 1\nschedule = \"constant\"\n\
             [data]\npath = \"{}/data/corpus.txt\"\ntokenizer = \"{}/data/tokenizer.json\"\n\
             [checkpoint]\ndir = \"{}\"\ninterval = 2\n",
            root(),
            root(),
            checkpoints.display()
        ),
    )
    .unwrap();
    let train = |steps: &str, resume: bool, ckpt: bool| train_run(&config, &dir, steps, resume, ckpt);
    let first = train("2", false, true);
    let resumed = train("4", true, true);
    assert!(resumed.contains("from step 2"), "{resumed}");
    let whole = losses(&train("4", false, false));
    let resumed = losses(&resumed);
    assert_eq!((resumed.len(), whole.len()), (2, 4));
    for (a, b) in resumed.iter().zip(&whole[2..]) {
        assert!((a - b).abs() < 1e-5, "resumed {resumed:?} vs one run {whole:?}");
    }
    assert!(losses(&first)[0] > 0.0);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(checkpoints.join("step-00000004/manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["lora"]["base_quantization"], "nf4");
    assert!(checkpoints.join("step-00000004/merged/model.safetensors").is_file());

    let rows = dir.join("rows.jsonl");
    let text: String = (0..12)
        .map(|i| format!("{}\n", serde_json::json!({"id": format!("r{i:02}"), "text": format!("line {i}: the quick brown fox jumps over {} lazy dogs.", i % 5)})))
        .collect();
    std::fs::write(&rows, text).unwrap();
    let by_tool = dir.join("merged");
    run(torch_rank().args(["merge", &base, checkpoints.to_str().unwrap(), by_tool.to_str().unwrap()]));
    let score = |tag: &str, extra: &[&str]| score_run(&rows, &dir.join(tag), extra);
    let adapter = checkpoints.to_str().unwrap();
    let on_4bit = score("adapter", &["--model", &base, "--adapter", adapter]);
    let merged = score("merged", &["--model", adapter]);
    let merged_by_tool = score("by-tool", &["--model", by_tool.to_str().unwrap()]);
    let on_float = score(
        "adapter-float",
        &["--model", &base, "--adapter", adapter, "--adapter-base", "none"],
    );
    assert_eq!(on_4bit.len(), 12);
    let moved = agree_and_move(
        &on_4bit,
        &[("the run's merged weights", &merged), ("merge", &merged_by_tool)],
        &on_float,
    );
    assert!(moved > 1e-2, "the 4-bit base scores as the float one ({moved})");
    let _ = std::fs::remove_dir_all(&dir);
}
