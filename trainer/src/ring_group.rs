//! A ring of rank actors across the cluster: the rendezvous and CPU collective plumbing the
//! trainer group stands on. The driver reserves one bundle per rank (a placement group),
//! spawns a [`RingRank`] in each, asks every rank for its ring address (rank 0's view of
//! the ring is the list of those addresses), and tells each rank its successor; the ranks
//! then run collectives among themselves (a Unix socket between ranks on one host, TCP with
//! sealed frames between hosts, QUIC as the fallback: [`crate::link`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use regatta_runtime::{
    Actor, ActorContext, ActorError, ActorHandle, ActorOptions, Cluster, PlacementGroup, Resources, Strategy,
};
use serde::{Deserialize, Serialize};

use crate::collective::{Collective, RingCollective};
use crate::link::{LinkOptions, RingLinkBuilder, StreamLink};

/// Constructor arguments of a rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankArgs {
    /// This rank.
    pub rank: usize,
    /// Ranks in the ring.
    pub world: usize,
    /// A secret shared by the ring's ranks only; their TLS identity (TCP and QUIC) derives from it.
    pub secret: String,
}

/// What a rank does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum RankOp {
    /// Open this rank's ring endpoints; replies with its ring address.
    Bind,
    /// Connect to the next rank at this address (all ranks at once).
    Connect(String),
    /// Sum a buffer over the ring; replies with the sum.
    AllReduce(Vec<f32>),
}

/// What a rank replies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RankReply {
    /// The rank's ring address.
    Bound(String),
    /// Connected.
    Connected,
    /// A reduced buffer.
    Reduced(Vec<f32>),
}

/// One rank of a ring.
pub struct RingRank {
    args: RankArgs,
    builder: Option<RingLinkBuilder>,
    ring: Option<Arc<Mutex<RingCollective<StreamLink>>>>,
}

impl Actor for RingRank {
    const KIND: &'static str = "ring-rank";
    type Args = RankArgs;
    type Request = RankOp;
    type Reply = RankReply;

    async fn create(args: RankArgs, _ctx: &ActorContext) -> Result<Self, ActorError> {
        if args.world == 0 || args.rank >= args.world {
            return Err(format!("rank {} does not fit a ring of {}", args.rank, args.world).into());
        }
        Ok(Self {
            args,
            builder: None,
            ring: None,
        })
    }

    async fn handle(&mut self, op: RankOp, ctx: &ActorContext) -> Result<RankReply, ActorError> {
        match op {
            RankOp::Bind => {
                let bind = format!("{}:0", ctx.host())
                    .parse()
                    .map_err(|e| format!("bad host {}: {e}", ctx.host()))?;
                let builder = RingLinkBuilder::bind(bind, &self.args.secret, LinkOptions::from_env())?;
                let address = builder.address()?.to_string();
                self.builder = Some(builder);
                Ok(RankReply::Bound(address))
            }
            RankOp::Connect(next) => {
                let builder = self.builder.take().ok_or("Bind the rank before connecting it")?;
                let link = builder.connect(&next).await?;
                let ring = RingCollective::new(self.args.rank, self.args.world, link);
                self.ring = Some(Arc::new(Mutex::new(ring)));
                Ok(RankReply::Connected)
            }
            RankOp::AllReduce(mut buffer) => {
                let ring = self.ring.clone().ok_or("the ring is not connected")?;
                // The ring blocks while it waits for its neighbours: off the async threads.
                let reduced = tokio::task::spawn_blocking(move || {
                    let mut ring = ring.lock().map_err(|_| "the ring lock was poisoned".to_string())?;
                    ring.all_reduce(&mut buffer).map_err(|e| e.to_string())?;
                    Ok::<_, String>(buffer)
                })
                .await
                .map_err(|e| format!("the collective thread failed: {e}"))??;
                Ok(RankReply::Reduced(reduced))
            }
        }
    }
}

/// A formed ring: its placement group and its rank actors, in rank order.
pub struct RingGroup {
    group: PlacementGroup,
    ranks: Vec<ActorHandle<RingRank>>,
}

impl RingGroup {
    /// Reserves `world` bundles of `per_rank` resources with `strategy`, spawns a rank in each
    /// and connects them into a ring.
    pub async fn form(
        cluster: &Cluster,
        world: usize,
        per_rank: Resources,
        strategy: Strategy,
        timeout: Duration,
    ) -> regatta_runtime::Result<Self> {
        let group = cluster
            .create_placement_group(vec![per_rank.clone(); world], strategy)
            .await?;
        group.ready(timeout).await?;
        let secret = crate::group::random_secret().map_err(|e| regatta_runtime::Error::Rejected(e.to_string()))?;
        let mut ranks = Vec::with_capacity(world);
        for rank in 0..world {
            let options = ActorOptions::new()
                .resources(per_rank.clone())
                .in_group(&group, Some(rank));
            let args = RankArgs {
                rank,
                world,
                secret: secret.clone(),
            };
            ranks.push(cluster.spawn::<RingRank>(args, options).await?);
        }
        let mut addresses = Vec::with_capacity(world);
        for rank in &ranks {
            match rank.call_timeout(RankOp::Bind, timeout).await? {
                RankReply::Bound(address) => addresses.push(address),
                other => return Err(unexpected(other)),
            }
        }
        let connects = ranks
            .iter()
            .enumerate()
            .map(|(i, rank)| rank.call_timeout(RankOp::Connect(addresses[(i + 1) % world].clone()), timeout));
        futures::future::try_join_all(connects).await?;
        Ok(Self { group, ranks })
    }

    /// The rank actors, in rank order.
    pub fn ranks(&self) -> &[ActorHandle<RingRank>] {
        &self.ranks
    }

    /// Runs an all-reduce with one input per rank; returns each rank's result.
    pub async fn all_reduce(&self, inputs: Vec<Vec<f32>>, timeout: Duration) -> regatta_runtime::Result<Vec<Vec<f32>>> {
        let calls = self
            .ranks
            .iter()
            .zip(inputs)
            .map(|(rank, input)| rank.call_timeout(RankOp::AllReduce(input), timeout));
        futures::future::try_join_all(calls)
            .await?
            .into_iter()
            .map(|reply| match reply {
                RankReply::Reduced(values) => Ok(values),
                other => Err(unexpected(other)),
            })
            .collect()
    }

    /// Removes the ring's placement group, which stops its ranks.
    pub async fn remove(&self) -> regatta_runtime::Result<()> {
        self.group.remove().await
    }
}

fn unexpected(reply: RankReply) -> regatta_runtime::Error {
    regatta_runtime::Error::Rejected(format!("a rank replied {reply:?} out of turn"))
}
