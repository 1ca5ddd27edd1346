//! The head's cluster state on disk, in its state directory: a snapshot, `cluster.state`,
//! and a log of the changes made since, `cluster.log`. Each change is appended to the log
//! and flushed to disk before the head answers the request that made it (a group commit:
//! changes made while a write is under way go together in the next). When the log grows
//! past [`CHECKPOINT_BYTES`] the head writes a new snapshot (written beside, flushed,
//! renamed, directory flushed) and starts the log afresh. A head started on the same
//! directory reads the snapshot, replays the log after it (`HeadCore::replay`) and takes
//! its nodes and actors back as they register.
//!
//! Snapshot layout: the magic `REGATTA-HEAD-STATE`, a format version (u32, little-endian),
//! the cluster's scope fingerprint (so a head of another cluster authority refuses it), the sequence
//! number of the last change it includes (u64), the body's length (u64) and CRC-32, then
//! the body: a `Snapshot` in bincode. Log layout: the magic `REGATTA-HEAD-LOG`, the version
//! and the fingerprint, then records of [length u32, CRC-32 u32, sequence u64, a `Change`
//! in bincode]. A torn or foreign snapshot is refused with a clear error, never silently
//! replaced; a torn last record of the log (a crash mid-write: its request was never
//! answered) is dropped with a warning.

use std::io::Write;
use std::path::{Path, PathBuf};

use bincode::Options;
use regatta_proto::{Change, ChangeRef, Saved, Snapshot};

use crate::error::{Error, Result};

const MAGIC: &[u8] = b"REGATTA-HEAD-STATE";
const LOG_MAGIC: &[u8] = b"REGATTA-HEAD-LOG";
/// What an operator does with a state file the head cannot use.
const ASIDE: &str = "move it aside (or delete it) to start an empty cluster; the workers then stop their actors";
/// The format's version: 3 since the scheduler keeps the nodes removed for good (and the
/// state is keyed by the cluster's authority); 2 typed a dead actor's cause and an exit's
/// loss (`DeathCause`, `Loss`).
const VERSION: u32 = 3;
/// The snapshot's name in the state directory.
pub(crate) const FILE_NAME: &str = "cluster.state";
/// The change log's name in the state directory.
pub(crate) const LOG_NAME: &str = "cluster.log";
/// A state larger than this is refused when read (a corrupt length must not allocate).
const MAX_BODY_BYTES: u64 = 4 << 30;
/// A log record larger than this is corrupt (requests are at most 16 MiB).
const MAX_RECORD_BYTES: u32 = 64 << 20;
/// Log bytes after which the head writes a snapshot and starts the log afresh. A restart
/// replays the log at about 15 us a change (some 40 bytes each; BENCHMARKS.md, 2026-11-25),
/// so 8 MiB bounds the replay near 3.5 s on a 2-core machine; the snapshot it costs holds
/// the head's loop about 46 ms at 100,000 actors.
pub(crate) const CHECKPOINT_BYTES: u64 = 8 << 20;

fn codec() -> impl Options {
    bincode::DefaultOptions::new().with_limit(MAX_BODY_BYTES)
}

/// A cluster's state files.
#[derive(Clone, Debug)]
pub(crate) struct StateFile {
    path: PathBuf,
    log: PathBuf,
    scope: String,
}

/// What a restarting head reads back.
pub(crate) struct Recovered {
    /// The snapshot, if one was written.
    pub(crate) saved: Option<Saved>,
    /// The changes logged after it, in order.
    pub(crate) changes: Vec<Change>,
    /// The sequence number of the last change (of the snapshot's, when none follow).
    pub(crate) last_seq: u64,
    /// Bytes at the log's end that did not read as a whole record (dropped).
    pub(crate) dropped_bytes: usize,
}

/// What the head itself keeps in its state directory; a directory holding only these (or
/// nothing) is the head's own, and may be tightened.
const STATE_DIR_ENTRIES: [&str; 6] = [FILE_NAME, LOG_NAME, "head.lock", "jobs", "logs", "run"];

