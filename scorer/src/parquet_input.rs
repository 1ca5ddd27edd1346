//! Parquet input: a dataset of `id` and `text` columns, partitioned by row group (row
//! groups are split into row ranges when there are fewer of them than partitions wanted).
//! Only the footer and the column chunks of a partition's row group are fetched, through
//! ranged reads of any object_store location. The slicing arithmetic is pure.

use crate::error::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::errors::ParquetError;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use parquet::file::properties::{ReaderProperties, WriterProperties};
use parquet::file::reader::{ChunkReader, Length, RowGroupReader};
use parquet::file::serialized_reader::SerializedRowGroupReader;
use parquet::file::writer::SerializedFileWriter;
use parquet::record::Field;
use parquet::schema::parser::parse_message_type;
use regatta_object_store::Place;
use serde::{Deserialize, Serialize};

use crate::partition::{Row, RowError};

/// Rows `rows` of row group `group` (row numbers inside the group).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowSlice {
    /// The row group.
    pub group: usize,
    /// Rows of the group.
    pub rows: Range<u64>,
}

/// Slices covering row groups of `group_rows` rows each: one per row group when there are
/// at least `target` groups, else each group cut into equal row ranges so that there are
/// at least `target` slices (never an empty slice).
pub fn row_slices(group_rows: &[u64], target: usize) -> Vec<RowSlice> {
    let groups = group_rows.iter().filter(|n| **n > 0).count().max(1);
    let cuts = target.max(1).div_ceil(groups) as u64;
    let mut slices = Vec::new();
    for (group, &rows) in group_rows.iter().enumerate() {
        let n = cuts.min(rows);
        if n == 0 {
            continue;
        }
        let (base, extra) = (rows / n, rows % n);
        let mut start = 0;
        for i in 0..n {
            let len = base + u64::from(i < extra);
            slices.push(RowSlice {
                group,
                rows: start..start + len,
            });
            start += len;
        }
    }
    slices
}

/// Whether an input location names a Parquet file (by its extension).
pub fn is_parquet(input: &str) -> bool {
    let name = input.rsplit('/').next().unwrap_or(input);
    name.to_ascii_lowercase().ends_with(".parquet")
}

/// Byte ranges of one file held in memory, read by parquet as if it were the whole file.
struct Pieces {
    size: u64,
    pieces: Vec<(u64, Bytes)>,
}

impl Pieces {
    fn find(&self, start: u64, length: u64) -> parquet::errors::Result<Bytes> {
        for (offset, bytes) in &self.pieces {
            let end = offset + bytes.len() as u64;
            if *offset <= start && start + length <= end {
                let from = (start - offset) as usize;
                return Ok(bytes.slice(from..from + length as usize));
            }
        }
        Err(ParquetError::General(format!(
            "bytes {start}..{} were not fetched",
            start + length
        )))
    }
}

impl Length for Pieces {
    fn len(&self) -> u64 {
        self.size
    }
}

impl ChunkReader for Pieces {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        let (offset, bytes) = self
            .pieces
            .iter()
            .find(|(offset, bytes)| *offset <= start && start < offset + bytes.len() as u64)
            .ok_or_else(|| ParquetError::General(format!("byte {start} was not fetched")))?;
        Ok(bytes.slice((start - offset) as usize..).reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.find(start, length as u64)
    }
}

/// A Parquet input opened through its footer (parsed once): the row groups' sizes and,
/// once a slice's row group is fetched, its rows.
pub struct ParquetInput {
    place: Place,
    name: String,
    url: String,
    size: u64,
    metadata: ParquetMetaData,
    group_rows: Vec<u64>,
    id_column: usize,
    text_column: usize,
}

impl ParquetInput {
    /// Reads the footer of `input` (path or URL) and checks it has `id` and `text` columns.
    pub async fn open(input: &str) -> Result<Self> {
        let (place, name) = Place::file(input)?;
        let size = place.size(&name).await?;
        let not_parquet = |why: String| Error::Input(format!("{input} is not a readable Parquet file: {why}"));
        if size < 12 {
            return Err(not_parquet(format!("{size} bytes")));
        }
        let tail_start = size.saturating_sub(64 << 10);
        let mut tail = place.get_range(&name, tail_start..size).await?;
        if &tail[tail.len() - 4..] != b"PAR1" {
            return Err(not_parquet("no PAR1 footer magic".into()));
        }
        let len_bytes: [u8; 4] = tail[tail.len() - 8..tail.len() - 4]
            .try_into()
            .expect("a 4-byte slice converts to [u8; 4]");
        let footer = u64::from(u32::from_le_bytes(len_bytes)) + 8;
        if footer > size {
            return Err(not_parquet(format!("a footer of {footer} bytes in a file of {size}")));
        }
        let mut tail_offset = tail_start;
        if footer > tail.len() as u64 {
            tail_offset = size - footer;
            tail = place.get_range(&name, tail_offset..size).await?;
        }
        let pieces = Pieces {
            size,
            pieces: vec![(tail_offset, tail)],
        };
        let metadata = ParquetMetaDataReader::new()
            .parse_and_finish(&pieces)
            .map_err(|e| not_parquet(e.to_string()))?;
        let columns: Vec<String> = metadata
            .file_metadata()
            .schema_descr()
            .columns()
            .iter()
            .map(|c| c.path().string())
            .collect();
        let column = |wanted: &str| {
            columns.iter().position(|c| c == wanted).ok_or_else(|| {
                Error::Input(format!(
                    "{input} has no `{wanted}` column (its columns: {}); Parquet input needs `id` and `text`",
                    columns.join(", ")
                ))
            })
        };
        let (id_column, text_column) = (column("id")?, column("text")?);
        let group_rows = metadata
            .row_groups()
            .iter()
            .map(|g| u64::try_from(g.num_rows()).unwrap_or(0))
            .collect();
        Ok(Self {
            place,
            name,
            url: input.to_string(),
            size,
            metadata,
            group_rows,
            id_column,
            text_column,
        })
    }

