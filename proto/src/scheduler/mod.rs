//! The head's bookkeeping: node membership and liveness, the resource ledger, the actor
//! directory with restart budgets, placement groups and the queue of waiting requests.
//!
//! Pure state machine: every method takes the time as `now_ms` and returns the [`Effect`]s
//! the head actor must carry out (start or stop an actor on a node). No sockets, no clock.
//! The records and the [`Scheduler`] are here; its methods are in one file per concern:
//! `nodes.rs` (membership and liveness), `actors.rs` (actors and restarts), `groups.rs`
//! (placement groups), `placing.rs` (placing what waits), `index.rs` (the placement index
//! by request shape), `status.rs` (`regatta status`) and `view.rs` (the dashboard's pages).
//!
//! Cost does not grow with the cluster in the common case: free actors are placed from
//! the index (the first node of their shape), each node keeps the actors it hosts and each
//! group its members (a lost node or a removed group touches only theirs), and waiting
//! actors queue by what they ask for, so a pass stops trying a request once it failed.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::placement::{Allocation, Ledger};
use crate::protocol::{ActorId, ActorSpec, ActorState, GroupId, GroupSpec, NodeInfo, StartActor};

mod actors;
mod groups;
mod index;
mod nodes;
mod placing;
mod status;
mod view;

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

#[derive(Serialize, Deserialize)]
struct NodeRecord {
    info: NodeInfo,
    incarnation: u64,
    ledger: Ledger,
    dead_cause: Option<String>,
    since_ms: u64,
    last_heartbeat_ms: u64,
    /// Actors placed here (on the node or in its bundles).
    hosted: BTreeSet<ActorId>,
}

#[derive(Serialize, Deserialize)]
struct Placed {
    node: String,
    allocation: Allocation,
    bundle: Option<(GroupId, usize)>,
}

#[derive(Serialize, Deserialize)]
struct ActorRecord {
    spec: ActorSpec,
    state: ActorState,
    restarts: u32,
    attempt: u32,
    placed: Option<Placed>,
    /// The node of its latest placement (kept after it dies, for its logs there).
    last_node: Option<String>,
    waiting_since_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct Bundle {
    node: String,
    reservation: Allocation,
    ledger: Ledger,
}

#[derive(Serialize, Deserialize)]
struct GroupRecord {
    spec: GroupSpec,
    bundles: Vec<Option<Bundle>>,
    created: bool,
    waiting_since_ms: u64,
    /// Actors submitted into the group (some may be dead or forgotten).
    members: BTreeSet<ActorId>,
}

/// What a waiting actor waits for: in one scheduling pass, once a request failed, the
/// others with the same key fail too (placing only takes resources), so they are skipped.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum WaitKey {
    /// A free actor: its kind and resources.
    Free(index::Shape),
    /// An actor in a placement group's bundle (or any bundle of it).
    Bundle {
        group: GroupId,
        bundle: Option<usize>,
        request: crate::resources::Resources,
    },
}

impl WaitKey {
    fn of(spec: &ActorSpec) -> Self {
        match &spec.placement {
            Some(at) => WaitKey::Bundle {
                group: at.group,
                bundle: at.bundle,
                request: spec.resources.clone(),
            },
            None => WaitKey::Free(index::Shape {
                kind: spec.kind.clone(),
                request: spec.resources.clone(),
            }),
        }
    }
}

/// Dead actors remembered (for status and for telling callers why); older ones are
/// forgotten so a long-running head does not grow without bound.
pub const MAX_DEAD_ACTORS: usize = 10_000;

