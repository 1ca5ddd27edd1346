//! The model a run trains and what comes with it: the model (a Hugging Face folder or GGUF
//! file, a `model.config`, or the factory's), its tokenizer and chat settings, its first
//! weights, the files its checkpoints copy, and the batches its data makes per step; and
//! the plain reference run over the same model and batches.

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::eval::Side;
use regatta_trainer::TokenizerSettings;
use regatta_trainer::TrainConfig;
use tch::{Device, Tensor};

use super::{ModelFactory, NamedTensors};
use crate::data::{DataSource, RankData, TextTokenizer};
use crate::engine::{seeded, MicroBatch};
use crate::error::Error;
use crate::gpt::Gpt;
use crate::hf::{model_from_config, HfModel};
use crate::model::{Model, ParamSpec};

/// The built-in GPT for a configuration and vocabulary.
pub fn builtin_model(config: &TrainConfig, vocab: usize) -> Box<dyn Model> {
    Box::new(Gpt::new(config.model.clone(), vocab))
}

/// The `tokenizer.json` a run uses: `data.tokenizer`, else the model folder's (a GGUF
/// model file is its own tokenizer), else none (bytes are tokens).
pub fn tokenizer_spec(config: &TrainConfig) -> String {
    if !config.data.tokenizer.is_empty() {
        config.data.tokenizer.clone()
    } else if crate::hf::is_gguf(&config.model.path) {
        config.model.path.clone()
    } else if !config.model.path.is_empty() {
        format!("{}/tokenizer.json", config.model.path.trim_end_matches('/'))
    } else {
        String::new()
    }
}

/// The model a run trains, the folder its first weights come from (none: seeded random
/// weights) and the files its checkpoints copy (tokenizer and generation settings).
pub struct RunModel {
    /// The model.
    pub model: Box<dyn Model>,
    /// The Hugging Face folder it loads from.
    pub source: Option<HfModel>,
    /// Files copied into checkpoints.
    pub side_files: Vec<(String, Bytes)>,
    /// The tokenizer.
    pub tokenizer: std::sync::Arc<TextTokenizer>,
    /// Special tokens and chat template (`tokenizer_config.json` beside the tokenizer).
    pub settings: TokenizerSettings,
}

impl RunModel {
    /// Partitions `which` of `partitions` of the run's dataset, tokenized by this model's
    /// tokenizer into sequences of the run's context.
    /// With `eval.split`, the held-out rows are left out.
    pub async fn data(&self, config: &TrainConfig, partitions: usize, which: &[usize]) -> Result<RankData, Error> {
        let source = DataSource {
            path: &config.data.path,
            format: config.data.format,
            tokenizer: &self.tokenizer,
            settings: &self.settings,
            holdout: config.eval.as_ref().and_then(|e| e.holdout(config.seed, Side::Train)),
        };
        RankData::load(&source, config.model.context, partitions, which).await
    }

    /// The validation rows of `[eval]` (all of them: each rank evaluates its share of
    /// them by [`regatta_trainer::eval::rank_batches`]) and how many are used
    /// (`eval.max_rows` at most); `None` without `[eval]`.
    pub async fn eval_data(&self, config: &TrainConfig) -> Result<Option<(RankData, usize)>, Error> {
        let Some(eval) = &config.eval else {
            return Ok(None);
        };
        let source = if eval.path.is_empty() {
            DataSource {
                path: &config.data.path,
                format: config.data.format,
                tokenizer: &self.tokenizer,
                settings: &self.settings,
                holdout: eval.holdout(config.seed, Side::Eval),
            }
        } else {
            DataSource {
                path: &eval.path,
                format: regatta_trainer::DataFormat::Auto,
                tokenizer: &self.tokenizer,
                settings: &self.settings,
                holdout: None,
            }
        };
        let data = RankData::load(&source, config.model.context, 1, &[0])
            .await
            .map_err(|e| match e {
                Error::Dataset(problem) => Error::Dataset(format!("validation data ([eval]): {problem}")),
                other => other,
            })?;
        let rows = data.sequences()[0].min(eval.max_rows);
        Ok(Some((data, rows)))
    }
}