/// Creates `dir` if missing, readable by its owner only: the head's state holds what
/// crossed the network encrypted (spawn arguments with the trainer ring's secret, job
/// environments), so it must not sit readable by other users on disk. An existing
/// directory open to others is tightened to 700 when it holds nothing but the head's own
/// files (a state directory from an earlier version); any other directory (`/tmp`, a home)
/// is left as it is, with a warning to choose a private one.
pub(crate) fn private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let cannot = |what: &str, e| Error::io(format!("cannot {what} the head's state directory {}", dir.display()), e);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| cannot("create", e))?;
    let mode = std::fs::metadata(dir)
        .map_err(|e| cannot("read", e))?
        .permissions()
        .mode();
    if mode & 0o077 == 0 {
        return Ok(());
    }
    let only_ours = std::fs::read_dir(dir)
        .map_err(|e| cannot("list", e))?
        .filter_map(|entry| entry.ok())
        .all(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            STATE_DIR_ENTRIES.contains(&name.as_ref()) || name.ends_with(".tmp")
        });
    let was = format!("{:o}", mode & 0o7777);
    if only_ours {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| cannot("restrict (chmod 700)", e))?;
        tracing::warn!(dir = %dir.display(), %was, "the head's state directory was open to other users; it is now 700 (owner only)");
    } else {
        tracing::warn!(dir = %dir.display(), %was, "the head's state directory is open to other users and holds other files, so it is left as it is: its state and job records (spawn arguments, job environments) are readable by them; give --state-dir a directory of its own");
    }
    Ok(())
}

