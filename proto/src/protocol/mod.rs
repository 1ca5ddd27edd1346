//! What crosses the wire between the head, node agents, actor hosts and clients.
//!
//! Every remote actor in Regatta receives `Wire` envelopes whose payload is one
//! of these types encoded with bincode; replies are `Result<T, Failure>` encoded the same way.

use serde::{Deserialize, Serialize};

pub mod actor;
pub mod ids;
pub mod status;

pub use actor::{ActorState, ActorView, DeathCause, Loss, StartFailure};
pub use ids::{ActorId, BundleRef, GroupId, RESTART_FOREVER};
pub use status::{ActorLine, ClusterStatus, GroupStatus, NodeStatus, PendingLine};

use crate::object::ObjectId;

use crate::placement::Strategy;
use crate::resources::Resources;

/// Everything the head needs to place and (re)start an actor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorSpec {
    /// The registered kind name.
    pub kind: String,
    /// Constructor arguments, encoded by the kind's `Args` type.
    pub args: Vec<u8>,
    /// Resources the actor holds while it lives.
    pub resources: Resources,
    /// Optional cluster-unique name for lookups.
    pub name: Option<String>,
    /// How many times the actor is restarted after its node or process dies.
    pub max_restarts: u32,
    /// Optional placement group bundle.
    pub placement: Option<BundleRef>,
    /// The job that spawned it (its actors die when the job ends).
    #[serde(default)]
    pub job: Option<String>,
}

/// A placement group request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSpec {
    /// One resource set per bundle.
    pub bundles: Vec<Resources>,
    /// How bundles spread over nodes.
    pub strategy: Strategy,
    /// Optional name shown in status.
    pub name: Option<String>,
}

/// What a worker tells the head when it joins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's name, unique in the cluster.
    pub name: String,
    /// `host:port` of its cluster listener.
    pub address: String,
    /// Its resources.
    pub resources: Resources,
    /// Actor kinds its registry can construct.
    pub kinds: Vec<String>,
    /// Its process id, for operators.
    pub pid: u32,
    /// `host:port` of its `/metrics` endpoint, if it serves one.
    #[serde(default)]
    pub metrics_address: Option<String>,
}

/// An actor a worker runs (or is starting) when it registers, so that a head that
/// restarted, or that lost the node for a while, can take it back instead of having it
/// stopped and started again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RunningActor {
    /// The actor.
    pub actor: ActorId,
    /// The start attempt it runs as.
    pub attempt: u32,
    /// Whether its constructor has finished (false: still starting).
    pub up: bool,
}

/// An object copy a worker holds in memory, reported when it registers so that a head
/// that restarted (or lost the node for a while) knows where the object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldObject {
    /// The object.
    pub id: ObjectId,
    /// Its size in bytes.
    pub size: u64,
    /// Its CRC-32.
    pub checksum: u32,
    /// Whether the worker's process references it.
    pub referenced: bool,
}

/// The head's answer to [`HeadRequest::Register`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The node's incarnation, which its heartbeats carry.
    pub incarnation: u64,
    /// Reported actors the head does not want running there (killed while the head could
    /// not say so, restarted elsewhere, or unknown to it): the worker stops them.
    pub stop: Vec<ActorId>,
}

/// Why a request failed, as sent back over the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Failure {
    /// No node could ever satisfy it.
    Infeasible(String),
    /// No alive node registers this kind.
    UnknownKind {
        /// The kind asked for.
        kind: String,
        /// Which kinds exist.
        detail: String,
    },
    /// The request was refused.
    Rejected(String),
    /// The actor is dead.
    Dead {
        /// Its kind.
        kind: String,
        /// Why.
        cause: DeathCause,
    },
    /// The handler returned an error.
    Handler(String),
    /// The message did not decode as what the receiver expects.
    BadMessage(String),
    /// The object is unknown (never put, or freed) or lost with its node.
    ObjectMissing {
        /// The object.
        id: ObjectId,
        /// The node whose loss took the last copy, if it was lost.
        lost_with: Option<String>,
    },
    /// The call reached the actor but will get no reply: the actor stopped or panicked
    /// before answering it (whether it will be restarted, the head knows).
    Lost(String),
    /// A call reached a node that does not host the actor (it died, or was restarted
    /// elsewhere since the caller looked it up): ask the head where it is now.
    NotHosted {
        /// The actor.
        actor: ActorId,
        /// The node that answered.
        node: String,
    },
}