/// A parameter's first values: read from the model folder, or drawn from `seed` when there
/// is none or the parameter is a new LoRA adapter (A uniform as PEFT draws it, B zero).
pub async fn initial_weights(source: Option<&HfModel>, spec: &ParamSpec, seed: u64) -> Result<Tensor, Error> {
    match source {
        Some(hf) if !regatta_trainer::is_adapter(&spec.name) => hf.read(spec).await,
        _ => Ok(seeded(spec, seed)),
    }
}

/// Hands the model the weights it holds quantized that `source` already stores so in the
/// run's settings (a bitsandbytes 4-bit or 8-bit folder), as stored: the engine then
/// quantizes only the others.
pub async fn take_stored_quantized(
    model: &mut dyn Model,
    source: Option<&HfModel>,
    device: Device,
) -> Result<(), Error> {
    let Some(hf) = source else {
        return Ok(());
    };
    for spec in model.quantized_specs() {
        if let Some(stored) = hf.read_stored(&spec).await? {
            model.take_stored(&spec, &stored, device)?;
        }
    }
    Ok(())
}

/// Loads every weight `model` holds quantized (a QLoRA base) from `hf`: as the folder
/// stores it where that fits the settings, else read and quantized one at a time (the
/// float weight dropped before the next is read).
pub async fn load_quantized(model: &mut dyn Model, hf: &HfModel, device: Device) -> Result<(), Error> {
    take_stored_quantized(model, Some(hf), device).await?;
    for spec in model.quantized_specs() {
        if !model.holds_quantized(&spec.name) {
            let weight = hf.read(&spec).await?;
            model.set_quantized(&spec, &weight, device)?;
        }
    }
    Ok(())
}

/// Opens the model and tokenizer `config` names (a folder, a config, or `make_model`'s).
pub async fn open_run_model(config: &TrainConfig, make_model: &ModelFactory) -> Result<RunModel, Error> {
    // The model folder first: a wrong path is named as a missing model, not a tokenizer.
    let hf = if config.model.path.is_empty() {
        None
    } else {
        Some(HfModel::open(&config.model.path).await?)
    };
    let spec = tokenizer_spec(config);
    let (tokenizer, settings) = if crate::hf::is_gguf(&spec) {
        // The model file itself when it is the tokenizer: its header is read once.
        let opened;
        let file = match hf.as_ref().filter(|h| h.is_gguf() && config.data.tokenizer.is_empty()) {
            Some(model) => model,
            None => {
                opened = HfModel::open(&spec).await?;
                &opened
            }
        };
        gguf_tokenizer(file).await?
    } else {
        let tokenizer = TextTokenizer::load(&spec).await.map_err(|e| match e {
            Error::Storage(problem) => Error::ModelFile {
                path: spec.clone(),
                problem,
            },
            Error::Place(e) => Error::ModelFile {
                path: spec.clone(),
                problem: e.to_string(),
            },
            other => other,
        })?;
        (tokenizer, tokenizer_settings(&spec).await?)
    };
    let (mut model, source, mut side_files) = if let Some(hf) = hf {
        let model = hf.model()?;
        hf.check(model.as_ref())?;
        let side = hf.side_files().await?;
        (model, Some(hf), side)
    } else if let Some(json) = &config.model.config {
        (model_from_config(json, "model.config")?, None, Vec::new())
    } else {
        (make_model(config, tokenizer.vocab()), None, Vec::new())
    };
    if let Some(lora) = &config.lora {
        model.set_lora(lora)?;
    }
    if tokenizer.vocab() > model.vocab() {
        return Err(Error::ModelFile {
            path: if spec.is_empty() {
                "the byte tokenizer".into()
            } else {
                spec.clone()
            },
            problem: format!(
                "has {} tokens but the model embeds only {}; use the model's own tokenizer.json",
                tokenizer.vocab(),
                model.vocab()
            ),
        });
    }
    if source.is_none() && !config.data.tokenizer.is_empty() {
        side_files.push((
            "tokenizer.json".into(),
            crate::data::tokenizer_json(&config.data.tokenizer).await?,
        ));
    }
    Ok(RunModel {
        model,
        source,
        side_files,
        tokenizer: std::sync::Arc::new(tokenizer),
        settings,
    })
}

