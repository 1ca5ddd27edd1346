//! The object directory's requests: registrations, lookups parked until an id arrives,
//! and broadcast pulls held back until a holder has room.

use std::collections::BTreeSet;

use super::durable::REPLAYED;
use super::output::answer;
use super::{Answer, HeadCore, Notice, Output, ReplyTo};
use crate::object::{Missing, ObjectId, Plan};
use crate::protocol::{Failure, HeadRequest, HeldObject};

/// How long the head holds a lookup of an object id it has not heard of: registration of
/// a put is asynchronous, so a reference can overtake it.
pub const UNKNOWN_OBJECT_WAIT_MS: u64 = 2_000;

/// An object request waiting for its id to be registered.
pub(super) struct Parked {
    pub(super) request: HeadRequest,
    pub(super) to: ReplyTo,
    pub(super) deadline_ms: u64,
}

/// A pull held back until a holder has room in its share of a broadcast.
pub(super) struct PullWait {
    pub(super) node: String,
    pub(super) address: String,
    pub(super) to: ReplyTo,
}

/// Which held-back pulls to plan again after a request or a tick.
#[derive(Default)]
pub(super) struct PullWakes {
    /// Those of these objects (a pull of them ended, a copy appeared or went, or the
    /// object was freed).
    pub(super) objects: BTreeSet<ObjectId>,
    /// All of them (a node died, a lease may have lapsed).
    pub(super) all: bool,
}

impl HeadCore {
    /// The object directory's requests.
    pub(super) fn object_request(
        &mut self,
        request: HeadRequest,
        to: Option<ReplyTo>,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        self.object_waits_stale = true;
        match request {
            HeadRequest::ObjectPut {
                id,
                size,
                checksum,
                node,
                address,
                job,
            } => {
                let result = self.directory.put(id, size, checksum, &node, &node, &address, job);
                self.put_registered(id, result.map_err(|e| Failure::Rejected(e.to_string())), to, now, out);
            }
            HeadRequest::ObjectLocate(id) => match (self.directory.locate(id), to) {
                (Err(Missing::Unknown), Some(to)) => self.park(id, HeadRequest::ObjectLocate(id), to, now),
                (result, _) => answer(to, Answer::Location(result.map_err(|m| object_missing(id, m))), out),
            },
            HeadRequest::ObjectAddSource { id, node, address } => {
                self.fanout.ended(id, &node);
                self.pull_wakes.objects.insert(id);
                out.extend(self.directory.add_source(id, &node, &address).map(Output::Release));
            }
            HeadRequest::ObjectPull { id, node, address } => self.pull(id, node, address, to, now, out),
            HeadRequest::ObjectPullEnded { id, node } => self.pull_ended(id, &node),
            HeadRequest::ObjectsHeld { node, address, objects } => {
                self.objects_held(node, &address, &objects, to, now, out);
            }
            HeadRequest::ObjectRemoveSource { id, node, spilled_to } => {
                self.remove_source(id, &node, spilled_to.as_deref());
            }
            HeadRequest::ObjectAddRef { id, holder } => match (self.directory.add_ref(id, &holder), to) {
                (Err(Missing::Unknown), Some(to)) => self.park(id, HeadRequest::ObjectAddRef { id, holder }, to, now),
                (result, _) => answer(to, Answer::Done(result.map_err(|m| object_missing(id, m))), out),
            },
            HeadRequest::ObjectDropRef { id, holder } => self.directory.drop_ref(id, &holder, now),
            HeadRequest::ObjectFree(id) => {
                self.pull_wakes.objects.insert(id);
                out.extend(self.directory.free(id).map(Output::Release));
                answer(to, Answer::Done(Ok(())), out);
            }
            HeadRequest::HolderGone(holder) => self.directory.holder_gone(&holder, now),
            other => {
                // `request` routes every other kind itself; refuse rather than drop one
                // that a future change forgets to route.
                let refused = Failure::Rejected(format!("the head does not route '{}' requests", other.name()));
                answer(to, Answer::Done(Err(refused)), out);
            }
        }
    }

    /// A put's registration decided: a refusal is logged, and the requests parked until
    /// the id arrived take effect now.
    fn put_registered(
        &mut self,
        id: ObjectId,
        result: Result<(), Failure>,
        to: Option<ReplyTo>,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        if let Err(failure) = &result {
            out.push(Output::Notice(Notice::ObjectRefused(failure.clone())));
        }
        answer(to, Answer::Done(result), out);
        self.unpark(id, now, out);
    }

    /// A pull of `id` by `node` ended (done or given up): its holder's share is free again.
    fn pull_ended(&mut self, id: ObjectId, node: &str) {
        self.fanout.ended(id, node);
        // A pull still held back for that node was given up (its get timed out or
        // was dropped): answered now, it would take a share for nobody. A node's
        // requests arrive in order, so a later pull of its own is not among them.
        if let Some(waiters) = self.pull_waiters.get_mut(&id) {
            waiters.retain(|wait| wait.node != node);
        }
        // So is one parked until the object's id arrives.
        if let Some(parked) = self.object_waiters.get_mut(&id) {
            parked.retain(|p| !matches!(&p.request, HeadRequest::ObjectPull { node: n, .. } if n == node));
        }
        self.object_waiters.retain(|_, parked| !parked.is_empty());
        self.pull_wakes.objects.insert(id);
    }

