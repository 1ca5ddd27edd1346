//! Checkpoints through `object_store`: a directory per step holding each rank's optimizer
//! slice (`optim-rank-R-of-N.safetensors`), the consolidated weights (`model.safetensors`,
//! loadable by PyTorch's `safetensors.torch.load_file`) and `manifest.json`; then `latest`
//! names the directory. Every rank writes its slice before a barrier, and rank 0 writes the
//! manifest and `latest` after it, so `latest` only ever names a complete checkpoint.

use bytes::Bytes;
use regatta_trainer::config::ModelConfig;
use serde::{Deserialize, Serialize};
use tch::Tensor;
use tokio::runtime::Runtime;

use crate::engine::Engine;
use regatta_object_store::Place;

/// What a checkpoint holds, besides the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Steps done.
    pub step: u64,
    /// Ranks that wrote it.
    pub world: usize,
    /// ZeRO stage.
    pub zero_stage: u8,
    /// Model shape.
    pub model: ModelConfig,
    /// Vocabulary.
    pub vocab: usize,
    /// The `tokenizer.json` the run used; empty: bytes.
    #[serde(default)]
    pub tokenizer: String,
    /// Real parameters.
    pub params: u64,
    /// Each rank's loader position (sequences taken from its partition).
    pub positions: Vec<u64>,
    /// Files, relative to the step directory.
    pub files: Vec<String>,
}

/// The directory name of a step.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

fn temp_path(tag: &str) -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("regatta-{}-{n}-{tag}", std::process::id()))
}

/// Tensors as safetensors bytes.
pub fn to_safetensors(tensors: &[(String, Tensor)]) -> Result<Bytes, String> {
    let path = temp_path("write.safetensors");
    let result = Tensor::write_safetensors(tensors, &path)
        .map_err(|e| format!("cannot encode safetensors: {e}"))
        .and_then(|()| std::fs::read(&path).map_err(|e| e.to_string()));
    let _ = std::fs::remove_file(&path);
    result.map(Bytes::from)
}

/// Tensors from safetensors bytes (an error, never a panic, on bad bytes).
pub fn from_safetensors(bytes: &[u8], what: &str) -> Result<Vec<(String, Tensor)>, String> {
    let path = temp_path("read.safetensors");
    std::fs::write(&path, bytes).map_err(|e| format!("cannot stage {what}: {e}"))?;
    let result = Tensor::read_safetensors(&path).map_err(|e| format!("{what} is not a valid safetensors file: {e}"));
    let _ = std::fs::remove_file(&path);
    result
}

/// The newest complete checkpoint in `place`, if any.
pub async fn latest(place: &Place) -> Result<Option<Manifest>, String> {
    let Some(name) = place.get_opt("latest").await? else {
        return Ok(None);
    };
    let name = String::from_utf8_lossy(&name).trim().to_string();
    let bytes = place.child(&name).get("manifest.json").await?;
    let manifest: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{}/{name}/manifest.json is not a valid manifest: {e}", place.url()))?;
    Ok(Some(manifest))
}

/// Writes this rank's part of a checkpoint at the engine's current step (a collective:
/// every rank calls it). Returns the step directory's URL. Synchronous: the collectives
/// block on the ring's own runtime, so only the uploads run on `runtime`.
pub fn save(
    runtime: &Runtime,
    place: &Place,
    engine: &mut Engine,
    rank: usize,
    world: usize,
    manifest: Manifest,
) -> Result<String, String> {
    let dir = place.child(&step_dir(manifest.step));
    let shard = format!("optim-rank-{rank}-of-{world}.safetensors");
    runtime.block_on(dir.put(&shard, to_safetensors(&engine.optimizer_state())?))?;
    let weights = engine.consolidated()?;
    if rank == 0 {
        runtime.block_on(dir.put("model.safetensors", to_safetensors(&weights)?))?;
    }
    engine.barrier()?;
    if rank == 0 {
        let body = serde_json::to_vec_pretty(&manifest).map_err(|e| e.to_string())?;
        runtime.block_on(dir.put("manifest.json", Bytes::from(body)))?;
        runtime.block_on(place.put("latest", Bytes::from(step_dir(manifest.step))))?;
    }
    Ok(dir.url().to_string())
}

/// Loads this rank's optimizer slice from the checkpoint `manifest` describes (a
/// collective: every rank calls it).
pub fn restore(
    runtime: &Runtime,
    place: &Place,
    engine: &mut Engine,
    rank: usize,
    manifest: &Manifest,
) -> Result<(), String> {
    let dir = place.child(&step_dir(manifest.step));
    let name = format!("optim-rank-{rank}-of-{}.safetensors", manifest.world);
    let bytes = runtime.block_on(dir.get(&name))?;
    let tensors = from_safetensors(&bytes, &format!("{}/{name}", dir.url()))?;
    engine.load_optimizer_state(tensors, manifest.step)
}

/// Reads a checkpoint's consolidated weights (`model.safetensors` in a step directory, or
/// the newest one under a checkpoint directory).
pub async fn load_weights(url: &str) -> Result<(Manifest, Vec<(String, Tensor)>), String> {
    let place = Place::dir(url)?;
    let (dir, manifest) = match latest(&place).await? {
        Some(manifest) => (place.child(&step_dir(manifest.step)), manifest),
        None => {
            let bytes = place.get("manifest.json").await?;
            let manifest: Manifest = serde_json::from_slice(&bytes)
                .map_err(|e| format!("{url}/manifest.json is not a valid manifest: {e}"))?;
            (place, manifest)
        }
    };
    let bytes = dir.get("model.safetensors").await?;
    let tensors = from_safetensors(&bytes, &format!("{}/model.safetensors", dir.url()))?;
    Ok((manifest, tensors))
}
