//! The NCCL backend (cudarc, loaded at run time): collectives on CUDA tensors.
//!
//! Rank 0 makes the unique id, the group hands it to every rank through the cluster, and
//! each rank joins with a non-blocking `ncclCommInitRankConfig`, polled until the group is
//! formed or the join deadline passes (then the communicator is aborted and the error says
//! which rank waited for how long), so a rank that never comes cannot hang the others.
//!
//! Collectives run on a communication stream of their own (non-blocking, so it never
//! serialises with libtorch's default stream), ordered with events: the stream waits for
//! the compute issued before the call, and compute that uses the result waits for the
//! collective ([`Pending::wait`]). Started collectives therefore overlap the compute issued
//! between start and wait (stage 3 gathers the next block while this one computes). Each
//! collective is bracketed by timing events: the step's collective time is what the device
//! spent in them, read at [`TensorCollective::settle`].
//!
//! `settle` is where a failure surfaces: it polls the last collective's event and
//! `ncclCommGetAsyncError` until done, and on an NCCL error or when the collective timeout
//! passes (a peer lost mid-collective never completes it) calls `ncclCommAbort` and fails
//! with the cause. The engine settles before every host read that depends on a collective.
//!
//! Where libnccl is missing, [`check_library`] says which library and how to point at it
//! (cudarc would panic on first use).
//!
//! The timeouts and the join's config are in `config`, the pure rule a poll follows (wait,
//! done, or abort with the cause) in `poll`.
#![allow(unsafe_code)]

mod config;
mod poll;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use cudarc::driver::{result as driver, sys as cu};
use cudarc::nccl::{result, sys};
use tch::{Kind, Tensor};

use crate::collective::{CollResult, Landing, Pending, TensorCollective};
use config::nonblocking_config;
pub use config::NcclTimeouts;
use poll::{verdict, Seen, Stop, Verdict};

/// Is libnccl loadable? Errors with what to do when it is not.
pub fn check_library() -> Result<()> {
    // SAFETY: only tries to dlopen candidate library names; no NCCL function is called.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Collective(format!(
            "NCCL is not available: none of {:?} could be loaded. Install NCCL (for example the \
             nvidia-nccl-cu13 wheel), create a `libnccl.so` link next to its libnccl.so.2 (cudarc \
             does not look for that name), and put that directory on LD_LIBRARY_PATH",
            cudarc::get_lib_name_candidates("nccl")
                .iter()
                .take(3)
                .collect::<Vec<_>>()
        )))
    }
}

