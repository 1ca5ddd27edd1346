//! The part of Regatta that links libtorch: the trainer's rank executor
//! (`regatta-torch-rank`), the [`Model`] trait with its two families (the built-in GPT and
//! Hugging Face Llama / Mistral / Qwen2 models, [`Llama`], loaded from and saved to
//! Hugging Face folders by [`hf`]), the ZeRO engine, checkpoints through `object_store`,
//! the plain libtorch reference loop, and the NCCL backend (cudarc, loaded at run time).
//! Nodes never link this crate: a rank actor in the agent launches the executor binary.

mod attention;
mod attention_check;
mod bench_data;
mod bench_generate;
pub mod checkpoint;
pub mod collective;
pub mod cuda;
mod data;
mod engine;
mod error;
mod executor;
mod generate;
mod gpt;
mod graphs;
mod hf;
mod libtorch;
mod llama;
mod lora;
mod merge;
mod model;
mod nccl;
mod nccl_check;
mod packed;
mod quant;
mod reference;
mod score;
mod score_executor;
mod shim;
pub mod stream;

// The one door: the subject toolkits (`checkpoint`, `collective`, `cuda`, `stream`) are
// public namespaces and re-exported nowhere; every other module is private and this list is
// what it offers. `tch` is handed on so that a user's model builds against the same one.

pub use error::{Error, Result};
pub use tch;
// The model trait, its two families and what a model is made of.
pub use gpt::Gpt;
pub use hf::{encode_safetensors_as, model_from_config, HfModel};
pub use llama::Llama;
pub use model::{
    arrange, dropout, inference_layout, logits, parameter_count, Batch, Init, KvLayout, KvStep, Model, ParamSpec,
};
// Training: the ZeRO engine, the rank executor and its data, LoRA and quantized bases.
pub use data::{encode_record, DataSource, RankData, TextTokenizer};
pub use engine::{
    adamw_update, seeded, token_loss_sum, AdamwStep, Engine, EngineSettings, Held, MicroBatch, StepOutcome,
};
pub use executor::{
    builtin_model, executor_main, gemm_peak, initial_weights, load_quantized, open_run_model, reference_run,
    step_batches, take_stored_quantized, GemmPeak, SHARD_BYTES,
};
pub use lora::{hold_base, Adapter};
pub use merge::merge as merge_adapter;
pub use packed::LinearGroup;
pub use quant::QuantWeight;
// Scoring and generation.
pub use generate::{Generator, KvCache, Output, Prepared, RowError};
pub use score::Scorer;
pub use score_executor::{export as export_torchscript, score_main};
// The executor binary's checks and benches.
pub use attention_check::check as attention_check;
pub use bench_data::{bench_data, BenchDataSpec};
pub use bench_generate::{bench_generate, generate_ids, IdsJob};
pub use nccl_check::check as nccl_check;
