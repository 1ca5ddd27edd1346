//! The KV cache's tensors (keys and values of every token slot, per layer) and the memory
//! a cache may be sized from.

use regatta_scorer::{mem_available, FreeMemory};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::model::KvLayout;

/// Keys and values of every token slot, per layer: `[slots, kv_heads, head_dim]`.
pub struct KvCache {
    pub(super) keys: Vec<Tensor>,
    pub(super) values: Vec<Tensor>,
}

impl KvCache {
    /// Bytes one token occupies in the cache (keys and values of every layer).
    pub fn bytes_per_token(layout: &KvLayout, kind: Kind) -> u64 {
        2 * (layout.layers * layout.kv_heads * layout.head_dim) as u64 * kind.elt_size_in_bytes() as u64
    }

    /// Extends the cache to `slots` token slots, keeping what the present ones hold.
    pub fn grow(&mut self, slots: usize) {
        for cache in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let size = cache.size();
            let extra = slots as i64 - size[0];
            if extra > 0 {
                let more = Tensor::zeros([extra, size[1], size[2]], (cache.kind(), cache.device()));
                *cache = Tensor::cat(&[&*cache, &more], 0);
            }
        }
    }

    /// A cache of `slots` token slots.
    pub fn new(layout: &KvLayout, slots: usize, kind: Kind, device: Device) -> Self {
        let shape = [slots as i64, layout.kv_heads as i64, layout.head_dim as i64];
        let make = || {
            (0..layout.layers)
                .map(|_| Tensor::zeros(shape, (kind, device)))
                .collect()
        };
        Self {
            keys: make(),
            values: make(),
        }
    }
}

/// The memory the KV cache may be sized from on `device`: the GPU's total and what this
/// process's caching allocator holds there now (the weights, loaded before), or the host's
/// available memory.
pub(super) fn free_memory(device: Device) -> Result<FreeMemory> {
    match device {
        Device::Cuda(ordinal) => {
            let total = crate::cuda::total_memory_bytes(ordinal).ok_or_else(|| {
                Error::Invalid(format!(
                    "cannot read cuda:{ordinal}'s memory size to size the KV cache; set kv_cache_mb"
                ))
            })?;
            let held = crate::shim::cuda_memory(ordinal, false)?.reserved;
            let free = crate::cuda::free_memory_bytes(ordinal);
            Ok(FreeMemory::Device { total, held, free })
        }
        _ => {
            let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
            let available = mem_available(&meminfo).ok_or_else(|| {
                Error::Invalid(
                    "cannot read the host's available memory (/proc/meminfo) to size the KV cache; set kv_cache_mb"
                        .into(),
                )
            })?;
            Ok(FreeMemory::Host { available })
        }
    }
}
