//! `regatta-torch-rank score`: the scorer actor's executor. Reads [`ToScorer`] lines on
//! stdin (a setup, then batches), writes [`FromScorer`] lines on stdout; exits when stdin
//! closes.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::mpsc::{Receiver, TryRecvError};

use regatta_object_store::Place;
use regatta_scorer::{is_torchscript, AdapterBase, FromScorer, RowFailure, RowScore, ScorerSetup, ToScorer};
use regatta_scorer::{GenRequest, Generation, GenerationSetup};
use tch::Device;

use crate::checkpoint::open_model;
use crate::data::TextTokenizer;
use crate::error::{Error, Result};
use crate::generate::{Generator, Output, Session};
use crate::lora::{hold_base, Adapter};
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
        let (place, name) = Place::file(&setup.checkpoint)?;
        let bytes = runtime.block_on(place.get(&name))?;
        let tokenizer = runtime.block_on(TextTokenizer::load(&setup.tokenizer))?;
        let scorer = Scorer::from_torchscript(&bytes, setup.context, tokenizer, device)
            .map_err(|e| Error::Invalid(format!("{}: {e}", setup.checkpoint)))?;
        return Ok((scorer, 0, device));
    }
    let (scorer, params) = runtime.block_on(open_scorer(
        &setup.checkpoint,
        (&setup.adapter, setup.adapter_base, setup.double_quant),
        &setup.tokenizer,
        setup.context,
        device,
        setup.generation.as_ref(),
    ))?;
    Ok((scorer, params, device))
}

/// The scorer of a model folder or checkpoint: its tokenizer is `tokenizer` when given,
/// else the folder's `tokenizer.json`, else the one the training run named, else bytes.
/// `adapter`: the adapter's folder (empty: none) and how the base under it is held;
/// `generation`: the setup it will generate under, where it is loaded to generate.
async fn open_scorer(
    url: &str,
    (adapter, base, double_quant): (&str, AdapterBase, bool),
    tokenizer: &str,
    context: usize,
    device: Device,
    generation: Option<&GenerationSetup>,
) -> Result<(Scorer, u64)> {
    let (manifest, hf) = open_model(url).await?;
    let adapter = if adapter.is_empty() {
        None
    } else {
        let mut adapter = Adapter::open(adapter).await?;
        hold_base(&mut adapter.config, base, double_quant, hf.stored_quantization());
        Some(adapter)
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
        (device, crate::cuda::inference_kind(device)),
        generation,
    )
    .await?;
    let params = scorer.parameters();
    Ok((scorer, params))
}

/// `regatta-torch-rank export CHECKPOINT OUT.pt`: the checkpoint's model as a traced
/// TorchScript module (any batch size, up to the model's context); returns the context.
pub fn export(checkpoint: &str, out: &str) -> Result<usize> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (scorer, _) = runtime.block_on(open_scorer(
        checkpoint,
        ("", AdapterBase::None, false),
        "",
        0,
        Device::Cpu,
        None,
    ))?;
    let module = scorer.export()?;
    let file = tempfile_beside(out);
    module
        .save(&file)
        .map_err(|e| Error::Invalid(format!("cannot write {}: {e}", file.display())))?;
    let bytes = std::fs::read(&file).map_err(|e| Error::Invalid(format!("cannot read {}: {e}", file.display())))?;
    let _ = std::fs::remove_file(&file);
    let (place, name) = Place::file(out)?;
    runtime.block_on(place.put(&name, bytes.into()))?;
    Ok(scorer.context())
}

/// A local scratch file for libtorch's writer (the export itself may go to S3).
fn tempfile_beside(out: &str) -> std::path::PathBuf {
    let name = out.rsplit('/').next().unwrap_or("model.pt");
    std::env::temp_dir().join(format!("regatta-export-{}-{name}", std::process::id()))
}

