//! The NCCL backend (cudarc, loaded at run time): collectives on CUDA tensors in place.
//! Rank 0 makes the unique id, the group hands it to every rank through the cluster, and
//! each rank joins on its own thread (`ncclCommInitRank` blocks until all ranks join).
//! Where libnccl is missing, [`check_library`] says which library and how to point at it
//! (cudarc would panic on first use).
#![allow(unsafe_code)]

use crate::error::{Error, Result};
use cudarc::nccl::{result, sys};
use tch::{Kind, Tensor};

use crate::collective::{CollResult, TensorCollective};

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

/// One rank's NCCL communicator on the current CUDA device.
pub struct NcclCollective {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
}

// SAFETY: a communicator is used by one thread at a time (the rank's own), which NCCL allows.
unsafe impl Send for NcclCollective {}

impl NcclCollective {
    /// Joins the group `id` as `rank` of `world`; blocks until every rank has joined.
    pub fn join(id: &[u8], rank: usize, world: usize) -> Result<Self> {
        check_library()?;
        if id.len() != 128 {
            return Err(Error::Collective(format!("an NCCL id has 128 bytes, not {}", id.len())));
        }
        let mut unique = sys::ncclUniqueId { internal: [0; 128] };
        for (slot, byte) in unique.internal.iter_mut().zip(id) {
            *slot = *byte as std::ffi::c_char;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id came from ncclGetUniqueId on rank 0.
        unsafe { result::comm_init_rank(&mut comm, world as i32, unique, rank as i32) }
            .map_err(|e| Error::Collective(format!("ncclCommInitRank: {e:?}")))?;
        Ok(Self { comm, rank, world })
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
        // SAFETY: the communicator was created by comm_init_rank and is destroyed once.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

const STREAM: sys::cudaStream_t = std::ptr::null_mut();

impl TensorCollective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let kind = Self::check(input)?;
        let out = input.empty_like();
        // SAFETY: both buffers are live contiguous device tensors of input.numel() elements
        // of the type `kind` names.
        unsafe {
            result::all_reduce(
                input.data_ptr(),
                out.data_ptr(),
                input.numel(),
                kind,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                STREAM,
            )
        }
        .map_err(|e| Error::Collective(format!("ncclAllReduce: {e:?}")))?;
        Ok(out)
    }
    fn reduce_scatter(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let kind = Self::check(input)?;
        let n = input.numel() / self.world;
        let out = Tensor::empty([n as i64], (input.kind(), input.device()));
        // SAFETY: input holds world * n elements and out n, both live on the device, of
        // the type `kind` names.
        unsafe {
            result::reduce_scatter(
                input.data_ptr(),
                out.data_ptr(),
                n,
                kind,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                STREAM,
            )
        }
        .map_err(|e| Error::Collective(format!("ncclReduceScatter: {e:?}")))?;
        Ok(out)
    }
    fn all_gather(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let kind = Self::check(input)?;
        let out = Tensor::empty([(input.numel() * self.world) as i64], (input.kind(), input.device()));
        // SAFETY: input holds n elements and out world * n, both live on the device, of
        // the type `kind` names.
        unsafe { result::all_gather(input.data_ptr(), out.data_ptr(), input.numel(), kind, self.comm, STREAM) }
            .map_err(|e| Error::Collective(format!("ncclAllGather: {e:?}")))?;
        Ok(out)
    }
    fn broadcast(&mut self, input: &Tensor, root: usize) -> CollResult<Tensor> {
        let kind = Self::check(input)?;
        let out = input.copy();
        // SAFETY: both buffers are live contiguous device tensors of input.numel() elements
        // of the type `kind` names.
        unsafe {
            result::broadcast(
                input.data_ptr(),
                out.data_ptr(),
                input.numel(),
                kind,
                root as i32,
                self.comm,
                STREAM,
            )
        }
        .map_err(|e| Error::Collective(format!("ncclBroadcast: {e:?}")))?;
        Ok(out)
    }
    fn barrier(&mut self) -> CollResult<()> {
        let token = Tensor::zeros([1], (Kind::Float, tch::Device::Cuda(0)));
        self.all_reduce(&token).map(|_| ())
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
            // A GPU host with NCCL: joining needs a device, covered by the GPU benchmark.
            Ok(()) => assert!(unique_id().is_ok()),
            Err(message) => {
                assert!(matches!(message, Error::Collective(_)), "{message:?}");
                let message = message.to_string();
                assert!(message.contains("NCCL is not available"), "{message}");
                assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
                assert!(unique_id().unwrap_err().to_string().contains("NCCL is not available"));
                assert!(NcclCollective::join(&[0; 128], 0, 1).is_err());
            }
        }
    }
}