    /// A (re)registering node's list of what it holds, reconciled with the directory.
    fn objects_held(
        &mut self,
        node: String,
        address: &str,
        objects: &[HeldObject],
        to: Option<ReplyTo>,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        let lost = self.directory.reconcile(&node, address, objects, now);
        if !lost.is_empty() {
            out.push(Output::Notice(Notice::ObjectsGone {
                node,
                objects: lost.len(),
            }));
        }
        answer(to, Answer::Done(Ok(())), out);
        // A lookup that overtook the object's registration is answered now.
        for held in objects {
            self.unpark(held.id, now, out);
        }
    }

    /// `node` dropped its copy of `id`, perhaps after spilling it to `spilled_to`.
    fn remove_source(&mut self, id: ObjectId, node: &str, spilled_to: Option<&str>) {
        // An object left with a spilled copy only is read from it: nothing to wait for.
        self.pull_wakes.objects.insert(id);
        if let Some(url) = spilled_to {
            self.directory.spilled(id, node, url);
        }
        self.directory.remove_source(id, node);
    }

    /// Handles again the requests parked until `id` was registered.
    fn unpark(&mut self, id: ObjectId, now: u64, out: &mut Vec<Output>) {
        for parked in self.object_waiters.remove(&id).unwrap_or_default() {
            self.request(parked.request, Some(parked.to), now, out);
        }
    }

    /// Where `node` should pull `id` from: answered now, or held back (behind the pulls
    /// held back before it) until a holder has room in its share. A pull nobody waits for
    /// (a cast, or one parked before a restart) is not planned: it would take a share for
    /// nothing.
    fn pull(
        &mut self,
        id: ObjectId,
        node: String,
        address: String,
        to: Option<ReplyTo>,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        let Some(to) = to.filter(|to| *to != REPLAYED) else {
            return;
        };
        let location = match self.directory.locate(id) {
            Ok(location) => location,
            Err(Missing::Unknown) => return self.park(id, HeadRequest::ObjectPull { id, node, address }, to, now),
            Err(missing) => {
                return out.push(Output::Reply(to, Answer::Location(Err(object_missing(id, missing)))));
            }
        };
        // Those held back go first: a share a lapsed lease freed is theirs. Any still held
        // found every holder busy, so this pull waits too unless it needs no share (a
        // same-host or small one).
        self.wake_pulls_of(id, now, out);
        match self.fanout.plan(id, location, &node, &address, now) {
            Plan::Go(location) => out.push(Output::Reply(to, Answer::Location(Ok(location)))),
            Plan::Wait => self
                .pull_waiters
                .entry(id)
                .or_default()
                .push(PullWait { node, address, to }),
        }
    }

    /// Plans again the held-back pulls that something may have let go (see [`PullWakes`]).
    pub(super) fn wake_pulls(&mut self, now: u64, out: &mut Vec<Output>) {
        let wakes = std::mem::take(&mut self.pull_wakes);
        let ids: Vec<ObjectId> = if wakes.all {
            self.pull_waiters.keys().copied().collect()
        } else {
            wakes.objects.into_iter().collect()
        };
        for id in ids {
            self.wake_pulls_of(id, now, out);
        }
    }

    /// Answers `id`'s held-back pulls, oldest first, while a holder has room (all of them
    /// when the object is gone); the rest stay held, in their order.
    fn wake_pulls_of(&mut self, id: ObjectId, now: u64, out: &mut Vec<Output>) {
        let Some(waiters) = self.pull_waiters.remove(&id) else {
            return;
        };
        let mut held = Vec::new();
        for wait in waiters {
            if !held.is_empty() {
                held.push(wait);
                continue;
            }
            match self.directory.locate(id) {
                Err(missing) => {
                    out.push(Output::Reply(
                        wait.to,
                        Answer::Location(Err(object_missing(id, missing))),
                    ));
                }
                Ok(location) => match self.fanout.plan(id, location, &wait.node, &wait.address, now) {
                    Plan::Go(location) => out.push(Output::Reply(wait.to, Answer::Location(Ok(location)))),
                    Plan::Wait => held.push(wait),
                },
            }
        }
        if !held.is_empty() {
            self.pull_waiters.insert(id, held);
        }
    }

    /// Holds an object request until the id is registered or the wait runs out.
    fn park(&mut self, id: ObjectId, request: HeadRequest, to: ReplyTo, now: u64) {
        self.object_waiters.entry(id).or_default().push(Parked {
            request,
            to,
            deadline_ms: now + UNKNOWN_OBJECT_WAIT_MS,
        });
    }
}

pub(super) fn object_missing(id: ObjectId, missing: Missing) -> Failure {
    Failure::ObjectMissing {
        id,
        lost_with: match missing {
            Missing::Unknown => None,
            Missing::Lost { node } => Some(node),
        },
    }
}

/// The "missing" answer to a parked object request, typed as that request's answer.
pub(super) fn missing_answer(request: &HeadRequest, id: ObjectId, missing: Missing) -> Answer {
    let failure = object_missing(id, missing);
    match request {
        HeadRequest::ObjectLocate(_) | HeadRequest::ObjectPull { .. } => Answer::Location(Err(failure)),
        _ => Answer::Done(Err(failure)),
    }
}
