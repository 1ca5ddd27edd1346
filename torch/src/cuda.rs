//! Finding CUDA for libtorch, for sure, and saying what was found.
//!
//! torch-sys links `libtorch_cuda` only when it is there at build time, and the linker's
//! `--as-needed` drops it even then, because nothing in the binary calls into it directly
//! (tch-rs issue 980): a CUDA libtorch on `LD_LIBRARY_PATH` would then never load its CUDA
//! half and `Cuda::is_available()` would be false on a GPU host. So every executor calls
//! [`load_libtorch_cuda`] first thing: it opens `libtorch_cuda.so` from the folder the
//! running `libtorch_cpu.so` came from (one binary for CPU and GPU; the CUDA libraries are
//! found at run time, through the wheel's own run paths to its `nvidia-*` libraries).
//! libtorch resolves its CUDA hooks on first use, so the load must come before any CUDA
//! query, which is why it is the first call of `main`.
//!
//! [`Diagnosis`] is what `regatta-torch-rank doctor` prints, and [`pick_device`] turns a
//! rank's device setting and granted GPUs into a device, refusing with the diagnosis's
//! reason where GPUs were granted and CUDA cannot be used: never a silent CPU fallback.
#![allow(unsafe_code)]

use std::path::PathBuf;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

pub use crate::libtorch::{
    keep_freed_memory, libtorch_dir, load_libtorch_cuda, wheel_version, CudaLibrary, BUILT_AGAINST,
};

/// A library `doctor` looked for: its version, or why it cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Found {
    /// Loaded; its version.
    Available {
        /// As the library reports it.
        version: String,
    },
    /// Not usable, and why.
    Missing {
        /// What is missing and what to do.
        reason: String,
    },
}

impl Found {
    fn reason(&self) -> Option<&str> {
        match self {
            Self::Available { .. } => None,
            Self::Missing { reason } => Some(reason),
        }
    }

    fn show(&self) -> String {
        match self {
            Self::Available { version } => version.clone(),
            Self::Missing { reason } => format!("not available: {reason}"),
        }
    }
}

fn missing(reason: impl Into<String>) -> Found {
    Found::Missing { reason: reason.into() }
}

/// One CUDA device as the driver reports it.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    /// Ordinal.
    pub index: usize,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Device memory.
    pub total_memory_bytes: u64,
    /// Compute capability, as `major.minor`.
    pub compute_capability: String,
    /// bf16 tensor cores (compute capability 8.0 or later).
    pub bf16: bool,
}

/// Which fused attention kernel libtorch picks for a training-shaped call on a device.
#[derive(Debug, Clone, Serialize)]
pub struct SdpaChoice {
    /// The device and dtype asked about.
    pub on: String,
    /// Kernel for causal attention with no mask (GQA, 8 query heads over 2 KV heads).
    pub causal: String,
    /// Kernel when a dense `[B,1,T,T]` mask is passed (how packed rows attend where the
    /// variable-length kernel does not run).
    pub dense_mask: String,
}

/// libtorch's global SDPA switches.
#[derive(Debug, Clone, Serialize)]
pub struct SdpaEnabled {
    /// FlashAttention.
    pub flash: bool,
    /// Memory-efficient attention.
    pub efficient: bool,
    /// The math fallback.
    pub math: bool,
    /// cuDNN attention.
    pub cudnn: bool,
}

/// Everything `regatta-torch-rank doctor` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    /// The headers this binary was compiled against.
    pub libtorch_built_against: String,
    /// The folder of the running `libtorch_cpu.so`.
    pub libtorch_dir: Option<PathBuf>,
    /// The running wheel's `torch/version.py`, where libtorch came from a wheel.
    pub libtorch_wheel_version: Option<String>,
    /// What became of `libtorch_cuda.so`.
    pub libtorch_cuda: CudaLibrary,
    /// `libcuda.so` (the driver): its version, or why it is not there.
    pub driver: Found,
    /// libtorch's own answer.
    pub cuda_available: bool,
    /// libtorch's device count.
    pub device_count: i64,
    /// The devices the driver lists.
    pub devices: Vec<DeviceInfo>,
    /// cuDNN usable by libtorch.
    pub cudnn_available: bool,
    /// NCCL's version, or why it cannot be loaded.
    pub nccl: Found,
    /// Kernel choices of scaled-dot-product attention.
    pub sdpa: Vec<SdpaChoice>,
    /// The SDPA kernels libtorch may use (its global switches).
    pub sdpa_enabled: SdpaEnabled,
    /// How packed training rows attend on the first CUDA device in bf16 (or on the CPU).
    pub packed_attention: String,
    /// Why a rank granted a GPU could not use one here; `None` when it can.
    pub cuda_unusable: Option<String>,
    /// `libregatta_cuda_graphs.so` (decode steps replayed as CUDA graphs): where it was
    /// loaded from, or why generation on CUDA will decode eagerly.
    pub cuda_graphs: Found,
}

