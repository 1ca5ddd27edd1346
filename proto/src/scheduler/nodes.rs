//! Membership and liveness: nodes register, heartbeat, go silent and are declared dead.

use super::{NodeRecord, Scheduler};
use crate::placement::{self, Ledger};
use crate::protocol::{ActorId, Failure, NodeInfo};

impl Scheduler {
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
            hosted: Default::default(),
        };
        for kind in &record.info.kinds {
            *self.kinds.entry(kind.clone()).or_insert(0) += 1;
        }
        let name = record.info.name.clone();
        self.nodes.insert(name.clone(), record);
        self.touch(&name);
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
            self.actor_lost(id, &format!("node {node} died: {cause}"), false, now_ms);
        }
    }

    pub(super) fn is_alive(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|n| n.dead_cause.is_none())
    }
}
