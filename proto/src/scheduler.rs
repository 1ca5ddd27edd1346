//! The head's bookkeeping: node membership and liveness, the resource ledger, the actor
//! directory with restart budgets, placement groups and the queue of waiting requests.
//!
//! Pure state machine: every method takes the time as `now_ms` and returns the [`Effect`]s
//! the head actor must carry out (start or stop an actor on a node). No sockets, no clock.

use std::collections::{BTreeMap, BTreeSet};

use crate::placement::{self, Allocation, Candidate, Decision, Ledger};
use crate::protocol::{
    ActorId, ActorLine, ActorSpec, ActorState, ActorView, ClusterStatus, Failure, GroupId, GroupSpec, GroupStatus,
    NodeInfo, NodeStatus, PendingLine, StartActor,
};
use crate::resources::Resources;

/// Something the head must do on a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Construct an actor there.
    Start(StartActor),
    /// Stop an actor there.
    Stop {
        /// The node.
        node: String,
        /// The actor.
        actor: ActorId,
    },
    /// Advertise an actor there again (see [`crate::protocol::HeadRequest::Announce`]).
    Announce {
        /// The node.
        node: String,
        /// The actor.
        actor: ActorId,
    },
}

struct NodeRecord {
    info: NodeInfo,
    incarnation: u64,
    ledger: Ledger,
    dead_cause: Option<String>,
    since_ms: u64,
    last_heartbeat_ms: u64,
}

struct Placed {
    node: String,
    allocation: Allocation,
    bundle: Option<(GroupId, usize)>,
}

struct ActorRecord {
    spec: ActorSpec,
    state: ActorState,
    restarts: u32,
    attempt: u32,
    placed: Option<Placed>,
    waiting_since_ms: u64,
}

struct Bundle {
    node: String,
    reservation: Allocation,
    ledger: Ledger,
}

struct GroupRecord {
    spec: GroupSpec,
    bundles: Vec<Option<Bundle>>,
    created: bool,
    waiting_since_ms: u64,
}

/// Dead actors remembered (for status and for telling callers why); older ones are
/// forgotten so a long-running head does not grow without bound.
pub const MAX_DEAD_ACTORS: usize = 10_000;

/// The head's cluster state.
#[derive(Default)]
pub struct Scheduler {
    dead_order: std::collections::VecDeque<ActorId>,
    nodes: BTreeMap<String, NodeRecord>,
    actors: BTreeMap<ActorId, ActorRecord>,
    named: BTreeMap<String, ActorId>,
    groups: BTreeMap<GroupId, GroupRecord>,
    next_actor: u64,
    next_group: u64,
    next_incarnation: u64,
}

impl Scheduler {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    // ----- membership -----

    /// A worker joins (or rejoins after a restart). Returns its incarnation number; an
    /// earlier incarnation of the same name is declared dead first. A node whose declared
    /// capacity makes no sense is refused.
    pub fn register(&mut self, info: NodeInfo, now_ms: u64) -> Result<u64, Failure> {
        placement::validate_capacity(&info.resources)
            .map_err(|why| Failure::Rejected(format!("node {} refused: {why}", info.name)))?;
        if self.is_alive(&info.name) {
            self.lose_node(&info.name, "the worker re-registered (it restarted)", now_ms);
        }
        self.next_incarnation += 1;
        let record = NodeRecord {
            ledger: Ledger::for_node(info.resources.clone()),
            info,
            incarnation: self.next_incarnation,
            dead_cause: None,
            since_ms: now_ms,
            last_heartbeat_ms: now_ms,
        };
        self.nodes.insert(record.info.name.clone(), record);
        Ok(self.next_incarnation)
    }

    /// Records a heartbeat; false means the node is unknown, dead or a stale incarnation
    /// and must register again.
    pub fn heartbeat(&mut self, node: &str, incarnation: u64, now_ms: u64) -> bool {
        match self.nodes.get_mut(node) {
            Some(rec) if rec.dead_cause.is_none() && rec.incarnation == incarnation => {
                rec.last_heartbeat_ms = now_ms;
                true
            }
            _ => false,
        }
    }