impl StateFile {
    /// The state files in `dir` (created if missing) of the cluster whose process-group
    /// scope is `scope`.
    pub(crate) fn open(dir: &Path, scope: &str) -> Result<Self> {
        private_dir(dir)?;
        Ok(Self {
            path: dir.join(FILE_NAME),
            log: dir.join(LOG_NAME),
            scope: scope.to_string(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn refused(&self, path: &Path, problem: StateFileError) -> Error {
        Error::HeadState {
            path: path.to_path_buf(),
            reason: problem.to_string(),
        }
    }

    /// The saved snapshot and the changes logged after it.
    pub(crate) fn recover(&self) -> Result<Recovered> {
        let (saved, snapshot_seq) = match read_if_there(&self.path)? {
            None => (None, 0),
            Some(bytes) => {
                let (saved, seq) = decode(&bytes, &self.scope).map_err(|reason| self.refused(&self.path, reason))?;
                (Some(saved), seq)
            }
        };
        let (changes, last_seq, dropped_bytes) = match read_if_there(&self.log)? {
            None => (Vec::new(), snapshot_seq, 0),
            Some(bytes) => {
                read_log(&bytes, &self.scope, snapshot_seq).map_err(|reason| self.refused(&self.log, reason))?
            }
        };
        Ok(Recovered {
            saved,
            changes,
            last_seq,
            dropped_bytes,
        })
    }

    /// Encodes a snapshot that includes the changes up to `seq`.
    pub(crate) fn encode(&self, snapshot: &Snapshot<'_>, seq: u64) -> Result<Vec<u8>> {
        let body = codec()
            .serialize(snapshot)
            .map_err(|source| self.refused(&self.path, StateFileError::Encode { what: "it", source }))?;
        let mut bytes = Vec::with_capacity(body.len() + 64);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&(self.scope.len() as u32).to_le_bytes());
        bytes.extend_from_slice(self.scope.as_bytes());
        bytes.extend_from_slice(&seq.to_le_bytes());
        bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&regatta_object_store::crc32(&body).to_le_bytes());
        bytes.extend_from_slice(&body);
        Ok(bytes)
    }

    /// Encodes one change as a log record.
    pub(crate) fn record(&self, change: &ChangeRef<'_>, seq: u64) -> Result<Vec<u8>> {
        let body = codec().serialize(change).map_err(|source| {
            self.refused(
                &self.log,
                StateFileError::Encode {
                    what: "a change",
                    source,
                },
            )
        })?;
        let mut framed = Vec::with_capacity(body.len() + 16);
        framed.extend_from_slice(&seq.to_le_bytes());
        framed.extend_from_slice(&body);
        let mut bytes = Vec::with_capacity(framed.len() + 8);
        bytes.extend_from_slice(&(framed.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&regatta_object_store::crc32(&framed).to_le_bytes());
        bytes.extend_from_slice(&framed);
        Ok(bytes)
    }

    /// Replaces the snapshot with `bytes` atomically: a crash leaves the old one or the new.
    pub(crate) fn write(&self, bytes: &[u8]) -> Result<()> {
        let tmp = self.path.with_extension("state.tmp");
        let context = |what: &str| format!("cannot {what} {}", tmp.display());
        let mut file = std::fs::File::create(&tmp).map_err(|e| Error::io(context("create"), e))?;
        file.write_all(bytes).map_err(|e| Error::io(context("write"), e))?;
        file.sync_data().map_err(|e| Error::io(context("flush"), e))?;
        drop(file);
        std::fs::rename(&tmp, &self.path)
            .map_err(|e| Error::io(format!("cannot move {} into place", tmp.display()), e))?;
        if let Some(dir) = self.path.parent() {
            // The rename itself is durable once the directory is flushed.
            if let Ok(dir) = std::fs::File::open(dir) {
                let _ = dir.sync_all();
            }
        }
        Ok(())
    }

    /// Opens the log for appending, empty (a snapshot including everything was just
    /// written).
    pub(crate) fn start_log(&self) -> Result<LogWriter> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&self.log)
            .map_err(|e| Error::io(format!("cannot open {}", self.log.display()), e))?;
        let mut writer = LogWriter {
            file,
            len: 0,
            header: log_header(&self.scope),
            path: self.log.clone(),
        };
        writer.truncate()?;
        Ok(writer)
    }
}

fn log_header(scope: &str) -> Vec<u8> {
    let mut header = Vec::new();
    header.extend_from_slice(LOG_MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&(scope.len() as u32).to_le_bytes());
    header.extend_from_slice(scope.as_bytes());
    header
}

/// The open change log, owned by the head's writer thread.
pub(crate) struct LogWriter {
    file: std::fs::File,
    len: u64,
    header: Vec<u8>,
    path: PathBuf,
}

impl LogWriter {
    /// Bytes in the log.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Appends records and flushes them to disk. A failed append is cut off again, so
    /// the log never holds a broken record before good ones.
    pub(crate) fn append(&mut self, bytes: &[u8]) -> Result<()> {
        use std::io::{Seek, SeekFrom};
        let written = self
            .file
            .seek(SeekFrom::Start(self.len))
            .and_then(|_| self.file.write_all(bytes))
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += bytes.len() as u64;
                Ok(())
            }
            Err(e) => {
                let _ = self.file.set_len(self.len);
                Err(Error::io(format!("cannot append to {}", self.path.display()), e))
            }
        }
    }

    /// Empties the log (a snapshot now includes everything in it).
    pub(crate) fn truncate(&mut self) -> Result<()> {
        use std::io::{Seek, SeekFrom};
        let context = format!("cannot start {} afresh", self.path.display());
        self.file.set_len(0).map_err(|e| Error::io(context.clone(), e))?;
        self.file
            .seek(SeekFrom::Start(0))
            .and_then(|_| self.file.write_all(&self.header))
            .and_then(|()| self.file.sync_data())
            .map_err(|e| Error::io(context, e))?;
        self.len = self.header.len() as u64;
        Ok(())
    }
}

fn read_if_there(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(format!("cannot read {}", path.display()), e)),
    }
}

