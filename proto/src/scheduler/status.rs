//! What the head shows: status, heartbeat ages, metrics targets.

use std::collections::BTreeMap;

use super::Scheduler;
use crate::protocol::{ActorId, ActorLine, ActorState, ClusterStatus, GroupStatus, NodeStatus, PendingLine};
use crate::resources::Resources;

impl Scheduler {
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
        ClusterStatus {
            actors: self.actor_lines_after(None, usize::MAX),
            ..self.status_without_actors(now_ms)
        }
    }

    /// [`Scheduler::status`] with no actors listed (nodes still count theirs).
    pub fn status_without_actors(&self, now_ms: u64) -> ClusterStatus {
        ClusterStatus {
            nodes: self.node_lines(now_ms),
            groups: self.group_lines(),
            actors: Vec::new(),
            pending: self.pending_lines(now_ms),
            objects: Default::default(),
        }
    }

    /// At most `limit` actor lines of ids above `after`, in id order.
    pub fn actor_lines_after(&self, after: Option<ActorId>, limit: usize) -> Vec<ActorLine> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, Excluded);
        self.actors
            .range((from, Unbounded))
            .filter_map(|(id, a)| {
                Some(ActorLine {
                    view: self.actor_view(*id)?,
                    name: a.spec.name.clone(),
                    resources: a.spec.resources.clone(),
                    gpu_ids: a.placed.as_ref().map(|p| p.allocation.gpu_ids()).unwrap_or_default(),
                })
            })
            .take(limit)
            .collect()
    }

    fn node_lines(&self, now_ms: u64) -> Vec<NodeStatus> {
        let mut placed = BTreeMap::<&str, usize>::new();
        for actor in self.actors.values() {
            if let Some(p) = &actor.placed {
                *placed.entry(p.node.as_str()).or_default() += 1;
            }
        }
        self.nodes
            .values()
            .map(|n| NodeStatus {
                name: n.info.name.clone(),
                address: n.info.address.clone(),
                state: self.node_state(n).to_string(),
                since_s: seconds_since(now_ms, n.since_ms),
                cause: n.dead_cause.clone(),
                total: n.ledger.total().clone(),
                used: if n.dead_cause.is_none() {
                    n.ledger.used()
                } else {
                    Resources::new()
                },
                kinds: n.info.kinds.clone(),
                actors: placed.get(n.info.name.as_str()).copied().unwrap_or(0),
            })
            .collect()
    }

    pub(super) fn group_lines(&self) -> Vec<GroupStatus> {
        self.groups
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
            .collect()
    }

    /// Groups with unplaced bundles, then actors waiting for resources.
    fn pending_lines(&self, now_ms: u64) -> Vec<PendingLine> {
        let groups = self
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
                waiting_s: seconds_since(now_ms, g.waiting_since_ms),
            });
        let actors = self
            .actors
            .iter()
            .filter(|(_, a)| matches!(a.state, ActorState::Pending | ActorState::Restarting))
            .map(|(id, a)| PendingLine {
                what: format!("actor {id} ({})", a.spec.kind),
                resources: a.spec.resources.to_string(),
                waiting_s: seconds_since(now_ms, a.waiting_since_ms),
            });
        groups.chain(actors).collect()
    }
}

fn seconds_since(now_ms: u64, since_ms: u64) -> f64 {
    now_ms.saturating_sub(since_ms) as f64 / 1000.0
}
