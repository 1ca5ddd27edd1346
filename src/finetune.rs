//! The main job's real work on a real model: LoRA fine-tuning of a pretrained chat model
//! from a GGUF file (SmolLM2-135M-Instruct by default, fetched once by
//! `scripts/setup-smollm2.sh`) with ZeRO-3 over the ranks, on chat rows shipped in the
//! binary that teach facts about Regatta the base model cannot know. A held-out split
//! (other wordings of the same questions) is scored before and after by a pool of scorer
//! actors, and the questions are answered greedily through the model's chat template by
//! the base model and by the base with the trained adapter, so the report shows what the
//! model learned side by side.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use regatta_runtime::Cluster;
use regatta_scorer::{ScoreConfig, ScoreRun};
use regatta_trainer::eval::EvalConfig;
use regatta_trainer::gguf::{GgufError, GgufHeader, GgufModel};
use regatta_trainer::{LoraConfig, TrainConfig};
use regatta_trainer::{Message, TokenizerSettings};

use crate::pipeline::{generated_rows, prepare_dir, score_mean, train};

/// Chat rows the adapter learns from: eight facts, four wordings of each question.
pub const TRAIN_SET: &str = include_str!("../data/finetune.jsonl");
/// The held-out split: a fifth wording of each question, with its answer.
pub const EVAL_SET: &str = include_str!("../data/finetune-eval.jsonl");

/// Where the default model lives once `scripts/setup-smollm2.sh` fetched it.
pub fn default_model() -> PathBuf {
    if let Some(path) = std::env::var_os("REGATTA_SMOLLM2_GGUF") {
        return PathBuf::from(path);
    }
    let models = std::env::var_os("REGATTA_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache/regatta/models")
        });
    models.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// What the fine-tune runs.
#[derive(Clone, Debug)]
pub struct FineTuneOptions {
    /// A new or empty folder (or one an earlier run made, which is emptied).
    pub dir: PathBuf,
    /// The GGUF model.
    pub model: PathBuf,
    /// Optimizer steps.
    pub steps: u64,
    /// Ranks (ZeRO-3).
    pub world_size: usize,
    /// Scorer actors.
    pub actors: usize,
}

/// One held-out question answered before and after.
#[derive(Clone, Debug)]
pub struct Answer {
    /// The row's id.
    pub id: String,
    /// The question.
    pub question: String,
    /// The answer the training rows teach.
    pub taught: String,
    /// The base model's greedy answer.
    pub base: String,
    /// The answer with the trained adapter.
    pub tuned: String,
}

/// What the fine-tune measured.
#[derive(Clone, Debug)]
pub struct FineTuneReport {
    /// Training loss at the first and the last step.
    pub loss: (f64, f64),
    /// Validation loss on the held-out split before training and at the last step.
    pub validation: (f64, f64),
    /// The checkpoint that validated lowest, whose adapter is scored and answers: its step
    /// and folder.
    pub best: (u64, String),
    /// The TensorBoard events file.
    pub tensorboard: String,
    /// Tokens per second over all ranks at the last step.
    pub tokens_per_sec: f64,
    /// Model parameters (adapters included).
    pub params: u64,
    /// Mean perplexity of the held-out conversations, base and tuned.
    pub perplexity: (f64, f64),
    /// Held-out rows scored.
    pub rows: u64,
    /// Every held-out question with both answers.
    pub answers: Vec<Answer>,
    /// The checkpoint folder (adapter in PEFT's layout).
    pub checkpoints: PathBuf,
    /// Scores of the held-out split with the adapter (Parquet).
    pub scores: PathBuf,
    /// The tuned answers (Parquet).
    pub generated: PathBuf,
}

/// Greedy tokens per answer.
const ANSWER_TOKENS: usize = 40;
/// Training sequence length: one rendered conversation fits.
const CONTEXT: usize = 64;

/// Fine-tunes, scores and answers; `say` gets progress lines.
pub async fn fine_tune(
    cluster: &Cluster,
    options: &FineTuneOptions,
    mut say: impl FnMut(String),
) -> anyhow::Result<FineTuneReport> {
    let settings = check_model(&options.model)?;
    let dir = &options.dir;
    prepare_dir(dir)?;
    let held_out = held_out_rows()?;
    let inputs = Inputs::write(dir, &settings, &held_out)?;
    let checkpoints = dir.join("checkpoints");
    let config = train_config(options, &inputs, &checkpoints);
    let trained = train(cluster, &config, config.checkpoint.interval, &mut say).await?;
    let (Some(validation), Some(best), Some(tensorboard)) = (trained.validation, trained.best, trained.tensorboard)
    else {
        bail!("training finished without a validation loss, a best checkpoint or a TensorBoard file");
    };
    let adapter = best.1.clone();
    let scores = dir.join("scores-tuned");
    let (rows, perplexity) = perplexities(cluster, options, &inputs.held_out, &adapter, &scores, &mut say).await?;
    let base = answer(cluster, options, &inputs.questions, "", &dir.join("answers-base"))
        .await
        .context("answering with the base model")?;
    let generated = dir.join("answers-tuned");
    let tuned = answer(cluster, options, &inputs.questions, &adapter, &generated)
        .await
        .context("answering with the adapter")?;
    Ok(FineTuneReport {
        loss: trained.loss,
        validation,
        best,
        tensorboard,
        tokens_per_sec: trained.tokens_per_sec,
        params: trained.params,
        perplexity,
        rows,
        answers: side_by_side(&held_out, &base, &tuned),
        checkpoints,
        scores,
        generated,
    })
}

