//! A QLoRA base at ZeRO-3: each block's quantized weights are packed into one byte buffer
//! (codes and scales, `quant::PackedWeights`) of which a rank keeps its slice; the block's
//! turn (forward, backward's recomputation, a merged save) gathers the buffer and hands
//! the weights back to the model, and another block's turn or the step's end drops them.
//! Stages 1 and 2 leave the weights whole in the model.

use super::*;
use crate::quant::PackedWeights;

/// One block's slice of its packed quantized weights.
pub(super) struct QuantShard {
    packed: PackedWeights,
    /// This rank's slice of the buffer, viewed as f32 (the collectives' type; the bytes
    /// travel unchanged).
    slice: Tensor,
}

impl QuantShard {
    /// Packs `block`'s quantized weights (taken from `model`) and keeps slice `rank` of
    /// `world`; `None` for a block without any.
    pub(super) fn of_block(model: &mut dyn Model, block: usize, world: usize, rank: usize) -> Option<Self> {
        let weights: Vec<(String, crate::quant::QuantWeight)> = model
            .quantized_block(block)
            .iter()
            .filter_map(|spec| model.take_quantized(&spec.name).map(|w| (spec.name.clone(), w)))
            .collect();
        // Slices of whole f32 words.
        let (packed, buffer) = PackedWeights::pack(weights, 4 * world as i64)?;
        let words = packed.len() / 4 / world as i64;
        let slice = buffer
            .view_dtype(Kind::Float)
            .narrow(0, rank as i64 * words, words)
            .copy();
        Some(Self { packed, slice })
    }

    fn bytes(&self) -> u64 {
        (self.slice.numel() * 4) as u64 + self.packed.whole_bytes()
    }
}

impl Engine {
    /// Hands the model block `block`'s quantized weights, gathered from every rank's
    /// slice (a collective), after dropping another block's. Nothing for a block whose
    /// weights the model holds whole.
    pub(super) fn install_quantized(&mut self, block: usize) -> Result<()> {
        if self.installed == Some(block) {
            return Ok(());
        }
        let Some(shard) = self.quant_shards.get(block).and_then(Option::as_ref) else {
            return Ok(());
        };
        let full = self.coll.all_gather(&shard.slice)?;
        let weights = shard.packed.unpack(&full.view_dtype(Kind::Uint8));
        self.release_quantized();
        for (name, weight) in weights {
            self.model.put_quantized(name, weight)?;
        }
        self.installed = Some(block);
        Ok(())
    }

    /// Drops the gathered block's quantized weights, if any.
    pub(super) fn release_quantized(&mut self) {
        if let Some(block) = self.installed.take() {
            for spec in self.model.quantized_block(block) {
                self.model.take_quantized(&spec.name);
            }
        }
    }

    /// Bytes of the quantized base this rank holds: its slices, or the model's whole
    /// weights when not sliced.
    pub(super) fn quantized_held(&self) -> u64 {
        let slices: u64 = self.quant_shards.iter().flatten().map(QuantShard::bytes).sum();
        // Sliced, the model holds only a block gathered for its turn: transient, as a
        // stage-3 gather of float ones.
        let whole = match self.installed {
            Some(_) => 0,
            None => self.model.quantized_bytes(),
        };
        slices + whole
    }
}
