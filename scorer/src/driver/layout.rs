//! What an output folder records about the run that writes it: `_plan.json` (the input,
//! model and partition layout, claimed before any partition is written, so a rerun only
//! skips partitions of the very same run) and `_manifest.json` (written once every
//! partition is settled).

use bytes::Bytes;
use regatta_object_store::Place;
use serde::{Deserialize, Serialize};

use super::{Progress, ScoreConfig};
use crate::actor::Slice;
use crate::error::{Error, Result};
use crate::generate::SamplingParams;

/// The manifest written at the end of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoreManifest {
    /// Input.
    pub input: String,
    /// Model.
    pub model: String,
    /// Partitions, each with its rows (a byte range or a row group's rows) and output file.
    pub partitions: Vec<(Slice, String)>,
    /// Rows scored by the last run (earlier runs' rows are in their files).
    pub rows_this_run: u64,
    /// Malformed rows found by the last run.
    pub errors_this_run: u64,
}

impl ScoreManifest {
    /// What a finished run of `config` over `slices` records.
    pub(super) fn of(config: &ScoreConfig, slices: &[(Slice, u64)], progress: &Progress) -> Self {
        Self {
            input: config.input.clone(),
            model: config.model_and_adapter(),
            partitions: slices
                .iter()
                .enumerate()
                .map(|(p, (slice, _))| (slice.clone(), crate::plan::output_name(p)))
                .collect(),
            rows_this_run: progress.rows,
            errors_this_run: progress.errors,
        }
    }

    /// Writes the manifest as `_manifest.json` in `output`.
    pub(super) async fn write(&self, output: &Place) -> Result<()> {
        let body = serde_json::to_vec_pretty(self)?;
        output.put(MANIFEST_FILE, Bytes::from(body)).await?;
        Ok(())
    }
}

/// Where a run records its layout in its output, before any partition is written.
const PLAN_FILE: &str = "_plan.json";
/// Where a finished run records its partitions.
const MANIFEST_FILE: &str = "_manifest.json";

/// What makes partition files of one run valid for another: the same input (and size),
/// model and partition layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct OutputLayout {
    input: String,
    input_bytes: u64,
    model: String,
    partitions: Vec<Slice>,
    /// The sampling settings of a generating run (absent when scoring).
    #[serde(default)]
    generation: Option<SamplingParams>,
}

impl OutputLayout {
    /// The layout of a run of `config` over `slices` of an input of `input_bytes`.
    pub(super) fn of(config: &ScoreConfig, slices: &[(Slice, u64)], input_bytes: u64) -> Self {
        Self {
            input: config.input.clone(),
            input_bytes,
            model: config.model_and_adapter(),
            partitions: slices.iter().map(|(slice, _)| slice.clone()).collect(),
            generation: config.generate.then(|| config.sampling()),
        }
    }

    /// What differs from `other`, in words; `None` when they match.
    fn difference(&self, other: &Self) -> Option<String> {
        if self.input != other.input || self.input_bytes != other.input_bytes {
            Some(format!(
                "input {} of {} bytes, not {} of {} bytes",
                self.input, self.input_bytes, other.input, other.input_bytes
            ))
        } else if self.model != other.model {
            Some(format!("model {}, not {}", self.model, other.model))
        } else if self.generation != other.generation {
            Some(format!(
                "generation settings {}, not {}",
                describe(&self.generation),
                describe(&other.generation)
            ))
        } else if self.partitions != other.partitions {
            Some(format!(
                "{} partitions laid out differently from these {}",
                self.partitions.len(),
                other.partitions.len()
            ))
        } else {
            None
        }
    }

    /// Makes sure the partition files already in `output` (named in `existing`) belong to
    /// this very run (same input, size, model and partitions), so a rerun that skips them
    /// loses and repeats no row; records the run's layout in `_plan.json` before any
    /// partition is written.
    pub(super) async fn claim(&self, output: &Place, existing: &[String]) -> Result<()> {
        match output.get_opt(PLAN_FILE).await? {
            Some(bytes) => {
                let earlier: OutputLayout = serde_json::from_slice(&bytes)
                    .map_err(|e| Error::Output(format!("{}/{PLAN_FILE} is not a scoring plan: {e}", output.url())))?;
                if let Some(difference) = earlier.difference(self) {
                    return Err(Error::Output(format!(
                        "{} holds the output of another run ({difference}); use a new output location, \
                         or rerun with the same input, model and partitions to finish it",
                        output.url()
                    )));
                }
                Ok(())
            }
            None if existing.iter().any(|name| crate::plan::partition_of(name).is_some()) => {
                Err(Error::Output(format!(
                    "{} already holds partition files but no {PLAN_FILE}; use an empty output location",
                    output.url()
                )))
            }
            None => {
                let body = serde_json::to_vec_pretty(self)?;
                output.put(PLAN_FILE, Bytes::from(body)).await.map_err(Error::from)
            }
        }
    }
}

fn describe(generation: &Option<SamplingParams>) -> String {
    match generation {
        Some(params) => serde_json::to_string(params).unwrap_or_default(),
        None => "none (scoring)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_belongs_to_one_input_model_and_layout() {
        let layout = |input: &str, bytes: u64, model: &str, parts: u64| OutputLayout {
            input: input.into(),
            input_bytes: bytes,
            model: model.into(),
            partitions: (0..parts).map(|p| Slice::Bytes { start: p, end: p + 1 }).collect(),
            generation: None,
        };
        let run = layout("/d/rows.jsonl", 4, "/ckpt", 4);
        assert_eq!(run.difference(&run.clone()), None);
        let grown = run.difference(&layout("/d/rows.jsonl", 5, "/ckpt", 4)).unwrap();
        assert!(grown.contains("of 4 bytes, not /d/rows.jsonl of 5 bytes"), "{grown}");
        assert!(run
            .difference(&layout("/d/rows.jsonl", 4, "/other", 4))
            .unwrap()
            .contains("model"));
        assert!(run
            .difference(&layout("/d/rows.jsonl", 4, "/ckpt", 3))
            .unwrap()
            .contains("4 partitions laid out differently from these 3"));
        let generating = OutputLayout {
            generation: Some(SamplingParams::default()),
            ..run.clone()
        };
        assert!(run
            .difference(&generating)
            .unwrap()
            .contains("generation settings none (scoring)"));
    }
}
