//! The rank executor: the process a rank actor launches. It reads [`ToExecutor`] lines on
//! stdin and writes [`FromExecutor`] lines on stdout (logs go to stderr). It exits when its
//! stdin closes, so it never outlives the agent that launched it, even after a SIGKILL.
//!
//! A user's own model runs through [`executor_main`] in their own binary, passed to
//! `TrainerGroup::executor`.
//!
//! - `run_model`: the model a run trains, its tokenizer, first weights and batches
//!   ([`RunModel`], [`open_run_model`], [`reference_run`]).
//! - `feed`: where a rank's batches come from (a fixed partition or the streaming loader).
//! - `rank`: a rank's life from setup to its last step (`rank/save`: its checkpoints).
//! - `peak`: the GEMM rate model FLOPs utilisation is measured against ([`GemmPeak`]).

use std::io::{BufRead, Write};
use std::panic::AssertUnwindSafe;
use std::process::ExitCode;
use std::sync::mpsc;

use regatta_trainer::TrainConfig;
use regatta_trainer::{FromExecutor, ToExecutor};

use crate::error::Error;
use crate::model::Model;

mod feed;
mod peak;
mod rank;
mod run_model;

pub use feed::stream_batches;
pub use peak::{gemm_peak, matmul_flops_per_sec, matmul_flops_per_sec_on, GemmPeak};
pub use run_model::{
    builtin_model, initial_weights, load_quantized, open_run_model, reference_run, step_batches, take_stored_quantized,
    tokenizer_spec, RunModel,
};

/// Largest weight shard a checkpoint writes.
pub const SHARD_BYTES: u64 = 2 << 30;

pub use crate::reference::NamedTensors;

/// Makes the model a run trains when `[model]` names no Hugging Face model, for the
/// tokenizer's vocabulary.
pub type ModelFactory = dyn Fn(&TrainConfig, usize) -> Box<dyn Model>;

/// A rank's failure: `fatal` when retrying cannot help.
#[derive(Debug)]
pub struct Failure {
    /// Why.
    pub reason: String,
    /// Bad inputs rather than a lost peer.
    pub fatal: bool,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure {
            fatal: !error.is_transient(),
            reason: error.to_string(),
        }
    }
}

pub(crate) use crate::error::panic_text;

fn fatal(reason: impl ToString) -> Failure {
    Failure {
        reason: reason.to_string(),
        fatal: true,
    }
}

fn lost(reason: impl ToString) -> Failure {
    Failure {
        reason: reason.to_string(),
        fatal: false,
    }
}

fn emit(event: &FromExecutor) {
    if let Ok(line) = serde_json::to_string(event) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// Runs an executor on stdin/stdout with `make_model`'s model; returns the exit code.
pub fn executor_main(make_model: &ModelFactory) -> ExitCode {
    let (tx, rx) = mpsc::channel::<ToExecutor>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<ToExecutor>(&line) {
                Ok(message) => {
                    if tx.send(message).is_err() {
                        break;
                    }
                }
                Err(e) => eprintln!("ignored a malformed instruction: {e}"),
            }
        }
        // The agent is gone (or closed the pipe): nothing will read what this rank does.
        std::process::exit(3);
    });
    let setup = match rx.recv() {
        Ok(ToExecutor::Setup(setup)) => *setup,
        Ok(other) => {
            emit(&FromExecutor::Failed {
                reason: format!("expected setup first, got {other:?}"),
                fatal: true,
            });
            return ExitCode::from(2);
        }
        Err(_) => return ExitCode::from(2),
    };
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| rank::run_rank(setup, &rx, make_model)));
    let failure = match result {
        Ok(Ok(())) => return ExitCode::SUCCESS,
        Ok(Err(failure)) => failure,
        Err(panic) => fatal(format!("the executor panicked: {}", panic_text(panic.as_ref()))),
    };
    // Name the device the rank ran on (a CUDA out-of-memory or a vanished GPU reads as
    // `on cuda:0 (NVIDIA H100 80GB HBM3): ...`), once it was picked.
    let reason = match RANK_DEVICE.get() {
        Some(device) => format!("on {device}: {}", failure.reason),
        None => failure.reason,
    };
    eprintln!("rank failed: {reason}");
    emit(&FromExecutor::Failed {
        reason,
        fatal: failure.fatal,
    });
    ExitCode::from(1)
}

/// The device this executor's rank runs on, as failures name it.
static RANK_DEVICE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
