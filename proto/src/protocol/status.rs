//! The cluster's status as `regatta status` shows it: nodes, groups, actors, what waits.

use serde::{Deserialize, Serialize};

use super::actor::ActorView;
use super::ids::GroupId;
use crate::object::DirectoryStats;
use crate::placement::Strategy;
use crate::resources::Resources;

/// A snapshot of the cluster for `regatta status`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// Every node ever registered.
    pub nodes: Vec<NodeStatus>,
    /// Placement groups not removed.
    pub groups: Vec<GroupStatus>,
    /// Actors not dead, plus recent dead ones.
    pub actors: Vec<ActorLine>,
    /// Requests waiting for resources.
    pub pending: Vec<PendingLine>,
    /// The object directory's figures.
    #[serde(default)]
    pub objects: DirectoryStats,
}

/// One node in [`ClusterStatus`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Name.
    pub name: String,
    /// Cluster listener address.
    pub address: String,
    /// `alive` or `dead`.
    pub state: String,
    /// Seconds since the node reached that state.
    pub since_s: f64,
    /// Why it died, if it did.
    pub cause: Option<String>,
    /// Total resources.
    pub total: Resources,
    /// Resources in use.
    pub used: Resources,
    /// Actor kinds it can construct.
    pub kinds: Vec<String>,
    /// Live actors on it.
    pub actors: usize,
}

/// One placement group in [`ClusterStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupStatus {
    /// Id.
    pub id: GroupId,
    /// Name, if any.
    pub name: Option<String>,
    /// Strategy.
    pub strategy: Strategy,
    /// `pending`, `created` or `rescheduling`.
    pub state: String,
    /// Node per bundle (`None` while unplaced).
    pub bundles: Vec<(Resources, Option<String>)>,
}

/// One actor in [`ClusterStatus`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ActorLine {
    /// The actor.
    pub view: ActorView,
    /// Name, if any.
    pub name: Option<String>,
    /// Resources it holds or asks for.
    pub resources: Resources,
    /// GPU indices it holds.
    pub gpu_ids: Vec<u32>,
}

/// One waiting request in [`ClusterStatus`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PendingLine {
    /// `actor 7 (echo)` or `pg-3`.
    pub what: String,
    /// What it asks for.
    pub resources: String,
    /// Seconds it has waited.
    pub waiting_s: f64,
}
