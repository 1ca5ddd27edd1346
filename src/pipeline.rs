//! Train, then score: the main job's real work. A ZeRO trainer group trains the built-in GPT
//! on the corpus shipped in the binary, writing the initial and final weights as
//! checkpoints; a pool of scorer actors scores the shipped evaluation set with each, so the
//! report shows the perplexity before and after training.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use regatta_runtime::Cluster;
use regatta_scorer::{from_parquet, Progress, ScoreConfig, ScoreRun};
use regatta_trainer::{TrainConfig, TrainEvent, TrainerGroup};

/// The training text shipped with Regatta (Python's standard-library docstrings, PSF
/// licence; see scripts/make-corpus.py).
pub const CORPUS: &str = include_str!("../data/corpus.txt");
/// The evaluation set shipped with Regatta: JSONL rows of held-out text.
pub const EVAL_SET: &str = include_str!("../data/eval.jsonl");

/// What the pipeline runs.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// Where the data, checkpoints and scores go (emptied first).
    pub dir: PathBuf,
    /// Optimizer steps.
    pub steps: u64,
    /// Ranks (ZeRO-2).
    pub world_size: usize,
    /// Scorer actors.
    pub actors: usize,
}

/// What the pipeline measured.
#[derive(Clone, Debug)]
pub struct PipelineReport {
    /// Training loss at the first and the last step.
    pub loss: (f64, f64),
    /// Tokens per second over all ranks at the last step.
    pub tokens_per_sec: f64,
    /// Model parameters.
    pub params: u64,
    /// Rows scored (per model) and malformed rows.
    pub rows: u64,
    /// Malformed rows in the evaluation set.
    pub malformed: u64,
    /// Mean per-row perplexity with the initial and with the trained weights.
    pub perplexity: (f64, f64),
    /// The checkpoint directory.
    pub checkpoints: PathBuf,
    /// The scores with the trained weights.
    pub scores: PathBuf,
}

/// Writes the shipped data, trains, scores before and after; `say` gets progress lines.
pub async fn train_then_score(
    cluster: &Cluster,
    options: &PipelineOptions,
    mut say: impl FnMut(String),
) -> anyhow::Result<PipelineReport> {
    let dir = &options.dir;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot empty {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let corpus = dir.join("corpus.txt");
    let eval = dir.join("eval.jsonl");
    std::fs::write(&corpus, CORPUS).with_context(|| format!("cannot write {}", corpus.display()))?;
    std::fs::write(&eval, EVAL_SET).with_context(|| format!("cannot write {}", eval.display()))?;
    let checkpoints = dir.join("checkpoints");

    let mut config = TrainConfig::default();
    config.data.path = corpus.to_string_lossy().into_owned();
    config.world_size = options.world_size;
    config.zero_stage = 2;
    config.steps = options.steps;
    config.batch_size = 8 * options.world_size.max(1);
    config.checkpoint.dir = checkpoints.to_string_lossy().into_owned();
    config.checkpoint.interval = options.steps.max(1);
    config.checkpoint.initial = true;
    let log_every = (options.steps / 10).max(1);
    let group = TrainerGroup::new(cluster.clone(), config.clone())?;
    let summary = group
        .run(|event| {
            if let Some(line) = crate::train_cli::describe(event, &config, log_every) {
                say(line);
            } else if let TrainEvent::Restarting { .. } = event {
                say(format!("{event:?}"));
            }
        })
        .await?;
    let (Some(first), Some(last)) = (summary.losses.values().next(), summary.last.as_ref()) else {
        bail!("training finished without reporting a step");
    };

    let before = checkpoints.join("step-00000000");
    let (rows, malformed, ppl_before) = score(cluster, options, &eval, &before, &dir.join("scores-before"), &mut say)
        .await
        .context("scoring with the initial weights")?;
    let scores = dir.join("scores-after");
    let (_, _, ppl_after) = score(cluster, options, &eval, &checkpoints, &scores, &mut say)
        .await
        .context("scoring with the trained weights")?;
    Ok(PipelineReport {
        loss: (*first, last.loss),
        tokens_per_sec: last.tokens_per_sec,
        params: summary.params,
        rows,
        malformed,
        perplexity: (ppl_before, ppl_after),
        checkpoints,
        scores,
    })
}

/// Scores the evaluation set with one checkpoint; returns rows, malformed rows and the
/// mean per-row perplexity read back from the Parquet output.
async fn score(
    cluster: &Cluster,
    options: &PipelineOptions,
    input: &Path,
    model: &Path,
    output: &Path,
    say: &mut impl FnMut(String),
) -> anyhow::Result<(u64, u64, f64)> {
    let config = ScoreConfig {
        input: input.to_string_lossy().into_owned(),
        model: model.to_string_lossy().into_owned(),
        output: output.to_string_lossy().into_owned(),
        actors: options.actors,
        batch_size: 32,
        ..ScoreConfig::default()
    };
    let name = model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let run = ScoreRun::new(cluster.clone(), config).map_err(anyhow::Error::msg)?;
    let done: Progress = run
        .run(|p| {
            if p.partitions_done == p.partitions {
                say(format!("scoring with {name}: {}", crate::score_cli::progress_line(p)));
            }
        })
        .await
        .map_err(anyhow::Error::msg)?;
    let mut sum = 0.0;
    let mut count = 0u64;
    for entry in std::fs::read_dir(output).with_context(|| format!("cannot list {}", output.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "parquet") {
            let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
            for row in from_parquet(bytes.into()).map_err(anyhow::Error::msg)? {
                sum += row.perplexity;
                count += 1;
            }
        }
    }
    if count != done.rows {
        bail!("{} rows were scored but {count} are in {}", done.rows, output.display());
    }
    if count == 0 {
        bail!("no row of the evaluation set could be scored");
    }
    Ok((done.rows, done.errors, sum / count as f64))
}