/// The files a fine-tune reads, written into its folder.
struct Inputs {
    /// The training rows.
    train: PathBuf,
    /// The held-out conversations rendered through the chat template, for scoring.
    held_out: PathBuf,
    /// The held-out split as chat rows, for the validation loss during training.
    validation: PathBuf,
    /// The held-out questions alone, to answer.
    questions: PathBuf,
}

impl Inputs {
    fn write(dir: &Path, settings: &TokenizerSettings, held_out: &[(String, Vec<Message>)]) -> anyhow::Result<Self> {
        let train = dir.join("train.jsonl");
        std::fs::write(&train, TRAIN_SET).with_context(|| format!("cannot write {}", train.display()))?;
        // Scoring reads text: each held-out conversation rendered through the chat template.
        let mut texts = String::new();
        let mut questions = String::new();
        for (id, messages) in held_out {
            let text = settings.chat_text(messages)?;
            texts.push_str(&serde_json::json!({"id": id, "text": text}).to_string());
            texts.push('\n');
            questions.push_str(&serde_json::json!({"id": id, "messages": &messages[..1]}).to_string());
            questions.push('\n');
        }
        let inputs = Self {
            train,
            held_out: dir.join("held-out.jsonl"),
            validation: dir.join("validation.jsonl"),
            questions: dir.join("questions.jsonl"),
        };
        let write = |path: &Path, text: &str| {
            std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
        };
        write(&inputs.held_out, &texts)?;
        write(&inputs.validation, EVAL_SET)?;
        write(&inputs.questions, &questions)?;
        Ok(inputs)
    }
}

/// LoRA (rank 8) with ZeRO-3 on the training rows, validated on the held-out split four
/// times during training (and before it), with a checkpoint at each.
fn train_config(options: &FineTuneOptions, inputs: &Inputs, checkpoints: &Path) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.model.path = options.model.to_string_lossy().into_owned();
    config.model.context = CONTEXT;
    config.data.path = inputs.train.to_string_lossy().into_owned();
    config.world_size = options.world_size;
    config.zero_stage = regatta_trainer::ZeroStage::Three;
    config.steps = options.steps;
    config.micro_batch_size = 2;
    config.optimizer.lr = 1e-3;
    config.optimizer.warmup_steps = 2;
    config.optimizer.schedule = regatta_trainer::Schedule::Constant;
    config.lora = Some(LoraConfig {
        rank: 8,
        ..LoraConfig::default()
    });
    // The checkpoint that validates lowest is what gets scored.
    let quarter = (options.steps / 4).max(1);
    config.eval = Some(EvalConfig {
        path: inputs.validation.to_string_lossy().into_owned(),
        interval: quarter,
        ..EvalConfig::default()
    });
    config.checkpoint.dir = checkpoints.to_string_lossy().into_owned();
    config.checkpoint.interval = quarter;
    config.checkpoint.keep_best = true;
    config.logging.tensorboard = options.dir.join("tensorboard").to_string_lossy().into_owned();
    config
}

/// Scores the held-out conversations with the base model and with `adapter` (the tuned
/// scores go to `scores`): the rows scored and the mean perplexity of each.
async fn perplexities(
    cluster: &Cluster,
    options: &FineTuneOptions,
    held_out: &Path,
    adapter: &str,
    scores: &Path,
    say: &mut impl FnMut(String),
) -> anyhow::Result<(u64, (f64, f64))> {
    let scoring = |output: &Path, adapter: &str| ScoreConfig {
        input: held_out.to_string_lossy().into_owned(),
        model: options.model.to_string_lossy().into_owned(),
        adapter: adapter.to_string(),
        output: output.to_string_lossy().into_owned(),
        actors: options.actors,
        batch_size: 8,
        max_new_tokens: 0,
        ..ScoreConfig::default()
    };
    let (rows, _, before) = score_mean(
        cluster,
        scoring(&options.dir.join("scores-base"), ""),
        "the base model",
        &mut *say,
    )
    .await
    .context("scoring the held-out split with the base model")?;
    let (_, _, after) = score_mean(cluster, scoring(scores, adapter), "the adapter", &mut *say)
        .await
        .context("scoring the held-out split with the adapter")?;
    Ok((rows, (before, after)))
}

