//! Regatta's shared object store, the parts that need no network: the head's
//! [`Directory`] of every object, a node's [`MemoryStore`] (capacity and LRU spilling,
//! zero-copy local reads), shared-memory [`Segment`]s between processes on one host,
//! [`SpillBackend`]s on `object_store` (local directory or S3) and [`Place`]s (a local path
//! or an object-store URL, read and written alike).
//!
//! Moving objects between nodes (the TLS transfer, sealed frames, QUIC) is `regatta-net`'s;
//! the runtime crate wires both into the head, workers and clients (`put`, `get`, `wait`,
//! `free` on `ObjectRef`s).
//!
//! ```
//! use regatta_object_store::{MemoryStore, ObjectId};
//! let mut store = MemoryStore::new(1 << 20);
//! let id = ObjectId::random();
//! store.insert(id, bytes::Bytes::from_static(b"hello"));
//! assert_eq!(&store.get(id).unwrap()[..], b"hello");
//! ```

mod checksum;
mod error;
mod place;
mod shm;
mod spill;

// The bookkeeping (ids, the directory, the memory store) is pure and lives in regatta-proto.
pub use regatta_proto::{
    Directory, DirectoryStats, Location, MemoryStats, MemoryStore, Missing, NoRoom, ObjectId, Release,
};

pub use checksum::crc32;
pub use error::{Error, Result};
pub use place::{absolute, Place, PlaceError};
pub use shm::{
    receive_buffer, release_spare_pages, Handle as SharedHandle, HostKey, Prefault, Segment, SharedHugePages,
};
pub use spill::{
    default_spill_dir, delete as delete_spilled, make_private_dir, open_store, parse_spill_url, restore, SpillBackend,
};
