//! Where a rank's batches come from: its fixed partition of `data.path`, or the streaming
//! loader over `[[data.sources]]` (resumed from a checkpoint's loader state, with the
//! ledger of documents trained on and the skipped rows reported).

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::TrainConfig;
use regatta_trainer::{FromExecutor, RankSetup};
use tch::Tensor;
use tokio::runtime::Runtime;

use super::{emit, fatal, step_batches, Failure, RunModel};
use crate::checkpoint::{self, Manifest};
use crate::data::RankData;
use crate::engine::{Engine, MicroBatch};
use crate::stream::{Loader, LoaderSpec};

/// Where a rank's batches come from.
pub(super) enum Feed {
    /// `data.path`: a fixed partition per rank.
    Fixed(RankData),
    /// `[[data.sources]]`: the streaming loader.
    Stream(Box<StreamFeed>),
}

/// The streaming loader of a rank, its ledger, and how many skipped rows it reported.
pub(super) struct StreamFeed {
    loader: Loader,
    ledger: Option<Ledger>,
    /// Skipped rows reported one by one so far.
    reported: u64,
}

impl StreamFeed {
    /// The loader over this rank's shards of the run's sources, and its ledger when
    /// `data.ledger` names one.
    fn open(
        setup: &RankSetup,
        run_model: &RunModel,
        runtime: &Runtime,
        resume_from: Option<(&Place, &Manifest)>,
    ) -> Result<Self, Failure> {
        let (config, rank, world) = (&setup.config, setup.rank, setup.world);
        let plan = Arc::new(runtime.block_on(crate::stream::plan(&config.data, config.seed))?);
        let (state, after) = match resume_from {
            Some((place, m)) => {
                let (state, lasts) = checkpoint::loader_state(runtime, place, m, &plan)?;
                // The round-robin continues where this rank left it on the same world size.
                let after = if m.world == world {
                    lasts.get(rank).copied().flatten()
                } else {
                    None
                };
                (state, after)
            }
            None => (plan.start(), None),
        };
        let spec = LoaderSpec {
            shards: regatta_trainer::stream::rank_shards(plan.shards, world, rank),
            plan,
            state,
            context: config.model.context,
            prefetch: config.data.prefetch,
            after,
        };
        let settings = Arc::new(run_model.settings.clone());
        let loader = Loader::start(spec, run_model.tokenizer.clone(), settings, runtime.handle().clone())?;
        let ledger = if config.data.ledger.is_empty() {
            None
        } else {
            Some(Ledger::open(&config.data.ledger, rank, world, setup.attempt).map_err(fatal)?)
        };
        Ok(Self {
            loader,
            ledger,
            reported: 0,
        })
    }
}

/// Skipped rows a rank reports one by one; past these, one report a step.
const SKIPPED_REPORTS: u64 = 100;

/// Where a rank writes which documents it trained on: `attempt<TAB>step<TAB>document`
/// lines in `rank-R-of-N-attempt-A.tsv`. A step redone after a restart appears again
/// under a later attempt, which supersedes the earlier lines of that step.
struct Ledger {
    out: std::io::BufWriter<std::fs::File>,
    attempt: u64,
}

impl Ledger {
    fn open(dir: &str, rank: usize, world: usize, attempt: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = std::path::Path::new(dir).join(format!("rank-{rank}-of-{world}-attempt-{attempt}.tsv"));
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            out: std::io::BufWriter::new(file),
            attempt,
        })
    }

    fn write(&mut self, step: u64, keys: &[String]) -> std::io::Result<()> {
        for key in keys {
            writeln!(self.out, "{}\t{step}\t{key}", self.attempt)?;
        }
        self.out.flush()
    }
}

impl Feed {
    /// This rank's feed for `setup`'s run: its partition of `data.path`, or the streaming
    /// loader over its shards, continuing where `resume_from`'s checkpoint left them.
    pub(super) fn open(
        setup: &RankSetup,
        run_model: &RunModel,
        runtime: &Runtime,
        resume_from: Option<(&Place, &Manifest)>,
    ) -> Result<Self, Failure> {
        let config = &setup.config;
        if config.streaming() {
            let feed = StreamFeed::open(setup, run_model, runtime, resume_from)?;
            Ok(Self::Stream(Box::new(feed)))
        } else {
            let data = runtime
                .block_on(run_model.data(config, setup.world, &[setup.rank]))
                .map_err(fatal)?;
            Ok(Self::Fixed(data))
        }
    }

