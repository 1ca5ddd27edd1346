//! Collectives on flat tensors: the one interface the ZeRO engine uses. [`CpuCollective`]
//! runs the ring from `regatta-trainer` (QUIC between nodes) on CPU tensors; the NCCL
//! backend ([`crate::nccl`]) runs on CUDA tensors; [`Solo`] is a group of one.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use regatta_trainer::Collective;
use tch::{Device, Kind, Tensor};

/// A failed collective.
pub type CollResult<T> = Result<T>;

/// Orders compute after a collective that may still be running on a stream of its own
/// (NCCL): the compute stream waits for it; the host does not.
pub trait Landing: Send {
    /// Makes work issued from now on the compute stream wait for the collective.
    fn order_compute(&self) -> CollResult<()>;
}

/// A collective's result that may still be on its way. [`Pending::wait`] orders compute
/// after it (without blocking the host); dropping it unused orders compute likewise, so
/// its memory is never reused while the collective still reads or writes it.
pub struct Pending {
    out: Tensor,
    landing: Option<Box<dyn Landing>>,
}

impl Pending {
    /// A result already complete (the CPU ring, a group of one).
    pub fn done(out: Tensor) -> Self {
        Self { out, landing: None }
    }

    /// A result that `landing` orders compute after.
    pub fn landing(out: Tensor, landing: Box<dyn Landing>) -> Self {
        Self {
            out,
            landing: Some(landing),
        }
    }

    /// The result, for compute issued after this call.
    pub fn wait(mut self) -> CollResult<Tensor> {
        if let Some(landing) = self.landing.take() {
            landing.order_compute()?;
        }
        Ok(self.out.shallow_clone())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(landing) = self.landing.take() {
            // Nothing to report to: a failed wait shows at the next settle.
            let _ = landing.order_compute();
        }
    }
}

/// Collectives on flat (1-D) tensors, summing. Every rank calls each one in the same order.
pub trait TensorCollective: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks.
    fn world(&self) -> usize;
    /// The sum over ranks.
    fn all_reduce(&mut self, input: &Tensor) -> CollResult<Tensor>;
    /// The sum over ranks of `input` (world * n elements); this rank's n-element slice.
    fn reduce_scatter(&mut self, input: &Tensor) -> CollResult<Tensor>;
    /// Every rank's `input` (n elements) concatenated in rank order.
    fn all_gather(&mut self, input: &Tensor) -> CollResult<Tensor>;
    /// `root`'s tensor on every rank.
    fn broadcast(&mut self, input: &Tensor, root: usize) -> CollResult<Tensor>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> CollResult<()>;
    /// Starts an all-gather whose result is taken later ([`Pending::wait`]), so it can
    /// overlap compute issued in between (stage 3 gathers the next block's parameters
    /// while this one computes). Backends without a stream of their own gather now.
    fn all_gather_start(&mut self, input: &Tensor) -> CollResult<Pending> {
        self.all_gather(input).map(Pending::done)
    }
    /// Whether started collectives run beside compute (prefetching is worth its memory).
    fn overlaps(&self) -> bool {
        false
    }
    /// Returns once every collective issued so far has completed on the device, or fails
    /// with the cause (a lost rank, an NCCL error, a timeout) after aborting the group:
    /// called before the host reads a value that depends on them, so a failure ends the
    /// step with a cause instead of a hang.
    fn settle(&mut self) -> CollResult<()> {
        Ok(())
    }
    /// Time the collectives took on the device since the last call, where the backend
    /// measures it there (CUDA events); `None` where the host's wall time is the measure.
    fn take_device_time(&mut self) -> Option<Duration> {
        None
    }
}

/// A group of one: every collective is the identity.
pub struct Solo;

impl TensorCollective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&mut self, input: &Tensor) -> CollResult<Tensor> {
        Ok(input.copy())
    }
    fn reduce_scatter(&mut self, input: &Tensor) -> CollResult<Tensor> {
        Ok(input.copy())
    }
    fn all_gather(&mut self, input: &Tensor) -> CollResult<Tensor> {
        Ok(input.copy())
    }
    fn broadcast(&mut self, input: &Tensor, _root: usize) -> CollResult<Tensor> {
        Ok(input.copy())
    }
    fn barrier(&mut self) -> CollResult<()> {
        Ok(())
    }
}

/// Copies a tensor's values out as `f32` (on the host).
pub fn to_vec(tensor: &Tensor) -> Vec<f32> {
    let flat = tensor
        .to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous()
        .view([-1]);
    let len = flat.numel();
    let mut out = vec![0f32; len];
    flat.copy_data(&mut out, len);
    out
}

/// The CPU ring over any link from `regatta-trainer`.
pub struct CpuCollective {
    ring: Box<dyn Collective>,
}

impl CpuCollective {
    /// Wraps a ring.
    pub fn new(ring: Box<dyn Collective>) -> Self {
        Self { ring }
    }
}

