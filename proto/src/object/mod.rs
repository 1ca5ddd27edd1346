//! The object store's bookkeeping: object ids, the head's directory of every object (where
//! copies are, who references them, what to free) and a node's memory store (capacity, LRU
//! order and which objects to spill to make room), and the tree a broadcast spreads along.

pub mod directory;
pub mod fanout;
pub mod id;
pub mod memory;

pub use directory::{Directory, DirectoryStats, Location, Missing, Release};
pub use fanout::{Fanout, Plan};
pub use id::ObjectId;
pub use memory::{MemoryStats, MemoryStore, NoRoom};
