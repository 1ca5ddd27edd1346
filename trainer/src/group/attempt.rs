//! One attempt of a run on a placed group: spawn a rank actor in each bundle, bind them
//! (each rank's ring address, the start step they agree on), hand every rank its
//! successor's address, then watch; how a failure counts ([`AttemptError`]: a lost rank
//! is worth a restart, a fault in the run's own inputs is not).

use std::time::Duration;

use regatta_runtime::{ActorHandle, ActorOptions};

use super::placement::{RemoveOnDrop, PLACEMENT_TIMEOUT};
use super::{TrainEvent, TrainSummary, TrainerGroup};
use crate::config::TrainConfig;
use crate::protocol::{Binding, RankSetup, TrainOp, TrainReply};
use crate::rank::{TrainRank, TrainRankArgs};

pub(super) use super::outcome::AttemptError;

impl TrainerGroup {
    pub(super) async fn attempt(
        &self,
        attempt: u32,
        group: regatta_runtime::PlacementGroup,
        world: usize,
        resume: bool,
        summary: &mut TrainSummary,
        on_event: &mut impl FnMut(&TrainEvent),
    ) -> Result<(), AttemptError> {
        // Removes the group even when this future is dropped (Ctrl-C in the driver).
        let mut guard = RemoveOnDrop(Some(group.clone()));
        let config = match self.config.rescale(world) {
            Ok(config) => config,
            Err(e) => {
                let _ = group.remove().await;
                guard.0 = None;
                return Err(AttemptError::Fatal(e.to_string()));
            }
        };
        let result = async {
            let nodes = group.ready(PLACEMENT_TIMEOUT).await.map_err(AttemptError::Cluster)?;
            let ranks = self
                .spawn_ranks(&group, &config, world, resume, summary.rescales)
                .await?;
            let (addresses, params, start_step, device, nccl_id) = bind_all(&ranks).await?;
            summary.params = params;
            on_event(&TrainEvent::Started {
                attempt,
                start_step,
                params,
                nodes,
                device,
                world,
            });
            connect_ring(&ranks, &addresses, &nccl_id).await?;
            self.watch(&ranks, summary, on_event).await
        }
        .await;
        // Removing the group stops every rank actor, which kills its executor.
        let _ = group.remove().await;
        guard.0 = None;
        result
    }

    /// A rank actor in each of the group's `world` bundles, all sharing one fresh ring
    /// secret and this attempt's time stamp.
    async fn spawn_ranks(
        &self,
        group: &regatta_runtime::PlacementGroup,
        config: &TrainConfig,
        world: usize,
        resume: bool,
        rescales: u32,
    ) -> Result<Vec<ActorHandle<TrainRank>>, AttemptError> {
        let per_rank = self.bundle();
        let secret = random_secret().map_err(|e| AttemptError::Fatal(e.to_string()))?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut ranks = Vec::with_capacity(world);
        for rank in 0..world {
            let args = TrainRankArgs {
                setup: RankSetup {
                    rank,
                    world,
                    host: String::new(),
                    config: config.clone(),
                    resume,
                    gpus: Vec::new(),
                    rescales,
                    attempt: stamp,
                },
                secret: secret.clone(),
                executor: self.executor.clone(),
            };
            let options = ActorOptions::new()
                .resources(per_rank.clone())
                .in_group(group, Some(rank));
            let handle = self
                .cluster
                .spawn::<TrainRank>(args, options)
                .await
                .map_err(|e| classify(rank, e))?;
            ranks.push(handle);
        }
        Ok(ranks)
    }
}

type Bound = (Vec<String>, u64, u64, String, Option<String>);

async fn bind_all(ranks: &[ActorHandle<TrainRank>]) -> Result<Bound, AttemptError> {
    let binds = ranks.iter().enumerate().map(|(rank, handle)| async move {
        handle
            .call_timeout(TrainOp::Bind, Duration::from_secs(330))
            .await
            .map_err(|e| classify(rank, e))
    });
    let mut addresses = Vec::with_capacity(ranks.len());
    let mut first = None;
    let mut starts = Vec::new();
    for (rank, reply) in futures::future::try_join_all(binds).await?.into_iter().enumerate() {
        if let TrainReply::Failed { reason, fatal } = reply {
            return Err(if fatal {
                AttemptError::Fatal(reason)
            } else {
                AttemptError::Lost { rank, reason }
            });
        }
        let TrainReply::Bound(Binding {
            addr,
            params,
            start_step,
            device,
            nccl_id,
        }) = reply
        else {
            return Err(AttemptError::Fatal("a rank replied out of turn".into()));
        };
        addresses.push(addr);
        starts.push(start_step);
        first.get_or_insert((params, start_step, device, nccl_id));
    }
    let (params, start_step, device, nccl_id) =
        first.ok_or_else(|| AttemptError::Fatal("a group of no ranks".into()))?;
    if starts.iter().any(|s| *s != start_step) {
        return Err(AttemptError::Fatal(format!(
            "the ranks loaded checkpoints of different steps: {starts:?}"
        )));
    }
    Ok((addresses, params, start_step, device, nccl_id))
}

/// Hands every rank its successor's ring address (and rank 0's NCCL id), all at once:
/// each rank connects to the next while accepting the previous one.
async fn connect_ring(
    ranks: &[ActorHandle<TrainRank>],
    addresses: &[String],
    nccl_id: &Option<String>,
) -> Result<(), AttemptError> {
    let world = ranks.len();
    let connects = ranks.iter().enumerate().map(|(i, rank)| async move {
        let op = TrainOp::Connect(addresses[(i + 1) % world].clone(), nccl_id.clone());
        rank.call_timeout(op, PLACEMENT_TIMEOUT)
            .await
            .map_err(|e| AttemptError::Lost {
                rank: i,
                reason: e.to_string(),
            })
    });
    futures::future::try_join_all(connects).await?;
    Ok(())
}

/// A spawn or bind failure is fatal when the cause is in the run's own inputs (a missing
/// executor, bad data, a bad checkpoint); a lost node or a crashed executor is worth a
/// restart.
fn classify(rank: usize, error: regatta_runtime::Error) -> AttemptError {
    use regatta_runtime::Error;
    let text = error.to_string();
    let lost = match &error {
        Error::ActorDead { cause, .. } => cause.node_lost(),
        Error::CallFailed { .. } | Error::Timeout { .. } => true,
        Error::Remote { .. } => true,
        _ => false,
    };
    if lost {
        AttemptError::Lost { rank, reason: text }
    } else {
        AttemptError::Fatal(format!("rank {rank}: {text}"))
    }
}

/// 256 random bits from the OS, hex-encoded: the ring's TLS identity derives from it.
pub(crate) fn random_secret() -> crate::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).map_err(|e| crate::Error::Secret(e.to_string()))?;
    Ok(crate::hex::encode(&bytes))
}
