//! The streaming loader's reading side: sources listed through `object_store`, units read
//! with ranged requests (the next range fetched while the current one is parsed), rows of
//! JSONL (plain, zstd, gzip) and Parquet parsed, tokenized and packed per logical shard,
//! in a background thread per rank that stays `data.prefetch` rows ahead of training.
//! The layout, the cursors and the weighting are [`regatta_trainer::stream`]'s; this module
//! moves the bytes. Memory is bounded by the prefetch, one read range per open unit and
//! one Parquet row group, never by the dataset's size.
//!
//! A row that does not parse, a corrupt or truncated compressed file or row group is
//! skipped, counted, and reported with its file and offset (the rest of the unit is
//! skipped when its bytes cannot be read); a source with no readable file is an error.

mod listing;
mod packer;
mod reader;
mod remote;
mod units;

pub use listing::plan;

pub use remote::{RangedRead, Remote};

use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use regatta_trainer::stream::{DataPlan, LoaderState, ShardState};
use regatta_trainer::{TokenizerSettings, IGNORE_INDEX};

use crate::data::TextTokenizer;
use crate::error::{Error, Result};
use packer::ShardPacker;
use reader::ShardReader;

/// A row that could not be used, for the rank's report.
#[derive(Clone, Debug, PartialEq)]
pub struct Skipped {
    /// `url@offset` and why.
    pub what: String,
}

/// One training row of a shard, with the shard's state after it and the documents that
/// start in it.
#[derive(Clone, Debug)]
pub struct Row {
    /// Input ids.
    pub inputs: Vec<i64>,
    /// Target ids or [`IGNORE_INDEX`].
    pub targets: Vec<i64>,
    /// Each input's document (attention stays inside one).
    pub documents: Vec<i64>,
    /// The shard it came from.
    pub shard: usize,
    /// The shard's state once this row is trained on.
    pub state: ShardState,
    /// Keys (`url@offset`) of the documents whose first token is an input of this row.
    pub keys: Vec<String>,
}

/// What the background thread hands the training loop.
enum Item {
    Row(Box<Row>),
    /// Every shard of the rank is exhausted.
    End,
    Failed(Error),
}

/// Where a rank's loader starts.
pub struct LoaderSpec {
    /// The dataset.
    pub plan: Arc<DataPlan>,
    /// Every shard's state (the start, or a checkpoint's).
    pub state: LoaderState,
    /// The shards this rank reads.
    pub shards: Range<usize>,
    /// Tokens per row input.
    pub context: usize,
    /// Rows to read ahead.
    pub prefetch: usize,
    /// The shard the rank took its last row from before (a checkpoint of the same world
    /// size): the round-robin over its shards continues after it. `None`: from the first.
    pub after: Option<usize>,
}

/// A rank's loader: a background thread reading, tokenizing and packing its shards'
/// rows in a fixed order (round-robin over shards that have rows left), a bounded
/// channel of rows, and the state of every shard as of the rows taken so far.
pub struct Loader {
    thread: Option<std::thread::JoinHandle<()>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    rx: Receiver<Item>,
    peeked: Option<Item>,
    states: Vec<(usize, ShardState)>,
    context: usize,
    fingerprint: u64,
    last_shard: Option<usize>,
    skipped: Arc<std::sync::Mutex<Vec<Skipped>>>,
}

impl Loader {
    /// Starts the background thread; ranged reads run on `handle`'s runtime.
    pub fn start(
        spec: LoaderSpec,
        tokenizer: Arc<TextTokenizer>,
        settings: Arc<TokenizerSettings>,
        handle: tokio::runtime::Handle,
    ) -> Result<Self> {
        check_state(&spec)?;
        let states: Vec<(usize, ShardState)> = spec.shards.clone().map(|s| (s, spec.state.shards[s].clone())).collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut packers = Vec::with_capacity(states.len());
        for (shard, state) in &states {
            let reader = ShardReader::new(spec.plan.clone(), *shard, state.clone(), handle.clone(), stop.clone())?;
            let (tokenizer, settings) = (tokenizer.clone(), settings.clone());
            packers.push(ShardPacker::new(
                reader,
                spec.context as u64,
                tokenizer,
                settings,
                state.partial,
            ));
        }
        let (tx, rx) = sync_channel(spec.prefetch.max(1));
        let skipped = Arc::new(std::sync::Mutex::new(Vec::new()));
        let report = skipped.clone();
        let first = spec
            .after
            .filter(|s| spec.shards.contains(s))
            .map_or(0, |s| s - spec.shards.start + 1);
        let thread = std::thread::Builder::new()
            .name("regatta-loader".into())
            .spawn(move || send_rows(packers, first, &tx, &report))
            .map_err(|e| Error::Dataset(format!("cannot start the loader thread: {e}")))?;
        Ok(Self {
            stop,
            thread: Some(thread),
            rx,
            peeked: None,
            states,
            context: spec.context,
            fingerprint: spec.plan.fingerprint,
            last_shard: spec.after,
            skipped,
        })
    }

