//! The README's main job (`regatta demo`, what `scripts/main-job.sh` runs) does its work
//! (actors, objects, then a LoRA fine-tune of SmolLM2 from its GGUF file that learns the
//! shipped facts; or, with `--model builtin`, train-then-score of the built-in GPT with a
//! clear drop in perplexity) and stops every process it started.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_main_job_fine_tunes_smollm2_and_its_answers_learn_the_taught_facts() {
    let model = regatta::finetune::default_model();
    assert!(
        model.is_file(),
        "{} is missing: run scripts/setup-smollm2.sh (scripts/test.sh does)",
        model.display()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["demo", "--actors", "20", "--calls", "3"])
        .output()
        .expect("run regatta demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for expected in [
        "spawned 20 counter actors",
        "read byte-exact on w2",
        "fine-tuning SmolLM2-135M-Instruct.Q4_1.gguf: LoRA (r 8) with ZeRO-3 over 2 ranks, 16 steps",
        "with LoRA adapters (r 8, alpha 32)",
        "ZeRO-3 over 2 ranks",
        "checkpoint at step 16: ",
        "validation at step 0/16",
        "validation at step 8/16",
        "validation at step 16/16",
        "held-out split: 8 conversations scored",
        "cluster stopped",
    ] {
        assert!(text.contains(expected), "missing '{expected}' in:\n{text}");
    }
    let numbers_after = |marker: &str| -> Vec<f64> {
        let line = text
            .lines()
            .find(|l| l.contains(marker))
            .unwrap_or_else(|| panic!("no '{marker}' line in:\n{text}"));
        line.split(marker)
            .nth(1)
            .map(|rest| {
                rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                    .filter_map(|n| n.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let loss = numbers_after("training loss ");
    assert!(loss.len() >= 2 && loss[1] < 0.6 * loss[0], "the loss falls: {loss:?}");
    // Validation on the held-out chats during training: it falls, a best checkpoint is
    // named, and the TensorBoard events file is where the report says.
    let validation = numbers_after("validation loss on the held-out split ");
    assert!(
        validation.len() >= 2 && validation[1] < 0.8 * validation[0],
        "the validation loss falls: {validation:?}"
    );
    assert!(text.contains("best checkpoint at step "), "{text}");
    let events = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("TensorBoard events (tensorboard --logdir): "))
        .unwrap_or_else(|| panic!("no TensorBoard line in:\n{text}"));
    let events = std::fs::metadata(events).unwrap_or_else(|e| panic!("{events}: {e}"));
    assert!(events.len() > 100, "the events file holds the run's scalars");
    let perplexity = numbers_after("mean perplexity ");
    assert!(
        perplexity.len() >= 2 && perplexity[1] < 0.7 * perplexity[0],
        "the held-out perplexity drops: {perplexity:?}"
    );
    // Each held-out question: the taught answer, the base model's and the tuned one.
    let answers: Vec<(&str, &str, &str)> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("taught: "))
        .zip(text.lines().filter_map(|l| l.trim().strip_prefix("base:")))
        .zip(text.lines().filter_map(|l| l.trim().strip_prefix("tuned:")))
        .map(|((taught, base), tuned)| (taught.trim(), base.trim(), tuned.trim()))
        .collect();
    assert_eq!(answers.len(), 8, "{text}");
    let learned = answers.iter().filter(|(taught, _, tuned)| taught == tuned).count();
    assert!(
        learned >= 2,
        "at least two tuned answers are the taught ones: {answers:#?}"
    );
    assert!(
        answers.iter().all(|(taught, base, _)| taught != base),
        "the base model does not know the facts: {answers:#?}"
    );
    assert!(
        text.contains(&format!("{learned} of 8 tuned answers are the taught answer")),
        "{text}"
    );
}

#[test]
fn the_builtin_main_job_runs_its_workload_and_stops_its_cluster() {
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args([
            "demo", "--model", "builtin", "--actors", "20", "--calls", "3", "--steps", "120",
        ])
        .output()
        .expect("run regatta demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for expected in [
        "spawned 20 counter actors",
        "60 actor calls",
        "every total checked",
        "STRICT_SPREAD",
        "with GPU indices [0]",
        "read byte-exact on w2",
        "Nodes: 2 alive, 0 dead",
        "training: ",
        "ZeRO-2 over 2 ranks",
        "checkpoint at step 0: ",
        "checkpoint at step 120: ",
        "continuations with the KV cache",
        "cluster stopped",
    ] {
        assert!(text.contains(expected), "missing '{expected}' in:\n{text}");
    }
    // "mean perplexity B before training, A after"
    let line = text
        .lines()
        .find(|l| l.contains("mean perplexity"))
        .unwrap_or_else(|| panic!("no perplexity line in:\n{text}"));
    let numbers: Vec<f64> = line
        .split("mean perplexity ")
        .nth(1)
        .map(|rest| {
            rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let (before, after) = match numbers.as_slice() {
        [before, after, ..] => (*before, *after),
        _ => panic!("cannot read the perplexities in {line:?}"),
    };
    assert!(
        after < 0.7 * before && after > 1.0,
        "perplexity did not clearly drop: {line}"
    );
    let rows = regatta::pipeline::EVAL_SET.lines().count();
    assert!(line.contains(&format!(": {rows} rows scored (0 malformed)")), "{line}");
    let generation = text
        .lines()
        .find(|l| l.contains("continuations with the KV cache"))
        .unwrap_or_else(|| panic!("no generation line in:\n{text}"));
    assert!(
        generation.contains(&format!("generation: {rows} continuations")),
        "every evaluation text is continued: {generation}"
    );
    let logs = text
        .lines()
        .find_map(|l| l.split("logs in ").nth(1))
        .map(|l| l.trim_end_matches(')').to_string())
        .expect("the log folder is printed");
    // The head's command line names the demo's log folder (its --state-dir lives there): no
    // process with it may outlive the demo.
    let still_running = std::fs::read_dir("/proc")
        .map(|entries| {
            entries.flatten().any(|e| {
                std::fs::read_to_string(e.path().join("cmdline"))
                    .map(|c| c.contains(&logs))
                    .unwrap_or(false)
            })
        })
        .unwrap_or(false);
    assert!(!still_running, "a process of the demo's cluster is still running");
}

/// Processes whose environment carries `marker` (every process the demo starts inherits it).
fn processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if environ.split(|b| *b == 0).any(|kv| kv == marker.as_bytes()) {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            found.push(String::from_utf8_lossy(&cmdline).replace('\0', " "));
        }
    }
    found
}

#[test]
fn ctrl_c_during_training_stops_every_process_the_main_job_started() {
    let marker = format!("REGATTA_DEMO_MARK=ctrl-c-{}", std::process::id());
    let (key, value) = marker.split_once('=').expect("KEY=VALUE");
    let mut demo = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args([
            "demo", "--model", "builtin", "--actors", "4", "--calls", "1", "--steps", "1000000",
        ])
        .env(key, value)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start regatta demo");
    let stdout = demo.stdout.take().expect("piped stdout");
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    // Wait until the ranks are training (a step line after the start line).
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = String::new();
    loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("no training step within 120 s:\n{seen}"));
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with("step ") {
            break;
        }
    }
    let executors = processes_with(&marker);
    assert!(
        executors.iter().filter(|c| c.contains("regatta-torch-rank")).count() == 2,
        "two rank executors run: {executors:#?}"
    );
    assert!(Command::new("kill")
        .args(["-INT", &demo.id().to_string()])
        .status()
        .expect("kill")
        .success());
    let status = demo.wait().expect("the demo exits");
    assert_eq!(status.code(), Some(130), "{seen}");
    // Every process it started is gone (give exiting children a moment to be reaped).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = processes_with(&marker);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still running after Ctrl-C: {left:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_missing_model_is_said_before_any_process_starts() {
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["demo", "--model", "/nonexistent/model.gguf"])
        .output()
        .expect("run regatta demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("/nonexistent/model.gguf is missing") && text.contains("--model builtin"),
        "{text}"
    );
    assert!(!text.contains("starting a local cluster"), "{text}");
}
