//! Carrying out what the head's core decided: answers encoded for their callers, starts
//! and stops sent to node agents, object releases, notices written to the log.

use std::time::Duration;

use ractor::ActorRef;
use regatta_object_store::Release;
use regatta_proto::Effect;
use regatta_proto::{AgentRequest, Failure, HeadRequest, Loss, ObjectCommand, StartActor};
use regatta_proto::{Answer, Notice};

use crate::net::node;
use crate::net::wire::{self, LocalSignal, Wire};
use crate::objects::objects_group;

/// Encodes an answer as the `Result<T, Failure>` its caller decodes.
pub(super) fn encode_answer(answer: Answer) -> Vec<u8> {
    match answer {
        Answer::Registered(r) => wire::encode(&r),
        Answer::Heartbeat(beat) => wire::encode(&Ok::<regatta_proto::Beat, Failure>(beat)),
        Answer::Removed(known) => wire::encode(&Ok::<bool, Failure>(known)),
        Answer::Spawned(r) => wire::encode(&r),
        Answer::Actor(r) => wire::encode(&r),
        Answer::Named(view) => wire::encode(&Ok::<_, Failure>(view)),
        Answer::GroupCreated(r) => wire::encode(&r),
        Answer::GroupPlaced(r) => wire::encode(&r),
        Answer::Status(status) => wire::encode(&Ok::<_, Failure>(*status)),
        Answer::View(view) => wire::encode(&Ok::<_, Failure>(*view)),
        Answer::Location(r) => wire::encode(&r),
        Answer::Ready(r) => wire::encode(&r),
        Answer::Done(r) => wire::encode(&r),
    }
}

pub(super) fn log_notice(notice: Notice) {
    match notice {
        Notice::NodeJoined {
            node,
            address,
            resources,
            kinds,
            kept,
            stopped,
        } => {
            tracing::info!(node = %node, address = %address, resources = %resources, kinds = ?kinds, kept, stopped, "node joined")
        }
        Notice::RegistrationRefused(failure) => tracing::warn!(?failure, "refused a node's registration"),
        Notice::NodeDead {
            node,
            cause,
            objects_lost,
        } => {
            tracing::warn!(node = %node, cause = %cause, "node declared dead; its actors restart elsewhere or are reported dead");
            if objects_lost > 0 {
                tracing::warn!(node = %node, objects = objects_lost, "objects lost with their node");
            }
        }
        Notice::StartFailed { actor, cause } => tracing::warn!(%actor, cause = %cause, "actor failed to start"),
        Notice::Exited { actor, cause } => tracing::warn!(%actor, cause = %cause, "actor exited"),
        Notice::ObjectRefused(failure) => tracing::warn!(?failure, "refused an object registration"),
        Notice::ObjectsGone { node, objects } => {
            tracing::warn!(node = %node, objects, "the node registered without objects whose only copy it held; they are lost")
        }
    }
}

/// Sends a start or stop to the node's agent without blocking the head.
pub(super) fn carry_out(head: &ActorRef<Wire>, scope: &str, effect: Effect) {
    let (node, request, start) = match effect {
        Effect::Start(start) => (start.node.clone(), AgentRequest::Start(start.clone()), Some(start)),
        Effect::Stop { node, actor } => (node, AgentRequest::Stop(actor), None),
        Effect::Announce { node, actor } => (node, AgentRequest::Announce(actor), None),
    };
    let Some(agent) = node::first_member(scope, &node::agent_group(&node)) else {
        if let Some(start) = start {
            // No session to the node: it is lost, and the actor never ran there.
            let report = HeadRequest::Undelivered {
                actor: start.actor,
                attempt: start.attempt,
                cause: format!("node {node}'s agent is not reachable"),
            };
            let _ = head.send_message(Wire::Local(LocalSignal::Deferred(wire::encode(&report))));
        }
        return;
    };
    let head = head.clone();
    tokio::spawn(async move {
        let delivered = wire::call_raw(&agent, wire::encode(&request), Duration::from_secs(10)).await;
        if let (Err(_), Some(start)) = (delivered, start) {
            report_undeliverable(&head, &start);
        }
    });
}

/// A start the node's agent did not take: the actor is lost with its node's part in it.
fn report_undeliverable(head: &ActorRef<Wire>, start: &StartActor) {
    let report = HeadRequest::Exited {
        actor: start.actor,
        attempt: start.attempt,
        cause: Loss::Undelivered {
            node: start.node.clone(),
        },
    };
    let _ = head.send_message(Wire::Local(LocalSignal::Deferred(wire::encode(&report))));
}

/// Tells every holder to drop its copy, and deletes the spilled copy.
pub(super) fn carry_out_release(scope: &str, release: Release) {
    let command = ObjectCommand::Release {
        id: release.id,
        spilled: None,
    };
    for node in &release.nodes {
        if let Some(target) = node::first_member(scope, &objects_group(node)) {
            let _ = wire::cast_raw(&target, wire::encode(&command));
        }
    }
    if let Some((_, url)) = release.spilled {
        tokio::spawn(async move {
            if let Err(e) = regatta_object_store::delete_spilled(&url).await {
                tracing::warn!(error = %e, "could not delete a spilled copy");
            }
        });
    }
}