/// Looks at this process's libtorch, CUDA driver, devices and NCCL.
pub fn diagnose() -> Diagnosis {
    let libtorch_cuda = load_libtorch_cuda().clone();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let dir = libtorch_dir(&maps);
    let wheel = dir
        .as_deref()
        .and_then(|dir| std::fs::read_to_string(dir.join("../version.py")).ok())
        .and_then(|text| wheel_version(&text));
    let cuda_available = tch::Cuda::is_available();
    let device_count = tch::Cuda::device_count();
    let (driver, devices) = driver_devices();
    let mut sdpa = vec![sdpa_choice(Device::Cpu, Kind::Float)];
    if cuda_available {
        sdpa.push(sdpa_choice(Device::Cuda(0), Kind::BFloat16));
    }
    let cuda_unusable = why_unusable(&libtorch_cuda, &driver, cuda_available, device_count);
    Diagnosis {
        libtorch_built_against: BUILT_AGAINST.to_string(),
        libtorch_dir: dir,
        libtorch_wheel_version: wheel,
        libtorch_cuda,
        driver,
        cuda_available,
        device_count,
        devices,
        cudnn_available: cuda_available && tch::Cuda::cudnn_is_available(),
        nccl: nccl_version(),
        sdpa,
        sdpa_enabled: {
            let (flash, efficient, math, cudnn) = crate::shim::sdp_enabled();
            SdpaEnabled {
                flash,
                efficient,
                math,
                cudnn,
            }
        },
        packed_attention: {
            let (device, kind) = if cuda_available {
                (Device::Cuda(0), Kind::BFloat16)
            } else {
                (Device::Cpu, Kind::Float)
            };
            format!(
                "{} on {device:?} {kind:?} (head sizes multiple of 8 up to 256)",
                crate::attention::Kernel::choose(device, kind, 128).name()
            )
        },
        cuda_unusable,
        cuda_graphs: match crate::graphs::loaded_from() {
            Ok(path) => Found::Available {
                version: format!("loaded from {}", path.display()),
            },
            Err(e) => Found::Missing { reason: e.to_string() },
        },
    }
}

fn why_unusable(library: &CudaLibrary, driver: &Found, cuda_available: bool, device_count: i64) -> Option<String> {
    if cuda_available && device_count > 0 {
        return None;
    }
    if let Some(reason) = library.why_not() {
        return Some(reason);
    }
    if let Some(reason) = driver.reason() {
        return Some(format!("libtorch has CUDA but {reason}"));
    }
    // libtorch's own words on the first CUDA allocation say what is missing.
    let probe = Tensor::f_zeros([1], (Kind::Float, Device::Cuda(0)))
        .err()
        .map(|e| first_line(&e.to_string()))
        .unwrap_or_else(|| "no CUDA device is visible".to_string());
    Some(format!(
        "libtorch has CUDA and the driver loads, but libtorch sees {device_count} devices: {probe}"
    ))
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().trim().to_string()
}