/// The head's answer to a heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beat {
    /// Whether the head knows the node as registered (false: register again).
    pub known: bool,
    /// Every node removed from the cluster, when the node knows of fewer; its TLS
    /// listeners refuse their certificates from then on.
    pub removed: Option<Vec<String>>,
    /// The node trusts other authorities than the head does (a rotation started or
    /// finished): it should renew its certificate now, which brings the head's.
    pub renew: bool,
}

/// Requests the head answers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum HeadRequest {
    /// A worker joins or rejoins, with the actors it runs now (empty for a new process):
    /// replies [`Registration`].
    Register(NodeInfo, Vec<RunningActor>),
    /// A worker that just registered lists the object copies it holds in memory: the
    /// directory takes its word for them (copies it no longer has are no longer sources,
    /// copies the directory did not know are added). Replies `()`.
    ObjectsHeld {
        /// The node.
        node: String,
        /// Its object transfer address.
        address: String,
        /// What it holds.
        objects: Vec<HeldObject>,
    },
    /// A worker is alive: replies [`Beat`].
    Heartbeat {
        /// The node.
        node: String,
        /// The incarnation it registered as.
        incarnation: u64,
        /// How many removed nodes it knows of: the answer names them all when the head
        /// knows of more (removals are for good, so the count tells).
        removed_known: usize,
        /// The fingerprint of the authorities it trusts (`regatta_net`'s
        /// `TrustSlot::fingerprint`): the answer asks for a renewal when the head's differs.
        trust: u64,
    },
    /// Spawn an actor: replies [`ActorId`] once accepted (placement may still wait).
    Spawn(ActorSpec),
    /// Wait until the actor is alive or dead: replies [`ActorView`].
    WaitActor(ActorId),
    /// Look up a named actor: replies `Option<ActorView>`.
    Named(String),
    /// Kill an actor without restart: replies `()`.
    Kill(ActorId),
    /// Reserve a placement group: replies [`GroupId`] once accepted.
    CreateGroup(GroupSpec),
    /// Wait until the group is placed: replies `Vec<String>` (node per bundle).
    WaitGroup(GroupId),
    /// Remove a group and kill its actors: replies `()`.
    RemoveGroup(GroupId),
    /// The whole cluster's state: replies [`ClusterStatus`].
    Status,
    /// The cluster's state a page of actors at a time, for readers of large clusters (one
    /// whole status of 100,000 actors is about 9 MB, and a session's frames stop at 16 MiB):
    /// replies [`ClusterStatus`] with at most `limit` actors of ids above `after`, in id
    /// order; nodes, groups, pending requests and objects only when `after` is `None`.
    StatusPage {
        /// The last actor id of the previous page.
        after: Option<ActorId>,
        /// Actors in this page.
        limit: u32,
    },
    /// From an agent: a start attempt finished: replies `()`.
    Started {
        /// The actor.
        actor: ActorId,
        /// The attempt number from [`StartActor`].
        attempt: u32,
        /// `Err` when the actor could not be started.
        outcome: Result<(), StartFailure>,
    },
    /// A new object: replies `()`.
    ObjectPut {
        /// The object.
        id: ObjectId,
        /// Size in bytes.
        size: u64,
        /// CRC-32 of the bytes.
        checksum: u32,
        /// The node (process) holding it and referencing it.
        node: String,
        /// Its object transfer address (TCP).
        address: String,
        /// The job that put it (freed when the job ends).
        job: Option<String>,
    },
    /// Where to read an object: replies [`crate::object::Location`].
    ObjectLocate(ObjectId),
    /// A node now holds a copy in memory: no reply.
    ObjectAddSource {
        /// The object.
        id: ObjectId,
        /// The node.
        node: String,
        /// Its transfer address.
        address: String,
    },
    /// A node dropped its copy; `spilled_to` is set when it wrote one first: no reply.
    ObjectRemoveSource {
        /// The object.
        id: ObjectId,
        /// The node.
        node: String,
        /// URL of the spilled copy it wrote.
        spilled_to: Option<String>,
    },
    /// A process references an object: replies `()`, or the object is missing.
    ObjectAddRef {
        /// The object.
        id: ObjectId,
        /// The referencing process.
        holder: String,
    },
    /// A process dropped its last reference: no reply.
    ObjectDropRef {
        /// The object.
        id: ObjectId,
        /// The process.
        holder: String,
    },
    /// Free an object everywhere now: replies `()`.
    ObjectFree(ObjectId),
    /// A client process disconnected: drop what it held (sent by the head to itself).
    HolderGone(String),
    /// A job ended: kill its actors and free its objects: replies `()`.
    EndJob(String),
    /// From an agent: a running actor stopped on its own: replies `()`.
    Exited {
        /// The actor.
        actor: ActorId,
        /// The attempt number it was started with.
        attempt: u32,
        /// Why it stopped.
        cause: Loss,
    },
    /// From the head's shell to its core: a start could not be delivered because the
    /// node's agent is not reachable (no session to it). The node is lost; the actor waits
    /// again without spending a restart, since it never ran there. Replies `()`.
    Undelivered {
        /// The actor.
        actor: ActorId,
        /// The attempt number of the start.
        attempt: u32,
        /// Why it could not be delivered.
        cause: String,
    },
    /// From a process that cannot see a live actor in its process-group mirror: have the
    /// actor's agent advertise it again: replies `()`.
    Announce(ActorId),
    /// A paged view of the cluster for the dashboard and scripts: replies [`crate::View`].
    View(crate::view::ViewQuery),
    /// From a training or scoring driver: a point of its run: replies `()` (usually cast).
    RunReport(crate::runs::RunPoint),
    /// Where `node` (its transfer endpoint at `address`) should pull an object from now:
    /// replies [`crate::object::Location`] with the chosen holder first, once one has room
    /// in its share of a broadcast ([`crate::object::Fanout`]). Last in the enum so that
    /// the indices of the requests a head logs stay as they were.
    ObjectPull {
        /// The object.
        id: ObjectId,
        /// The pulling node (process).
        node: String,
        /// Its transfer address, whose host tells same-host pulls apart.
        address: String,
    },
    /// `node`'s pull of an object ended without a copy kept there (it failed, was given up,
    /// or the copy did not fit): its holder's share is free. No reply.
    ObjectPullEnded {
        /// The object.
        id: ObjectId,
        /// The pulling node (process).
        node: String,
    },
    /// Wait until `wanted` of `ids` can be read (a copy in memory on some node, or a
    /// spilled one), or `timeout_ms` has passed: replies `Vec<ObjectId>`, those readable
    /// then, in the order asked. Parked in the head, not polled.
    ObjectsWait {
        /// The objects.
        ids: Vec<ObjectId>,
        /// How many must be readable (at most `ids.len()`).
        wanted: usize,
        /// How long to wait at most.
        timeout_ms: u64,
    },
    /// Remove a node from the cluster for good (`regatta node remove`): it is declared
    /// dead at once (its actors restart elsewhere) and its name is refused from then on,
    /// registrations and heartbeats alike: replies `bool`, whether the head knew it.
    RemoveNode(String),
    /// The fingerprint of the authorities the head trusts now (at its start and after each
    /// step of a rotation; not kept): heartbeats of nodes that trust others are answered
    /// with a request to renew. Replies `()`.
    Trust(u64),
}

