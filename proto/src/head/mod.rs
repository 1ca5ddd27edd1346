//! The head as a state machine: [`HeadCore::handle`] takes one request (and the time) and
//! returns what to answer and what to do, [`HeadCore::tick`] does the same for the
//! liveness timer. Requests that must wait — for an actor to come alive, a group to be
//! placed, an object id to be registered — are parked here, not in the actor shell, which
//! only maps [`ReplyTo`] tokens to its reply ports, encodes [`Answer`]s and carries out
//! [`Output`]s.

//!
//! Inside: the core loop here (routing, settling waits, the liveness tick); what it hands
//! back in `output.rs`; the object directory's requests in `objects.rs`; what survives a
//! restart in `durable.rs`.

use std::collections::BTreeMap;

use crate::object::{Directory, Fanout, Missing, ObjectId};
use crate::protocol::{
    ActorId, ActorState, ActorView, ClusterStatus, Failure, GroupId, HeadRequest, NodeInfo, RunningActor, StartFailure,
};
use crate::runs::RunBook;
use crate::scheduler::{Effect, Scheduler};
use crate::view::{View, ViewQuery};

mod durable;
mod objects;
mod output;
mod waits;

pub use durable::{Change, ChangeRef, Saved, Snapshot};
pub use output::{Answer, Notice, Output, ReplyTo};

use objects::{missing_answer, Parked, PullWait, PullWakes};
use output::{answer, answer_with_effects};

/// The head's whole decision state: the scheduler, the object directory and the requests
/// waiting on them.
pub struct HeadCore {
    scheduler: Scheduler,
    directory: Directory,
    heartbeat_timeout_ms: u64,
    actor_waiters: BTreeMap<ActorId, Vec<ReplyTo>>,
    group_waiters: BTreeMap<GroupId, Vec<ReplyTo>>,
    object_waiters: BTreeMap<ObjectId, Vec<Parked>>,
    runs: RunBook,
    /// Broadcast pulls under way. Not saved: after a restart pulls start afresh.
    fanout: Fanout,
    /// Pulls held back by object, oldest first. Not saved: their callers ask the next head
    /// again.
    pull_waiters: BTreeMap<ObjectId, Vec<PullWait>>,
    pull_wakes: PullWakes,
    /// Parked `ObjectsWait`s. Not saved, as other waits.
    object_waits: Vec<waits::ObjectsWait>,
    /// The directory changed since the parked waits were last looked at.
    object_waits_stale: bool,
    /// The fingerprint of the authorities the head trusts (0: not told yet). Not saved: the
    /// head tells it at each start.
    trust: u64,
}

impl HeadCore {
    /// A head with no nodes; nodes silent for `heartbeat_timeout_ms` are declared dead and
    /// unreferenced objects are released `object_grace_ms` after their last reference.
    pub fn new(heartbeat_timeout_ms: u64, object_grace_ms: u64) -> Self {
        Self {
            scheduler: Scheduler::new(),
            directory: Directory::new(object_grace_ms),
            heartbeat_timeout_ms,
            actor_waiters: BTreeMap::new(),
            group_waiters: BTreeMap::new(),
            object_waiters: BTreeMap::new(),
            runs: RunBook::new(),
            fanout: Fanout::new(crate::object::fanout::DEFAULT_PER_SOURCE),
            pull_waiters: BTreeMap::new(),
            pull_wakes: PullWakes::default(),
            object_waits: Vec::new(),
            object_waits_stale: false,
            trust: 0,
        }
    }

    /// The same head letting one holder serve at most `per_source` network pulls of a large
    /// object at once (0: no limit); see [`Fanout`].
    pub fn with_object_fanout(self, per_source: usize) -> Self {
        Self {
            fanout: Fanout::new(per_source),
            ..self
        }
    }

    /// The scheduler, for reading (metrics, discovery targets).
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The cluster's status, objects included.
    pub fn status(&self, now_ms: u64) -> ClusterStatus {
        let mut status = self.scheduler.status(now_ms);
        status.objects = self.directory.stats();
        status
    }

    /// One page of [`HeadRequest::StatusPage`].
    pub fn status_page(&self, after: Option<ActorId>, limit: usize, now_ms: u64) -> ClusterStatus {
        let mut page = match after {
            None => self.status_without_actors(now_ms),
            Some(_) => ClusterStatus {
                nodes: Vec::new(),
                groups: Vec::new(),
                actors: Vec::new(),
                pending: Vec::new(),
                objects: Default::default(),
            },
        };
        page.actors = self.scheduler.actor_lines_after(after, limit);
        page
    }

