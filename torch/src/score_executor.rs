//! `regatta-torch-rank score`: the scorer actor's executor. Reads [`ToScorer`] lines on
//! stdin (a setup, then batches), writes [`FromScorer`] lines on stdout; exits when stdin
//! closes.

use std::io::{BufRead, Write};
use std::process::ExitCode;

use regatta_object_store::Place;
use regatta_scorer::protocol::{is_torchscript, FromScorer, RowScore, ScorerSetup, ToScorer};
use tch::Device;

use crate::checkpoint::open_model;
use crate::data::TextTokenizer;
use crate::error::{Error, Result};
use crate::lora::Adapter;
use crate::score::Scorer;

fn emit(message: &FromScorer) {
    if let Ok(line) = serde_json::to_string(message) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

fn load(setup: &ScorerSetup) -> Result<(Scorer, u64, Device)> {
    tch::set_num_threads(setup.threads.max(1) as i32);
    let device = crate::cuda::pick_device(&setup.device, &setup.gpus)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    if is_torchscript(&setup.checkpoint) {
        let (place, name) = Place::file(&setup.checkpoint).map_err(Error::Storage)?;
        let bytes = runtime.block_on(place.get(&name)).map_err(Error::Storage)?;
        let tokenizer = runtime.block_on(TextTokenizer::load(&setup.tokenizer))?;
        let scorer = Scorer::from_torchscript(&bytes, setup.context, tokenizer, device)
            .map_err(|e| Error::Invalid(format!("{}: {e}", setup.checkpoint)))?;
        return Ok((scorer, 0, device));
    }
    let (scorer, params) = runtime.block_on(open_scorer(
        &setup.checkpoint,
        &setup.adapter,
        &setup.tokenizer,
        setup.context,
        device,
    ))?;
    Ok((scorer, params, device))
}

/// The scorer of a model folder or checkpoint: its tokenizer is `tokenizer` when given,
/// else the folder's `tokenizer.json`, else the one the training run named, else bytes.
async fn open_scorer(
    url: &str,
    adapter: &str,
    tokenizer: &str,
    context: usize,
    device: Device,
) -> Result<(Scorer, u64)> {
    let (manifest, hf) = open_model(url).await?;
    let adapter = if adapter.is_empty() {
        None
    } else {
        Some(Adapter::open(adapter).await?)
    };
    let tokenizer = if !tokenizer.is_empty() {
        TextTokenizer::load(tokenizer).await?
    } else if let Some(bytes) = hf.file("tokenizer.json").await? {
        TextTokenizer::from_json(&bytes, &format!("{}/tokenizer.json", hf.url()))?
    } else {
        TextTokenizer::load(&manifest.map(|m| m.tokenizer).unwrap_or_default()).await?
    };
    let scorer = Scorer::from_folder(
        &hf,
        adapter.as_ref(),
        context,
        tokenizer,
        device,
        crate::cuda::inference_kind(device),
    )
    .await?;
    let params = scorer.parameters();
    Ok((scorer, params))
}

/// `regatta-torch-rank export CHECKPOINT OUT.pt`: the checkpoint's model as a traced
/// TorchScript module (any batch size, up to the model's context); returns the context.
pub fn export(checkpoint: &str, out: &str) -> Result<usize> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (scorer, _) = runtime.block_on(open_scorer(checkpoint, "", "", 0, Device::Cpu))?;
    let module = scorer.export()?;
    let file = tempfile_beside(out);
    module
        .save(&file)
        .map_err(|e| Error::Invalid(format!("cannot write {}: {e}", file.display())))?;
    let bytes = std::fs::read(&file).map_err(|e| Error::Invalid(format!("cannot read {}: {e}", file.display())))?;
    let _ = std::fs::remove_file(&file);
    let (place, name) = Place::file(out).map_err(Error::Storage)?;
    runtime
        .block_on(place.put(&name, bytes.into()))
        .map_err(Error::Storage)?;
    Ok(scorer.context())
}

/// A local scratch file for libtorch's writer (the export itself may go to S3).
fn tempfile_beside(out: &str) -> std::path::PathBuf {
    let name = out.rsplit('/').next().unwrap_or("model.pt");
    std::env::temp_dir().join(format!("regatta-export-{}-{name}", std::process::id()))
}

/// Serves scoring requests on stdin/stdout.
pub fn score_main() -> ExitCode {
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut next = || -> Option<ToScorer> {
        loop {
            let line = lines.next()?.ok()?;
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str(&line) {
                Ok(message) => return Some(message),
                Err(e) => eprintln!("ignored a malformed request: {e}"),
            }
        }
    };
    let Some(ToScorer::Setup(setup)) = next() else {
        emit(&FromScorer::Failed("expected a setup line first".into()));
        return ExitCode::from(2);
    };
    let (scorer, params, device) = match load(&setup) {
        Ok(loaded) => loaded,
        Err(reason) => {
            eprintln!("scorer failed: {reason}");
            emit(&FromScorer::Failed(reason.to_string()));
            return ExitCode::from(1);
        }
    };
    emit(&FromScorer::Ready {
        params,
        device: format!("{device:?}").to_lowercase(),
    });
    while let Some(message) = next() {
        let rows = match message {
            ToScorer::Batch(rows) => rows,
            ToScorer::Generate(requests) => {
                let setup = setup.generation.clone().unwrap_or_default();
                let mut stats = |s| emit(&FromScorer::Stats(s));
                match scorer.generate_rows(&requests, &setup, &mut stats) {
                    Ok(results) => emit(&FromScorer::Generated(results)),
                    // The model itself failed (not one row): the partition fails with it.
                    Err(reason) => emit(&FromScorer::Failed(reason.to_string())),
                }
                continue;
            }
            ToScorer::Setup(_) => {
                eprintln!("ignored a second setup");
                continue;
            }
        };
        let tokenized: Vec<Result<(Vec<i64>, bool)>> = rows.iter().map(|(_, text)| scorer.tokenize(text)).collect();
        let valid: Vec<(Vec<i64>, bool)> = tokenized.iter().filter_map(|r| r.as_ref().ok().cloned()).collect();
        let mut scored = match scorer.score(&valid, setup.max_new_tokens) {
            Ok(scored) => scored.into_iter(),
            Err(reason) => {
                // The model itself failed (not one row): the partition fails with the cause.
                emit(&FromScorer::Failed(reason.to_string()));
                continue;
            }
        };
        let results = tokenized
            .into_iter()
            .map(|r| {
                // Row errors travel to the scorer actor as text: they are written to the
                // partition's errors file for people.
                r.map_err(|e| e.to_string()).and_then(|_| {
                    let s = scored.next().ok_or("a score is missing")?;
                    Ok(RowScore {
                        tokens: s.tokens as u64,
                        truncated: s.truncated,
                        log_likelihood: s.log_likelihood,
                        perplexity: s.perplexity,
                        generated: s.generated,
                    })
                })
            })
            .collect();
        emit(&FromScorer::Scored(results));
    }
    ExitCode::SUCCESS
}
