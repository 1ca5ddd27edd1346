//! The node agent: the actor on each worker that constructs actors by kind name (remote
//! spawn, which `ractor_cluster` lacks), supervises their hosts and reports their exits.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};

use crate::client::actor::{unix_ms, LogBook};
use crate::client::ActorContext;
use crate::client::Cluster;
use crate::net::node;
use crate::net::wire::{self, LocalSignal, Wire};
use crate::worker::registry::{Host, HostArgs, Registry, StartError};
use regatta_proto::{ActorId, AgentRequest, Failure, HeadRequest, Loss, RunningActor, StartActor, StartFailure};

use super::router::Router;
use crate::error::Error;
use crate::net::calls::Routes;

/// How long an agent waits for the head to take a report.
const REPORT_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct Agent;

pub(crate) struct AgentArgs {
    pub(crate) node: String,
    pub(crate) host: String,
    pub(crate) registry: Registry,
    pub(crate) cluster: Cluster,
    /// Where the node's hosted actors' queues are, shared with its call channel.
    pub(crate) routes: Routes,
    /// The node's call channel address, if it serves one.
    pub(crate) call_address: Option<crate::net::calls::CallAddress>,
}

/// Starts a node's agent and joins it to the node's agent group, where the head and
/// peers find it.
pub(crate) async fn start_agent(scope: &str, args: AgentArgs) -> crate::error::Result<ActorRef<Wire>> {
    let name = args.node.clone();
    let (agent, _) = Actor::spawn(None, Agent, args)
        .await
        .map_err(|e| Error::Actor(format!("cannot start node {name}'s agent: {e}")))?;
    node::join_group(scope, &node::agent_group(&name), agent.get_cell());
    Ok(agent)
}

pub(crate) struct AgentState {
    node: String,
    host: String,
    registry: Registry,
    cluster: Cluster,
    hosts: HashMap<ActorId, (ActorCell, u32)>,
    by_cell: HashMap<ractor::ActorId, (ActorId, u32)>,
    stopping: HashSet<ractor::ActorId>,
    /// Actors whose start is under way here, with their attempt.
    starting: HashMap<ActorId, u32>,
    /// Actors the head stopped while they were starting: stopped as soon as they are up
    /// (else a kill racing a slow constructor left the actor running, unknown to the head).
    stop_when_up: HashSet<ActorId>,
    logs: LogBook,
    /// Where the router finds each hosted actor's queue.
    routes: Routes,
    /// The node's router (process group `router/<node>`).
    router: ActorRef<Wire>,
}

impl AgentState {
    /// A line in `actor`'s log on this node.
    fn log(&self, actor: ActorId, text: &str) {
        log_to(&self.logs, actor, text);
    }
}

fn log_to(logs: &LogBook, actor: ActorId, text: &str) {
    if let Ok(mut book) = logs.lock() {
        book.push(actor, unix_ms(), text);
    }
}

impl Actor for Agent {
    type Msg = Wire;
    type State = AgentState;
    type Arguments = AgentArgs;

