//! Where an engine's parameters are stored: each spec's slot in its block's trained or
//! frozen flat buffer (or in the earlier block's storage it is tied to), and this rank's
//! first state of those buffers (master slices, weight-decay ranges, frozen parameters).

use std::collections::HashMap;
use std::ops::Range;

use regatta_trainer::{FlatLayout, Offload, ZeroStage};
use tch::{Device, Kind, Tensor};

use super::{pinned, EngineSettings};
use crate::error::{Error, Result};
use crate::model::ParamSpec;

/// Where a parameter's storage is inside its block: the trainable buffer or the frozen one,
/// at a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Store {
    Train(usize),
    Frozen(usize),
}

/// Where a tied parameter's storage is: (block, store of the block it lives in).
pub(super) type Source = (usize, Store);

/// Each spec of a block: stored in this block, or tied to an earlier block's storage.
#[derive(Clone, Copy, Debug)]
pub(super) enum Slot {
    Own(Store),
    Tied(Source),
}

/// One block's flat buffers: which tensors they hold and in what shapes.
pub(super) struct Flat {
    pub(super) layout: FlatLayout,
    pub(super) shapes: Vec<Vec<i64>>,
}

impl Flat {
    pub(super) fn view(&self, slot: usize, flat: &Tensor) -> Tensor {
        let s = &self.layout.tensors[slot];
        flat.narrow(0, s.offset as i64, s.numel as i64)
            .view(self.shapes[slot].as_slice())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.layout.padded == 0
    }
}

/// Every block's slots and flat buffer layouts, trained and frozen.
pub(super) struct Layout {
    pub(super) slots: Vec<Vec<Slot>>,
    pub(super) train: Vec<Flat>,
    pub(super) frozen_flat: Vec<Flat>,
}

impl Layout {
    /// The layout of `specs` over `world` ranks; a tied parameter must name one an earlier
    /// block stores.
    pub(super) fn plan(specs: &[Vec<ParamSpec>], world: usize) -> Result<Self> {
        let mut where_stored: HashMap<String, Source> = HashMap::new();
        let mut slots = Vec::with_capacity(specs.len());
        let (mut train, mut frozen_flat) = (Vec::new(), Vec::new());
        for (b, block) in specs.iter().enumerate() {
            let mut block_slots = Vec::new();
            let (mut sizes, mut frozen_sizes) = (Vec::new(), Vec::new());
            let (mut shapes, mut frozen_shapes) = (Vec::new(), Vec::new());
            for spec in block {
                match &spec.tied_to {
                    None => {
                        let store = if spec.frozen {
                            frozen_sizes.push((spec.name.clone(), spec.numel()));
                            frozen_shapes.push(spec.shape.clone());
                            Store::Frozen(frozen_sizes.len() - 1)
                        } else {
                            sizes.push((spec.name.clone(), spec.numel()));
                            shapes.push(spec.shape.clone());
                            Store::Train(sizes.len() - 1)
                        };
                        where_stored.insert(spec.name.clone(), (b, store));
                        block_slots.push(Slot::Own(store));
                    }
                    Some(source) => {
                        let found = where_stored.get(source).copied().filter(|(sb, _)| *sb < b);
                        let found = found.ok_or_else(|| {
                            Error::Invalid(format!(
                                "{} is tied to {source}, which no earlier block holds",
                                spec.name
                            ))
                        })?;
                        block_slots.push(Slot::Tied(found));
                    }
                }
            }
            slots.push(block_slots);
            train.push(Flat {
                layout: FlatLayout::new(&sizes, world),
                shapes,
            });
            frozen_flat.push(Flat {
                layout: FlatLayout::new(&frozen_sizes, world),
                shapes: frozen_shapes,
            });
        }
        Ok(Self {
            slots,
            train,
            frozen_flat,
        })
    }
}

/// This rank's first state, per block: its float32 master slice (where optimizer state
/// lives), where weight decay applies inside that slice, and its frozen parameters.
pub(super) struct Initial {
    pub(super) master: Vec<Tensor>,
    pub(super) decay: Vec<Vec<Range<usize>>>,
    pub(super) frozen: Vec<Tensor>,
}

