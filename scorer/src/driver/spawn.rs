//! The run's scorer actors: spawned against the configured resources under a name prefix
//! of the output location, each waited for until its model is loaded, and those an earlier
//! driver of the same output left stopped.

use std::time::Duration;

use regatta_runtime::{ActorHandle, ActorOptions, Resources};

use super::{ScoreConfig, ScoreRun};
use crate::actor::{ScorerActor, ScorerArgs};
use crate::error::{Error, Result};
use crate::protocol::ScorerSetup;

/// How long spawning one scorer actor (placing it and loading its model) may take.
const SPAWN_TIMEOUT: Duration = Duration::from_secs(120);

fn actor_options(config: &ScoreConfig) -> ActorOptions {
    let resources = Resources::from_units(config.resources.iter().map(|(k, v)| (k.as_str(), *v)));
    // The driver replaces a dead actor itself (and retries its partition elsewhere).
    ActorOptions::new().resources(resources).max_restarts(0)
}

impl ScoreRun {
    /// The name prefix of this run's actors: a hash of the output location, so a driver
    /// started again on the same output finds the actors an earlier, killed driver left.
    fn actor_prefix(&self) -> String {
        let hash = self.config.output.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        format!("scorer-{hash:016x}-")
    }

    /// Stops actors an earlier driver of the same output left running (a driver killed
    /// with SIGKILL cannot stop its own), so their resources are free again.
    pub(super) async fn stop_leftovers(&self) -> Result<usize> {
        let prefix = self.actor_prefix();
        let status = self.cluster.status().await?;
        let mut stopped = 0;
        for line in status.actors {
            let alive = matches!(line.view.state, regatta_runtime::ActorState::Alive);
            if alive && line.name.as_deref().is_some_and(|n| n.starts_with(&prefix)) {
                let _ = self.cluster.kill(line.view.id).await;
                stopped += 1;
            }
        }
        Ok(stopped)
    }

    pub(super) async fn spawn_actor(&self) -> Result<ActorHandle<ScorerActor>> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let serial = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{}{}-{serial}", self.actor_prefix(), std::process::id());
        let args = ScorerArgs {
            setup: ScorerSetup {
                checkpoint: self.config.model.clone(),
                adapter: self.config.adapter.clone(),
                adapter_base: self.config.adapter_base,
                double_quant: self.config.double_quant,
                context: self.config.context,
                tokenizer: self.config.tokenizer.clone(),
                device: self.config.device.clone(),
                threads: self.config.threads,
                max_new_tokens: if self.config.generate {
                    0
                } else {
                    self.config.max_new_tokens
                },
                gpus: Vec::new(),
                generation: self.config.generate.then(|| self.config.generation_setup()),
            },
            sampling: self.config.generate.then(|| self.config.sampling()),
            batch_size: self.config.batch_size,
            executor: self.executor.clone(),
        };
        // A spawn placed on a node that dies before the head notices can wait forever:
        // give up after a while (an actor that appears later carries this run's name
        // prefix and is stopped at the end of the run).
        // Waits until the actor has loaded its model, so no partition is ever handed to an
        // actor that will not start (placed on a node that is dying, say).
        let spawn = async {
            let handle = self
                .cluster
                .spawn::<ScorerActor>(args, actor_options(&self.config).name(name))
                .await?;
            handle.wait_ready(SPAWN_TIMEOUT).await?;
            Ok(handle)
        };
        match tokio::time::timeout(SPAWN_TIMEOUT + Duration::from_secs(30), spawn).await {
            Ok(spawned) => spawned,
            Err(_) => Err(Error::Run(format!(
                "a scorer actor was not ready within {SPAWN_TIMEOUT:?}"
            ))),
        }
    }

    /// `count` new actors, each with its model loaded.
    pub(super) async fn spawn_actors(&self, count: usize) -> Result<Vec<ActorHandle<ScorerActor>>> {
        let mut actors = Vec::with_capacity(count);
        for _ in 0..count {
            actors.push(self.spawn_actor().await?);
        }
        Ok(actors)
    }
}