    fn status_without_actors(&self, now_ms: u64) -> ClusterStatus {
        let mut status = self.scheduler.status_without_actors(now_ms);
        status.objects = self.directory.stats();
        status
    }

    /// Answers a dashboard query.
    pub fn view(&self, query: ViewQuery, now_ms: u64) -> View {
        match query {
            ViewQuery::Overview => {
                let mut overview = self.scheduler.overview();
                overview.objects = self.directory.stats();
                overview.runs = self.runs.len();
                View::Overview(overview)
            }
            ViewQuery::Nodes(page) => {
                View::Nodes(self.scheduler.node_page(page, now_ms, &self.directory.bytes_by_node()))
            }
            ViewQuery::Actors(filter, page) => View::Actors(self.scheduler.actor_page(&filter, page, now_ms)),
            ViewQuery::Actor(id) => View::Actor(self.scheduler.actor_row(id, now_ms)),
            ViewQuery::Groups(page) => View::Groups(self.scheduler.group_page(page)),
            ViewQuery::Runs => View::Runs(self.runs.summaries(now_ms)),
            ViewQuery::Run(name) => View::Run(self.runs.detail(&name, now_ms)),
        }
    }

    /// Handles one request; `to` is `None` for casts (no answer wanted).
    pub fn handle(&mut self, request: HeadRequest, to: Option<ReplyTo>, now_ms: u64) -> Vec<Output> {
        let mut out = Vec::new();
        self.request(request, to, now_ms, &mut out);
        self.wake_pulls(now_ms, &mut out);
        self.settle(now_ms, &mut out);
        out
    }