    /// Rows per row group.
    pub fn group_rows(&self) -> &[u64] {
        &self.group_rows
    }

    /// Rows in the file.
    pub fn rows(&self) -> u64 {
        self.group_rows.iter().sum()
    }

    /// The file's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The rows of `slice`, each with its row number in the file, and the rows that cannot
    /// be scored (the error's `offset` is the row number).
    pub async fn read(&self, slice: &RowSlice) -> Result<(Vec<(u64, Row)>, Vec<RowError>)> {
        let rows_in_group = *self.group_rows.get(slice.group).ok_or_else(|| {
            Error::Input(format!(
                "{} has {} row groups, not {}",
                self.url,
                self.group_rows.len(),
                slice.group + 1
            ))
        })?;
        let group = self.metadata.row_group(slice.group);
        let column_range = |column: usize| {
            let (start, len) = group.column(column).byte_range();
            start..start.saturating_add(len)
        };
        let (id, text) = (column_range(self.id_column), column_range(self.text_column));
        let span = id.start.min(text.start)..id.end.max(text.end);
        if span.end > self.size {
            return Err(Error::Input(format!(
                "{}: row group {} runs past the end of the file",
                self.url, slice.group
            )));
        }
        let data = self.place.get_range(&self.name, span.clone()).await?;
        let pieces = Pieces {
            size: self.size,
            pieces: vec![(span.start, data)],
        };
        let in_group = |e: ParquetError| Error::Input(format!("{}: row group {}: {e}", self.url, slice.group));
        let reader = SerializedRowGroupReader::new(
            Arc::new(pieces),
            group,
            None,
            Arc::new(ReaderProperties::builder().build()),
        )
        .map_err(in_group)?;
        let iter = reader.get_row_iter(Some(self.projection()?)).map_err(in_group)?;
        let first_row: u64 = self.group_rows[..slice.group].iter().sum();
        let take = slice.rows.end.min(rows_in_group).saturating_sub(slice.rows.start);
        let (mut rows, mut errors) = (Vec::new(), Vec::new());
        for (i, row) in iter.skip(slice.rows.start as usize).take(take as usize).enumerate() {
            let number = first_row + slice.rows.start + i as u64;
            let row = row.map_err(|e| Error::Input(format!("{}: row {number}: {e}", self.url)))?;
            let mut fields = row.get_column_iter();
            let (Some((_, id)), Some((_, text))) = (fields.next(), fields.next()) else {
                return Err(Error::Input(format!(
                    "{}: row {number} lacks the id or text column",
                    self.url
                )));
            };
            match parse_fields(id, text, number) {
                Ok(row) => rows.push((number, row)),
                Err(error) => errors.push(error),
            }
        }
        Ok((rows, errors))
    }

    /// The schema of just the `id` and `text` columns, in that order.
    fn projection(&self) -> Result<parquet::schema::types::Type> {
        let schema = self.metadata.file_metadata().schema_descr();
        let fields = [self.id_column, self.text_column]
            .iter()
            .map(|c| schema.get_column_root_ptr(*c))
            .collect();
        // Parquet accepts a projection only under the root's own name.
        parquet::schema::types::Type::group_type_builder(schema.root_schema().name())
            .with_fields(fields)
            .build()
            .map_err(|e| Error::Input(format!("{}: {e}", self.url)))
    }
}

