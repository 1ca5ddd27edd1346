//! What a worker has: CPUs, memory and GPUs found on this machine, overridable by flags.

use std::process::Command;

use regatta_proto::{Resources, GPU};

/// GPUs found through `nvidia-smi`: count and model names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuInventory {
    /// Device model names, one per GPU.
    pub models: Vec<String>,
}

/// One GPU as `nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDevice {
    /// The driver's index.
    pub index: u32,
    /// The model name (`NVIDIA A100-SXM4-80GB`).
    pub name: String,
    /// `GPU-...`.
    pub uuid: String,
}

/// The `nvidia-smi` query a worker runs.
pub const NVIDIA_SMI_QUERY: [&str; 2] = ["--query-gpu=index,name,uuid", "--format=csv,noheader"];

/// Detects this machine's resources: `CPU`, `memory` (bytes), `GPU` (the devices
/// `CUDA_VISIBLE_DEVICES` leaves visible) and, for NVIDIA devices, a normalised
/// `accelerator_type:<model>` tag such as `accelerator_type:H100`.
pub fn detect_resources() -> Resources {
    let mut set = Resources::new();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    set.set("CPU", cpus as f64);
    if let Some(bytes) = crate::objects::total_memory_bytes() {
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

/// Lists the NVIDIA GPUs this process may use: `nvidia-smi`'s devices filtered by
/// `CUDA_VISIBLE_DEVICES`; none when the tool or driver is absent.
pub fn detect_gpus() -> GpuInventory {
    let output = Command::new("nvidia-smi").args(NVIDIA_SMI_QUERY).output();
    let devices = match output {
        Ok(out) if out.status.success() => parse_nvidia_smi(&String::from_utf8_lossy(&out.stdout)),
        _ => return GpuInventory::default(),
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    GpuInventory {
        models: visible_devices(&devices, visible.as_deref())
            .into_iter()
            .map(|d| d.name)
            .collect(),
    }
}

/// Parses `nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader` (one device a
/// line; lines that do not parse are skipped).
pub fn parse_nvidia_smi(text: &str) -> Vec<GpuDevice> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split(',').map(str::trim);
            let index = fields.next()?.parse().ok()?;
            let name = fields.next().filter(|n| !n.is_empty())?.to_string();
            let uuid = fields.next().unwrap_or_default().to_string();
            Some(GpuDevice { index, name, uuid })
        })
        .collect()
}

/// The devices `CUDA_VISIBLE_DEVICES` leaves visible, in its order, as CUDA applies it:
/// unset means all; an empty value, or one whose first entry names no device, means
/// none; entries are indices or (prefixes of) UUIDs, and the list stops at the first
/// entry that names no device.
pub fn visible_devices(devices: &[GpuDevice], cuda_visible_devices: Option<&str>) -> Vec<GpuDevice> {
    let Some(list) = cuda_visible_devices else {
        return devices.to_vec();
    };
    let mut out: Vec<GpuDevice> = Vec::new();
    for entry in list.split(',').map(str::trim) {
        let found = if let Ok(index) = entry.parse::<i64>() {
            devices.iter().find(|d| i64::from(d.index) == index)
        } else if entry.starts_with("GPU-") || entry.starts_with("MIG-") {
            devices.iter().find(|d| !entry.is_empty() && d.uuid.starts_with(entry))
        } else {
            None
        };
        match found {
            Some(device) if !out.contains(device) => out.push(device.clone()),
            _ => break,
        }
    }
    out
}

/// The accelerator type of a model name, in the form placement tags use: the model
/// without vendor words, memory size or form factor — `NVIDIA H100 80GB HBM3` -> `H100`,
/// `NVIDIA A100-SXM4-80GB` -> `A100`, `Tesla V100-SXM2-16GB` -> `V100`, `NVIDIA L4` ->
/// `L4`, `NVIDIA GeForce RTX 4090` -> `RTX4090`.
pub fn accelerator_type(model: &str) -> Option<String> {
    const VENDOR: [&str; 5] = ["nvidia", "tesla", "geforce", "quadro", "titan"];
    let words: Vec<&str> = model
        .split_whitespace()
        .filter(|w| !VENDOR.iter().any(|v| w.eq_ignore_ascii_case(v)))
        .collect();
    let first = words.first()?;
    let core = |w: &str| w.split('-').next().unwrap_or(w).to_ascii_uppercase();
    let kind = if (first.eq_ignore_ascii_case("rtx") || first.eq_ignore_ascii_case("gtx")) && words.len() > 1 {
        format!("{}{}", core(first), core(words[1]))
    } else {
        core(first)
    };
    (!kind.is_empty()).then_some(kind)
}