/// Each held-out question with the taught answer and the `base` and `tuned` ones (empty
/// where a row got none).
fn side_by_side(
    held_out: &[(String, Vec<Message>)],
    base: &[(String, String)],
    tuned: &[(String, String)],
) -> Vec<Answer> {
    let answer_to = |answers: &[(String, String)], id: &str| {
        answers
            .iter()
            .find(|(i, _)| i == id)
            .map(|(_, t)| t.clone())
            .unwrap_or_default()
    };
    held_out
        .iter()
        .map(|(id, messages)| Answer {
            id: id.clone(),
            question: messages[0].content.clone(),
            taught: messages.get(1).map(|m| m.content.clone()).unwrap_or_default(),
            base: answer_to(base, id),
            tuned: answer_to(tuned, id),
        })
        .collect()
}

/// Checks that `path` is a GGUF model with a chat template (its header only is read) and
/// returns its special tokens and template.
pub fn check_model(path: &Path) -> anyhow::Result<TokenizerSettings> {
    if !path.is_file() {
        bail!(
            "{} is missing: scripts/main-job.sh fetches it (scripts/setup-smollm2.sh), or pass --model FILE.gguf, or --model builtin for the no-download demo",
            path.display()
        );
    }
    chat_settings(path)
}

/// The special tokens and chat template of a GGUF file (its header only is read).
fn chat_settings(path: &Path) -> anyhow::Result<TokenizerSettings> {
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let size = file.metadata()?.len();
    let mut bytes = Vec::new();
    let mut want = (4u64 << 20).min(size);
    let header = loop {
        let have = bytes.len() as u64;
        (&mut file)
            .take(want - have)
            .read_to_end(&mut bytes)
            .with_context(|| format!("cannot read {}", path.display()))?;
        match GgufHeader::parse(&bytes, size) {
            Ok(header) => break header,
            Err(GgufError::Truncated { needed }) if want < size => want = needed.max(want * 2).min(size),
            Err(e) => bail!("{}: {e}", path.display()),
        }
    };
    let model = GgufModel::from_header(&header).with_context(|| path.display().to_string())?;
    if let Err(e) = &model.tokenizer {
        bail!("{}: {e}", path.display());
    }
    let settings = TokenizerSettings::from_json(&model.tokenizer_config);
    if settings.chat_template.is_none() {
        bail!("{} carries no chat template (tokenizer.chat_template)", path.display());
    }
    Ok(settings)
}

/// The held-out rows: id and conversation (question, taught answer).
fn held_out_rows() -> anyhow::Result<Vec<(String, Vec<Message>)>> {
    let mut rows = Vec::new();
    for (i, line) in EVAL_SET.lines().enumerate() {
        let row: serde_json::Value = serde_json::from_str(line).with_context(|| format!("held-out row {i}"))?;
        let id = row["id"].as_str().unwrap_or_default().to_string();
        let messages: Vec<Message> = row["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| Message {
                role: m["role"].as_str().unwrap_or_default().to_string(),
                content: m["content"].as_str().unwrap_or_default().to_string(),
            })
            .collect();
        if id.is_empty() || messages.len() != 2 {
            bail!("held-out row {i} needs an id, a question and an answer");
        }
        rows.push((id, messages));
    }
    Ok(rows)
}

/// Greedy answers to the held-out questions, with `adapter` when it is not empty.
async fn answer(
    cluster: &Cluster,
    options: &FineTuneOptions,
    questions: &Path,
    adapter: &str,
    output: &Path,
) -> anyhow::Result<Vec<(String, String)>> {
    let config = ScoreConfig {
        input: questions.to_string_lossy().into_owned(),
        model: options.model.to_string_lossy().into_owned(),
        adapter: adapter.to_string(),
        output: output.to_string_lossy().into_owned(),
        actors: options.actors,
        generate: true,
        max_new_tokens: ANSWER_TOKENS,
        max_batch: 8,
        kv_cache_mb: Some(64),
        ..ScoreConfig::default()
    };
    let done = ScoreRun::new(cluster.clone(), config)
        .map_err(anyhow::Error::msg)?
        .run(|_| {})
        .await
        .map_err(anyhow::Error::msg)?;
    generated_rows(output, done.rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_sets_are_chats_and_the_held_out_questions_are_new() {
        let held = held_out_rows().unwrap();
        assert_eq!(held.len(), 8);
        let train: Vec<serde_json::Value> = TRAIN_SET.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(train.len(), 32);
        for (id, messages) in &held {
            let asked = &messages[0].content;
            let taught = &messages[1].content;
            let same_answer = train
                .iter()
                .filter(|row| row["messages"][1]["content"] == taught.as_str())
                .count();
            assert_eq!(same_answer, 4, "{id}: four training wordings teach its answer");
            assert!(
                train.iter().all(|row| row["messages"][0]["content"] != asked.as_str()),
                "{id}: the held-out question is not a training question"
            );
        }
    }
}
