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
mod remote;
mod units;

pub use listing::plan;

pub use remote::{RangedRead, Remote};
use units::{Next, UnitRows};

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use regatta_object_store::Place;
use regatta_trainer::documents::{Record, TokenizerSettings, IGNORE};
use regatta_trainer::stream::{DataPlan, LoaderState, Part, ShardState};

use crate::data::{encode_record, TextTokenizer};
use crate::error::{Error, Result};

/// A row that could not be used, for the rank's report.
#[derive(Clone, Debug, PartialEq)]
pub struct Skipped {
    /// `url@offset` and why.
    pub what: String,
}

/// A document pulled from a shard, with the shard's state before it.
struct Pulled {
    before: ShardState,
    source: usize,
    key: String,
    record: Record,
}

/// One logical shard's documents, in the plan's order, from a state.
struct ShardReader {
    plan: Arc<DataPlan>,
    shard: usize,
    state: ShardState,
    open: Vec<Option<UnitRows>>,
    places: Vec<Place>,
    handle: tokio::runtime::Handle,
    weights: Vec<f64>,
    skipped: Vec<Skipped>,
    /// Per source: whether a document came out since an epoch was entered at its start
    /// (`None`: entered mid-epoch, unknown).
    yielded: Vec<Option<bool>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl ShardReader {
    fn new(
        plan: Arc<DataPlan>,
        shard: usize,
        state: ShardState,
        handle: tokio::runtime::Handle,
        stop: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Self> {
        let places = plan
            .sources
            .iter()
            .map(|s| Place::dir(&s.url).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        let weights = plan.sources.iter().map(|s| s.weight).collect();
        let yielded = state
            .sources
            .iter()
            .map(|c| (c.unit == 0 && c.docs == 0).then_some(false))
            .collect();
        Ok(Self {
            yielded,
            stop,
            open: (0..plan.sources.len()).map(|_| None).collect(),
            plan,
            shard,
            state,
            places,
            handle,
            weights,
            skipped: Vec::new(),
        })
    }

    /// The next document, `None` once the shard is exhausted (or the loader stops); an
    /// error when a unit could not be fetched.
    fn next_doc(&mut self) -> Result<Option<Pulled>> {
        loop {
            if self.stop.load(std::sync::atomic::Ordering::Relaxed) {
                return Ok(None);
            }
            let mut before = self.state.clone();
            before.partial = 0;
            let Some(source) = self.state.pick(&self.weights) else {
                return Ok(None);
            };
            let unit = self.plan.unit(source, self.shard, &self.state.sources[source]);
            let file = &self.plan.sources[source].files[unit.file as usize];
            if self.open[source].is_none() {
                let remote = Remote::new(
                    self.places[source].clone(),
                    file.name.clone(),
                    file.size,
                    self.handle.clone(),
                );
                self.open[source] = Some(UnitRows::open(remote, file, unit, &self.state.sources[source]));
            }
            let url = format!("{}/{}", self.plan.sources[source].url, file.name);
            let Some(rows) = self.open[source].as_mut() else {
                return Ok(None);
            };
            match rows.next() {
                Next::Row(raw) => {
                    let cursor = &mut self.state.sources[source];
                    cursor.docs += 1;
                    cursor.offset = raw.next;
                    let url = match unit.part {
                        Part::RowGroup(group) => format!("{url}#{group}"),
                        _ => url,
                    };
                    let record = raw.row.and_then(|v| Record::parse(&v).map_err(|e| e.to_string()));
                    match record {
                        Ok(record) => {
                            if self.yielded[source].is_some() {
                                self.yielded[source] = Some(true);
                            }
                            return Ok(Some(Pulled {
                                before,
                                source,
                                key: format!("{url}@{}", raw.offset),
                                record,
                            }));
                        }
                        Err(reason) => self.skipped.push(Skipped {
                            what: format!("{url}@{}: {reason}", raw.offset),
                        }),
                    }
                }
                Next::Broken {
                    reason, storage: true, ..
                } => {
                    return Err(Error::Storage(format!("{url}: {reason}")));
                }
                Next::Broken { offset, reason, .. } => self.skipped.push(Skipped {
                    // Parquet offsets are rows of the row group.
                    what: format!("{url}@{offset}: unreadable, the rest of the unit is skipped: {reason}"),
                }),
                Next::End => {
                    self.open[source] = None;
                    let epoch = self.state.sources[source].epoch;
                    self.plan.next_unit(source, self.shard, &mut self.state.sources[source]);
                    let cursor = &mut self.state.sources[source];
                    if cursor.epoch != epoch {
                        if self.yielded[source] == Some(false) && !cursor.done {
                            // A whole pass gave nothing: repeating it would spin forever.
                            cursor.done = true;
                            self.skipped.push(Skipped {
                                what: format!(
                                    "{}: shard {} read every unit of this source and found no usable row; the \
                                     source is done for this shard",
                                    self.plan.sources[source].url, self.shard
                                ),
                            });
                        }
                        self.yielded[source] = Some(false);
                    }
                }
            }
        }
    }
}

/// One training row of a shard, with the shard's state after it and the documents that
/// start in it.
#[derive(Clone, Debug)]
pub struct Row {
    /// Input ids.
    pub inputs: Vec<i64>,
    /// Target ids or [`IGNORE`].
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

struct Pending {
    before: ShardState,
    start: u64,
    len: u64,
    skip: u64,
    key: String,
    counted: bool,
}

/// A shard's documents, tokenized and packed into rows of `context` inputs (row k reads
/// stream tokens `k*context ..= (k+1)*context`, as [`regatta_trainer::Packed`]).
struct ShardPacker {
    reader: ShardReader,
    context: u64,
    tokenizer: Arc<TextTokenizer>,
    settings: Arc<TokenizerSettings>,
    tokens: VecDeque<(i64, bool, u32)>,
    base: u64,
    pending: VecDeque<Pending>,
    next_row: u64,
    resume_skip: u64,
    exhausted: bool,
    documents: u32,
}

impl ShardPacker {
    fn end(&self) -> u64 {
        self.base + self.tokens.len() as u64
    }

    fn pull(&mut self) -> Result<()> {
        let Some(pulled) = self.reader.next_doc()? else {
            self.exhausted = true;
            return Ok(());
        };
        let document = match encode_record(&self.tokenizer, &self.settings, &pulled.record) {
            Ok(document) => document,
            Err(e) => {
                // A template that does not render, text the tokenizer refuses: this row only.
                self.reader.skipped.push(Skipped {
                    what: format!("{}: {e}", pulled.key),
                });
                return Ok(());
            }
        };
        self.reader.state.chosen[pulled.source] += document.tokens.len() as u64;
        let skip = std::mem::take(&mut self.resume_skip).min(document.tokens.len() as u64);
        self.documents = self.documents.wrapping_add(1);
        let start = self.end();
        let id = self.documents;
        self.tokens.extend(
            document
                .tokens
                .iter()
                .zip(&document.loss)
                .skip(skip as usize)
                .map(|(t, l)| (*t, *l, id)),
        );
        self.pending.push_back(Pending {
            before: pulled.before,
            start,
            len: document.tokens.len() as u64 - skip,
            skip,
            key: pulled.key,
            counted: skip > 0,
        });
        Ok(())
    }

    /// The next row, or `None` once the shard's last document is trained on.
    fn next_row(&mut self) -> Result<Option<Row>> {
        let (c, s) = (self.context, self.next_row);
        // One token past the row, so a stream ending right at its last target is known
        // to end there.
        while !self.exhausted && self.end() <= s + c + 1 {
            self.pull()?;
        }
        // Left alone, the last token (the previous row's last target) would make a row
        // with no target: the row before counted its document already.
        if self.end() <= s + 1 && self.exhausted {
            return Ok(None);
        }
        let at = |i: u64| self.tokens.get((i - self.base) as usize).copied();
        let pad = self.documents.wrapping_add(1);
        let mut row = Row {
            inputs: Vec::with_capacity(c as usize),
            targets: Vec::with_capacity(c as usize),
            documents: Vec::with_capacity(c as usize),
            shard: self.reader.shard,
            state: ShardState::default(),
            keys: Vec::new(),
        };
        for i in s..s + c {
            match at(i) {
                Some((token, _, doc)) => {
                    row.inputs.push(token);
                    row.documents.push(i64::from(doc));
                    row.targets.push(match at(i + 1) {
                        Some((next, true, next_doc)) if next_doc == doc => next,
                        _ => IGNORE,
                    });
                }
                None => {
                    row.inputs.push(0);
                    row.documents.push(i64::from(pad));
                    row.targets.push(IGNORE);
                }
            }
        }
        // A document starting at the row's last target is counted here when nothing
        // follows it (no next row will have it as an input).
        let horizon = if self.exhausted && self.end() == s + c + 1 {
            s + c + 1
        } else {
            s + c
        };
        for p in self.pending.iter_mut().filter(|p| p.start < horizon && !p.counted) {
            p.counted = true;
            row.keys.push(p.key.clone());
        }
        let e = s + c;
        self.next_row = e;
        row.state = match self.pending.iter().find(|p| p.start <= e && e < p.start + p.len) {
            Some(p) => ShardState {
                partial: e - p.start + p.skip,
                ..p.before.clone()
            },
            None => {
                let mut state = self.reader.state.clone();
                state.partial = 0;
                state
            }
        };
        while self.pending.front().is_some_and(|p| p.start + p.len <= e && p.counted) {
            self.pending.pop_front();
        }
        let drop = (e.min(self.end()) - self.base) as usize;
        self.tokens.drain(..drop);
        self.base += drop as u64;
        Ok(Some(row))
    }
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
        let states: Vec<(usize, ShardState)> = spec.shards.clone().map(|s| (s, spec.state.shards[s].clone())).collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut packers = Vec::with_capacity(states.len());
        for (shard, state) in &states {
            let resume_skip = state.partial;
            packers.push(ShardPacker {
                reader: ShardReader::new(spec.plan.clone(), *shard, state.clone(), handle.clone(), stop.clone())?,
                context: spec.context as u64,
                tokenizer: tokenizer.clone(),
                settings: settings.clone(),
                tokens: VecDeque::new(),
                base: 0,
                pending: VecDeque::new(),
                next_row: 0,
                resume_skip,
                exhausted: false,
                documents: 0,
            });
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
            .spawn(move || {
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
            })
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
                        targets: vec![IGNORE; self.context],
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

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop();
    }
}
