//! Reserving the ranks' bundles: a placement group of `world_size` bundles, or for an
//! elastic run the largest size in range that can be placed; the capacity probe an
//! elastic run makes at its checkpoints; and the guard that removes a placement group
//! when the driver is cancelled.

use std::time::{Duration, Instant};

use regatta_runtime::Strategy;

use super::outcome::AttemptError;
use super::TrainerGroup;

/// How long a placement group may wait for resources.
pub(super) const PLACEMENT_TIMEOUT: Duration = Duration::from_secs(120);

impl TrainerGroup {
    /// A placement group for the next attempt and its size: `world_size` bundles, or for
    /// an elastic run the most in `min_workers..=max_workers` that can be placed (the
    /// largest waited for `wait`, smaller ones briefly, the smallest until
    /// [`PLACEMENT_TIMEOUT`]).
    pub(super) async fn reserve(
        &self,
        wait: Duration,
    ) -> Result<(regatta_runtime::PlacementGroup, usize), AttemptError> {
        let strategy = self
            .config
            .strategy
            .parse::<Strategy>()
            .map_err(|e| AttemptError::Fatal(e.to_string()))?;
        let Some(scaling) = self.scaling() else {
            // A fixed-size run: a cluster too small for it is an error at once.
            let world = self.config.world_size;
            let group = self
                .cluster
                .create_placement_group(vec![self.bundle(); world], strategy)
                .await
                .map_err(AttemptError::Cluster)?;
            let mut guard = RemoveOnDrop(Some(group.clone()));
            let ready = group.ready(PLACEMENT_TIMEOUT).await;
            guard.0 = None;
            if let Err(error) = ready {
                let _ = group.remove().await;
                return Err(AttemptError::Cluster(error));
            }
            return Ok((group, world));
        };
        let (min, max) = (scaling.min_workers, scaling.max_workers);
        for world in (min..=max).rev() {
            let patience = if world == min {
                PLACEMENT_TIMEOUT
            } else if world == max {
                wait
            } else {
                Duration::from_secs(2)
            };
            match self.place(world, strategy, patience).await {
                Ok(Some(group)) => return Ok((group, world)),
                Ok(None) if world > min => {}
                Ok(None) => {
                    return Err(AttemptError::Cluster(regatta_runtime::Error::Timeout {
                        what: format!("placing {world} ranks"),
                        timeout: patience,
                    }))
                }
                Err(error) => return Err(AttemptError::Cluster(error)),
            }
        }
        Err(AttemptError::Fatal("no world size to place".into()))
    }

    /// A placement group of `world` bundles once it is placed, waiting up to `patience`
    /// (also while the cluster is too small for it at all: a node may be joining);
    /// `None` when it was not placed in time.
    async fn place(
        &self,
        world: usize,
        strategy: Strategy,
        patience: Duration,
    ) -> Result<Option<regatta_runtime::PlacementGroup>, regatta_runtime::Error> {
        let deadline = Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self
                .cluster
                .create_placement_group(vec![self.bundle(); world], strategy)
                .await
            {
                Ok(group) => {
                    // Removed if this future is dropped while it waits (Ctrl-C in the driver).
                    let mut guard = RemoveOnDrop(Some(group.clone()));
                    let ready = group.ready(left.max(Duration::from_millis(100))).await;
                    guard.0 = None;
                    return match ready {
                        Ok(_) => Ok(Some(group)),
                        Err(_) => {
                            let _ = group.remove().await;
                            Ok(None)
                        }
                    };
                }
                Err(regatta_runtime::Error::Infeasible(_)) if left > Duration::from_secs(1) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(regatta_runtime::Error::Infeasible(_)) => return Ok(None),
                Err(other) => return Err(other),
            }
        }
    }

    /// Whether `extra` more ranks could be placed now (a placement group is created and
    /// removed again).
    pub(super) async fn capacity_for(&self, extra: usize) -> bool {
        let Ok(strategy) = self.config.strategy.parse::<Strategy>() else {
            return false;
        };
        let Ok(probe) = self
            .cluster
            .create_placement_group(vec![self.bundle(); extra], strategy)
            .await
        else {
            return false;
        };
        let mut guard = RemoveOnDrop(Some(probe.clone()));
        let ready = probe.ready(Duration::from_secs(2)).await.is_ok();
        guard.0 = None;
        let _ = probe.remove().await;
        ready
    }
}

/// Removes a placement group (stopping its ranks and their executors) when dropped, from
/// a background task: the driver may be cancelled at any await.
pub(super) struct RemoveOnDrop(pub(super) Option<regatta_runtime::PlacementGroup>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let (Some(group), Ok(runtime)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(async move {
                let _ = group.remove().await;
            });
        }
    }
}
