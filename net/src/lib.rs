//! Regatta's secure networking between nodes: the cluster's own certificate authority, the
//! join that trades a join token for a certificate of it, each process's TLS identity, the per-source handshake slots that keep strangers from
//! exhausting a listener, sealed frames (AES-GCM on keys exported from a TLS session, so
//! bulk bytes skip TLS's record layer), QUIC endpoints, and the object [`Transfer`]
//! between nodes (with shared-memory [`Segment`](regatta_object_store::Segment) hand-off
//! between processes on one host and pooled receive buffers).
//!
//! `regatta-object-store` keeps the store itself; the runtime wires both into the head,
//! workers and clients, and the trainer's ring uses the sealed frames and QUIC.

mod authorities;
mod ca;
mod error;
mod handshake_slots;
mod identity;
mod idle_pool;
mod join;
mod quic;
mod receive_pool;
mod sealed;
mod throttle;
mod transfer;

pub use authorities::{trust_fingerprint, Authorities, AuthorityStore, Retiring};
pub use ca::{certificate_pem, CaHash, ClusterCa, Role, CERT_LIFETIME, HEAD_CERT_LIFETIME, HEAD_NAME};
pub use error::{Error, Result};
pub use handshake_slots::{
    source_of, HandshakeSlots, Refusal as HandshakeRefusal, Slot as HandshakeSlot, MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_SOURCE,
};
pub use identity::{identity_from_secret, peer_name, CertSlot, RemovedNodes, TlsIdentity, TrustSlot};
pub use join::{
    answer_join, join, renew, signatures_only_verifier, JoinDesk, JoinKey, JoinToken, JoinTokens,
    Refusal as JoinRefusal, TokenEntry, JOIN_ALPN, JOIN_TIMEOUT,
};
pub use quic::endpoint;
pub use receive_pool::{pooled_bytes, RECEIVE_POOL_ENV};
pub use sealed::{
    receive_frame_into, send_frame, tls_for_frames, FrameError, Keys as FrameKeys, Opener, SealedStream, Sealer,
};
pub use throttle::{Throttle, FAILURE_BURST, FAILURE_REFILL};
pub use transfer::{
    keep_alive, Fetched, ObjectSource, Transfer, CHUNK_BYTES, FAULT_CORRUPT_ENV, IO_TIMEOUT, NO_SHARED_MEMORY_ENV,
    SERVER_NAME, TRANSFER_ALPN,
};

/// The bounded fuzzing's configuration (the `fuzz` test modules): `cases` cases from a fixed
/// seed unless `PROPTEST_RNG_SEED` names one, so that CI runs the same cases every time (a
/// flaky fuzz is a failing test); a developer widens the search with `PROPTEST_RNG_SEED` and
/// `PROPTEST_CASES`.
#[cfg(test)]
pub(crate) fn fuzz_config(cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    let mut config = proptest::test_runner::Config::with_cases(cases);
    if matches!(config.rng_seed, proptest::test_runner::RngSeed::Random) {
        config.rng_seed = proptest::test_runner::RngSeed::Fixed(0x5eed_1e55);
    }
    config
}
