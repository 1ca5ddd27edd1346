//! Scoring a partition: its rows read, batched by length, scored by the executor batch
//! by batch, and the scores gathered into the partition's Parquet file.

use std::ops::Range;
use std::time::Instant;

use regatta_object_store::Place;

use super::finish::Outcome;
use super::link::{read_reply, send};
use super::metrics::metrics;
use super::{PartitionTask, ScorerActor, Slice};
use crate::error::{Error, Result};
use crate::jsonl::read_owned_lines;
use crate::output::{to_parquet, ScoredRow};
use crate::parquet_input::ParquetInput;
use crate::partition::{parse_row, Row, RowError};
use crate::plan::length_batches;
use crate::protocol::{FromScorer, ToScorer};

impl ScorerActor {
    async fn request(&mut self, message: &ToScorer) -> Result<FromScorer> {
        send(&self.stdin, message).await?;
        let stdout = self
            .stdout
            .as_mut()
            .ok_or_else(|| Error::Executor("this scorer generates; it cannot score batches".into()))?;
        read_reply(stdout).await
    }

    /// Scores a partition's rows in length-sorted batches.
    pub(super) async fn score(&mut self, task: &PartitionTask) -> Result<Outcome> {
        let m = metrics();
        let (rows, mut errors) = read_rows(task).await?;
        let (offsets, rows): (Vec<u64>, Vec<Row>) = rows.into_iter().unzip();
        let lengths: Vec<usize> = rows.iter().map(|r| r.text.len()).collect();
        let mut scored: Vec<Option<ScoredRow>> = vec![None; rows.len()];
        let mut tokens = 0u64;
        for batch in length_batches(&lengths, self.batch_size) {
            let request: Vec<(String, String)> = batch
                .iter()
                .map(|i| (rows[*i].id.clone(), rows[*i].text.clone()))
                .collect();
            let timer = Instant::now();
            let reply = self.request(&ToScorer::Batch(request)).await?;
            m.batch_seconds
                .with_label_values(&[] as &[&str])
                .observe(timer.elapsed().as_secs_f64());
            let FromScorer::Scored(results) = reply else {
                return Err(Error::Executor(format!(
                    "the scorer executor replied {reply:?} to a batch"
                )));
            };
            if results.len() != batch.len() {
                return Err(Error::Executor(format!(
                    "{} results for a batch of {}",
                    results.len(),
                    batch.len()
                )));
            }
            for (i, result) in batch.into_iter().zip(results) {
                match result {
                    Ok(score) => {
                        tokens += score.tokens;
                        scored[i] = Some(ScoredRow {
                            id: rows[i].id.clone(),
                            tokens: score.tokens as i64,
                            truncated: score.truncated,
                            log_likelihood: score.log_likelihood,
                            perplexity: score.perplexity,
                            generated: score.generated,
                        });
                    }
                    Err(failure) => errors.push(RowError {
                        id: Some(rows[i].id.clone()),
                        offset: offsets[i],
                        reason: failure.message,
                    }),
                }
            }
        }
        let scored: Vec<ScoredRow> = scored.into_iter().flatten().collect();
        Ok(Outcome {
            rows: scored.len() as u64,
            file: to_parquet(&scored)?,
            extra: Vec::new(),
            errors,
            tokens,
            output_tokens: 0,
        })
    }
}

/// A partition's rows (with their offsets) and the rows that could not be read.
pub(super) async fn read_rows(task: &PartitionTask) -> Result<(Vec<(u64, Row)>, Vec<RowError>)> {
    match &task.slice {
        Slice::Bytes { start, end } => read_lines(&task.input, *start..*end).await,
        Slice::Rows(rows) => ParquetInput::open(&task.input).await?.read(rows).await,
    }
}

async fn read_lines(input: &str, range: Range<u64>) -> Result<(Vec<(u64, Row)>, Vec<RowError>)> {
    let (place, name) = Place::file(input)?;
    let size = place.size(&name).await?;
    let (mut rows, mut errors) = (Vec::new(), Vec::new());
    for (offset, line) in read_owned_lines(&place, &name, size, range).await? {
        match parse_row(&line, offset) {
            Ok(row) => rows.push((offset, row)),
            Err(error) => errors.push(error),
        }
    }
    Ok((rows, errors))
}