/// Serves scoring or generation requests on stdin/stdout. A reader thread takes requests
/// as they come, so a generating executor adds a partition's rows to the running batch
/// while earlier ones still decode.
pub fn score_main() -> ExitCode {
    let (sender, messages) = std::sync::mpsc::channel::<ToScorer>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str(&line) {
                Ok(message) => {
                    if sender.send(message).is_err() {
                        break;
                    }
                }
                Err(e) => eprintln!("ignored a malformed request: {e}"),
            }
        }
    });
    let Ok(ToScorer::Setup(setup)) = messages.recv() else {
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
    let ready = |kv_cache_bytes| FromScorer::Ready {
        params,
        device: format!("{device:?}").to_lowercase(),
        kv_cache_bytes,
    };
    let Some(generation) = &setup.generation else {
        emit(&ready(None));
        return score_loop(&scorer, &setup, &messages);
    };
    // The generator sizes its cache budget (unset: from the memory left after the weights).
    let generator = match scorer.generator(generation) {
        Ok(generator) => generator,
        Err(reason) => {
            emit(&FromScorer::Failed(reason.to_string()));
            return ExitCode::from(1);
        }
    };
    let budget = generator.kv_cache_bytes();
    eprintln!(
        "KV cache budget {} MiB ({})",
        budget >> 20,
        if generation.kv_cache_bytes.is_some() {
            "kv_cache_mb"
        } else {
            "auto"
        }
    );
    let (matrices, bytes) = generator.packed_weights();
    let layout = match generator.packed_kernel() {
        Some(crate::packed::PackKernel::Panels) => "column panels for Regatta's own kernel",
        Some(crate::packed::PackKernel::OneDnn) => "oneDNN's layout",
        None => "",
    };
    if matrices > 0 {
        eprintln!("{matrices} weight matrices packed in {layout} ({} MiB)", bytes >> 20);
    }
    emit(&ready(Some(budget)));
    generate_loop(&scorer, &generator, &messages)
}

/// A generate request whose rows are still running.
struct InFlight {
    requests: Vec<GenRequest>,
    prompt_tokens: Vec<usize>,
    results: Vec<Option<std::result::Result<Generation, RowFailure>>>,
    left: usize,
}

impl InFlight {
    fn answer(self, tag: u64) {
        let results = self
            .results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(RowFailure::new("the row's generation is missing"))))
            .collect();
        emit(&FromScorer::Generated { tag, results });
    }
}

/// One generation session for every request: a request's rows join the running batch at
/// the next step, and its answer goes out when its last row ends. A step the model fails
/// loses every request in flight (one `Failed`); the next request starts a new session.
fn generate_loop(scorer: &Scorer, generator: &Generator, messages: &Receiver<ToScorer>) -> ExitCode {
    let session = match generator.session() {
        Ok(session) => session,
        Err(reason) => {
            emit(&FromScorer::Failed(reason.to_string()));
            return ExitCode::from(1);
        }
    };
    let mut generating = Generating {
        scorer,
        generator,
        session,
        in_flight: HashMap::new(),
        owner: HashMap::new(),
    };
    let mut open = true;
    loop {
        let message = next_message(messages, generating.session.is_idle(), &mut open);
        if generating.session.is_idle() && message.is_none() {
            // stdin closed with nothing running.
            return ExitCode::SUCCESS;
        }
        match message {
            Some(message) => generating.handle(message),
            None => {
                if generating.step().is_err() {
                    return ExitCode::from(1);
                }
            }
        }
    }
}

/// The next message: every one that has arrived is taken before a step, and one is waited
/// for only when nothing runs (`idle`). `None` when none has arrived, or once stdin is
/// closed (`open` then turns false).
fn next_message(messages: &Receiver<ToScorer>, idle: bool, open: &mut bool) -> Option<ToScorer> {
    if idle {
        if !*open {
            return None;
        }
        return messages.recv().ok();
    }
    match messages.try_recv() {
        Ok(message) => Some(message),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Disconnected) => {
            *open = false;
            None
        }
    }
}

