//! What a head keeps across its own restart: the snapshot, the change log's records and
//! how a restarted head is rebuilt from them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{HeadCore, Parked, PullWakes, ReplyTo};
use crate::object::{Directory, Fanout, ObjectId};
use crate::protocol::HeadRequest;
use crate::runs::RunBook;
use crate::scheduler::Scheduler;

/// What a head keeps across its own restart, borrowed for writing: the decisions that
/// cannot be rebuilt from the workers (nodes, actors with their specs and restart budgets,
/// names, placement groups, the object directory, training runs). Parked requests are not
/// kept: their callers' sessions closed with the head, and they ask again.
#[derive(Serialize)]
pub struct Snapshot<'a> {
    scheduler: &'a Scheduler,
    directory: &'a Directory,
    runs: &'a RunBook,
    parked: Vec<ParkedObject>,
    now_ms: u64,
}

/// An object request parked when the state was written: a reference that overtook its
/// object's registration still takes effect when the registration comes.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct ParkedObject {
    id: ObjectId,
    request: HeadRequest,
    deadline_ms: u64,
}

/// The reply token of requests replayed from the log: nobody waits for their answers.
pub(super) const REPLAYED: ReplyTo = ReplyTo(u64::MAX);

/// A change to the head's state, as its log records it: applying the changes logged after
/// a [`Snapshot`], in order, to the head it restores ([`HeadCore::replay`]) gives the
/// state the head had. The core decides deterministically from its state, the request
/// and the time; the one input it does not log, heartbeats, reaches the state only
/// through the nodes a tick declares dead, which [`Change::Tick`] names.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Change {
    /// A request that is not [`HeadRequest::reads_only`].
    Request {
        /// The request.
        request: HeadRequest,
        /// Whether its caller waited for an answer (parked requests depend on it).
        answered: bool,
        /// The head's clock when it was handled.
        now_ms: u64,
    },
    /// A liveness tick that changed something: the nodes it declared dead (node, cause).
    Tick {
        /// The nodes declared dead and why.
        lost: Vec<(String, String)>,
        /// The head's clock.
        now_ms: u64,
    },
}

/// A [`Change`] borrowed for writing: it encodes exactly as the `Change` it is read back
/// as, without copying the request (a spawn carries its constructor arguments).
#[derive(Clone, Copy, Debug, Serialize)]
pub enum ChangeRef<'a> {
    /// See [`Change::Request`].
    Request {
        /// The request.
        request: &'a HeadRequest,
        /// Whether its caller waited for an answer.
        answered: bool,
        /// The head's clock when it was handled.
        now_ms: u64,
    },
    /// See [`Change::Tick`].
    Tick {
        /// The nodes declared dead and why.
        lost: &'a [(String, String)],
        /// The head's clock.
        now_ms: u64,
    },
}

impl<'a> ChangeRef<'a> {
    /// The change a request makes, if it makes one.
    pub fn of(request: &'a HeadRequest, to: Option<ReplyTo>, now_ms: u64) -> Option<Self> {
        (!request.reads_only()).then_some(Self::Request {
            request,
            answered: to.is_some(),
            now_ms,
        })
    }
}

impl Change {
    /// The change borrowed for writing.
    pub fn as_ref(&self) -> ChangeRef<'_> {
        match self {
            Self::Request {
                request,
                answered,
                now_ms,
            } => ChangeRef::Request {
                request,
                answered: *answered,
                now_ms: *now_ms,
            },
            Self::Tick { lost, now_ms } => ChangeRef::Tick { lost, now_ms: *now_ms },
        }
    }

    /// The head's clock when the change was made.
    pub fn now_ms(&self) -> u64 {
        match self {
            Self::Request { now_ms, .. } | Self::Tick { now_ms, .. } => *now_ms,
        }
    }
}

/// A [`Snapshot`] read back.
#[derive(Deserialize)]
pub struct Saved {
    scheduler: Scheduler,
    directory: Directory,
    runs: RunBook,
    parked: Vec<ParkedObject>,
    now_ms: u64,
}

impl Saved {
    /// The head's clock when it was written: a restored head's clock goes on from there.
    pub fn saved_at_ms(&self) -> u64 {
        self.now_ms
    }
}

impl HeadCore {
    /// The state to write down at `now_ms`.
    pub fn snapshot(&self, now_ms: u64) -> Snapshot<'_> {
        let parked = self
            .object_waiters
            .iter()
            .flat_map(|(id, parked)| {
                parked.iter().map(|p| ParkedObject {
                    id: *id,
                    request: p.request.clone(),
                    deadline_ms: p.deadline_ms,
                })
            })
            .collect();
        Snapshot {
            scheduler: &self.scheduler,
            directory: &self.directory,
            runs: &self.runs,
            parked,
            now_ms,
        }
    }

    /// A head read back from `saved`, before the changes logged after it are replayed
    /// ([`HeadCore::replay`]) and its nodes are asked to register again
    /// ([`HeadCore::await_rejoin`]).
    pub fn restore(saved: Saved, heartbeat_timeout_ms: u64, object_grace_ms: u64) -> Self {
        let mut object_waiters: BTreeMap<ObjectId, Vec<Parked>> = BTreeMap::new();
        for p in saved.parked {
            object_waiters.entry(p.id).or_default().push(Parked {
                request: p.request,
                to: REPLAYED,
                deadline_ms: p.deadline_ms,
            });
        }
        Self {
            scheduler: saved.scheduler.rebuilt(),
            directory: saved.directory.with_grace(object_grace_ms),
            heartbeat_timeout_ms,
            actor_waiters: BTreeMap::new(),
            group_waiters: BTreeMap::new(),
            object_waiters,
            runs: saved.runs,
            fanout: Fanout::new(crate::object::fanout::DEFAULT_PER_SOURCE),
            pull_waiters: BTreeMap::new(),
            pull_wakes: PullWakes::default(),
            object_waits: Vec::new(),
            object_waits_stale: false,
            trust: 0,
        }
    }

    /// Applies one logged change again, as it was applied when logged; its answers and
    /// effects were carried out then and are dropped now. Requests parked by the replay
    /// stay parked until they take effect or their wait runs out, as they did; their
    /// callers, whose sessions closed with the old head, get no answer.
    pub fn replay(&mut self, change: Change) {
        match change {
            Change::Request {
                request,
                answered,
                now_ms,
            } => {
                self.handle(request, answered.then_some(REPLAYED), now_ms);
            }
            Change::Tick { lost, now_ms } => {
                self.tick_after(lost, now_ms);
            }
        }
    }

    /// After a restart (and the replay): every node it knew alive must register again,
    /// reporting what it runs, before anything new is placed (see
    /// [`Scheduler::await_rejoin`]).
    pub fn await_rejoin(&mut self, now_ms: u64) {
        self.scheduler.await_rejoin(now_ms);
    }

    /// Marks lost the objects whose copy was held by `node` outside the cluster's nodes
    /// (the head's own store, which does not survive the head); returns how many.
    pub fn objects_lost_with(&mut self, node: &str, now_ms: u64) -> usize {
        self.directory.node_lost(node, now_ms).len()
    }
}
