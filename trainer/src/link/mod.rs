//! The ring link between neighbouring ranks. Each rank listens three ways: on a TCP port
//! whose connections speak the object store's sealed frames after a mutual TLS 1.3
//! handshake (the cluster's TLS, derived from the ring's secret; AES-128-GCM frames of up to
//! 1 MiB sealed straight from the tensor and opened in place in the receiving tensor), on a
//! QUIC endpoint (the same TLS), and on a Unix socket in a private directory. A rank connects
//! to the next rank over the Unix socket when both run on one host (same kernel boot and PID
//! namespace: the object store's [`HostKey`](regatta_object_store::HostKey)), proving the ring's secret with an HMAC
//! challenge each way; otherwise over TCP with sealed frames, or over QUIC when the next rank
//! offers no TCP port or its port cannot be reached (`REGATTA_RING_TRANSPORT=quic` makes
//! every link QUIC, for comparisons).
//!
//! Either way the link moves the tensors' own bytes: a send writes straight from the caller's
//! `f32` slice and a receive reads straight into the caller's slice, with no encoding pass and
//! no intermediate buffer. In an exchange (send to the next rank while receiving from the
//! previous one, every ring step) the send runs on a scoped thread so it overlaps the receive:
//! every rank sends before it receives, and blocking sends alone would deadlock the ring once
//! a chunk outgrows the socket's buffer.
//!
//! Here: the link itself ([`StreamLink`]) and its two halves; the address in `address.rs`,
//! forming the link in `builder.rs`, and each transport in `unix.rs`, `tcp.rs` and `quic.rs`.

use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::collective::{LinkError, RingLink};

mod address;
mod builder;
mod quic;
mod tcp;
mod unix;

pub use address::{LocalAddress, RingAddress};
pub use builder::{LinkOptions, RingLinkBuilder};
use quic::{QuicRecv, QuicSend};
use tcp::{SealedRecv, SealedSend};

/// Set to `quic` to make every ring link use QUIC, or to `tcp` to make every link TCP with
/// sealed frames, even between ranks on one host (for comparisons and for hosts whose
/// temporary directory cannot hold a socket).
pub const RING_TRANSPORT_ENV: &str = "REGATTA_RING_TRANSPORT";

/// How long a Unix-socket peer has to finish the secret handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

// The wire form of the values is little-endian `f32`, which is the memory form here.
#[cfg(not(target_endian = "little"))]
compile_error!("the ring link sends f32 values in memory order, which must be little-endian");

/// The sending half of a link.
enum Outgoing {
    Local(UnixStream),
    Sealed(Box<SealedSend>),
    Quic(QuicSend),
}

/// The receiving half of a link.
enum Incoming {
    Local(UnixStream),
    Sealed(Box<SealedRecv>),
    Quic(QuicRecv),
}

/// What shuts a link's sending half down from another thread, so a blocked write returns.
enum Unblock {
    Unix(UnixStream),
    Tcp(std::net::TcpStream),
}

