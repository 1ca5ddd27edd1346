//! Finding the running libtorch and opening its CUDA half (`libtorch_cuda.so`) beside it,
//! first thing in every executor: see [`crate::cuda`] for why. Below `cuda.rs` and
//! `graphs.rs`, which both need it.
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Serialize;

/// The libtorch headers this binary was compiled against (from `build.rs`).
pub const BUILT_AGAINST: &str = env!("REGATTA_LIBTORCH_BUILT");

/// What became of `libtorch_cuda.so` at start-up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum CudaLibrary {
    /// Loaded from `path`: libtorch can run CUDA kernels where a driver and a device are.
    Loaded {
        /// The library opened.
        path: PathBuf,
    },
    /// The running libtorch is a CPU-only one (no `libtorch_cuda.so` beside it).
    Absent {
        /// Where it was looked for.
        looked_in: Option<PathBuf>,
    },
    /// `libtorch_cuda.so` is there but would not load (usually a missing CUDA library).
    Failed {
        /// The library tried.
        path: PathBuf,
        /// The dynamic loader's reason.
        error: String,
    },
}

impl CudaLibrary {
    /// Whether libtorch has its CUDA half.
    pub fn is_loaded(&self) -> bool {
        matches!(self, Self::Loaded { .. })
    }

    pub(crate) fn why_not(&self) -> Option<String> {
        match self {
            Self::Loaded { .. } => None,
            Self::Absent { looked_in } => Some(format!(
                "the libtorch in use is CPU-only (no libtorch_cuda.so in {}); put a CUDA libtorch \
                 2.11 first on LD_LIBRARY_PATH (the torch==2.11.0 wheel's torch/lib, see \
                 docs/GPU.md)",
                looked_in
                    .as_deref()
                    .map_or_else(|| "the libtorch folder".to_string(), |p| p.display().to_string())
            )),
            Self::Failed { path, error } => Some(format!(
                "{} is there but did not load: {error}; its CUDA libraries (the nvidia-* wheels) \
                 must be findable",
                path.display()
            )),
        }
    }
}

/// The folder of the `libtorch_cpu.so` mapped into this process, read from the text of
/// `/proc/self/maps`.
pub fn libtorch_dir(maps: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            Path::new(path)
                .file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("libtorch_cpu.so"))
        })
        .and_then(|path| Path::new(path).parent().map(Path::to_path_buf))
}

/// The version a PyTorch wheel states in `torch/version.py` (`__version__ = '2.11.0+cu130'`).
pub fn wheel_version(version_py: &str) -> Option<String> {
    version_py.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("__version__")?.trim_start();
        let value = rest.strip_prefix('=')?.trim();
        // A type annotation (`__version__: str = ...`) is not the plain form; skip it.
        let quoted = value.trim_matches(|c| c == '\'' || c == '"');
        (quoted.len() + 2 == value.len()).then(|| quoted.to_string())
    })
}

/// Opens `libtorch_cuda.so` beside the running `libtorch_cpu.so`, once per process; later
/// calls return the first outcome. Call it before anything asks libtorch about CUDA.
pub fn load_libtorch_cuda() -> &'static CudaLibrary {
    static LOADED: OnceLock<CudaLibrary> = OnceLock::new();
    LOADED.get_or_init(|| {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let Some(dir) = libtorch_dir(&maps) else {
            return CudaLibrary::Absent { looked_in: None };
        };
        let path = dir.join("libtorch_cuda.so");
        if !path.exists() {
            return CudaLibrary::Absent { looked_in: Some(dir) };
        }
        let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
        // SAFETY: loading runs libtorch_cuda's static initialisers, which register its CUDA
        // hooks and kernels with the libtorch_cpu already loaded from the same folder (the
        // same build); nothing else in this process runs CUDA code yet.
        match unsafe { libloading::os::unix::Library::open(Some(&path), flags) } {
            Ok(library) => {
                // Kept for the process's life: its kernels are registered with libtorch.
                std::mem::forget(library);
                CudaLibrary::Loaded { path }
            }
            Err(e) => CudaLibrary::Failed {
                path,
                error: e.to_string(),
            },
        }
    })
}

/// Makes glibc's allocator keep the memory a step frees for the next step: tensors below
/// 32 MiB come from the heap (not a fresh `mmap` each, zeroed page by page by the kernel),
/// and up to 1 GiB freed at the heap's top stays mapped. libtorch allocates and frees a
/// step's intermediates (gathered keys, activations, logits) anew every step; with glibc's
/// defaults a CPU decode step at batch 64 spent ~12% of its time in the kernel faulting
/// those pages in again (docs/NOTES.md, "Generation speed on the CPU"). Call first thing.
pub fn keep_freed_memory() {
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_TOP_PAD: c_int = -2;
    const M_MMAP_THRESHOLD: c_int = -3;
    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    // SAFETY: glibc's documented tuning call with valid parameters; it changes only
    // thresholds of the allocator, before or between allocations alike.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
        mallopt(M_TOP_PAD, 64 << 20);
    }
}
