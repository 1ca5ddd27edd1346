//! The driver's bookkeeping for one scoring run: which partitions are done (their output
//! exists), which are handed out, and how often each has failed. Partitions go to whichever
//! actor is free (faster actors take more); a partition whose actor died goes back to the
//! queue for another actor, up to a retry limit. Pure: no I/O.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// The output file of a partition.
pub fn output_name(partition: usize) -> String {
    format!("part-{partition:05}.parquet")
}

/// The errors file of a partition (malformed rows, with their ids and reasons).
pub fn errors_name(partition: usize) -> String {
    format!("part-{partition:05}.errors.jsonl")
}

/// A partition's results in OpenAI's batch output format (when its input lines were in
/// OpenAI's batch input format).
pub fn openai_output_name(partition: usize) -> String {
    format!("part-{partition:05}.openai.jsonl")
}

/// A partition's refused rows in OpenAI's batch error format.
pub fn openai_errors_name(partition: usize) -> String {
    format!("part-{partition:05}.openai-errors.jsonl")
}

/// The partition an output file name belongs to.
pub fn partition_of(name: &str) -> Option<usize> {
    name.strip_prefix("part-")?.strip_suffix(".parquet")?.parse().ok()
}

/// Where every partition of a run stands.
#[derive(Clone, Debug)]
pub struct Plan {
    queue: VecDeque<usize>,
    running: BTreeSet<usize>,
    done: BTreeSet<usize>,
    failed: BTreeMap<usize, String>,
    attempts: BTreeMap<usize, u32>,
    handed_out: BTreeMap<usize, u32>,
    max_attempts: u32,
    total: usize,
    skipped: usize,
    lost: u32,
}

impl Plan {
    /// `total` partitions, of which those whose output already exists are done.
    pub fn new(total: usize, existing_outputs: &[String], max_attempts: u32) -> Self {
        let done: BTreeSet<usize> = existing_outputs
            .iter()
            .filter_map(|name| partition_of(name))
            .filter(|p| *p < total)
            .collect();
        Self {
            queue: (0..total).filter(|p| !done.contains(p)).collect(),
            running: BTreeSet::new(),
            skipped: done.len(),
            done,
            failed: BTreeMap::new(),
            attempts: BTreeMap::new(),
            handed_out: BTreeMap::new(),
            max_attempts: max_attempts.max(1),
            total,
            lost: 0,
        }
    }

    /// The next partition to hand out.
    pub fn hand_out(&mut self) -> Option<usize> {
        let partition = self.queue.pop_front()?;
        self.running.insert(partition);
        *self.attempts.entry(partition).or_default() += 1;
        *self.handed_out.entry(partition).or_default() += 1;
        Some(partition)
    }

    /// Whether the partition was handed out before in this run (after a failure or a lost
    /// actor).
    pub fn is_retry(&self, partition: usize) -> bool {
        self.handed_out.get(&partition).is_some_and(|n| *n > 1)
    }

    /// A partition's output was committed.
    pub fn finished(&mut self, partition: usize) {
        self.running.remove(&partition);
        self.done.insert(partition);
    }

    /// A partition's attempt failed; it is queued again unless it ran out of attempts.
    /// Returns true when it will be retried.
    pub fn failed(&mut self, partition: usize, reason: String) -> bool {
        self.running.remove(&partition);
        if self.attempts.get(&partition).copied().unwrap_or(0) < self.max_attempts {
            self.queue.push_back(partition);
            true
        } else {
            self.failed.insert(partition, reason);
            false
        }
    }

    /// A partition's actor died under it (its node was lost): the partition goes back to
    /// the front of the queue without using up one of its attempts.
    pub fn lost(&mut self, partition: usize) {
        if self.running.remove(&partition) {
            if let Some(attempts) = self.attempts.get_mut(&partition) {
                *attempts = attempts.saturating_sub(1);
            }
            self.lost += 1;
            self.queue.push_front(partition);
        }
    }

    /// Nothing queued or running.
    pub fn is_settled(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty()
    }

    /// Partitions done (including skipped ones).
    pub fn done(&self) -> usize {
        self.done.len()
    }

    /// Partitions done by an earlier run and skipped.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Partitions that ran out of attempts, with the last reason.
    pub fn failures(&self) -> &BTreeMap<usize, String> {
        &self.failed
    }

    /// Partitions handed out again: after a failure or after their actor was lost.
    pub fn retries(&self) -> u32 {
        self.lost + self.attempts.values().map(|a| a.saturating_sub(1)).sum::<u32>()
    }

    /// Partitions in the run.
    pub fn total(&self) -> usize {
        self.total
    }
}

/// Row indices grouped into batches of similar length (longest first), so a batch pads
/// little: `lengths[i]` is row i's token count.
pub fn length_batches(lengths: &[usize], batch: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|a, b| lengths[*b].cmp(&lengths[*a]).then(a.cmp(b)));
    order.chunks(batch.max(1)).map(<[usize]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_partitions_are_skipped_on_a_rerun() {
        let existing = vec![
            output_name(1),
            output_name(3),
            "part-00009.parquet.tmp".into(),
            output_name(99),
        ];
        let mut plan = Plan::new(5, &existing, 3);
        assert_eq!(plan.skipped(), 2);
        let handed: Vec<usize> = std::iter::from_fn(|| plan.hand_out()).collect();
        assert_eq!(handed, vec![0, 2, 4]);
        for p in handed {
            plan.finished(p);
        }
        assert!(plan.is_settled());
        assert_eq!(plan.done(), 5);
    }

    #[test]
    fn a_failed_partition_is_retried_then_given_up() {
        let mut plan = Plan::new(2, &[], 2);
        assert_eq!(plan.hand_out(), Some(0));
        assert_eq!(plan.hand_out(), Some(1));
        assert!(plan.failed(0, "actor died".into()));
        plan.finished(1);
        assert_eq!(plan.hand_out(), Some(0));
        assert!(!plan.failed(0, "actor died again".into()));
        assert!(plan.is_settled());
        assert_eq!(plan.failures()[&0], "actor died again");
        assert_eq!((plan.done(), plan.retries()), (1, 1));
    }

    #[test]
    fn a_partition_whose_actor_died_is_retried_without_using_an_attempt() {
        let mut plan = Plan::new(1, &[], 1);
        for round in 0..5 {
            assert_eq!(plan.hand_out(), Some(0));
            assert_eq!(plan.is_retry(0), round > 0);
            plan.lost(0);
        }
        assert_eq!(plan.hand_out(), Some(0));
        assert!(!plan.failed(0, "bad input".into()), "one real attempt allowed");
        assert_eq!(plan.retries(), 5);
    }

    #[test]
    fn batches_group_similar_lengths() {
        let batches = length_batches(&[3, 10, 1, 9, 3], 2);
        assert_eq!(batches, vec![vec![1, 3], vec![0, 4], vec![2]]);
        assert_eq!(partition_of(&output_name(12)), Some(12));
        assert_eq!(partition_of(&errors_name(12)), None);
    }
}
