//! JSONL input split into byte ranges, one partition each, and the rows a partition owns:
//! a line belongs to the partition its first byte falls in, so every line is read by
//! exactly one partition however the ranges cut the file. Pure: byte arithmetic only.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// `partitions` byte ranges covering a file of `size` bytes (the last ones may be one
/// byte shorter; empty files give no partition).
pub fn byte_ranges(size: u64, partitions: usize) -> Vec<Range<u64>> {
    let n = (partitions.max(1) as u64).min(size);
    if n == 0 {
        return Vec::new();
    }
    let (base, extra) = (size / n, size % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + u64::from(i < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// The bytes a reader fetches for `range`: from one byte before it (to see whether a line
/// starts exactly at `range.start`) to its end; more follows while the last owned line is
/// unfinished (see [`owned_lines`]).
pub fn read_window(range: &Range<u64>) -> Range<u64> {
    range.start.saturating_sub(1)..range.end
}

/// Lines owned by `range` inside `buf`, which holds the file from `buf_start` (as fetched
/// through [`read_window`], possibly extended). Returns each owned line's file offset and
/// bytes (without the newline), and `Some(offset)` when the last owned line runs past the
/// end of `buf` and more must be read from that offset (unless `buf` reaches the file's end).
pub fn owned_lines<'a>(
    buf: &'a [u8],
    buf_start: u64,
    range: &Range<u64>,
    at_file_end: bool,
) -> (Vec<(u64, &'a [u8])>, Option<u64>) {
    let mut lines = Vec::new();
    // The first owned line starts at range.start if the byte before is a newline (or the
    // file starts there), else after the first newline inside the range.
    let mut pos = if range.start == 0 {
        0
    } else {
        let before = (range.start - 1 - buf_start) as usize;
        match buf[before..].iter().position(|b| *b == b'\n') {
            Some(newline) => before + newline + 1,
            None => return (lines, None),
        }
    };
    while buf_start + (pos as u64) < range.end && pos < buf.len() {
        match buf[pos..].iter().position(|b| *b == b'\n') {
            Some(len) => {
                lines.push((buf_start + pos as u64, &buf[pos..pos + len]));
                pos += len + 1;
            }
            None if at_file_end => {
                lines.push((buf_start + pos as u64, &buf[pos..]));
                pos = buf.len();
            }
            None => return (lines, Some(buf_start + pos as u64)),
        }
    }
    (lines, None)
}

/// One input row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The row's id (a JSON string, or a number written as text).
    pub id: String,
    /// The text to score.
    pub text: String,
}

/// A row that could not be read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowError {
    /// The id, when the line had one.
    pub id: Option<String>,
    /// Where the line starts in the input.
    pub offset: u64,
    /// What is wrong.
    pub reason: String,
}

/// The `id` of the row at `offset`: a non-empty string, or an integer written as text.
pub(crate) fn row_id(value: &serde_json::Value, offset: u64) -> Result<String, RowError> {
    let reason = match value.get("id") {
        Some(serde_json::Value::String(s)) if !s.is_empty() => return Ok(s.clone()),
        Some(serde_json::Value::Number(n)) if n.is_u64() || n.is_i64() => return Ok(n.to_string()),
        Some(other) => format!("`id` must be a non-empty string or an integer, not {other}"),
        None => "no `id` field".into(),
    };
    Err(RowError {
        id: None,
        offset,
        reason,
    })
}

/// Parses one JSONL line: an object with an `id` (string or integer) and a `text` string.
pub fn parse_row(line: &[u8], offset: u64) -> Result<Row, RowError> {
    let fail = |id: Option<String>, reason: String| RowError { id, offset, reason };
    let value: serde_json::Value =
        serde_json::from_slice(line).map_err(|e| fail(None, format!("not valid JSON: {e}")))?;
    let id = row_id(&value, offset)?;
    match value.get("text") {
        Some(serde_json::Value::String(text)) if !text.is_empty() => Ok(Row { id, text: text.clone() }),
        Some(serde_json::Value::String(_)) => Err(fail(Some(id), "`text` is empty".into())),
        Some(other) => Err(fail(Some(id), format!("`text` must be a string, not {other}"))),
        None => Err(fail(Some(id), "no `text` field".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(file: &[u8], partitions: usize) -> Vec<Vec<u64>> {
        byte_ranges(file.len() as u64, partitions)
            .iter()
            .map(|range| {
                let mut window = read_window(range);
                loop {
                    let buf = &file[window.start as usize..window.end as usize];
                    let at_end = window.end == file.len() as u64;
                    let (lines, more) = owned_lines(buf, window.start, range, at_end);
                    match more {
                        Some(_) => window.end = (window.end + 3).min(file.len() as u64),
                        None => return lines.iter().map(|(offset, _)| *offset).collect(),
                    }
                }
            })
            .collect()
    }

    #[test]
    fn every_line_is_owned_by_exactly_one_partition_for_any_cut() {
        let file = b"a\nbbbb\n\ncc\nddddddddd\ne\nff";
        let starts: Vec<u64> = std::iter::once(0)
            .chain(
                file.iter()
                    .enumerate()
                    .filter(|(_, b)| **b == b'\n')
                    .map(|(i, _)| i as u64 + 1),
            )
            .collect();
        for partitions in 1..=file.len() + 2 {
            let owned: Vec<u64> = read_all(file, partitions).into_iter().flatten().collect();
            assert_eq!(owned, starts, "{partitions} partitions");
        }
    }

    #[test]
    fn a_trailing_newline_makes_no_empty_row() {
        let file = b"x\ny\n";
        let owned: Vec<u64> = read_all(file, 2).into_iter().flatten().collect();
        assert_eq!(owned, vec![0, 2]);
    }

    #[test]
    fn ranges_cover_the_file() {
        assert_eq!(byte_ranges(10, 3), vec![0..4, 4..7, 7..10]);
        assert_eq!(byte_ranges(2, 5), vec![0..1, 1..2]);
        assert!(byte_ranges(0, 4).is_empty());
    }

    #[test]
    fn rows_parse_or_say_why_not() {
        assert_eq!(
            parse_row(br#"{"id": 7, "text": "hi"}"#, 0).unwrap(),
            Row {
                id: "7".into(),
                text: "hi".into()
            }
        );
        let cases: [(&[u8], &str, Option<&str>); 5] = [
            (b"{not json", "not valid JSON", None),
            (br#"{"text": "x"}"#, "no `id`", None),
            (br#"{"id": "a"}"#, "no `text`", Some("a")),
            (br#"{"id": "b", "text": 3}"#, "must be a string", Some("b")),
            (br#"{"id": [1], "text": "x"}"#, "non-empty string or an integer", None),
        ];
        for (line, reason, id) in cases {
            let error = parse_row(line, 42).unwrap_err();
            assert!(error.reason.contains(reason), "{error:?}");
            assert_eq!((error.id.as_deref(), error.offset), (id, 42));
        }
    }
}