/// The head's cluster state. It serializes as what cannot be recomputed (nodes, actors,
/// names, groups, counters); the indexes are rebuilt by [`Scheduler::rebuilt`].
#[derive(Default, Serialize, Deserialize)]
pub struct Scheduler {
    dead_order: std::collections::VecDeque<ActorId>,
    nodes: BTreeMap<String, NodeRecord>,
    /// Boxed: a map node holds 11 entries and is often half full, so unboxed records
    /// (about 300 bytes each) would waste more than they hold.
    actors: BTreeMap<ActorId, Box<ActorRecord>>,
    named: BTreeMap<String, ActorId>,
    groups: BTreeMap<GroupId, GroupRecord>,
    /// Actors waiting to be placed (pending or restarting), by what they wait for.
    #[serde(skip)]
    waiting: BTreeMap<WaitKey, BTreeSet<ActorId>>,
    /// Alive nodes registering each kind.
    #[serde(skip)]
    kinds: BTreeMap<String, usize>,
    #[serde(skip)]
    index: index::ShapeIndex,
    next_actor: u64,
    next_group: u64,
    next_incarnation: u64,
    /// Distinct resource requests seen (up to [`MAX_SHARED_SHAPES`]): actors of one shape
    /// share one map instead of holding one each.
    #[serde(skip)]
    shapes: BTreeSet<crate::resources::Resources>,
    /// Nodes of a restored head that have not registered again yet. While any is
    /// missing nothing is placed: a start sent to a node whose session is not back yet
    /// would declare it lost. Each either registers (and its actors are reconciled) or
    /// goes silent past the heartbeat timeout like any node. Kept in the serialized form:
    /// requests replayed after a snapshot must be placed as they were.
    rejoining: BTreeSet<String>,
    /// Node names removed for good (`regatta node remove`): refused from then on.
    removed: BTreeSet<String>,
}

/// How many distinct resource requests the head shares; requests beyond that many shapes
/// keep their own map (correct, only larger).
const MAX_SHARED_SHAPES: usize = 4_096;

