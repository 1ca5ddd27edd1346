//! Regatta's trainer: a ZeRO stage 1/2/3 trainer group on libtorch with NCCL on GPUs and a
//! CPU collective backend.
//!
//! Built so far (the trainer issue is open): the ZeRO partition arithmetic
//! ([`zero::partition`]) and the collective interface with a ring implementation over any
//! link ([`collective`]), including QUIC between nodes ([`quic_link`]), and a ring of rank actors formed through
//! the cluster ([`ring_group`]). Still to come: the NCCL
//! backend (cudarc), libtorch models and the trainer group; `scripts/setup-libtorch.sh`
//! already installs libtorch 2.11 from PyPI wheels (see docs/NOTES.md).

pub mod collective;
pub mod quic_link;
pub mod ring_group;
pub mod zero;

pub use collective::{chunks, memory_ring, Collective, CollectiveError, MemoryLink, RingCollective, RingLink};
pub use quic_link::{QuicLink, QuicLinkBuilder};
pub use ring_group::{RankArgs, RankOp, RankReply, RingGroup, RingRank};
pub use zero::partition::{bytes_per_rank, gradient_buckets, FlatLayout, Piece, StateBytes, TensorSlot, ZeroStage};
