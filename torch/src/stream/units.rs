//! The rows of one unit (a byte range of plain JSONL, a whole compressed JSONL file or a
//! Parquet row group) from a cursor: each with its offset, the next row's offset and its
//! JSON, or why it cannot be used.

use std::io::{BufRead, BufReader, Read};
use std::ops::Range;

use regatta_trainer::stream::{Compression, FileEntry, Part, SourceCursor, Unit};

use super::remote::{is_storage_failure, RangedRead, Remote, LINE_BUFFER, READ_BYTES};

/// A row as read: where it starts, where the next starts, its JSON or why it is unusable.
pub(super) struct RawRow {
    pub(super) offset: u64,
    pub(super) next: u64,
    pub(super) row: std::result::Result<serde_json::Value, BadRow>,
}

/// Why a row cannot be trained on: it is skipped and reported, the others go on.
#[derive(Debug, thiserror::Error)]
pub(super) enum BadRow {
    /// The line is not JSON.
    #[error("is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The JSON is not a row the trainer reads (the trainer's reason).
    #[error(transparent)]
    Record(regatta_trainer::DocumentError),
}

/// What a unit yields next.
pub(super) enum Next {
    Row(RawRow),
    /// The unit's bytes cannot be read from `offset` on (the rest of it is skipped), or,
    /// `storage`, could not be fetched (the rank fails and restarts).
    Broken {
        offset: u64,
        reason: String,
        storage: bool,
    },
    End,
}

/// The rows of one unit, from a cursor.
pub(super) enum UnitRows {
    Lines {
        reader: Box<dyn BufRead + Send>,
        pos: u64,
        end: u64,
    },
    Parquet {
        rows: parquet::record::reader::RowIter<'static>,
        next: u64,
    },
    /// The unit cannot be opened: reported once, then done.
    Failed {
        offset: u64,
        reason: String,
        storage: bool,
    },
    Done,
}

fn parse_line(line: &[u8]) -> std::result::Result<serde_json::Value, BadRow> {
    Ok(serde_json::from_slice(line)?)
}

fn parquet_storage_failure(error: &parquet::errors::ParquetError) -> bool {
    match error {
        parquet::errors::ParquetError::External(inner) => {
            inner.downcast_ref::<std::io::Error>().is_some_and(is_storage_failure)
        }
        _ => false,
    }
}

impl UnitRows {
    pub(super) fn open(remote: Remote, file: &FileEntry, unit: Unit, cursor: &SourceCursor) -> Self {
        let resume = cursor.docs > 0;
        match (unit.part, file.compression) {
            (Part::Bytes { start, end }, _) => Self::open_range(remote, start..end, resume.then_some(cursor.offset)),
            (Part::Whole, compression) => Self::open_whole(remote, compression, resume.then_some(cursor.offset)),
            (Part::RowGroup(group), _) => Self::open_row_group(remote, group, resume.then_some(cursor.offset)),
        }
    }

    /// The lines of a byte range of plain JSONL: from `resume` (the next line's offset),
    /// or from the first line starting in the range.
    fn open_range(remote: Remote, range: Range<u64>, resume: Option<u64>) -> Self {
        let Range { start, end } = range;
        let from = resume.unwrap_or(start.saturating_sub(1));
        let first = (end.saturating_sub(from) + (64 << 10)).min(READ_BYTES);
        let read = RangedRead::new(remote, from, first, end);
        let mut reader: Box<dyn BufRead + Send> = Box::new(BufReader::with_capacity(LINE_BUFFER, read));
        let mut pos = from;
        if resume.is_none() && start > 0 {
            // The line in progress at `start` belongs to the unit before.
            let mut skipped = Vec::new();
            match reader.read_until(b'\n', &mut skipped) {
                Ok(n) => pos += n as u64,
                Err(e) => return Self::failed(from, &e),
            }
        }
        Self::Lines { reader, pos, end }
    }