/// A flat CPU `f32` copy of `tensor` that this call owns, outside autograd: never aliases the
/// caller's memory, converted in the copy where the kind or device differs.
fn owned_f32(tensor: &Tensor) -> Tensor {
    let converted = tensor
        .detach()
        .to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous()
        .view([-1]);
    if converted.numel() > 0 && converted.data_ptr() == tensor.data_ptr() {
        converted.copy()
    } else {
        converted
    }
}

/// A flat CPU `f32` view of `tensor` for reading (the tensor itself where it already is one).
fn readable_f32(tensor: &Tensor) -> Tensor {
    tensor
        .detach()
        .to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous()
        .view([-1])
}

/// The values of a contiguous CPU `f32` tensor, in place.
#[allow(unsafe_code)]
fn values(tensor: &Tensor) -> &[f32] {
    assert!(
        tensor.device() == Device::Cpu && tensor.kind() == Kind::Float && tensor.is_contiguous(),
        "values() needs a contiguous CPU f32 tensor"
    );
    let len = tensor.numel();
    if len == 0 {
        return &[];
    }
    // SAFETY: the tensor is contiguous, on the CPU and of kind f32 (checked above), so
    // `data_ptr` (which includes the storage offset) points at `numel` initialised f32 values,
    // alive while the borrowed tensor holds its storage.
    unsafe { std::slice::from_raw_parts(tensor.data_ptr().cast::<f32>(), len) }
}

/// The values of a contiguous CPU `f32` tensor that this code owns, writable in place.
#[allow(unsafe_code)]
fn values_mut(tensor: &mut Tensor) -> &mut [f32] {
    let len = values(tensor).len();
    if len == 0 {
        return &mut [];
    }
    // SAFETY: as in `values`; the tensors passed here come from `owned_f32` or
    // `Tensor::empty` in this module, so no other handle reads or writes their storage while
    // the exclusive borrow lasts.
    unsafe { std::slice::from_raw_parts_mut(tensor.data_ptr().cast::<f32>(), len) }
}

/// `values` back in `template`'s kind and device (no copy for CPU `f32`).
fn like(values: Tensor, template: &Tensor) -> Tensor {
    values.to_kind(template.kind()).to_device(template.device())
}

fn failed(e: regatta_trainer::CollectiveError) -> Error {
    Error::Collective(e.to_string())
}

/// The CPU collectives work on the tensors' own memory: one owned copy where the result
/// must not alias the input (all-reduce, reduce-scatter, broadcast), none for all-gather's
/// input, and the ring link reads from and writes to that memory directly.
impl TensorCollective for CpuCollective {
    fn rank(&self) -> usize {
        self.ring.rank()
    }
    fn world(&self) -> usize {
        self.ring.world()
    }
    fn all_reduce(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let mut work = owned_f32(input);
        self.ring.all_reduce(values_mut(&mut work)).map_err(failed)?;
        Ok(like(work, input))
    }
    fn reduce_scatter(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let world = self.world();
        let len = input.numel();
        if !len.is_multiple_of(world) {
            return Err(Error::Collective(format!(
                "reduce-scatter of {len} elements over {world} ranks"
            )));
        }
        let mut work = owned_f32(input);
        self.ring
            .reduce_scatter_in_place(values_mut(&mut work))
            .map_err(failed)?;
        let n = (len / world) as i64;
        // Its own copy of this rank's chunk, so the shard does not hold the whole buffer.
        let shard = work.narrow(0, self.rank() as i64 * n, n).copy();
        Ok(like(shard, input))
    }
    fn all_gather(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let source = readable_f32(input);
        let mut out = Tensor::empty(
            [source.numel() as i64 * self.world() as i64],
            (Kind::Float, Device::Cpu),
        );
        self.ring
            .all_gather(values(&source), values_mut(&mut out))
            .map_err(failed)?;
        Ok(like(out, input))
    }
    fn broadcast(&mut self, input: &Tensor, root: usize) -> CollResult<Tensor> {
        let mut work = owned_f32(input);
        self.ring.broadcast(values_mut(&mut work), root).map_err(failed)?;
        Ok(like(work, input))
    }
    fn barrier(&mut self) -> CollResult<()> {
        self.ring.barrier().map_err(failed)
    }
}

/// Wraps a collective and adds up the time spent in it.
pub struct Timed {
    inner: Box<dyn TensorCollective>,
    spent: Duration,
}

impl Timed {
    /// Times `inner`.
    pub fn new(inner: Box<dyn TensorCollective>) -> Self {
        Self {
            inner,
            spent: Duration::ZERO,
        }
    }

    /// Time spent since the last call: measured on the device where the backend does
    /// (NCCL, CUDA events, after [`TensorCollective::settle`]), else the host's time in
    /// the calls.
    pub fn take_spent(&mut self) -> Duration {
        let host = std::mem::take(&mut self.spent);
        self.inner.take_device_time().unwrap_or(host)
    }

