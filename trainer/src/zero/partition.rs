//! ZeRO partition arithmetic: a model's parameters flattened into one contiguous buffer,
//! padded so it divides evenly by the world size, and split into one shard per rank.
//! Pure: indices and ranges only, no tensors.

use std::ops::Range;

/// One tensor's place in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSlot {
    /// The parameter's name.
    pub name: String,
    /// Elements.
    pub numel: usize,
    /// First element in the flat buffer.
    pub offset: usize,
}

/// A piece of one tensor that falls inside one rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the tensor in [`FlatLayout::tensors`].
    pub tensor: usize,
    /// Elements of the tensor (flattened) in this piece.
    pub in_tensor: Range<usize>,
    /// Where they sit inside the rank's shard.
    pub in_shard: Range<usize>,
}

/// Parameters flattened and padded to a multiple of the world size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    /// Every tensor, in order.
    pub tensors: Vec<TensorSlot>,
    /// Real elements.
    pub numel: usize,
    /// Elements including padding (a multiple of `world`).
    pub padded: usize,
    /// Ranks.
    pub world: usize,
}

impl FlatLayout {
    /// Lays out tensors of the given sizes for `world` ranks (`world` >= 1).
    pub fn new(tensors: &[(String, usize)], world: usize) -> Self {
        let world = world.max(1);
        let mut offset = 0;
        let slots = tensors
            .iter()
            .map(|(name, numel)| {
                let slot = TensorSlot {
                    name: name.clone(),
                    numel: *numel,
                    offset,
                };
                offset += numel;
                slot
            })
            .collect();
        let padded = offset.div_ceil(world) * world;
        Self {
            tensors: slots,
            numel: offset,
            padded,
            world,
        }
    }

    /// Elements per shard.
    pub fn shard_len(&self) -> usize {
        self.padded / self.world
    }

    /// The flat range `rank` owns.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        let len = self.shard_len();
        rank * len..(rank + 1) * len
    }

    /// The rank owning flat element `index`.
    pub fn owner_of(&self, index: usize) -> usize {
        (index / self.shard_len().max(1)).min(self.world - 1)
    }

    /// The pieces of real tensors inside `rank`'s shard (padding has no piece).
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let shard = self.shard_range(rank);
        self.tensors
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| {
                let start = slot.offset.max(shard.start);
                let end = (slot.offset + slot.numel).min(shard.end);
                (start < end).then(|| Piece {
                    tensor: index,
                    in_tensor: start - slot.offset..end - slot.offset,
                    in_shard: start - shard.start..end - shard.start,
                })
            })
            .collect()
    }
}

/// Where rank `rank`'s shard of a `numel`-element flat buffer laid out for `new_world`
/// ranks comes from in the same buffer laid out for `old_world` ranks: pieces of
/// `(old rank, range in its shard, range in the new shard)`. Padding has no piece (it
/// stays zero). How a checkpoint's optimizer slices reach a run with another world size.
pub fn reshard(
    numel: usize,
    old_world: usize,
    new_world: usize,
    rank: usize,
) -> Vec<(usize, Range<usize>, Range<usize>)> {
    let old = FlatLayout::new(&[(String::new(), numel)], old_world);
    let new = FlatLayout::new(&[(String::new(), numel)], new_world);
    let mine = new.shard_range(rank);
    let mine = mine.start.min(numel)..mine.end.min(numel);
    (0..old.world)
        .filter_map(|o| {
            let theirs = old.shard_range(o);
            let start = mine.start.max(theirs.start);
            let end = mine.end.min(theirs.end);
            (start < end).then(|| {
                (
                    o,
                    start - theirs.start..end - theirs.start,
                    start - mine.start..end - mine.start,
                )
            })
        })
        .collect()
}

/// What ZeRO partitions, by stage. In configs and manifests it is the number 1, 2 or 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum ZeroStage {
    /// Optimizer state.
    One,
    /// Optimizer state and gradients.
    Two,
    /// Optimizer state, gradients and parameters.
    Three,
}

impl TryFrom<u8> for ZeroStage {
    type Error = crate::Error;

    fn try_from(number: u8) -> crate::Result<Self> {
        match number {
            1 => Ok(Self::One),
            2 => Ok(Self::Two),
            3 => Ok(Self::Three),
            other => Err(crate::Error::Config(format!(
                "ZeRO stage {other} does not exist; use 1, 2 or 3"
            ))),
        }
    }
}