/// The generating executor's state: the session every request's rows join, the requests
/// still running and which request and row each running sequence answers.
struct Generating<'s, 'g, 'a> {
    scorer: &'s Scorer,
    generator: &'g Generator<'a>,
    session: Session<'g, 'a>,
    in_flight: HashMap<u64, InFlight>,
    /// A running sequence's request tag and row.
    owner: HashMap<usize, (u64, usize)>,
}

impl Generating<'_, '_, '_> {
    fn handle(&mut self, message: ToScorer) {
        match message {
            ToScorer::Generate { tag, rows } => self.admit(tag, rows),
            ToScorer::Batch(_) => {
                emit(&FromScorer::Failed(
                    "this executor generates; it was sent rows to score".into(),
                ));
            }
            ToScorer::Setup(_) => eprintln!("ignored a second setup"),
        }
    }

    /// Adds a request's rows to the session; a row that cannot run gets its reason now, and
    /// a request none of whose rows runs is answered at once.
    fn admit(&mut self, tag: u64, rows: Vec<GenRequest>) {
        let mut flight = InFlight {
            prompt_tokens: vec![0; rows.len()],
            results: vec![None; rows.len()],
            left: 0,
            requests: Vec::new(),
        };
        for (i, request) in rows.iter().enumerate() {
            let added = self.scorer.prepare(request).and_then(|prepared| {
                let tokens = prepared.prompt.len();
                self.session.add(prepared).map(|seq| (seq, tokens))
            });
            match added {
                Ok((seq, tokens)) => {
                    self.owner.insert(seq, (tag, i));
                    flight.prompt_tokens[i] = tokens;
                    flight.left += 1;
                }
                Err(reason) => flight.results[i] = Some(Err(RowFailure::new(reason.to_string()))),
            }
        }
        flight.requests = rows;
        if flight.left == 0 {
            flight.answer(tag);
        } else {
            self.in_flight.insert(tag, flight);
        }
    }

    /// Runs one step and files the rows it finished. When the model fails, every request in
    /// flight fails and a new session starts; an error only when that cannot.
    fn step(&mut self) -> Result<()> {
        let decode = |ids: &[i64]| self.scorer.decode(ids);
        let mut stats = |s| emit(&FromScorer::Stats(s));
        match self.session.step(&decode, &mut stats) {
            Ok(finished) => {
                for (seq, output) in finished {
                    self.finish(seq, output);
                }
            }
            Err(reason) => {
                // The model itself failed (not one row): every request in flight fails.
                eprintln!("generation failed: {reason}");
                emit(&FromScorer::Failed(reason.to_string()));
                self.in_flight.clear();
                self.owner.clear();
                self.session = self.generator.session()?;
            }
        }
        Ok(())
    }

    /// Files a finished sequence's row in its request, answered when it was the last.
    fn finish(&mut self, seq: usize, output: Output) {
        let Some((tag, i)) = self.owner.remove(&seq) else {
            return;
        };
        let Some(flight) = self.in_flight.get_mut(&tag) else {
            return;
        };
        flight.results[i] = Some(Ok(self.scorer.generation(
            &flight.requests[i],
            flight.prompt_tokens[i],
            output,
        )));
        flight.left -= 1;
        if flight.left == 0 {
            if let Some(flight) = self.in_flight.remove(&tag) {
                flight.answer(tag);
            }
        }
    }
}

/// Scores each batch as it comes.
fn score_loop(scorer: &Scorer, setup: &ScorerSetup, messages: &Receiver<ToScorer>) -> ExitCode {
    while let Ok(message) = messages.recv() {
        let rows = match message {
            ToScorer::Batch(rows) => rows,
            ToScorer::Generate { tag, rows } => {
                let results = rows
                    .iter()
                    .map(|_| Err(RowFailure::new("this run scores; it was not set up to generate")))
                    .collect();
                emit(&FromScorer::Generated { tag, results });
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
                r.map_err(|e| RowFailure::new(e.to_string())).and_then(|_| {
                    let s = scored.next().ok_or_else(|| RowFailure::new("a score is missing"))?;
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