    async fn pre_start(&self, myself: ActorRef<Wire>, args: AgentArgs) -> Result<AgentState, ActorProcessingErr> {
        let routes = args.routes.clone();
        let router_args = (args.node.clone(), routes.clone(), args.call_address.clone());
        let (router, _) = Actor::spawn_linked(None, Router, router_args, myself.get_cell()).await?;
        node::join_group(args.cluster.scope(), &node::router_group(&args.node), router.get_cell());
        Ok(AgentState {
            routes,
            router,
            node: args.node,
            host: args.host,
            registry: args.registry,
            cluster: args.cluster,
            hosts: HashMap::new(),
            by_cell: HashMap::new(),
            stopping: HashSet::new(),
            starting: HashMap::new(),
            stop_when_up: HashSet::new(),
            logs: Default::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Wire>,
        message: Wire,
        state: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            Wire::Call(bytes, port) => match wire::decode::<AgentRequest>(&bytes, "an agent request") {
                Ok(AgentRequest::Logs(actor)) => {
                    let lines = state.logs.lock().map(|book| book.lines(actor)).unwrap_or_default();
                    wire::reply(port, Ok::<_, Failure>(lines));
                }
                Ok(AgentRequest::Running) => wire::reply(port, Ok::<_, Failure>(running(state))),
                Ok(request) => {
                    handle_request(&myself, state, request);
                    wire::reply(port, Ok::<(), Failure>(()));
                }
                Err(failure) => {
                    tracing::warn!(?failure, "ignored a malformed agent request");
                    wire::reply::<()>(port, Err(failure));
                }
            },
            Wire::Cast(bytes, _) => match wire::decode::<AgentRequest>(&bytes, "an agent request") {
                Ok(request) => handle_request(&myself, state, request),
                Err(failure) => tracing::warn!(?failure, "ignored a malformed agent message"),
            },
            Wire::Local(LocalSignal::Hosted { actor, attempt, host }) => {
                state.starting.remove(&actor);
                if state.stop_when_up.remove(&actor) {
                    // Known by its cell, so its exit is taken as the stop it is.
                    state.by_cell.insert(host.get_id(), (actor, attempt));
                    state.routes.remove(actor, attempt);
                    state.log(
                        actor,
                        "stopped by the head (killed, its group removed or its job ended) as soon as it started",
                    );
                    stop_host(state, &host);
                    return Ok(());
                }
                state.by_cell.insert(host.get_id(), (actor, attempt));
                if let Some((old, _)) = state.hosts.insert(actor, (host, attempt)) {
                    stop_host(state, &old);
                }
            }
            Wire::Local(LocalSignal::Unwanted(actors)) => {
                for actor in actors {
                    stop_actor(
                        state,
                        actor,
                        "stopped: the head did not want it running when this node registered (killed meanwhile, restarted elsewhere, or unknown to it)",
                    );
                }
            }
            Wire::Local(LocalSignal::NotStarted(actor)) => {
                state.starting.remove(&actor);
                state.stop_when_up.remove(&actor);
            }
            Wire::Local(_) | Wire::CallActor(..) | Wire::CastActor(..) => {}
        }
        Ok(())
    }

    async fn post_stop(&self, _myself: ActorRef<Wire>, state: &mut AgentState) -> Result<(), ActorProcessingErr> {
        state.routes.clear();
        state.router.stop(None);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Wire>,
        event: SupervisionEvent,
        state: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, cause) = match event {
            SupervisionEvent::ActorFailed(cell, err) => (cell, format!("the actor failed: {err}")),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                cell,
                format!(
                    "the actor stopped: {}",
                    reason.unwrap_or_else(|| "no reason given".into())
                ),
            ),
            _ => return Ok(()),
        };
        let Some((actor, attempt)) = state.by_cell.remove(&cell.get_id()) else {
            if cell.get_id() == state.router.get_id() {
                tracing::error!(node = %state.node, cause = %cause, "the node's router exited; its actors cannot be called");
            }
            return Ok(());
        };
        state.routes.remove(actor, attempt);
        if state.stopping.remove(&cell.get_id()) {
            return Ok(());
        }
        state.hosts.remove(&actor);
        tracing::warn!(%actor, cause = %cause, "actor exited");
        state.log(actor, &format!("exited: {cause}"));
        let cluster = state.cluster.clone();
        tokio::spawn(async move {
            let report = HeadRequest::Exited {
                actor,
                attempt,
                cause: Loss::Exited(cause),
            };
            if let Err(e) = cluster.ask_head::<()>(&report, REPORT_TIMEOUT).await {
                tracing::warn!(%actor, error = %e, "could not report an actor exit to the head");
            }
        });
        Ok(())
    }
}

/// What the node runs or is starting, for a registration with the head.
fn running(state: &AgentState) -> Vec<RunningActor> {
    let up = state.hosts.iter().map(|(actor, (_, attempt))| RunningActor {
        actor: *actor,
        attempt: *attempt,
        up: true,
    });
    let starting = state.starting.iter().map(|(actor, attempt)| RunningActor {
        actor: *actor,
        attempt: *attempt,
        up: false,
    });
    up.chain(starting).collect()
}

/// Stops a hosted actor now, or one still starting as soon as it is up.
fn stop_actor(state: &mut AgentState, actor: ActorId, why: &str) {
    if let Some((cell, attempt)) = state.hosts.remove(&actor) {
        state.routes.remove(actor, attempt);
        state.log(actor, why);
        stop_host(state, &cell);
    } else if state.starting.contains_key(&actor) {
        state.stop_when_up.insert(actor);
    }
}