/// A new unique id (rank 0), as bytes to send through the cluster.
pub fn unique_id() -> Result<Vec<u8>> {
    check_library()?;
    let id = result::get_uniqueid().map_err(|e| Error::Collective(format!("ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal.iter().map(|c| *c as u8).collect())
}

fn nccl_error(code: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: both return pointers to static or communicator-owned C strings (or null).
    let text = |p: *const std::ffi::c_char| {
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let name = text(unsafe { sys::ncclGetErrorString(code) }).unwrap_or_else(|| format!("{code:?}"));
    let last = if comm.is_null() {
        None
    } else {
        text(unsafe { sys::ncclGetLastError(comm) }).filter(|t| !t.is_empty())
    };
    match last {
        Some(last) => format!("{name} ({last})"),
        None => name,
    }
}

fn driver_error(what: &str, e: driver::DriverError) -> Error {
    Error::Collective(format!("{what}: {e:?}"))
}

/// A pair of timing events bracketing one collective on the communication stream,
/// destroyed when the last holder lets go.
struct Marks {
    start: cu::CUevent,
    end: cu::CUevent,
}

// SAFETY: CUDA events are plain handles usable from any thread of the context.
unsafe impl Send for Marks {}
unsafe impl Sync for Marks {}

impl Marks {
    fn new() -> Result<Self> {
        let make = || driver::event::create(cu::CUevent_flags::CU_EVENT_DEFAULT);
        let start = make().map_err(|e| driver_error("cuEventCreate", e))?;
        let end = make().map_err(|e| driver_error("cuEventCreate", e))?;
        Ok(Self { start, end })
    }
}

impl Drop for Marks {
    fn drop(&mut self) {
        // SAFETY: created by `Marks::new`, destroyed once (CUDA frees them at completion
        // when still pending).
        unsafe {
            let _ = driver::event::destroy(self.start);
            let _ = driver::event::destroy(self.end);
        }
    }
}

/// Compute waits for one collective; the input stays alive until then (its memory must
/// not be reused by compute while the collective still reads it).
struct NcclLanding {
    marks: Arc<Marks>,
    _input: Tensor,
}

// SAFETY: the tensor handle is only dropped, never used, from here.
unsafe impl Send for NcclLanding {}

impl Landing for NcclLanding {
    fn order_compute(&self) -> CollResult<()> {
        // SAFETY: the event is alive (held by `marks`); the null stream is libtorch's
        // default (legacy) stream, which its kernels run on.
        unsafe {
            driver::stream::wait_event(
                driver::stream::null(),
                self.marks.end,
                cu::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_error("cuStreamWaitEvent", e))
    }
}

/// One rank's NCCL communicator on its CUDA device, with its communication stream.
pub struct NcclCollective {
    comm: sys::ncclComm_t,
    /// The device's primary context (libtorch's): made current before each call, so the
    /// communicator can be used from any thread.
    context: cu::CUcontext,
    ordinal: usize,
    stream: cu::CUstream,
    /// Recorded on the compute stream at each call, waited for by the communication stream.
    ready: cu::CUevent,
    rank: usize,
    world: usize,
    timeouts: NcclTimeouts,
    /// Collectives issued since the last settle, in order.
    issued: Vec<Arc<Marks>>,
    /// Device time of the settled collectives since the last `take_device_time`.
    spent: Duration,
    /// Why the communicator was aborted (every later call fails with it).
    aborted: Option<String>,
}

// SAFETY: a communicator, its context and its stream are used by one thread at a time
// (the rank's own), which NCCL and CUDA allow.
unsafe impl Send for NcclCollective {}

impl NcclCollective {
    /// Joins the group `id` as `rank` of `world` on CUDA device `ordinal`, waiting at most
    /// the join timeout for every rank.
    pub fn join(id: &[u8], rank: usize, world: usize, ordinal: usize, timeouts: NcclTimeouts) -> Result<Self> {
        check_library()?;
        if id.len() != 128 {
            return Err(Error::Collective(format!("an NCCL id has 128 bytes, not {}", id.len())));
        }
        let mut unique = sys::ncclUniqueId { internal: [0; 128] };
        for (slot, byte) in unique.internal.iter_mut().zip(id) {
            *slot = *byte as std::ffi::c_char;
        }
        // SAFETY: only tries to dlopen libcuda; cudarc panics on a call without it.
        if !unsafe { cu::is_culib_present() } {
            return Err(Error::Collective(
                "NCCL needs the CUDA driver, and libcuda cannot be loaded on this host".into(),
            ));
        }
        // The device's primary context (libtorch's) current on this thread: NCCL, the
        // stream and the events all belong to it.
        driver::init().map_err(|e| driver_error("cuInit", e))?;
        let device = driver::device::get(ordinal as i32).map_err(|e| driver_error("cuDeviceGet", e))?;
        // SAFETY: `device` came from cuDeviceGet; the retained context lives as long as
        // the process (libtorch holds the same primary context).
        let context = unsafe {
            let context =
                driver::primary_ctx::retain(device).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
            driver::ctx::set_current(context).map_err(|e| driver_error("cuCtxSetCurrent", e))?;
            context
        };
        let mut version = 0;
        // SAFETY: a valid out-pointer.
        unsafe { sys::ncclGetVersion(&mut version) };
        let mut config = nonblocking_config(version);
        // The stream and event first: once the join has started, every way out goes
        // through `Self` (whose drop releases the communicator).
        let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_error("cuStreamCreate", e))?;
        let ready = match driver::event::create(cu::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
            Ok(ready) => ready,
            Err(e) => {
                // SAFETY: created just above, never used.
                let _ = unsafe { driver::stream::destroy(stream) };
                return Err(driver_error("cuEventCreate", e));
            }
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid pointers; the id came from ncclGetUniqueId.
        let code = unsafe { sys::ncclCommInitRankConfig(&mut comm, world as i32, unique, rank as i32, &mut config) };
        let what = "joining the NCCL group";
        if !matches!(code, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
            let cause = nccl_error(code, comm);
            // SAFETY: created above, never used.
            unsafe {
                let _ = driver::event::destroy(ready);
                let _ = driver::stream::destroy(stream);
            }
            return Err(Error::Collective(format!(
                "rank {rank} of {world}: {what}: ncclCommInitRankConfig: {cause}"
            )));
        }
        let mut this = Self {
            comm,
            context,
            ordinal,
            stream,
            ready,
            rank,
            world,
            timeouts,
            issued: Vec::new(),
            spent: Duration::ZERO,
            aborted: None,
        };
        this.await_comm(what, timeouts.join)?;
        Ok(this)
    }

    /// NCCL's own report on the communicator: complete, still in progress, or an error.
    fn comm_state(&self) -> Seen {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and a valid out-pointer.
        let code = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        match (code, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => Seen::Done,
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => Seen::Running,
            (sys::ncclResult_t::ncclSuccess, error) => Seen::Failed(nccl_error(error, self.comm)),
            (error, _) => Seen::Failed(format!("ncclCommGetAsyncError: {}", nccl_error(error, self.comm))),
        }
    }

    /// Polls `seen` until done; on an error or past `limit`, aborts and fails with the cause.
    fn poll(&mut self, what: &str, limit: Duration, mut seen: impl FnMut(&Self) -> Seen) -> Result<()> {
        let started = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            match verdict(seen(self), started.elapsed(), limit) {
                Verdict::Done => return Ok(()),
                Verdict::Abort(cause) => return Err(self.abort(what, cause)),
                Verdict::Wait => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(2));
                }
            }
        }
    }

    /// Waits for a non-blocking NCCL call on the communicator to take effect.
    fn await_comm(&mut self, what: &str, limit: Duration) -> Result<()> {
        self.poll(what, limit, Self::comm_state)
    }

    /// Aborts the communicator (its kernels stop, the peers see the error) and returns the
    /// error every later call repeats.
    fn abort(&mut self, what: &str, cause: Stop) -> Error {
        let first = self.aborted.is_none();
        if first {
            // SAFETY: a live communicator, aborted once.
            unsafe { sys::ncclCommAbort(self.comm) };
            self.aborted = Some(format!("{what}: {cause}; the NCCL communicator was aborted"));
        }
        let text = format!(
            "rank {} of {}: {}",
            self.rank,
            self.world,
            self.aborted.as_deref().unwrap_or_default()
        );
        match cause {
            Stop::TimedOut(limit) if first => Error::CollectiveTimeout { text, limit },
            _ => Error::Collective(text),
        }
    }

    /// Fails with the abort's cause once aborted; else makes the device's context current
    /// on the calling thread.
    fn usable(&self) -> Result<()> {
        if let Some(why) = &self.aborted {
            return Err(Error::Collective(format!(
                "rank {} of {}: {why}",
                self.rank, self.world
            )));
        }
        // SAFETY: the primary context retained in `join`, alive for the process.
        unsafe { driver::ctx::set_current(self.context) }.map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    /// NCCL's type for a contiguous CUDA tensor, or why it cannot take part.
    fn check(tensor: &Tensor) -> CollResult<sys::ncclDataType_t> {
        match nccl_type(tensor.kind()) {
            Some(kind) if tensor.device().is_cuda() && tensor.is_contiguous() => Ok(kind),
            _ => Err(Error::Collective(format!(
                "NCCL collectives take contiguous CUDA tensors of f32, bf16, f16 or f64, not a {}{:?} tensor on {:?}",
                if tensor.is_contiguous() { "" } else { "non-contiguous " },
                tensor.kind(),
                tensor.device()
            ))),
        }
    }

    /// Issues `op` on the communication stream after the compute issued so far, bracketed
    /// by timing events; the result lands in `out`.
    fn launch(
        &mut self,
        what: &str,
        input: &Tensor,
        out: Tensor,
        op: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> CollResult<Pending> {
        self.usable()?;
        let marks = Arc::new(Marks::new()?);
        let stream = self.stream;
        // SAFETY: the events and the stream are alive and of this thread's context; the
        // null stream is the one libtorch computes on.
        unsafe {
            driver::event::record(self.ready, driver::stream::null()).map_err(|e| driver_error("cuEventRecord", e))?;
            driver::stream::wait_event(stream, self.ready, cu::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .map_err(|e| driver_error("cuStreamWaitEvent", e))?;
            driver::event::record(marks.start, stream).map_err(|e| driver_error("cuEventRecord", e))?;
        }
        let code = op(self.comm, stream as sys::cudaStream_t);
        match code {
            sys::ncclResult_t::ncclSuccess => {}
            // A non-blocking communicator may still be enqueueing: wait for that (not
            // for the collective itself).
            sys::ncclResult_t::ncclInProgress => self.await_comm(what, self.timeouts.collective)?,
            error => {
                let cause = nccl_error(error, self.comm);
                return Err(self.abort(what, Stop::Failed(cause)));
            }
        }
        // SAFETY: as above.
        unsafe { driver::event::record(marks.end, stream) }.map_err(|e| driver_error("cuEventRecord", e))?;
        self.issued.push(marks.clone());
        Ok(Pending::landing(
            out,
            Box::new(NcclLanding {
                marks,
                _input: input.shallow_clone(),
            }),
        ))
    }

    fn all_reduce_start(&mut self, input: &Tensor) -> CollResult<Pending> {
        let kind = Self::check(input)?;
        let out = input.empty_like();
        let (send, recv, n) = (input.data_ptr(), out.data_ptr(), input.numel());
        // SAFETY: both buffers are live contiguous device tensors of n elements of the
        // type `kind` names, kept alive until compute waits for the collective.
        self.launch("ncclAllReduce", input, out, |comm, stream| unsafe {
            sys::ncclAllReduce(send, recv, n, kind, sys::ncclRedOp_t::ncclSum, comm, stream)
        })
    }

    fn reduce_scatter_start(&mut self, input: &Tensor) -> CollResult<Pending> {
        let kind = Self::check(input)?;
        let n = input.numel() / self.world;
        let out = Tensor::empty([n as i64], (input.kind(), input.device()));
        let (send, recv) = (input.data_ptr(), out.data_ptr());
        // SAFETY: input holds world * n elements and out n, both live on the device.
        self.launch("ncclReduceScatter", input, out, |comm, stream| unsafe {
            sys::ncclReduceScatter(send, recv, n, kind, sys::ncclRedOp_t::ncclSum, comm, stream)
        })
    }

    fn broadcast_start(&mut self, input: &Tensor, root: usize) -> CollResult<Pending> {
        let kind = Self::check(input)?;
        let out = input.empty_like();
        let (send, recv, n) = (input.data_ptr(), out.data_ptr(), input.numel());
        // SAFETY: both buffers are live contiguous device tensors of n elements.
        self.launch("ncclBroadcast", input, out, |comm, stream| unsafe {
            sys::ncclBroadcast(send, recv, n, kind, root as i32, comm, stream)
        })
    }
}

/// The NCCL element type of a libtorch kind: collectives move the buffer's own dtype (a
/// bf16 gather moves two bytes an element, not four).
pub fn nccl_type(kind: Kind) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as T;
    match kind {
        Kind::Float => Some(T::ncclFloat32),
        Kind::BFloat16 => Some(T::ncclBfloat16),
        Kind::Half => Some(T::ncclFloat16),
        Kind::Double => Some(T::ncclFloat64),
        _ => None,
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // A collective still running (a rank failed for another cause before settling,
        // say) may never finish if a peer is gone: abort rather than wait for it.
        let outstanding = self.issued.last().is_some_and(|last| {
            // SAFETY: the event is alive (held by `last`).
            unsafe { driver::event::query(last.end) }.is_err()
        });
        if outstanding && self.aborted.is_none() {
            let _ = self.abort(
                "dropping the communicator",
                Stop::Failed("collectives were still running".into()),
            );
        }
        // SAFETY: the communicator, stream and event were created in `join` and are
        // released once; an aborted communicator is already gone.
        unsafe {
            if self.aborted.is_none() {
                let _ = result::comm_destroy(self.comm);
            }
            let _ = driver::event::destroy(self.ready);
            let _ = driver::stream::destroy(self.stream);
        }
    }
}

impl TensorCollective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce(&mut self, input: &Tensor) -> CollResult<Tensor> {
        self.all_reduce_start(input)?.wait()
    }
    fn reduce_scatter(&mut self, input: &Tensor) -> CollResult<Tensor> {
        self.reduce_scatter_start(input)?.wait()
    }
    fn all_gather(&mut self, input: &Tensor) -> CollResult<Tensor> {
        self.all_gather_start(input)?.wait()
    }
    fn broadcast(&mut self, input: &Tensor, root: usize) -> CollResult<Tensor> {
        self.broadcast_start(input, root)?.wait()
    }
    fn barrier(&mut self) -> CollResult<()> {
        let token = Tensor::zeros([1], (Kind::Float, tch::Device::Cuda(self.ordinal)));
        let _ = self.all_reduce(&token)?;
        self.settle()
    }
    fn all_gather_start(&mut self, input: &Tensor) -> CollResult<Pending> {
        let kind = Self::check(input)?;
        let out = Tensor::empty([(input.numel() * self.world) as i64], (input.kind(), input.device()));
        let (send, recv, n) = (input.data_ptr(), out.data_ptr(), input.numel());
        // SAFETY: input holds n elements and out world * n, both live on the device.
        self.launch("ncclAllGather", input, out, |comm, stream| unsafe {
            sys::ncclAllGather(send, recv, n, kind, comm, stream)
        })
    }
    fn overlaps(&self) -> bool {
        true
    }
    fn settle(&mut self) -> CollResult<()> {
        self.usable()?;
        let Some(last) = self.issued.last().cloned() else {
            return Ok(());
        };
        let limit = self.timeouts.collective;
        self.poll("a collective", limit, |this| {
            // SAFETY: the event is alive (held by `last`).
            match unsafe { driver::event::query(last.end) } {
                Ok(()) => Seen::Done,
                Err(e) if e.0 == cu::cudaError_enum::CUDA_ERROR_NOT_READY => match this.comm_state() {
                    Seen::Done => Seen::Running,
                    other => other,
                },
                Err(e) => Seen::Failed(format!("the communication stream failed: {e:?}")),
            }
        })?;
        for marks in self.issued.drain(..) {
            // SAFETY: both events have completed (the last one has, and the stream is in order).
            if let Ok(ms) = unsafe { driver::event::elapsed(marks.start, marks.end) } {
                self.spent += Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            }
        }
        Ok(())
    }
    fn take_device_time(&mut self) -> Option<Duration> {
        Some(std::mem::take(&mut self.spent))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_move_the_buffers_own_dtype() {
        use sys::ncclDataType_t as T;
        assert_eq!(nccl_type(Kind::BFloat16), Some(T::ncclBfloat16));
        assert_eq!(nccl_type(Kind::Half), Some(T::ncclFloat16));
        assert_eq!(nccl_type(Kind::Float), Some(T::ncclFloat32));
        assert_eq!(nccl_type(Kind::Int64), None);
        // A CPU tensor is refused with what it is, before any NCCL call.
        let error = NcclCollective::check(&Tensor::zeros([2], (Kind::BFloat16, tch::Device::Cpu)))
            .expect_err("a CPU tensor cannot take part in NCCL");
        assert!(error.to_string().contains("BFloat16 tensor on Cpu"), "{error}");
    }

    #[test]
    fn a_missing_library_is_a_clear_error_not_a_panic() {
        match check_library() {
            // A GPU host with NCCL: joining needs a device, covered by the GPU proof.
            Ok(()) => assert!(unique_id().is_ok()),
            Err(message) => {
                assert!(matches!(message, Error::Collective(_)), "{message:?}");
                let message = message.to_string();
                assert!(message.contains("NCCL is not available"), "{message}");
                assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
                assert!(unique_id().unwrap_err().to_string().contains("NCCL is not available"));
                assert!(NcclCollective::join(&[0; 128], 0, 1, 0, NcclTimeouts::default()).is_err());
            }
        }
    }
}