/// Why a state file or change log cannot be written or read back; each says what to do.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StateFileError {
    /// The file ends inside a field.
    #[error("it ends before its {what} ({len} bytes in all; was the disk full?); {ASIDE}")]
    Truncated {
        /// The field cut short.
        what: &'static str,
        /// The file's length.
        len: usize,
    },
    /// Another file's magic.
    #[error("it is not a Regatta head {0}; {ASIDE}")]
    NotOurs(&'static str),
    /// Another format version.
    #[error(
        "it is of format version {0}, this head reads version {VERSION}; start the Regatta version that wrote it, or {ASIDE}"
    )]
    Version(u32),
    /// The cluster fingerprint's length is impossible.
    #[error("its cluster fingerprint is corrupt; {ASIDE}")]
    Fingerprint,
    /// Written for another cluster (another authority, or an older Regatta's token).
    #[error(
        "it belongs to another cluster: one with another certificate authority (its ca folder beside it was replaced or lost), or a state an older Regatta keyed by its cluster token; move it aside to start this cluster empty, or give this cluster its own --state-dir"
    )]
    OtherCluster,
    /// A record in the middle of the log is damaged: changes after it were acknowledged
    /// and would be lost.
    #[error(
        "a record at byte {offset} is damaged and whole records follow it: the changes after it would be lost; {ASIDE}"
    )]
    Corrupt {
        /// Where the damaged record starts.
        offset: usize,
    },
    /// A record's sequence number skips: changes before it are missing.
    #[error("the record at byte {offset} is change {found}, but change {expected} is missing; {ASIDE}")]
    Gap {
        /// Where the record starts.
        offset: usize,
        /// The change that should come next.
        expected: u64,
        /// The change found.
        found: u64,
    },
    /// The body's length disagrees with the header.
    #[error("its body should be {expected} bytes but {found} follow (a torn or truncated write); {ASIDE}")]
    Torn {
        /// Bytes the header promises.
        expected: u64,
        /// Bytes present.
        found: usize,
    },
    /// The checksum does not match.
    #[error("its checksum does not match (the file is corrupt); {ASIDE}")]
    Checksum,
    /// The body does not decode.
    #[error("it does not decode ({0}); {ASIDE}")]
    Decode(bincode::Error),
    /// The state or a change cannot be encoded.
    #[error("cannot encode {what}: {source}")]
    Encode {
        /// `it` (the snapshot) or `a change`.
        what: &'static str,
        /// The encoder's error.
        source: bincode::Error,
    },
}

/// A cursor over a file's bytes whose errors say what was cut short.
struct Reader<'a> {
    all: usize,
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            all: bytes.len(),
            rest: bytes,
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> std::result::Result<&'a [u8], StateFileError> {
        if self.rest.len() < n {
            return Err(StateFileError::Truncated { what, len: self.all });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u32(&mut self, what: &'static str) -> std::result::Result<u32, StateFileError> {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(raw))
    }

    fn u64(&mut self, what: &'static str) -> std::result::Result<u64, StateFileError> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(raw))
    }

    /// The magic, version and fingerprint every file starts with.
    fn header(&mut self, magic: &[u8], kind: &'static str, scope: &str) -> std::result::Result<(), StateFileError> {
        if self.take(magic.len(), "header")? != magic {
            return Err(StateFileError::NotOurs(kind));
        }
        let version = self.u32("version")?;
        if version != VERSION {
            return Err(StateFileError::Version(version));
        }
        let scope_len = self.u32("cluster fingerprint")? as usize;
        if scope_len > 256 {
            return Err(StateFileError::Fingerprint);
        }
        if self.take(scope_len, "cluster fingerprint")? != scope.as_bytes() {
            return Err(StateFileError::OtherCluster);
        }
        Ok(())
    }
}

/// Reads a snapshot back: the state and the sequence number of its last change.
fn decode(bytes: &[u8], scope: &str) -> std::result::Result<(Saved, u64), StateFileError> {
    let mut reader = Reader::new(bytes);
    reader.header(MAGIC, "state file", scope)?;
    let seq = reader.u64("sequence number")?;
    let len = reader.u64("length")?;
    let crc = reader.u32("checksum")?;
    let rest = reader.rest;
    if len > MAX_BODY_BYTES || len as usize != rest.len() {
        return Err(StateFileError::Torn {
            expected: len,
            found: rest.len(),
        });
    }
    if regatta_object_store::crc32(rest) != crc {
        return Err(StateFileError::Checksum);
    }
    let saved = codec().deserialize(rest).map_err(StateFileError::Decode)?;
    Ok((saved, seq))
}

