//! Writing the head's state down and reading it back: the state files opened at start and
//! the core recovered from them, each change logged as a group commit on a thread of its
//! own, answers held until their change is on disk, and a snapshot when the log is long.

use std::path::Path;
use std::time::{Duration, Instant};

use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};
use regatta_proto::{ChangeRef, HeadCore, Saved};

use super::state_file::{self, StateFile};
use super::{HeadConfig, HEAD_NODE};
use crate::error::Result;
use crate::net::wire::{LocalSignal, Wire};

/// Opens the head's state under `dir` (one head per directory: the lock is held while the
/// head runs) and recovers what it holds, then writes it back as one snapshot, so the log
/// starts empty.
pub(super) fn open(dir: &Path, scope: &str, config: &HeadConfig) -> Result<(Recovery, std::fs::File)> {
    let file = StateFile::open(dir, scope)?;
    let lock = state_file::lock(dir)?;
    let (core, now, seq) = recover(&file, config.heartbeat_timeout_ms, config.object_grace_ms)?;
    let encoding = Instant::now();
    let snapshot = file.encode(&core.snapshot(now), seq)?;
    observe_snapshot("recovery", encoding.elapsed(), snapshot.len());
    file.write(&snapshot)?;
    let log = file.start_log()?;
    let recovery = Recovery {
        file,
        log,
        core,
        now,
        seq,
    };
    Ok((recovery, lock))
}

/// A head's state read back at start, and its files, ready to log the next change.
pub(super) struct Recovery {
    pub(super) file: StateFile,
    pub(super) log: state_file::LogWriter,
    pub(super) core: HeadCore,
    /// The clock to go on from.
    pub(super) now: u64,
    /// The sequence number of the last change in the snapshot.
    pub(super) seq: u64,
}

/// Writing the state down, as a group commit: each change is encoded as a log record,
/// and the records are handed to the writer thread at once, unless a write is under way,
/// in which case the records made meanwhile go together in the next write, when that one
/// is done. Answers to requests that changed the state are held until a write that
/// includes their change is on disk: whatever the head acknowledged, a restarted head
/// knows. Past [`state_file::CHECKPOINT_BYTES`] of log, a snapshot follows the records.
pub(super) struct Persist {
    file: StateFile,
    writer: tokio::sync::mpsc::UnboundedSender<Write>,
    /// An append is under way.
    writing: bool,
    /// Records not handed to the writer yet.
    pending: Vec<u8>,
    /// Answers waiting for those records.
    pub(super) held: Vec<(RpcReplyPort<Vec<u8>>, Vec<u8>)>,
    /// The sequence number of the last change recorded.
    seq: u64,
    /// Log bytes handed over since the last snapshot.
    since_checkpoint: u64,
}

impl Persist {
    /// Starts the writer thread of `recovery`'s files; it tells `head` each time a write
    /// is done. Returns the core recovered, the clock to go on from and the writing state.
    pub(super) fn start(
        recovery: Recovery,
        head: ActorRef<Wire>,
    ) -> std::result::Result<(HeadCore, u64, Self), ActorProcessingErr> {
        let Recovery {
            file,
            log,
            core,
            now,
            seq,
        } = recovery;
        let (writer, writes) = tokio::sync::mpsc::unbounded_channel();
        start_writer(file.clone(), log, writes, head)?;
        let persist = Persist {
            file,
            writer,
            writing: false,
            pending: Vec::new(),
            held: Vec::new(),
            seq,
            since_checkpoint: 0,
        };
        Ok((core, now, persist))
    }

    /// Hands the writer thread the last records and answers (it finishes what it was
    /// handed when the head stops).
    pub(super) fn flush(&mut self) {
        let bytes = std::mem::take(&mut self.pending);
        let answers = std::mem::take(&mut self.held);
        if !bytes.is_empty() || !answers.is_empty() {
            let _ = self.writer.send(Write::Append { bytes, answers });
        }
    }
}

/// Work for the writer thread.
enum Write {
    /// Records to append, and the answers to send once they are on disk.
    Append {
        bytes: Vec<u8>,
        answers: Vec<(RpcReplyPort<Vec<u8>>, Vec<u8>)>,
    },
    /// A snapshot including every record appended before it; the log starts afresh.
    Checkpoint(Vec<u8>),
}

