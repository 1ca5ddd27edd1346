//! Generating for a partition: its prompt rows read, each row's settings laid over the
//! run's, the rows sent to the executor in one tagged request (they join its running
//! batch), and the generations gathered into the partition's Parquet file (and OpenAI's
//! batch output and error files when the input is in OpenAI's batch format).

use bytes::Bytes;
use regatta_object_store::Place;

use super::finish::Outcome;
use super::link::Link;
use super::score::read_rows;
use super::{PartitionTask, Slice};
use crate::error::Result;
use crate::generate::openai::{self, Endpoint, OpenAiRow};
use crate::generate::{parse_prompt_row, GenRequest, Generation, Prompt, PromptRow, SamplingParams};
use crate::jsonl::read_owned_lines;
use crate::output::{generated_to_parquet, GeneratedRow};
use crate::partition::RowError;
use crate::plan::{openai_errors_name, openai_output_name};

/// Generates for a partition's rows: every row with valid settings goes to the executor
/// in one request, tagged with the partition, and joins its running batch; rows it cannot
/// run, and rows with bad settings, go to the errors file.
pub(super) async fn generate(link: &Link, task: &PartitionTask) -> Result<Outcome> {
    let (rows, mut errors, openai_lines) = read_prompt_rows(task).await?;
    let queued = queue(&link.sampling, rows, &mut errors);
    let results = if queued.requests.is_empty() {
        Vec::new()
    } else {
        link.generate(task.partition as u64, &queued.requests).await?
    };
    let mut written = Written::new(openai_lines.then_some(link.model_name.as_str()));
    for (((request, offset), meta), result) in queued
        .requests
        .into_iter()
        .zip(queued.offsets)
        .zip(queued.metas)
        .zip(results)
    {
        match result {
            Ok(generation) => written.push(request, meta, generation),
            Err(failure) => errors.push(RowError {
                id: Some(request.id),
                offset,
                reason: failure.message,
            }),
        }
    }
    let extra = written.openai_files(task.partition, &errors);
    Ok(Outcome {
        rows: written.rows.len() as u64,
        file: generated_to_parquet(&written.rows)?,
        extra,
        errors,
        tokens: written.prompt_tokens,
        output_tokens: written.output_tokens,
    })
}

/// A generating run's rows: JSONL lines with `prompt`, `text` or `messages` (and
/// `params`); Parquet rows' `text` as the prompt.
/// Also says whether any line is in OpenAI's batch input format (the partition's
/// results are then also written in OpenAI's batch output format).
async fn read_prompt_rows(task: &PartitionTask) -> Result<(Vec<(u64, PromptRow)>, Vec<RowError>, bool)> {
    match &task.slice {
        Slice::Bytes { start, end } => {
            let (place, name) = Place::file(&task.input)?;
            let size = place.size(&name).await?;
            let (mut rows, mut errors, mut openai_lines) = (Vec::new(), Vec::new(), false);
            for (offset, line) in read_owned_lines(&place, &name, size, *start..*end).await? {
                // A cheap look for OpenAI's key; the parse decides the row.
                openai_lines |= line.windows(11).any(|w| w == b"\"custom_id\"");
                match parse_prompt_row(&line, offset) {
                    Ok(row) => rows.push((offset, row)),
                    Err(error) => errors.push(error),
                }
            }
            Ok((rows, errors, openai_lines))
        }
        Slice::Rows(_) => {
            let (rows, errors) = read_rows(task).await?;
            let rows = rows
                .into_iter()
                .map(|(offset, row)| {
                    let prompt = PromptRow {
                        id: row.id,
                        prompt: Prompt::Text(row.text),
                        params: None,
                        openai: None,
                    };
                    (offset, prompt)
                })
                .collect();
            Ok((rows, errors, false))
        }
    }
}

/// A partition's rows whose settings are valid, in input order: what goes to the
/// executor, and each row's offset and OpenAI answer shape.
struct Queued {
    requests: Vec<GenRequest>,
    offsets: Vec<u64>,
    metas: Vec<Option<OpenAiRow>>,
}

/// Lays each row's `params` over the run's `sampling`; a row whose settings are bad goes
/// to `errors`.
fn queue(sampling: &SamplingParams, rows: Vec<(u64, PromptRow)>, errors: &mut Vec<RowError>) -> Queued {
    let mut queued = Queued {
        requests: Vec::with_capacity(rows.len()),
        offsets: Vec::with_capacity(rows.len()),
        metas: Vec::with_capacity(rows.len()),
    };
    for (offset, row) in rows {
        match sampling.with_overrides(row.params.as_ref()) {
            Ok(params) => {
                queued.offsets.push(offset);
                queued.metas.push(row.openai);
                queued.requests.push(GenRequest {
                    id: row.id,
                    prompt: row.prompt,
                    params,
                });
            }
            Err(error) => errors.push(RowError {
                id: Some(row.id),
                offset,
                reason: error.to_string(),
            }),
        }
    }
    queued
}

/// A partition's generations as they are gathered: Parquet rows, OpenAI batch output
/// lines (when the input is in OpenAI's format), and token counts.
struct Written<'a> {
    rows: Vec<GeneratedRow>,
    /// The model's name in OpenAI answers and the lines so far; `None`: not OpenAI input.
    openai: Option<(&'a str, String)>,
    /// When the answers were made, in seconds since the epoch (OpenAI's `created`).
    created: u64,
    prompt_tokens: u64,
    output_tokens: u64,
}

impl<'a> Written<'a> {
    /// Nothing gathered yet; `openai_model`: the model's name when OpenAI lines are written.
    fn new(openai_model: Option<&'a str>) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self {
            rows: Vec::new(),
            openai: openai_model.map(|model| (model, String::new())),
            created,
            prompt_tokens: 0,
            output_tokens: 0,
        }
    }

    /// Adds a row's generation (`meta`: how its OpenAI answer is shaped, when its line had
    /// one).
    fn push(&mut self, request: GenRequest, meta: Option<OpenAiRow>, g: Generation) {
        self.prompt_tokens += g.prompt_tokens;
        self.output_tokens += g.generated_tokens;
        if let Some((model, lines)) = &mut self.openai {
            let meta = meta.unwrap_or(OpenAiRow {
                endpoint: if matches!(request.prompt, Prompt::Chat(_)) {
                    Endpoint::Chat
                } else {
                    Endpoint::Completions
                },
                model: None,
            });
            let line = openai::output_line(
                &request.id,
                &meta,
                model,
                &g.text,
                &g.finish_reason,
                g.prompt_tokens,
                g.generated_tokens,
                self.created,
            );
            lines.push_str(&line.to_string());
            lines.push('\n');
        }
        self.rows.push(GeneratedRow {
            id: request.id,
            generated: g.text,
            prompt_tokens: g.prompt_tokens as i64,
            generated_tokens: g.generated_tokens as i64,
            finish_reason: g.finish_reason,
            token_logprobs: g.logprobs,
        });
    }

    /// OpenAI's batch error and output files of `partition` (none unless the input is in
    /// OpenAI's format), by name.
    fn openai_files(&mut self, partition: usize, errors: &[RowError]) -> Vec<(String, Bytes)> {
        let Some((_, lines)) = self.openai.take() else {
            return Vec::new();
        };
        let mut error_lines = String::new();
        for error in errors {
            error_lines.push_str(&openai::error_line(error).to_string());
            error_lines.push('\n');
        }
        vec![
            (openai_errors_name(partition), Bytes::from(error_lines)),
            (openai_output_name(partition), Bytes::from(lines)),
        ]
    }
}