    /// The liveness timer: declares silent nodes dead, releases unreferenced objects,
    /// answers object lookups whose id never arrived, and lets go the held-back pulls
    /// whose holder's share a lapsed lease freed.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Output> {
        self.tick_logged(now_ms).0
    }

    /// [`HeadCore::tick`], with the change to log when it made one.
    pub fn tick_logged(&mut self, now_ms: u64) -> (Vec<Output>, Option<Change>) {
        let lost = self.scheduler.expire(now_ms, self.heartbeat_timeout_ms);
        let mut out = self.tick_after(lost.clone(), now_ms);
        // Any output means a change: a wait that ran out also drops a parked reference.
        let changed = !lost.is_empty() || !out.is_empty();
        // Pulls let go change nothing that is saved: decided after the change is.
        self.fanout.expire(now_ms);
        self.pull_wakes.all = true;
        self.wake_pulls(now_ms, &mut out);
        (out, changed.then_some(Change::Tick { lost, now_ms }))
    }

    /// The rest of a tick once `lost` nodes were declared dead (by the scheduler now, or
    /// by the log when replayed).
    fn tick_after(&mut self, lost: Vec<(String, String)>, now_ms: u64) -> Vec<Output> {
        let mut out = Vec::new();
        for (node, cause) in lost {
            // Replayed, the scheduler has not declared it dead yet (live, this is a no-op).
            self.scheduler.lose_node(&node, &cause, now_ms);
            self.node_dead(node, cause, now_ms, &mut out);
        }
        out.extend(self.directory.collect(now_ms).into_iter().map(Output::Release));
        for (id, parked) in std::mem::take(&mut self.object_waiters) {
            let (due, keep): (Vec<_>, Vec<_>) = parked.into_iter().partition(|p| p.deadline_ms <= now_ms);
            for p in due {
                out.push(Output::Reply(p.to, missing_answer(&p.request, id, Missing::Unknown)));
            }
            if !keep.is_empty() {
                self.object_waiters.insert(id, keep);
            }
        }
        self.settle(now_ms, &mut out);
        out
    }

    /// A node the scheduler declared dead: its objects are lost too.
    fn node_dead(&mut self, node: String, cause: String, now_ms: u64, out: &mut Vec<Output>) {
        let objects_lost = self.directory.node_lost(&node, now_ms).len();
        self.object_waits_stale = true;
        self.fanout.node_gone(&node);
        self.pull_wakes.all = true;
        out.push(Output::Notice(Notice::NodeDead {
            node,
            cause,
            objects_lost,
        }));
    }

    /// Forgets waiters whose callers gave up (the shell knows which ports closed), so
    /// abandoned waits do not pile up.
    pub fn forget(&mut self, gone: impl Fn(ReplyTo) -> bool) {
        for waiters in self.actor_waiters.values_mut().chain(self.group_waiters.values_mut()) {
            waiters.retain(|to| !gone(*to));
        }
        for parked in self.object_waiters.values_mut() {
            parked.retain(|p| !gone(p.to));
        }
        for waiters in self.pull_waiters.values_mut() {
            waiters.retain(|wait| !gone(wait.to));
        }
        self.object_waits.retain(|wait| !gone(wait.to));
        self.pull_waiters.retain(|_, w| !w.is_empty());
        self.actor_waiters.retain(|_, w| !w.is_empty());
        self.group_waiters.retain(|_, w| !w.is_empty());
        self.object_waiters.retain(|_, w| !w.is_empty());
    }

    /// How many requests are parked (actor, group and object waits, held-back pulls).
    pub fn parked(&self) -> usize {
        self.actor_waiters.values().map(Vec::len).sum::<usize>()
            + self.group_waiters.values().map(Vec::len).sum::<usize>()
            + self.object_waiters.values().map(Vec::len).sum::<usize>()
            + self.pull_waiters.values().map(Vec::len).sum::<usize>()
            + self.object_waits.len()
    }

    /// After any change: place what waits, then answer the waits that are over.
    fn settle(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        out.extend(self.scheduler.schedule(now_ms).into_iter().map(Output::Effect));
        for (id, waiters) in std::mem::take(&mut self.actor_waiters) {
            match self.scheduler.actor_view(id) {
                Some(view) if matches!(view.state, ActorState::Alive | ActorState::Dead { .. }) => {
                    for to in waiters {
                        out.push(Output::Reply(to, Answer::Actor(Ok(view.clone()))));
                    }
                }
                Some(_) => {
                    self.actor_waiters.insert(id, waiters);
                }
                None => {}
            }
        }
        for (id, waiters) in std::mem::take(&mut self.group_waiters) {
            let outcome = match self.scheduler.group_nodes(id) {
                Ok(Some(nodes)) => Ok(nodes),
                Ok(None) => {
                    self.group_waiters.insert(id, waiters);
                    continue;
                }
                Err(failure) => Err(failure),
            };
            for to in waiters {
                out.push(Output::Reply(to, Answer::GroupPlaced(outcome.clone())));
            }
        }
        self.settle_waits(now_ms, out);
    }

    /// Routes one request to its handler; each answers `to` (when given) through `out`.
    fn request(&mut self, request: HeadRequest, to: Option<ReplyTo>, now: u64, out: &mut Vec<Output>) {
        match request {
            HeadRequest::Register(info, running) => self.register(info, &running, to, now, out),
            HeadRequest::Heartbeat {
                node,
                incarnation,
                removed_known,
                trust,
            } => {
                let known = self.scheduler.heartbeat(&node, incarnation, now);
                // Every node beats twice a second: the names are copied only for a node
                // that knows fewer than the head.
                let removed = (self.scheduler.removed_count() != removed_known)
                    .then(|| self.scheduler.removed_nodes().map(str::to_string).collect());
                let renew = self.trust != 0 && trust != self.trust;
                answer(to, Answer::Heartbeat(crate::Beat { known, removed, renew }), out);
            }
            HeadRequest::Trust(trust) => {
                self.trust = trust;
                answer(to, Answer::Done(Ok(())), out);
            }
            HeadRequest::RemoveNode(node) => {
                let (known, lost) = self.scheduler.remove_node(&node, now);
                if let Some(cause) = lost {
                    self.node_dead(node, cause, now, out);
                }
                answer(to, Answer::Removed(known), out);
            }
            HeadRequest::Spawn(spec) => answer(to, Answer::Spawned(self.scheduler.submit(spec, now)), out),
            HeadRequest::WaitActor(id) => self.wait_actor(id, to, out),
            HeadRequest::Announce(id) => self.announce(id, to, out),
            HeadRequest::Named(name) => answer(to, Answer::Named(self.scheduler.named(&name)), out),
            HeadRequest::View(query) => answer(to, Answer::View(Box::new(self.view(query, now))), out),
            HeadRequest::RunReport(point) => {
                let result = self
                    .runs
                    .report(point, now)
                    .map_err(|e| Failure::Rejected(e.to_string()));
                answer(to, Answer::Done(result), out);
            }
            HeadRequest::Kill(id) => {
                let result = self.scheduler.kill(id);
                answer_with_effects(to, result, out);
            }
            HeadRequest::CreateGroup(spec) => {
                answer(to, Answer::GroupCreated(self.scheduler.create_group(spec, now)), out);
            }
            HeadRequest::WaitGroup(id) => {
                if let Some(to) = to {
                    self.group_waiters.entry(id).or_default().push(to);
                }
            }
            HeadRequest::RemoveGroup(id) => {
                let result = self.scheduler.remove_group(id);
                answer_with_effects(to, result, out);
            }
            HeadRequest::Status => answer(to, Answer::Status(Box::new(self.status(now))), out),
            HeadRequest::StatusPage { after, limit } => {
                let page = self.status_page(after, limit as usize, now);
                answer(to, Answer::Status(Box::new(page)), out);
            }
            HeadRequest::EndJob(job) => self.end_job(&job, to, out),
            HeadRequest::Started {
                actor,
                attempt,
                outcome,
            } => self.started(actor, attempt, outcome, to, out),
            HeadRequest::Exited { actor, attempt, cause } => {
                out.push(Output::Notice(Notice::Exited {
                    actor,
                    cause: cause.clone(),
                }));
                self.scheduler.exited(actor, attempt, cause, now);
                answer(to, Answer::Done(Ok(())), out);
            }
            HeadRequest::Undelivered { actor, attempt, cause } => {
                if let Some(node) = self.scheduler.undelivered(actor, attempt, now) {
                    let cause = format!("start of actor {actor} undeliverable: {cause}");
                    self.scheduler.lose_node(&node, &cause, now);
                    self.node_dead(node, cause, now, out);
                }
                answer(to, Answer::Done(Ok(())), out);
            }
            HeadRequest::ObjectsWait {
                ids,
                wanted,
                timeout_ms,
            } => self.wait_objects(ids, wanted, timeout_ms, to, now, out),
            object => self.object_request(object, to, now, out),
        }
    }

    fn register(
        &mut self,
        info: NodeInfo,
        running: &[RunningActor],
        to: Option<ReplyTo>,
        now: u64,
        out: &mut Vec<Output>,
    ) {
        let (node, address, resources, kinds) = (
            info.name.clone(),
            info.address.clone(),
            info.resources.to_string(),
            info.kinds.clone(),
        );
        let result = self.scheduler.register(info, running, now);
        out.push(Output::Notice(match &result {
            Ok(registration) => Notice::NodeJoined {
                node,
                address,
                resources,
                kinds,
                kept: running.len() - registration.stop.len(),
                stopped: registration.stop.len(),
            },
            Err(failure) => Notice::RegistrationRefused(failure.clone()),
        }));
        answer(to, Answer::Registered(result), out);
    }

    /// Parks a wait for an actor until it is alive or dead; an unknown actor is refused.
    fn wait_actor(&mut self, id: ActorId, to: Option<ReplyTo>, out: &mut Vec<Output>) {
        let Some(to) = to else { return };
        if self.scheduler.actor_view(id).is_some() {
            self.actor_waiters.entry(id).or_default().push(to);
        } else {
            let refused = Failure::Rejected(format!("actor {id} does not exist"));
            out.push(Output::Reply(to, Answer::Actor(Err(refused))));
        }
    }

    /// Has a live actor's agent advertise it again.
    fn announce(&mut self, id: ActorId, to: Option<ReplyTo>, out: &mut Vec<Output>) {
        answer(to, Answer::Done(Ok(())), out);
        if let Some(ActorView {
            state: ActorState::Alive,
            node: Some(node),
            ..
        }) = self.scheduler.actor_view(id)
        {
            out.push(Output::Effect(Effect::Announce { node, actor: id }));
        }
    }

    fn end_job(&mut self, job: &str, to: Option<ReplyTo>, out: &mut Vec<Output>) {
        let effects = self.scheduler.end_job(job);
        out.extend(self.directory.end_job(job).into_iter().map(Output::Release));
        answer(to, Answer::Done(Ok(())), out);
        out.extend(effects.into_iter().map(Output::Effect));
    }

    fn started(
        &mut self,
        actor: ActorId,
        attempt: u32,
        outcome: Result<(), StartFailure>,
        to: Option<ReplyTo>,
        out: &mut Vec<Output>,
    ) {
        if let Err(cause) = &outcome {
            out.push(Output::Notice(Notice::StartFailed {
                actor,
                cause: cause.clone(),
            }));
        }
        self.scheduler.started(actor, attempt, outcome);
        answer(to, Answer::Done(Ok(())), out);
    }
}

#[cfg(test)]
mod tests;
