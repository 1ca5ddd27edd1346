//! What the dashboard and scripts read from the head: paged, filtered views of the cluster
//! (`HeadRequest::View`), answered by [`crate::HeadCore`] and served as JSON by the head's
//! HTTP API. Pages are bounded ([`MAX_PAGE`]) so a 100,000-actor head answers any of them
//! in milliseconds.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::object::DirectoryStats;
use crate::protocol::ids::ActorId;
use crate::protocol::status::GroupStatus;
use crate::resources::Resources;
use crate::runs::{RunDetail, RunSummary};
use crate::{Error, Result};

/// The most rows one page holds.
pub const MAX_PAGE: usize = 1000;
/// Rows in a page when the caller does not say.
pub const DEFAULT_PAGE: usize = 100;

/// Which rows of a list: `offset` rows skipped, at most `limit` returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRequest {
    /// Rows skipped.
    pub offset: usize,
    /// Rows returned at most (capped at [`MAX_PAGE`]).
    pub limit: usize,
}

impl Default for PageRequest {
    fn default() -> Self {
        Self {
            offset: 0,
            limit: DEFAULT_PAGE,
        }
    }
}

impl PageRequest {
    /// A page request from optional query values; a limit of 0 or past [`MAX_PAGE`] is an error.
    pub fn new(offset: Option<usize>, limit: Option<usize>) -> Result<Self> {
        let limit = limit.unwrap_or(DEFAULT_PAGE);
        if limit == 0 || limit > MAX_PAGE {
            return Err(Error::BadQuery(format!("limit must be 1 to {MAX_PAGE}, not {limit}")));
        }
        Ok(Self {
            offset: offset.unwrap_or(0),
            limit,
        })
    }

    /// Takes this page's rows out of `rows`, counting them all.
    pub fn take<T>(&self, rows: impl Iterator<Item = T>) -> Page<T> {
        let mut total = 0;
        let mut items = Vec::new();
        for row in rows {
            if total >= self.offset && items.len() < self.limit {
                items.push(row);
            }
            total += 1;
        }
        Page {
            total,
            offset: self.offset,
            limit: self.limit,
            items,
        }
    }
}

/// One page of a list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    /// Rows in the whole (filtered) list.
    pub total: usize,
    /// Rows skipped.
    pub offset: usize,
    /// The page size asked for.
    pub limit: usize,
    /// This page's rows.
    pub items: Vec<T>,
}

/// An actor's lifecycle state as a filter and in rows ([`crate::ActorState::label`]).
pub const ACTOR_STATES: [&str; 5] = ["pending", "starting", "alive", "restarting", "dead"];

/// Which actors a listing shows; every set field must match.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorFilter {
    /// The kind, exactly.
    pub kind: Option<String>,
    /// One of [`ACTOR_STATES`].
    pub state: Option<String>,
    /// The node it runs (or last ran) on, exactly.
    pub node: Option<String>,
    /// The job that spawned it, exactly.
    pub job: Option<String>,
    /// A part of its name.
    pub name: Option<String>,
}

impl ActorFilter {
    /// Checks the state's spelling (empty fields count as unset).
    pub fn checked(mut self) -> Result<Self> {
        for field in [
            &mut self.kind,
            &mut self.state,
            &mut self.node,
            &mut self.job,
            &mut self.name,
        ] {
            if field.as_deref().is_some_and(|v| v.trim().is_empty()) {
                *field = None;
            }
        }
        if let Some(state) = &self.state {
            if !ACTOR_STATES.contains(&state.as_str()) {
                return Err(Error::BadQuery(format!(
                    "state must be one of {}, not {state:?}",
                    ACTOR_STATES.join(", ")
                )));
            }
        }
        Ok(self)
    }

    /// Whether `row` passes.
    pub fn matches(&self, row: &ActorRow) -> bool {
        fn same(want: &Option<String>, have: Option<&str>) -> bool {
            want.as_deref().is_none_or(|w| have == Some(w))
        }
        same(&self.kind, Some(&row.kind))
            && same(&self.state, Some(&row.state))
            && same(&self.node, row.node.as_deref())
            && same(&self.job, row.job.as_deref())
            && self
                .name
                .as_deref()
                .is_none_or(|part| row.name.as_deref().is_some_and(|n| n.contains(part)))
    }
}

/// A question to the head about its state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ViewQuery {
    /// Counts and totals: [`View::Overview`].
    Overview,
    /// Nodes: [`View::Nodes`].
    Nodes(PageRequest),
    /// Actors that pass a filter, by id: [`View::Actors`].
    Actors(ActorFilter, PageRequest),
    /// One actor: [`View::Actor`].
    Actor(ActorId),
    /// Placement groups: [`View::Groups`].
    Groups(PageRequest),
    /// Training and scoring runs: [`View::Runs`].
    Runs,
    /// One run with its points: [`View::Run`].
    Run(String),
}

/// The head's answer to a [`ViewQuery`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum View {
    /// Counts and totals.
    Overview(Overview),
    /// A page of nodes.
    Nodes(Page<NodeRow>),
    /// A page of actors.
    Actors(Page<ActorRow>),
    /// One actor, if known.
    Actor(Option<ActorRow>),
    /// A page of placement groups.
    Groups(Page<GroupStatus>),
    /// Every run the head keeps.
    Runs(Vec<RunSummary>),
    /// One run, if known.
    Run(Option<RunDetail>),
}

