//! Regatta's trainer: a ZeRO stage 1/2/3 trainer group on libtorch with NCCL on GPUs and a
//! CPU collective backend.
//!
//! Not built yet: see the trainer issue.