/// The driver's version and devices, or why the driver cannot be used.
fn driver_devices() -> (Found, Vec<DeviceInfo>) {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to dlopen candidate names of the driver library.
    if !unsafe { sys::is_culib_present() } {
        return (missing("no NVIDIA driver (libcuda.so.1) is installed"), Vec::new());
    }
    if let Err(e) = result::init() {
        return (
            missing(format!("the NVIDIA driver did not initialise: {e:?}")),
            Vec::new(),
        );
    }
    let mut version = 0;
    // SAFETY: a valid out-pointer; the driver is initialised.
    let version = match unsafe { sys::cuDriverGetVersion(&mut version) }.result() {
        Ok(()) => format!("CUDA {}.{}", version / 1000, (version % 1000) / 10),
        Err(e) => format!("unknown ({e:?})"),
    };
    let count = result::device::get_count().unwrap_or(0).max(0);
    let devices = (0..count)
        .filter_map(|index| {
            let device = result::device::get(index).ok()?;
            let attribute = |which| {
                // SAFETY: `device` came from cuDeviceGet.
                unsafe { result::device::get_attribute(device, which) }.unwrap_or(0)
            };
            let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
            let minor = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
            Some(DeviceInfo {
                index: index as usize,
                name: result::device::get_name(device).unwrap_or_default(),
                // SAFETY: `device` came from cuDeviceGet.
                total_memory_bytes: unsafe { result::device::total_mem(device) }.unwrap_or(0) as u64,
                compute_capability: format!("{major}.{minor}"),
                bf16: major >= 8,
            })
        })
        .collect();
    (Found::Available { version }, devices)
}

fn nccl_version() -> Found {
    if let Err(e) = crate::nccl::check_library() {
        return missing(e.to_string());
    }
    let mut version = 0;
    // SAFETY: the library is present (checked above) and the pointer is valid.
    match unsafe { cudarc::nccl::sys::ncclGetVersion(&mut version) } {
        cudarc::nccl::sys::ncclResult_t::ncclSuccess => Found::Available {
            version: format!("{}.{}.{}", version / 10000, (version % 10000) / 100, version % 100),
        },
        other => missing(format!("ncclGetVersion: {other:?}")),
    }
}

/// libtorch's name for an `_fused_sdp_choice` answer (`SDPBackend`'s order).
pub fn sdp_backend_name(choice: i64) -> &'static str {
    match choice {
        0 => "math",
        1 => "flash_attention",
        2 => "efficient_attention",
        3 => "cudnn_attention",
        4 => "overrideable",
        _ => "none",
    }
}

fn sdpa_choice(device: Device, kind: Kind) -> SdpaChoice {
    let (batch, heads, kv_heads, time, head_dim) = (2, 8, 2, 256, 64);
    let q = Tensor::zeros([batch, heads, time, head_dim], (kind, device));
    let kv = Tensor::zeros([batch, kv_heads, time, head_dim], (kind, device));
    let choose = |mask: Option<&Tensor>| {
        Tensor::f_internal_fused_sdp_choice(&q, &kv, &kv, mask, 0.0, mask.is_none(), None, true).map_or_else(
            |e| format!("error: {}", first_line(&e.to_string())),
            |c| sdp_backend_name(c).into(),
        )
    };
    let mask = Tensor::ones([batch, 1, time, time], (Kind::Bool, device)).tril(0);
    SdpaChoice {
        on: format!("{device:?} {kind:?}"),
        causal: choose(None),
        dense_mask: choose(Some(&mask)),
    }
}

/// The device a rank or scorer runs on: `setting` is the config's `device` (`auto`, `cpu`
/// or `cuda`), `gpus` the GPUs the cluster granted it. Granted GPUs that cannot be used,
/// or `cuda` asked where there is none, are refused with the reason.
pub fn pick_device(setting: &str, gpus: &[u32]) -> Result<Device> {
    let wants_cuda = match setting {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => true,
        _ => !gpus.is_empty(),
    };
    if !wants_cuda {
        return Ok(Device::Cpu);
    }
    load_libtorch_cuda();
    if tch::Cuda::is_available() && tch::Cuda::device_count() > 0 {
        // Float32 matmuls on CUDA may use TF32 tensor cores, as PyTorch recipes allow
        // (`set_float32_matmul_precision("high")`): 8x the f32 rate on an H100.
        crate::shim::allow_tf32(true);
        return Ok(Device::Cuda(0));
    }
    let diagnosis = diagnose();
    let reason = diagnosis
        .cuda_unusable
        .unwrap_or_else(|| "libtorch sees no CUDA device".to_string());
    let asked = if setting == "cuda" {
        "device = \"cuda\"".to_string()
    } else {
        format!("granted GPU {gpus:?} (device = \"{setting}\")")
    };
    Err(Error::Invalid(format!(
        "{asked} but CUDA cannot be used here: {reason}. Run `regatta-torch-rank doctor` on this \
         node for details, or set device = \"cpu\" to train on the CPU on purpose"
    )))
}

