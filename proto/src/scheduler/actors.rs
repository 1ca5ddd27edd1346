//! Actors: submission checks, starts and exits, restarts within their budget, kills.

use super::{ActorRecord, Effect, Scheduler, MAX_DEAD_ACTORS};
use crate::placement::{self, Allocation, Decision, Ledger};
use crate::protocol::{ActorId, ActorSpec, ActorState, ActorView, DeathCause, Failure, GroupId, Loss, StartFailure};

impl Scheduler {
    /// Accepts an actor for placement, or refuses it at once when it can never run.
    pub fn submit(&mut self, spec: ActorSpec, now_ms: u64) -> Result<ActorId, Failure> {
        placement::validate_request(&spec.resources).map_err(|e| Failure::Infeasible(e.to_string()))?;
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
                if let Decision::Infeasible(why) = self.decide(&spec.kind, &spec.resources) {
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
        if let Some(group) = spec.placement.as_ref().and_then(|at| self.groups.get_mut(&at.group)) {
            group.members.insert(id);
        }
        let spec = ActorSpec {
            resources: self.share(spec.resources),
            ..spec
        };
        self.actors.insert(
            id,
            Box::new(ActorRecord {
                spec,
                state: ActorState::Pending,
                restarts: 0,
                attempt: 0,
                placed: None,
                last_node: None,
                waiting_since_ms: now_ms,
            }),
        );
        self.enqueue(id);
        Ok(id)
    }

    pub(super) fn check_kind(&self, kind: &str) -> Result<(), Failure> {
        if self.kinds.contains_key(kind) {
            return Ok(());
        }
        let list: Vec<&str> = self.kinds.keys().map(String::as_str).collect();
        Err(Failure::UnknownKind {
            kind: kind.to_string(),
            detail: if list.is_empty() {
                "no alive worker has joined yet".to_string()
            } else {
                format!("no alive worker registers it; registered kinds: {}", list.join(", "))
            },
        })
    }

    pub(super) fn check_bundle_fit(
        &self,
        spec: &ActorSpec,
        group: GroupId,
        bundle: Option<usize>,
    ) -> Result<(), Failure> {
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
            address: a
                .placed
                .as_ref()
                .and_then(|p| self.nodes.get(&p.node))
                .map(|n| n.info.address.clone()),
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
    pub fn started(&mut self, id: ActorId, attempt: u32, outcome: Result<(), StartFailure>) {
        let Some(actor) = self.actors.get_mut(&id) else { return };
        if actor.attempt != attempt || actor.state != ActorState::Starting {
            return;
        }
        match outcome {
            Ok(()) => actor.state = ActorState::Alive,
            // A constructor that fails will fail again with the same arguments: no restart.
            Err(cause) => {
                self.release(id);
                self.set_dead(id, DeathCause::ConstructorFailed(cause));
            }
        }
    }

    /// An agent reports that a running actor stopped (panic or error in a handler).
    pub fn exited(&mut self, id: ActorId, attempt: u32, cause: Loss, now_ms: u64) {
        let current = self
            .actors
            .get(&id)
            .is_some_and(|a| a.attempt == attempt && matches!(a.state, ActorState::Alive | ActorState::Starting));
        if current {
            self.actor_lost(id, cause, true, now_ms);
        }
    }

    /// A start that never reached its node (the node's agent is unreachable): the actor
    /// waits again without spending a restart. Returns the node, which the caller declares
    /// lost; `None` for a stale report.
    pub fn undelivered(&mut self, id: ActorId, attempt: u32, now_ms: u64) -> Option<String> {
        let actor = self.actors.get(&id)?;
        if actor.attempt != attempt || actor.state != ActorState::Starting {
            return None;
        }
        let node = actor.placed.as_ref()?.node.clone();
        self.release(id);
        let actor = self.actors.get_mut(&id)?;
        actor.state = if actor.restarts == 0 {
            ActorState::Pending
        } else {
            ActorState::Restarting
        };
        actor.waiting_since_ms = now_ms;
        self.enqueue(id);
        Some(node)
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
        self.set_dead(id, DeathCause::Killed);
        Ok(effects)
    }

    /// A job ended: its actors die (no restart) with the cause named.
    pub fn end_job(&mut self, job: &str) -> Vec<Effect> {
        let all: Vec<ActorId> = self.actors.keys().copied().collect();
        let cause = DeathCause::JobEnded { job: job.to_string() };
        self.kill_where(all, |a| a.spec.job.as_deref() == Some(job), cause)
    }

    /// Kills every live actor among `among` matching `doomed` (no restart), stopping it on
    /// its node.
    pub(super) fn kill_where(
        &mut self,
        among: impl IntoIterator<Item = ActorId>,
        doomed: impl Fn(&ActorRecord) -> bool,
        cause: DeathCause,
    ) -> Vec<Effect> {
        let members: Vec<ActorId> = among
            .into_iter()
            .filter(|id| {
                self.actors
                    .get(id)
                    .is_some_and(|a| !matches!(a.state, ActorState::Dead { .. }) && doomed(a))
            })
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
            self.set_dead(id, cause.clone());
        }
        effects
    }

    pub(super) fn actor_lost(&mut self, id: ActorId, cause: Loss, node_alive: bool, now_ms: u64) {
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
            self.enqueue(id);
        } else {
            let max_restarts = actor.spec.max_restarts;
            self.set_dead(
                id,
                DeathCause::RestartsExhausted {
                    last: cause,
                    max_restarts,
                },
            );
        }
    }

    pub(super) fn set_dead(&mut self, id: ActorId, cause: DeathCause) {
        self.dequeue(id);
        let Some(actor) = self.actors.get_mut(&id) else { return };
        let first_time = !matches!(actor.state, ActorState::Dead { .. });
        actor.state = ActorState::Dead { cause };
        // A dead actor is no longer its group's to kill: members stay bounded by the live.
        if let Some(group) = actor
            .spec
            .placement
            .as_ref()
            .and_then(|at| self.groups.get_mut(&at.group))
        {
            group.members.remove(&id);
        }
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
    pub(super) fn release(&mut self, id: ActorId) {
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
        self.unhost(&placed.node, id);
    }

    pub(super) fn forget_placement(&mut self, id: ActorId) {
        if let Some(placed) = self.actors.get_mut(&id).and_then(|a| a.placed.take()) {
            self.unhost(&placed.node, id);
        }
    }
}