    /// The micro-batches of `step` and the documents that start in them.
    pub(super) fn batches(
        &mut self,
        config: &TrainConfig,
        step: u64,
    ) -> Result<(Vec<MicroBatch>, Vec<String>), Failure> {
        match self {
            Self::Fixed(data) => Ok((step_batches(config, data, step), Vec::new())),
            Self::Stream(feed) => {
                let rows = feed.loader.take(config.per_rank_batch())?;
                let keys = rows.iter().flat_map(|r| r.keys.iter().cloned()).collect();
                Ok((
                    stream_batches(&rows, config.micro_batch_size, config.model.context),
                    keys,
                ))
            }
        }
    }

    /// After step `done`: the ledger, skipped rows reported; with `epochs`, whether every
    /// rank's shards are exhausted (a collective).
    pub(super) fn after_step(
        &mut self,
        done: u64,
        keys: Vec<String>,
        epochs: bool,
        engine: &mut Engine,
    ) -> Result<bool, Failure> {
        let Self::Stream(feed) = self else {
            return Ok(false);
        };
        if let Some(ledger) = &mut feed.ledger {
            ledger
                .write(done, &keys)
                .map_err(|e| fatal(format!("cannot write the data ledger: {e}")))?;
        }
        let skipped = feed.loader.take_skipped();
        for s in &skipped {
            eprintln!("data: skipped {}", s.what);
        }
        let one_by_one = (SKIPPED_REPORTS.saturating_sub(feed.reported) as usize).min(skipped.len());
        for s in &skipped[..one_by_one] {
            emit(&FromExecutor::Skipped {
                what: s.what.clone(),
                count: 1,
            });
        }
        feed.reported += one_by_one as u64;
        if let Some(first) = skipped.get(one_by_one) {
            emit(&FromExecutor::Skipped {
                what: first.what.clone(),
                count: (skipped.len() - one_by_one) as u64,
            });
        }
        if !epochs {
            return Ok(false);
        }
        Ok(!self.data_left(engine)?)
    }

    /// Whether any rank has a row of data left (a collective; `data.path` always has).
    pub(super) fn data_left(&mut self, engine: &mut Engine) -> Result<bool, Failure> {
        let Self::Stream(feed) = self else {
            return Ok(true);
        };
        let more = if feed.loader.has_more() { 1.0 } else { 0.0 };
        Ok(engine.sum_over_ranks(more)? > 0.5)
    }

    /// This rank's loader state file for a checkpoint.
    pub(super) fn saved(&self, rank: usize, world: usize) -> Result<Option<(String, Bytes)>, Failure> {
        let Self::Stream(feed) = self else {
            return Ok(None);
        };
        let saved = checkpoint::SavedShards {
            fingerprint: feed.loader.fingerprint(),
            shards: feed.loader.states(),
            last_shard: feed.loader.last_shard(),
        };
        let bytes = serde_json::to_vec(&saved).map_err(|e| fatal(format!("cannot encode the loader state: {e}")))?;
        Ok(Some((checkpoint::loader_file(rank, world), Bytes::from(bytes))))
    }
}

/// Streaming rows as micro-batches of `micro` rows (the documents tensor keeps attention
/// inside each document).
pub fn stream_batches(rows: &[crate::stream::Row], micro: usize, context: usize) -> Vec<MicroBatch> {
    rows.chunks(micro.max(1))
        .map(|chunk| {
            let shape = [chunk.len() as i64, context as i64];
            let tensor = |pick: fn(&crate::stream::Row) -> &Vec<i64>| {
                let flat: Vec<i64> = chunk.iter().flat_map(|r| pick(r).iter().copied()).collect();
                Tensor::from_slice(&flat).view(shape)
            };
            MicroBatch {
                tokens: tensor(|r| &r.inputs),
                targets: tensor(|r| &r.targets),
                documents: Some(tensor(|r| &r.documents)),
            }
        })
        .collect()
}