/// Whether CUDA device `ordinal` (as this process sees it, after `CUDA_VISIBLE_DEVICES`)
/// has bf16 tensor cores (compute capability 8.0 or later); `None` without a driver.
pub fn bf16_supported(ordinal: usize) -> Option<bool> {
    let device = driver_device(ordinal)?;
    // SAFETY: `device` came from cuDeviceGet.
    let major = unsafe {
        cudarc::driver::result::device::get_attribute(
            device,
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )
    }
    .ok()?;
    Some(major >= 8)
}

/// The driver's handle of device `ordinal`, initialising the driver; `None` where there is
/// no driver library (cudarc panics on a call without it, so none is made) or no device.
fn driver_device(ordinal: usize) -> Option<cudarc::driver::sys::CUdevice> {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to dlopen candidate names of the driver library.
    if !unsafe { sys::is_culib_present() } {
        return None;
    }
    result::init().ok()?;
    result::device::get(ordinal as i32).ok()
}

/// The memory of CUDA device `ordinal` in bytes, from the driver; `None` without one.
pub fn total_memory_bytes(ordinal: usize) -> Option<u64> {
    let device = driver_device(ordinal)?;
    // SAFETY: `device` came from cuDeviceGet.
    unsafe { cudarc::driver::result::device::total_mem(device) }
        .ok()
        .map(|bytes| bytes as u64)
}

/// Free memory of CUDA device `ordinal` as the driver counts it (every process's use
/// taken), through the context libtorch made current on this thread; `None` where there
/// is no driver or no current context.
pub fn free_memory_bytes(ordinal: usize) -> Option<u64> {
    driver_device(ordinal)?;
    cudarc::driver::result::mem_get_info().ok().map(|(free, _)| free as u64)
}

/// How failures name a device: `cpu`, or `cuda:0 (NVIDIA H100 80GB HBM3)` (the name from
/// the driver, where it answers).
pub fn device_label(device: Device) -> String {
    match device {
        Device::Cuda(ordinal) => {
            let name = driver_device(ordinal).and_then(|d| cudarc::driver::result::device::get_name(d).ok());
            match name {
                Some(name) => format!("cuda:{ordinal} ({name})"),
                None => format!("cuda:{ordinal}"),
            }
        }
        _ => "cpu".to_string(),
    }
}

/// The dtype scoring and generation compute in on `device`: bf16 on a CUDA device that
/// has it, f16 on an older one, f32 on the CPU (weights and KV cache alike).
pub fn inference_kind(device: Device) -> Kind {
    match device {
        Device::Cuda(ordinal) if bf16_supported(ordinal).unwrap_or(true) => Kind::BFloat16,
        Device::Cuda(_) => Kind::Half,
        _ => Kind::Float,
    }
}

/// The dtype training computes in on `device` (master weights stay f32): bf16 on CUDA, f32
/// on the CPU. A GPU without bf16 is refused: f16 training would need loss scaling, which
/// Regatta does not do.
pub fn training_kind(device: Device) -> Result<Kind> {
    match device {
        Device::Cuda(ordinal) if bf16_supported(ordinal) == Some(false) => Err(Error::Invalid(format!(
            "cuda:{ordinal} has no bf16 (compute capability below 8.0): Regatta trains in bf16 \
             on CUDA and does not do f16 loss scaling; use an Ampere or later GPU, or device = \"cpu\""
        ))),
        Device::Cuda(_) => Ok(Kind::BFloat16),
        _ => Ok(Kind::Float),
    }
}

