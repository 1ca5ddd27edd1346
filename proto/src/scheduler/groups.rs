//! Placement groups: reserve, wait for and remove bundles.

use super::{Effect, GroupRecord, Scheduler};
use crate::placement::{self, Decision};
use crate::protocol::{DeathCause, Failure, GroupId, GroupSpec};

impl Scheduler {
    /// Accepts a placement group, or refuses it at once when it can never be placed.
    pub fn create_group(&mut self, spec: GroupSpec, now_ms: u64) -> Result<GroupId, Failure> {
        for bundle in &spec.bundles {
            placement::validate_request(bundle).map_err(|e| Failure::Infeasible(e.to_string()))?;
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
                members: Default::default(),
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
        let members: Vec<_> = self.groups[&id].members.iter().copied().collect();
        let effects = self.kill_where(
            members,
            |a| a.spec.placement.as_ref().is_some_and(|p| p.group == id),
            DeathCause::GroupRemoved { group: id },
        );
        if let Some(group) = self.groups.remove(&id) {
            for bundle in group.bundles.into_iter().flatten() {
                if let Some(node) = self.nodes.get_mut(&bundle.node).filter(|n| n.dead_cause.is_none()) {
                    node.ledger.release(&bundle.reservation);
                }
                self.touch(&bundle.node);
            }
        }
        Ok(effects)
    }
}
