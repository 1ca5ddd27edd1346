//! One file of a source, read in ranges from a blocking thread: the next range is fetched
//! while the current one is parsed, each read is retried, and a read that still fails is a
//! storage failure (the rank restarts) rather than bad bytes (skipped and counted).

use std::io::Read;
use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use regatta_object_store::{Place, PlaceError};

/// Bytes one ranged read fetches at most. Each open unit holds one read and the next one
/// in flight, so a rank's read buffers stay near 2 x this x its shards.
pub(super) const READ_BYTES: u64 = 256 << 10;
/// The buffer lines are cut from.
pub(super) const LINE_BUFFER: usize = 64 << 10;
/// Attempts of one ranged read before the loader gives up (the rank restarts).
pub(super) const READ_ATTEMPTS: u32 = 4;

/// A failed ranged read (after its retries), told apart from bad bytes by its kind: the
/// rank restarts from its checkpoint rather than skip data it could not fetch.
pub(super) fn storage_failure(reason: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, reason.to_string())
}

pub(super) fn is_storage_failure(error: &std::io::Error) -> bool {
    error.kind() == std::io::ErrorKind::ConnectionAborted
}

/// One file, read in ranges from a blocking thread.
#[derive(Clone)]
pub struct Remote {
    place: Place,
    name: String,
    pub(super) size: u64,
    handle: tokio::runtime::Handle,
}

impl Remote {
    pub(super) fn new(place: Place, name: String, size: u64, handle: tokio::runtime::Handle) -> Self {
        Self {
            place,
            name,
            size,
            handle,
        }
    }

    pub(super) fn url(&self) -> String {
        format!("{}/{}", self.place.url(), self.name)
    }

    /// The bytes, retrying a backend failure (not a missing file) with backoff.
    async fn fetch(place: Place, name: String, range: Range<u64>) -> std::result::Result<Bytes, PlaceError> {
        let mut wait = Duration::from_millis(100);
        let mut attempt = 1;
        loop {
            match place.get_range(&name, range.clone()).await {
                Ok(bytes) => return Ok(bytes),
                Err(e) if attempt >= READ_ATTEMPTS || !e.is_transient() => return Err(e),
                Err(_) => {
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    attempt += 1;
                }
            }
        }
    }

    /// Bytes `range` (clipped to the file), from a thread outside the runtime.
    pub(super) fn range(&self, range: Range<u64>) -> std::io::Result<Bytes> {
        let range = range.start.min(self.size)..range.end.min(self.size);
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        self.handle
            .block_on(Self::fetch(self.place.clone(), self.name.clone(), range))
            .map_err(storage_failure)
    }
}

/// A file read from `pos` to its end in ranges: the first of `first` bytes, then
/// [`READ_BYTES`] each, the next one requested while the current one is consumed.
pub struct RangedRead {
    remote: Remote,
    pos: u64,
    buf: Bytes,
    next_len: u64,
    ahead: Option<tokio::task::JoinHandle<std::result::Result<Bytes, PlaceError>>>,
    /// Ranges starting here or later are fetched only when read (a unit's reader
    /// rarely needs more than its own bytes).
    ahead_until: u64,
}

impl RangedRead {
    pub(super) fn new(remote: Remote, pos: u64, first: u64, ahead_until: u64) -> Self {
        Self {
            remote,
            pos,
            buf: Bytes::new(),
            next_len: first.max(1),
            ahead: None,
            ahead_until,
        }
    }

    pub(super) fn request(
        &self,
        start: u64,
        len: u64,
    ) -> Option<tokio::task::JoinHandle<std::result::Result<Bytes, PlaceError>>> {
        let end = (start + len).min(self.remote.size);
        (start < end && start < self.ahead_until).then(|| {
            let (place, name) = (self.remote.place.clone(), self.remote.name.clone());
            self.remote.handle.spawn(Remote::fetch(place, name, start..end))
        })
    }
}

impl Read for RangedRead {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.buf.is_empty() {
            if self.pos >= self.remote.size {
                return Ok(0);
            }
            let chunk = match self.ahead.take() {
                Some(ahead) => self
                    .remote
                    .handle
                    .block_on(ahead)
                    .map_err(|e| storage_failure(e.to_string()))?
                    .map_err(storage_failure)?,
                None => self.remote.range(self.pos..self.pos + self.next_len)?,
            };
            if chunk.is_empty() {
                return Ok(0);
            }
            self.next_len = READ_BYTES;
            self.buf = chunk;
            self.ahead = self.request(self.pos + self.buf.len() as u64, self.next_len);
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf = self.buf.slice(n..);
        self.pos += n as u64;
        Ok(n)
    }
}

impl parquet::file::reader::Length for Remote {
    fn len(&self) -> u64 {
        self.size
    }
}

impl parquet::file::reader::ChunkReader for Remote {
    type T = RangedRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<RangedRead> {
        Ok(RangedRead::new(self.clone(), start, READ_BYTES, self.size))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let bytes = self
            .range(start..start + length as u64)
            .map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))?;
        if bytes.len() != length {
            return Err(parquet::errors::ParquetError::EOF(format!(
                "{} ends before byte {}",
                self.url(),
                start + length as u64
            )));
        }
        Ok(bytes)
    }
}
