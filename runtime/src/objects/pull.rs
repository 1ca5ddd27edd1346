//! Getting an object: from this process's memory, else pulled from the holder the head
//! names (one pull per object at a time, however many getters wait for it), or restored
//! from its spilled copy, and cached here.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use regatta_net::Fetched;
use regatta_object_store::{Location, ObjectId};
use regatta_proto::HeadRequest;

use super::ObjectService;
use crate::error::{Error, Result};

pub(super) type Fetch = Shared<BoxFuture<'static, std::result::Result<Bytes, PullFailure>>>;

/// Why a pull found no copy, and whether asking the head again may help.
#[derive(Clone, Debug)]
pub(super) struct PullFailure {
    message: String,
    /// Every holder failed to answer (not corrupt, not refused): it may be dying, and the
    /// head will say so once it notices.
    transient: bool,
}

/// How long a node waits for the head to name the holder to pull from: in a broadcast the
/// head holds the answer until a holder has room, as long as the pulls ahead take; the
/// get's own timeout is what bounds a caller's wait.
const PULL_ASK_TIMEOUT: Duration = Duration::from_secs(600);

/// A pull under way: tells the head it ended when it did without keeping a copy here (a
/// kept copy's `ObjectAddSource` says so), whatever the way out (an error, the getters
/// giving up), so that the holder's share it held is free at once.
struct PullEnd<'a> {
    service: &'a ObjectService,
    id: ObjectId,
    kept: bool,
}

impl Drop for PullEnd<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.service.link.tell(&HeadRequest::ObjectPullEnded {
                id: self.id,
                node: self.service.node.clone(),
            });
        }
    }
}

/// Pause before pulling again from holders that did not answer.
const PULL_RETRY: Duration = Duration::from_millis(250);

impl ObjectService {
    /// The object's bytes: from memory without a copy, else pulled from a peer (mapped from
    /// a same-host peer's shared memory, or streamed; or restored from its spilled copy),
    /// checked, and cached here. A holder that cannot be reached is tried again until the
    /// head says what became of it (lost with its node) or the timeout ends.
    pub async fn get(self: &Arc<Self>, id: ObjectId, timeout: Duration) -> Result<Bytes> {
        if let Some(bytes) = self.memory().get(id) {
            return Ok(bytes);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let fetch = {
                let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                inflight
                    .entry(id)
                    .or_insert_with(|| {
                        let me = self.clone();
                        async move { me.pull(id).await }.boxed().shared()
                    })
                    .clone()
            };
            let outcome = tokio::time::timeout_at(deadline, fetch.clone()).await;
            {
                // The entry goes once its pull is over, or when this getter gave up and
                // nobody else waits on it (dropping it cancels the pull, which tells the
                // head). A pull other getters still wait on stays theirs, and a newer
                // pull's entry is not this one's to remove: one pull per node and object.
                let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                let ours = inflight.get(&id).is_some_and(|entry| entry.ptr_eq(&fetch));
                if ours && (outcome.is_ok() || fetch.strong_count() <= Some(2)) {
                    inflight.remove(&id);
                }
            }
            drop(fetch);
            match outcome {
                Ok(Ok(bytes)) => return Ok(bytes),
                Ok(Err(failure)) => {
                    let error = self.explain(id, &failure.message).await;
                    let again = tokio::time::Instant::now() + PULL_RETRY;
                    if failure.transient && matches!(error, Error::Rejected(_)) && again < deadline {
                        tracing::debug!(%id, reason = %failure.message, "no holder answered; asking again");
                        tokio::time::sleep_until(again).await;
                        continue;
                    }
                    return Err(error);
                }
                Err(_) => {
                    return Err(Error::Timeout {
                        what: format!("get of object {id}"),
                        timeout,
                    })
                }
            }
        }
    }