    /// Declares dead every node silent for longer than `timeout_ms`; returns each node lost
    /// with the cause.
    pub fn expire(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<(String, String)> {
        let silent: Vec<(String, u64)> = self
            .nodes
            .values()
            .filter(|n| n.dead_cause.is_none() && now_ms.saturating_sub(n.last_heartbeat_ms) > timeout_ms)
            .map(|n| (n.info.name.clone(), now_ms - n.last_heartbeat_ms))
            .collect();
        let mut lost = Vec::new();
        for (node, silent_ms) in silent {
            let cause = format!("no heartbeat for {silent_ms} ms (timeout {timeout_ms} ms)");
            self.lose_node(&node, &cause, now_ms);
            lost.push((node, cause));
        }
        lost
    }

    /// Marks a node dead: its actors restart elsewhere within their budget, the rest die
    /// with the cause; its placement-group bundles wait to be placed again.
    pub fn lose_node(&mut self, node: &str, cause: &str, now_ms: u64) {
        let Some(rec) = self.nodes.get_mut(node) else {
            return;
        };
        if rec.dead_cause.is_some() {
            return;
        }
        rec.dead_cause = Some(cause.to_string());
        rec.since_ms = now_ms;
        for group in self.groups.values_mut() {
            for slot in &mut group.bundles {
                if slot.as_ref().is_some_and(|b| b.node == node) {
                    *slot = None;
                    group.waiting_since_ms = now_ms;
                }
            }
        }
        let lost: Vec<ActorId> = self
            .actors
            .iter()
            .filter(|(_, a)| a.placed.as_ref().is_some_and(|p| p.node == node))
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            self.actor_lost(id, &format!("node {node} died: {cause}"), false, now_ms);
        }
    }

