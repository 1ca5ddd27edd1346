//! The call channel: actor calls and casts go straight from the caller's process to the
//! process that hosts the actor, over one mutually authenticated TLS connection per pair
//! of processes, instead of through `ractor_cluster`'s session actors.
//!
//! Why: a call through the sessions passes about ten task-to-task hand-offs across the two
//! processes (caller → session writer → … → session reader → router → host and back), each
//! able to wake a parked worker thread on an idle core; on a machine with slow wake-ups
//! that, not the network, bounded one-at-a-time calls. Here a call is the caller's write,
//! the serving connection's read, the host's queue and one reply write: the host's queue
//! is the same one the node's router fills ([`Routes`]), so
//! restarts, "not hosted here" answers and mailbox metrics are unchanged.
//!
//! Every worker serves the channel on its own TCP port (`--call-port`, any free one by
//! default) with TLS 1.3 and client certificates derived from the cluster token, as the
//! object transfer does: a peer without the token cannot connect, and nothing crosses in
//! cleartext. A caller learns the port from the node's router (over the session, once)
//! and falls back to the session path when the node offers no channel or cannot be
//! reached on it, so a firewall between a driver and a worker's call port costs speed,
//! not correctness. [`CALL_PATH_ENV`] = `session` turns the channel off in a process.
//!
//! Ordering: calls and casts a caller sends one after another over one connection reach
//! the actor's queue in that order.

mod client;
mod frame;
mod routes;
mod server;
mod socket;

pub(crate) use client::{CallPlane, Hops, Target};
pub(crate) use frame::wall_clock_ns;
#[cfg(test)]
pub(crate) use frame::ServerStamps;
pub(crate) use routes::{RouterQuery, Routes};
pub(crate) use server::{CallCounters, CallServer};
pub(crate) use socket::CallAddress;

use regatta_net::TlsIdentity;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::error::{Error, Result};

/// Environment variable choosing how this process sends actor calls: `direct` (default:
/// the call channel, falling back to the session path), `tcp` (the call channel over TCP
/// even to processes of this host, which otherwise get a Unix socket: for packet captures
/// and diagnosis) or `session` (always the session path).
pub const CALL_PATH_ENV: &str = "REGATTA_CALL_PATH";

/// ALPN protocol id of the call channel (the object transfer has its own). Version 2 added
/// timed calls: a peer of version 1 would close a shared connection on one, so the two
/// fail the handshake instead and their calls take the session path.
const ALPN: &[u8] = b"regatta-calls/2";

/// How this process sends actor calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallPath {
    /// The call channel where the node offers one, else the session path.
    Direct,
    /// As `Direct`, always over TCP (never the same-host Unix socket).
    Tcp,
    /// Always through `ractor_cluster`'s sessions.
    Session,
}

impl CallPath {
    /// Parses [`CALL_PATH_ENV`]'s value.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "" | "direct" => Ok(Self::Direct),
            "tcp" => Ok(Self::Tcp),
            "session" => Ok(Self::Session),
            other => Err(Error::Rejected(format!(
                "{CALL_PATH_ENV}='{other}' is not a call path; use 'direct' (the default), 'tcp' or 'session'"
            ))),
        }
    }

    /// The path [`CALL_PATH_ENV`] asks for (`Direct` when unset).
    pub fn from_env() -> Result<Self> {
        Self::parse(&std::env::var(CALL_PATH_ENV).unwrap_or_default())
    }
}

/// TLS for the call channel, from the cluster token (mutual: both sides present a
/// certificate signed by the token's authority).
#[derive(Clone)]
pub(crate) struct CallTls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    /// Whether peers' certificates name their nodes ([`TlsIdentity::peer_name`]).
    names_nodes: bool,
}

impl CallTls {
    /// The process's token identity (the object transfer's), with the call channel's ALPN.
    pub(crate) fn new(identity: &TlsIdentity) -> Self {
        let (server, client) = identity.with_alpn(ALPN);
        Self {
            acceptor: TlsAcceptor::from(server),
            connector: TlsConnector::from(client),
            names_nodes: identity.names_nodes,
        }
    }

    /// The name node `node`'s certificate must carry: its own under the cluster's
    /// authority (a call meant for w3 is answered by w3), [`regatta_net::SERVER_NAME`] under a
    /// secret's.
    fn server_name(&self, node: &str) -> ServerName<'static> {
        ServerName::try_from(regatta_net::peer_name(self.names_nodes, node))
            .expect("a node's certificate name is a valid DNS name")
    }
}

#[cfg(test)]
mod tests;