impl Diagnosis {
    /// The report as lines a person reads.
    pub fn to_text(&self) -> String {
        let mut out = Vec::new();
        out.push(format!("libtorch built against: {}", self.libtorch_built_against));
        out.push(format!(
            "libtorch in use: {}{}",
            self.libtorch_dir
                .as_deref()
                .map_or("?".into(), |p| p.display().to_string()),
            self.libtorch_wheel_version
                .as_deref()
                .map_or(String::new(), |v| format!(" (wheel {v})"))
        ));
        out.push(format!(
            "libtorch_cuda: {}",
            match &self.libtorch_cuda {
                CudaLibrary::Loaded { path } => format!("loaded from {}", path.display()),
                other => other.why_not().unwrap_or_default(),
            }
        ));
        out.push(format!("NVIDIA driver: {}", self.driver.show()));
        out.push(format!(
            "CUDA available: {} ({} devices, cuDNN {})",
            self.cuda_available,
            self.device_count,
            if self.cudnn_available { "yes" } else { "no" }
        ));
        for d in &self.devices {
            out.push(format!(
                "  cuda:{} {}: {:.1} GiB, compute capability {}, bf16 {}",
                d.index,
                d.name,
                d.total_memory_bytes as f64 / (1u64 << 30) as f64,
                d.compute_capability,
                if d.bf16 { "yes" } else { "no" }
            ));
        }
        out.push(format!("NCCL: {}", self.nccl.show()));
        for s in &self.sdpa {
            out.push(format!(
                "attention kernel on {}: causal {}, with a dense mask {}",
                s.on, s.causal, s.dense_mask
            ));
        }
        let e = &self.sdpa_enabled;
        out.push(format!(
            "SDPA kernels enabled: flash {}, memory-efficient {}, math {}, cuDNN {}",
            e.flash, e.efficient, e.math, e.cudnn
        ));
        out.push(format!("packed training rows attend with: {}", self.packed_attention));
        out.push(format!("CUDA graphs for decoding: {}", self.cuda_graphs.show()));
        out.push(match &self.cuda_unusable {
            None => "verdict: CUDA usable".to_string(),
            Some(reason) => format!("verdict: CPU only: {reason}"),
        });
        out.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_dir_is_read_from_the_process_maps() {
        let maps = "\
7f1c00000000-7f1c00021000 rw-p 00000000 00:00 0
7f1c10000000-7f1c12000000 r-xp 00000000 fd:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c20000000-7f1c40000000 r-xp 00000000 fd:01 456 /opt/venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so
";
        assert_eq!(
            libtorch_dir(maps),
            Some(PathBuf::from("/opt/venv/lib/python3.12/site-packages/torch/lib"))
        );
        assert_eq!(libtorch_dir("7f1c 0 r-xp 0 0:0 1 /lib/libtorch_cuda.so\n"), None);
        assert_eq!(libtorch_dir(""), None);
    }

    #[test]
    fn wheel_version_reads_the_plain_assignment() {
        let text =
            "from typing import Optional\n__all__ = ['__version__']\n__version__ = '2.11.0+cu130'\ndebug = False\n";
        assert_eq!(wheel_version(text).as_deref(), Some("2.11.0+cu130"));
        assert_eq!(wheel_version("__version__ = \"2.11.0\"\n").as_deref(), Some("2.11.0"));
        assert_eq!(wheel_version("__version__: str = 'x'\n"), None);
        assert_eq!(wheel_version("version = '1'\n"), None);
    }

    #[test]
    fn cpu_setting_and_no_gpus_stay_on_cpu_without_asking_cuda() {
        assert_eq!(pick_device("cpu", &[0, 1]).ok(), Some(Device::Cpu));
        assert_eq!(pick_device("auto", &[]).ok(), Some(Device::Cpu));
    }

    #[test]
    fn granted_gpus_without_cuda_are_refused_with_the_reason() {
        // This test runs on the CPU libtorch the suite builds against (no GPU here).
        if tch::Cuda::is_available() {
            return;
        }
        let error = pick_device("auto", &[0]).expect_err("a granted GPU that cannot be used must fail");
        let text = error.to_string();
        assert!(text.contains("granted GPU [0]"), "{text}");
        assert!(text.contains("CUDA cannot be used here"), "{text}");
        let error = pick_device("cuda", &[]).expect_err("device = cuda without CUDA must fail");
        assert!(error.to_string().contains("device = \"cuda\""), "{error}");
    }

    #[test]
    fn failures_name_the_device() {
        assert_eq!(device_label(Device::Cpu), "cpu");
        // No driver here: the ordinal alone, and no panic from the missing library.
        if !tch::Cuda::is_available() {
            assert_eq!(device_label(Device::Cuda(0)), "cuda:0");
        }
    }

    #[test]
    fn the_cpu_computes_in_f32_for_training_and_inference() {
        assert_eq!(inference_kind(Device::Cpu), Kind::Float);
        assert_eq!(training_kind(Device::Cpu).ok(), Some(Kind::Float));
    }

    #[test]
    fn backend_names_follow_libtorch_order() {
        assert_eq!(sdp_backend_name(0), "math");
        assert_eq!(sdp_backend_name(1), "flash_attention");
        assert_eq!(sdp_backend_name(-1), "none");
    }
}
