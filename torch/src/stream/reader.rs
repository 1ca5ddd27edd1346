//! One logical shard's documents in the plan's order: the weighted pick of a source, its
//! current unit opened and read row by row, unusable rows skipped with their file and
//! offset, and the shard's cursors moved past every row read.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use regatta_object_store::Place;
use regatta_trainer::stream::{DataPlan, Part, ShardState, Unit};
use regatta_trainer::Record;

use super::units::{BadRow, Next, RawRow, UnitRows};
use super::{Remote, Skipped};
use crate::error::{Error, Result};

/// A document pulled from a shard, with the shard's state before it.
pub(super) struct Pulled {
    pub(super) before: ShardState,
    pub(super) source: usize,
    pub(super) key: String,
    pub(super) record: Record,
}

/// One logical shard's documents, in the plan's order, from a state.
pub(super) struct ShardReader {
    plan: Arc<DataPlan>,
    pub(super) shard: usize,
    pub(super) state: ShardState,
    open: Vec<Option<UnitRows>>,
    places: Vec<Place>,
    handle: tokio::runtime::Handle,
    weights: Vec<f64>,
    pub(super) skipped: Vec<Skipped>,
    /// Per source: whether a document came out since an epoch was entered at its start
    /// (`None`: entered mid-epoch, unknown).
    yielded: Vec<Option<bool>>,
    stop: Arc<AtomicBool>,
}

impl ShardReader {
    pub(super) fn new(
        plan: Arc<DataPlan>,
        shard: usize,
        state: ShardState,
        handle: tokio::runtime::Handle,
        stop: Arc<AtomicBool>,
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
    pub(super) fn next_doc(&mut self) -> Result<Option<Pulled>> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let mut before = self.state.clone();
            before.partial = 0;
            let Some(source) = self.state.pick(&self.weights) else {
                return Ok(None);
            };
            let unit = self.plan.unit(source, self.shard, &self.state.sources[source]);
            let url = self.open_unit(source, unit);
            let Some(rows) = self.open[source].as_mut() else {
                return Ok(None);
            };
            match rows.next() {
                Next::Row(raw) => {
                    if let Some(pulled) = self.take_row(source, unit.part, &url, raw, before) {
                        return Ok(Some(pulled));
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
                Next::End => self.end_unit(source),
            }
        }
    }

    /// Opens `source`'s current `unit` unless it is open; returns its file's URL.
    fn open_unit(&mut self, source: usize, unit: Unit) -> String {
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
        format!("{}/{}", self.plan.sources[source].url, file.name)
    }

    /// Moves `source`'s cursor past a row read from `url`: the row as a document, or
    /// `None` when it is unusable (skipped, with its key and reason).
    fn take_row(&mut self, source: usize, part: Part, url: &str, raw: RawRow, before: ShardState) -> Option<Pulled> {
        let cursor = &mut self.state.sources[source];
        cursor.docs += 1;
        cursor.offset = raw.next;
        let url = match part {
            Part::RowGroup(group) => format!("{url}#{group}"),
            _ => url.to_string(),
        };
        match raw.row.and_then(|v| Record::parse(&v).map_err(BadRow::Record)) {
            Ok(record) => {
                if self.yielded[source].is_some() {
                    self.yielded[source] = Some(true);
                }
                Some(Pulled {
                    before,
                    source,
                    key: format!("{url}@{}", raw.offset),
                    record,
                })
            }
            Err(reason) => {
                self.skipped.push(Skipped {
                    what: format!("{url}@{}: {reason}", raw.offset),
                });
                None
            }
        }
    }

    /// Closes `source`'s unit and moves to its next; a whole epoch of it that gave no
    /// document ends the source for this shard.
    fn end_unit(&mut self, source: usize) {
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
