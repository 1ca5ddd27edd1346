//! The run's hand-out loop: partitions go to actor slots as the slots free up (a
//! generating actor takes [`GENERATE_DEPTH`] partitions at once, so its batch stays full
//! across partition boundaries; a scoring actor one at a time), a partition whose actor
//! died goes to another actor without using an attempt while a replacement is spawned
//! beside the other actors' work, and progress is reported after every event. [`Slots`]
//! keeps the slots' bookkeeping apart from actors and futures, so a test drives it.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use regatta_runtime::ActorHandle;

use super::{Progress, ScoreRun};
use crate::actor::{PartitionReport, PartitionTask, ScorerActor, Slice, GENERATE_DEPTH};
use crate::error::{Error, Result};
use crate::plan::Plan;

/// How long one partition's call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// What the driver waits for.
enum Event {
    /// A partition's call returned: the actor's slot, the actor's incarnation in it when
    /// the call went out, the partition, the reply.
    Scored(usize, u64, usize, regatta_runtime::Result<PartitionReport>),
    /// A replacement actor for a slot was spawned (or not).
    Replaced(usize, Result<ActorHandle<ScorerActor>>),
}

/// Which actor slots can take a call, and the bookkeeping of replacing a slot's dead
/// actor: each free call place is the slot's number once (a slot is listed as many times
/// as calls it may take at once).
#[derive(Debug)]
struct Slots {
    idle: Vec<usize>,
    /// Times each slot's actor was replaced: a failed call of an older actor is stale.
    incarnation: Vec<u64>,
    /// Calls lost with a dead actor, given back to its slot once the replacement is up.
    orphaned: Vec<usize>,
    /// Slots whose replacement is being spawned.
    replacing: Vec<bool>,
    /// Replacements spawned in all.
    replacements: u32,
}

/// What becomes of a slot whose actor died under a call.
#[derive(Debug, PartialEq, Eq)]
enum Death {
    /// The call went to an actor already replaced: the slot's new actor takes its place.
    AlreadyReplaced,
    /// The actor's other call: its replacement is on its way, and takes the place.
    ReplacementComing,
    /// The slot needs a new actor, the run's `n`th replacement.
    Replace(u32),
}

impl Slots {
    /// `actors` slots, each taking `depth` calls at once.
    fn new(actors: usize, depth: usize) -> Self {
        Self {
            idle: (0..actors).flat_map(|slot| vec![slot; depth]).collect(),
            incarnation: vec![0; actors],
            orphaned: vec![0; actors],
            replacing: vec![false; actors],
            replacements: 0,
        }
    }

    /// A free call place, if any.
    fn take(&mut self) -> Option<usize> {
        self.idle.pop()
    }

    /// Gives a call place of `slot` back.
    fn free(&mut self, slot: usize) {
        self.idle.push(slot);
    }

    /// Whether no call place is free.
    fn none_free(&self) -> bool {
        self.idle.is_empty()
    }

    /// How many times `slot`'s actor has been replaced.
    fn incarnation(&self, slot: usize) -> u64 {
        self.incarnation[slot]
    }

    /// A call sent to `slot`'s actor in incarnation `born` ended because the actor died.
    fn died(&mut self, slot: usize, born: u64) -> Death {
        if born < self.incarnation[slot] {
            self.idle.push(slot);
            return Death::AlreadyReplaced;
        }
        self.orphaned[slot] += 1;
        if self.replacing[slot] {
            return Death::ReplacementComing;
        }
        self.replacing[slot] = true;
        self.replacements += 1;
        Death::Replace(self.replacements)
    }

    /// `slot` has its new actor: the calls its old one lost are its to take again.
    fn replaced(&mut self, slot: usize) {
        self.incarnation[slot] += 1;
        self.replacing[slot] = false;
        self.idle
            .extend(std::iter::repeat_n(slot, std::mem::take(&mut self.orphaned[slot])));
    }

    /// `slot` got no new actor: the run goes on without it.
    fn unreplaced(&mut self, slot: usize) {
        self.replacing[slot] = false;
        self.orphaned[slot] = 0;
    }
}

/// A run's partitions being handed out to its actors.
pub(super) struct Dispatch<'r> {
    run: &'r ScoreRun,
    slices: &'r [(Slice, u64)],
    plan: Plan,
    progress: Progress,
    started: Instant,
    actors: Vec<ActorHandle<ScorerActor>>,
    slots: Slots,
    running: FuturesUnordered<BoxFuture<'r, Event>>,
}

impl<'r> Dispatch<'r> {
    /// Hands out `plan`'s partitions of `slices` to `actors` (the run started at `started`).
    pub(super) fn new(
        run: &'r ScoreRun,
        slices: &'r [(Slice, u64)],
        plan: Plan,
        progress: Progress,
        started: Instant,
        actors: Vec<ActorHandle<ScorerActor>>,
    ) -> Self {
        let depth = if run.config.generate { GENERATE_DEPTH } else { 1 };
        Self {
            run,
            slices,
            plan,
            progress,
            started,
            slots: Slots::new(actors.len(), depth),
            actors,
            running: FuturesUnordered::new(),
        }
    }

