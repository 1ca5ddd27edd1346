//! Collectives on flat tensors: the one interface the ZeRO engine uses. [`CpuCollective`]
//! runs the ring from `regatta-trainer` (QUIC between nodes) on CPU tensors; the NCCL
//! backend ([`crate::nccl`]) runs on CUDA tensors; [`Solo`] is a group of one.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use regatta_trainer::Collective;
use tch::{Device, Kind, Tensor};

/// A failed collective.
pub type CollResult<T> = Result<T>;

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

fn like(values: &[f32], template: &Tensor) -> Tensor {
    Tensor::from_slice(values)
        .to_kind(template.kind())
        .to_device(template.device())
}

impl TensorCollective for CpuCollective {
    fn rank(&self) -> usize {
        self.ring.rank()
    }
    fn world(&self) -> usize {
        self.ring.world()
    }
    fn all_reduce(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let mut values = to_vec(input);
        self.ring
            .all_reduce(&mut values)
            .map_err(|e| Error::Collective(e.to_string()))?;
        Ok(like(&values, input))
    }
    fn reduce_scatter(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let values = to_vec(input);
        let world = self.world();
        if !values.len().is_multiple_of(world) {
            return Err(Error::Collective(format!(
                "reduce-scatter of {} elements over {world} ranks",
                values.len()
            )));
        }
        let mut out = vec![0f32; values.len() / world];
        self.ring
            .reduce_scatter(&values, &mut out)
            .map_err(|e| Error::Collective(e.to_string()))?;
        Ok(like(&out, input))
    }
    fn all_gather(&mut self, input: &Tensor) -> CollResult<Tensor> {
        let values = to_vec(input);
        let mut out = vec![0f32; values.len() * self.world()];
        self.ring
            .all_gather(&values, &mut out)
            .map_err(|e| Error::Collective(e.to_string()))?;
        Ok(like(&out, input))
    }
    fn broadcast(&mut self, input: &Tensor, root: usize) -> CollResult<Tensor> {
        let mut values = to_vec(input);
        self.ring
            .broadcast(&mut values, root)
            .map_err(|e| Error::Collective(e.to_string()))?;
        Ok(like(&values, input))
    }
    fn barrier(&mut self) -> CollResult<()> {
        self.ring.barrier().map_err(|e| Error::Collective(e.to_string()))
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

    /// Time spent since the last call.
    pub fn take_spent(&mut self) -> Duration {
        std::mem::take(&mut self.spent)
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
}
