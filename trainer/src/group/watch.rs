//! Watching an attempt: polling every rank for its events until all have finished, a
//! rank is lost, the run stalls, or (elastic runs) capacity for more ranks returns at a
//! checkpoint; draining the survivors after a failure; [`Seen`], what the attempt has
//! heard; and which rank a lost attempt is blamed on.

use std::time::{Duration, Instant};

use regatta_runtime::ActorHandle;

use super::attempt::AttemptError;
use super::{TrainEvent, TrainSummary, TrainerGroup};
use crate::protocol::{FromExecutor, TrainOp, TrainReply};
use crate::rank::TrainRank;

/// How long a failed attempt waits for its surviving ranks' executors to exit, taking in
/// what they reported, before the restart.
const DRAIN_FOR: Duration = Duration::from_secs(5);

/// How often the driver asks the ranks for events.
const POLL_EVERY: Duration = Duration::from_millis(200);

impl TrainerGroup {
    pub(super) async fn watch(
        &self,
        ranks: &[ActorHandle<TrainRank>],
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
    ) -> Result<(), AttemptError> {
        let mut seen = Seen::new(ranks.len());
        let outcome = self.watch_until_done(ranks, summary, on_event, &mut seen).await;
        let Err(error) = outcome else {
            return Ok(());
        };
        // Ranks still alive may hold steps and checkpoints not polled yet (a checkpoint
        // the restart resumes from must not leave a hole in the loss curve): drain them.
        // After a lost rank the survivors cannot go on: each is drained until its executor
        // has exited (every line it wrote read: a step reported just before its checkpoint
        // was saved may still be in the pipe), for DRAIN_FOR at most. Healthy ranks (the
        // group grows) are polled once: they would train on while waited for.
        let mut unreachable = Vec::new();
        let until = match error {
            AttemptError::Lost { .. } => Instant::now() + DRAIN_FOR,
            _ => Instant::now(),
        };
        for (rank, handle) in ranks.iter().enumerate() {
            loop {
                match handle.call_timeout(TrainOp::Poll, Duration::from_secs(5)).await {
                    Ok(TrainReply::Events { events, exited }) => {
                        let _ = seen.absorb(rank, events, summary, on_event);
                        if exited.is_some() || Instant::now() >= until {
                            break;
                        }
                        tokio::time::sleep(POLL_EVERY).await;
                    }
                    Ok(_) => break,
                    Err(e) => {
                        unreachable.push((rank, e.to_string()));
                        break;
                    }
                }
            }
        }
        Err(blame(error, &unreachable))
    }

