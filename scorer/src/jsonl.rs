//! The lines of a JSONL file a byte range owns ([`crate::partition::owned_lines`]), fetched
//! through object_store: the range plus the byte before it, grown geometrically while the
//! last owned line runs on, so a very long line costs O(n) bytes fetched, not O(n^2).

use std::ops::Range;

use bytes::Bytes;
use regatta_object_store::Place;

use crate::error::Result;
use crate::partition::{owned_lines, read_window};

/// Each non-blank line starting in `range` of the file `name` (of `size` bytes) in `place`,
/// with its offset in the file, without its newline.
pub async fn read_owned_lines(place: &Place, name: &str, size: u64, range: Range<u64>) -> Result<Vec<(u64, Bytes)>> {
    let range = range.start..range.end.min(size);
    let mut window = read_window(&range);
    loop {
        let buf = place.get_range(name, window.clone()).await?;
        let (lines, more) = owned_lines(&buf, window.start, &range, window.end >= size);
        if more.is_some() {
            let grow = (window.end - window.start).max(64 << 10);
            window.end = (window.end + grow).min(size);
            continue;
        }
        return Ok(lines
            .into_iter()
            .filter(|(_, line)| !line.iter().all(u8::is_ascii_whitespace))
            .map(|(offset, line)| {
                let start = (offset - window.start) as usize;
                (offset, buf.slice(start..start + line.len()))
            })
            .collect());
    }
}
