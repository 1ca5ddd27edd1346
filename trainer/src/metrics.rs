//! The trainer's metrics, on the node's `/metrics` next to the runtime's: each rank actor
//! publishes what its executor reports. Labels: `rank` only (bounded by the world size).

use std::sync::OnceLock;

use prometheus::{GaugeVec, IntCounterVec, Opts};

use crate::protocol::FromExecutor;

/// Every trainer metric.
pub struct TrainMetrics {
    loss: GaugeVec,
    eval_loss: GaugeVec,
    lr: GaugeVec,
    grad_norm: GaugeVec,
    step: GaugeVec,
    step_seconds: GaugeVec,
    tokens_per_second: GaugeVec,
    collective_seconds: GaugeVec,
    state_bytes: GaugeVec,
    host_state_bytes: GaugeVec,
    mfu: GaugeVec,
    cuda_peak_bytes: GaugeVec,
    world_size: GaugeVec,
    rescales: GaugeVec,
    checkpoints: IntCounterVec,
    skipped_rows: IntCounterVec,
}

fn counter(name: &str, help: &str) -> IntCounterVec {
    let metric = IntCounterVec::new(Opts::new(name, help), &["rank"]).expect("metric names and labels are valid");
    let _ = regatta_runtime::metrics().registry().register(Box::new(metric.clone()));
    metric
}

fn gauge(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let metric = GaugeVec::new(Opts::new(name, help), labels).expect("metric names and labels are valid");
    // A second registration (two groups in one process) keeps the first; both update it.
    let _ = regatta_runtime::metrics().registry().register(Box::new(metric.clone()));
    metric
}

impl TrainMetrics {
    /// The process's trainer metrics, registered on first use.
    pub fn get() -> &'static TrainMetrics {
        static METRICS: OnceLock<TrainMetrics> = OnceLock::new();
        METRICS.get_or_init(|| TrainMetrics {
            loss: gauge("regatta_train_loss", "Mean loss of the last step", &["rank"]),
            eval_loss: gauge(
                "regatta_train_eval_loss",
                "Mean validation loss per target token, last validation ([eval]; reported by rank 0)",
                &["rank"],
            ),
            lr: gauge("regatta_train_learning_rate", "Learning rate of the last step", &["rank"]),
            grad_norm: gauge(
                "regatta_train_grad_norm",
                "Global gradient norm of the last step, before clipping",
                &["rank"],
            ),
            step: gauge("regatta_train_step", "Steps done", &["rank"]),
            step_seconds: gauge("regatta_train_step_seconds", "Wall time of the last step", &["rank"]),
            tokens_per_second: gauge(
                "regatta_train_tokens_per_second",
                "Tokens per second over the whole group, last step",
                &["rank"],
            ),
            collective_seconds: gauge(
                "regatta_train_collective_seconds",
                "Time in collectives during the last step",
                &["rank"],
            ),
            state_bytes: gauge(
                "regatta_train_state_bytes",
                "Bytes held by the rank: parameters, gradients, optimizer",
                &["rank", "state"],
            ),
            host_state_bytes: gauge(
                "regatta_train_host_state_bytes",
                "Of regatta_train_state_bytes, bytes in host memory (ZeRO-Offload): parameters, gradients, optimizer",
                &["rank", "state"],
            ),
            mfu: gauge("regatta_train_mfu", "Model FLOPs utilisation estimate (GPU)", &["rank"]),
            cuda_peak_bytes: gauge(
                "regatta_train_cuda_peak_bytes",
                "Most bytes the CUDA caching allocator allocated to tensors or reserved from the driver during the last step (GPU)",
                &["rank", "kind"],
            ),
            world_size: gauge("regatta_train_world_size", "Ranks in the rank's group", &["rank"]),
            rescales: gauge(
                "regatta_train_rescales",
                "Changes of the group's number of ranks during the run (elastic training)",
                &["rank"],
            ),
            checkpoints: counter("regatta_train_checkpoints_total", "Checkpoints committed, by rank"),
            skipped_rows: counter(
                "regatta_train_skipped_rows_total",
                "Dataset rows a rank skipped because they cannot be read (each is in the job log)",
            ),
        })
    }

    /// Records a rank's start: its group's size and the rescales before it.
    pub fn started(&self, rank: usize, world: usize, rescales: u32) {
        let r = rank.to_string();
        self.world_size.with_label_values(&[&r]).set(world as f64);
        self.rescales.with_label_values(&[&r]).set(f64::from(rescales));
        self.skipped_rows.with_label_values(&[&r]).inc_by(0);
    }

    /// Records what an executor reported.
    pub fn observe(&self, rank: usize, event: &FromExecutor) {
        let r = rank.to_string();
        match event {
            FromExecutor::Step(s) => {
                self.loss.with_label_values(&[&r]).set(s.loss);
                self.lr.with_label_values(&[&r]).set(s.lr);
                self.grad_norm.with_label_values(&[&r]).set(s.grad_norm);
                self.step.with_label_values(&[&r]).set(s.step as f64);
                self.step_seconds.with_label_values(&[&r]).set(s.step_secs);
                self.tokens_per_second.with_label_values(&[&r]).set(s.tokens_per_sec);
                self.collective_seconds.with_label_values(&[&r]).set(s.collective_secs);
                for (state, bytes) in [
                    ("parameters", s.param_bytes),
                    ("gradients", s.grad_bytes),
                    ("optimizer", s.optimizer_bytes),
                ] {
                    self.state_bytes.with_label_values(&[&r, state]).set(bytes as f64);
                }
                for (state, bytes) in [
                    ("parameters", s.host_param_bytes),
                    ("gradients", s.host_grad_bytes),
                    ("optimizer", s.host_optimizer_bytes),
                ] {
                    self.host_state_bytes.with_label_values(&[&r, state]).set(bytes as f64);
                }
                if let Some(mfu) = s.mfu {
                    self.mfu.with_label_values(&[&r]).set(mfu);
                }
                for (kind, bytes) in [
                    ("allocated", s.cuda_peak_allocated_bytes),
                    ("reserved", s.cuda_peak_reserved_bytes),
                ] {
                    if let Some(bytes) = bytes {
                        self.cuda_peak_bytes.with_label_values(&[&r, kind]).set(bytes as f64);
                    }
                }
            }
            FromExecutor::Eval(report) => self.eval_loss.with_label_values(&[&r]).set(report.loss),
            FromExecutor::Checkpoint { .. } => self.checkpoints.with_label_values(&[&r]).inc(),
            FromExecutor::Skipped { count, .. } => self.skipped_rows.with_label_values(&[&r]).inc_by(*count),
            _ => {}
        }
    }
}