    fn recv(&mut self) -> Item {
        match self.peeked.take() {
            Some(item) => item,
            // The thread sends End before it ends; a closed channel without one is a crash.
            None => self
                .rx
                .recv()
                .unwrap_or_else(|_| Item::Failed(Error::Dataset("the loader thread ended unexpectedly".into()))),
        }
    }

    /// The next `n` rows; once every shard is exhausted, rows of padding (no loss).
    pub fn take(&mut self, n: usize) -> Result<Vec<Row>> {
        let mut rows = Vec::with_capacity(n);
        for _ in 0..n {
            match self.recv() {
                Item::Row(row) => {
                    if let Some(slot) = self.states.iter_mut().find(|(s, _)| *s == row.shard) {
                        slot.1 = row.state.clone();
                    }
                    self.last_shard = Some(row.shard);
                    rows.push(*row);
                }
                Item::End => {
                    self.peeked = Some(Item::End);
                    rows.push(Row {
                        inputs: vec![0; self.context],
                        targets: vec![IGNORE_INDEX; self.context],
                        documents: vec![0; self.context],
                        shard: usize::MAX,
                        state: ShardState::default(),
                        keys: Vec::new(),
                    });
                }
                Item::Failed(e) => {
                    self.peeked = Some(Item::Failed(Error::Dataset(e.to_string())));
                    return Err(e);
                }
            }
        }
        Ok(rows)
    }

    /// Whether a row of data is left (waits for the background thread to know).
    pub fn has_more(&mut self) -> bool {
        let item = self.recv();
        let more = matches!(item, Item::Row(_));
        self.peeked = Some(item);
        more
    }

    /// The dataset's fingerprint the states belong to.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The shard of the last row taken (what [`LoaderSpec::after`] resumes after).
    pub fn last_shard(&self) -> Option<usize> {
        self.last_shard
    }

    /// The state of this rank's shards as of the rows taken.
    pub fn states(&self) -> Vec<(usize, ShardState)> {
        self.states.clone()
    }

    /// Stops the background thread and waits for it (it ends at its next row): its
    /// reads must not outlive the runtime they run on.
    pub fn stop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (_, rx) = sync_channel(1);
        drop(std::mem::replace(&mut self.rx, rx));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Rows skipped since the last call, with file, offset and reason.
    pub fn take_skipped(&self) -> Vec<Skipped> {
        std::mem::take(&mut *self.skipped.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Refuses a saved state the plan cannot continue: files changed since, or another
/// number of shards.
fn check_state(spec: &LoaderSpec) -> Result<()> {
    if spec.state.fingerprint != spec.plan.fingerprint {
        return Err(Error::Dataset(
            "the dataset's files changed since the checkpoint was written (names or sizes differ): its cursors \
             would skip or repeat data; restore the files or start a new checkpoint.dir"
                .into(),
        ));
    }
    if spec.state.shards.len() != spec.plan.shards || spec.shards.end > spec.plan.shards {
        return Err(Error::Dataset(format!(
            "the saved loader state has {} shards, the plan {}",
            spec.state.shards.len(),
            spec.plan.shards
        )));
    }
    Ok(())
}

/// The background thread: rows round-robin over the shards that have rows left, from the
/// `first`, until all are exhausted (then `End`), one fails, or the loader goes away.
fn send_rows(mut packers: Vec<ShardPacker>, first: usize, tx: &SyncSender<Item>, report: &Mutex<Vec<Skipped>>) {
    let k = packers.len().max(1);
    let mut next = first % k;
    let mut done = vec![false; packers.len()];
    loop {
        let mut sent = false;
        for tries in 0..packers.len() {
            let i = (next + tries) % k;
            if done[i] {
                continue;
            }
            let outcome = packers[i].next_row();
            let fresh = std::mem::take(&mut packers[i].reader.skipped);
            if !fresh.is_empty() {
                report.lock().unwrap_or_else(|p| p.into_inner()).extend(fresh);
            }
            match outcome {
                Ok(Some(row)) => {
                    if tx.send(Item::Row(Box::new(row))).is_err() {
                        return;
                    }
                    next = i + 1;
                    sent = true;
                    break;
                }
                Ok(None) => done[i] = true,
                Err(e) => {
                    let _ = tx.send(Item::Failed(e));
                    return;
                }
            }
        }
        if !sent {
            let _ = tx.send(Item::End);
            return;
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop();
    }
}
