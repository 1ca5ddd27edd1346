//! The part of Regatta that links libtorch: the trainer's rank executor
//! (`regatta-torch-rank`), the built-in GPT model, the ZeRO engine, checkpoints in
//! safetensors through `object_store`, and the NCCL backend (cudarc, loaded at run time).
//! Nodes never link this crate: a rank actor in the agent launches the executor binary.

pub mod checkpoint;
pub mod collective;
pub mod data;
pub mod engine;
pub mod executor;
pub mod model;
pub mod nccl;
pub mod score;
pub mod score_executor;

pub use engine::{Engine, Held, StepOutcome};
pub use executor::{builtin_model, executor_main, reference_run};
pub use model::{Gpt, Init, LayeredModel, ParamSpec};
pub use tch;