impl HeadRequest {
    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Register(..) => "register",
            Self::ObjectsHeld { .. } => "objects-held",
            Self::Heartbeat { .. } => "heartbeat",
            Self::Spawn(_) => "spawn",
            Self::WaitActor(_) => "wait-actor",
            Self::Named(_) => "named",
            Self::Kill(_) => "kill",
            Self::CreateGroup(_) => "create-placement-group",
            Self::WaitGroup(_) => "wait-placement-group",
            Self::RemoveGroup(_) => "remove-placement-group",
            Self::Status => "status",
            Self::StatusPage { .. } => "status_page",
            Self::ObjectsWait { .. } => "objects-wait",
            Self::Started { .. } => "started",
            Self::ObjectPut { .. } => "object-put",
            Self::ObjectLocate(_) => "object-locate",
            Self::ObjectAddSource { .. } => "object-add-source",
            Self::ObjectRemoveSource { .. } => "object-remove-source",
            Self::ObjectAddRef { .. } => "object-add-ref",
            Self::ObjectDropRef { .. } => "object-drop-ref",
            Self::ObjectFree(_) => "object-free",
            Self::HolderGone(_) => "holder-gone",
            Self::EndJob(_) => "end-job",
            Self::Exited { .. } => "exited",
            Self::Undelivered { .. } => "undelivered",
            Self::View(_) => "view",
            Self::RunReport(_) => "run-report",
            Self::Announce(_) => "announce",
            Self::ObjectPull { .. } => "object-pull",
            Self::ObjectPullEnded { .. } => "object-pull-ended",
            Self::RemoveNode(_) => "remove-node",
            Self::Trust(_) => "trust",
        }
    }

    /// Whether the head's state stays as it was after this request (it reads, waits or
    /// beats): a head that keeps its state on disk writes it after every other request.
    pub fn reads_only(&self) -> bool {
        matches!(
            self,
            Self::Heartbeat { .. }
                | Self::WaitActor(_)
                | Self::Named(_)
                | Self::WaitGroup(_)
                | Self::Status
                | Self::StatusPage { .. }
                | Self::View(_)
                | Self::ObjectLocate(_)
                | Self::Announce(_)
                | Self::ObjectPull { .. }
                | Self::ObjectPullEnded { .. }
                | Self::ObjectsWait { .. }
                | Self::Trust(_)
        )
    }

    /// Whether sending the request twice changes nothing beyond sending it once, so that a
    /// request lost with its session (a duplicate connection closed by `ractor_cluster`, a
    /// head restart) can be sent again on the next session.
    pub fn retryable(&self) -> bool {
        self.reads_only()
    }
}