impl Scheduler {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// A scheduler read back from its serialized form, with its indexes rebuilt.
    pub fn rebuilt(mut self) -> Self {
        let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
        for rec in self.nodes.values().filter(|n| n.dead_cause.is_none()) {
            for kind in &rec.info.kinds {
                *kinds.entry(kind.clone()).or_insert(0) += 1;
            }
        }
        self.kinds = kinds;
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            self.touch(&name);
        }
        let ids: Vec<ActorId> = self.actors.keys().copied().collect();
        for id in ids {
            let resources = self.actors[&id].spec.resources.clone();
            let shared = self.share(resources);
            if let Some(actor) = self.actors.get_mut(&id) {
                actor.spec.resources = shared;
            }
            if self.is_waiting(id) {
                self.enqueue(id);
            }
        }
        self
    }

    /// After a head restart: every alive node must register again (with the actors it
    /// runs) before anything is placed; until then each counts as heard from at `now_ms`.
    pub fn await_rejoin(&mut self, now_ms: u64) {
        for rec in self.nodes.values_mut().filter(|n| n.dead_cause.is_none()) {
            rec.last_heartbeat_ms = now_ms;
            self.rejoining.insert(rec.info.name.clone());
        }
    }

    /// Nodes of a restored head that have not registered again yet.
    pub fn rejoining(&self) -> usize {
        self.rejoining.len()
    }

    /// The shared copy of `resources` (see [`Scheduler::shapes`]).
    fn share(&mut self, resources: crate::resources::Resources) -> crate::resources::Resources {
        if let Some(shared) = self.shapes.get(&resources) {
            return shared.clone();
        }
        if self.shapes.len() < MAX_SHARED_SHAPES {
            self.shapes.insert(resources.clone());
        }
        resources
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::placement::{Decision, Strategy};
    use crate::protocol::BundleRef;
    use crate::protocol::{DeathCause, Failure, Loss};
    use crate::resources::Resources;

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
    fn actors_of_one_shape_share_one_resource_map_and_placement_still_counts_each() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=4"), &[], 0).unwrap();
        let a = s.submit(spec("CPU=1", 0), 0).unwrap();
        let b = s.submit(spec("CPU=1", 0), 0).unwrap();
        let c = s.submit(spec("CPU=2", 0), 0).unwrap();
        let (ra, rb, rc) = (
            &s.actors[&a].spec.resources,
            &s.actors[&b].spec.resources,
            &s.actors[&c].spec.resources,
        );
        assert!(ra.shares_map_with(rb), "two requests of CPU=1 hold separate maps");
        assert!(!ra.shares_map_with(rc));
        let effects = s.schedule(0);
        assert_eq!(starts(&effects).len(), 3);
        // Sharing is copy-on-write: taking from the ledger changed no actor's request.
        assert_eq!(s.actors[&a].spec.resources, Resources::parse_request("CPU=1").unwrap());
        let extra = s.submit(spec("CPU=1", 0), 0).unwrap();
        assert!(
            starts(&s.schedule(0)).is_empty(),
            "a fourth CPU on a 4-CPU node with 4 taken"
        );
        s.kill(a).unwrap();
        let effects = s.schedule(2);
        assert_eq!(
            starts(&effects).iter().map(|st| st.actor).collect::<Vec<_>>(),
            vec![extra]
        );
    }

    #[test]
    fn status_pages_list_every_actor_once_in_id_order() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=8"), &[], 0).unwrap();
        let ids: Vec<ActorId> = (0..7).map(|_| s.submit(spec("CPU=1", 0), 0).unwrap()).collect();
        let effects = s.schedule(0);
        start_all(&mut s, &effects);
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = s.actor_lines_after(after, 3);
            assert!(page.len() <= 3);
            seen.extend(page.iter().map(|line| line.view.id));
            match page.last() {
                Some(last) if page.len() == 3 => after = Some(last.view.id),
                _ => break,
            }
        }
        assert_eq!(seen, ids);
        let whole = s.status(0);
        assert_eq!(whole.actors.len(), 7);
        let first = s.status_without_actors(0);
        assert!(first.actors.is_empty());
        assert_eq!(first.nodes[0].actors, 7, "nodes still count their actors");
    }

    #[test]
    fn lost_node_restarts_actors_elsewhere_within_budget() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=2"), &[], 0).unwrap();
        let keep = s.submit(spec("CPU=1", 1), 0).unwrap();
        let lose = s.submit(spec("CPU=1", 0), 0).unwrap();
        let effects = s.schedule(0);
        assert!(starts(&effects).iter().all(|st| st.node == "w1"));
        start_all(&mut s, &effects);
        s.register(node("w2", "CPU=2"), &[], 10).unwrap();
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
                    matches!(
                        &cause,
                        DeathCause::RestartsExhausted {
                            last: Loss::NodeDied { node, .. },
                            max_restarts: 0,
                        } if node == "w1"
                    ),
                    "{cause}"
                );
                assert!(cause.node_lost() && cause.label() == "node_lost");
                assert!(cause.to_string().starts_with("node w1 died: "), "{cause}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.actor_view(keep).unwrap().restarts, 1);
    }

    #[test]
    fn ending_a_job_kills_only_its_actors() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=4"), &[], 0).unwrap();
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
        assert!(
            matches!(s.actor_view(a).unwrap().state, ActorState::Dead { cause } if cause == DeathCause::JobEnded { job: "j1".into() })
        );
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
        s.register(node("w1", "CPU=1"), &[], 0).unwrap();
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
        let err = s.register(node("w1", "GPU=100000"), &[], 0).unwrap_err();
        assert!(matches!(err, Failure::Rejected(m) if m.contains("node w1 refused")));
        assert!(s.status(0).nodes.is_empty());
    }

    #[test]
    fn stale_start_reports_are_ignored() {
        let mut s = Scheduler::new();
        s.register(node("w1", "CPU=1"), &[], 0).unwrap();
        let id = s.submit(spec("CPU=1", 5), 0).unwrap();
        let first = starts(&s.schedule(0)).remove(0);
        s.exited(id, first.attempt, Loss::Exited("panicked".into()), 1);
        let second = starts(&s.schedule(1)).remove(0);
        s.started(id, first.attempt, Ok(()));
        assert_eq!(s.actor_view(id).unwrap().state, ActorState::Starting);
        s.started(id, second.attempt, Ok(()));
        assert_eq!(s.actor_view(id).unwrap().state, ActorState::Alive);
    }

    #[test]
    fn busy_request_is_placed_when_resources_free_up() {
        let mut s = Scheduler::new();
        s.register(node("w1", "GPU=1"), &[], 0).unwrap();
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
        s.register(node("w1", "CPU=2,GPU=4"), &[], 0).unwrap();
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
        s.register(node("w1", "CPU=2"), &[], 0).unwrap();
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
            s.register(node(name, "CPU=4,GPU=1"), &[], 0).unwrap();
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
            s.register(node(name, "CPU=1"), &[], 0).unwrap();
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
        s.register(node("w1", "CPU=4,accelerator_type:H100=1"), &[], 0).unwrap();
        s.submit(spec("CPU=1,accelerator_type:H100", 0), 0).unwrap();
        s.schedule(0);
        let status = s.status(0);
        assert_eq!(status.nodes[0].used.to_string(), "CPU=1,accelerator_type:H100=0.001");
        s.lose_node("w1", "test", 2_000);
        let status = s.status(3_000);
        assert_eq!(status.nodes[0].state, "dead");
        assert_eq!(status.nodes[0].since_s, 1.0);
    }

    /// The scheduler's own bookkeeping (hosted actors per node, the waiting queue, the
    /// placement index) against a recount from its records, after every step of random
    /// submissions, starts, exits, kills, group changes and node losses and joins; and the
    /// index's decision against the exhaustive placement over the same nodes.
    #[test]
    fn the_indexes_agree_with_a_recount_through_random_histories() {
        let shapes = ["CPU=1", "CPU=2", "GPU=1", "GPU=0.5", "CPU=1,GPU=1"];
        for seed in 1..=12u64 {
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let mut s = Scheduler::new();
            let mut groups: Vec<GroupId> = Vec::new();
            for n in 0..4 {
                s.register(node(&format!("w{n}"), "CPU=4,GPU=2"), &[], 0).unwrap();
            }
            for step in 0..300u64 {
                let now = step * 10;
                match next(9) {
                    0..=2 => {
                        let mut spec = spec(shapes[next(shapes.len() as u64) as usize], 1);
                        if next(4) == 0 && !groups.is_empty() {
                            spec.placement = Some(BundleRef {
                                group: groups[next(groups.len() as u64) as usize],
                                bundle: None,
                            });
                            spec.resources = Resources::parse_request("CPU=1").unwrap();
                        }
                        let _ = s.submit(spec, now);
                    }
                    3 => {
                        let live: Vec<ActorId> = s.actors.keys().copied().collect();
                        if let Some(id) = live.get(next(live.len() as u64 + 1) as usize) {
                            let attempt = s.actors[id].attempt;
                            s.exited(*id, attempt, Loss::Exited("panicked".into()), now);
                        }
                    }
                    4 => {
                        let live: Vec<ActorId> = s.actors.keys().copied().collect();
                        if let Some(id) = live.get(next(live.len() as u64 + 1) as usize) {
                            let _ = s.kill(*id);
                        }
                    }
                    5 => {
                        let spec = GroupSpec {
                            bundles: vec![Resources::parse_request("CPU=1").unwrap(); 1 + next(3) as usize],
                            strategy: Strategy::Spread,
                            name: None,
                        };
                        if let Ok(id) = s.create_group(spec, now) {
                            groups.push(id);
                        }
                    }
                    6 if !groups.is_empty() => {
                        let id = groups.swap_remove(next(groups.len() as u64) as usize);
                        let _ = s.remove_group(id);
                    }
                    7 => {
                        let name = format!("w{}", next(5));
                        if s.is_alive(&name) {
                            s.lose_node(&name, "test", now);
                        } else {
                            s.register(node(&name, "CPU=4,GPU=2"), &[], now).unwrap();
                        }
                    }
                    _ => {}
                }
                let effects = s.schedule(now);
                start_all(&mut s, &effects);
                check_bookkeeping(&mut s, &shapes, seed, step);
                if next(8) == 0 {
                    s = restarted_head(s, now, seed, step);
                    check_bookkeeping(&mut s, &shapes, seed, step);
                }
            }
        }
    }

    /// The scheduler written down, read back as a restarted head's, and each alive node
    /// registered again reporting the actors placed on it: everything is taken back.
    fn restarted_head(s: Scheduler, now: u64, seed: u64, step: u64) -> Scheduler {
        let before: Vec<_> = s.actors.keys().map(|id| s.actor_view(*id)).collect();
        let bytes = bincode::serialize(&s).unwrap();
        let mut s = bincode::deserialize::<Scheduler>(&bytes).unwrap().rebuilt();
        s.await_rejoin(now);
        let alive: Vec<(NodeInfo, Vec<crate::protocol::RunningActor>)> = s
            .nodes
            .values()
            .filter(|n| n.dead_cause.is_none())
            .map(|n| {
                let running = n
                    .hosted
                    .iter()
                    .map(|id| crate::protocol::RunningActor {
                        actor: *id,
                        attempt: s.actors[id].attempt,
                        up: s.actors[id].state == ActorState::Alive,
                    })
                    .collect();
                (n.info.clone(), running)
            })
            .collect();
        assert_eq!(s.rejoining(), alive.len());
        for (info, running) in alive {
            let registration = s.register(info, &running, now).unwrap();
            assert!(
                registration.stop.is_empty(),
                "seed {seed} step {step}: {registration:?}"
            );
        }
        assert_eq!(s.rejoining(), 0);
        let after: Vec<_> = s.actors.keys().map(|id| s.actor_view(*id)).collect();
        assert_eq!(
            after, before,
            "seed {seed} step {step}: actors changed across the restart"
        );
        s
    }

    fn check_bookkeeping(s: &mut Scheduler, shapes: &[&str], seed: u64, step: u64) {
        let mut hosted: BTreeMap<String, BTreeSet<ActorId>> = BTreeMap::new();
        let mut waiting: BTreeSet<ActorId> = BTreeSet::new();
        for (id, actor) in &s.actors {
            if let Some(p) = &actor.placed {
                hosted.entry(p.node.clone()).or_default().insert(*id);
            }
            if matches!(actor.state, ActorState::Pending | ActorState::Restarting) {
                waiting.insert(*id);
            }
        }
        for (name, rec) in &s.nodes {
            if rec.dead_cause.is_none() {
                let expected = hosted.remove(name).unwrap_or_default();
                assert_eq!(rec.hosted, expected, "seed {seed} step {step}: actors on {name}");
            }
        }
        for (id, group) in &s.groups {
            for member in &group.members {
                let actor = &s.actors[member];
                assert!(
                    !matches!(actor.state, ActorState::Dead { .. }),
                    "seed {seed} step {step}: dead {member} kept as a member of {id}"
                );
            }
        }
        let queued: BTreeSet<ActorId> = s.waiting.values().flatten().copied().collect();
        assert_eq!(queued, waiting, "seed {seed} step {step}: the waiting queue");
        for shape in shapes {
            let request = Resources::parse_request(shape).unwrap();
            let exhaustive = crate::placement::place_actor(&s.candidates(Some("echo")), &request);
            let indexed = s.decide("echo", &request);
            match (&exhaustive, &indexed) {
                (Decision::Infeasible(_), Decision::Infeasible(_)) => {}
                _ => assert_eq!(indexed, exhaustive, "seed {seed} step {step}: {shape}"),
            }
        }
    }
}
