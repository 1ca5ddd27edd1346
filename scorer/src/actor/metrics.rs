//! The scorer's Prometheus metrics: rows, tokens, partitions and batch times, and the
//! generation figures (sequences, KV cache blocks, preemptions) summed over a node's
//! scorer actors.

use std::sync::OnceLock;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts};

use crate::generate::GenStats;

/// The scorer actors' Prometheus series (one set per process).
pub(super) struct Metrics {
    pub(super) rows: IntCounterVec,
    pub(super) tokens: IntCounterVec,
    pub(super) output_tokens: IntCounterVec,
    pub(super) partitions: IntCounterVec,
    pub(super) batch_seconds: HistogramVec,
    /// Generation figures summed over the process's scorer actors: each actor adds the
    /// change since its last report and takes its share back when it stops, so the series
    /// are one per node whatever the number of actors it ever hosted.
    pub(super) running: IntGauge,
    pub(super) waiting: IntGauge,
    pub(super) capacity: IntGauge,
    pub(super) kv_used: IntGauge,
    pub(super) kv_blocks: IntGauge,
    pub(super) preemptions: prometheus::IntCounter,
    pub(super) cached_tokens: prometheus::IntCounter,
}

impl Metrics {
    /// Applies the change from `before` to `after` of one actor's generation figures.
    pub(super) fn generation(&self, before: &GenStats, after: &GenStats) {
        let delta = |a: usize, b: usize| b as i64 - a as i64;
        self.running.add(delta(before.running, after.running));
        self.waiting.add(delta(before.waiting, after.waiting));
        self.capacity.add(delta(before.max_batch, after.max_batch));
        self.kv_used.add(delta(before.used_blocks, after.used_blocks));
        self.kv_blocks.add(delta(before.blocks, after.blocks));
        self.output_tokens
            .with_label_values(&[] as &[&str])
            .inc_by(after.new_tokens);
        self.preemptions
            .inc_by(after.preemptions.saturating_sub(before.preemptions));
        self.cached_tokens
            .inc_by(after.cached_tokens.saturating_sub(before.cached_tokens));
    }
}

/// The process's scorer metrics, registered on first use.
pub(super) fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let registry = regatta_runtime::metrics().registry();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            let _ = registry.register(Box::new(metric.clone()));
            metric
        };
        let batch_seconds = HistogramVec::new(
            HistogramOpts::new("regatta_score_batch_seconds", "Time to score one batch")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &[],
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(batch_seconds.clone()));
        let gauge = |name: &str, help: &str| {
            let metric = IntGauge::new(name, help).expect("valid metric");
            let _ = registry.register(Box::new(metric.clone()));
            metric
        };
        let plain_counter = |name: &str, help: &str| {
            let metric = prometheus::IntCounter::new(name, help).expect("valid metric");
            let _ = registry.register(Box::new(metric.clone()));
            metric
        };
        Metrics {
            output_tokens: counter("regatta_score_output_tokens_total", "Tokens generated", &[]),
            running: gauge(
                "regatta_score_running_sequences",
                "Sequences the node's scorers are decoding",
            ),
            waiting: gauge(
                "regatta_score_waiting_sequences",
                "Sequences waiting for a batch slot or KV cache blocks (the queue)",
            ),
            capacity: gauge(
                "regatta_score_batch_capacity",
                "Sequences the node's generating scorers may decode at once (their max_batch)",
            ),
            kv_used: gauge("regatta_score_kv_blocks_used", "KV cache blocks in use"),
            preemptions: plain_counter(
                "regatta_score_preemptions_total",
                "Sequences preempted for cache blocks (recomputed when they join again)",
            ),
            cached_tokens: plain_counter(
                "regatta_score_prefix_cached_tokens_total",
                "Tokens found in cached KV blocks when a row joined (a shared prefix, or a preempted row's own blocks)",
            ),
            kv_blocks: gauge(
                "regatta_score_kv_blocks",
                "KV cache blocks of the node's generating scorers",
            ),
            rows: counter(
                "regatta_score_rows_total",
                "Rows scored, and rows refused as malformed",
                &["outcome"],
            ),
            tokens: counter("regatta_score_tokens_total", "Tokens scored", &[]),
            partitions: counter(
                "regatta_score_partitions_total",
                "Partitions finished, failed, or started again after a failure or a lost actor",
                &["outcome"],
            ),
            batch_seconds,
        }
    })
}
