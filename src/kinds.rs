//! Actor kinds compiled into the stock `regatta` worker: small, real actors used by the
//! demo, the examples and the tests.

use serde::{Deserialize, Serialize};

use bytes::Bytes;
use regatta_runtime::{Actor, ActorContext, ActorError, ActorId, ObjectRef, ObjectStats, Registry};

/// The registry of the stock worker binary.
pub fn builtin() -> Registry {
    Registry::new()
        .register::<Echo>()
        .register::<Counter>()
        .register::<Store>()
        .register::<Noop>()
        .register::<SlowStart>()
        .register::<Caller>()
        .register::<Rendezvous>()
        .register::<regatta_trainer::RingRank>()
        .register::<regatta_trainer::TrainRank>()
        .register::<regatta_scorer::ScorerActor>()
}

/// Deterministic test bytes: `size` bytes from `seed`, fast to make for multi-GB objects.
pub fn pattern(size: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; size];
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in out.chunks_mut(8) {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
    out
}

/// A 128-bit digest of bytes, to compare objects without moving them.
pub fn digest(bytes: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(bytes)
}

/// Puts and gets objects from inside the cluster: the object store's test and benchmark
/// workhorse.
pub struct Store {
    kept: Vec<ObjectRef<Bytes>>,
}

/// What a [`Store`] does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum StoreOp {
    /// Put `size` pattern bytes made from `seed`; keep a reference here if `keep`.
    Put {
        /// Bytes.
        size: u64,
        /// Pattern seed.
        seed: u64,
        /// Hold the reference in this actor.
        keep: bool,
    },
    /// Get an object and digest it.
    Get(ObjectRef<Bytes>),
    /// Get an object `count` times concurrently; all copies must digest the same.
    GetMany(ObjectRef<Bytes>, usize),
    /// Get an object without digesting it; replies with the time the get took.
    Fetch(ObjectRef<Bytes>),
    /// Drop every reference this actor holds.
    DropAll,
    /// This node's object store figures.
    Stats,
}

/// What a [`Store`] replies.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum StoreReply {
    /// A new object.
    Put {
        /// Its reference.
        reference: ObjectRef<Bytes>,
        /// Its digest.
        digest: u128,
    },
    /// An object read back.
    Got {
        /// Its length.
        len: u64,
        /// Its digest.
        digest: u128,
    },
    /// A timed get.
    Fetched {
        /// Bytes read.
        len: u64,
        /// Nanoseconds the get took.
        nanos: u64,
    },
    /// Figures.
    Stats(ObjectStats),
    /// Done.
    Done,
}

impl Actor for Store {
    const KIND: &'static str = "store";
    type Args = ();
    type Request = StoreOp;
    type Reply = StoreReply;

    async fn create(_: (), _ctx: &ActorContext) -> Result<Self, ActorError> {
        Ok(Self { kept: Vec::new() })
    }

    async fn handle(&mut self, op: StoreOp, ctx: &ActorContext) -> Result<StoreReply, ActorError> {
        let cluster = ctx.cluster();
        match op {
            StoreOp::Put { size, seed, keep } => {
                let size = usize::try_from(size)?;
                let bytes = pattern(size, seed);
                let digest = digest(&bytes);
                let reference = cluster.put_bytes(bytes).await?;
                if keep {
                    self.kept.push(reference.clone());
                }
                Ok(StoreReply::Put { reference, digest })
            }
            StoreOp::Get(reference) => {
                let bytes = cluster.get_bytes(&reference).await?;
                Ok(StoreReply::Got {
                    len: bytes.len() as u64,
                    digest: digest(&bytes),
                })
            }
            StoreOp::GetMany(reference, count) => {
                let gets = (0..count).map(|_| cluster.get_bytes(&reference));
                let all = futures::future::try_join_all(gets).await?;
                let first = digest(&all[0]);
                if all.iter().any(|b| digest(b) != first) {
                    return Err("concurrent gets returned different bytes".into());
                }
                Ok(StoreReply::Got {
                    len: all[0].len() as u64,
                    digest: first,
                })
            }
            StoreOp::Fetch(reference) => {
                cluster.adopt(&reference).await?;
                let started = std::time::Instant::now();
                let bytes = cluster.get_bytes(&reference).await?;
                let nanos = started.elapsed().as_nanos() as u64;
                Ok(StoreReply::Fetched {
                    len: bytes.len() as u64,
                    nanos,
                })
            }
            StoreOp::DropAll => {
                self.kept.clear();
                Ok(StoreReply::Done)
            }
            StoreOp::Stats => Ok(StoreReply::Stats(cluster.object_stats()?)),
        }
    }
}

