//! The node's router: the one remote-capable actor through which every call and cast to a
//! user actor hosted on this node arrives.
//!
//! Why not address each user actor directly: `ractor_cluster` advertises every
//! remote-capable actor a process spawns to every peer it has a session with, and each peer
//! then runs a proxy actor (a task and a mailbox) per advertised actor. With user actors
//! remote-capable, the head — which has a session to every node — held one proxy per actor
//! in the cluster (about 13 KB each), and every client one per actor of each node it talked
//! to. So user actors' hosts take only local messages, and a caller sends
//! [`Wire::CallActor`]/[`Wire::CastActor`] to the router of the node the head names
//! (process group `router/<node>`, one member per node); the router puts the message in the
//! actor's queue. That costs no extra hop: the host's mailbox used to forward into the same
//! queue.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc::{UnboundedSender, WeakUnboundedSender};

use serde::{Deserialize, Serialize};

use crate::calls::CallAddress;
use crate::protocol::{ActorId, Failure};
use crate::wire::{self, Wire};

/// What a router answers besides routed messages (a plain `Wire::Call`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum RouterQuery {
    /// The node's call channel address, if it serves one: a
    /// `Result<Option<CallAddress>, Failure>`.
    CallAddress,
}

/// Where a hosted actor's messages go: its host's queue (held weakly: the queue closes
/// when the host stops, whatever the table says) and its mailbox-depth gauge.
struct Route {
    attempt: u32,
    queue: WeakUnboundedSender<Wire>,
    depth: prometheus::IntGauge,
}

/// The hosted actors of one node, by id: written by the agent's start tasks and exit
/// handling, read by the router.
#[derive(Clone, Default)]
pub(crate) struct Routes(Arc<Mutex<HashMap<ActorId, Route>>>);

impl Routes {
    /// Routes `actor`'s messages (this attempt of it) into `queue`.
    pub(crate) fn insert(&self, actor: ActorId, attempt: u32, queue: &UnboundedSender<Wire>, kind: &str) {
        let depth = crate::metrics::metrics().mailbox_depth.with_label_values(&[kind]);
        let route = Route {
            attempt,
            queue: queue.downgrade(),
            depth,
        };
        if let Ok(mut routes) = self.0.lock() {
            routes.insert(actor, route);
        }
    }

    /// Stops routing to `actor` if the route is still that of `attempt` (a newer attempt
    /// on this node keeps its route).
    pub(crate) fn remove(&self, actor: ActorId, attempt: u32) {
        if let Ok(mut routes) = self.0.lock() {
            if routes.get(&actor).is_some_and(|route| route.attempt == attempt) {
                routes.remove(&actor);
            }
        }
    }

    /// Stops routing to every actor.
    pub(crate) fn clear(&self) {
        if let Ok(mut routes) = self.0.lock() {
            routes.clear();
        }
    }

    /// How many actors are routed.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().map(|routes| routes.len()).unwrap_or(0)
    }

    /// Puts `message` in `actor`'s queue, or gives it back when the actor is not hosted
    /// here (never was, or its host stopped).
    pub(crate) fn deliver(&self, actor: ActorId, message: Wire) -> Result<(), Wire> {
        let Ok(mut routes) = self.0.lock() else {
            return Err(message);
        };
        let Some(route) = routes.get(&actor) else {
            return Err(message);
        };
        let Some(queue) = route.queue.upgrade() else {
            routes.remove(&actor);
            return Err(message);
        };
        match queue.send(message) {
            Ok(()) => {
                route.depth.inc();
                Ok(())
            }
            Err(returned) => {
                routes.remove(&actor);
                Err(returned.0)
            }
        }
    }
}

/// The router actor of one node.
pub(crate) struct Router;

pub(crate) struct RouterState {
    node: String,
    routes: Routes,
    call_address: Option<CallAddress>,
}

impl Actor for Router {
    type Msg = Wire;
    type State = RouterState;
    /// The node's name, its routes and its call channel's address.
    type Arguments = (String, Routes, Option<CallAddress>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Wire>,
        (node, routes, call_address): Self::Arguments,
    ) -> Result<RouterState, ActorProcessingErr> {
        Ok(RouterState {
            node,
            routes,
            call_address,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Wire>,
        message: Wire,
        state: &mut RouterState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            Wire::CallActor(actor, payload, port) => {
                if let Err(Wire::Call(_, port)) = state.routes.deliver(actor, Wire::Call(payload, port)) {
                    let not_hosted = Failure::NotHosted {
                        actor,
                        node: state.node.clone(),
                    };
                    wire::reply::<()>(port, Err(not_hosted));
                }
            }
            Wire::CastActor(actor, payload) => {
                if state.routes.deliver(actor, Wire::Cast(payload)).is_err() {
                    tracing::debug!(%actor, node = %state.node, "dropped a cast to an actor this node does not host");
                }
            }
            Wire::Call(bytes, port) => match wire::decode::<RouterQuery>(&bytes, "a router query") {
                Ok(RouterQuery::CallAddress) => wire::reply(port, Ok::<_, Failure>(state.call_address.clone())),
                Err(_) => wire::reply::<()>(
                    port,
                    Err(Failure::BadMessage(format!(
                        "could not decode a message for node {}'s router: it takes calls addressed to an actor and router queries",
                        state.node
                    ))),
                ),
            },
            Wire::Cast(_) | Wire::Local(_) => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cast(bytes: u8) -> Wire {
        Wire::Cast(vec![bytes])
    }

    #[test]
    fn delivers_to_the_hosted_actor_and_gives_back_for_any_other() {
        let routes = Routes::default();
        let (queue, mut inbox) = tokio::sync::mpsc::unbounded_channel();
        routes.insert(ActorId(1), 0, &queue, "test");
        assert!(routes.deliver(ActorId(1), cast(7)).is_ok());
        assert!(matches!(inbox.try_recv(), Ok(Wire::Cast(bytes)) if bytes == vec![7]));
        assert!(matches!(routes.deliver(ActorId(2), cast(8)), Err(Wire::Cast(bytes)) if bytes == vec![8]));
    }

    #[test]
    fn a_stopped_host_is_not_reached_and_its_route_goes() {
        let routes = Routes::default();
        let (queue, inbox) = tokio::sync::mpsc::unbounded_channel();
        routes.insert(ActorId(1), 0, &queue, "test");
        drop(queue);
        drop(inbox);
        assert!(routes.deliver(ActorId(1), cast(1)).is_err());
        assert_eq!(routes.len(), 0);
    }

    #[test]
    fn removing_an_old_attempt_keeps_the_new_route() {
        let routes = Routes::default();
        let (queue, _inbox) = tokio::sync::mpsc::unbounded_channel();
        routes.insert(ActorId(1), 0, &queue, "test");
        routes.insert(ActorId(1), 1, &queue, "test");
        routes.remove(ActorId(1), 0);
        assert_eq!(routes.len(), 1);
        routes.remove(ActorId(1), 1);
        assert_eq!(routes.len(), 0);
    }
}
