//! The object store's error type.

use regatta_proto::ObjectId;

/// What can go wrong storing, spilling or restoring objects.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object does not fit in this node's store.
    #[error("object of {size} bytes does not fit in this node's object store (capacity {capacity} bytes, {pinned} bytes pinned); raise --object-store-bytes or free objects")]
    NoRoom {
        /// Size asked for.
        size: u64,
        /// Capacity.
        capacity: u64,
        /// Bytes that cannot be spilled now.
        pinned: u64,
    },
    /// A received or restored object does not match its checksum.
    #[error("object {id} is corrupt ({detail}); the copy was discarded")]
    Corrupt {
        /// The object.
        id: ObjectId,
        /// Where the mismatch was found.
        detail: String,
    },
    /// The spill backend failed.
    #[error("spill backend {url}: {reason}")]
    Spill {
        /// The backend or object URL.
        url: String,
        /// What failed.
        reason: String,
    },
}

/// The object store's result type.
pub type Result<T> = std::result::Result<T, Error>;