    /// The lines of a whole (possibly compressed) JSONL file, from `resume` (the next
    /// line's offset in the decompressed stream) or its start.
    fn open_whole(remote: Remote, compression: Compression, resume: Option<u64>) -> Self {
        let size = remote.size;
        let read = RangedRead::new(remote, 0, READ_BYTES, size);
        let decoded: Box<dyn Read + Send> = match compression {
            Compression::Zstd => match zstd::stream::read::Decoder::new(read) {
                Ok(d) => Box::new(d),
                Err(e) => return Self::failed(0, &e),
            },
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(read)),
            Compression::None => Box::new(read),
        };
        let mut reader: Box<dyn BufRead + Send> = Box::new(BufReader::with_capacity(LINE_BUFFER, decoded));
        let mut pos = 0;
        if let Some(offset) = resume {
            // Compressed streams are entered from the start: skip what was read.
            let mut skip = std::io::Read::take(&mut reader, offset);
            match std::io::copy(&mut skip, &mut std::io::sink()) {
                Ok(n) => pos = n,
                Err(e) => return Self::failed(0, &e),
            }
        }
        Self::Lines {
            reader,
            pos,
            end: u64::MAX,
        }
    }

    /// The rows of one Parquet row group, from `resume` (the next row's index) or its first.
    fn open_row_group(remote: Remote, group: u32, resume: Option<u64>) -> Self {
        use parquet::file::serialized_reader::{ReadOptionsBuilder, SerializedFileReader};
        let options = ReadOptionsBuilder::new()
            .with_predicate(Box::new(move |_, i| i == group as usize))
            .build();
        match SerializedFileReader::new_with_options(remote, options) {
            Ok(reader) => {
                let skip = resume.unwrap_or(0);
                let mut rows = parquet::record::reader::RowIter::from_file_into(Box::new(reader));
                for _ in 0..skip {
                    if rows.next().is_none() {
                        break;
                    }
                }
                Self::Parquet { rows, next: skip }
            }
            Err(e) => Self::Failed {
                offset: 0,
                storage: parquet_storage_failure(&e),
                reason: format!("row group {group}: {e}"),
            },
        }
    }

    /// A unit whose opening read failed at `offset`.
    fn failed(offset: u64, error: &std::io::Error) -> Self {
        Self::Failed {
            offset,
            reason: error.to_string(),
            storage: is_storage_failure(error),
        }
    }

    pub(super) fn next(&mut self) -> Next {
        match self {
            Self::Lines { reader, pos, end } => loop {
                if *pos >= *end {
                    return Next::End;
                }
                let mut line = Vec::new();
                let offset = *pos;
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) => return Next::End,
                    Ok(n) => {
                        *pos += n as u64;
                        let text = line.trim_ascii();
                        if text.is_empty() {
                            continue;
                        }
                        return Next::Row(RawRow {
                            offset,
                            next: *pos,
                            row: parse_line(text),
                        });
                    }
                    Err(e) => {
                        *self = Self::Done;
                        return Next::Broken {
                            offset,
                            reason: e.to_string(),
                            storage: is_storage_failure(&e),
                        };
                    }
                }
            },
            Self::Parquet { rows, next } => match rows.next() {
                None => Next::End,
                Some(Ok(row)) => {
                    *next += 1;
                    Next::Row(RawRow {
                        offset: *next - 1,
                        next: *next,
                        row: Ok(row.to_json_value()),
                    })
                }
                Some(Err(e)) => {
                    let offset = *next;
                    *self = Self::Done;
                    Next::Broken {
                        offset,
                        storage: parquet_storage_failure(&e),
                        reason: e.to_string(),
                    }
                }
            },
            Self::Failed {
                offset,
                reason,
                storage,
            } => {
                let broken = Next::Broken {
                    offset: *offset,
                    reason: std::mem::take(reason),
                    storage: *storage,
                };
                *self = Self::Done;
                broken
            }
            Self::Done => Next::End,
        }
    }
}