impl From<ZeroStage> for u8 {
    fn from(stage: ZeroStage) -> u8 {
        match stage {
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", u8::from(*self))
    }
}

/// Bytes of training state one rank holds (fp32 parameters and gradients; AdamW keeps a
/// master copy plus two moments per element).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateBytes {
    /// Parameters.
    pub parameters: usize,
    /// Gradients.
    pub gradients: usize,
    /// Optimizer state.
    pub optimizer: usize,
}

/// The bytes each rank holds at `stage` for a layout (what a test checks the real tensors
/// against).
pub fn bytes_per_rank(layout: &FlatLayout, stage: ZeroStage) -> StateBytes {
    let full = layout.padded * 4;
    let shard = layout.shard_len() * 4;
    StateBytes {
        parameters: if stage == ZeroStage::Three { shard } else { full },
        gradients: if stage == ZeroStage::One { full } else { shard },
        optimizer: 3 * shard,
    }
}

/// Groups tensors into reduce-scatter buckets of at least `bucket_elems` elements, in
/// backward order (last tensor first), as gradients become ready.
pub fn gradient_buckets(layout: &FlatLayout, bucket_elems: usize) -> Vec<Vec<usize>> {
    let mut buckets = Vec::new();
    let mut current = Vec::new();
    let mut size = 0;
    for index in (0..layout.tensors.len()).rev() {
        current.push(index);
        size += layout.tensors[index].numel;
        if size >= bucket_elems.max(1) {
            buckets.push(std::mem::take(&mut current));
            size = 0;
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(sizes: &[usize], world: usize) -> FlatLayout {
        let tensors: Vec<(String, usize)> = sizes.iter().enumerate().map(|(i, n)| (format!("t{i}"), *n)).collect();
        FlatLayout::new(&tensors, world)
    }

    #[test]
    fn padding_makes_the_buffer_divide_by_the_world() {
        let l = layout(&[5, 3, 3], 3);
        assert_eq!((l.numel, l.padded, l.shard_len()), (11, 12, 4));
        assert_eq!(l.shard_range(2), 8..12);
        assert_eq!(l.owner_of(7), 1);
    }

    #[test]
    fn pieces_cover_every_real_element_exactly_once() {
        for world in 1..=4 {
            let l = layout(&[7, 1, 10, 3], world);
            let mut seen = vec![0u8; l.numel];
            for rank in 0..world {
                for piece in l.pieces(rank) {
                    let slot = &l.tensors[piece.tensor];
                    assert_eq!(piece.in_tensor.len(), piece.in_shard.len());
                    for i in piece.in_tensor.clone() {
                        seen[slot.offset + i] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|c| *c == 1), "world {world}: {seen:?}");
        }
    }

    #[test]
    fn each_rank_holds_about_a_world_th_of_the_state() {
        let l = layout(&[1000, 1001], 3);
        let one = bytes_per_rank(&l, ZeroStage::One);
        let three = bytes_per_rank(&l, ZeroStage::Three);
        assert_eq!(one.optimizer, 3 * 4 * 667);
        assert_eq!(one.gradients, 4 * 2001);
        assert_eq!(three.parameters, 4 * 667);
        assert_eq!(bytes_per_rank(&l, ZeroStage::Two).gradients, 4 * 667);
    }

    #[test]
    fn buckets_follow_backward_order() {
        let l = layout(&[4, 4, 4, 4, 1], 2);
        assert_eq!(gradient_buckets(&l, 8), vec![vec![4, 3, 2], vec![1, 0]]);
    }

    #[test]
    fn reshard_moves_every_real_element_once() {
        for (numel, old, new) in [(10, 3, 2), (10, 2, 3), (7, 1, 4), (100, 4, 1), (5, 3, 3)] {
            let flat: Vec<usize> = (0..numel).collect();
            let old_layout = FlatLayout::new(&[(String::new(), numel)], old);
            let old_shards: Vec<Vec<usize>> = (0..old)
                .map(|r| {
                    old_layout
                        .shard_range(r)
                        .map(|i| flat.get(i).copied().unwrap_or(usize::MAX))
                        .collect()
                })
                .collect();
            let new_len = FlatLayout::new(&[(String::new(), numel)], new).shard_len();
            let mut rebuilt = Vec::new();
            for rank in 0..new {
                let mut shard = vec![usize::MAX; new_len];
                for (o, from, to) in reshard(numel, old, new, rank) {
                    shard[to].copy_from_slice(&old_shards[o][from]);
                }
                rebuilt.extend(shard);
            }
            rebuilt.truncate(numel);
            assert_eq!(rebuilt, flat, "{numel} elements from {old} to {new} ranks");
        }
    }
}
