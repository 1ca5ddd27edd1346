//! CUDA graphs: libtorch's `at::cuda::CUDAGraph` through `libregatta_cuda_graphs.so`
//! (`src/shim/cuda_graphs.cpp`, built by `scripts/build-cuda-graphs.sh` against a CUDA
//! PyTorch wheel). The generation engine captures its decode step once per batch shape and
//! replays it: one launch instead of a couple of thousand kernel launches a step, which is
//! what a decode step of a small batch on a GPU is bound by (docs/GPU.md).
//!
//! The library is looked for at `REGATTA_CUDA_GRAPHS_LIB`, else beside the running
//! executable, else beside the libtorch loaded (the Docker image's /opt/libtorch/lib);
//! without it (or without CUDA) the engine decodes eagerly and says why.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The file name of the library.
pub const LIBRARY: &str = "libregatta_cuda_graphs.so";
/// The version of the C API this code speaks (`regatta_graphs_api_version`).
const API_VERSION: c_int = 1;

type Status = c_int;

/// The library's functions (kept for the process's life).
struct Api {
    path: PathBuf,
    new: unsafe extern "C" fn(*mut *mut c_void, *mut c_char, usize) -> Status,
    free: unsafe extern "C" fn(*mut c_void),
    stream: unsafe extern "C" fn(c_int, c_int, *mut c_char, usize) -> Status,
    begin: unsafe extern "C" fn(*mut c_void, u64, u64, *mut c_char, usize) -> Status,
    end: unsafe extern "C" fn(*mut c_void, *mut u64, *mut u64, *mut c_char, usize) -> Status,
    replay: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> Status,
}

/// Where the library is looked for, in order: `REGATTA_CUDA_GRAPHS_LIB` alone when set,
/// else beside the running executable, then beside the libtorch this process loaded.
pub fn library_paths() -> Vec<PathBuf> {
    if let Some(path) = std::env::var_os("REGATTA_CUDA_GRAPHS_LIB") {
        return vec![PathBuf::from(path)];
    }
    let beside_exe = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join(LIBRARY)));
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let beside_libtorch = crate::libtorch::libtorch_dir(&maps).map(|dir| dir.join(LIBRARY));
    beside_exe.into_iter().chain(beside_libtorch).collect()
}

/// Loads the library once per process (after libtorch_cuda); later calls return the first
/// outcome.
fn api() -> Result<&'static Api> {
    static LOADED: OnceLock<Result<Api>> = OnceLock::new();
    LOADED.get_or_init(load).as_ref().map_err(|e| match e {
        Error::CudaGraph(reason) => Error::CudaGraph(reason.clone()),
        other => Error::CudaGraph(other.to_string()),
    })
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::CudaGraph(reason.into())
}

fn load() -> Result<Api> {
    if let crate::libtorch::CudaLibrary::Absent { .. } | crate::libtorch::CudaLibrary::Failed { .. } =
        crate::libtorch::load_libtorch_cuda()
    {
        return Err(unavailable("libtorch_cuda is not loaded"));
    }
    let candidates = library_paths();
    let Some(path) = candidates.iter().find(|p| p.exists()).cloned() else {
        let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
        return Err(unavailable(format!(
            "{LIBRARY} not found (looked at {}; build it with scripts/build-cuda-graphs.sh, or set REGATTA_CUDA_GRAPHS_LIB)",
            looked.join(", ")
        )));
    };
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL;
    // SAFETY: the library has no initialisers of its own; it links the libtorch
    // already loaded in this process (same sonames), and its functions catch every C++
    // exception.
    let library = unsafe { libloading::os::unix::Library::open(Some(&path), flags) }
        .map_err(|e| unavailable(format!("{}: {e}", path.display())))?;
    // SAFETY: each symbol is declared in cuda_graphs.cpp with exactly this signature; the
    // library is kept loaded for the process's life below, so the pointers stay valid.
    let api = unsafe {
        let version = *library
            .get::<unsafe extern "C" fn() -> c_int>(b"regatta_graphs_api_version\0")
            .map_err(|e| unavailable(e.to_string()))?;
        if version() != API_VERSION {
            return Err(unavailable(format!(
                "{} speaks API version {}, this binary {API_VERSION}: rebuild it",
                path.display(),
                version()
            )));
        }
        fn symbol<T: Copy>(library: &libloading::os::unix::Library, name: &[u8]) -> Result<T> {
            // SAFETY: see above: the caller names a symbol of exactly type `T`.
            unsafe { library.get::<T>(name) }
                .map(|s| *s)
                .map_err(|e| unavailable(e.to_string()))
        }
        Api {
            path: path.clone(),
            new: symbol(&library, b"regatta_graph_new\0")?,
            free: symbol(&library, b"regatta_graph_free\0")?,
            stream: symbol(&library, b"regatta_graph_stream\0")?,
            begin: symbol(&library, b"regatta_graph_capture_begin\0")?,
            end: symbol(&library, b"regatta_graph_capture_end\0")?,
            replay: symbol(&library, b"regatta_graph_replay\0")?,
        }
    };
    std::mem::forget(library);
    Ok(api)
}

