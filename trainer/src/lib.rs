//! Regatta's trainer: a ZeRO stage 1/2/3 trainer group on libtorch, with NCCL on GPUs and
//! a CPU collective backend.
//!
//! This crate links no libtorch: it holds the pure parts (configuration, ZeRO partition
//! arithmetic, data partitioning), the CPU collectives ([`collective`] over [`link`]: a Unix
//! socket between ranks on one host, TCP with sealed frames between hosts, QUIC as the fallback),
//! the rank actor that runs inside a node's agent and supervises the rank's executor
//! process ([`rank`]), and the driver's [`TrainerGroup`]. The executor itself, the model,
//! the ZeRO engine, checkpoints and the NCCL backend live in `regatta-torch`, the one
//! crate that links libtorch (see ARCHITECTURE.md).

mod collective;
mod config;
mod data;
mod documents;
mod error;
pub mod eval;
pub mod gguf;
mod group;
pub mod hex;
mod hf;
mod link;
mod lora;
mod metrics;
mod protocol;
pub mod quant;
mod rank;
mod ring_group;
pub mod stream;
mod tensorboard;
mod zero;

// The one door: the subject toolkits with names of their own (`eval`, `gguf`, `hex`,
// `quant`, `stream`) are public namespaces and re-exported nowhere; every other module is
// private and this list is what it offers.

pub use error::{Error, Result, TrainError};
// A training run's settings, as `train.toml` reads.
pub use config::{
    DataConfig, DataFormat, ModelConfig, OptimizerConfig, ScalingConfig, Schedule, SourceConfig, TrainConfig,
    BYTE_VOCAB,
};
pub use lora::{
    from_peft_name, is_adapter, peft_name, BaseQuantization, LoraConfig, Offload, ZeroConfig, ADAPTER_CONFIG,
    ADAPTER_WEIGHTS, PROJECTIONS,
};
// Models and documents.
pub use documents::{
    Document, DocumentError, Message, Packed, PackedRow, Record, Segment, TokenizerSettings, IGNORE_INDEX,
};
pub use hf::{Architecture, HfConfigError, LlamaConfig, RopeScaling};
// The trainer group, its ranks and the wire to the libtorch executor.
pub use data::DataLayout;
pub use group::{TrainEvent, TrainSummary, TrainerGroup};
pub use protocol::{Binding, FromExecutor, RankSetup, StepReport, ToExecutor, TrainOp, TrainReply};
pub use rank::{TrainRank, TrainRankArgs, SECRET_ENV};
pub use regatta_runtime::executor::{executor_path, EXECUTOR_ENV};
pub use ring_group::{RankArgs, RankOp, RankReply, RingGroup, RingRank};
// Collectives over the ring and ZeRO's arithmetic.
pub use collective::{
    chunks, memory_ring, Collective, CollectiveError, LinkError, MemoryLink, RingCollective, RingLink,
};
pub use link::{LinkOptions, RingAddress, RingLinkBuilder, StreamLink, RING_TRANSPORT_ENV};
pub use zero::partition::{
    bytes_per_rank, gradient_buckets, reshard, FlatLayout, Piece, StateBytes, TensorSlot, ZeroStage,
};