    /// Turns a failed pull into the typed error (lost, unknown) when the head knows why.
    pub(super) async fn explain(&self, id: ObjectId, message: &str) -> Error {
        match self
            .link
            .ask::<Location>(&HeadRequest::ObjectLocate(id), Duration::from_secs(5))
            .await
        {
            Err(e @ (Error::ObjectLost { .. } | Error::ObjectUnknown { .. })) => e,
            _ => Error::Rejected(format!("object {id} could not be read: {message}")),
        }
    }

    pub(super) async fn pull(self: Arc<Self>, id: ObjectId) -> std::result::Result<Bytes, PullFailure> {
        // Until this node keeps a copy (and tells the head), its pull may hold a share of a
        // holder's sending at the head; any other way out of here frees it.
        let mut end = PullEnd {
            service: &self,
            id,
            kept: false,
        };
        // The head names the holder to pull from first: in a broadcast it holds the answer
        // back until a holder has room in its share, for as long as the pulls ahead take.
        // The get's own timeout bounds the wait.
        let ask = HeadRequest::ObjectPull {
            id,
            node: self.node.clone(),
            address: self.address.clone(),
        };
        let location: Location = self.link.ask(&ask, PULL_ASK_TIMEOUT).await.map_err(|e| PullFailure {
            message: e.to_string(),
            transient: false,
        })?;
        let mut failures = Vec::new();
        // Whether every copy failed only for want of an answer (its holder may be dying).
        let mut transient = true;
        for (node, address) in &location.sources {
            if node == &self.node {
                continue;
            }
            let Ok(peer) = address.parse::<SocketAddr>() else {
                failures.push(format!("{node}: bad address {address}"));
                transient = false;
                continue;
            };
            match self
                .transfer
                .fetch(peer, node, id, location.size, location.checksum)
                .await
            {
                Ok(Fetched { bytes, segment }) => {
                    self.counters.transfer_in.fetch_add(location.size, Ordering::Relaxed);
                    if segment.is_some() {
                        self.counters.shared_in.fetch_add(location.size, Ordering::Relaxed);
                    }
                    end.kept = self.cache(id, bytes.clone()).await;
                    // The segment (an open descriptor) is kept while there is room for it: a
                    // reader here that maps objects itself maps these pages, not a copy.
                    if let (true, Some(segment)) = (end.kept, segment) {
                        self.keep_segment(id, segment);
                    }
                    return Ok(bytes);
                }
                Err(e) => {
                    tracing::warn!(%id, node = %node, error = %e, "pull failed; trying the next copy");
                    transient &= matches!(e, regatta_net::Error::Transfer(_) | regatta_net::Error::NotHeld { .. });
                    failures.push(format!("{node}: {e}"));
                }
            }
        }
        if let Some(url) = &location.spilled {
            match regatta_object_store::restore(url, id, location.size, location.checksum).await {
                Ok(bytes) => {
                    self.counters.restores.fetch_add(1, Ordering::Relaxed);
                    end.kept = self.cache(id, bytes.clone()).await;
                    return Ok(bytes);
                }
                Err(e) => {
                    failures.push(format!("spilled copy: {e}"));
                    transient = false;
                }
            }
        }
        if failures.is_empty() {
            failures.push("no copy is held anywhere".into());
            transient = false;
        }
        Err(PullFailure {
            message: failures.join("; "),
            transient,
        })
    }

    /// Keeps a pulled copy here if there is room, and tells the head; true when it is kept.
    pub(super) async fn cache(&self, id: ObjectId, bytes: Bytes) -> bool {
        if self.memory().contains(id) {
            return false;
        }
        match self.store(id, bytes).await {
            Ok(()) => {
                self.link.tell(&HeadRequest::ObjectAddSource {
                    id,
                    node: self.node.clone(),
                    address: self.address.clone(),
                });
                true
            }
            Err(e) => {
                tracing::debug!(%id, error = %e, "not caching a pulled object");
                false
            }
        }
    }
}