impl Unblock {
    fn shutdown(&self) {
        let _ = match self {
            Unblock::Unix(stream) => stream.shutdown(std::net::Shutdown::Both),
            Unblock::Tcp(stream) => stream.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl Outgoing {
    fn close(&mut self) {
        match self {
            Outgoing::Local(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Outgoing::Sealed(sealed) => {
                let _ = sealed.tcp.shutdown(std::net::Shutdown::Both);
            }
            Outgoing::Quic(quic) => {
                if let Some(stream) = quic.stream.as_mut() {
                    let _ = stream.reset(quinn::VarInt::from_u32(0));
                }
            }
        }
    }

    /// Writes a message: its value count, then the values' bytes from the caller's slice.
    fn send(&mut self, values: &[f32]) -> Result<(), LinkError> {
        let header = (values.len() as u64).to_le_bytes();
        let payload = as_bytes(values);
        match self {
            Outgoing::Local(stream) => unix::send(stream, &header, payload),
            Outgoing::Sealed(sealed) => sealed.send(&header, payload),
            Outgoing::Quic(quic) => quic.send(&header, payload),
        }
    }
}

impl Incoming {
    fn close(&mut self) {
        match self {
            Incoming::Local(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Incoming::Sealed(sealed) => {
                let _ = sealed.tcp.shutdown(std::net::Shutdown::Both);
            }
            Incoming::Quic(quic) => {
                let _ = quic.stream.stop(quinn::VarInt::from_u32(0));
            }
        }
    }

    /// Reads a message of exactly `out.len()` values straight into `out`.
    fn recv(&mut self, out: &mut [f32]) -> Result<(), LinkError> {
        match self {
            Incoming::Local(stream) => unix::recv(stream, out),
            Incoming::Sealed(sealed) => sealed.recv(out),
            Incoming::Quic(quic) => quic.recv(out),
        }
    }
}

/// Checks a message's header: the value count the receiver expects, else an error naming
/// both.
fn check_count(header: [u8; 8], expected: usize) -> Result<(), LinkError> {
    let count = u64::from_le_bytes(header);
    if count == expected as u64 {
        Ok(())
    } else {
        Err(LinkError(format!(
            "expected {expected} values from the previous rank, it sent {count}"
        )))
    }
}

/// A rank's link to its two ring neighbours. Its calls block: run them on a plain thread
/// (the executor's, or `spawn_blocking`), never on an async task.
pub struct StreamLink {
    outgoing: Outgoing,
    incoming: Incoming,
    sent: u64,
    /// Why the link broke, once a send or receive failed: the streams may be out of step
    /// (a half-read message), so every later call fails at once.
    broken: Option<String>,
}

impl StreamLink {
    /// Which transport each half uses: `(to the next rank, from the previous rank)`, each
    /// `"unix"`, `"tcp"` or `"quic"`.
    pub fn transports(&self) -> (&'static str, &'static str) {
        let out = match self.outgoing {
            Outgoing::Local(_) => "unix",
            Outgoing::Sealed(_) => "tcp",
            Outgoing::Quic(_) => "quic",
        };
        let inc = match self.incoming {
            Incoming::Local(_) => "unix",
            Incoming::Sealed(_) => "tcp",
            Incoming::Quic(_) => "quic",
        };
        (out, inc)
    }

    /// Value bytes sent so far.
    pub fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

impl StreamLink {
    fn usable(&self) -> Result<(), LinkError> {
        match &self.broken {
            None => Ok(()),
            Some(cause) => Err(LinkError(format!("the ring link broke earlier: {cause}"))),
        }
    }

    /// Records the failure and closes both halves, so the neighbours see it too rather than
    /// read a stream that is out of step.
    fn broke(&mut self, error: LinkError) -> LinkError {
        self.outgoing.close();
        self.incoming.close();
        self.broken = Some(error.0.clone());
        error
    }
}

impl RingLink for StreamLink {
    fn send(&mut self, data: &[f32]) -> Result<(), LinkError> {
        self.usable()?;
        if let Err(e) = self.outgoing.send(data) {
            return Err(self.broke(e));
        }
        self.sent += 4 * data.len() as u64;
        Ok(())
    }

    fn recv(&mut self, out: &mut [f32]) -> Result<(), LinkError> {
        self.usable()?;
        self.incoming.recv(out).map_err(|e| self.broke(e))
    }

    fn exchange(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), LinkError> {
        self.usable()?;
        // A failed receive must not leave the send blocked on a neighbour that stopped
        // reading: shutting the socket down makes the blocked write return.
        let unblock = match &self.outgoing {
            Outgoing::Local(stream) => stream.try_clone().ok().map(Unblock::Unix),
            Outgoing::Sealed(sealed) => sealed.tcp.try_clone().ok().map(Unblock::Tcp),
            Outgoing::Quic(_) => None,
        };
        let (outgoing, incoming) = (&mut self.outgoing, &mut self.incoming);
        let (sent, received) = std::thread::scope(|scope| {
            let writer = scope.spawn(move || outgoing.send(send));
            let received = incoming.recv(recv);
            if received.is_err() {
                if let Some(unblock) = &unblock {
                    unblock.shutdown();
                }
            }
            let sent = writer
                .join()
                .unwrap_or_else(|_| Err(LinkError("the ring's send thread panicked".into())));
            (sent, received)
        });
        if let Err(e) = received {
            return Err(self.broke(e));
        }
        if let Err(e) = sent {
            return Err(self.broke(e));
        }
        self.sent += 4 * send.len() as u64;
        Ok(())
    }
}

/// The bytes of `values` in memory (little-endian `f32`, checked at compile time above).
#[allow(unsafe_code)]
fn as_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: `f32` has no padding and every byte of it is initialised; `u8` has alignment 1;
    // the length covers exactly the same memory, borrowed for the same lifetime.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// The bytes of `values` in memory, writable: any bit pattern is a valid `f32`.
#[allow(unsafe_code)]
fn as_bytes_mut(values: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern written through the result is a valid
    // `f32`, and the exclusive borrow is carried over.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{Collective, RingCollective};

    pub(super) fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    /// Forms a ring of `world` ranks in this process with one option set per rank.
    fn ring(runtime: &tokio::runtime::Runtime, options: &[LinkOptions]) -> Vec<StreamLink> {
        let world = options.len();
        let builders: Vec<RingLinkBuilder> = runtime.block_on(async {
            options
                .iter()
                .map(|o| RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", *o).unwrap())
                .collect()
        });
        let addresses: Vec<String> = builders.iter().map(|b| b.address().unwrap().to_string()).collect();
        runtime.block_on(async {
            let connects = builders
                .into_iter()
                .enumerate()
                .map(|(rank, b)| b.connect(&addresses[(rank + 1) % world]));
            futures::future::try_join_all(connects).await.unwrap()
        })
    }

    /// All-reduces `len` values on every rank of `links`, checking every element.
    fn all_reduce_on(links: Vec<StreamLink>, len: usize) {
        let world = links.len();
        let threads: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, link)| {
                std::thread::spawn(move || {
                    let mut ring = RingCollective::new(rank, world, link);
                    let mut buffer: Vec<f32> = (0..len).map(|i| (rank + i % 7) as f32).collect();
                    ring.all_reduce(&mut buffer).unwrap();
                    buffer
                })
            })
            .collect();
        let ranks_sum = (world * (world - 1) / 2) as f32;
        for thread in threads {
            let buffer = thread.join().unwrap();
            for (i, value) in buffer.iter().enumerate() {
                assert_eq!(*value, world as f32 * (i % 7) as f32 + ranks_sum, "element {i}");
            }
        }
    }

    pub(super) fn quic_only() -> LinkOptions {
        LinkOptions {
            local: false,
            tcp: false,
        }
    }

    pub(super) fn tcp_only() -> LinkOptions {
        LinkOptions {
            local: false,
            tcp: true,
        }
    }

    pub(super) fn local() -> LinkOptions {
        LinkOptions { local: true, tcp: true }
    }

    // 3,000,001 values = 12 MB per rank: far beyond one flow-control window or socket buffer.
    const LARGE: usize = 3_000_001;

    #[test]
    fn a_ring_over_quic_all_reduces_large_buffers_without_deadlock() {
        let runtime = runtime();
        let links = ring(&runtime, &[quic_only(); 3]);
        assert!(links.iter().all(|l| l.transports() == ("quic", "quic")));
        all_reduce_on(links, LARGE);
    }

    #[test]
    fn a_ring_over_tcp_with_sealed_frames_all_reduces_large_buffers_without_deadlock() {
        let runtime = runtime();
        let links = ring(&runtime, &[tcp_only(); 3]);
        assert!(
            links.iter().all(|l| l.transports() == ("tcp", "tcp")),
            "{:?}",
            links.iter().map(StreamLink::transports).collect::<Vec<_>>()
        );
        all_reduce_on(links, LARGE);
    }

    #[test]
    fn a_ring_mixing_tcp_and_quic_links_agrees() {
        // Rank 1 offers no TCP port: rank 0 reaches it by QUIC, and it reaches rank 2 by QUIC.
        let runtime = runtime();
        let links = ring(&runtime, &[tcp_only(), quic_only(), tcp_only()]);
        let transports: Vec<_> = links.iter().map(StreamLink::transports).collect();
        assert_eq!(transports, vec![("quic", "tcp"), ("quic", "quic"), ("tcp", "quic")]);
        all_reduce_on(links, 100_003);
    }

    #[test]
    fn ranks_on_one_host_use_unix_sockets_and_all_reduce_large_buffers() {
        let runtime = runtime();
        let links = ring(&runtime, &[local(); 3]);
        assert!(
            links.iter().all(|l| l.transports() == ("unix", "unix")),
            "{:?}",
            links.iter().map(StreamLink::transports).collect::<Vec<_>>()
        );
        all_reduce_on(links, LARGE);
    }

    #[test]
    fn a_ring_mixing_unix_and_quic_links_agrees() {
        // Rank 1 offers no Unix socket: rank 0 reaches it by QUIC, rank 1 reaches rank 2 by
        // its Unix socket, rank 2 reaches rank 0 by its Unix socket.
        let runtime = runtime();
        let links = ring(&runtime, &[local(), quic_only(), local()]);
        let transports: Vec<_> = links.iter().map(StreamLink::transports).collect();
        assert_eq!(transports, vec![("quic", "unix"), ("quic", "quic"), ("unix", "quic")]);
        all_reduce_on(links, 100_003);
    }

    #[test]
    fn a_rank_without_the_token_cannot_join_the_ring() {
        let runtime = runtime();
        for options in [quic_only(), tcp_only(), local()] {
            runtime.block_on(async {
                let member = RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", options).unwrap();
                let stranger = RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "other-token", options).unwrap();
                let member_addr = member.address().unwrap().to_string();
                let stranger_addr = stranger.address().unwrap().to_string();
                let outcome = tokio::time::timeout(Duration::from_secs(10), async {
                    tokio::join!(member.connect(&stranger_addr), stranger.connect(&member_addr))
                })
                .await;
                // Neither side completing a handshake (a timeout) is refused by waiting, not joined.
                if let Ok((a, b)) = outcome {
                    assert!(a.is_err() && b.is_err(), "a ring across two tokens must not form");
                }
            });
        }
    }

    #[test]
    fn a_message_of_the_wrong_length_is_refused() {
        for options in [local(), tcp_only()] {
            a_message_of_the_wrong_length_is_refused_on(options);
        }
    }

    fn a_message_of_the_wrong_length_is_refused_on(options: LinkOptions) {
        let runtime = runtime();
        let mut links = ring(&runtime, &[options; 2]);
        let mut second = links.pop().unwrap();
        let mut first = links.pop().unwrap();
        let sender = std::thread::spawn(move || {
            // The receiver may close its end after the header, before the payload is
            // written: then this send fails too, and the link on this side is broken as well.
            let _ = first.send(&[1.0, 2.0, 3.0]);
            first
        });
        let mut out = [0f32; 2];
        let err = second.recv(&mut out).unwrap_err();
        assert!(err.0.contains("expected 2 values"), "{err}");
        // The stream is out of step now: later calls fail at once, never read garbage.
        let again = second.recv(&mut out).unwrap_err();
        assert!(again.0.contains("broke earlier"), "{again}");
        let mut first = sender.join().unwrap();
        // The neighbour sees the link closed rather than waiting on it.
        assert!(first.exchange(&[1.0; 4], &mut [0.0; 4]).is_err());
    }
}