    fn time<T>(&mut self, op: impl FnOnce(&mut dyn TensorCollective) -> T) -> T {
        let started = Instant::now();
        let out = op(self.inner.as_mut());
        self.spent += started.elapsed();
        out
    }
}

impl TensorCollective for Timed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce(&mut self, input: &Tensor) -> CollResult<Tensor> {
        self.time(|c| c.all_reduce(input))
    }
    fn reduce_scatter(&mut self, input: &Tensor) -> CollResult<Tensor> {
        self.time(|c| c.reduce_scatter(input))
    }
    fn all_gather(&mut self, input: &Tensor) -> CollResult<Tensor> {
        self.time(|c| c.all_gather(input))
    }
    fn broadcast(&mut self, input: &Tensor, root: usize) -> CollResult<Tensor> {
        self.time(|c| c.broadcast(input, root))
    }
    fn barrier(&mut self) -> CollResult<()> {
        self.time(|c| c.barrier())
    }
    fn all_gather_start(&mut self, input: &Tensor) -> CollResult<Pending> {
        self.time(|c| c.all_gather_start(input))
    }
    fn overlaps(&self) -> bool {
        self.inner.overlaps()
    }
    fn settle(&mut self) -> CollResult<()> {
        self.time(|c| c.settle())
    }
    fn take_device_time(&mut self) -> Option<Duration> {
        self.inner.take_device_time()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regatta_trainer::{memory_ring, RingCollective};

    /// Runs `body` on every rank of an in-memory CPU ring, one thread each.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        body: impl Fn(&mut CpuCollective) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let body = std::sync::Arc::new(body);
        let threads: Vec<_> = memory_ring(world)
            .into_iter()
            .enumerate()
            .map(|(rank, link)| {
                let body = body.clone();
                std::thread::spawn(move || {
                    let mut c = CpuCollective::new(Box::new(RingCollective::new(rank, world, link)));
                    body(&mut c)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    fn input(rank: usize, len: i64, kind: Kind) -> Tensor {
        (Tensor::arange(len, (Kind::Float, Device::Cpu)) + 100.0 * rank as f64).to_kind(kind)
    }

    #[test]
    fn collectives_leave_their_inputs_alone_and_keep_the_kind() {
        for kind in [Kind::Float, Kind::Double, Kind::BFloat16] {
            let results = on_ranks(2, move |c| {
                let rank = c.rank();
                let x = input(rank, 6, kind);
                let before = to_vec(&x);
                let summed = c.all_reduce(&x).unwrap();
                let shard = c.reduce_scatter(&x).unwrap();
                let gathered = c.all_gather(&shard).unwrap();
                let from_root = c.broadcast(&x, 1).unwrap();
                assert_eq!(to_vec(&x), before, "an input changed on rank {rank}");
                for t in [&summed, &shard, &gathered, &from_root] {
                    assert_eq!(t.kind(), kind);
                }
                (to_vec(&summed), to_vec(&shard), to_vec(&gathered), to_vec(&from_root))
            });
            let sum: Vec<f32> = (0..6).map(|i| 2.0 * i as f32 + 100.0).collect();
            for (rank, (summed, shard, gathered, from_root)) in results.into_iter().enumerate() {
                assert_eq!(summed, sum, "{kind:?}");
                assert_eq!(shard, sum[rank * 3..(rank + 1) * 3].to_vec(), "{kind:?}");
                assert_eq!(gathered, sum, "{kind:?}");
                assert_eq!(from_root, to_vec(&input(1, 6, kind)), "{kind:?}");
            }
        }
    }

    #[test]
    fn a_view_into_a_larger_tensor_is_not_written_through() {
        let results = on_ranks(2, |c| {
            let whole = input(c.rank(), 8, Kind::Float);
            let view = whole.narrow(0, 2, 4);
            let summed = c.all_reduce(&view).unwrap();
            (to_vec(&whole), to_vec(&summed))
        });
        for (rank, (whole, summed)) in results.into_iter().enumerate() {
            assert_eq!(whole, to_vec(&input(rank, 8, Kind::Float)));
            assert_eq!(summed, vec![104.0, 106.0, 108.0, 110.0]);
        }
    }

    #[test]
    fn results_stay_outside_autograd() {
        let results = on_ranks(2, |c| {
            let x = input(c.rank(), 4, Kind::Float).set_requires_grad(true);
            let summed = c.all_reduce(&x).unwrap();
            let shard = c.reduce_scatter(&x).unwrap();
            (summed.requires_grad(), shard.requires_grad(), to_vec(&summed))
        });
        for (summed_grad, shard_grad, summed) in results {
            assert!(!summed_grad && !shard_grad);
            assert_eq!(summed, vec![100.0, 102.0, 104.0, 106.0]);
        }
    }

    #[test]
    fn reduce_scatter_of_an_uneven_length_is_refused() {
        let results = on_ranks(2, |c| c.reduce_scatter(&input(0, 5, Kind::Float)).is_err());
        assert!(results.into_iter().all(|refused| refused));
    }
}