    async fn watch_until_done(
        &self,
        ranks: &[ActorHandle<TrainRank>],
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
        seen: &mut Seen,
    ) -> Result<(), AttemptError> {
        let stall = Duration::from_secs(self.config.stall_timeout_secs.max(1));
        loop {
            for (rank, handle) in ranks.iter().enumerate() {
                let reply = handle
                    .call_timeout(TrainOp::Poll, Duration::from_secs(30))
                    .await
                    .map_err(|e| AttemptError::Lost {
                        rank,
                        reason: e.to_string(),
                    })?;
                let TrainReply::Events { events, exited } = reply else {
                    return Err(AttemptError::Lost {
                        rank,
                        reason: "the rank replied out of turn".into(),
                    });
                };
                seen.absorb(rank, events, summary, on_event)?;
                if let (Some(exited), false) = (exited, seen.finished[rank]) {
                    return Err(AttemptError::Lost { rank, reason: exited });
                }
            }
            if seen.finished.iter().all(|done| *done) {
                return Ok(());
            }
            if let (Some(scaling), Some(step)) = (self.scaling(), seen.new_checkpoint.take()) {
                let missing = scaling.max_workers.saturating_sub(ranks.len());
                // Not at the last step's checkpoint: the run is about to finish.
                let last = step >= self.config.steps;
                let waiting = seen.checkpoints <= self.probe_skip.load(std::sync::atomic::Ordering::Relaxed);
                if missing > 0
                    && !last
                    && !waiting
                    && !seen.finished.iter().any(|d| *d)
                    && self.capacity_for(missing).await
                {
                    tracing::info!(step, missing, "capacity returned at the checkpoint of step {step}");
                    return Err(AttemptError::Grow {
                        to: scaling.max_workers,
                    });
                }
            }
            if seen.last_progress.elapsed() > stall {
                return Err(AttemptError::Lost {
                    rank: 0,
                    reason: format!("no step finished for {stall:?}"),
                });
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }
}

/// What one attempt has heard from its ranks.
struct Seen {
    new_checkpoint: Option<u64>,
    checkpoints: u32,
    steps: std::collections::BTreeSet<u64>,
    finished: Vec<bool>,
    last_progress: Instant,
}

impl Seen {
    fn new(world: usize) -> Self {
        Self {
            new_checkpoint: None,
            checkpoints: 0,
            steps: Default::default(),
            finished: vec![false; world],
            last_progress: Instant::now(),
        }
    }

    /// Takes in a rank's events. Every rank reports the same loss for a step; the first
    /// report of a step counts, so a step is recorded even when rank 0 died before its
    /// report was polled. Rank 0 alone reports checkpoints and sets the last report.
    fn absorb(
        &mut self,
        rank: usize,
        events: Vec<FromExecutor>,
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
    ) -> Result<(), AttemptError> {
        for event in events {
            match event {
                FromExecutor::Step(report) => {
                    self.last_progress = Instant::now();
                    if rank == 0 {
                        summary.last = Some(report.clone());
                    }
                    if self.steps.insert(report.step) {
                        summary.losses.insert(report.step, report.loss);
                        on_event(&TrainEvent::Step(report));
                    }
                }
                FromExecutor::Checkpoint { step, url, best } if rank == 0 => {
                    self.new_checkpoint = Some(step);
                    self.checkpoints += 1;
                    summary.checkpoint = Some((step, url.clone()));
                    if best {
                        summary.best = Some((step, url.clone()));
                    }
                    on_event(&TrainEvent::Checkpoint { step, url, best });
                }
                FromExecutor::Eval(report) if rank == 0 => {
                    self.last_progress = Instant::now();
                    summary.evals.insert(report.step, report.loss);
                    on_event(&TrainEvent::Eval(report));
                }
                FromExecutor::Finished { .. } => self.finished[rank] = true,
                FromExecutor::Skipped { what, count } => on_event(&TrainEvent::Skipped { rank, what, count }),
                FromExecutor::Failed { reason, fatal: true } => {
                    return Err(AttemptError::Fatal(format!("rank {rank}: {reason}")))
                }
                FromExecutor::Failed { reason, fatal: false } => return Err(AttemptError::Lost { rank, reason }),
                _ => {}
            }
        }
        Ok(())
    }
}

/// The rank a lost attempt is blamed on. A rank whose executor exited because its ring
/// peer vanished is a victim, not the cause: when the blamed rank still answers and
/// another does not, the unreachable one is the lost rank.
fn blame(error: AttemptError, unreachable: &[(usize, String)]) -> AttemptError {
    match error {
        AttemptError::Lost { rank, reason } => match unreachable.first() {
            Some((gone, cause)) if unreachable.iter().all(|(r, _)| *r != rank) => AttemptError::Lost {
                rank: *gone,
                reason: format!("{cause} (rank {rank}: {reason})"),
            },
            _ => AttemptError::Lost { rank, reason },
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(rank: usize) -> AttemptError {
        AttemptError::Lost {
            rank,
            reason: "ring peer closed".into(),
        }
    }

    fn blamed(error: AttemptError) -> Option<usize> {
        match error {
            AttemptError::Lost { rank, .. } => Some(rank),
            _ => None,
        }
    }

    #[test]
    fn a_rank_that_still_answers_passes_the_blame_to_the_unreachable_one() {
        let gone = [(1, "node w2 lost".to_string())];
        assert_eq!(blamed(blame(lost(0), &gone)), Some(1));
    }

    #[test]
    fn an_unreachable_blamed_rank_keeps_the_blame() {
        let gone = [(0, "node w1 lost".to_string()), (1, "node w2 lost".to_string())];
        assert_eq!(blamed(blame(lost(1), &gone)), Some(1));
        assert_eq!(blamed(blame(lost(0), &[])), Some(0));
    }

    #[test]
    fn only_lost_attempts_are_reattributed() {
        let gone = [(1, "node w2 lost".to_string())];
        assert!(matches!(
            blame(AttemptError::Grow { to: 3 }, &gone),
            AttemptError::Grow { to: 3 }
        ));
    }
}
