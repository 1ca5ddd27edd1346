//! An actor as the head sees it: where it is, its state, and why it died.

use serde::{Deserialize, Serialize};

use super::ids::{ActorId, GroupId};

/// Where an actor is and how it is doing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorView {
    /// The actor.
    pub id: ActorId,
    /// Its kind.
    pub kind: String,
    /// Its state.
    pub state: ActorState,
    /// The node it runs on, if placed.
    pub node: Option<String>,
    /// `host:port` of that node's cluster listener, for opening a session to it.
    #[serde(default)]
    pub address: Option<String>,
    /// How many times it was restarted.
    pub restarts: u32,
}

/// An actor's lifecycle state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActorState {
    /// Waiting for resources.
    Pending,
    /// Placed; its constructor is running.
    Starting,
    /// Running.
    Alive,
    /// Lost its node or process; waiting to be placed again.
    Restarting,
    /// Gone for good.
    Dead {
        /// Why.
        cause: DeathCause,
    },
}

impl ActorState {
    /// A short lower-case label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Starting => "starting",
            Self::Alive => "alive",
            Self::Restarting => "restarting",
            Self::Dead { .. } => "dead",
        }
    }
}

/// Why an actor's start attempt failed, as its node's agent reports it to the head in
/// [`HeadRequest::Started`]: the constructor's error, or why the node could not host the
/// actor it built. The head marks the actor dead with it (`constructor failed: <cause>`)
/// and does not restart it: the same arguments would fail again.
///
/// A struct of one string, it encodes on the wire and in the head's change log exactly as
/// the plain `String` it replaced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{cause}")]
pub struct StartFailure {
    /// What went wrong, for people.
    pub cause: String,
}

impl StartFailure {
    /// A failure saying `cause`.
    pub fn new(cause: impl Into<String>) -> Self {
        Self { cause: cause.into() }
    }
}

/// Why an actor is dead for good: what callers match on (a lost node is worth trying
/// again elsewhere; a constructor that failed is not). Its text is what people read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum DeathCause {
    /// Its constructor failed; it is not restarted, since the same arguments fail again.
    #[error("constructor failed: {0}")]
    ConstructorFailed(StartFailure),
    /// Killed on request.
    #[error("killed by request")]
    Killed,
    /// The job that started it ended.
    #[error("job {job} ended")]
    JobEnded {
        /// The job.
        job: String,
    },
    /// Its placement group was removed.
    #[error("placement group {group} was removed")]
    GroupRemoved {
        /// The group.
        group: GroupId,
    },
    /// It waited to be placed again and no node alive could ever hold it any more.
    #[error("cannot be placed any more: {why}")]
    Unplaceable {
        /// What no node has.
        why: String,
    },
    /// Lost once more than its restart budget allows.
    #[error("{last}; restart budget exhausted (max_restarts={max_restarts})")]
    RestartsExhausted {
        /// The loss that ended it.
        last: Loss,
        /// Its budget.
        max_restarts: u32,
    },
}

impl DeathCause {
    /// Whether it died with its node (the node died, restarted, or never took its start, or
    /// the nodes that could hold it are gone) rather than of its own doing: running it
    /// again elsewhere may well work.
    pub fn node_lost(&self) -> bool {
        match self {
            Self::RestartsExhausted { last, .. } => last.node_lost(),
            Self::Unplaceable { .. } => true,
            _ => false,
        }
    }

    /// A short snake_case name, for clients in other languages (Python's
    /// `ActorDiedError.cause`) and for filters.
    pub fn label(&self) -> &'static str {
        match self {
            Self::ConstructorFailed(_) => "constructor_failed",
            Self::Killed => "killed",
            Self::JobEnded { .. } => "job_ended",
            Self::GroupRemoved { .. } => "group_removed",
            Self::Unplaceable { .. } => "unplaceable",
            Self::RestartsExhausted { last, .. } if last.node_lost() => "node_lost",
            Self::RestartsExhausted { .. } => "restarts_exhausted",
        }
    }
}

/// How a placed actor was lost; each is worth a restart while its budget lasts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Loss {
    /// Its node was declared dead.
    #[error("node {node} died: {cause}")]
    NodeDied {
        /// The node.
        node: String,
        /// Why the node was declared dead.
        cause: String,
    },
    /// Its node registered again without it: the worker process restarted.
    #[error("node {node} registered again without it (its worker restarted)")]
    NodeRestarted {
        /// The node.
        node: String,
    },
    /// Its start never reached its node: the node's agent did not take it.
    #[error("node {node}'s agent did not accept the start")]
    Undelivered {
        /// The node.
        node: String,
    },
    /// Its host on the node stopped (a panic, an error, its process exited), as the node's
    /// agent reported it.
    #[error("{0}")]
    Exited(String),
}

impl Loss {
    /// Whether the loss came from its node rather than from the actor itself.
    pub fn node_lost(&self) -> bool {
        !matches!(self, Self::Exited(_))
    }
}
