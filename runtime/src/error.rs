//! The runtime's one error type.

use std::time::Duration;

use regatta_proto::{ActorId, Failure};

impl From<regatta_proto::Error> for Error {
    fn from(error: regatta_proto::Error) -> Self {
        match error {
            regatta_proto::Error::BadResources { input, reason } => Self::BadResources { input, reason },
            regatta_proto::Error::BadQuery(reason) => Self::Rejected(format!("bad query: {reason}")),
            // Input refused as it was given: the caller's to fix, as the message says.
            refused @ (regatta_proto::Error::UnknownStrategy { .. }
            | regatta_proto::Error::GpuRequestNotWhole { .. }
            | regatta_proto::Error::NodeGpuNotWhole { .. }
            | regatta_proto::Error::TooManyGpus { .. }
            | regatta_proto::Error::BadRunName { .. }
            | regatta_proto::Error::BadObjectId { .. }
            | regatta_proto::Error::ObjectExists { .. }
            | regatta_proto::Error::UnsupportedRuntimeEnv { .. }
            | regatta_proto::Error::EmptyEntrypoint
            | regatta_proto::Error::BadEnvVar { .. }
            | regatta_proto::Error::LabelSelectorUnsupported
            | regatta_proto::Error::UnsupportedPackage { .. }
            | regatta_proto::Error::PyModuleNotUploaded { .. }
            | regatta_proto::Error::BadAmount { .. }
            | regatta_proto::Error::BadJobId { .. }) => Self::Rejected(refused.to_string()),
        }
    }
}

/// Everything that can go wrong in the runtime, each with the input that caused it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A resource string could not be parsed.
    #[error("bad resource list '{input}': {reason}")]
    BadResources {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No node could ever satisfy the request.
    #[error("infeasible request: {0}")]
    Infeasible(String),
    /// The actor kind is registered on no alive node.
    #[error("unknown actor kind '{kind}': {detail}")]
    UnknownKind {
        /// The kind asked for.
        kind: String,
        /// Which kinds exist.
        detail: String,
    },
    /// A request the head refused (duplicate name, bad bundle index, ...).
    #[error("{0}")]
    Rejected(String),
    /// The actor is dead and will not come back.
    #[error("actor {actor} ({kind}) is dead: {cause}")]
    ActorDead {
        /// The actor.
        actor: ActorId,
        /// Its kind.
        kind: String,
        /// Why it died.
        cause: regatta_proto::DeathCause,
    },
    /// A call or cast could not be delivered or its reply was lost.
    #[error("call to actor {actor} failed: {cause}")]
    CallFailed {
        /// The actor.
        actor: ActorId,
        /// What happened.
        cause: String,
    },
    /// The actor's handler returned an error.
    #[error("actor {actor} returned an error: {message}")]
    Remote {
        /// The actor.
        actor: ActorId,
        /// The handler's message.
        message: String,
    },
    /// Something did not answer in time.
    #[error("{what} timed out after {timeout:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        timeout: Duration,
    },
    /// The head could not be reached or refused this node.
    #[error("cannot join the cluster at {address}: {reason}")]
    Connect {
        /// The head's address.
        address: String,
        /// Why.
        reason: String,
    },
    /// An executor process could not be found or started.
    #[error("{0}")]
    Executor(String),
    /// The head refused this process's join token or certificate.
    #[error("the head at {address} refused this process: {reason}")]
    TokenRefused {
        /// The head's address.
        address: String,
        /// Why (the join's refusal, or a certificate of another cluster).
        reason: String,
    },
    /// The job API does not know the job.
    #[error("unknown job: {0}")]
    JobUnknown(String),
    /// No cluster token was found, or it is not a join token (the message says which).
    #[error("{0}")]
    Token(String),
    /// Bytes from the network did not decode.
    #[error("could not decode {what}: {reason}")]
    Decode {
        /// What was being decoded.
        what: String,
        /// The decoder's message.
        reason: String,
    },
    /// The head's saved cluster state cannot be used; the head refuses to start rather
    /// than forget the cluster it describes.
    #[error("the head's saved cluster state {path} cannot be used: {reason}")]
    HeadState {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// A local I/O failure.
    #[error("{context}: {cause}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error (in the message, not chained, so it is printed once).
        cause: std::io::Error,
    },
    /// Every copy of the object was on a node that died.
    #[error("object {id} is lost: its only copy was on node {node}, which died, and it was never spilled")]
    ObjectLost {
        /// The object.
        id: regatta_object_store::ObjectId,
        /// The node.
        node: String,
    },
    /// The object was never put, or was freed.
    #[error("object {id} does not exist (never put, or already freed)")]
    ObjectUnknown {
        /// The object.
        id: regatta_object_store::ObjectId,
    },
    /// Storing, spilling or restoring an object failed.
    #[error(transparent)]
    Object(regatta_object_store::Error),
    /// TLS set-up or moving an object between nodes failed.
    #[error(transparent)]
    Net(regatta_net::Error),
    /// The actor system failed locally.
    #[error("actor system: {0}")]
    Actor(String),
}

/// The object store's errors, inside the runtime's.
impl From<regatta_object_store::Error> for Error {
    fn from(e: regatta_object_store::Error) -> Self {
        Error::Object(e)
    }
}

/// The networking crate's errors, inside the runtime's.
impl From<regatta_net::Error> for Error {
    fn from(e: regatta_net::Error) -> Self {
        Error::Net(e)
    }
}

/// The runtime's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Whether this is a port already taken by another process (the OS error's kind, not
    /// its text): a caller that chose the port may choose another and start again.
    pub fn is_address_in_use(&self) -> bool {
        matches!(self, Self::Io { cause, .. } if cause.kind() == std::io::ErrorKind::AddrInUse)
    }

    pub(crate) fn io(context: impl Into<String>, cause: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            cause,
        }
    }
}

/// The error a caller sees for a failure the head, an agent or an actor sent back;
/// `actor` names the actor a call went to.
pub(crate) fn failure_to_error(failure: Failure, actor: Option<ActorId>) -> Error {
    match failure {
        Failure::Infeasible(m) => Error::Infeasible(m),
        Failure::UnknownKind { kind, detail } => Error::UnknownKind { kind, detail },
        Failure::Rejected(m) => Error::Rejected(m),
        Failure::Dead { kind, cause } => Error::ActorDead {
            actor: actor.unwrap_or(ActorId(0)),
            kind,
            cause,
        },
        Failure::Handler(message) => Error::Remote {
            actor: actor.unwrap_or(ActorId(0)),
            message,
        },
        Failure::BadMessage(m) => Error::Decode {
            what: "a message".into(),
            reason: m,
        },
        Failure::ObjectMissing {
            id,
            lost_with: Some(node),
        } => Error::ObjectLost { id, node },
        Failure::ObjectMissing { id, lost_with: None } => Error::ObjectUnknown { id },
        Failure::Lost(cause) => Error::CallFailed {
            actor: actor.unwrap_or(ActorId(0)),
            cause,
        },
        Failure::NotHosted { actor, node } => Error::CallFailed {
            actor,
            cause: format!("node {node} no longer hosts the actor (it died or moved)"),
        },
    }
}
