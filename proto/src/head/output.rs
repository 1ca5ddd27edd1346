//! What the head hands back: answers to reply tokens, effects, releases and notices.

use crate::object::{Location, ObjectId, Release};
use crate::protocol::{ActorId, ActorView, ClusterStatus, Failure, GroupId, Loss, Registration, StartFailure};
use crate::scheduler::Effect;

/// Who an answer goes to: a token the shell maps to the caller's reply port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplyTo(pub u64);

/// A reply, typed by the request it answers (the shell encodes each as the
/// `Result<T, Failure>` its caller decodes).
#[derive(Clone, Debug)]
pub enum Answer {
    /// `Register`: the node's incarnation and the reported actors it must stop.
    Registered(Result<Registration, Failure>),
    /// `Heartbeat`: whether the head knows the node (false: re-register).
    Heartbeat(crate::Beat),
    /// `RemoveNode`: whether the head knew the node.
    Removed(bool),
    /// `Spawn`: the new actor's id.
    Spawned(Result<ActorId, Failure>),
    /// `WaitActor`: the actor once alive or dead.
    Actor(Result<ActorView, Failure>),
    /// `Named`: the actor of that name, if any.
    Named(Option<ActorView>),
    /// `CreateGroup`: the new group's id.
    GroupCreated(Result<GroupId, Failure>),
    /// `WaitGroup`: the node of each bundle once placed.
    GroupPlaced(Result<Vec<String>, Failure>),
    /// `Status`: the whole cluster.
    Status(Box<ClusterStatus>),
    /// `View`: the page asked for.
    View(Box<crate::view::View>),
    /// `ObjectLocate`: where to read the object.
    Location(Result<Location, Failure>),
    /// `ObjectsWait`: the objects readable now, in the order asked.
    Ready(Result<Vec<ObjectId>, Failure>),
    /// Requests with no value to return.
    Done(Result<(), Failure>),
}

/// Something the head noticed that an operator should read in its log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// A node registered.
    NodeJoined {
        /// Its name.
        node: String,
        /// Its cluster address.
        address: String,
        /// Its resources, formatted.
        resources: String,
        /// The kinds it can construct.
        kinds: Vec<String>,
        /// Actors it reported running that keep running.
        kept: usize,
        /// Actors it reported running that it is told to stop.
        stopped: usize,
    },
    /// A node's registration was refused.
    RegistrationRefused(Failure),
    /// A node stopped heartbeating: its actors restart elsewhere or die.
    NodeDead {
        /// Its name.
        node: String,
        /// Why.
        cause: String,
        /// Objects whose only copy was there.
        objects_lost: usize,
    },
    /// An actor's constructor failed.
    StartFailed {
        /// The actor.
        actor: ActorId,
        /// Why.
        cause: StartFailure,
    },
    /// A running actor stopped on its own.
    Exited {
        /// The actor.
        actor: ActorId,
        /// Why.
        cause: Loss,
    },
    /// An object registration was refused.
    ObjectRefused(Failure),
    /// A registering node no longer holds objects whose only copy it had.
    ObjectsGone {
        /// The node.
        node: String,
        /// How many objects were lost.
        objects: usize,
    },
}

/// What the shell does after a request or a tick.
#[derive(Clone, Debug)]
pub enum Output {
    /// Send an answer.
    Reply(ReplyTo, Answer),
    /// Start, stop or re-advertise an actor on a node.
    Effect(Effect),
    /// Tell an object's holders to drop their copies and delete its spilled copy.
    Release(Release),
    /// Log it.
    Notice(Notice),
}

/// Sends `answer` to `to`, when the request wanted one.
pub(super) fn answer(to: Option<ReplyTo>, answer: Answer, out: &mut Vec<Output>) {
    if let Some(to) = to {
        out.push(Output::Reply(to, answer));
    }
}

/// Answers a request that may have effects on nodes (a kill, a group's removal).
pub(super) fn answer_with_effects(to: Option<ReplyTo>, result: Result<Vec<Effect>, Failure>, out: &mut Vec<Output>) {
    let effects = result.as_ref().cloned().unwrap_or_default();
    answer(to, Answer::Done(result.map(|_| ())), out);
    out.extend(effects.into_iter().map(Output::Effect));
}