/// The cluster at a glance.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Overview {
    /// Nodes alive.
    pub nodes_alive: usize,
    /// Of those, the nodes a restarted head still waits for to register again.
    #[serde(default)]
    pub nodes_rejoining: usize,
    /// Nodes dead.
    pub nodes_dead: usize,
    /// Each resource over the alive nodes, by name (GPU and accelerator tags included).
    pub resources: Vec<ResourceUse>,
    /// Actors by state (every state of [`ACTOR_STATES`] present).
    pub actors: BTreeMap<String, usize>,
    /// Placement groups by state (`pending`, `created`, `rescheduling`).
    pub groups: BTreeMap<String, usize>,
    /// Requests waiting for resources (actors and groups).
    pub waiting: usize,
    /// The object directory's figures.
    pub objects: DirectoryStats,
    /// Runs the head keeps.
    pub runs: usize,
}

/// One resource's total and use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResourceUse {
    /// Its name.
    pub name: String,
    /// Total over the alive nodes, in units (a tag counts 1 per node).
    pub total: f64,
    /// In use.
    pub used: f64,
}

/// One node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeRow {
    /// Name.
    pub name: String,
    /// Cluster listener address.
    pub address: String,
    /// `alive` or `dead`.
    pub state: String,
    /// Seconds since it reached that state.
    pub since_s: f64,
    /// Why it died, if it did.
    pub cause: Option<String>,
    /// Seconds since its last heartbeat (alive nodes).
    pub heartbeat_age_s: Option<f64>,
    /// Total resources.
    pub total: Resources,
    /// Resources in use.
    pub used: Resources,
    /// Actor kinds it can construct.
    pub kinds: Vec<String>,
    /// Actors placed on it and not dead.
    pub actors: usize,
    /// Bytes of objects it holds in memory.
    pub object_bytes: u64,
}

/// One actor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActorRow {
    /// Id.
    pub id: ActorId,
    /// Kind.
    pub kind: String,
    /// Name, if any.
    pub name: Option<String>,
    /// One of [`ACTOR_STATES`].
    pub state: String,
    /// Why it died, when dead.
    pub cause: Option<String>,
    /// The node it runs on, if placed.
    pub node: Option<String>,
    /// The node it was placed on last (where its log lines are, also once it died).
    pub last_node: Option<String>,
    /// Restarts so far.
    pub restarts: u32,
    /// Its restart budget ([`crate::RESTART_FOREVER`]: unlimited).
    pub max_restarts: u32,
    /// The job that spawned it.
    pub job: Option<String>,
    /// Resources it holds or asks for.
    pub resources: Resources,
    /// GPU indices it holds.
    pub gpu_ids: Vec<u32>,
    /// Its placement group and bundle, if any.
    pub group: Option<(u64, Option<usize>)>,
    /// Seconds it has waited for resources (pending or restarting).
    pub waiting_s: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(kind: &str, state: &str, node: Option<&str>, name: Option<&str>) -> ActorRow {
        ActorRow {
            id: ActorId(1),
            kind: kind.into(),
            name: name.map(Into::into),
            state: state.into(),
            cause: None,
            node: node.map(Into::into),
            last_node: node.map(Into::into),
            restarts: 0,
            max_restarts: 0,
            job: None,
            resources: Resources::new(),
            gpu_ids: Vec::new(),
            group: None,
            waiting_s: None,
        }
    }

    #[test]
    fn a_page_counts_every_row_and_keeps_its_window() {
        let page = PageRequest::new(Some(3), Some(4)).unwrap().take(0..10);
        assert_eq!(page.total, 10);
        assert_eq!(page.items, vec![3, 4, 5, 6]);
        let past = PageRequest::new(Some(20), None).unwrap().take(0..10);
        assert_eq!((past.total, past.items.len()), (10, 0));
        assert!(PageRequest::new(None, Some(0)).is_err());
        assert!(PageRequest::new(None, Some(MAX_PAGE + 1)).is_err());
    }

    #[test]
    fn filters_match_every_set_field() {
        let a = row("echo", "alive", Some("w1"), Some("trainer-0"));
        assert!(ActorFilter::default().matches(&a));
        let by = |f: ActorFilter| f.checked().unwrap().matches(&a);
        assert!(by(ActorFilter {
            kind: Some("echo".into()),
            state: Some("alive".into()),
            node: Some("w1".into()),
            name: Some("ner-".into()),
            ..Default::default()
        }));
        assert!(!by(ActorFilter {
            node: Some("w2".into()),
            ..Default::default()
        }));
        assert!(!by(ActorFilter {
            job: Some("j".into()),
            ..Default::default()
        }));
        assert!(!by(ActorFilter {
            name: Some("scorer".into()),
            ..Default::default()
        }));
        // Empty fields are unset; a misspelt state is an error, not an empty page.
        assert!(by(ActorFilter {
            kind: Some(" ".into()),
            ..Default::default()
        }));
        assert!(ActorFilter {
            state: Some("running".into()),
            ..Default::default()
        }
        .checked()
        .is_err());
    }
}
