//! Regatta's shared object store: the head's directory of every object, node-local stores,
//! QUIC transfer between nodes and spilling to `object_store` backends.
//!
//! Not built yet: see the object store issue. The runtime crate owns the cluster this store
//! will plug into.