/// Loads the library if not yet (after libtorch_cuda) and says where it came from, or why
/// it cannot be used (`regatta-torch-rank doctor` reports it).
pub fn loaded_from() -> Result<PathBuf> {
    Ok(api()?.path.clone())
}

/// Calls `f` with an error buffer; a non-zero status becomes the text the library wrote.
fn checked(f: impl FnOnce(*mut c_char, usize) -> Status) -> Result<()> {
    let mut error = [0 as c_char; 1024];
    if f(error.as_mut_ptr(), error.len()) != 0 {
        // SAFETY: the library wrote a NUL-terminated string into `error` (zeroed before).
        let text = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
        return Err(Error::CudaGraph(text));
    }
    Ok(())
}

/// Set once a capture failed in this process: libtorch's caching allocator may still count
/// that capture's pool as in use, so later sessions do not try again (they decode eagerly).
static CAPTURE_FAILED: AtomicBool = AtomicBool::new(false);

/// The memory pool graphs share: a later capture takes the first one's, so the graphs of
/// every batch shape reuse one set of intermediate buffers (they never replay at once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pool(u64, u64);

/// One captured graph.
pub struct CudaGraph {
    handle: NonNull<c_void>,
    api: &'static Api,
}

impl CudaGraph {
    /// Captures what `work` enqueues on CUDA device `device` into a graph, `work` run once
    /// before on the same side stream (eager: libraries set up their handles and
    /// workspaces, which a capture may not). Returns the graph, the pool it allocated
    /// from, and what the captured run returned (tensors the replays write into). The
    /// eager run's effects are the step's own, so `work` must be idempotent for its inputs.
    pub fn capture<T>(
        device: usize,
        pool: Option<Pool>,
        work: &mut dyn FnMut() -> Result<T>,
    ) -> Result<(Self, Pool, T)> {
        let api = api()?;
        if CAPTURE_FAILED.load(Ordering::Relaxed) {
            return Err(Error::CudaGraph(
                "an earlier capture in this process failed; decoding eagerly".into(),
            ));
        }
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and error buffer.
        checked(|e, n| unsafe { (api.new)(&mut handle, e, n) })?;
        let graph = Self {
            handle: NonNull::new(handle).ok_or_else(|| Error::CudaGraph("no graph was made".into()))?,
            api,
        };
        let device = device as c_int;
        // SAFETY: plain calls with an error buffer.
        checked(|e, n| unsafe { (api.stream)(device, 1, e, n) })?;
        // libtorch's refusals reach tch's plain ops as panics: one inside a capture (an op
        // that waits for the device, say) becomes this capture's error.
        let mut guarded = || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *work))
                .unwrap_or_else(|panic| Err(Error::CudaGraph(crate::error::panic_text(&*panic))))
        };
        let captured = (|| -> Result<(Pool, T)> {
            guarded()?;
            let Pool(a, b) = pool.unwrap_or_default();
            // SAFETY: a live graph, an error buffer.
            checked(|e, n| unsafe { (api.begin)(graph.handle.as_ptr(), a, b, e, n) })?;
            let out = guarded();
            let (mut a, mut b) = (0u64, 0u64);
            // Always ended, so a failed capture leaves the stream usable.
            // SAFETY: a live graph, valid out-pointers, an error buffer.
            let ended = checked(|e, n| unsafe { (api.end)(graph.handle.as_ptr(), &mut a, &mut b, e, n) });
            let out = out?;
            ended?;
            Ok((Pool(a, b), out))
        })();
        // SAFETY: plain calls with an error buffer.
        let restored = checked(|e, n| unsafe { (api.stream)(device, 0, e, n) });
        if captured.is_err() {
            CAPTURE_FAILED.store(true, Ordering::Relaxed);
        }
        let (pool, out) = captured?;
        restored?;
        Ok((graph, pool, out))
    }

    /// Runs the captured work again, on the current (default) stream.
    pub fn replay(&self) -> Result<()> {
        // SAFETY: a live graph, an error buffer.
        checked(|e, n| unsafe { (self.api.replay)(self.handle.as_ptr(), e, n) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: the graph was made by `new` and is freed once, here.
        unsafe { (self.api.free)(self.handle.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_cuda_a_capture_is_a_clear_error_not_a_crash() {
        let error = CudaGraph::capture(0, None, &mut || Ok(())).err().expect("no CUDA here");
        assert!(matches!(error, Error::CudaGraph(_)), "{error}");
        assert!(!error.to_string().is_empty());
    }
}
