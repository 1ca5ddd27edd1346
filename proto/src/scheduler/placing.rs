//! Placing what waits: groups first, then actors, against the ledger.

use std::collections::BTreeSet;

use super::index::{Lookup, NodeState, Shape};
use super::{Bundle, Effect, NodeRecord, Placed, Scheduler, WaitKey};
use crate::placement::{self, Candidate, Decision, Ledger};
use crate::protocol::{ActorId, ActorState, DeathCause, GroupId, StartActor};
use crate::resources::Resources;

impl Scheduler {
    /// Places whatever can be placed now: groups first (in order), then waiting actors in
    /// the order they were submitted, skipping requests like one that already failed in
    /// this pass. Nothing is placed while a restored head waits for its nodes to register
    /// again (see [`Scheduler::await_rejoin`]).
    pub fn schedule(&mut self, now_ms: u64) -> Vec<Effect> {
        if !self.rejoining.is_empty() {
            return Vec::new();
        }
        let group_ids: Vec<GroupId> = self
            .groups
            .iter()
            .filter(|(_, g)| g.bundles.iter().any(Option::is_none))
            .map(|(id, _)| *id)
            .collect();
        for id in group_ids {
            self.place_group(id);
        }
        let mut effects = Vec::new();
        let mut failed: BTreeSet<WaitKey> = BTreeSet::new();
        loop {
            let next = self
                .waiting
                .iter()
                .filter(|(key, _)| !failed.contains(*key))
                .filter_map(|(key, ids)| ids.first().map(|id| (*id, key)))
                .min();
            let Some((id, key)) = next else { break };
            let key = key.clone();
            match self.place_one(id, now_ms) {
                Some(effect) => effects.push(effect),
                None if self.is_waiting(id) => {
                    failed.insert(key);
                }
                None => {}
            }
        }
        effects
    }

    pub(super) fn is_waiting(&self, id: ActorId) -> bool {
        self.actors
            .get(&id)
            .is_some_and(|a| matches!(a.state, ActorState::Pending | ActorState::Restarting))
    }

    /// Queues an actor that waits to be placed (pending or restarting).
    pub(super) fn enqueue(&mut self, id: ActorId) {
        if let Some(actor) = self.actors.get(&id) {
            self.waiting.entry(WaitKey::of(&actor.spec)).or_default().insert(id);
        }
    }

    /// Takes an actor out of the waiting queue (placed or dead).
    pub(super) fn dequeue(&mut self, id: ActorId) {
        let Some(actor) = self.actors.get(&id) else { return };
        let key = WaitKey::of(&actor.spec);
        if let Some(ids) = self.waiting.get_mut(&key) {
            ids.remove(&id);
            if ids.is_empty() {
                self.waiting.remove(&key);
            }
        }
    }

    /// Refreshes a node's place in the placement index after its ledger, actors or
    /// liveness changed.
    pub(super) fn touch(&mut self, node: &str) {
        if let Some(rec) = self.nodes.get(node) {
            self.index.refresh(rec.state());
        }
    }

    /// Records that `id` now runs (or is starting) on `node`.
    pub(super) fn host(&mut self, node: &str, id: ActorId) {
        if let Some(rec) = self.nodes.get_mut(node) {
            rec.hosted.insert(id);
        }
        self.touch(node);
    }

    /// Records that `id` left `node`.
    pub(super) fn unhost(&mut self, node: &str, id: ActorId) {
        if let Some(rec) = self.nodes.get_mut(node) {
            rec.hosted.remove(&id);
        }
        self.touch(node);
    }

    /// Where a free actor of `kind` asking for `request` goes: the placement index's
    /// answer, which is [`placement::place_actor`]'s over the alive nodes of that kind.
    pub(super) fn decide(&mut self, kind: &str, request: &Resources) -> Decision<String> {
        let shape = Shape {
            kind: kind.to_string(),
            request: request.clone(),
        };
        let nodes = &self.nodes;
        match self.index.lookup(&shape, || nodes.values().map(NodeRecord::state)) {
            Lookup::Fits(node) => Decision::Place(node),
            Lookup::Busy => Decision::Busy,
            Lookup::Never => Decision::Infeasible(placement::describe_missing(&self.candidates(Some(kind)), request)),
        }
    }

    pub(super) fn place_group(&mut self, id: GroupId) {
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
            self.touch(&node);
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

    pub(super) fn place_one(&mut self, id: ActorId, now_ms: u64) -> Option<Effect> {
        let actor = self.actors.get(&id)?;
        let spec = actor.spec.clone();
        let placed = match &spec.placement {
            Some(bundle_ref) => self.allocate_in_group(bundle_ref.group, bundle_ref.bundle, &spec.resources),
            None => match self.decide(&spec.kind, &spec.resources) {
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
                    self.set_dead(id, DeathCause::Unplaceable { why });
                    let _ = now_ms;
                    return None;
                }
            },
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
        actor.last_node = Some(placed.node.clone());
        let node = placed.node.clone();
        actor.placed = Some(placed);
        self.dequeue(id);
        self.host(&node, id);
        Some(Effect::Start(start))
    }

    pub(super) fn allocate_in_group(
        &mut self,
        group: GroupId,
        bundle: Option<usize>,
        request: &Resources,
    ) -> Option<Placed> {
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

    pub(super) fn candidates(&self, kind: Option<&str>) -> Vec<Candidate<'_>> {
        self.nodes
            .values()
            .filter(|n| n.dead_cause.is_none())
            .filter(|n| kind.is_none_or(|k| n.info.kinds.iter().any(|x| x == k)))
            .map(|n| Candidate {
                node: &n.info.name,
                ledger: &n.ledger,
                #[cfg(test)]
                actors: n.hosted.len(),
            })
            .collect()
    }
}

impl NodeRecord {
    fn state(&self) -> NodeState<'_> {
        NodeState {
            name: &self.info.name,
            kinds: &self.info.kinds,
            ledger: &self.ledger,
            actors: self.hosted.len(),
            alive: self.dead_cause.is_none(),
        }
    }
}
