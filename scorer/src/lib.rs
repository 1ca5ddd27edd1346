//! Regatta's scorer: an actor pool that partitions datasets by rank and scores them in
//! batches, exactly once.
//!
//! - [`partition`]: JSONL input split into byte ranges whose rows are each owned by
//!   exactly one partition; rows parsed with a reason for every malformed one.
//! - [`parquet_input`]: Parquet input split by row group (and row ranges inside groups),
//!   read through ranged object_store reads of the footer and one group's columns.
//! - [`plan`]: the driver's bookkeeping (finished partitions skipped on a rerun, dynamic
//!   hand-out, retries) and length-sorted batches.
//! - [`actor`]: the `scorer` actor (in the agent), which launches `regatta-torch-rank score`
//!   and writes one Parquet file per partition ([`output`]) plus an errors file.
//! - [`generate`]: generation without tensors: prompt rows, sampling settings, the
//!   continuous batcher over a paged KV cache, token choice and stop strings.
//! - [`driver`]: [`ScoreRun`], which runs a whole dataset through a pool of scorer actors.
//! - [`ScorerPool`]: Ray `ActorPool` semantics over any actor kind, scorer actors included.

mod actor;
mod driver;
mod error;
mod generate;
mod jsonl;
mod output;
mod parquet_input;
mod partition;
mod plan;
mod protocol;

// The one door: modules are private and this list is everything the crate offers.

pub use error::{Error, Result};
// A scoring or generation run: its settings, the driver, its progress and its manifest.
pub use driver::{Progress, ScoreConfig, ScoreManifest, ScoreRun};
// The scorer actors and what they are handed.
pub use actor::{PartitionReport, PartitionTask, ScorerActor, ScorerArgs, Slice};
// Inputs, partitions and outputs.
pub use jsonl::read_owned_lines;
pub use output::{from_parquet, generated_from_parquet, generated_to_parquet, to_parquet, GeneratedRow, ScoredRow};
pub use parquet_input::{is_parquet, row_slices, rows_to_parquet, ParquetInput, RowSlice};
pub use partition::{byte_ranges, owned_lines, parse_row, read_window, Row, RowError};
pub use plan::{errors_name, length_batches, output_name, partition_of, Plan};
// The wire to the libtorch executor.
pub use protocol::{is_torchscript, AdapterBase, FromScorer, RowFailure, RowScore, ScorerSetup, ToScorer};
// Generation: the pure batcher, sampling, and the executor's side of a generation run.
pub use generate::{
    auto_kv_cache_bytes, choose, mem_available, stop_at, Batcher, BatcherConfig, Choice, Feed, Finish, FreeMemory,
    GenRequest, GenStats, Generation, GenerationSetup, Prompt, RowStream, SamplingParams, Work, DEVICE_MEMORY_SHARE,
    HOST_MEMORY_SHARE,
};

/// Ray `ActorPool` semantics (`map`, `map_unordered`, `submit`, `get_next`,
/// `get_next_unordered`, `has_free`, `has_next`, `push`, `pop_idle`) over any registered
/// actor kind, for example `ScorerPool<ScorerActor>` over actors spawned against GPU tags.
pub type ScorerPool<A> = regatta_runtime::ActorPool<A>;
