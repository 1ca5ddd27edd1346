//! What a run reports as it goes ([`TrainEvent`]), what it returns when it ends
//! ([`TrainSummary`]), and a step's figures as the dashboard charts them.

use std::collections::BTreeMap;

use crate::eval::EvalReport;
use crate::protocol::StepReport;

/// What happens during a run, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum TrainEvent {
    /// The group is placed and bound; training starts after `start_step`.
    Started {
        /// 0 for the first attempt.
        attempt: u32,
        /// Steps already done (from a checkpoint).
        start_step: u64,
        /// Model parameters.
        params: u64,
        /// Node of each rank.
        nodes: Vec<String>,
        /// Device of rank 0.
        device: String,
        /// Ranks in this attempt.
        world: usize,
    },
    /// The number of ranks changes (an elastic run lost a rank without a replacement, or
    /// regained capacity).
    Rescaled {
        /// Ranks before.
        from: usize,
        /// Ranks now.
        to: usize,
        /// Why.
        reason: String,
    },
    /// A rank skipped dataset rows it cannot read (`url@offset: why` of the first).
    Skipped {
        /// The rank.
        rank: usize,
        /// What and why.
        what: String,
        /// Rows skipped (1, or a step's rows past a rank's first 100 reports).
        count: u64,
    },
    /// A step finished (rank 0's report; every rank sees the same loss).
    Step(StepReport),
    /// A checkpoint was committed.
    Checkpoint {
        /// Steps it holds.
        step: u64,
        /// Where.
        url: String,
        /// It validates lowest so far (`keep_best`: the `best` pointer names it).
        best: bool,
    },
    /// A validation finished (`[eval]`).
    Eval(EvalReport),
    /// A rank was lost; the group restarts from the newest checkpoint.
    Restarting {
        /// The rank that failed.
        rank: usize,
        /// Why.
        reason: String,
        /// Failures so far.
        failures: u32,
        /// The limit.
        max_failures: u32,
    },
}

/// The result of a finished run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainSummary {
    /// Loss of every step, by step (a restarted step keeps its latest value).
    pub losses: BTreeMap<u64, f64>,
    /// The last step's report.
    pub last: Option<StepReport>,
    /// Rank failures survived.
    pub failures: u32,
    /// The newest checkpoint.
    pub checkpoint: Option<(u64, String)>,
    /// Validation loss by step (`[eval]`).
    pub evals: BTreeMap<u64, f64>,
    /// The checkpoint that validated lowest (`keep_best`).
    pub best: Option<(u64, String)>,
    /// The TensorBoard events file written (`[logging] tensorboard`).
    pub tensorboard: Option<String>,
    /// Model parameters.
    pub params: u64,
    /// Wall time of the whole run.
    pub seconds: f64,
    /// Ranks of the last attempt.
    pub world: usize,
    /// Changes of the number of ranks.
    pub rescales: u32,
}

/// A step's figures as the dashboard charts them.
pub(super) fn step_figures(report: &StepReport) -> BTreeMap<String, f64> {
    let mut figures = BTreeMap::from([
        ("loss".to_string(), report.loss),
        ("lr".to_string(), report.lr),
        ("grad_norm".to_string(), report.grad_norm),
        ("tokens_per_sec".to_string(), report.tokens_per_sec),
        ("step_secs".to_string(), report.step_secs),
        ("collective_secs".to_string(), report.collective_secs),
        (
            "bytes_per_rank".to_string(),
            (report.param_bytes + report.grad_bytes + report.optimizer_bytes) as f64,
        ),
    ]);
    if let Some(mfu) = report.mfu {
        figures.insert("mfu".to_string(), mfu);
    }
    figures
}
