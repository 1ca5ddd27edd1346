//! What passes between a rank actor (inside a node's agent) and its executor process (the
//! one that links libtorch), as one JSON object per line on the executor's stdin and
//! stdout, and between the driver and the rank actors. Enums are externally tagged: the
//! actor messages travel as bincode, which cannot decode internally tagged enums.

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;

/// Everything a rank needs to start.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankSetup {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// The address this rank's ring endpoint binds (its node's host).
    pub host: String,
    /// The run.
    pub config: TrainConfig,
    /// Continue from the newest checkpoint in `config.checkpoint.dir`, if there is one.
    pub resume: bool,
    /// GPU indices granted to this rank (empty on CPU).
    pub gpus: Vec<u32>,
    /// Changes of the group's number of ranks so far (elastic runs).
    #[serde(default)]
    pub rescales: u32,
    /// The attempt this rank belongs to: the driver's clock (ms since the Unix epoch) when
    /// the attempt started, the same for every rank of it and larger for a later one.
    #[serde(default)]
    pub attempt: u64,
}

/// Agent to executor.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToExecutor {
    /// The first line.
    Setup(Box<RankSetup>),
    /// The next rank's ring address; the executor connects and starts training.
    Connect {
        /// `host:port`.
        next: String,
        /// Rank 0's NCCL unique id (hex), when the group runs on GPUs.
        nccl_id: Option<String>,
    },
}

/// One finished step, as a rank saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// Steps done (1 after the first).
    pub step: u64,
    /// Mean loss of the step over the whole batch (all ranks).
    pub loss: f64,
    /// Wall time of the step.
    pub step_secs: f64,
    /// Tokens per second over all ranks.
    pub tokens_per_sec: f64,
    /// Time this rank spent in collectives during the step.
    pub collective_secs: f64,
    /// Bytes of parameters this rank holds between steps.
    pub param_bytes: u64,
    /// Bytes of gradients this rank held at the end of backward.
    pub grad_bytes: u64,
    /// Bytes of optimizer state (master weights and both moments) this rank holds.
    pub optimizer_bytes: u64,
    /// Of `param_bytes`, in host memory (`offload_params`).
    #[serde(default)]
    pub host_param_bytes: u64,
    /// Of `grad_bytes`, in host memory (`offload_optimizer`: reduced shards go to the host).
    #[serde(default)]
    pub host_grad_bytes: u64,
    /// Of `optimizer_bytes`, in host memory (`offload_optimizer`).
    #[serde(default)]
    pub host_optimizer_bytes: u64,
    /// Of `param_bytes`, frozen parameters (a LoRA run's base).
    #[serde(default)]
    pub frozen_param_bytes: u64,
    /// Model FLOPs utilisation estimate (GPU only).
    pub mfu: Option<f64>,
    /// The learning rate the step's update used.
    #[serde(default)]
    pub lr: f64,
    /// The global gradient norm before clipping.
    #[serde(default)]
    pub grad_norm: f64,
    /// Most bytes the CUDA caching allocator handed to tensors during the step (GPU only).
    #[serde(default)]
    pub cuda_peak_allocated_bytes: Option<u64>,
    /// Most bytes it held from the driver during the step, cache included (GPU only).
    #[serde(default)]
    pub cuda_peak_reserved_bytes: Option<u64>,
}

/// What a rank's executor reports once its ring endpoint listens: its address and what
/// it loaded. The executor sends it ([`FromExecutor::Bound`]) and the rank's actor hands
/// it to the driver as it is ([`TrainReply::Bound`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    /// `host:port`.
    pub addr: String,
    /// Parameters of the model (real, without padding).
    pub params: u64,
    /// The step training starts after (0, or the checkpoint's step).
    pub start_step: u64,
    /// `cpu` or `cuda:N` (with the compute dtype and attention kernel).
    pub device: String,
    /// Rank 0 on GPUs: the NCCL unique id (hex) every rank joins with.
    pub nccl_id: Option<String>,
}

/// Executor to agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FromExecutor {
    /// The ring endpoint is listening (on the wire as the struct variant it was:
    /// `{"bound": {"addr": ..}}`).
    Bound(Binding),
    /// A step finished.
    Step(StepReport),
    /// A checkpoint was committed (rank 0 reports it once every rank's shard is written).
    Checkpoint {
        /// Steps it holds.
        step: u64,
        /// Where it is.
        url: String,
        /// It validates lowest so far and the `best` pointer names it (`keep_best`).
        #[serde(default)]
        best: bool,
    },
    /// A validation finished (rank 0 reports it; the loss is reduced over every rank).
    Eval(crate::eval::EvalReport),
    /// Dataset rows were skipped (not trained on): the first's `url@offset` and why.
    Skipped {
        /// What and why.
        what: String,
        /// Rows this report stands for (past the first 100 of a rank, one report a step).
        #[serde(default = "one")]
        count: u64,
    },
    /// Training finished.
    Finished {
        /// Steps done.
        steps: u64,
    },
    /// The rank gave up.
    Failed {
        /// Why.
        reason: String,
        /// True when retrying cannot help (bad data, bad checkpoint, bad config).
        fatal: bool,
    },
}

fn one() -> u64 {
    1
}

/// Driver to rank actor.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TrainOp {
    /// Wait until the executor listens; replies [`TrainReply::Bound`].
    Bind,
    /// Give the executor its successor's address (and rank 0's NCCL id); training starts.
    Connect(String, Option<String>),
    /// Events since the last poll.
    Poll,
}

/// Rank actor to driver.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TrainReply {
    /// The executor's ring address and what it loaded.
    Bound(Binding),
    /// The executor failed before binding; `fatal` when retrying cannot help (bad data, a
    /// bad model folder) rather than a lost peer.
    Failed {
        /// The executor's words.
        reason: String,
        /// Whether a restart of the group could succeed.
        fatal: bool,
    },
    /// Sent.
    Connected,
    /// Events, and the executor's exit when it has exited.
    Events {
        /// In order.
        events: Vec<FromExecutor>,
        /// Set once the executor process is gone: how it ended and its last log lines.
        exited: Option<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binding_travels_as_the_struct_variant_it_replaced() {
        let binding = Binding {
            addr: "h:1".into(),
            params: 7,
            start_step: 3,
            device: "cpu".into(),
            nccl_id: None,
        };
        let line = serde_json::to_string(&FromExecutor::Bound(binding.clone())).expect("encodes");
        assert_eq!(
            line,
            r#"{"bound":{"addr":"h:1","params":7,"start_step":3,"device":"cpu","nccl_id":null}}"#
        );
        assert_eq!(
            serde_json::from_str::<FromExecutor>(&line).expect("decodes"),
            FromExecutor::Bound(binding)
        );
    }
}