    /// Hands partitions out until every one is settled or one has used its attempts, then
    /// stops the actors; calls `on_progress` after each event. Returns the plan (with any
    /// partition that failed) and the progress.
    pub(super) async fn run(mut self, on_progress: &mut impl FnMut(&Progress)) -> Result<(Plan, Progress)> {
        loop {
            self.hand_out();
            let Some(event) = self.running.next().await else {
                break;
            };
            let go_on = match event {
                Event::Scored(slot, _, partition, Ok(report)) => {
                    self.scored(slot, partition, &report);
                    true
                }
                Event::Scored(slot, born, partition, Err(error)) => self.call_failed(slot, born, partition, error)?,
                Event::Replaced(slot, spawned) => {
                    self.replaced(slot, spawned);
                    true
                }
            };
            if !go_on {
                break;
            }
            self.report(on_progress);
            if self.plan.is_settled() {
                // Every partition is done: a replacement still being spawned is not needed.
                break;
            }
            if self.running.is_empty() && self.slots.none_free() {
                return Err(Error::Run("every scorer actor died and none could be replaced".into()));
            }
        }
        for actor in &self.actors {
            let _ = actor.kill().await;
        }
        Ok((self.plan, self.progress))
    }

    /// Sends partitions to free call places while there are both.
    fn hand_out(&mut self) {
        let config = &self.run.config;
        while let Some(slot) = self.slots.take() {
            let Some(partition) = self.plan.hand_out() else {
                self.slots.free(slot);
                break;
            };
            let handle = self.actors[slot].clone();
            let request = PartitionTask {
                input: config.input.clone(),
                partition,
                slice: self.slices[partition].0.clone(),
                output: config.output.clone(),
                retry: self.plan.is_retry(partition),
            };
            let born = self.slots.incarnation(slot);
            self.running.push(Box::pin(async move {
                let reply = handle.call_timeout(request, CALL_TIMEOUT).await;
                Event::Scored(slot, born, partition, reply)
            }));
        }
    }

    /// A partition is done.
    fn scored(&mut self, slot: usize, partition: usize, report: &PartitionReport) {
        self.plan.finished(partition);
        let progress = &mut self.progress;
        progress.rows += report.rows;
        progress.errors += report.errors;
        progress.tokens += report.tokens;
        progress.output_tokens += report.output_tokens;
        progress.bytes_done += self.slices[partition].1;
        self.slots.free(slot);
    }

    /// A partition's call failed. When its actor died (its node or executor is gone), the
    /// partition goes to another actor without using an attempt and the slot gets a new
    /// actor on whatever node has room (the run goes on with fewer if none has); any other
    /// failure uses an attempt. Returns `false` once the partition has used them all.
    fn call_failed(&mut self, slot: usize, born: u64, partition: usize, error: regatta_runtime::Error) -> Result<bool> {
        let dead = matches!(
            error,
            regatta_runtime::Error::ActorDead { .. } | regatta_runtime::Error::CallFailed { .. }
        );
        let reason = error.to_string();
        tracing::warn!(partition, %reason, "partition failed");
        if !dead {
            if !self.plan.failed(partition, reason) {
                return Ok(false);
            }
            self.slots.free(slot);
            return Ok(true);
        }
        self.plan.lost(partition);
        if let Death::Replace(replacements) = self.slots.died(slot, born) {
            self.replace(slot, replacements, &reason)?;
        }
        Ok(true)
    }

    /// Spawns the run's `replacements`th new actor for `slot`, beside the other actors'
    /// work, never blocking it; fails the run when actors keep dying.
    fn replace(&mut self, slot: usize, replacements: u32, reason: &str) -> Result<()> {
        if replacements as usize > 4 * self.run.config.actors.max(1) {
            return Err(Error::Run(format!(
                "scorer actors keep dying ({replacements} replaced); last: {reason}"
            )));
        }
        // Until the head has declared a dead node dead, a new actor may land on it: back
        // off a little more with every replacement.
        let backoff = Duration::from_millis(500 * u64::from(replacements.min(20)));
        let run = self.run;
        self.running.push(Box::pin(async move {
            tokio::time::sleep(backoff).await;
            Event::Replaced(slot, run.spawn_actor().await)
        }));
        Ok(())
    }

    /// A replacement for `slot` was spawned, or not.
    fn replaced(&mut self, slot: usize, spawned: Result<ActorHandle<ScorerActor>>) {
        match spawned {
            Ok(actor) => {
                self.actors[slot] = actor;
                self.slots.replaced(slot);
            }
            Err(e) => {
                self.slots.unreplaced(slot);
                tracing::warn!("no replacement scorer: {e}");
            }
        }
    }

    fn report(&mut self, on_progress: &mut impl FnMut(&Progress)) {
        self.progress.partitions_done = self.plan.done();
        self.progress.retries = self.plan.retries();
        self.progress.seconds = self.started.elapsed().as_secs_f64();
        on_progress(&self.progress);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_actors_calls_wait_for_its_one_replacement() {
        // Two slots taking two calls each; slot 1's actor dies under both of its calls.
        let mut slots = Slots::new(2, 2);
        let taken: Vec<usize> = std::iter::from_fn(|| slots.take()).collect();
        assert_eq!(taken, vec![1, 1, 0, 0]);
        assert_eq!(slots.died(1, 0), Death::Replace(1));
        assert_eq!(slots.died(1, 0), Death::ReplacementComing);
        assert!(slots.none_free());
        slots.replaced(1);
        assert_eq!(slots.incarnation(1), 1);
        assert_eq!(std::iter::from_fn(|| slots.take()).collect::<Vec<_>>(), vec![1, 1]);
        // A call of the actor replaced since frees a place of the new one at once.
        assert_eq!(slots.died(1, 0), Death::AlreadyReplaced);
        assert_eq!(slots.take(), Some(1));
        // A slot without a replacement loses its places; the next death replaces again.
        assert_eq!(slots.died(0, 0), Death::Replace(2));
        slots.unreplaced(0);
        assert!(slots.none_free());
        assert_eq!(slots.died(0, 0), Death::Replace(3));
    }
}
