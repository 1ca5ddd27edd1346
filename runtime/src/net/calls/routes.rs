//! The route table of one node's hosted actors: where the call channel's server and the
//! node's router put a message for an actor (its host's queue), and what a router answers
//! besides routed messages. Written by the node agent as actors start and stop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use regatta_proto::ActorId;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::{UnboundedSender, WeakUnboundedSender};

use crate::net::wire::Wire;

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
    /// Routes `actor`'s messages (this attempt of it) into `queue`; `depth` is the gauge that
    /// counts the messages waiting there.
    pub(crate) fn insert(
        &self,
        actor: ActorId,
        attempt: u32,
        queue: &UnboundedSender<Wire>,
        depth: prometheus::IntGauge,
    ) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn gauge() -> prometheus::IntGauge {
        prometheus::IntGauge::new("depth", "test").expect("a gauge")
    }

    fn cast(bytes: u8) -> Wire {
        Wire::Cast(vec![bytes], crate::net::wire::Hold::default())
    }

    #[test]
    fn delivers_to_the_hosted_actor_and_gives_back_for_any_other() {
        let routes = Routes::default();
        let (queue, mut inbox) = tokio::sync::mpsc::unbounded_channel();
        routes.insert(ActorId(1), 0, &queue, gauge());
        assert!(routes.deliver(ActorId(1), cast(7)).is_ok());
        assert!(matches!(inbox.try_recv(), Ok(Wire::Cast(bytes, _)) if bytes == vec![7]));
        assert!(matches!(routes.deliver(ActorId(2), cast(8)), Err(Wire::Cast(bytes, _)) if bytes == vec![8]));
    }

    #[test]
    fn a_stopped_host_is_not_reached_and_its_route_goes() {
        let routes = Routes::default();
        let (queue, inbox) = tokio::sync::mpsc::unbounded_channel();
        routes.insert(ActorId(1), 0, &queue, gauge());
        drop(queue);
        drop(inbox);
        assert!(routes.deliver(ActorId(1), cast(1)).is_err());
        assert_eq!(routes.len(), 0);
    }

    #[test]
    fn removing_an_old_attempt_keeps_the_new_route() {
        let routes = Routes::default();
        let (queue, _inbox) = tokio::sync::mpsc::unbounded_channel();
        routes.insert(ActorId(1), 0, &queue, gauge());
        routes.insert(ActorId(1), 1, &queue, gauge());
        routes.remove(ActorId(1), 0);
        assert_eq!(routes.len(), 1);
        routes.remove(ActorId(1), 1);
        assert_eq!(routes.len(), 0);
    }
}
