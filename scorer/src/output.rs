//! A partition's output: one Parquet file of scored rows (written whole, then put under
//! its final name, so a reader sees all of it or nothing) and a JSONL file of the rows
//! that could not be scored. Written with parquet's own column writers (no Arrow).

use crate::error::{Error, Result};
use std::sync::Arc;

use bytes::Bytes;
use parquet::basic::Compression;
use parquet::data_type::{BoolType, ByteArray, ByteArrayType, DoubleType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::file::writer::SerializedFileWriter;
use parquet::record::{ListAccessor, RowAccessor};
use parquet::schema::parser::parse_message_type;
use serde::{Deserialize, Serialize};

/// One row of output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoredRow {
    /// The input row's id.
    pub id: String,
    /// Tokens scored.
    pub tokens: i64,
    /// Whether the text was cut to the model's context.
    pub truncated: bool,
    /// Sum of token log-probabilities after the first.
    pub log_likelihood: f64,
    /// Per-token perplexity.
    pub perplexity: f64,
    /// Greedy continuation.
    pub generated: String,
}

const SCHEMA: &str = "message scored {
    REQUIRED BYTE_ARRAY id (UTF8);
    REQUIRED INT64 tokens;
    REQUIRED BOOLEAN truncated;
    REQUIRED DOUBLE log_likelihood;
    REQUIRED DOUBLE perplexity;
    REQUIRED BYTE_ARRAY generated (UTF8);
}";

fn text_column(rows: &[ScoredRow], pick: fn(&ScoredRow) -> &str) -> Vec<ByteArray> {
    rows.iter()
        .map(|r| ByteArray::from(pick(r).as_bytes().to_vec()))
        .collect()
}

/// The rows as a Parquet file (one row group, snappy).
pub fn to_parquet(rows: &[ScoredRow]) -> Result<Bytes> {
    let schema = Arc::new(parse_message_type(SCHEMA).map_err(|e| Error::Output(e.to_string()))?);
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let mut out = Vec::new();
    let mut writer = SerializedFileWriter::new(&mut out, schema, props).map_err(|e| Error::Output(e.to_string()))?;
    let mut group = writer.next_row_group().map_err(|e| Error::Output(e.to_string()))?;
    let mut index = 0;
    while let Some(mut column) = group.next_column().map_err(|e| Error::Output(e.to_string()))? {
        let written = match index {
            0 => column
                .typed::<ByteArrayType>()
                .write_batch(&text_column(rows, |r| &r.id), None, None),
            1 => {
                column
                    .typed::<Int64Type>()
                    .write_batch(&rows.iter().map(|r| r.tokens).collect::<Vec<_>>(), None, None)
            }
            2 => column.typed::<BoolType>().write_batch(
                &rows.iter().map(|r| r.truncated).collect::<Vec<_>>(),
                None,
                None,
            ),
            3 => column.typed::<DoubleType>().write_batch(
                &rows.iter().map(|r| r.log_likelihood).collect::<Vec<_>>(),
                None,
                None,
            ),
            4 => column.typed::<DoubleType>().write_batch(
                &rows.iter().map(|r| r.perplexity).collect::<Vec<_>>(),
                None,
                None,
            ),
            _ => column
                .typed::<ByteArrayType>()
                .write_batch(&text_column(rows, |r| &r.generated), None, None),
        };
        written.map_err(|e| Error::Output(e.to_string()))?;
        column.close().map_err(|e| Error::Output(e.to_string()))?;
        index += 1;
    }
    group.close().map_err(|e| Error::Output(e.to_string()))?;
    writer.close().map_err(|e| Error::Output(e.to_string()))?;
    Ok(Bytes::from(out))
}

/// Rows back from a file written by [`to_parquet`].
pub fn from_parquet(bytes: Bytes) -> Result<Vec<ScoredRow>> {
    let reader = SerializedFileReader::new(bytes).map_err(|e| Error::Output(format!("not a Parquet file: {e}")))?;
    let mut rows = Vec::new();
    for row in reader.get_row_iter(None).map_err(|e| Error::Output(e.to_string()))? {
        let row = row.map_err(|e| Error::Output(e.to_string()))?;
        let field = |e: parquet::errors::ParquetError| Error::Output(format!("unexpected column: {e}"));
        rows.push(ScoredRow {
            id: row.get_string(0).map_err(field)?.clone(),
            tokens: row.get_long(1).map_err(field)?,
            truncated: row.get_bool(2).map_err(field)?,
            log_likelihood: row.get_double(3).map_err(field)?,
            perplexity: row.get_double(4).map_err(field)?,
            generated: row.get_string(5).map_err(field)?.clone(),
        });
    }
    Ok(rows)
}

/// One row of a generating run's output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GeneratedRow {
    /// The input row's id.
    pub id: String,
    /// The generated text.
    pub generated: String,
    /// Tokens in the prompt.
    pub prompt_tokens: i64,
    /// Tokens generated.
    pub generated_tokens: i64,
    /// `stop`, `length` or `eos`.
    pub finish_reason: String,
    /// Each generated token's log-probability, when asked for (a Parquet list column).
    pub token_logprobs: Option<Vec<f64>>,
}

const GENERATED_SCHEMA: &str = "message generated {
    REQUIRED BYTE_ARRAY id (UTF8);
    REQUIRED BYTE_ARRAY generated (UTF8);
    REQUIRED INT64 prompt_tokens;
    REQUIRED INT64 generated_tokens;
    REQUIRED BYTE_ARRAY finish_reason (UTF8);
    OPTIONAL group token_logprobs (LIST) {
        REPEATED group list {
            REQUIRED DOUBLE element;
        }
    }
}";

