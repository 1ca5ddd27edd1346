//! The dashboard's views of the scheduler: counts, node rows, actor pages. Each is one pass
//! over the records it reads (no per-node scan of every actor), so a page costs the same
//! at 1,000 nodes and 100,000 actors as a listing of them does.

use std::collections::BTreeMap;

use super::{ActorRecord, Scheduler};
use crate::protocol::{ActorId, ActorState, GroupStatus};
use crate::resources::{Resources, UNIT};
use crate::view::{ActorFilter, ActorRow, NodeRow, Overview, Page, PageRequest, ResourceUse, ACTOR_STATES};

impl Scheduler {
    /// Counts and resource totals (objects and runs are the head's to fill in).
    pub fn overview(&self) -> Overview {
        let mut overview = Overview {
            actors: ACTOR_STATES.iter().map(|s| (s.to_string(), 0)).collect(),
            ..Default::default()
        };
        let mut total = BTreeMap::<String, (u64, u64)>::new();
        for node in self.nodes.values() {
            if node.dead_cause.is_some() {
                overview.nodes_dead += 1;
                continue;
            }
            overview.nodes_alive += 1;
            overview.nodes_rejoining += usize::from(self.rejoining.contains(&node.info.name));
            let used = node.ledger.used();
            for (name, amount) in node.ledger.total().iter() {
                let entry = total.entry(name.to_string()).or_default();
                entry.0 += amount;
                entry.1 += used.fixed(name);
            }
        }
        overview.resources = total
            .into_iter()
            .map(|(name, (total, used))| ResourceUse {
                name,
                total: total as f64 / UNIT as f64,
                used: used as f64 / UNIT as f64,
            })
            .collect();
        for actor in self.actors.values() {
            *overview.actors.entry(actor.state.label().to_string()).or_default() += 1;
            if matches!(actor.state, ActorState::Pending | ActorState::Restarting) {
                overview.waiting += 1;
            }
        }
        for group in self.group_lines() {
            *overview.groups.entry(group.state).or_default() += 1;
        }
        overview.waiting += self
            .groups
            .values()
            .filter(|g| g.bundles.iter().any(Option::is_none))
            .count();
        overview
    }

    /// A page of nodes by name; `object_bytes` gives each node's object bytes.
    pub fn node_page(&self, page: PageRequest, now_ms: u64, object_bytes: &BTreeMap<String, u64>) -> Page<NodeRow> {
        page.take(self.nodes.values().map(|n| {
            let alive = n.dead_cause.is_none();
            NodeRow {
                name: n.info.name.clone(),
                address: n.info.address.clone(),
                state: self.node_state(n).to_string(),
                since_s: seconds(now_ms, n.since_ms),
                cause: n.dead_cause.clone(),
                heartbeat_age_s: alive.then(|| seconds(now_ms, n.last_heartbeat_ms)),
                total: n.ledger.total().clone(),
                used: if alive { n.ledger.used() } else { Resources::new() },
                kinds: n.info.kinds.clone(),
                actors: n.hosted.len(),
                object_bytes: object_bytes.get(&n.info.name).copied().unwrap_or(0),
            }
        }))
    }

    /// A page of the actors that pass `filter`, by id.
    pub fn actor_page(&self, filter: &ActorFilter, page: PageRequest, now_ms: u64) -> Page<ActorRow> {
        // Cheap checks on the record first: building a row clones strings.
        let quick = |a: &ActorRecord| {
            filter.kind.as_deref().is_none_or(|k| a.spec.kind == k)
                && filter.state.as_deref().is_none_or(|s| a.state.label() == s)
                && filter.job.as_deref().is_none_or(|j| a.spec.job.as_deref() == Some(j))
                && filter
                    .node
                    .as_deref()
                    .is_none_or(|n| a.placed.as_ref().is_some_and(|p| p.node == n))
                && filter
                    .name
                    .as_deref()
                    .is_none_or(|part| a.spec.name.as_deref().is_some_and(|n| n.contains(part)))
        };
        // A node filter reads that node's actors only.
        let hosted = filter.node.as_deref().map(|n| self.nodes.get(n).map(|rec| &rec.hosted));
        let ids: Box<dyn Iterator<Item = &ActorId>> = match hosted {
            None => Box::new(self.actors.keys()),
            Some(Some(ids)) => Box::new(ids.iter()),
            Some(None) => Box::new(std::iter::empty()),
        };
        let matching = ids
            .filter_map(|id| self.actors.get(id).map(|a| (id, a)))
            .filter(|(_, a)| quick(a));
        // Only the page's rows are built.
        let mut total = 0;
        let mut items = Vec::new();
        for (id, actor) in matching {
            if total >= page.offset && items.len() < page.limit {
                items.push(row(*id, actor, now_ms));
            }
            total += 1;
        }
        Page {
            total,
            offset: page.offset,
            limit: page.limit,
            items,
        }
    }

    /// One actor's row.
    pub fn actor_row(&self, id: ActorId, now_ms: u64) -> Option<ActorRow> {
        self.actors.get(&id).map(|a| row(id, a, now_ms))
    }

    /// A page of placement groups by id.
    pub fn group_page(&self, page: PageRequest) -> Page<GroupStatus> {
        page.take(self.group_lines().into_iter())
    }
}

fn row(id: ActorId, actor: &ActorRecord, now_ms: u64) -> ActorRow {
    let placement = actor.spec.placement.as_ref();
    ActorRow {
        id,
        kind: actor.spec.kind.clone(),
        name: actor.spec.name.clone(),
        state: actor.state.label().to_string(),
        cause: match &actor.state {
            ActorState::Dead { cause } => Some(cause.to_string()),
            _ => None,
        },
        node: actor.placed.as_ref().map(|p| p.node.clone()),
        last_node: actor.last_node.clone(),
        restarts: actor.restarts,
        max_restarts: actor.spec.max_restarts,
        job: actor.spec.job.clone(),
        resources: actor.spec.resources.clone(),
        gpu_ids: actor
            .placed
            .as_ref()
            .map(|p| p.allocation.gpu_ids())
            .unwrap_or_default(),
        group: placement.map(|b| (b.group.0, b.bundle)),
        waiting_s: matches!(actor.state, ActorState::Pending | ActorState::Restarting)
            .then(|| seconds(now_ms, actor.waiting_since_ms)),
    }
}

fn seconds(now_ms: u64, since_ms: u64) -> f64 {
    now_ms.saturating_sub(since_ms) as f64 / 1000.0
}
