//! Validation during training: the `[eval]` section, which dataset rows are held out of
//! training for it, which rows each rank evaluates in which micro-batch, and when a run
//! evaluates. Pure: the executor (regatta-torch) loads the rows and runs the forward passes.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// `[eval]`: a validation loss every `interval` steps and at the end, on a held-out
/// dataset (`path`) or a `split` of the training rows held out of training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// A held-out dataset, read like `data.path` (JSONL, Parquet or text; local or by URL).
    pub path: String,
    /// The fraction of `data.path`'s rows (JSONL or Parquet) held out of training and
    /// validated on instead; 0 when `path` names the validation data.
    pub split: f64,
    /// Steps between validations (the last step always validates); 0: only at the end.
    pub interval: u64,
    /// Most validation rows (packed sequences of `model.context` tokens) read; the first
    /// ones are taken.
    pub max_rows: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            path: String::new(),
            split: 0.0,
            interval: 0,
            max_rows: 256,
        }
    }
}

impl EvalConfig {
    /// Checks the section on its own (the training data's shape is checked by the caller).
    pub fn validate(&self) -> crate::Result<()> {
        let fail = |m: String| Err(Error::Config(m));
        let (path, split) = (!self.path.is_empty(), self.split);
        if !path && split == 0.0 {
            return fail("[eval] needs path (a validation dataset) or split (a fraction of data.path held out)".into());
        }
        if path && split != 0.0 {
            return fail("eval.path and eval.split are exclusive: validate on a dataset or on a held-out split".into());
        }
        if !path && !(0.0..=0.5).contains(&split) {
            return fail(format!("eval.split must lie in (0, 0.5], not {split}"));
        }
        if !(1..=1_000_000).contains(&self.max_rows) {
            return fail(format!("eval.max_rows must be 1..=1000000, not {}", self.max_rows));
        }
        Ok(())
    }

    /// Whether the run validates after `done` of `steps` steps.
    pub fn due(&self, done: u64, steps: u64) -> bool {
        done == steps || (self.interval > 0 && done.is_multiple_of(self.interval))
    }

    /// Which rows a split holds out, for a run seeded `seed`.
    pub fn holdout(&self, seed: u64, side: Side) -> Option<Holdout> {
        (self.split > 0.0).then_some(Holdout {
            fraction: self.split,
            seed,
            side,
        })
    }
}

/// Which side of a held-out split a reader keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The rows trained on.
    Train,
    /// The rows held out for validation.
    Eval,
}

/// A split of a dataset's rows by a hash of each row's place in its file (a JSONL line's
/// byte offset, a Parquet row's number), so every rank, whatever its partition, puts a
/// row on the same side, and a row is never both trained and validated on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Holdout {
    /// The fraction held out.
    pub fraction: f64,
    /// The run's seed.
    pub seed: u64,
    /// The side this reader keeps.
    pub side: Side,
}

impl Holdout {
    /// Whether the row at `key` is on this reader's side.
    pub fn keeps(&self, key: u64) -> bool {
        let held_out = unit(mix(key ^ mix(self.seed))) < self.fraction;
        held_out == (self.side == Side::Eval)
    }
}

/// SplitMix64's finaliser: consecutive keys land far apart.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A hash as a number in [0, 1).
fn unit(hash: u64) -> f64 {
    (hash >> 11) as f64 / (1u64 << 53) as f64
}

/// The validation rows `rank` of `world` evaluates, as micro-batches of `micro` rows: rows
/// `rank`, `rank + world`, ... of `rows`. Every rank gets the same number of micro-batches
/// (the forward passes gather parameters together at ZeRO-3); `None` fills a batch's
/// place past a rank's last row and carries no loss.
pub fn rank_batches(rows: usize, world: usize, rank: usize, micro: usize) -> Vec<Vec<Option<usize>>> {
    let (world, micro) = (world.max(1), micro.max(1));
    let per_rank = rows.div_ceil(world);
    let batches = per_rank.div_ceil(micro);
    (0..batches)
        .map(|b| {
            (0..micro)
                .map(|j| {
                    let k = b * micro + j;
                    let row = rank + k * world;
                    (k < per_rank && row < rows).then_some(row)
                })
                .collect()
        })
        .collect()
}

