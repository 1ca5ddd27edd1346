//! The part of Regatta that links libtorch: the trainer's rank executor
//! (`regatta-torch-rank`), the [`Model`] trait with its two families (the built-in GPT and
//! Hugging Face Llama / Mistral / Qwen2 models, [`Llama`], loaded from and saved to
//! Hugging Face folders by [`hf`]), the ZeRO engine, checkpoints through `object_store`,
//! the plain libtorch reference loop, and the NCCL backend (cudarc, loaded at run time).
//! Nodes never link this crate: a rank actor in the agent launches the executor binary.

pub mod attention;
pub mod attention_check;
pub mod bench_data;
pub mod bench_generate;
pub mod checkpoint;
pub mod collective;
pub mod cuda;
pub mod data;
pub mod engine;
pub mod error;
pub mod executor;
pub mod generate;
pub mod gpt;
pub mod graphs;
pub mod hf;
pub mod libtorch;
pub mod llama;
pub mod lora;
pub mod merge;
pub mod model;
pub mod nccl;
pub mod nccl_check;
pub mod quant;
pub mod reference;
pub mod score;
pub mod score_executor;
pub mod shim;
pub mod stream;

pub use bench_generate::bench_generate;
pub use engine::{Engine, EngineSettings, Held, MicroBatch, StepOutcome};
pub use error::{Error, Result};
pub use executor::{builtin_model, executor_main, gemm_peak, reference_run, GemmPeak};
pub use generate::{Generator, KvCache, Output, Prepared, RowError};
pub use gpt::Gpt;
pub use hf::HfModel;
pub use llama::Llama;
pub use model::{Batch, Init, KvLayout, KvStep, Model, ParamSpec};
pub use tch;
