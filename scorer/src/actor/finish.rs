//! A partition's outcome written: the errors file first, then any OpenAI-format files,
//! then the output file under its final name, whose existence means the partition is done.

use std::time::Instant;

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_runtime::ActorError;

use super::metrics::metrics;
use super::{PartitionReport, PartitionTask};
use crate::error::{Error, Result};
use crate::partition::RowError;
use crate::plan::{errors_name, output_name};

/// A partition's output before it is written.
pub(super) struct Outcome {
    pub(super) rows: u64,
    pub(super) file: Bytes,
    /// Files written before the output file (OpenAI-format results), by name.
    pub(super) extra: Vec<(String, Bytes)>,
    pub(super) errors: Vec<RowError>,
    pub(super) tokens: u64,
    pub(super) output_tokens: u64,
}

/// Runs a partition's work and writes its output: the errors file first, then the output
/// file under its final name (its existence means the partition is done).
pub(super) async fn finish_partition(
    task: PartitionTask,
    node: String,
    work: impl std::future::Future<Output = Result<Outcome>>,
) -> std::result::Result<PartitionReport, ActorError> {
    let started = Instant::now();
    let m = metrics();
    if task.retry {
        m.partitions.with_label_values(&["retried"]).inc();
    }
    let outcome = async {
        let done = work.await?;
        let out = Place::dir(&task.output)?;
        if !done.errors.is_empty() {
            let mut text = String::new();
            for error in &done.errors {
                text.push_str(&serde_json::to_string(error).map_err(|e| Error::Output(e.to_string()))?);
                text.push('\n');
            }
            out.put(&errors_name(task.partition), Bytes::from(text)).await?;
        }
        for (name, bytes) in done.extra {
            out.put(&name, bytes).await?;
        }
        out.put(&output_name(task.partition), done.file).await?;
        m.rows.with_label_values(&["scored"]).inc_by(done.rows);
        m.rows
            .with_label_values(&["malformed"])
            .inc_by(done.errors.len() as u64);
        m.tokens.with_label_values(&[] as &[&str]).inc_by(done.tokens);
        Ok::<_, Error>(PartitionReport {
            partition: task.partition,
            rows: done.rows,
            errors: done.errors.len() as u64,
            tokens: done.tokens,
            output_tokens: done.output_tokens,
            seconds: started.elapsed().as_secs_f64(),
            node,
        })
    }
    .await;
    let label = if outcome.is_ok() { "done" } else { "failed" };
    m.partitions.with_label_values(&[label]).inc();
    outcome.map_err(ActorError::from)
}
