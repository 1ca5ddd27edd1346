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
    /// A local spill folder that someone else could change: a restore trusts a spilled
    /// copy's size and CRC, so whoever can write there could plant an object.
    #[error("spill folder {path}: {problem}; spilled objects must sit where only this user can write (point --spill-url at a folder of your own, or leave it unset)")]
    NotPrivate {
        /// The folder at fault (the spill folder or one above it).
        path: String,
        /// Who else could change it.
        problem: String,
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
