//! The pipe to the scorer's executor: one JSON message a line each way, and a generating
//! scorer's reply reader, which hands each partition its answer by tag.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::io::{AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout};
use tokio::sync::oneshot;

use super::metrics::metrics;
use crate::error::{Error, Result};
use crate::generate::{GenRequest, GenStats, Generation, SamplingParams};
use crate::protocol::{FromScorer, RowFailure, ToScorer};

/// What a generating scorer's partitions share: the executor's stdin, and the answers
/// its reply reader hands to each partition by tag.
pub(super) struct Link {
    pub(super) stdin: Arc<tokio::sync::Mutex<ChildStdin>>,
    pub(super) sampling: SamplingParams,
    /// The model's name in OpenAI-format answers (the last part of its location).
    pub(super) model_name: String,
    pub(super) state: std::sync::Mutex<LinkState>,
}

/// A generate request's rows, one result each, in order: or why the whole request was
/// lost (a step of the model failed, or the executor is gone).
type Answer = Result<Rows>;

/// One result per row of a generate request: a generation, or why the row has none.
pub(super) type Rows = Vec<std::result::Result<Generation, RowFailure>>;

#[derive(Default)]
pub(super) struct LinkState {
    waiting: HashMap<u64, oneshot::Sender<Answer>>,
    /// Set once the executor is gone: later partitions fail at once.
    gone: Option<String>,
}

impl Link {
    /// Registers a partition's answer before its rows go out.
    fn expect(&self, tag: u64) -> Result<oneshot::Receiver<Answer>> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| Error::Executor("a scorer link lock was poisoned".into()))?;
        if let Some(reason) = &state.gone {
            return Err(Error::Executor(reason.clone()));
        }
        let (sender, receiver) = oneshot::channel();
        state.waiting.insert(tag, sender);
        Ok(receiver)
    }

    /// Hands `answer` to the partition tagged `tag` (no one waiting: dropped).
    fn answer(&self, tag: u64, answer: Answer) {
        if let Ok(mut state) = self.state.lock() {
            if let Some(sender) = state.waiting.remove(&tag) {
                let _ = sender.send(answer);
            }
        }
    }

    /// Stops waiting for the answer tagged `tag` (its rows never went out).
    fn forget(&self, tag: u64) {
        if let Ok(mut state) = self.state.lock() {
            state.waiting.remove(&tag);
        }
    }

    /// Fails every partition waiting (and, when `gone`, every later one).
    fn fail_all(&self, reason: &str, gone: bool) {
        if let Ok(mut state) = self.state.lock() {
            for (_, sender) in state.waiting.drain() {
                let _ = sender.send(Err(Error::Executor(reason.to_string())));
            }
            if gone {
                state.gone = Some(reason.to_string());
            }
        }
    }

    /// Sends `rows` to the executor tagged `tag` (they join its running batch) and waits
    /// for their results, one per row in order.
    pub(super) async fn generate(&self, tag: u64, rows: &[GenRequest]) -> Result<Rows> {
        let answer = self.expect(tag)?;
        let sent = send(
            &self.stdin,
            &ToScorer::Generate {
                tag,
                rows: rows.to_vec(),
            },
        )
        .await;
        if let Err(e) = sent {
            self.forget(tag);
            return Err(e);
        }
        let results = answer
            .await
            .map_err(|_| Error::Executor("the scorer executor's reply reader stopped".into()))??;
        if results.len() != rows.len() {
            return Err(Error::Executor(format!(
                "the scorer executor answered {} rows to generate with {} results",
                rows.len(),
                results.len()
            )));
        }
        Ok(results)
    }

    /// Reads the executor's replies until it exits: answers by tag, progress figures to
    /// the node's gauges (taken back when the executor is gone).
    pub(super) async fn read_replies(self: Arc<Self>, mut stdout: Lines<BufReader<ChildStdout>>) {
        let m = metrics();
        let mut reported = GenStats::default();
        loop {
            match read_reply(&mut stdout).await {
                Ok(FromScorer::Stats(stats)) => {
                    m.generation(&reported, &stats);
                    reported = GenStats { new_tokens: 0, ..stats };
                }
                Ok(FromScorer::Generated { tag, results }) => self.answer(tag, Ok(results)),
                Ok(FromScorer::Failed(reason)) => self.fail_all(&format!("generation failed: {reason}"), false),
                Ok(other) => tracing::warn!("the scorer executor said {other:?} while generating"),
                Err(e) => {
                    self.fail_all(&e.to_string(), true);
                    break;
                }
            }
        }
        m.generation(&reported, &GenStats::default());
    }
}

pub(super) async fn send(stdin: &tokio::sync::Mutex<ChildStdin>, message: &ToScorer) -> Result<()> {
    let line = serde_json::to_string(message)?;
    stdin
        .lock()
        .await
        .write_all(format!("{line}\n").as_bytes())
        .await
        .map_err(|e| Error::Executor(format!("the scorer executor is gone: {e}")))
}

pub(super) async fn read_reply(stdout: &mut Lines<BufReader<ChildStdout>>) -> Result<FromScorer> {
    loop {
        match stdout.next_line().await {
            Ok(Some(line)) => match serde_json::from_str(&line) {
                Ok(message) => return Ok(message),
                Err(_) => tracing::info!("scorer executor: {line}"),
            },
            Ok(None) => {
                return Err(Error::Executor(
                    "the scorer executor exited (see the node's log)".into(),
                ))
            }
            Err(e) => return Err(Error::Executor(format!("cannot read from the scorer executor: {e}"))),
        }
    }
}
