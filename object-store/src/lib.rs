//! Regatta's shared object store, the parts that need no cluster: the head's
//! [`Directory`] of every object, a node's [`MemoryStore`] (capacity and LRU spilling,
//! zero-copy local reads), the TCP+TLS [`Transfer`] between nodes (and shared-memory
//! [`Segment`]s between processes on one host) with mutual TLS derived from
//! the cluster token, and [`SpillBackend`]s on `object_store` (local directory or S3).
//!
//! The runtime crate wires these into the head, workers and clients (`put`, `get`, `wait`,
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
mod handshake_slots;
mod identity;
mod idle_pool;
mod place;
mod quic;
mod receive_pool;
mod sealed;
mod shm;
mod spill;
mod transfer;

// The bookkeeping (ids, the directory, the memory store) is pure and lives in regatta-proto.
use regatta_proto::object::{directory, id, memory};

pub use checksum::crc32;
pub use directory::{Directory, DirectoryStats, Location, Missing, Release};
pub use error::{Error, Result};
pub use handshake_slots::{
    HandshakeSlots, Refusal as HandshakeRefusal, Slot as HandshakeSlot, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE,
};
pub use id::ObjectId;
pub use identity::{identity_from_token, TlsIdentity};
pub use memory::{MemoryStats, MemoryStore, NoRoom};
pub use place::{absolute, Place, PlaceError};
pub use quic::endpoint;
pub use receive_pool::{pooled_bytes, RECEIVE_POOL_ENV};
pub use sealed::{
    receive_frame_into, send_frame, tls_for_frames, FrameError, Keys as FrameKeys, Opener, SealedStream, Sealer,
};
pub use shm::{Handle as SharedHandle, HostKey, Segment};
pub use spill::{delete as delete_spilled, open_store, parse_spill_url, restore, SpillBackend};
pub use transfer::{
    keep_alive, Fetched, ObjectSource, Transfer, CHUNK_BYTES, FAULT_CORRUPT_ENV, IO_TIMEOUT, NO_SHARED_MEMORY_ENV,
    SERVER_NAME, TRANSFER_ALPN,
};