impl Persist {
    /// Logs a change (written with the next append).
    pub(super) fn record(&mut self, change: &ChangeRef<'_>) {
        match self.file.record(change, self.seq + 1) {
            Ok(bytes) => {
                self.seq += 1;
                self.pending.extend_from_slice(&bytes);
            }
            Err(e) => {
                tracing::error!(error = %e, "could not encode a change of the head's state; a restarted head would miss it")
            }
        }
    }

    /// After a change: hands the records to the writer now, or after the write under way.
    pub(super) fn commit(&mut self, core: &HeadCore, now: u64) {
        if !self.writing {
            self.send_records(core, now);
        }
    }

    /// Hands the records made so far to the writer, and a snapshot of `core` once the log
    /// has grown past [`state_file::CHECKPOINT_BYTES`].
    fn send_records(&mut self, core: &HeadCore, now: u64) {
        if self.pending.is_empty() && self.held.is_empty() {
            return;
        }
        let bytes = std::mem::take(&mut self.pending);
        self.since_checkpoint += bytes.len() as u64;
        let answers = std::mem::take(&mut self.held);
        self.writing = self.writer.send(Write::Append { bytes, answers }).is_ok();
        if self.since_checkpoint >= state_file::CHECKPOINT_BYTES {
            self.since_checkpoint = 0;
            let encoding = Instant::now();
            match self.file.encode(&core.snapshot(now), self.seq) {
                Ok(snapshot) => {
                    observe_snapshot("log-full", encoding.elapsed(), snapshot.len());
                    let _ = self.writer.send(Write::Checkpoint(snapshot));
                }
                Err(e) => tracing::error!(error = %e, "could not encode the head's state; its log keeps growing"),
            }
        }
    }

    /// The writer finished an append: the records made meanwhile go next.
    pub(super) fn written(&mut self, core: &HeadCore, now: u64) {
        self.writing = false;
        self.send_records(core, now);
    }
}

/// The head's core read back from its state files: the snapshot, then the changes logged
/// after it. Returns the core, the clock to go on from and the last change's number.
fn recover(file: &StateFile, heartbeat_timeout_ms: u64, object_grace_ms: u64) -> Result<(HeadCore, u64, u64)> {
    let started = Instant::now();
    let recovered = file.recover()?;
    let restored = recovered.saved.is_some() || !recovered.changes.is_empty();
    let mut clock = recovered.saved.as_ref().map_or(0, Saved::saved_at_ms);
    let mut core = match recovered.saved {
        Some(saved) => HeadCore::restore(saved, heartbeat_timeout_ms, object_grace_ms),
        None => HeadCore::new(heartbeat_timeout_ms, object_grace_ms),
    };
    let replayed = recovered.changes.len();
    for change in recovered.changes {
        clock = clock.max(change.now_ms());
        core.replay(change);
    }
    // One millisecond on, so that nothing restored reads as happening "now".
    let now = clock + 1;
    if recovered.dropped_bytes > 0 {
        tracing::warn!(
            bytes = recovered.dropped_bytes,
            "the head's change log ends in a record cut short (the head stopped while writing it); its request was never answered, and it is dropped"
        );
    }
    if !restored {
        tracing::info!(file = %file.path().display(), "keeping the cluster's state; a head started again on it takes the cluster back");
        return Ok((core, now, recovered.last_seq));
    }
    // The head's own store held its copies in memory: they went with the old process.
    let lost = core.objects_lost_with(HEAD_NODE, now);
    core.await_rejoin(now);
    let status = core.status(now);
    tracing::info!(
        file = %file.path().display(),
        replayed,
        nodes = status.nodes.iter().filter(|n| n.state != "dead").count(),
        actors = status.actors.len(),
        groups = status.groups.len(),
        objects = status.objects.objects,
        millis = started.elapsed().as_millis() as u64,
        "took the cluster's state back; its nodes register again with the actors they run, and nothing new is placed until they have (or time out)"
    );
    if lost > 0 {
        tracing::warn!(objects = lost, "objects held only in the old head's own store are lost");
    }
    Ok((core, now, recovered.last_seq))
}

/// Where records are appended; the head's change log, or a stand-in in tests.
trait Append {
    fn append(&mut self, bytes: &[u8]) -> Result<()>;
}

impl Append for state_file::LogWriter {
    fn append(&mut self, bytes: &[u8]) -> Result<()> {
        state_file::LogWriter::append(self, bytes)
    }
}