/// Orders to a process's object service (process group `objects/<node>`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ObjectCommand {
    /// Drop the in-memory copy and delete the spilled copy at the URL, if given.
    Release {
        /// The object.
        id: ObjectId,
        /// A spilled copy this node wrote.
        spilled: Option<String>,
    },
}

/// Requests a node agent answers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum AgentRequest {
    /// Construct an actor: replies `()` at once; the outcome goes to the head.
    Start(StartActor),
    /// Stop an actor: replies `()`.
    Stop(ActorId),
    /// Advertise a hosted actor to every peer again (re-join its process group): `()`.
    Announce(ActorId),
    /// The actor's recent log lines on this node: replies `Vec<crate::actor_log::LogLine>`.
    Logs(ActorId),
    /// The actors the node runs or is starting: replies `Vec<RunningActor>`.
    Running,
}

/// The head's order to construct one actor on one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartActor {
    /// The actor.
    pub actor: ActorId,
    /// Increases on every (re)start, so stale reports are ignored.
    pub attempt: u32,
    /// The node chosen.
    pub node: String,
    /// Kind to construct.
    pub kind: String,
    /// Constructor arguments.
    pub args: Vec<u8>,
    /// Resources granted.
    pub resources: Resources,
    /// GPU indices granted.
    pub gpu_ids: Vec<u32>,
    /// Optional name.
    pub name: Option<String>,
    /// The job it belongs to.
    #[serde(default)]
    pub job: Option<String>,
}
