//! The ids of actors and placement groups, and where in a group an actor goes.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A cluster-wide actor id, stable across restarts of the actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ActorId(pub u64);

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A placement group id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GroupId(pub u64);

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pg-{}", self.0)
    }
}

/// Restart budget meaning "restart forever".
pub const RESTART_FOREVER: u32 = u32::MAX;

/// Which bundle of which placement group an actor goes into.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleRef {
    /// The group.
    pub group: GroupId,
    /// The bundle index; `None` lets the head pick any bundle with room.
    pub bundle: Option<usize>,
}
