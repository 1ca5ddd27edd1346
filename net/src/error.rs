//! The networking crate's error type.

use regatta_object_store::ObjectId;

/// What can go wrong setting up TLS or moving an object between nodes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// TLS credentials could not be built.
    #[error("TLS setup failed: {0}")]
    Tls(String),
    /// A join request or answer that cannot be used (a bad token, hash or name).
    #[error("{0}")]
    Join(String),
    /// A file that is not there (the CA folder's authorities).
    #[error("{0}")]
    NotFound(String),
    /// A rotation of the cluster's authority that cannot be made now (one under way, none
    /// to finish, or certificates of the old authority still in use).
    #[error("{0}")]
    Rotation(String),
    /// The head refused the join, or proved it is not the cluster's head.
    #[error("{0}")]
    JoinRefused(String),
    /// The head could not be reached to join (yet).
    #[error("{0}")]
    JoinUnreachable(String),
    /// The object transfer (or the trainer's QUIC endpoint) could not be set up or reached.
    #[error("object transfer: {0}")]
    Transfer(String),
    /// A received object does not match its checksum.
    #[error("object {id} is corrupt ({detail}); the copy was discarded")]
    Corrupt {
        /// The object.
        id: ObjectId,
        /// Where the mismatch was found.
        detail: String,
    },
    /// A peer does not hold the object any more.
    #[error("object {id} is not held by {peer}")]
    NotHeld {
        /// The object.
        id: ObjectId,
        /// The peer asked.
        peer: String,
    },
}

/// The networking crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
