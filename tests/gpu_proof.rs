#![allow(clippy::unwrap_used)]
//! The GPU path's CPU-side proofs: `regatta-torch-rank` loads the CUDA half of a CUDA
//! libtorch for sure (the PyPI `torch==2.11.0` wheel, what the GPU hosts carry) and its
//! `doctor` says so cleanly with no GPU; the CPU libtorch is reported as such; and the GPU
//! proof script (`scripts/gpu-proof.sh`) prepares its folder and runs every step in its
//! CPU mode, so it cannot rot between GPU lendings. `scripts/test.sh` installs the torch
//! virtualenv these tests use (`REGATTA_TORCH_VENV`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn rank_binary() -> PathBuf {
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_regatta")).with_file_name("regatta-torch-rank");
    assert!(
        binary.is_file(),
        "regatta-torch-rank is not built next to regatta: run `cargo build --workspace` (scripts/test.sh does)"
    );
    binary
}

/// The virtualenv with torch 2.11 (CUDA wheel), transformers and peft.
fn torch_venv() -> PathBuf {
    let venv = std::env::var("REGATTA_TORCH_VENV")
        .unwrap_or_else(|_| format!("{}/.cache/regatta/torch-venv", std::env::var("HOME").unwrap()));
    let python = Path::new(&venv).join("bin/python");
    assert!(
        python.is_file(),
        "{} not found: run ./scripts/test.sh, which installs torch, transformers and peft into it",
        python.display()
    );
    PathBuf::from(venv)
}