    fn is_alive(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|n| n.dead_cause.is_none())
    }

    // ----- actors -----

    /// Accepts an actor for placement, or refuses it at once when it can never run.
    pub fn submit(&mut self, spec: ActorSpec, now_ms: u64) -> Result<ActorId, Failure> {
        placement::validate_request(&spec.resources).map_err(Failure::Infeasible)?;
        if let Some(name) = &spec.name {
            if let Some(existing) = self.named.get(name) {
                if !matches!(self.actors[existing].state, ActorState::Dead { .. }) {
                    return Err(Failure::Rejected(format!(
                        "an actor named '{name}' already exists (actor {existing}); pick another name or kill it first"
                    )));
                }
            }
        }
        self.check_kind(&spec.kind)?;
        match &spec.placement {
            Some(bundle_ref) => self.check_bundle_fit(&spec, bundle_ref.group, bundle_ref.bundle)?,
            None => {
                let candidates = self.candidates(Some(&spec.kind));
                if let Decision::Infeasible(why) = placement::place_actor(&candidates, &spec.resources) {
                    return Err(Failure::Infeasible(format!(
                        "actor of kind '{}' asks for {}: {why}",
                        spec.kind, spec.resources
                    )));
                }
            }
        }
        self.next_actor += 1;
        let id = ActorId(self.next_actor);
        if let Some(name) = &spec.name {
            self.named.insert(name.clone(), id);
        }
        self.actors.insert(
            id,
            ActorRecord {
                spec,
                state: ActorState::Pending,
                restarts: 0,
                attempt: 0,
                placed: None,
                waiting_since_ms: now_ms,
            },
        );
        Ok(id)
    }

    fn check_kind(&self, kind: &str) -> Result<(), Failure> {
        let alive = self.nodes.values().filter(|n| n.dead_cause.is_none());
        let mut known: BTreeSet<&str> = BTreeSet::new();
        for node in alive {
            known.extend(node.info.kinds.iter().map(String::as_str));
        }
        if known.contains(kind) {
            return Ok(());
        }
        let list: Vec<&str> = known.into_iter().collect();
        Err(Failure::UnknownKind {
            kind: kind.to_string(),
            detail: if list.is_empty() {
                "no alive worker has joined yet".to_string()
            } else {
                format!("no alive worker registers it; registered kinds: {}", list.join(", "))
            },
        })
    }

    fn check_bundle_fit(&self, spec: &ActorSpec, group: GroupId, bundle: Option<usize>) -> Result<(), Failure> {
        let rec = self
            .groups
            .get(&group)
            .ok_or_else(|| Failure::Rejected(format!("placement group {group} does not exist")))?;
        let bundles: Vec<usize> = match bundle {
            Some(i) if i >= rec.spec.bundles.len() => {
                return Err(Failure::Rejected(format!(
                    "placement group {group} has {} bundles; bundle index {i} is out of range",
                    rec.spec.bundles.len()
                )))
            }
            Some(i) => vec![i],
            None => (0..rec.spec.bundles.len()).collect(),
        };
        let fits = bundles.iter().any(|i| {
            let reserved = Allocation {
                resources: rec.spec.bundles[*i].clone(),
                gpus: Vec::new(),
            };
            let mut ledger = Ledger::for_bundle(&reserved);
            // GPU indices are not known before placement: count whole GPUs as slots.
            let gpu_ok = spec.resources.fixed(crate::resources::GPU) <= reserved.resources.fixed(crate::resources::GPU);
            let mut without_gpu = spec.resources.clone();
            without_gpu.set_fixed(crate::resources::GPU, 0);
            gpu_ok && ledger.allocate(&without_gpu).is_some()
        });
        if fits {
            Ok(())
        } else {
            Err(Failure::Infeasible(format!(
                "actor of kind '{}' asks for {} which no chosen bundle of {group} holds",
                spec.kind, spec.resources
            )))
        }
    }

    /// Where an actor is; `None` for an id never issued.
    pub fn actor_view(&self, id: ActorId) -> Option<ActorView> {
        self.actors.get(&id).map(|a| ActorView {
            id,
            kind: a.spec.kind.clone(),
            state: a.state.clone(),
            node: a.placed.as_ref().map(|p| p.node.clone()),
            restarts: a.restarts,
        })
    }

    /// A named actor that is not dead.
    pub fn named(&self, name: &str) -> Option<ActorView> {
        let id = *self.named.get(name)?;
        self.actor_view(id)
            .filter(|v| !matches!(v.state, ActorState::Dead { .. }))
    }

    /// An agent reports that a start attempt finished.
    pub fn started(&mut self, id: ActorId, attempt: u32, outcome: Result<(), String>) {
        let Some(actor) = self.actors.get_mut(&id) else { return };
        if actor.attempt != attempt || actor.state != ActorState::Starting {
            return;
        }
        match outcome {
            Ok(()) => actor.state = ActorState::Alive,
            // A constructor that fails will fail again with the same arguments: no restart.
            Err(cause) => {
                self.release(id);
                self.set_dead(id, format!("constructor failed: {cause}"));
            }
        }
    }

    /// An agent reports that a running actor stopped (panic or error in a handler).
    pub fn exited(&mut self, id: ActorId, attempt: u32, cause: &str, now_ms: u64) {
        let current = self
            .actors
            .get(&id)
            .is_some_and(|a| a.attempt == attempt && matches!(a.state, ActorState::Alive | ActorState::Starting));
        if current {
            self.actor_lost(id, cause, true, now_ms);
        }
    }

    /// Kills an actor for good.
    pub fn kill(&mut self, id: ActorId) -> Result<Vec<Effect>, Failure> {
        let actor = self
            .actors
            .get(&id)
            .ok_or_else(|| Failure::Rejected(format!("actor {id} does not exist")))?;
        if matches!(actor.state, ActorState::Dead { .. }) {
            return Ok(Vec::new());
        }
        let effects = actor
            .placed
            .as_ref()
            .map(|p| Effect::Stop {
                node: p.node.clone(),
                actor: id,
            })
            .into_iter()
            .collect();
        self.release(id);
        self.set_dead(id, "killed by request".to_string());
        Ok(effects)
    }

    /// A job ended: its actors die (no restart) with the cause named.
    pub fn end_job(&mut self, job: &str) -> Vec<Effect> {
        self.kill_where(|a| a.spec.job.as_deref() == Some(job), &format!("job {job} ended"))
    }

    /// Kills every live actor matching `doomed` (no restart), stopping it on its node.
    fn kill_where(&mut self, doomed: impl Fn(&ActorRecord) -> bool, cause: &str) -> Vec<Effect> {
        let members: Vec<ActorId> = self
            .actors
            .iter()
            .filter(|(_, a)| !matches!(a.state, ActorState::Dead { .. }) && doomed(a))
            .map(|(id, _)| *id)
            .collect();
        let mut effects = Vec::new();
        for id in members {
            if let Some(p) = &self.actors[&id].placed {
                effects.push(Effect::Stop {
                    node: p.node.clone(),
                    actor: id,
                });
            }
            self.release(id);
            self.set_dead(id, cause.to_string());
        }
        effects
    }

    fn actor_lost(&mut self, id: ActorId, cause: &str, node_alive: bool, now_ms: u64) {
        if node_alive {
            self.release(id);
        } else {
            self.forget_placement(id);
        }
        let Some(actor) = self.actors.get_mut(&id) else { return };
        if actor.restarts < actor.spec.max_restarts {
            actor.restarts += 1;
            actor.state = ActorState::Restarting;
            actor.waiting_since_ms = now_ms;
        } else {
            let budget = actor.spec.max_restarts;
            self.set_dead(id, format!("{cause}; restart budget exhausted (max_restarts={budget})"));
        }
    }

    fn set_dead(&mut self, id: ActorId, cause: String) {
        let Some(actor) = self.actors.get_mut(&id) else { return };
        let first_time = !matches!(actor.state, ActorState::Dead { .. });
        actor.state = ActorState::Dead { cause };
        if first_time {
            self.dead_order.push_back(id);
            while self.dead_order.len() > MAX_DEAD_ACTORS {
                let Some(oldest) = self.dead_order.pop_front() else {
                    break;
                };
                if let Some(record) = self.actors.remove(&oldest) {
                    if let Some(name) = record.spec.name {
                        if self.named.get(&name) == Some(&oldest) {
                            self.named.remove(&name);
                        }
                    }
                }
            }
        }
    }

    /// Returns an actor's allocation to its node or bundle.
    fn release(&mut self, id: ActorId) {
        let Some(placed) = self.actors.get_mut(&id).and_then(|a| a.placed.take()) else {
            return;
        };
        let ledger = match placed.bundle {
            Some((group, index)) => self
                .groups
                .get_mut(&group)
                .and_then(|g| g.bundles.get_mut(index))
                .and_then(|b| b.as_mut())
                .filter(|b| b.node == placed.node)
                .map(|b| &mut b.ledger),
            None => self
                .nodes
                .get_mut(&placed.node)
                .filter(|n| n.dead_cause.is_none())
                .map(|n| &mut n.ledger),
        };
        if let Some(ledger) = ledger {
            ledger.release(&placed.allocation);
        }
    }

    fn forget_placement(&mut self, id: ActorId) {
        if let Some(actor) = self.actors.get_mut(&id) {
            actor.placed = None;
        }
    }

    // ----- placement groups -----

    /// Accepts a placement group, or refuses it at once when it can never be placed.
    pub fn create_group(&mut self, spec: GroupSpec, now_ms: u64) -> Result<GroupId, Failure> {
        for bundle in &spec.bundles {
            placement::validate_request(bundle).map_err(Failure::Infeasible)?;
        }
        let candidates = self.candidates(None);
        if let Decision::Infeasible(why) = placement::place_bundles(&candidates, &spec.bundles, spec.strategy) {
            return Err(Failure::Infeasible(format!("placement group: {why}")));
        }
        self.next_group += 1;
        let id = GroupId(self.next_group);
        let bundles = (0..spec.bundles.len()).map(|_| None).collect();
        self.groups.insert(
            id,
            GroupRecord {
                spec,
                bundles,
                created: false,
                waiting_since_ms: now_ms,
            },
        );
        Ok(id)
    }

    /// The node of each bundle once every bundle is placed; `Ok(None)` while waiting.
    pub fn group_nodes(&self, id: GroupId) -> Result<Option<Vec<String>>, Failure> {
        let group = self
            .groups
            .get(&id)
            .ok_or_else(|| Failure::Rejected(format!("placement group {id} does not exist (or was removed)")))?;
        Ok(group
            .bundles
            .iter()
            .map(|b| b.as_ref().map(|b| b.node.clone()))
            .collect())
    }

    /// Removes a group: its actors are killed and its reservations freed.
    pub fn remove_group(&mut self, id: GroupId) -> Result<Vec<Effect>, Failure> {
        if !self.groups.contains_key(&id) {
            return Err(Failure::Rejected(format!("placement group {id} does not exist")));
        }
        let effects = self.kill_where(
            |a| a.spec.placement.as_ref().is_some_and(|p| p.group == id),
            &format!("placement group {id} was removed"),
        );
        if let Some(group) = self.groups.remove(&id) {
            for bundle in group.bundles.into_iter().flatten() {
                if let Some(node) = self.nodes.get_mut(&bundle.node).filter(|n| n.dead_cause.is_none()) {
                    node.ledger.release(&bundle.reservation);
                }
            }
        }
        Ok(effects)
    }

    // ----- scheduling -----

    /// Places whatever can be placed now: groups first (in order), then actors (in order).
    pub fn schedule(&mut self, now_ms: u64) -> Vec<Effect> {
        let group_ids: Vec<GroupId> = self.groups.keys().copied().collect();
        for id in group_ids {
            self.place_group(id);
        }
        let waiting: Vec<ActorId> = self
            .actors
            .iter()
            .filter(|(_, a)| matches!(a.state, ActorState::Pending | ActorState::Restarting))
            .map(|(id, _)| *id)
            .collect();
        let mut effects = Vec::new();
        for id in waiting {
            if let Some(effect) = self.place_one(id, now_ms) {
                effects.push(effect);
            }
        }
        effects
    }

    fn place_group(&mut self, id: GroupId) {
        let Some(group) = self.groups.get(&id) else { return };
        let missing: Vec<usize> = (0..group.bundles.len())
            .filter(|i| group.bundles[*i].is_none())
            .collect();
        if missing.is_empty() {
            return;
        }
        let strategy = group.spec.strategy;
        let used: Vec<String> = group.bundles.iter().flatten().map(|b| b.node.clone()).collect();
        let wanted: Vec<Resources> = missing.iter().map(|i| group.spec.bundles[*i].clone()).collect();
        let candidates: Vec<Candidate<'_>> = self
            .candidates(None)
            .into_iter()
            .filter(|c| match strategy {
                placement::Strategy::StrictSpread => !used.iter().any(|u| u == c.node),
                placement::Strategy::StrictPack => used.first().is_none_or(|u| u == c.node),
                _ => true,
            })
            .collect();
        let Decision::Place(nodes) = placement::place_bundles(&candidates, &wanted, strategy) else {
            return;
        };
        for (index, node) in missing.into_iter().zip(nodes) {
            let Some(ledger) = self.nodes.get_mut(&node).map(|n| &mut n.ledger) else {
                continue;
            };
            let Some(reservation) = ledger.allocate(&self.groups[&id].spec.bundles[index]) else {
                continue;
            };
            let bundle = Bundle {
                ledger: Ledger::for_bundle(&reservation),
                node,
                reservation,
            };
            if let Some(group) = self.groups.get_mut(&id) {
                group.bundles[index] = Some(bundle);
            }
        }
        if let Some(group) = self.groups.get_mut(&id) {
            group.created = group.created || group.bundles.iter().all(Option::is_some);
        }
    }

    fn place_one(&mut self, id: ActorId, now_ms: u64) -> Option<Effect> {
        let actor = self.actors.get(&id)?;
        let spec = actor.spec.clone();
        let placed = match &spec.placement {
            Some(bundle_ref) => self.allocate_in_group(bundle_ref.group, bundle_ref.bundle, &spec.resources),
            None => {
                let candidates = self.candidates(Some(&spec.kind));
                match placement::place_actor(&candidates, &spec.resources) {
                    Decision::Place(node) => {
                        let allocation = self.nodes.get_mut(&node)?.ledger.allocate(&spec.resources)?;
                        Some(Placed {
                            node,
                            allocation,
                            bundle: None,
                        })
                    }
                    Decision::Busy => None,
                    Decision::Infeasible(why) => {
                        self.set_dead(id, format!("cannot be placed any more: {why}"));
                        let _ = now_ms;
                        return None;
                    }
                }
            }
        }?;
        let actor = self.actors.get_mut(&id)?;
        actor.attempt += 1;
        actor.state = ActorState::Starting;
        let start = StartActor {
            actor: id,
            attempt: actor.attempt,
            node: placed.node.clone(),
            kind: spec.kind,
            args: spec.args,
            resources: spec.resources,
            gpu_ids: placed.allocation.gpu_ids(),
            name: spec.name,
            job: spec.job,
        };
        actor.placed = Some(placed);
        Some(Effect::Start(start))
    }

    fn allocate_in_group(&mut self, group: GroupId, bundle: Option<usize>, request: &Resources) -> Option<Placed> {
        let rec = self.groups.get_mut(&group)?;
        let indices: Vec<usize> = match bundle {
            Some(i) => vec![i],
            None => (0..rec.bundles.len()).collect(),
        };
        for index in indices {
            if let Some(b) = rec.bundles.get_mut(index).and_then(|b| b.as_mut()) {
                if let Some(allocation) = b.ledger.allocate(request) {
                    return Some(Placed {
                        node: b.node.clone(),
                        allocation,
                        bundle: Some((group, index)),
                    });
                }
            }
        }
        None
    }

    fn candidates(&self, kind: Option<&str>) -> Vec<Candidate<'_>> {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for actor in self.actors.values() {
            if let Some(p) = &actor.placed {
                *counts.entry(p.node.as_str()).or_insert(0) += 1;
            }
        }
        self.nodes
            .values()
            .filter(|n| n.dead_cause.is_none())
            .filter(|n| kind.is_none_or(|k| n.info.kinds.iter().any(|x| x == k)))
            .map(|n| Candidate {
                node: &n.info.name,
                ledger: &n.ledger,
                actors: counts.get(n.info.name.as_str()).copied().unwrap_or(0),
            })
            .collect()
    }

    // ----- views -----

    /// Seconds since each alive node's last heartbeat.
    pub fn heartbeat_ages(&self, now_ms: u64) -> BTreeMap<String, f64> {
        self.nodes
            .values()
            .filter(|n| n.dead_cause.is_none())
            .map(|n| {
                (
                    n.info.name.clone(),
                    now_ms.saturating_sub(n.last_heartbeat_ms) as f64 / 1000.0,
                )
            })
            .collect()
    }

    /// `(node, metrics address)` of each alive node that serves metrics.
    pub fn metrics_targets(&self) -> Vec<(String, String)> {
        self.nodes
            .values()
            .filter(|n| n.dead_cause.is_none())
            .filter_map(|n| n.info.metrics_address.clone().map(|a| (n.info.name.clone(), a)))
            .collect()
    }

    /// A snapshot for `regatta status`.
    pub fn status(&self, now_ms: u64) -> ClusterStatus {
        let secs = |since: u64| now_ms.saturating_sub(since) as f64 / 1000.0;
        let nodes = self
            .nodes
            .values()
            .map(|n| NodeStatus {
                name: n.info.name.clone(),
                address: n.info.address.clone(),
                state: if n.dead_cause.is_none() { "alive" } else { "dead" }.to_string(),
                since_s: secs(n.since_ms),
                cause: n.dead_cause.clone(),
                total: n.ledger.total().clone(),
                used: if n.dead_cause.is_none() {
                    n.ledger.used()
                } else {
                    Resources::new()
                },
                kinds: n.info.kinds.clone(),
                actors: self
                    .actors
                    .values()
                    .filter(|a| a.placed.as_ref().is_some_and(|p| p.node == n.info.name))
                    .count(),
            })
            .collect();
        let groups = self
            .groups
            .iter()
            .map(|(id, g)| GroupStatus {
                id: *id,
                name: g.spec.name.clone(),
                strategy: g.spec.strategy,
                state: match (g.created, g.bundles.iter().all(Option::is_some)) {
                    (_, true) => "created",
                    (false, false) => "pending",
                    (true, false) => "rescheduling",
                }
                .to_string(),
                bundles: g
                    .spec
                    .bundles
                    .iter()
                    .zip(&g.bundles)
                    .map(|(r, b)| (r.clone(), b.as_ref().map(|b| b.node.clone())))
                    .collect(),
            })
            .collect();
        let actors = self
            .actors
            .iter()
            .filter_map(|(id, a)| {
                Some(ActorLine {
                    view: self.actor_view(*id)?,
                    name: a.spec.name.clone(),
                    resources: a.spec.resources.clone(),
                    gpu_ids: a.placed.as_ref().map(|p| p.allocation.gpu_ids()).unwrap_or_default(),
                })
            })
            .collect();
        let mut pending: Vec<PendingLine> = self
            .groups
            .iter()
            .filter(|(_, g)| g.bundles.iter().any(Option::is_none))
            .map(|(id, g)| PendingLine {
                what: format!("placement group {id} ({:?})", g.spec.strategy),
                resources: g
                    .spec
                    .bundles
                    .iter()
                    .map(|b| format!("{{{b}}}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                waiting_s: secs(g.waiting_since_ms),
            })
            .collect();
        pending.extend(
            self.actors
                .iter()
                .filter(|(_, a)| matches!(a.state, ActorState::Pending | ActorState::Restarting))
                .map(|(id, a)| PendingLine {
                    what: format!("actor {id} ({})", a.spec.kind),
                    resources: a.spec.resources.to_string(),
                    waiting_s: secs(a.waiting_since_ms),
                }),
        );
        ClusterStatus {
            nodes,
            groups,
            actors,
            pending,
            objects: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Strategy;
    use crate::protocol::BundleRef;

    fn node(name: &str, resources: &str) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            address: format!("{name}:1"),
            resources: Resources::parse_capacity(resources).unwrap(),
            kinds: vec!["echo".into()],
            pid: 1,
            metrics_address: None,
        }
    }

    fn spec(resources: &str, max_restarts: u32) -> ActorSpec {
        ActorSpec {
            kind: "echo".into(),
            args: Vec::new(),
            resources: Resources::parse_request(resources).unwrap(),
            name: None,
            max_restarts,
            placement: None,
            job: None,
        }
    }

    fn starts(effects: &[Effect]) -> Vec<StartActor> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Start(s) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }

    fn start_all(s: &mut Scheduler, effects: &[Effect]) {
        for st in starts(effects) {
            s.started(st.actor, st.attempt, Ok(()));
        }
    }

    #[test]
    fn lost_node_restarts_actors_elsewhere_within_budget() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=2"), 0).unwrap();
        let keep = s.submit(spec("CPU=1", 1), 0).unwrap();
        let lose = s.submit(spec("CPU=1", 0), 0).unwrap();
        let effects = s.schedule(0);
        assert!(starts(&effects).iter().all(|st| st.node == "w1"));
        start_all(&mut s, &effects);
        s.register(node("w2", "CPU=2"), 10).unwrap();
        s.heartbeat("w2", 2, 5_000);
        s.expire(5_000, 3_000);
        let effects = s.schedule(5_000);
        let restarted = starts(&effects);
        assert_eq!(restarted.len(), 1);
        assert_eq!(
            (restarted[0].actor, restarted[0].node.as_str(), restarted[0].attempt),
            (keep, "w2", 2)
        );
        let dead = s.actor_view(lose).unwrap();
        match dead.state {
            ActorState::Dead { cause } => {
                assert!(
                    cause.contains("node w1 died") && cause.contains("max_restarts=0"),
                    "{cause}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.actor_view(keep).unwrap().restarts, 1);
    }

    #[test]
    fn ending_a_job_kills_only_its_actors() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=4"), 0).unwrap();
        let mut in_job = spec("CPU=1", 3);
        in_job.job = Some("j1".into());
        let a = s.submit(in_job, 0).unwrap();
        let b = s.submit(spec("CPU=1", 0), 0).unwrap();
        let effects = s.schedule(0);
        start_all(&mut s, &effects);
        let effects = s.end_job("j1");
        assert_eq!(
            effects,
            vec![Effect::Stop {
                node: "w1".into(),
                actor: a
            }]
        );
        assert!(matches!(s.actor_view(a).unwrap().state, ActorState::Dead { cause } if cause == "job j1 ended"));
        assert_eq!(s.actor_view(b).unwrap().state, ActorState::Alive);
        assert_eq!(
            s.status(0).nodes[0].used.fixed("CPU"),
            10_000,
            "the job's CPU was freed"
        );
    }

    #[test]
    fn only_the_most_recent_dead_actors_are_remembered() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=1"), 0).unwrap();
        let first = s.submit(spec("", 0), 0).unwrap();
        s.kill(first).unwrap();
        for _ in 0..MAX_DEAD_ACTORS {
            let id = s.submit(spec("", 0), 0).unwrap();
            s.kill(id).unwrap();
        }
        assert!(s.actor_view(first).is_none(), "the oldest dead actor is forgotten");
        assert_eq!(s.status(0).actors.len(), MAX_DEAD_ACTORS);
    }

    #[test]
    fn a_node_declaring_absurd_gpus_is_refused() {
        let mut s = Scheduler::new();
        let err = s.register(node("w1", "GPU=100000"), 0).unwrap_err();
        assert!(matches!(err, Failure::Rejected(m) if m.contains("node w1 refused")));
        assert!(s.status(0).nodes.is_empty());
    }

    #[test]
    fn stale_start_reports_are_ignored() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=1"), 0).unwrap();
        let id = s.submit(spec("CPU=1", 5), 0).unwrap();
        let first = starts(&s.schedule(0)).remove(0);
        s.exited(id, first.attempt, "panicked", 1);
        let second = starts(&s.schedule(1)).remove(0);
        s.started(id, first.attempt, Ok(()));
        assert_eq!(s.actor_view(id).unwrap().state, ActorState::Starting);
        s.started(id, second.attempt, Ok(()));
        assert_eq!(s.actor_view(id).unwrap().state, ActorState::Alive);
    }

    #[test]
    fn busy_request_is_placed_when_resources_free_up() {
        let mut s = Scheduler::new();
        s.register(node("w1", "GPU=1"), 0).unwrap();
        let a = s.submit(spec("GPU=1", 0), 0).unwrap();
        let b = s.submit(spec("GPU=1", 0), 0).unwrap();
        let first = s.schedule(0);
        assert_eq!(starts(&first).len(), 1);
        assert_eq!(s.status(0).pending.len(), 1);
        start_all(&mut s, &first);
        assert!(s.schedule(1).is_empty());
        s.kill(a).unwrap();
        let next = starts(&s.schedule(2));
        assert_eq!(next.len(), 1);
        assert_eq!((next[0].actor, next[0].gpu_ids.clone()), (b, vec![0]));
    }

    #[test]
    fn infeasible_and_unknown_requests_fail_at_once() {
        let mut s = Scheduler::new();
        assert!(matches!(
            s.submit(spec("CPU=1", 0), 0),
            Err(Failure::UnknownKind { .. })
        ));
        s.register(node("w1", "CPU=2,GPU=4"), 0).unwrap();
        match s.submit(spec("GPU=8", 0), 0) {
            Err(Failure::Infeasible(msg)) => assert!(msg.contains("largest: GPU=4 on node w1"), "{msg}"),
            other => panic!("{other:?}"),
        }
        let mut unknown = spec("", 0);
        unknown.kind = "nope".into();
        match s.submit(unknown, 0) {
            Err(Failure::UnknownKind { detail, .. }) => assert!(detail.contains("echo"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn duplicate_live_name_is_rejected() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=2"), 0).unwrap();
        let mut named = spec("", 0);
        named.name = Some("svc".into());
        let id = s.submit(named.clone(), 0).unwrap();
        assert!(matches!(s.submit(named.clone(), 0), Err(Failure::Rejected(_))));
        assert_eq!(s.named("svc").unwrap().id, id);
        s.kill(id).unwrap();
        assert!(s.named("svc").is_none());
        assert!(s.submit(named, 0).is_ok());
    }

    #[test]
    fn group_bundles_are_reserved_and_actors_use_them() {
        let mut s = Scheduler::new();
        for name in ["w1", "w2", "w3"] {
            s.register(node(name, "CPU=4,GPU=1"), 0).unwrap();
        }
        let group = s
            .create_group(
                GroupSpec {
                    bundles: vec![Resources::parse_request("CPU=1,GPU=1").unwrap(); 3],
                    strategy: Strategy::StrictSpread,
                    name: None,
                },
                0,
            )
            .unwrap();
        s.schedule(0);
        let nodes = s.group_nodes(group).unwrap().unwrap();
        assert_eq!(nodes.iter().collect::<BTreeSet<_>>().len(), 3);
        // The reservation holds every GPU: a plain GPU actor must wait.
        let outside = s.submit(spec("GPU=1", 0), 0).unwrap();
        let mut inside = spec("GPU=1", 0);
        inside.placement = Some(BundleRef { group, bundle: Some(2) });
        let inside = s.submit(inside, 0).unwrap();
        let placed = starts(&s.schedule(0));
        assert_eq!(placed.len(), 1);
        assert_eq!((placed[0].actor, placed[0].node.clone()), (inside, nodes[2].clone()));
        assert_eq!(s.actor_view(outside).unwrap().state, ActorState::Pending);
        let effects = s.remove_group(group).unwrap();
        assert_eq!(effects.len(), 1);
        assert!(matches!(s.actor_view(inside).unwrap().state, ActorState::Dead { .. }));
        assert_eq!(starts(&s.schedule(1)).len(), 1, "freed GPUs go to the waiting actor");
    }

    #[test]
    fn group_on_a_lost_node_is_placed_again() {
        let mut s = Scheduler::new();
        for name in ["w1", "w2", "w3"] {
            s.register(node(name, "CPU=1"), 0).unwrap();
        }
        let group = s
            .create_group(
                GroupSpec {
                    bundles: vec![Resources::parse_request("CPU=1").unwrap(); 2],
                    strategy: Strategy::StrictSpread,
                    name: None,
                },
                0,
            )
            .unwrap();
        s.schedule(0);
        let before = s.group_nodes(group).unwrap().unwrap();
        s.lose_node(&before[0], "killed", 1);
        s.schedule(1);
        let after = s.group_nodes(group).unwrap().unwrap();
        assert_ne!(after[0], before[0]);
        assert_ne!(after[0], after[1]);
        assert_eq!(after[1], before[1]);
    }

    #[test]
    fn status_reports_used_resources_and_dead_nodes() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=4,accelerator_type:H100=1"), 0).unwrap();
        s.submit(spec("CPU=1,accelerator_type:H100", 0), 0).unwrap();
        s.schedule(0);
        let status = s.status(0);
        assert_eq!(status.nodes[0].used.to_string(), "CPU=1,accelerator_type:H100=0.001");
        s.lose_node("w1", "test", 2_000);
        let status = s.status(3_000);
        assert_eq!(status.nodes[0].state, "dead");
        assert_eq!(status.nodes[0].since_s, 1.0);
    }
}
