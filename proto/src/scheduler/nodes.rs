//! Membership and liveness: nodes register, heartbeat, go silent and are declared dead.

use std::collections::BTreeSet;

use super::{NodeRecord, Scheduler};
use crate::placement::{self, Ledger};
use crate::protocol::{ActorId, ActorState, Failure, Loss, NodeInfo, Registration, RunningActor};

impl Scheduler {
    /// A worker joins, or joins again: after a head restart, after the head lost it for a
    /// while, or as a new process under the same name. `running` is what it runs now.
    ///
    /// A node the head still counts alive, with the same resources and kinds, is taken
    /// back as it is: each actor placed there that it reports at the same attempt keeps
    /// running (the worker's truth for what runs), the others placed there are lost (they
    /// restart within their budget), and reported actors the head did not place there at
    /// that attempt go back in [`Registration::stop`] (the head's truth for what was
    /// asked). Any other node starts afresh: an earlier alive record of the name is
    /// declared dead first and every reported actor is stopped. A node whose declared
    /// capacity makes no sense is refused.
    pub fn register(&mut self, info: NodeInfo, running: &[RunningActor], now_ms: u64) -> Result<Registration, Failure> {
        if self.removed.contains(&info.name) {
            return Err(Failure::Rejected(format!(
                "node {} was removed from the cluster (regatta node remove): it cannot join again under this name",
                info.name
            )));
        }
        placement::validate_capacity(&info.resources)
            .map_err(|why| Failure::Rejected(format!("node {} refused: {why}", info.name)))?;
        self.rejoining.remove(&info.name);
        let same = self.nodes.get(&info.name).is_some_and(|rec| {
            rec.dead_cause.is_none() && rec.info.resources == info.resources && rec.info.kinds == info.kinds
        });
        self.next_incarnation += 1;
        let kept = if same {
            self.take_back(info, running, now_ms)
        } else {
            self.register_afresh(info, now_ms);
            BTreeSet::new()
        };
        let stop = running
            .iter()
            .map(|r| r.actor)
            .filter(|id| !kept.contains(id))
            .collect();
        Ok(Registration {
            incarnation: self.next_incarnation,
            stop,
        })
    }

    /// Re-registers a node the head counts alive; returns the actors it keeps.
    fn take_back(&mut self, info: NodeInfo, running: &[RunningActor], now_ms: u64) -> BTreeSet<ActorId> {
        let name = info.name.clone();
        let Some(rec) = self.nodes.get_mut(&name) else {
            return BTreeSet::new();
        };
        rec.info = info;
        rec.incarnation = self.next_incarnation;
        rec.last_heartbeat_ms = now_ms;
        let hosted: Vec<ActorId> = rec.hosted.iter().copied().collect();
        let mut kept = BTreeSet::new();
        let mut up = Vec::new();
        for id in hosted {
            let Some(actor) = self.actors.get(&id) else { continue };
            let current = matches!(actor.state, ActorState::Alive | ActorState::Starting);
            match running.iter().find(|r| r.actor == id && r.attempt == actor.attempt) {
                Some(report) if current => {
                    kept.insert(id);
                    if report.up {
                        up.push((id, actor.attempt));
                    }
                }
                _ => {
                    let cause = Loss::NodeRestarted { node: name.to_string() };
                    self.actor_lost(id, cause, true, now_ms);
                }
            }
        }
        // An actor up on the node whose start report the head never got.
        for (id, attempt) in up {
            self.started(id, attempt, Ok(()));
        }
        self.touch(&name);
        kept
    }

    /// Registers a node as new.
    fn register_afresh(&mut self, info: NodeInfo, now_ms: u64) {
        if self.is_alive(&info.name) {
            self.lose_node(&info.name, "the worker re-registered (it restarted)", now_ms);
        }
        let record = NodeRecord {
            ledger: Ledger::for_node(info.resources.clone()),
            info,
            incarnation: self.next_incarnation,
            dead_cause: None,
            since_ms: now_ms,
            last_heartbeat_ms: now_ms,
            hosted: Default::default(),
        };
        for kind in &record.info.kinds {
            *self.kinds.entry(kind.clone()).or_insert(0) += 1;
        }
        let name = record.info.name.clone();
        self.nodes.insert(name.clone(), record);
        self.touch(&name);
    }

    /// Records a heartbeat; false means the node is unknown, dead, a stale incarnation
    /// or one a restored head waits to hear register again, and must register again.
    pub fn heartbeat(&mut self, node: &str, incarnation: u64, now_ms: u64) -> bool {
        if self.rejoining.contains(node) || self.removed.contains(node) {
            return false;
        }
        match self.nodes.get_mut(node) {
            Some(rec) if rec.dead_cause.is_none() && rec.incarnation == incarnation => {
                rec.last_heartbeat_ms = now_ms;
                true
            }
            _ => false,
        }
    }

    /// Removes `node` for good: its name is refused from now on and, when it is alive, it
    /// is declared dead at once. Returns whether the node was known, and the cause when it
    /// was alive.
    pub fn remove_node(&mut self, node: &str, now_ms: u64) -> (bool, Option<String>) {
        self.removed.insert(node.to_string());
        let Some(rec) = self.nodes.get(node) else {
            return (false, None);
        };
        if rec.dead_cause.is_some() {
            return (true, None);
        }
        let cause = "removed from the cluster (regatta node remove)".to_string();
        self.lose_node(node, &cause, now_ms);
        (true, Some(cause))
    }

    /// The names removed for good, in order.
    pub fn removed_nodes(&self) -> impl Iterator<Item = &str> {
        self.removed.iter().map(String::as_str)
    }

    /// How many names were removed for good.
    pub fn removed_count(&self) -> usize {
        self.removed.len()
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
        self.rejoining.remove(node);
        let lost: Vec<ActorId> = rec.hosted.iter().copied().collect();
        for kind in &rec.info.kinds {
            if let Some(count) = self.kinds.get_mut(kind) {
                *count -= 1;
                if *count == 0 {
                    self.kinds.remove(kind);
                }
            }
        }
        self.touch(node);
        for group in self.groups.values_mut() {
            for slot in &mut group.bundles {
                if slot.as_ref().is_some_and(|b| b.node == node) {
                    *slot = None;
                    group.waiting_since_ms = now_ms;
                }
            }
        }
        for id in lost {
            let loss = Loss::NodeDied {
                node: node.to_string(),
                cause: cause.to_string(),
            };
            self.actor_lost(id, loss, false, now_ms);
        }
    }

    /// A node's state as `regatta status` and the dashboard show it: `alive`, `dead`, or
    /// `rejoining` (a restored head waits for it to register again).
    pub(super) fn node_state(&self, rec: &NodeRecord) -> &'static str {
        if rec.dead_cause.is_some() {
            "dead"
        } else if self.rejoining.contains(&rec.info.name) {
            "rejoining"
        } else {
            "alive"
        }
    }

    /// Sets every node's last heartbeat to 0 (tests compare states whose heartbeat times
    /// differ by design).
    #[cfg(test)]
    pub(crate) fn forget_heartbeats(&mut self) {
        for rec in self.nodes.values_mut() {
            rec.last_heartbeat_ms = 0;
        }
    }

    /// The incarnation an alive node heartbeats with.
    pub fn incarnation_of(&self, node: &str) -> Option<u64> {
        self.nodes
            .get(node)
            .filter(|n| n.dead_cause.is_none())
            .map(|n| n.incarnation)
    }

    pub(super) fn is_alive(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|n| n.dead_cause.is_none())
    }
}
