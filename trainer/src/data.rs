//! Which tokens each rank trains on: pure arithmetic over the dataset's length.
//!
//! The dataset is a stream of tokens cut into sequences of `context + 1` tokens (input plus
//! the shifted target) with stride `context`. The sequences are split into one contiguous
//! partition per rank, so a rank reads only its own byte range. At every step a rank takes
//! the next `per_rank_batch` sequences of its partition (wrapping at the end: a new epoch).
//! A loader's position is the number of sequences it has taken, which a checkpoint stores,
//! so a resumed run continues exactly where the checkpoint was written.

use std::ops::Range;

use crate::collective::chunks;

/// The sequences of a dataset split over `partitions` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataLayout {
    /// Tokens per sequence input (the model's context).
    pub context: usize,
    /// Sequences in the dataset.
    pub sequences: usize,
    /// One sequence range per partition.
    pub partitions: Vec<Range<usize>>,
}

impl DataLayout {
    /// Lays out `tokens` tokens for `partitions` ranks; errors when some rank would get
    /// no sequence at all.
    pub fn new(tokens: u64, context: usize, partitions: usize) -> crate::Result<Self> {
        let context = context.max(1);
        let sequences = (tokens.saturating_sub(1) / context as u64) as usize;
        if sequences < partitions.max(1) {
            return Err(crate::Error::Dataset(format!(
                "the dataset is too small: {tokens} tokens make {sequences} sequences of {} tokens, \
                 fewer than the {partitions} ranks that each need one",
                context + 1
            )));
        }
        Ok(Self {
            context,
            sequences,
            partitions: chunks(sequences, partitions.max(1)),
        })
    }

    /// The token range partition `p` reads (its sequences plus the last target token).
    pub fn token_range(&self, p: usize) -> Range<u64> {
        let seqs = &self.partitions[p];
        let start = (seqs.start * self.context) as u64;
        let end = (seqs.end * self.context + 1) as u64;
        start..end
    }

    /// The sequences (indices within partition `p`) a loader at `position` takes for one
    /// batch of `batch` sequences.
    pub fn batch(&self, p: usize, position: u64, batch: usize) -> Vec<usize> {
        let len = self.partitions[p].len() as u64;
        (0..batch as u64).map(|j| ((position + j) % len) as usize).collect()
    }

    /// The token offset, within partition `p`'s byte range, of its local sequence `index`.
    pub fn sequence_offset(&self, index: usize) -> usize {
        index * self.context
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cover_the_dataset_without_overlap() {
        let layout = DataLayout::new(1001, 10, 3).unwrap();
        assert_eq!(layout.sequences, 100);
        assert_eq!(layout.partitions, vec![0..34, 34..67, 67..100]);
        assert_eq!(layout.token_range(0), 0..341);
        assert_eq!(layout.token_range(2), 670..1001);
    }

    #[test]
    fn a_loader_wraps_inside_its_partition() {
        let layout = DataLayout::new(101, 10, 2).unwrap();
        assert_eq!(layout.partitions, vec![0..5, 5..10]);
        assert_eq!(layout.batch(1, 3, 4), vec![3, 4, 0, 1]);
        // Positions advance by the batch: consecutive steps never revisit or skip.
        let taken: Vec<usize> = (0..5u64).flat_map(|step| layout.batch(0, step * 2, 2)).collect();
        assert_eq!(taken, vec![0, 1, 2, 3, 4, 0, 1, 2, 3, 4]);
    }

    #[test]
    fn too_small_a_dataset_is_refused_with_the_numbers() {
        let error = DataLayout::new(30, 10, 3).unwrap_err().to_string();
        assert!(error.contains("30 tokens make 2 sequences of 11 tokens"), "{error}");
    }
}