/// A validation result: the mean loss over every target token of the validation rows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// Steps done when it ran.
    pub step: u64,
    /// Mean cross-entropy per target token.
    pub loss: f64,
    /// Target tokens it covered (all ranks).
    pub tokens: u64,
}

impl EvalReport {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Whether a checkpoint validated at `loss` is better than the best so far.
pub fn improves(best: Option<f64>, loss: f64) -> bool {
    loss.is_finite() && best.is_none_or(|b| loss < b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_evaluated_once_in_equal_numbers_of_batches() {
        for rows in 1..40 {
            for world in 1..5 {
                for micro in 1..5 {
                    let plans: Vec<_> = (0..world).map(|r| rank_batches(rows, world, r, micro)).collect();
                    let counts: Vec<usize> = plans.iter().map(Vec::len).collect();
                    assert!(
                        counts.windows(2).all(|w| w[0] == w[1]),
                        "{rows} {world} {micro}: {counts:?}"
                    );
                    assert!(plans.iter().flatten().all(|b| b.len() == micro));
                    let mut seen: Vec<usize> = plans.iter().flatten().flatten().flatten().copied().collect();
                    seen.sort_unstable();
                    assert_eq!(seen, (0..rows).collect::<Vec<_>>(), "{rows} {world} {micro}");
                }
            }
        }
        assert_eq!(rank_batches(5, 2, 1, 2), vec![vec![Some(1), Some(3)], vec![None, None]]);
        assert_eq!(
            rank_batches(5, 2, 0, 2),
            vec![vec![Some(0), Some(2)], vec![Some(4), None]]
        );
    }

    #[test]
    fn a_split_puts_each_row_on_one_side_near_the_fraction() {
        let train = Holdout {
            fraction: 0.2,
            seed: 7,
            side: Side::Train,
        };
        let eval = Holdout {
            side: Side::Eval,
            ..train
        };
        let keys = (0..10_000u64).map(|k| k * 97);
        let held: Vec<u64> = keys.clone().filter(|k| eval.keeps(*k)).collect();
        assert!(keys.clone().all(|k| train.keeps(k) != eval.keeps(k)));
        assert!((1800..2200).contains(&held.len()), "{}", held.len());
        // Another seed holds out other rows.
        let other = Holdout { seed: 8, ..eval };
        assert_ne!(held, keys.filter(|k| other.keeps(*k)).collect::<Vec<_>>());
    }

    #[test]
    fn validation_runs_at_the_interval_and_the_end() {
        let config = EvalConfig {
            interval: 4,
            split: 0.1,
            ..EvalConfig::default()
        };
        let due: Vec<u64> = (1..=10).filter(|d| config.due(*d, 10)).collect();
        assert_eq!(due, vec![4, 8, 10]);
        let end_only = EvalConfig { interval: 0, ..config };
        assert_eq!((1..=10).filter(|d| end_only.due(*d, 10)).count(), 1);
    }

    #[test]
    fn the_section_needs_one_source_and_sane_numbers() {
        let ok = EvalConfig {
            path: "v.jsonl".into(),
            ..EvalConfig::default()
        };
        assert!(ok.validate().is_ok());
        let cases = [
            (EvalConfig::default(), "needs path"),
            (
                EvalConfig {
                    split: 0.1,
                    ..ok.clone()
                },
                "exclusive",
            ),
            (
                EvalConfig {
                    path: String::new(),
                    split: 0.9,
                    ..ok.clone()
                },
                "(0, 0.5]",
            ),
            (
                EvalConfig {
                    max_rows: 0,
                    ..ok.clone()
                },
                "max_rows",
            ),
        ];
        for (config, expected) in cases {
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains(expected), "{config:?}: {error}");
        }
    }

    #[test]
    fn only_a_lower_finite_loss_improves() {
        assert!(improves(None, 2.0));
        assert!(improves(Some(2.0), 1.5));
        assert!(!improves(Some(1.5), 1.5));
        assert!(!improves(Some(1.5), 2.0));
        assert!(!improves(None, f64::NAN));
    }
}