/// The tokenizer and the special tokens and chat template a GGUF file's metadata makes.
async fn gguf_tokenizer(file: &HfModel) -> Result<(TextTokenizer, TokenizerSettings), Error> {
    let missing = |name: &str| Error::ModelFile {
        path: file.url().to_string(),
        problem: format!("makes no {name}"),
    };
    let tokenizer = file
        .file("tokenizer.json")
        .await?
        .ok_or_else(|| missing("tokenizer.json"))?;
    let config = file
        .file("tokenizer_config.json")
        .await?
        .ok_or_else(|| missing("tokenizer_config.json"))?;
    let json: serde_json::Value = serde_json::from_slice(&config).map_err(|e| Error::ModelFile {
        path: file.url().to_string(),
        problem: format!("makes a tokenizer_config.json that is not JSON: {e}"),
    })?;
    Ok((
        TextTokenizer::from_json(&tokenizer, file.url())?,
        TokenizerSettings::from_json(&json),
    ))
}

/// The `tokenizer_config.json` beside the tokenizer at `spec`, when there is one.
async fn tokenizer_settings(spec: &str) -> Result<TokenizerSettings, Error> {
    if spec.is_empty() {
        return Ok(TokenizerSettings::default());
    }
    let (place, _) = Place::file(spec)?;
    let Some(bytes) = place.get_opt("tokenizer_config.json").await? else {
        return Ok(TokenizerSettings::default());
    };
    let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::ModelFile {
        path: format!("{}/tokenizer_config.json", place.url()),
        problem: format!("is not valid JSON: {e}"),
    })?;
    Ok(TokenizerSettings::from_json(&json))
}

/// The micro-batches a process takes at `step` from `data` (each of its partitions gives
/// `micro_batch_size` sequences per micro-batch).
pub fn step_batches(config: &TrainConfig, data: &RankData, step: u64) -> Vec<MicroBatch> {
    let (micro, accum) = (config.micro_batch_size, config.gradient_accumulation);
    (0..accum as u64)
        .map(|k| {
            let (tokens, targets, documents) = data.batch((step * accum as u64 + k) * micro as u64, micro);
            MicroBatch {
                tokens,
                targets,
                documents,
            }
        })
        .collect()
}

/// The plain single-process reference ([`crate::reference::plain_run`]: libtorch autograd
/// and AdamW, no ZeRO engine) on the global batch every rank of a `partitions`-rank layout
/// would see, from the same initial weights. Returns the loss of every step and the final
/// weights.
pub fn reference_run(
    config: &TrainConfig,
    partitions: usize,
    make_model: &ModelFactory,
) -> Result<(Vec<f64>, NamedTensors), Error> {
    tch::set_num_threads(config.threads as i32);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Invalid(e.to_string()))?;
    let run_model = runtime.block_on(open_run_model(config, make_model))?;
    let which: Vec<usize> = (0..partitions).collect();
    let data = runtime.block_on(run_model.data(config, partitions, &which))?;
    let steps: Vec<Vec<MicroBatch>> = (0..config.steps).map(|s| step_batches(config, &data, s)).collect();
    let seed = config.seed;
    let source = run_model.source;
    let mut init = |spec: &ParamSpec| runtime.block_on(initial_weights(source.as_ref(), spec, seed));
    crate::reference::plain_run(run_model.model.as_ref(), &mut init, &steps, &config.optimizer)
}
