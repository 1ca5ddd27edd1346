//! Train, then score: the main job's real work. A ZeRO trainer group trains the built-in GPT
//! on the corpus shipped in the binary, writing the initial and final weights as
//! checkpoints; a pool of scorer actors scores the shipped evaluation set with each, so the
//! report shows the perplexity before and after training; then the pool generates
//! continuations of the evaluation texts' openings with the trained model (KV cache,
//! continuous batching).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use regatta_runtime::Cluster;
use regatta_scorer::{from_parquet, generated_from_parquet, Progress, ScoreConfig, ScoreRun};
use regatta_trainer::{TrainConfig, TrainEvent, TrainerGroup};

/// The training text shipped with Regatta (Python's standard-library docstrings, PSF
/// licence; see scripts/make-corpus.py).
pub const CORPUS: &str = include_str!("../data/corpus.txt");
/// The evaluation set shipped with Regatta: JSONL rows of held-out text.
pub const EVAL_SET: &str = include_str!("../data/eval.jsonl");

/// What the pipeline runs.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// Where the data, checkpoints and scores go (a new or empty folder, or one an earlier run made:
    /// emptied first; any other folder is refused).
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
    /// Continuations generated with the trained weights.
    pub generated: Generated,
}

/// What the generation stage did.
#[derive(Clone, Debug)]
pub struct Generated {
    /// Prompts continued.
    pub rows: u64,
    /// Tokens generated, and per second over the run.
    pub output_tokens: u64,
    /// Output tokens per second.
    pub tokens_per_sec: f64,
    /// One prompt and its continuation.
    pub example: (String, String),
    /// Where the Parquet files are.
    pub output: PathBuf,
}

/// Bytes of each evaluation text the generation stage takes as its prompt.
const PROMPT_CHARS: usize = 24;
/// Tokens (bytes) generated per prompt.
const NEW_TOKENS: usize = 32;

/// Writes the shipped data, trains, scores before and after; `say` gets progress lines.
pub async fn train_then_score(
    cluster: &Cluster,
    options: &PipelineOptions,
    mut say: impl FnMut(String),
) -> anyhow::Result<PipelineReport> {
    let dir = &options.dir;
    prepare_dir(dir)?;
    let corpus = dir.join("corpus.txt");
    let eval = dir.join("eval.jsonl");
    std::fs::write(&corpus, CORPUS).with_context(|| format!("cannot write {}", corpus.display()))?;
    std::fs::write(&eval, EVAL_SET).with_context(|| format!("cannot write {}", eval.display()))?;
    let checkpoints = dir.join("checkpoints");

    let mut config = TrainConfig::default();
    config.data.path = corpus.to_string_lossy().into_owned();
    config.world_size = options.world_size;
    config.zero_stage = regatta_trainer::ZeroStage::Two;
    config.steps = options.steps;
    config.micro_batch_size = 8;
    config.checkpoint.dir = checkpoints.to_string_lossy().into_owned();
    config.checkpoint.interval = options.steps.max(1);
    config.checkpoint.initial = true;
    let log_every = (options.steps / 10).max(1);
    let trained = train(cluster, &config, log_every, &mut say).await?;

    let before = checkpoints.join("step-00000000");
    let (rows, malformed, ppl_before) = score(cluster, options, &eval, &before, &dir.join("scores-before"), &mut say)
        .await
        .context("scoring with the initial weights")?;
    let scores = dir.join("scores-after");
    let (_, _, ppl_after) = score(cluster, options, &eval, &checkpoints, &scores, &mut say)
        .await
        .context("scoring with the trained weights")?;
    let generated = generate(cluster, options, &eval, &checkpoints, &dir.join("generated"))
        .await
        .context("generating with the trained weights")?;
    Ok(PipelineReport {
        loss: trained.loss,
        tokens_per_sec: trained.tokens_per_sec,
        params: trained.params,
        rows,
        malformed,
        perplexity: (ppl_before, ppl_after),
        checkpoints,
        scores,
        generated,
    })
}

/// Continues the opening of every evaluation text with the trained model.
async fn generate(
    cluster: &Cluster,
    options: &PipelineOptions,
    eval: &Path,
    model: &Path,
    output: &Path,
) -> anyhow::Result<Generated> {
    let mut prompts = String::new();
    for line in EVAL_SET.lines() {
        let Ok(row) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(id), Some(text)) = (row.get("id"), row.get("text").and_then(|t| t.as_str())) else {
            continue;
        };
        let prompt: String = text.chars().take(PROMPT_CHARS).collect();
        prompts.push_str(&serde_json::json!({"id": id, "prompt": prompt}).to_string());
        prompts.push('\n');
    }
    let input = eval.with_file_name("prompts.jsonl");
    std::fs::write(&input, prompts).with_context(|| format!("cannot write {}", input.display()))?;
    let config = ScoreConfig {
        input: input.to_string_lossy().into_owned(),
        model: model.to_string_lossy().into_owned(),
        output: output.to_string_lossy().into_owned(),
        actors: options.actors,
        generate: true,
        max_new_tokens: NEW_TOKENS,
        max_batch: 16,
        kv_cache_mb: Some(16),
        ..ScoreConfig::default()
    };
    let done = ScoreRun::new(cluster.clone(), config)
        .map_err(anyhow::Error::msg)?
        .run(|_| {})
        .await
        .map_err(anyhow::Error::msg)?;
    let rows = generated_rows(output, done.rows)?;
    let (id, continuation) = rows.into_iter().next().unwrap_or_default();
    let prompt = std::fs::read_to_string(&input)?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|row| row["id"].to_string().trim_matches('"') == id)
        .and_then(|row| row["prompt"].as_str().map(str::to_string))
        .unwrap_or_default();
    Ok(Generated {
        rows: done.rows,
        output_tokens: done.output_tokens,
        tokens_per_sec: done.output_tokens as f64 / done.seconds.max(1e-9),
        example: (prompt, continuation),
        output: output.to_path_buf(),
    })
}