impl Initial {
    /// The state of rank `rank` whose weights start as `init` gives them (called for every
    /// stored parameter in block order); optimizer state on `host`.
    pub(super) fn new(
        specs: &[Vec<ParamSpec>],
        layout: &Layout,
        settings: &EngineSettings,
        rank: usize,
        host: Device,
        init: &mut dyn FnMut(&ParamSpec) -> Result<Tensor>,
    ) -> Result<Self> {
        let device = settings.device;
        let three = settings.stage == ZeroStage::Three;
        let mut master = Vec::with_capacity(specs.len());
        let mut decay = Vec::with_capacity(specs.len());
        let mut frozen = Vec::with_capacity(specs.len());
        for (b, block) in specs.iter().enumerate() {
            let (t, f) = (&layout.train[b].layout, &layout.frozen_flat[b].layout);
            let (flat, frozen_full) = fill_buffers(block, &layout.slots[b], t, f, settings.compute, init)?;
            let range = t.shard_range(rank);
            let shard = |x: &Tensor| {
                let part = x.narrow(0, range.start as i64, range.len() as i64).copy();
                pinned(part.to_device(host), device)
            };
            master.push(shard(&flat));
            decay.push(decay_ranges(block, &layout.slots[b], t, rank));
            let frozen_home = if settings.offload.offload_params == Offload::Cpu {
                Device::Cpu
            } else {
                device
            };
            frozen.push(if three {
                let range = f.shard_range(rank);
                let part = frozen_full.narrow(0, range.start as i64, range.len() as i64).copy();
                pinned(part.to_device(frozen_home), device)
            } else {
                frozen_full.to_device(device)
            });
        }
        Ok(Self { master, decay, frozen })
    }
}

/// A block's whole trained buffer (float32) and frozen buffer (in `compute`) on the host,
/// filled with what `init` gives each parameter the block stores.
fn fill_buffers(
    block: &[ParamSpec],
    slots: &[Slot],
    t: &FlatLayout,
    f: &FlatLayout,
    compute: Kind,
    init: &mut dyn FnMut(&ParamSpec) -> Result<Tensor>,
) -> Result<(Tensor, Tensor)> {
    let flat = Tensor::zeros([t.padded as i64], (Kind::Float, Device::Cpu));
    let frozen_full = Tensor::zeros([f.padded as i64], (compute, Device::Cpu));
    for (spec, slot) in block.iter().zip(slots) {
        let Slot::Own(store) = slot else { continue };
        let values = init(spec)?;
        if values.size() != spec.shape {
            return Err(Error::Invalid(format!(
                "initial values of {} have shape {:?}, not {:?}",
                spec.name,
                values.size(),
                spec.shape
            )));
        }
        let (buffer, place) = match store {
            Store::Train(i) => (&flat, &t.tensors[*i]),
            Store::Frozen(i) => (&frozen_full, &f.tensors[*i]),
        };
        let region = |t: &Tensor| t.narrow(0, place.offset as i64, place.numel as i64);
        region(buffer).copy_(&values.to_kind(buffer.kind()).view(-1));
    }
    Ok((flat, frozen_full))
}

/// The decaying pieces of this rank's shard of a block's trained buffer `t` (matrices,
/// not norms or biases), adjacent ones joined.
fn decay_ranges(block: &[ParamSpec], slots: &[Slot], t: &FlatLayout, rank: usize) -> Vec<Range<usize>> {
    let decaying: Vec<bool> = block
        .iter()
        .zip(slots)
        .filter(|(_, slot)| matches!(slot, Slot::Own(Store::Train(_))))
        .map(|(spec, _)| spec.decays())
        .collect();
    let mut ranges: Vec<Range<usize>> = Vec::new();
    for piece in t.pieces(rank).into_iter().filter(|p| decaying[p.tensor]) {
        match ranges.last_mut() {
            Some(last) if last.end == piece.in_shard.start => last.end = piece.in_shard.end,
            _ => ranges.push(piece.in_shard),
        }
    }
    ranges
}