/// Reads the log: the changes after `after` in order, the last sequence number, and the
/// bytes dropped at its end.
fn read_log(bytes: &[u8], scope: &str, after: u64) -> std::result::Result<(Vec<Change>, u64, usize), StateFileError> {
    if bytes.is_empty() {
        return Ok((Vec::new(), after, 0));
    }
    let mut reader = Reader::new(bytes);
    reader.header(LOG_MAGIC, "change log", scope)?;
    let mut changes = Vec::new();
    let mut last = after;
    while !reader.rest.is_empty() {
        let offset = bytes.len() - reader.rest.len();
        let Some((seq, change)) = next_record(&mut reader) else {
            // A torn last record (a crash mid-write: its request was never answered) is
            // dropped; a damaged one with whole records after it is not the tail.
            if whole_record_after(reader.rest) {
                return Err(StateFileError::Corrupt { offset });
            }
            break;
        };
        if seq <= after {
            // Already in the snapshot (a crash between writing it and emptying the log).
            continue;
        }
        if seq != last + 1 {
            return Err(StateFileError::Gap {
                offset,
                expected: last + 1,
                found: seq,
            });
        }
        changes.push(change);
        last = seq;
    }
    Ok((changes, last, reader.rest.len()))
}

/// Whether a whole, intact record follows the broken one at the start of `rest` (found
/// where the broken one's own length says it ends, when that length is plausible).
fn whole_record_after(rest: &[u8]) -> bool {
    let mut probe = Reader::new(rest);
    let Ok(len) = probe.u32("record length") else {
        return false;
    };
    if !(8..=MAX_RECORD_BYTES).contains(&len) {
        return false;
    }
    let Some(next) = rest.get(8 + len as usize..).filter(|next| !next.is_empty()) else {
        return false;
    };
    next_record(&mut Reader::new(next)).is_some()
}

/// One whole, intact record; `None` leaves the reader where the broken one starts.
fn next_record(reader: &mut Reader<'_>) -> Option<(u64, Change)> {
    let mut probe = Reader::new(reader.rest);
    let len = probe.u32("record length").ok()?;
    if !(8..=MAX_RECORD_BYTES).contains(&len) {
        return None;
    }
    let crc = probe.u32("record checksum").ok()?;
    let framed = probe.take(len as usize, "record").ok()?;
    if regatta_object_store::crc32(framed) != crc {
        return None;
    }
    let (seq, body) = framed.split_at(8);
    let seq = u64::from_le_bytes(seq.try_into().ok()?);
    let change = codec().deserialize(body).ok()?;
    reader.rest = probe.rest;
    Some((seq, change))
}

