//! The link from any process to the head actor: find it (again, after a head restart) and
//! ask it typed questions.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use ractor::ActorCell;
use serde::de::DeserializeOwned;

use crate::error::failure_to_error;
use crate::error::{Error, Result};
use crate::net::node::{self, Peers};
use crate::net::wire::{self, CallError};
use regatta_proto::{Failure, HeadRequest};

/// How a process reaches the head.
pub(crate) struct HeadLink {
    scope: String,
    head: Mutex<ActorCell>,
    address: String,
    peers: Option<Peers>,
}

impl HeadLink {
    pub(crate) fn new(scope: String, head: ActorCell, address: String) -> Self {
        Self {
            scope,
            head: Mutex::new(head),
            address,
            peers: None,
        }
    }

    /// The same link, able to open sessions to peer nodes ([`HeadLink::reach`]).
    pub(crate) fn with_peers(self, peers: Peers) -> Self {
        Self {
            peers: Some(peers),
            ..self
        }
    }

    /// Opens a session to `node` at `address` in the background, when this process can
    /// (the head's own link cannot, and needs not: every node connects to the head).
    pub(crate) fn reach(&self, node: &str, address: &str) {
        if let Some(peers) = &self.peers {
            peers.reach(node, address);
        }
    }

    pub(crate) fn scope(&self) -> &str {
        &self.scope
    }

    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// The head's actor: the cached one while it runs, else a fresh lookup (the head may
    /// have restarted and this node rejoined it).
    pub(crate) fn head(&self) -> Result<ActorCell> {
        let mut cached = self
            .head
            .lock()
            .map_err(|_| Error::Actor("the head handle lock was poisoned".into()))?;
        if cached.get_status() == ractor::ActorStatus::Running {
            return Ok(cached.clone());
        }
        match node::first_member(&self.scope, node::HEAD_GROUP) {
            Some(cell) => {
                *cached = cell.clone();
                Ok(cell)
            }
            None => Err(Error::Connect {
                address: self.address.clone(),
                reason: "the connection to the head is lost".into(),
            }),
        }
    }

    /// Sends a request to the head and decodes its reply. A [`HeadRequest::retryable`]
    /// request whose session closed before the reply is sent again once the head is
    /// reachable again, within `timeout`.
    pub(crate) async fn ask<T: DeserializeOwned>(&self, request: &HeadRequest, timeout: Duration) -> Result<T> {
        let what = request.name();
        let deadline = Instant::now() + timeout;
        let bytes = loop {
            let head = self.head_within(deadline, what, timeout).await?;
            let remaining = deadline.saturating_duration_since(Instant::now());
            match wire::call_raw(&head, wire::encode(request), remaining).await {
                Ok(bytes) => break bytes,
                Err(CallError::Timeout) => {
                    return Err(Error::Timeout {
                        what: format!("head request {what}"),
                        timeout,
                    })
                }
                Err(error) => {
                    // A request that never left can always be sent again; one that may
                    // have been delivered, only when asking twice does no harm.
                    let (unsent, cause) = match error {
                        CallError::NotSent(cause) => (true, cause),
                        CallError::Unreachable(cause) => (false, cause),
                        CallError::Timeout => (false, "no reply in time".to_string()),
                    };
                    // The head restarting or its session replaced: wait for the next one
                    // within the request's own timeout.
                    let waited = unsent || request.retryable();
                    let again = deadline.saturating_duration_since(Instant::now());
                    if waited && self.wait_for_another(&head, again).await {
                        tracing::debug!(what, %cause, "the head's session was replaced; asking again");
                        continue;
                    }
                    // Still no head after waiting for it: say so; else the request failed.
                    let reason = if waited && self.head().is_err() {
                        format!("head request {what}: the head did not come back within {timeout:?} ({cause})")
                    } else {
                        format!("head request {what} failed: {cause}")
                    };
                    return Err(Error::Connect {
                        address: self.address.clone(),
                        reason,
                    });
                }
            }
        };
        let reply: std::result::Result<T, Failure> =
            wire::decode(&bytes, "the head's reply").map_err(|f| failure_to_error(f, None))?;
        reply.map_err(|f| failure_to_error(f, None))
    }

    /// The head, waiting until `deadline` while it is away (restarting): a request that
    /// needs it waits for it rather than failing at once.
    async fn head_within(&self, deadline: Instant, what: &str, timeout: Duration) -> Result<ActorCell> {
        loop {
            match self.head() {
                Ok(head) => return Ok(head),
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::Connect {
                        address: self.address.clone(),
                        reason: format!("head request {what}: the head did not come back within {timeout:?} ({e})"),
                    })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Waits up to `grace` for a running head other than `lost` (the next session's).
    async fn wait_for_another(&self, lost: &ActorCell, grace: Duration) -> bool {
        let until = Instant::now() + grace;
        loop {
            if self.head().is_ok_and(|head| head.get_id() != lost.get_id()) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Sends a request without waiting for an answer; an error when it cannot be sent.
    pub(crate) fn send(&self, request: &HeadRequest) -> Result<()> {
        let head = self.head()?;
        wire::cast_raw(&head, wire::encode(request)).map_err(|cause| Error::Connect {
            address: self.address.clone(),
            reason: format!("head request {} could not be sent: {cause}", request.name()),
        })
    }

    /// Sends a request without waiting for an answer, logging a failure.
    pub(crate) fn tell(&self, request: &HeadRequest) {
        match self.head() {
            Ok(head) => {
                if let Err(e) = wire::cast_raw(&head, wire::encode(request)) {
                    tracing::debug!(error = %e, what = request.name(), "could not tell the head");
                }
            }
            Err(e) => tracing::debug!(error = %e, what = request.name(), "could not tell the head"),
        }
    }
}
