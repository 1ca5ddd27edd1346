//! What a worker has: CPUs, memory and GPUs found on this machine, overridable by flags.

use std::process::Command;

use crate::resources::{Resources, GPU};

/// GPUs found through `nvidia-smi`: count and model names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuInventory {
    /// Device model names, one per GPU.
    pub models: Vec<String>,
}

/// Detects this machine's resources: `CPU`, `memory` (bytes), `GPU` and, for NVIDIA
/// devices, an `accelerator_type:<model>` tag such as `accelerator_type:H100`.
pub fn detect_resources() -> Resources {
    let mut set = Resources::new();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    set.set("CPU", cpus as f64);
    if let Some(bytes) = total_memory_bytes() {
        set.set("memory", bytes as f64);
    }
    let gpus = detect_gpus();
    if !gpus.models.is_empty() {
        set.set(GPU, gpus.models.len() as f64);
        if let Some(tag) = gpus.models.first().and_then(|m| accelerator_tag(m)) {
            set.set(&tag, 1.0);
        }
    }
    set
}

/// Reads `MemTotal` from /proc/meminfo.
pub fn total_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Lists NVIDIA GPUs with `nvidia-smi`; none when the tool or driver is absent.
pub fn detect_gpus() -> GpuInventory {
    let output = Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output();
    match output {
        Ok(out) if out.status.success() => GpuInventory {
            models: String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect(),
        },
        _ => GpuInventory::default(),
    }
}

/// `NVIDIA H100 80GB HBM3` -> `accelerator_type:H100`.
pub fn accelerator_tag(model: &str) -> Option<String> {
    let short = model.split_whitespace().find(|word| {
        !word.eq_ignore_ascii_case("nvidia")
            && !word.eq_ignore_ascii_case("tesla")
            && !word.eq_ignore_ascii_case("geforce")
    })?;
    Some(format!("accelerator_type:{short}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accelerator_tags_come_from_model_names() {
        assert_eq!(
            accelerator_tag("NVIDIA H100 80GB HBM3").as_deref(),
            Some("accelerator_type:H100")
        );
        assert_eq!(
            accelerator_tag("Tesla V100-SXM2-16GB").as_deref(),
            Some("accelerator_type:V100-SXM2-16GB")
        );
        assert_eq!(accelerator_tag("NVIDIA"), None);
    }

    #[test]
    fn detects_cpus_and_memory_here() {
        let found = detect_resources();
        assert!(found.units("CPU") >= 1.0);
        assert!(found.units("memory") > 1e8);
    }
}