/// The first wait after a failed append; each next one doubles, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between two tries of a failed append.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Appends `bytes`, trying again after a growing wait for as long as the append fails
/// (a full disk, an I/O error), so that no acknowledged change is ever missing from the
/// log: the answers that wait on these records go out only once they are on disk, and a
/// gap would make a restarted head stop its replay there. Returns the failures it rode
/// out. `wait` sleeps (the tests' stand-in counts instead).
fn append_until_written(log: &mut impl Append, bytes: &[u8], mut wait: impl FnMut(Duration)) -> u32 {
    let mut failures = 0;
    let mut pause = RETRY_FIRST;
    loop {
        match log.append(bytes) {
            Ok(()) => {
                if failures > 0 {
                    tracing::info!(failures, "the head's state is written again; held answers go out now");
                }
                return failures;
            }
            Err(e) => {
                if failures == 0 {
                    tracing::error!(error = %e, "cannot write the head's state; the requests that changed it wait for their answers until it is written (free the disk or fix the error), trying again every few seconds");
                }
                failures += 1;
                wait(pause);
                pause = (pause * 2).min(RETRY_MAX);
            }
        }
    }
}

/// Starts the thread that writes the head's state: appends records and flushes them, then
/// sends the answers they made durable and tells the head it is done; writes snapshots
/// and empties the log. A failed append is tried again until it is written
/// ([`append_until_written`]): the answers wait, never the durability.
fn start_writer(
    file: StateFile,
    mut log: state_file::LogWriter,
    mut writes: tokio::sync::mpsc::UnboundedReceiver<Write>,
    head: ActorRef<Wire>,
) -> std::result::Result<(), ActorProcessingErr> {
    std::thread::Builder::new()
        .name("regatta-head-state".into())
        .spawn(move || {
            while let Some(write) = writes.blocking_recv() {
                match write {
                    Write::Append { bytes, answers } => {
                        append_until_written(&mut log, &bytes, std::thread::sleep);
                        for (port, answer) in answers {
                            let _ = port.send(answer);
                        }
                        if head.send_message(Wire::Local(LocalSignal::Written)).is_err() {
                            break;
                        }
                    }
                    Write::Checkpoint(snapshot) => match file.write(&snapshot) {
                        Ok(()) => {
                            if let Err(e) = log.truncate() {
                                tracing::error!(error = %e, "could not empty the head's change log after a snapshot");
                            }
                        }
                        // The log still holds everything: keep it.
                        Err(e) => tracing::error!(error = %e, "could not write a snapshot of the head's state; its log keeps growing"),
                    },
                }
            }
        })
        .map(|_| ())
        .map_err(|e| ActorProcessingErr::from(format!("cannot start the head's state writer: {e}")))
}

/// Records how long encoding a snapshot held the head's loop.
pub(super) fn observe_snapshot(when: &str, took: Duration, bytes: usize) {
    crate::metrics::metrics()
        .head_snapshot_seconds
        .with_label_values(&[when])
        .observe(took.as_secs_f64());
    tracing::info!(
        when,
        bytes,
        millis = took.as_millis() as u64,
        "encoded a snapshot of the cluster's state"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log that fails its first `failing` appends, then keeps what it is given.
    struct Flaky {
        failing: u32,
        kept: Vec<u8>,
        tries: u32,
    }

    impl Append for Flaky {
        fn append(&mut self, bytes: &[u8]) -> Result<()> {
            self.tries += 1;
            if self.tries <= self.failing {
                let full = std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left on device");
                return Err(crate::error::Error::Io {
                    context: "cannot append".into(),
                    cause: full,
                });
            }
            self.kept.extend_from_slice(bytes);
            Ok(())
        }
    }

    #[test]
    fn a_failed_append_is_tried_again_until_written_with_growing_waits() {
        let mut log = Flaky {
            failing: 7,
            kept: Vec::new(),
            tries: 0,
        };
        let mut waits = Vec::new();
        let failures = append_until_written(&mut log, b"record", |pause| waits.push(pause));
        assert_eq!(failures, 7);
        assert_eq!(log.kept, b"record", "written once, whole, after the failures");
        let millis: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(millis, [100, 200, 400, 800, 1600, 3200, 5000]);
    }

    #[test]
    fn an_append_that_works_waits_for_nothing() {
        let mut log = Flaky {
            failing: 0,
            kept: Vec::new(),
            tries: 0,
        };
        let failures = append_until_written(&mut log, b"r", |_| panic!("no wait when the append works"));
        assert_eq!((failures, log.tries, log.kept.as_slice()), (0, 1, &b"r"[..]));
    }
}