/// The venv's `torch/lib` (libtorch_cpu, libtorch_cuda, ...).
fn venv_torch_lib(venv: &Path) -> PathBuf {
    let out = Command::new(venv.join("bin/python"))
        .args(["-c", "import os, torch; print(os.path.dirname(torch.__file__))"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("lib")
}

fn doctor(env: &[(&str, &str)], extra: &[&str]) -> Output {
    let mut command = Command::new(rank_binary());
    command.arg("doctor").args(extra).envs(env.iter().copied());
    command.output().unwrap()
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --json printed no JSON ({e}):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn doctor_reports_the_cpu_libtorch_and_refuses_to_promise_cuda() {
    let out = doctor(&[], &["--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = json_of(&out);
    assert_eq!(report["libtorch_cuda"]["state"], "absent", "{report:#}");
    assert_eq!(report["cuda_available"], false);
    assert_eq!(report["device_count"], 0);
    assert_eq!(report["libtorch_built_against"], "2.11.0");
    let reason = report["cuda_unusable"].as_str().unwrap();
    assert!(reason.contains("CPU-only"), "{reason}");
    // The CPU's attention kernel choices are listed (libtorch answers for the CPU).
    assert_eq!(report["sdpa"][0]["on"], "Cpu Float");
    assert_eq!(report["driver"]["state"], "missing");
    // Without libtorch_cuda there are no CUDA graphs, and doctor says why.
    assert_eq!(report["cuda_graphs"]["state"], "missing", "{report:#}");
    let reason = report["cuda_graphs"]["reason"].as_str().unwrap();
    assert!(reason.contains("libtorch_cuda is not loaded"), "{reason}");

    let out = doctor(&[], &["--require-cuda"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "--require-cuda must fail where CUDA cannot be used"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--require-cuda") && stderr.contains("CPU-only"),
        "{stderr}"
    );

    let out = doctor(&[], &["--bogus"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn cuda_libtorch_loads_its_cuda_half_and_doctor_reports_no_device_cleanly() {
    let lib = venv_torch_lib(&torch_venv());
    assert!(
        lib.join("libtorch_cuda.so").is_file(),
        "the torch wheel has no libtorch_cuda.so in {}",
        lib.display()
    );
    let path = lib.to_str().unwrap();
    // The link holds at the loader: libtorch_cuda and libc10_cuda initialise in the process.
    let out = doctor(&[("LD_LIBRARY_PATH", path), ("LD_DEBUG", "libs")], &["--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let loader = String::from_utf8_lossy(&out.stderr);
    for library in ["libtorch_cuda.so", "libc10_cuda.so", "libtorch_cpu.so"] {
        let initialised = format!("calling init: {path}/{library}");
        assert!(
            loader.contains(&initialised),
            "{library} was not initialised from {path}"
        );
    }
    let report = json_of(&out);
    assert_eq!(report["libtorch_cuda"]["state"], "loaded", "{report:#}");
    assert_eq!(report["libtorch_dir"], path);
    assert!(
        report["libtorch_wheel_version"].as_str().unwrap().starts_with("2.11.0"),
        "{report:#}"
    );
    assert_eq!(report["cuda_available"], false);
    assert_eq!(report["device_count"], 0);
    assert!(report["devices"].as_array().unwrap().is_empty());
    // No GPU here: the reason is the missing driver, not a CPU-only libtorch.
    let reason = report["cuda_unusable"].as_str().unwrap();
    assert!(!reason.contains("CPU-only"), "{reason}");
    assert!(reason.contains("driver"), "{reason}");

    // The human form says the same in words.
    let out = doctor(&[("LD_LIBRARY_PATH", path)], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("libtorch_cuda: loaded from {path}/libtorch_cuda.so")),
        "{text}"
    );
    assert!(text.contains("verdict: CPU only"), "{text}");
    // Nothing beside the binary or libtorch: generation would decode eagerly, and the
    // report names the library and where it looked.
    let report = json_of(&doctor(&[("LD_LIBRARY_PATH", path)], &["--json"]));
    assert_eq!(report["cuda_graphs"]["state"], "missing", "{report:#}");
    let reason = report["cuda_graphs"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("libregatta_cuda_graphs.so not found") && reason.contains("build-cuda-graphs.sh"),
        "{reason}"
    );
}

#[test]
fn the_cuda_graphs_library_builds_against_the_wheel_and_loads_beside_its_libtorch_cuda() {
    let venv = torch_venv();
    let lib = venv_torch_lib(&venv);
    let dir = std::env::temp_dir().join(format!("regatta-cuda-graphs-{}", std::process::id()));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-cuda-graphs.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .arg(venv.join("bin/python"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "build-cuda-graphs.sh failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let built = dir.join("libregatta_cuda_graphs.so");
    let (path, built_str) = (lib.to_str().unwrap(), built.to_str().unwrap());
    // Every symbol the C API and libtorch's graph calls need resolves in the process
    // (RTLD_NOW): only capturing needs a GPU.
    let report = json_of(&doctor(
        &[("LD_LIBRARY_PATH", path), ("REGATTA_CUDA_GRAPHS_LIB", built_str)],
        &["--json"],
    ));
    assert_eq!(report["cuda_graphs"]["state"], "available", "{report:#}");
    assert_eq!(
        report["cuda_graphs"]["version"],
        format!("loaded from {built_str}"),
        "{report:#}"
    );
    // A file that is not the library is refused with the loader's reason, not a crash.
    let bogus = dir.join("bogus.so");
    std::fs::write(&bogus, b"not a shared library").unwrap();
    let report = json_of(&doctor(
        &[
            ("LD_LIBRARY_PATH", path),
            ("REGATTA_CUDA_GRAPHS_LIB", bogus.to_str().unwrap()),
        ],
        &["--json"],
    ));
    assert_eq!(report["cuda_graphs"]["state"], "missing", "{report:#}");
    assert!(
        report["cuda_graphs"]["reason"].as_str().unwrap().contains("bogus.so"),
        "{report:#}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpu_proof_script_prepares_its_folder_and_runs_every_step_on_cpu() {
    let venv = torch_venv();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("regatta-gpu-proof-{}", std::process::id()));
    let script = repo.join("scripts/gpu-proof.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("prepare")
        .env("REGATTA_PROOF_DIR", &dir)
        // The binaries under test, not a second build; being debug builds, they are larger
        // than the release ones the size limit is for.
        .env("REGATTA_PROOF_BIN_DIR", rank_binary().parent().unwrap())
        .env("REGATTA_PROOF_MAX_MIB", "2000")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "prepare failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for needed in [
        "bin/regatta",
        "bin/regatta-torch-rank",
        // Built against the torch venv's CUDA wheel (it compiles and links here; only a GPU
        // host can capture a graph).
        "bin/libregatta_cuda_graphs.so",
        "gpu-proof.sh",
        "peer.py",
        "fixtures/qwen2/config.json",
    ] {
        assert!(dir.join(needed).exists(), "prepare left no {needed}");
    }
    // Run from the folder, as on the GPU host.
    let run_cpu = |budget_secs: &str| {
        Command::new("bash")
            .arg(dir.join("gpu-proof.sh"))
            .args(["run", "--cpu"])
            .env("REGATTA_PROOF_PYTHON", venv.join("bin/python"))
            .env("REGATTA_PROOF_BUDGET_SECS", budget_secs)
            .env_remove("REGATTA_PROOF_DIR")
            .output()
            .unwrap()
    };
    let out = run_cpu("540");
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap_or_default();
    assert!(
        out.status.success(),
        "run --cpu failed:\n{}\n{}\n{report}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for step in [
        "doctor",
        "peak",
        "logits-llama",
        "logits-mistral",
        "logits-qwen2",
        "train-zero2",
        "train-zero3",
        "peer-train",
        "make-model",
        "generate-b1",
        "peer-generate-b8",
        "kv-budget-b1",
        "engine-eager-b1",
        "engine-b1",
        "engine-sampled-eager-b8",
        "engine-sampled-b8",
        "peer-ids-b8",
        "train-lora",
        "train-qlora-nf4",
        "train-qlora-nf4-dq",
        "train-qlora-int8",
        "peer-lora",
    ] {
        assert!(
            report.contains(&format!("### {step}: ok")),
            "step {step} is not ok in:\n{report}"
        );
    }
    // The figures hold numbers on both sides, not dashes.
    let figure = |name: &str| {
        report
            .lines()
            .find(|l| l.starts_with(&format!("| {name}")))
            .unwrap_or_else(|| panic!("no '{name}' row in:\n{report}"))
            .to_string()
    };
    for name in [
        "train ZeRO-2, tokens/s",
        "train ZeRO-3, tokens/s",
        "generate, batch limit 8",
        "LoRA r8",
    ] {
        let row = figure(name);
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert!(
            cells[2].parse::<f64>().is_ok() && cells[3].parse::<f64>().is_ok(),
            "{row}"
        );
    }
    // The engine alone beside transformers.generate on the same ids: in f32 on the same CPU
    // both sides choose the same greedy tokens, so every row is identical.
    let row = figure("engine alone (generate-ids), batch limit 8");
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    assert!(
        cells[2].parse::<f64>().is_ok() && cells[3].parse::<f64>().is_ok(),
        "{row}"
    );
    // (Allowing one row whose top two logits lie within f32 noise of each other: the
    // model is random-initialised, so near ties happen; a wrong engine agrees on nothing.)
    // The last such row is batch limit 8's (16 rows of 8 tokens).
    let identical = report
        .lines()
        .rev()
        .find(|l| l.starts_with("| ... identical rows"))
        .unwrap_or_else(|| panic!("no identical-rows figure in:\n{report}"));
    let counts: Vec<u32> = identical
        .split('|')
        .nth(2)
        .unwrap_or_default()
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    assert!(
        counts.len() == 4 && counts[0] >= 15 && counts[1] == 16 && counts[2] >= 120 && counts[3] == 128,
        "{identical}"
    );
    // f32 on the same CPU: Regatta's logits equal transformers' to 1e-3 of their range.
    let row = figure("qwen2 fixture logits");
    assert!(row.contains("argmax agreement 1.000"), "{row}");
    // A spent budget skips steps rather than cutting them, and still writes the report.
    let out = run_cpu("1");
    assert!(!out.status.success(), "a run with skipped steps must not pass");
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        report.contains("### doctor: SKIPPED (the run budget of 1s is spent)"),
        "{report}"
    );
    assert!(report.contains("## Figures"), "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}