/// One row from its `id` and `text` fields.
fn parse_fields(id: &Field, text: &Field, number: u64) -> std::result::Result<Row, RowError> {
    let fail = |id: Option<String>, reason: String| RowError {
        id,
        offset: number,
        reason,
    };
    let id = match id {
        Field::Str(s) if !s.is_empty() => s.clone(),
        Field::Byte(n) => n.to_string(),
        Field::Short(n) => n.to_string(),
        Field::Int(n) => n.to_string(),
        Field::Long(n) => n.to_string(),
        Field::UByte(n) => n.to_string(),
        Field::UShort(n) => n.to_string(),
        Field::UInt(n) => n.to_string(),
        Field::ULong(n) => n.to_string(),
        Field::Null => return Err(fail(None, "`id` is null".into())),
        other => {
            return Err(fail(
                None,
                format!("`id` must be a non-empty string or an integer, not {other}"),
            ))
        }
    };
    match text {
        Field::Str(text) if !text.is_empty() => Ok(Row { id, text: text.clone() }),
        Field::Str(_) => Err(fail(Some(id), "`text` is empty".into())),
        Field::Null => Err(fail(Some(id), "`text` is null".into())),
        other => Err(fail(Some(id), format!("`text` must be a string, not {other}"))),
    }
}

/// A Parquet dataset of `(id, text)` rows (`text` may be null), `group_rows` rows per row
/// group: for tests, benchmarks and users who want to try Parquet input.
pub fn rows_to_parquet(rows: &[(String, Option<String>)], group_rows: usize) -> Result<Bytes> {
    let schema =
        parse_message_type("message rows { REQUIRED BYTE_ARRAY id (UTF8); OPTIONAL BYTE_ARRAY text (UTF8); }")?;
    let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
    let mut out = Vec::new();
    let mut writer = SerializedFileWriter::new(&mut out, schema.into(), props.into())?;
    for chunk in rows.chunks(group_rows.max(1)) {
        let mut group = writer.next_row_group()?;
        let ids: Vec<ByteArray> = chunk.iter().map(|(id, _)| ByteArray::from(id.as_str())).collect();
        let texts: Vec<ByteArray> = chunk
            .iter()
            .filter_map(|(_, t)| t.as_deref().map(ByteArray::from))
            .collect();
        let levels: Vec<i16> = chunk.iter().map(|(_, t)| i16::from(t.is_some())).collect();
        let mut column = group
            .next_column()?
            .ok_or_else(|| Error::Output("no id column".into()))?;
        column.typed::<ByteArrayType>().write_batch(&ids, None, None)?;
        column.close()?;
        let mut column = group
            .next_column()?
            .ok_or_else(|| Error::Output("no text column".into()))?;
        column
            .typed::<ByteArrayType>()
            .write_batch(&texts, Some(&levels), None)?;
        column.close()?;
        group.close()?;
    }
    writer.close()?;
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    #[test]
    fn slices_cover_every_row_once() {
        for groups in [vec![10u64], vec![3, 0, 7, 100], vec![1, 1, 1, 1, 1], vec![]] {
            for target in 1..12 {
                let slices = row_slices(&groups, target);
                for (g, &rows) in groups.iter().enumerate() {
                    let mut covered = 0;
                    for s in slices.iter().filter(|s| s.group == g) {
                        assert_eq!(s.rows.start, covered, "{groups:?} {target}");
                        assert!(!s.rows.is_empty());
                        covered = s.rows.end;
                    }
                    assert_eq!(covered, rows, "{groups:?} target {target}");
                }
                let total: u64 = groups.iter().sum();
                let wanted = (target as u64).min(total) as usize;
                assert!(slices.len() >= wanted, "{groups:?} target {target}: {slices:?}");
            }
        }
    }

    #[test]
    fn many_row_groups_are_one_slice_each() {
        let slices = row_slices(&[5; 8], 4);
        assert_eq!(slices.len(), 8);
        assert!(slices.iter().all(|s| s.rows == (0..5)));
    }

    #[test]
    fn parquet_names() {
        assert!(is_parquet("s3://b/data/rows.parquet"));
        assert!(is_parquet("/tmp/ROWS.PARQUET"));
        assert!(!is_parquet("/tmp/rows.jsonl"));
    }

    #[test]
    fn fields_parse_or_say_why_not() {
        let s = |t: &str| Field::Str(t.to_string());
        assert_eq!(
            parse_fields(&Field::Long(7), &s("hi"), 3).unwrap(),
            Row {
                id: "7".into(),
                text: "hi".into()
            }
        );
        let err = parse_fields(&s("a"), &Field::Null, 9).unwrap_err();
        assert_eq!((err.id.as_deref(), err.offset), (Some("a"), 9));
        assert!(err.reason.contains("null"));
        assert!(parse_fields(&Field::Null, &s("x"), 0)
            .unwrap_err()
            .reason
            .contains("`id` is null"));
        assert!(parse_fields(&s("a"), &Field::Int(1), 0)
            .unwrap_err()
            .reason
            .contains("must be a string"));
    }

    #[test]
    fn pieces_serve_only_what_was_fetched() {
        let pieces = Pieces {
            size: 100,
            pieces: vec![(10, Bytes::from_static(b"abcdef")), (90, Bytes::from(vec![1u8; 10]))],
        };
        assert_eq!(&pieces.get_bytes(12, 3).unwrap()[..], b"cde");
        let mut rest = Vec::new();
        pieces.get_read(14).unwrap().read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"ef");
        assert!(pieces.get_bytes(14, 5).is_err());
        assert!(pieces.get_read(50).is_err());
    }
}
