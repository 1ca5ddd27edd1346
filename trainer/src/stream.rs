//! The streaming dataset's layout and state, independent of the world size.
//!
//! A dataset is one or more sources (`[[data.sources]]`: a folder, an object-store prefix
//! or a file, with a weight). Each source's files are cut into *units* (a byte range of an
//! uncompressed JSONL file, a Parquet row group, or a whole compressed file), the units
//! are shuffled with the run's seed and dealt round-robin to a fixed number of *logical
//! shards*. A shard is a deterministic stream of documents: per source, its units in a
//! seeded order per epoch, documents in file order inside a unit, sources interleaved by
//! weight (the source furthest below its share of tokens goes next). Its position is a
//! [`ShardState`] — a cursor per source plus how far into the current document the next
//! training row starts — so a checkpoint holds every shard's state and a run resumed on
//! any world size continues each shard where it stopped: ranks own contiguous ranges of
//! shards ([`rank_shards`]).
//!
//! Pure: listings in, plans, orders and cursors out. Reading is `regatta-torch`'s.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::collective::chunks;
use crate::error::Error;

/// Smallest and largest byte range of an uncompressed JSONL file that makes one unit.
pub const UNIT_BYTES: Range<u64> = 4 << 10..16 << 20;
/// Units per shard the byte ranges aim at, so shards get similar amounts of data.
const UNITS_PER_SHARD: u64 = 4;

/// How a file's rows are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    /// One JSON object per line.
    Jsonl,
    /// Apache Parquet.
    Parquet,
}

/// How a file's bytes are compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// Plain.
    None,
    /// Zstandard (`.zst`, `.zstd`).
    Zstd,
    /// Gzip (`.gz`).
    Gzip,
}

/// What a file name says about its format, or `None` for a file that holds no rows the
/// loader reads (it is listed as skipped).
pub fn file_kind(name: &str) -> Option<(FileKind, Compression)> {
    let lower = name.to_ascii_lowercase();
    let (stem, compression) = if let Some(stem) = lower.strip_suffix(".zst").or(lower.strip_suffix(".zstd")) {
        (stem, Compression::Zstd)
    } else if let Some(stem) = lower.strip_suffix(".gz") {
        (stem, Compression::Gzip)
    } else {
        (lower.as_str(), Compression::None)
    };
    if [".jsonl", ".json", ".ndjson"].iter().any(|s| stem.ends_with(s)) {
        Some((FileKind::Jsonl, compression))
    } else if stem.ends_with(".parquet") && compression == Compression::None {
        Some((FileKind::Parquet, compression))
    } else {
        None
    }
}

/// One file of a source.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Its name relative to the source.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Rows format.
    pub kind: FileKind,
    /// Compression.
    pub compression: Compression,
    /// Row groups (Parquet).
    pub row_groups: u32,
}

/// A source as listed: its files in name order.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceListing {
    /// The folder, prefix or file.
    pub url: String,
    /// Its share of the tokens, relative to the other sources.
    pub weight: f64,
    /// Its files.
    pub files: Vec<FileEntry>,
}

/// A piece of a file read as a whole by one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Part {
    /// Lines starting in `start..end` of an uncompressed JSONL file.
    Bytes {
        /// First byte.
        start: u64,
        /// End (exclusive) of where a line may start.
        end: u64,
    },
    /// One Parquet row group.
    RowGroup(u32),
    /// The whole file (compressed files cannot be entered in the middle).
    Whole,
}

/// A unit: a part of a file of a source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unit {
    /// Index of the file in its source.
    pub file: u32,
    /// Which part.
    pub part: Part,
}

/// A source in a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct SourcePlan {
    /// The folder, prefix or file.
    pub url: String,
    /// Its weight.
    pub weight: f64,
    /// Its files.
    pub files: Vec<FileEntry>,
    /// The units of every shard.
    pub units: Vec<Vec<Unit>>,
}

/// The whole dataset dealt to logical shards.
#[derive(Clone, Debug, PartialEq)]
pub struct DataPlan {
    /// Logical shards.
    pub shards: usize,
    /// Seed of the unit shuffles.
    pub seed: u64,
    /// Passes over each source before it is done; `None`: endless (each shard starts
    /// the source's next epoch, reshuffled, when it reaches its end).
    pub epochs: Option<u32>,
    /// The sources.
    pub sources: Vec<SourcePlan>,
    /// A hash of every file's name and size: a resumed run must see the same dataset.
    pub fingerprint: u64,
}