/// An actor whose calls run beside each other (up to `n`): each call waits, up to the
/// number of seconds it carries, until `n` calls are inside at once, and answers whether
/// they were. Calls handled one after another can never all answer true.
pub struct Rendezvous {
    barrier: std::sync::Arc<tokio::sync::Barrier>,
    n: usize,
}

impl Actor for Rendezvous {
    const KIND: &'static str = "rendezvous";
    type Args = usize;
    type Request = u64;
    type Reply = bool;

    async fn create(n: usize, _ctx: &ActorContext) -> Result<Self, ActorError> {
        if n == 0 {
            return Err("a rendezvous of 0 calls".into());
        }
        Ok(Self {
            barrier: std::sync::Arc::new(tokio::sync::Barrier::new(n)),
            n,
        })
    }

    async fn handle(&mut self, _seconds: u64, _ctx: &ActorContext) -> Result<bool, ActorError> {
        // Alone: a rendezvous of one is met at once, of more never.
        Ok(self.n == 1)
    }

    fn max_concurrency(&self) -> usize {
        self.n
    }

    fn handle_concurrently(
        &self,
        seconds: u64,
        _ctx: &ActorContext,
    ) -> Option<futures::future::BoxFuture<'static, Result<bool, ActorError>>> {
        let barrier = self.barrier.clone();
        Some(Box::pin(async move {
            Ok(
                tokio::time::timeout(std::time::Duration::from_secs(seconds), barrier.wait())
                    .await
                    .is_ok(),
            )
        }))
    }
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

    async fn create(prefix: String, ctx: &ActorContext) -> Result<Self, ActorError> {
        ctx.log(format!("echo ready, prefix {prefix:?}"));
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
                ctx.cluster()
                    .handle::<Counter>(peer)
                    .cast(CounterOp::Add(amount))
                    .await?;
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

/// Does nothing with its argument: the benchmarks' trivial actor.
pub struct Noop;

impl Actor for Noop {
    const KIND: &'static str = "noop";
    type Args = ();
    type Request = Vec<u8>;
    type Reply = u32;

    async fn create(_: (), _ctx: &ActorContext) -> Result<Self, ActorError> {
        Ok(Noop)
    }

    async fn handle(&mut self, arg: Vec<u8>, _ctx: &ActorContext) -> Result<u32, ActorError> {
        Ok(arg.len() as u32)
    }
}

/// An actor whose constructor takes the given milliseconds: for tests of what happens to
/// an actor while it starts.
pub struct SlowStart;

impl Actor for SlowStart {
    const KIND: &'static str = "slow-start";
    type Args = u64;
    type Request = ();
    type Reply = ();

    async fn create(ms: u64, _ctx: &ActorContext) -> Result<Self, ActorError> {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        Ok(SlowStart)
    }

    async fn handle(&mut self, _: (), _ctx: &ActorContext) -> Result<(), ActorError> {
        Ok(())
    }
}

/// Calls other actors from inside the cluster: the n:n benchmarks' client side.
pub struct Caller;

/// A burst of calls for a [`Caller`] to make.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Fanout {
    /// The [`Noop`] actors to call.
    pub targets: Vec<ActorId>,
    /// Calls to each target, all in flight together.
    pub calls_per_target: u32,
    /// Bytes of argument per call.
    pub arg_bytes: usize,
}

impl Actor for Caller {
    const KIND: &'static str = "caller";
    type Args = ();
    type Request = Fanout;
    type Reply = u64;

    async fn create(_: (), _ctx: &ActorContext) -> Result<Self, ActorError> {
        Ok(Caller)
    }

    async fn handle(&mut self, fanout: Fanout, ctx: &ActorContext) -> Result<u64, ActorError> {
        let arg = vec![1u8; fanout.arg_bytes];
        let handles: Vec<_> = fanout
            .targets
            .iter()
            .map(|id| ctx.cluster().handle::<Noop>(*id))
            .collect();
        let calls = handles
            .iter()
            .flat_map(|h| (0..fanout.calls_per_target).map(move |_| h))
            .map(|h| h.call(arg.clone()));
        let done = futures::future::try_join_all(calls).await?;
        Ok(done.len() as u64)
    }
}