/// The values and the definition and repetition levels of the `token_logprobs` list
/// column (0: no list, 1: an empty list, 2: an element).
fn logprob_levels(rows: &[GeneratedRow]) -> (Vec<f64>, Vec<i16>, Vec<i16>) {
    let (mut values, mut def, mut rep) = (Vec::new(), Vec::new(), Vec::new());
    for row in rows {
        match &row.token_logprobs {
            None => {
                def.push(0);
                rep.push(0);
            }
            Some(list) if list.is_empty() => {
                def.push(1);
                rep.push(0);
            }
            Some(list) => {
                for (i, value) in list.iter().enumerate() {
                    values.push(*value);
                    def.push(2);
                    rep.push(i16::from(i > 0));
                }
            }
        }
    }
    (values, def, rep)
}

/// A generating run's rows as a Parquet file (one row group, snappy).
pub fn generated_to_parquet(rows: &[GeneratedRow]) -> Result<Bytes> {
    let schema = Arc::new(parse_message_type(GENERATED_SCHEMA).map_err(|e| Error::Output(e.to_string()))?);
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let mut out = Vec::new();
    let mut writer = SerializedFileWriter::new(&mut out, schema, props)?;
    let mut group = writer.next_row_group()?;
    let mut index = 0;
    while let Some(mut column) = group.next_column()? {
        let ints = |pick: fn(&GeneratedRow) -> i64| rows.iter().map(pick).collect::<Vec<_>>();
        match index {
            0 => column
                .typed::<ByteArrayType>()
                .write_batch(&text_column_of(rows, |r| &r.id), None, None)?,
            1 => column
                .typed::<ByteArrayType>()
                .write_batch(&text_column_of(rows, |r| &r.generated), None, None)?,
            2 => column
                .typed::<Int64Type>()
                .write_batch(&ints(|r| r.prompt_tokens), None, None)?,
            3 => column
                .typed::<Int64Type>()
                .write_batch(&ints(|r| r.generated_tokens), None, None)?,
            4 => {
                column
                    .typed::<ByteArrayType>()
                    .write_batch(&text_column_of(rows, |r| &r.finish_reason), None, None)?
            }
            _ => {
                let (values, def, rep) = logprob_levels(rows);
                column
                    .typed::<DoubleType>()
                    .write_batch(&values, Some(&def), Some(&rep))?
            }
        };
        column.close()?;
        index += 1;
    }
    group.close()?;
    writer.close()?;
    Ok(Bytes::from(out))
}

fn text_column_of(rows: &[GeneratedRow], pick: fn(&GeneratedRow) -> &str) -> Vec<ByteArray> {
    rows.iter()
        .map(|r| ByteArray::from(pick(r).as_bytes().to_vec()))
        .collect()
}

/// Rows back from a file written by [`generated_to_parquet`].
pub fn generated_from_parquet(bytes: Bytes) -> Result<Vec<GeneratedRow>> {
    let reader = SerializedFileReader::new(bytes).map_err(|e| Error::Output(format!("not a Parquet file: {e}")))?;
    let mut rows = Vec::new();
    for row in reader.get_row_iter(None)? {
        let row = row?;
        let field = |e: parquet::errors::ParquetError| Error::Output(format!("unexpected column: {e}"));
        let token_logprobs = match row.get_list(5) {
            Ok(list) => Some(
                (0..list.len())
                    .map(|i| list.get_double(i))
                    .collect::<std::result::Result<Vec<f64>, _>>()
                    .map_err(field)?,
            ),
            Err(_) => None,
        };
        rows.push(GeneratedRow {
            id: row.get_string(0).map_err(field)?.clone(),
            generated: row.get_string(1).map_err(field)?.clone(),
            prompt_tokens: row.get_long(2).map_err(field)?,
            generated_tokens: row.get_long(3).map_err(field)?,
            finish_reason: row.get_string(4).map_err(field)?.clone(),
            token_logprobs,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_rows_round_trip_with_and_without_logprobs() {
        let rows: Vec<GeneratedRow> = (0..300)
            .map(|i| GeneratedRow {
                id: format!("g-{i}"),
                generated: "ü".repeat(i % 4),
                prompt_tokens: i as i64,
                generated_tokens: (i % 9) as i64,
                finish_reason: ["stop", "length", "eos"][i % 3].into(),
                token_logprobs: match i % 3 {
                    0 => None,
                    1 => Some(Vec::new()),
                    _ => Some((0..i % 9).map(|t| -(t as f64) * 0.25).collect()),
                },
            })
            .collect();
        let bytes = generated_to_parquet(&rows).unwrap();
        assert_eq!(generated_from_parquet(bytes).unwrap(), rows);
        assert!(generated_from_parquet(generated_to_parquet(&[]).unwrap())
            .unwrap()
            .is_empty());
    }

    #[test]
    fn rows_round_trip_through_parquet() {
        let rows: Vec<ScoredRow> = (0..1000)
            .map(|i| ScoredRow {
                id: format!("row-{i}"),
                tokens: i,
                truncated: i % 7 == 0,
                log_likelihood: -(i as f64) * 0.5,
                perplexity: 1.0 + i as f64,
                generated: "é".repeat((i % 5) as usize),
            })
            .collect();
        let bytes = to_parquet(&rows).unwrap();
        assert_eq!(&bytes[..4], b"PAR1");
        assert_eq!(from_parquet(bytes).unwrap(), rows);
        assert!(from_parquet(Bytes::from_static(b"not parquet"))
            .unwrap_err()
            .to_string()
            .contains("not a Parquet file"));
        assert!(from_parquet(to_parquet(&[]).unwrap()).unwrap().is_empty());
    }
}
