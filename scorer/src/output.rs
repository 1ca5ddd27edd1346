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
use parquet::record::RowAccessor;
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

#[cfg(test)]
mod tests {
    use super::*;

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