/// `NVIDIA H100 80GB HBM3` -> `accelerator_type:H100` (see [`accelerator_type`]).
pub fn accelerator_tag(model: &str) -> Option<String> {
    accelerator_type(model).map(|kind| format!("accelerator_type:{kind}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader` as recorded on an
    /// 8-GPU H100 host, a 4-GPU A100 host and a 2-GPU L4 host.
    const H100: &str = "0, NVIDIA H100 80GB HBM3, GPU-5a1c7f1e-7d2b-4c11-9a0e-1f0d2b7c3e41\n\
1, NVIDIA H100 80GB HBM3, GPU-8e44b3a0-2f6d-4d5e-8b7a-3c9e1d2f4a52\n\
2, NVIDIA H100 80GB HBM3, GPU-0b9d6e2c-5a3f-4e8b-9c1d-7e2f3a4b5c63\n\
3, NVIDIA H100 80GB HBM3, GPU-c3f1a2b4-6d7e-4f80-a1b2-c3d4e5f6a774\n\
4, NVIDIA H100 80GB HBM3, GPU-1d2e3f40-7a8b-4c9d-b0e1-f2a3b4c5d685\n\
5, NVIDIA H100 80GB HBM3, GPU-9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b96\n\
6, NVIDIA H100 80GB HBM3, GPU-2a3b4c5d-6e7f-4081-92a3-b4c5d6e7f8a7\n\
7, NVIDIA H100 80GB HBM3, GPU-7e6d5c4b-3a29-4180-9f8e-7d6c5b4a39b8\n";
    const A100: &str = "0, NVIDIA A100-SXM4-80GB, GPU-a1b2c3d4-0000-4000-8000-000000000001\n\
1, NVIDIA A100-SXM4-80GB, GPU-a1b2c3d4-0000-4000-8000-000000000002\n\
2, NVIDIA A100-SXM4-80GB, GPU-a1b2c3d4-0000-4000-8000-000000000003\n\
3, NVIDIA A100-SXM4-80GB, GPU-a1b2c3d4-0000-4000-8000-000000000004\n";
    const L4: &str = "0, NVIDIA L4, GPU-4c4c4c4c-1111-4222-8333-444455556666\n\
1, NVIDIA L4, GPU-4c4c4c4c-7777-4888-9999-aaaabbbbcccc\n";

    #[test]
    fn recorded_nvidia_smi_outputs_give_normalised_tags() {
        for (text, count, tag) in [
            (H100, 8, "accelerator_type:H100"),
            (A100, 4, "accelerator_type:A100"),
            (L4, 2, "accelerator_type:L4"),
        ] {
            let devices = parse_nvidia_smi(text);
            assert_eq!(devices.len(), count);
            assert!(
                devices.iter().all(|d| accelerator_tag(&d.name).as_deref() == Some(tag)),
                "{devices:?}"
            );
        }
        assert_eq!(parse_nvidia_smi(L4)[1].uuid, "GPU-4c4c4c4c-7777-4888-9999-aaaabbbbcccc");
        for (name, kind) in [
            ("Tesla V100-SXM2-16GB", "V100"),
            ("NVIDIA A10G", "A10G"),
            ("NVIDIA H200", "H200"),
            ("NVIDIA A100-PCIE-40GB", "A100"),
            ("Tesla T4", "T4"),
            ("NVIDIA GeForce RTX 4090", "RTX4090"),
            ("NVIDIA L40S", "L40S"),
        ] {
            assert_eq!(accelerator_type(name).as_deref(), Some(kind), "{name}");
        }
        assert_eq!(accelerator_tag("NVIDIA"), None);
        assert!(parse_nvidia_smi("No devices were found\n").is_empty());
    }

    #[test]
    fn cuda_visible_devices_selects_by_index_or_uuid_in_its_order() {
        let all = parse_nvidia_smi(H100);
        let indices = |v: Vec<GpuDevice>| v.iter().map(|d| d.index).collect::<Vec<_>>();
        assert_eq!(indices(visible_devices(&all, None)), (0..8).collect::<Vec<_>>());
        assert_eq!(indices(visible_devices(&all, Some("3,1"))), vec![3, 1]);
        assert_eq!(indices(visible_devices(&all, Some(""))), Vec::<u32>::new());
        assert_eq!(indices(visible_devices(&all, Some("-1"))), Vec::<u32>::new());
        // CUDA stops at the first entry that names no device.
        assert_eq!(indices(visible_devices(&all, Some("2,9,4"))), vec![2]);
        assert_eq!(
            indices(visible_devices(&all, Some("GPU-8e44b3a0,GPU-7e6d5c4b-3a29"))),
            vec![1, 7]
        );
        assert_eq!(indices(visible_devices(&all, Some("1,1"))), vec![1]);
    }

    #[test]
    fn detects_cpus_and_memory_here() {
        let found = detect_resources();
        assert!(found.units("CPU") >= 1.0);
        assert!(found.units("memory") > 1e8);
    }
}