/// Takes the state directory for this process: a second head started on the same
/// directory would overwrite the first one's state. Held until the returned file closes.
pub(crate) fn lock(dir: &Path) -> Result<std::fs::File> {
    let path = dir.join("head.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::HeadState {
            path,
            reason: format!(
                "another head runs on the state directory {}; give each head its own --state-dir",
                dir.display()
            ),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(Error::io(format!("cannot lock {}", path.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_damaged_header_is_told_apart_by_kind() {
        let mut header = MAGIC.to_vec();
        // A file a later version wrote.
        header.extend((VERSION + 1).to_le_bytes());
        assert!(matches!(decode(&header, "scope"), Err(StateFileError::Version(v)) if v == VERSION + 1));
        assert!(matches!(
            decode(b"REGATTA-HEAD-STATX", "scope"),
            Err(StateFileError::NotOurs("state file"))
        ));
        let cut = decode(&MAGIC[..4], "scope").err();
        assert!(
            matches!(cut, Some(StateFileError::Truncated { what: "header", len: 4 })),
            "{cut:?}"
        );
        assert!(matches!(
            read_log(&header, "scope", 0),
            Err(StateFileError::NotOurs("change log"))
        ));
    }
    use regatta_proto::HeadCore;
    use regatta_proto::HeadRequest;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("regatta-state-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn change(n: u64) -> Change {
        Change::Request {
            request: HeadRequest::EndJob(format!("job-{n}")),
            answered: true,
            now_ms: n,
        }
    }

    fn job_of(change: &Change) -> String {
        match change {
            Change::Request {
                request: HeadRequest::EndJob(job),
                ..
            } => job.clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_snapshot_and_the_log_after_it_are_read_back_and_a_torn_last_record_is_dropped() {
        let dir = dir("round");
        let file = StateFile::open(&dir, "scope-a").unwrap();
        let none = file.recover().unwrap();
        assert!(none.saved.is_none() && none.changes.is_empty() && none.last_seq == 0);
        let head = HeadCore::new(3_000, 10_000);
        file.write(&file.encode(&head.snapshot(1_234), 2).unwrap()).unwrap();
        let mut log = file.start_log().unwrap();
        // Records 1 and 2 are in the snapshot (a crash before the log was emptied).
        for seq in 1..=5 {
            log.append(&file.record(&change(seq).as_ref(), seq).unwrap()).unwrap();
        }
        let whole = log.len();
        let torn = file.record(&change(6).as_ref(), 6).unwrap();
        log.append(&torn[..torn.len() - 3]).unwrap();
        let back = file.recover().unwrap();
        assert_eq!(back.saved.expect("saved").saved_at_ms(), 1_234);
        assert_eq!(
            back.changes.iter().map(job_of).collect::<Vec<_>>(),
            ["job-3", "job-4", "job-5"]
        );
        assert_eq!((back.last_seq, back.dropped_bytes), (5, torn.len() - 3));
        // A flipped byte in a record ends the log there too.
        let mut bytes = std::fs::read(dir.join(LOG_NAME)).unwrap();
        bytes[whole as usize - 2] ^= 1;
        std::fs::write(dir.join(LOG_NAME), &bytes).unwrap();
        assert_eq!(file.recover().unwrap().last_seq, 4);
        // A flipped byte in a record with whole records after it is not a torn tail: the
        // changes after it were acknowledged, so the log is refused, with the offset.
        let mut bytes = std::fs::read(dir.join(LOG_NAME)).unwrap();
        bytes[whole as usize - 2] ^= 1;
        let header = log_header("scope-a").len();
        let third = file.record(&change(1).as_ref(), 1).unwrap().len();
        bytes[header + 2 * third + 10] ^= 1;
        std::fs::write(dir.join(LOG_NAME), &bytes).unwrap();
        let refused = file.recover().err().expect("a damaged record mid-log is refused");
        let at = header + 2 * third;
        assert!(refused.to_string().contains(&format!("at byte {at}")), "{refused}");
        // A sequence gap (a record missing) is refused too.
        let mut log = file.start_log().unwrap();
        for seq in [3, 4, 6] {
            log.append(&file.record(&change(seq).as_ref(), seq).unwrap()).unwrap();
        }
        let refused = file.recover().err().expect("a gap is refused");
        assert!(refused.to_string().contains("change 5 is missing"), "{refused}");
        // Starting the log afresh empties it.
        let mut log = file.start_log().unwrap();
        assert_eq!(file.recover().unwrap().changes.len(), 0);
        log.append(&file.record(&change(3).as_ref(), 3).unwrap()).unwrap();
        assert_eq!(file.recover().unwrap().last_seq, 3);
        assert!(!dir.join("cluster.state.tmp").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_state_directory_is_made_or_left_readable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |dir: &Path| std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
        let root = dir("private");
        let fresh = root.join("a").join("state");
        StateFile::open(&fresh, "s").unwrap();
        assert_eq!(mode(&fresh), 0o700);
        let open_to_all = root.join("shared");
        std::fs::create_dir(&open_to_all).unwrap();
        std::fs::set_permissions(&open_to_all, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(open_to_all.join(LOG_NAME), b"").unwrap();
        StateFile::open(&open_to_all, "s").unwrap();
        assert_eq!(
            mode(&open_to_all),
            0o700,
            "a state directory open to others is tightened"
        );
        // A directory that holds other things (a home, /tmp) is not the head's to change.
        let shared = root.join("home");
        std::fs::create_dir(&shared).unwrap();
        std::fs::write(shared.join("notes.txt"), b"mine").unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        StateFile::open(&shared, "s").unwrap();
        assert_eq!(
            std::fs::metadata(&shared).unwrap().permissions().mode() & 0o7777,
            0o1777,
            "left as it is"
        );
    }

    #[test]
    fn one_head_per_state_directory() {
        let dir = dir("lock");
        std::fs::create_dir_all(&dir).unwrap();
        let held = lock(&dir).unwrap();
        match lock(&dir) {
            Err(Error::HeadState { reason, .. }) => assert!(reason.contains("another head"), "{reason}"),
            other => panic!("a second lock was {other:?}"),
        }
        drop(held);
        lock(&dir).expect("free again once the first head is gone");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn torn_corrupt_foreign_and_other_cluster_files_are_refused_with_the_reason() {
        let dir = dir("bad");
        let file = StateFile::open(&dir, "scope-a").unwrap();
        let good = file.encode(&HeadCore::new(3_000, 10_000).snapshot(5), 0).unwrap();
        let refused = |bytes: &[u8]| {
            std::fs::write(file.path(), bytes).unwrap();
            match file.recover() {
                Err(Error::HeadState { reason, .. }) => reason,
                Err(other) => panic!("another error: {other}"),
                Ok(_) => panic!("{} bytes were accepted", bytes.len()),
            }
        };
        for cut in [0, 5, MAGIC.len() + 2, good.len() / 2, good.len() - 1] {
            let reason = refused(&good[..cut]);
            assert!(reason.contains("move it aside"), "{cut}: {reason}");
        }
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        assert!(refused(&flipped).contains("checksum"));
        assert!(refused(b"{\"json\": true, \"padded\": 1}").contains("not a Regatta head state file"));
        let other = StateFile::open(&dir, "scope-b").unwrap();
        std::fs::write(file.path(), &good).unwrap();
        match other.recover() {
            Err(Error::HeadState { reason, .. }) => assert!(reason.contains("another cluster"), "{reason}"),
            _ => panic!("another cluster's state was accepted"),
        }
        // Another cluster's log is refused the same way.
        std::fs::remove_file(file.path()).unwrap();
        file.start_log().unwrap();
        match other.recover() {
            Err(Error::HeadState { reason, path }) => {
                assert!(
                    reason.contains("another cluster") && path.ends_with(LOG_NAME),
                    "{reason}"
                )
            }
            _ => panic!("another cluster's log was accepted"),
        }
        std::fs::remove_file(dir.join(LOG_NAME)).unwrap();
        let mut future = good.clone();
        future[MAGIC.len()] = 9;
        assert!(refused(&future).contains("format version 9"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Bounded fuzzing of the state files' readers: any bytes, and a valid log or
    /// snapshot changed anywhere, are read or refused with a reason, never a panic.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn valid_log(records: u64) -> Vec<u8> {
            let file = StateFile {
                path: PathBuf::from("unused"),
                log: PathBuf::from("unused"),
                scope: "scope".into(),
            };
            let mut bytes = log_header("scope");
            for seq in 1..=records {
                let change = Change::Request {
                    request: regatta_proto::HeadRequest::EndJob(format!("job-{seq}")),
                    answered: true,
                    now_ms: seq,
                };
                bytes.extend(file.record(&change.as_ref(), seq).unwrap());
            }
            bytes
        }

        proptest! {
            #![proptest_config(crate::fuzz_config(256))]

            #[test]
            fn any_bytes_are_read_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
                let _ = decode(&bytes, "scope");
                let _ = read_log(&bytes, "scope", 0);
                let mut with_header = log_header("scope");
                with_header.extend_from_slice(&bytes);
                let _ = read_log(&with_header, "scope", 0);
            }

            #[test]
            fn a_log_changed_or_cut_anywhere_keeps_a_prefix_or_is_refused(
                records in 1u64..8,
                at in any::<prop::sample::Index>(),
                flip in 1u8..=255,
                cut in any::<prop::sample::Index>(),
            ) {
                let good = valid_log(records);
                let (changes, last, dropped) = read_log(&good, "scope", 0).unwrap();
                prop_assert_eq!((changes.len() as u64, last, dropped), (records, records, 0));
                // Cut anywhere after the header: a torn tail, the changes before it kept.
                let header = log_header("scope").len();
                let end = header + cut.index(good.len() - header + 1);
                let (kept, last, _) = read_log(&good[..end], "scope", 0).unwrap();
                prop_assert_eq!(kept.len() as u64, last);
                prop_assert!(last <= records);
                // Changed anywhere: refused, or the changes read are an unchanged prefix
                // (never a changed change: each record has its checksum).
                let mut bad = good.clone();
                let i = at.index(bad.len());
                bad[i] ^= flip;
                if let Ok((read, _, _)) = read_log(&bad, "scope", 0) {
                    prop_assert!(read.len() as u64 <= records);
                    for (got, want) in read.iter().zip(changes.iter()) {
                        prop_assert_eq!(format!("{got:?}"), format!("{want:?}"));
                    }
                }
            }
        }
    }
}