/// splitmix64: a seeded, portable stream of numbers for shuffles.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce5_e9b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `0..len` in the order a Fisher-Yates shuffle seeded by `seed` gives.
pub fn permutation(len: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut state = mix(seed);
    for i in (1..len).rev() {
        state = mix(state);
        let j = (state % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(hash, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Cuts `files` into units: a unit per Parquet row group, byte ranges of about
/// `unit_bytes` of a plain JSONL file, a compressed file whole (an empty one gives none).
fn cut_units(files: &[FileEntry], unit_bytes: u64) -> Vec<Unit> {
    let mut units = Vec::new();
    for (number, file) in files.iter().enumerate() {
        let file_index = number as u32;
        match (file.kind, file.compression) {
            (FileKind::Parquet, _) => {
                units.extend((0..file.row_groups).map(|g| Unit {
                    file: file_index,
                    part: Part::RowGroup(g),
                }));
            }
            (FileKind::Jsonl, Compression::None) => {
                let mut start = 0;
                while start < file.size {
                    let end = (start + unit_bytes).min(file.size);
                    units.push(Unit {
                        file: file_index,
                        part: Part::Bytes { start, end },
                    });
                    start = end;
                }
            }
            (FileKind::Jsonl, _) if file.size > 0 => units.push(Unit {
                file: file_index,
                part: Part::Whole,
            }),
            _ => {}
        }
    }
    units
}

/// The byte range a unit of `listing`'s plain JSONL files spans: their bytes spread over
/// [`UNITS_PER_SHARD`] units per shard, within [`UNIT_BYTES`].
fn unit_bytes(listing: &SourceListing, shards: usize) -> u64 {
    let plain: u64 = listing
        .files
        .iter()
        .filter(|f| f.kind == FileKind::Jsonl && f.compression == Compression::None)
        .map(|f| f.size)
        .sum();
    (plain / (shards as u64 * UNITS_PER_SHARD)).clamp(UNIT_BYTES.start, UNIT_BYTES.end)
}

/// Deals the units of one source after another round-robin to the shards.
struct Dealer {
    /// Units dealt so far, all sources together.
    dealt: usize,
    /// Units each shard holds, all sources together.
    per_shard: Vec<usize>,
}

impl Dealer {
    fn new(shards: usize) -> Self {
        Self {
            dealt: 0,
            per_shard: vec![0; shards],
        }
    }

    /// `units` of the source at `index`, shuffled with `seed` and dealt to the shards.
    fn deal(&mut self, units: &[Unit], index: usize, seed: u64) -> Vec<Vec<Unit>> {
        let shards = self.per_shard.len();
        let mut dealt = vec![Vec::new(); shards];
        // Each source continues where the previous one stopped dealing, so small sources
        // do not all land on the first shards.
        for u in permutation(units.len(), seed ^ mix(index as u64 + 1)) {
            let shard = self.dealt % shards;
            dealt[shard].push(units[u]);
            self.per_shard[shard] += 1;
            self.dealt += 1;
        }
        dealt
    }
}

impl DataPlan {
    /// Cuts every source's files into units and deals them to `shards` shards; errors
    /// when a source has no file or some shard would get no unit at all.
    pub fn new(listings: Vec<SourceListing>, shards: usize, seed: u64, epochs: Option<u32>) -> crate::Result<Self> {
        let shards = shards.max(1);
        // The seed and the shard count decide the order too: a resume with others would
        // point the cursors at other units.
        let mut fingerprint = fnv(
            fnv(0xcbf2_9ce4_8422_2325, &seed.to_le_bytes()),
            &(shards as u64).to_le_bytes(),
        );
        let mut dealer = Dealer::new(shards);
        let mut sources = Vec::with_capacity(listings.len());
        for (index, listing) in listings.into_iter().enumerate() {
            if listing.files.is_empty() {
                return Err(Error::Dataset(format!(
                    "{} holds no .jsonl or .parquet file",
                    listing.url
                )));
            }
            for file in &listing.files {
                fingerprint = fnv(fnv(fingerprint, file.name.as_bytes()), &file.size.to_le_bytes());
            }
            let units = cut_units(&listing.files, unit_bytes(&listing, shards));
            sources.push(SourcePlan {
                units: dealer.deal(&units, index, seed),
                url: listing.url,
                weight: listing.weight,
                files: listing.files,
            });
        }
        let units: usize = dealer.per_shard.iter().sum();
        if dealer.per_shard.contains(&0) {
            return Err(Error::Dataset(format!(
                "the dataset makes {units} units (byte ranges of JSONL files, Parquet row groups, whole compressed \
                 files), fewer than data.shards = {shards}: every logical shard needs one; lower data.shards"
            )));
        }
        Ok(Self {
            shards,
            seed,
            epochs,
            sources,
            fingerprint,
        })
    }

    /// The order in which `shard` reads its units of `source` in `epoch`.
    pub fn order(&self, source: usize, shard: usize, epoch: u32) -> Vec<usize> {
        let len = self.sources[source].units[shard].len();
        let salt = mix(self.seed ^ mix((source as u64) << 40 ^ (shard as u64) << 20 ^ u64::from(epoch)));
        permutation(len, salt)
    }

    /// The state every shard starts in.
    pub fn start(&self) -> LoaderState {
        let shard = |s: usize| ShardState {
            sources: self
                .sources
                .iter()
                .map(|source| SourceCursor {
                    done: source.units[s].is_empty(),
                    ..SourceCursor::default()
                })
                .collect(),
            chosen: vec![0; self.sources.len()],
            partial: 0,
        };
        LoaderState {
            fingerprint: self.fingerprint,
            shards: (0..self.shards).map(shard).collect(),
        }
    }

    /// Moves `cursor` (of `source` in `shard`) to its next unit, into the next epoch at
    /// the end of one; marks it done when the last epoch is over.
    pub fn next_unit(&self, source: usize, shard: usize, cursor: &mut SourceCursor) {
        let len = self.sources[source].units[shard].len() as u32;
        cursor.unit += 1;
        cursor.docs = 0;
        cursor.offset = 0;
        if cursor.unit >= len {
            cursor.unit = 0;
            cursor.epoch += 1;
            if len == 0 || self.epochs.is_some_and(|e| cursor.epoch >= e) {
                cursor.done = true;
            }
        }
    }

    /// The unit `cursor` is in.
    pub fn unit(&self, source: usize, shard: usize, cursor: &SourceCursor) -> Unit {
        let order = self.order(source, shard, cursor.epoch);
        self.sources[source].units[shard][order[cursor.unit as usize]]
    }
}

/// Where a shard is in one source.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceCursor {
    /// Passes completed.
    pub epoch: u32,
    /// Position of the current unit in this epoch's order.
    pub unit: u32,
    /// Documents already taken from the unit.
    pub docs: u64,
    /// Where the next one starts: a byte of the file (plain JSONL), a byte of the
    /// decompressed stream, or a row of the row group. Meaningful when `docs > 0`.
    pub offset: u64,
    /// No document is left (the last epoch is over, or the shard has no unit of it).
    pub done: bool,
}

/// Where a shard is: the next training row starts `partial` tokens into the document
/// its cursors point at (the one the weighting picks next).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardState {
    /// One cursor per source.
    pub sources: Vec<SourceCursor>,
    /// Tokens taken from each source so far (the weighting's state).
    pub chosen: Vec<u64>,
    /// Tokens of the next document already trained on.
    pub partial: u64,
}

impl ShardState {
    /// The source the next document comes from: among those not done, the one whose
    /// tokens so far are lowest for its weight (ties: the first). `None`: the shard is
    /// exhausted.
    pub fn pick(&self, weights: &[f64]) -> Option<usize> {
        (0..self.sources.len())
            .filter(|&s| !self.sources[s].done)
            .min_by(|&a, &b| {
                let share = |s: usize| self.chosen[s] as f64 / weights[s].max(f64::MIN_POSITIVE);
                share(a).total_cmp(&share(b)).then(a.cmp(&b))
            })
    }

    /// Whether no document is left.
    pub fn exhausted(&self) -> bool {
        self.sources.iter().all(|c| c.done)
    }
}

/// Every shard's state: what a checkpoint stores.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// The dataset's [`DataPlan::fingerprint`].
    pub fingerprint: u64,
    /// By shard.
    pub shards: Vec<ShardState>,
}

/// The shards rank `rank` of `world` reads: a contiguous range.
pub fn rank_shards(shards: usize, world: usize, rank: usize) -> Range<usize> {
    chunks(shards, world.max(1))[rank].clone()
}

/// The world sizes a streaming run with `shards` logical shards can use while keeping a
/// global batch of `global` sequences at `micro` sequences per micro-batch: each rank
/// needs a shard and a whole number of micro-batches.
pub fn allowed_worlds(shards: usize, global: usize, micro: usize) -> Vec<usize> {
    (1..=shards.min(64))
        .filter(|w| global.is_multiple_of(micro.max(1) * w))
        .collect()
}

/// Joins the shards ranks wrote (each rank's own range) into one state; errors when a
/// shard is missing or written twice.
pub fn merge_states(
    fingerprint: u64,
    shards: usize,
    parts: Vec<Vec<(usize, ShardState)>>,
) -> crate::Result<LoaderState> {
    let mut slots: Vec<Option<ShardState>> = vec![None; shards];
    for (index, state) in parts.into_iter().flatten() {
        match slots.get_mut(index) {
            Some(slot @ None) => *slot = Some(state),
            Some(Some(_)) => return Err(Error::Dataset(format!("shard {index} is saved twice"))),
            None => {
                return Err(Error::Dataset(format!(
                    "shard {index} does not exist (data.shards = {shards})"
                )))
            }
        }
    }
    let shards = slots
        .into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| Error::Dataset(format!("shard {i}'s state is missing"))))
        .collect::<crate::Result<Vec<_>>>()?;
    Ok(LoaderState { fingerprint, shards })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jsonl(name: &str, size: u64) -> FileEntry {
        FileEntry {
            name: name.into(),
            size,
            kind: FileKind::Jsonl,
            compression: Compression::None,
            row_groups: 0,
        }
    }

    fn listing(files: Vec<FileEntry>) -> SourceListing {
        SourceListing {
            url: "/data".into(),
            weight: 1.0,
            files,
        }
    }

    #[test]
    fn names_say_the_format_and_compression() {
        assert_eq!(file_kind("a.jsonl"), Some((FileKind::Jsonl, Compression::None)));
        assert_eq!(file_kind("A.JSONL.ZST"), Some((FileKind::Jsonl, Compression::Zstd)));
        assert_eq!(file_kind("a.json.gz"), Some((FileKind::Jsonl, Compression::Gzip)));
        assert_eq!(file_kind("a.parquet"), Some((FileKind::Parquet, Compression::None)));
        assert_eq!(file_kind("README.md"), None);
        assert_eq!(file_kind("a.parquet.gz"), None);
    }

    #[test]
    fn every_unit_goes_to_exactly_one_shard_and_byte_ranges_tile_the_files() {
        let plan = DataPlan::new(
            vec![listing(vec![jsonl("a.jsonl", 100_000), jsonl("b.jsonl", 30_001)])],
            6,
            7,
            None,
        )
        .unwrap();
        let mut ranges: Vec<(u32, u64, u64)> = plan.sources[0]
            .units
            .iter()
            .flatten()
            .map(|u| match u.part {
                Part::Bytes { start, end } => (u.file, start, end),
                other => panic!("{other:?}"),
            })
            .collect();
        ranges.sort();
        let mut next = (0, 0);
        for (file, start, end) in ranges {
            if file != next.0 {
                assert_eq!(next.1, [100_000, 30_001][next.0 as usize]);
                next = (file, 0);
            }
            assert_eq!(start, next.1);
            next.1 = end;
        }
        assert_eq!(next, (1, 30_001));
        let sizes: Vec<usize> = plan.sources[0].units.iter().map(Vec::len).collect();
        assert!(
            sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
            "{sizes:?}"
        );
    }

    #[test]
    fn the_plan_and_orders_are_functions_of_the_listing_and_seed() {
        let files = || vec![listing(vec![jsonl("a.jsonl", 50_000)])];
        let a = DataPlan::new(files(), 3, 1, None).unwrap();
        assert_eq!(a, DataPlan::new(files(), 3, 1, None).unwrap());
        assert_ne!(
            a.sources[0].units,
            DataPlan::new(files(), 3, 2, None).unwrap().sources[0].units
        );
        let order = a.order(0, 1, 0);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..a.sources[0].units[1].len()).collect::<Vec<_>>());
        assert_ne!(a.order(0, 1, 0), a.order(0, 1, 1), "each epoch reshuffles");
        let other = DataPlan::new(vec![listing(vec![jsonl("a.jsonl", 50_001)])], 3, 1, None).unwrap();
        assert_ne!(a.fingerprint, other.fingerprint);
    }

    #[test]
    fn too_few_units_or_no_files_are_refused_with_the_numbers() {
        let err = DataPlan::new(vec![listing(vec![jsonl("a.jsonl", 5000)])], 8, 0, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("makes 2 units") && err.contains("data.shards = 8"),
            "{err}"
        );
        let err = DataPlan::new(vec![listing(vec![])], 1, 0, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/data holds no .jsonl or .parquet file"), "{err}");
    }

    #[test]
    fn small_sources_fill_the_shards_together() {
        let small = |url: &str| SourceListing {
            url: url.into(),
            weight: 1.0,
            files: vec![jsonl("a.jsonl", 8 << 10)],
        };
        let plan = DataPlan::new(vec![small("/a"), small("/b"), small("/c")], 6, 0, None).unwrap();
        for shard in 0..6 {
            let units: usize = plan.sources.iter().map(|s| s.units[shard].len()).sum();
            assert_eq!(units, 1, "shard {shard}");
        }
        let other_seed = DataPlan::new(vec![small("/a"), small("/b"), small("/c")], 6, 1, None).unwrap();
        assert_ne!(plan.fingerprint, other_seed.fingerprint, "the seed orders the units");
    }

    #[test]
    fn cursors_walk_units_then_epochs_and_stop_after_the_last() {
        let plan = DataPlan::new(vec![listing(vec![jsonl("a.jsonl", 16 << 10)])], 2, 0, Some(2)).unwrap();
        let mut cursor = SourceCursor::default();
        let units = plan.sources[0].units[0].len();
        let mut seen = 0;
        while !cursor.done {
            seen += 1;
            plan.next_unit(0, 0, &mut cursor);
        }
        assert_eq!(seen, 2 * units);
        assert_eq!(cursor.epoch, 2);
    }

    #[test]
    fn weighting_keeps_each_source_near_its_share() {
        let mut state = ShardState {
            sources: vec![SourceCursor::default(); 2],
            chosen: vec![0, 0],
            partial: 0,
        };
        let weights = [0.7, 0.3];
        for n in 0..1000u64 {
            let s = state.pick(&weights).unwrap();
            state.chosen[s] += 10 + n % 7;
        }
        let share = state.chosen[0] as f64 / (state.chosen[0] + state.chosen[1]) as f64;
        assert!((share - 0.7).abs() < 0.01, "{share}");
        state.sources[0].done = true;
        assert_eq!(state.pick(&weights), Some(1));
        state.sources[1].done = true;
        assert_eq!(state.pick(&weights), None);
        assert!(state.exhausted());
    }

    #[test]
    fn ranks_own_contiguous_shard_ranges_and_worlds_keep_the_global_batch() {
        assert_eq!(rank_shards(12, 5, 0), 0..3);
        assert_eq!(rank_shards(12, 5, 4), 10..12);
        assert_eq!(allowed_worlds(12, 12, 2), vec![1, 2, 3, 6]);
        assert_eq!(allowed_worlds(4, 12, 1), vec![1, 2, 3, 4]);
    }

    #[test]
    fn states_from_every_rank_merge_and_gaps_are_named() {
        let s = ShardState::default();
        let merged = merge_states(9, 3, vec![vec![(0, s.clone()), (1, s.clone())], vec![(2, s.clone())]]).unwrap();
        assert_eq!(merged.shards.len(), 3);
        let err = merge_states(9, 3, vec![vec![(0, s.clone())], vec![(2, s.clone())]]).unwrap_err();
        assert!(err.to_string().contains("shard 1's state is missing"), "{err}");
        assert!(merge_states(9, 1, vec![vec![(0, s.clone()), (0, s)]]).is_err());
    }
}
