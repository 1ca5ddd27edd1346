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

pub mod collective;
pub mod config;
pub mod data;
pub mod documents;
pub mod error;
pub mod eval;
pub mod gguf;
pub mod group;
pub mod hex;
pub mod hf;
pub mod link;
pub mod lora;
pub mod metrics;
pub mod protocol;
pub mod quant;
pub mod rank;
pub mod ring_group;
pub mod stream;
pub mod tensorboard;
pub mod zero;

pub use collective::{
    chunks, memory_ring, Collective, CollectiveError, LinkError, MemoryLink, RingCollective, RingLink,
};
pub use config::{DataFormat, ScalingConfig, Schedule, SourceConfig, TrainConfig, BYTE_VOCAB};
pub use data::DataLayout;
pub use documents::{Document, DocumentError, Message, Packed, PackedRow, Record, Segment, TokenizerSettings};
pub use error::{Error, Result, TrainError};
pub use eval::{EvalConfig, EvalReport};
pub use group::{TrainEvent, TrainSummary, TrainerGroup};
pub use hf::{Architecture, HfConfigError, LlamaConfig, RopeScaling};
pub use link::{LinkOptions, RingAddress, RingLinkBuilder, StreamLink, RING_TRANSPORT_ENV};
pub use lora::{LoraConfig, Offload, ZeroConfig};
pub use protocol::{Binding, FromExecutor, RankSetup, StepReport, ToExecutor, TrainOp, TrainReply};
pub use rank::{TrainRank, TrainRankArgs, SECRET_ENV};
pub use regatta_runtime::executor::{executor_path, EXECUTOR_ENV};
pub use ring_group::{RankArgs, RankOp, RankReply, RingGroup, RingRank};
pub use zero::partition::{
    bytes_per_rank, gradient_buckets, reshard, FlatLayout, Piece, StateBytes, TensorSlot, ZeroStage,
};