/// What a training run reported: the first and last loss, the last tokens/s, parameters.
pub(crate) struct Trained {
    /// Loss at the first and the last step.
    pub loss: (f64, f64),
    /// Tokens per second over all ranks at the last step.
    pub tokens_per_sec: f64,
    /// Model parameters.
    pub params: u64,
    /// Validation loss at the first and the last validation (`[eval]`).
    pub validation: Option<(f64, f64)>,
    /// The checkpoint that validated lowest (`keep_best`): step and step directory.
    pub best: Option<(u64, String)>,
    /// The TensorBoard events file (`[logging] tensorboard`).
    pub tensorboard: Option<String>,
}

/// Runs a trainer group for `config`; its step lines (every `log_every` steps) and
/// restarts go to `say`.
pub(crate) async fn train(
    cluster: &Cluster,
    config: &TrainConfig,
    log_every: u64,
    say: &mut impl FnMut(String),
) -> anyhow::Result<Trained> {
    let group = TrainerGroup::new(cluster.clone(), config.clone())?;
    let summary = group
        .run(|event| {
            if let Some(line) = crate::cli::train::describe(event, config, log_every) {
                say(line);
            } else if let TrainEvent::Restarting { .. } = event {
                say(format!("{event:?}"));
            }
        })
        .await?;
    let (Some(first), Some(last)) = (summary.losses.values().next(), summary.last.as_ref()) else {
        bail!("training finished without reporting a step");
    };
    Ok(Trained {
        loss: (*first, last.loss),
        tokens_per_sec: last.tokens_per_sec,
        params: summary.params,
        validation: summary
            .evals
            .values()
            .next()
            .zip(summary.evals.values().last())
            .map(|(a, b)| (*a, *b)),
        best: summary.best.clone(),
        tensorboard: summary.tensorboard.clone(),
    })
}

/// The `(id, generated text)` rows of a generation run's Parquet output, checked to be the
/// `expected` count (and not none).
pub(crate) fn generated_rows(output: &Path, expected: u64) -> anyhow::Result<Vec<(String, String)>> {
    let mut rows = Vec::new();
    for entry in std::fs::read_dir(output).with_context(|| format!("cannot list {}", output.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "parquet") {
            let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
            for row in generated_from_parquet(bytes.into()).map_err(anyhow::Error::msg)? {
                rows.push((row.id, row.generated));
            }
        }
    }
    if rows.len() as u64 != expected || rows.is_empty() {
        bail!(
            "{expected} rows were generated for but {} are in {}",
            rows.len(),
            output.display()
        );
    }
    Ok(rows)
}

/// Marks a folder the pipeline made, so a later run may empty it.
const MARKER: &str = ".regatta-pipeline";

/// Makes `dir` an empty folder of the pipeline's own: a folder from an earlier run (it has
/// the marker) is emptied; any other non-empty folder is refused, never deleted.
pub(crate) fn prepare_dir(dir: &Path) -> anyhow::Result<()> {
    let has_entries = std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(false);
    if has_entries {
        if !dir.join(MARKER).is_file() {
            bail!(
                "{} is not empty and was not made by an earlier run: choose a new or empty folder",
                dir.display()
            );
        }
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot empty {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(
        dir.join(MARKER),
        "made by regatta's train-then-score pipeline; emptied by the next run\n",
    )
    .with_context(|| format!("cannot write in {}", dir.display()))
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
    score_mean(cluster, config, &name, say).await
}

/// Runs `config` (a scoring run) and returns rows, malformed rows and the mean per-row
/// perplexity read back from its Parquet output; `name` labels the progress line.
pub(crate) async fn score_mean(
    cluster: &Cluster,
    config: ScoreConfig,
    name: &str,
    say: &mut impl FnMut(String),
) -> anyhow::Result<(u64, u64, f64)> {
    let output = PathBuf::from(&config.output);
    let run = ScoreRun::new(cluster.clone(), config).map_err(anyhow::Error::msg)?;
    let done: Progress = run
        .run(|p| {
            if p.partitions_done == p.partitions {
                say(format!("scoring with {name}: {}", crate::cli::score::progress_line(p)));
            }
        })
        .await
        .map_err(anyhow::Error::msg)?;
    let mut sum = 0.0;
    let mut count = 0u64;
    for entry in std::fs::read_dir(&output).with_context(|| format!("cannot list {}", output.display()))? {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_pipelines_own_folders_are_emptied() {
        let root = std::env::temp_dir().join(format!("regatta-pipeline-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let mine = root.join("mine");
        prepare_dir(&mine).unwrap();
        std::fs::write(mine.join("scores.txt"), "old").unwrap();
        prepare_dir(&mine).unwrap();
        assert!(!mine.join("scores.txt").exists(), "an earlier run's folder is emptied");
        let theirs = root.join("theirs");
        std::fs::create_dir_all(&theirs).unwrap();
        std::fs::write(theirs.join("thesis.tex"), "precious").unwrap();
        let err = prepare_dir(&theirs).unwrap_err().to_string();
        assert!(err.contains("not made by an earlier run"), "{err}");
        assert!(theirs.join("thesis.tex").exists(), "a user's folder is never deleted");
        prepare_dir(&root.join("empty")).unwrap();
        let _ = std::fs::remove_dir_all(&root);
    }
}
