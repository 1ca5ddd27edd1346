//! The rows of one unit (a byte range of plain JSONL, a whole compressed JSONL file or a
//! Parquet row group) from a cursor: each with its offset, the next row's offset and its
//! JSON, or why it cannot be used.

use std::io::{BufRead, BufReader, Read};

use regatta_trainer::stream::{Compression, FileEntry, Part, SourceCursor, Unit};

use super::remote::{is_storage_failure, RangedRead, Remote, LINE_BUFFER, READ_BYTES};

/// A row as read: where it starts, where the next starts, its JSON or why it is unusable.
pub(super) struct RawRow {
    pub(super) offset: u64,
    pub(super) next: u64,
    pub(super) row: std::result::Result<serde_json::Value, String>,
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

fn parse_line(line: &[u8]) -> std::result::Result<serde_json::Value, String> {
    serde_json::from_slice(line).map_err(|e| format!("is not valid JSON: {e}"))
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
            (Part::Bytes { start, end }, _) => {
                let from = if resume { cursor.offset } else { start.saturating_sub(1) };
                let first = (end.saturating_sub(from) + (64 << 10)).min(READ_BYTES);
                let read = RangedRead::new(remote, from, first, end);
                let mut reader: Box<dyn BufRead + Send> = Box::new(BufReader::with_capacity(LINE_BUFFER, read));
                let mut pos = from;
                if !resume && start > 0 {
                    // The line in progress at `start` belongs to the unit before.
                    let mut skipped = Vec::new();
                    match reader.read_until(b'\n', &mut skipped) {
                        Ok(n) => pos += n as u64,
                        Err(e) => {
                            return Self::Failed {
                                offset: from,
                                reason: e.to_string(),
                                storage: is_storage_failure(&e),
                            }
                        }
                    }
                }
                Self::Lines { reader, pos, end }
            }
            (Part::Whole, compression) => {
                let size = remote.size;
                let read = RangedRead::new(remote, 0, READ_BYTES, size);
                let decoded: Box<dyn Read + Send> = match compression {
                    Compression::Zstd => match zstd::stream::read::Decoder::new(read) {
                        Ok(d) => Box::new(d),
                        Err(e) => {
                            return Self::Failed {
                                offset: 0,
                                reason: e.to_string(),
                                storage: is_storage_failure(&e),
                            }
                        }
                    },
                    Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(read)),
                    Compression::None => Box::new(read),
                };
                let mut reader: Box<dyn BufRead + Send> = Box::new(BufReader::with_capacity(LINE_BUFFER, decoded));
                let mut pos = 0;
                if resume {
                    // Compressed streams are entered from the start: skip what was read.
                    let mut skip = std::io::Read::take(&mut reader, cursor.offset);
                    match std::io::copy(&mut skip, &mut std::io::sink()) {
                        Ok(n) => pos = n,
                        Err(e) => {
                            return Self::Failed {
                                offset: 0,
                                reason: e.to_string(),
                                storage: is_storage_failure(&e),
                            }
                        }
                    }
                }
                Self::Lines {
                    reader,
                    pos,
                    end: u64::MAX,
                }
            }
            (Part::RowGroup(group), _) => {
                use parquet::file::serialized_reader::{ReadOptionsBuilder, SerializedFileReader};
                let options = ReadOptionsBuilder::new()
                    .with_predicate(Box::new(move |_, i| i == group as usize))
                    .build();
                match SerializedFileReader::new_with_options(remote, options) {
                    Ok(reader) => {
                        let skip = if resume { cursor.offset } else { 0 };
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
