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

use ractor::{Actor, ActorProcessingErr, ActorRef};
use regatta_proto::Failure;

use crate::net::calls::{CallAddress, RouterQuery, Routes};
use crate::net::wire::{self, Wire};

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
                if state
                    .routes
                    .deliver(actor, Wire::Cast(payload, crate::net::wire::Hold::default()))
                    .is_err()
                {
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
            Wire::Cast(..) | Wire::Local(_) => {}
        }
        Ok(())
    }
}
