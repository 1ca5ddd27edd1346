//! Actor kinds compiled into the stock `regatta` worker: small, real actors used by the
//! demo, the examples and the tests.

use serde::{Deserialize, Serialize};

use regatta_runtime::{Actor, ActorContext, ActorError, ActorId, Registry};

/// The registry of the stock worker binary.
pub fn builtin() -> Registry {
    Registry::new().register::<Echo>().register::<Counter>()
}

/// Where an actor runs, as it sees it from its context.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The actor.
    pub actor: ActorId,
    /// Its node.
    pub node: String,
    /// GPU indices granted.
    pub gpu_ids: Vec<u32>,
}

/// Echoes text back and says where it runs.
pub struct Echo {
    prefix: String,
}

/// What an [`Echo`] replies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EchoReply {
    /// The prefix followed by the request.
    pub text: String,
    /// Where the actor runs.
    pub placement: Placement,
}

impl Actor for Echo {
    const KIND: &'static str = "echo";
    type Args = String;
    type Request = String;
    type Reply = EchoReply;

    async fn create(prefix: String, _ctx: &ActorContext) -> Result<Self, ActorError> {
        Ok(Self { prefix })
    }

    async fn handle(&mut self, text: String, ctx: &ActorContext) -> Result<EchoReply, ActorError> {
        Ok(EchoReply {
            text: format!("{}{text}", self.prefix),
            placement: placement_of(ctx),
        })
    }
}

fn placement_of(ctx: &ActorContext) -> Placement {
    Placement {
        actor: ctx.id(),
        node: ctx.node().to_string(),
        gpu_ids: ctx.gpu_ids().to_vec(),
    }
}

/// A counter that can also call other counters, anywhere in the cluster.
pub struct Counter {
    total: i64,
}

/// What a [`Counter`] does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CounterOp {
    /// Add and return the new total.
    Add(i64),
    /// Return the total.
    Get,
    /// Add to another counter (by id) and return its new total: an actor-to-actor call.
    AddToPeer {
        /// The other counter.
        peer: ActorId,
        /// How much.
        amount: i64,
    },
    /// Cast `amount` to another counter without waiting.
    CastToPeer {
        /// The other counter.
        peer: ActorId,
        /// How much.
        amount: i64,
    },
    /// Return an error from the handler (the actor lives on).
    Fail(String),
    /// Panic inside the handler (the actor dies and restarts within its budget).
    Crash,
    /// Report where the actor runs.
    Where,
    /// Sleep this many milliseconds, then return the total (a slow call).
    Sleep(u64),
}

/// What a [`Counter`] replies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CounterReply {
    /// A total.
    Total(i64),
    /// A placement.
    Placement(Placement),
}

impl Actor for Counter {
    const KIND: &'static str = "counter";
    type Args = i64;
    type Request = CounterOp;
    type Reply = CounterReply;

    async fn create(start: i64, _ctx: &ActorContext) -> Result<Self, ActorError> {
        if start < 0 {
            return Err(format!("a counter cannot start below zero (got {start})").into());
        }
        Ok(Self { total: start })
    }

    async fn handle(&mut self, op: CounterOp, ctx: &ActorContext) -> Result<CounterReply, ActorError> {
        match op {
            CounterOp::Add(n) => {
                self.total += n;
                Ok(CounterReply::Total(self.total))
            }
            CounterOp::Get => Ok(CounterReply::Total(self.total)),
            CounterOp::AddToPeer { peer, amount } => {
                let peer = ctx.cluster().handle::<Counter>(peer);
                Ok(peer.call(CounterOp::Add(amount)).await?)
            }
            CounterOp::CastToPeer { peer, amount } => {
                ctx.cluster().handle::<Counter>(peer).cast(CounterOp::Add(amount)).await?;
                Ok(CounterReply::Total(self.total))
            }
            CounterOp::Fail(message) => Err(message.into()),
            CounterOp::Crash => panic!("counter {} was asked to crash", ctx.id()),
            CounterOp::Where => Ok(CounterReply::Placement(placement_of(ctx))),
            CounterOp::Sleep(ms) => {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                Ok(CounterReply::Total(self.total))
            }
        }
    }
}
