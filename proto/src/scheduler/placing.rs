//! Placing what waits: groups first, then actors, against the ledger.

use std::collections::BTreeMap;

use super::{Bundle, Effect, Placed, Scheduler};
use crate::placement::{self, Candidate, Decision, Ledger};
use crate::protocol::{ActorId, ActorState, GroupId, StartActor};
use crate::resources::Resources;

impl Scheduler {
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
        actor.last_node = Some(placed.node.clone());
        actor.placed = Some(placed);
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
}