fn stop_host(state: &mut AgentState, cell: &ActorCell) {
    state.stopping.insert(cell.get_id());
    cell.stop(Some("stopped by the head".into()));
}

fn handle_request(myself: &ActorRef<Wire>, state: &mut AgentState, request: AgentRequest) {
    match request {
        AgentRequest::Start(start) => {
            if start.node != state.node {
                tracing::warn!(node = %start.node, "ignored a start meant for another node");
                return;
            }
            state.log(
                start.actor,
                &format!(
                    "starting {} on {} (attempt {}, resources {{{}}}{})",
                    start.kind,
                    start.node,
                    start.attempt,
                    start.resources,
                    if start.gpu_ids.is_empty() {
                        String::new()
                    } else {
                        format!(", GPUs {:?}", start.gpu_ids)
                    }
                ),
            );
            state.starting.insert(start.actor, start.attempt);
            tokio::spawn(start_actor(
                myself.clone(),
                state.routes.clone(),
                state.registry.clone(),
                state.cluster.clone(),
                state.host.clone(),
                state.logs.clone(),
                start,
            ));
        }
        AgentRequest::Stop(actor) => stop_actor(
            state,
            actor,
            "stopped by the head (killed, its group removed or its job ended)",
        ),
        // Answered in `handle` (they have a reply).
        AgentRequest::Logs(_) | AgentRequest::Running => {}
        AgentRequest::Announce(actor) => {
            // Re-joining sends the membership to every connected peer again (ractor's pg
            // notifies joins of existing members too), healing a peer's mirror that missed
            // the router through which the actor is reached.
            if state.hosts.contains_key(&actor) {
                tracing::info!(%actor, "advertising the node's router again: a peer could not see it");
                node::join_group(
                    state.cluster.scope(),
                    &node::router_group(&state.node),
                    state.router.get_cell(),
                );
            }
        }
    }
}

/// Constructs the actor, hosts it, advertises it, then tells the head how it went.
async fn start_actor(
    agent: ActorRef<Wire>,
    routes: Routes,
    registry: Registry,
    cluster: Cluster,
    host: String,
    logs: LogBook,
    start: StartActor,
) {
    let ctx = ActorContext {
        logs: logs.clone(),
        id: start.actor,
        node: start.node.clone(),
        host,
        gpu_ids: start.gpu_ids.clone(),
        resources: start.resources.clone(),
        name: start.name.clone(),
        cluster: cluster.with_job(start.job.clone()),
    };
    let (queue, inbox) = tokio::sync::mpsc::unbounded_channel();
    let outcome = match registry.construct(&start.kind, start.args, ctx.clone()).await {
        Err(cause) => Err(cause),
        Ok(actor) => match Actor::spawn_linked(
            None,
            Host,
            HostArgs {
                actor,
                ctx,
                kind: start.kind.clone(),
                queue: queue.clone(),
                inbox,
            },
            agent.get_cell(),
        )
        .await
        {
            Err(e) => Err(StartError::Host(e)),
            Ok((host, _)) => {
                // Routed before the head hears it started: a caller told "alive" reaches it.
                let depth = crate::metrics::metrics()
                    .mailbox_depth
                    .with_label_values(&[&start.kind]);
                routes.insert(start.actor, start.attempt, &queue, depth);
                drop(queue);
                let hosted = LocalSignal::Hosted {
                    actor: start.actor,
                    attempt: start.attempt,
                    host: host.get_cell(),
                };
                if agent.send_message(Wire::Local(hosted)).is_err() {
                    host.stop(None);
                    Err(StartError::ShuttingDown)
                } else {
                    Ok(())
                }
            }
        },
    };
    match &outcome {
        Ok(()) => log_to(&logs, start.actor, "alive"),
        Err(cause) => {
            log_to(&logs, start.actor, &format!("could not start: {cause}"));
            let _ = agent.send_message(Wire::Local(LocalSignal::NotStarted(start.actor)));
        }
    }
    let report = HeadRequest::Started {
        actor: start.actor,
        attempt: start.attempt,
        outcome: outcome.map_err(|cause| StartFailure::new(cause.to_string())),
    };
    if let Err(e) = cluster.ask_head::<()>(&report, REPORT_TIMEOUT).await {
        tracing::warn!(actor = %start.actor, error = %e, "could not report an actor start to the head");
    }
}
