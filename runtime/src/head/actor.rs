//! The head actor: decodes requests, hands them to [`HeadCore`], holds the reply ports of
//! those the core parks, runs the liveness tick and carries out the core's outputs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use regatta_proto::{ChangeRef, HeadCore, Output, ReplyTo};
use regatta_proto::{Failure, HeadRequest};

use super::outputs::{carry_out, carry_out_release, encode_answer, log_notice};
use super::persist::{Persist, Recovery};
use super::HEAD_NODE;
use crate::metrics::SdTarget;
use crate::net::wire::{self, LocalSignal, Wire};

pub(super) struct Head;

pub(super) struct HeadArgs {
    pub(super) scope: String,
    pub(super) heartbeat_timeout_ms: u64,
    pub(super) object_grace_ms: u64,
    pub(super) object_fanout: usize,
    pub(super) targets: Arc<Mutex<Vec<SdTarget>>>,
    pub(super) head_target: Option<String>,
    /// The state files and what they held at start, when the head keeps its state.
    pub(super) state: Option<Recovery>,
}

/// The actor's state: the core that decides, and the reply ports of the requests it holds.
pub(super) struct HeadState {
    scope: String,
    pub(super) core: HeadCore,
    epoch: Instant,
    ports: BTreeMap<ReplyTo, RpcReplyPort<Vec<u8>>>,
    next_port: u64,
    targets: Arc<Mutex<Vec<SdTarget>>>,
    head_target: Option<String>,
    published_ms: Option<u64>,
    /// The clock of a restored head goes on from the saved one.
    clock_offset_ms: u64,
    pub(super) persist: Option<Persist>,
}

impl HeadState {
    /// Logs a change (written with the next append), when the head keeps its state.
    fn record(&mut self, change: &ChangeRef<'_>) {
        if let Some(persist) = &mut self.persist {
            persist.record(change);
        }
    }

    /// After a change: its records go to the writer now, or after the write under way.
    fn commit(&mut self) {
        let now = self.now_ms();
        if let Some(persist) = &mut self.persist {
            persist.commit(&self.core, now);
        }
    }

    /// The writer finished an append.
    fn written(&mut self) {
        let now = self.now_ms();
        if let Some(persist) = &mut self.persist {
            persist.written(&self.core, now);
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.clock_offset_ms + self.epoch.elapsed().as_millis() as u64
    }

    /// Keeps a reply port until the core answers through its token.
    fn hold(&mut self, port: RpcReplyPort<Vec<u8>>) -> ReplyTo {
        self.next_port += 1;
        let to = ReplyTo(self.next_port);
        self.ports.insert(to, port);
        to
    }

    /// Sends an answer now, or holds it for the write of the change that made it.
    fn answer(&mut self, port: RpcReplyPort<Vec<u8>>, bytes: Vec<u8>, changed: bool) {
        match &mut self.persist {
            Some(persist) if changed => persist.held.push((port, bytes)),
            _ => {
                let _ = port.send(bytes);
            }
        }
    }
}

impl Actor for Head {
    type Msg = Wire;
    type State = HeadState;
    type Arguments = HeadArgs;

    async fn post_stop(
        &self,
        _myself: ActorRef<Wire>,
        state: &mut HeadState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        // The writer thread finishes what it was handed; hand it the last records too.
        if let Some(persist) = &mut state.persist {
            persist.flush();
        }
        Ok(())
    }

    async fn pre_start(
        &self,
        myself: ActorRef<Wire>,
        args: HeadArgs,
    ) -> std::result::Result<HeadState, ActorProcessingErr> {
        let (core, clock_offset_ms, persist) = match args.state {
            None => (HeadCore::new(args.heartbeat_timeout_ms, args.object_grace_ms), 0, None),
            Some(recovery) => {
                let (core, now, persist) = Persist::start(recovery, myself.clone())?;
                (core, now, Some(persist))
            }
        };
        let core = core.with_object_fanout(args.object_fanout);
        Ok(HeadState {
            scope: args.scope,
            core,
            clock_offset_ms,
            persist,
            epoch: Instant::now(),
            ports: BTreeMap::new(),
            next_port: 0,
            targets: args.targets,
            head_target: args.head_target,
            published_ms: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Wire>,
        message: Wire,
        state: &mut HeadState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let now = state.now_ms();
        let (outputs, changed) = match message {
            Wire::Call(bytes, port) => match wire::decode::<HeadRequest>(&bytes, "a head request") {
                Ok(request) => {
                    let to = state.hold(port);
                    state.request(request, Some(to), now)
                }
                Err(failure) => {
                    tracing::warn!(?failure, "ignored a malformed head request");
                    wire::reply::<()>(port, Err(failure));
                    (Vec::new(), false)
                }
            },
            Wire::Cast(bytes, _) | Wire::Local(LocalSignal::Deferred(bytes)) => {
                match wire::decode::<HeadRequest>(&bytes, "a head request") {
                    Ok(request) => state.request(request, None, now),
                    Err(failure) => {
                        tracing::warn!(?failure, "ignored a malformed head message");
                        (Vec::new(), false)
                    }
                }
            }
            Wire::CallActor(actor, _, port) => {
                let failure = Failure::BadMessage(format!("could not decode a head request: the message is addressed to actor {actor}, which the head does not host"));
                wire::reply::<()>(port, Err(failure));
                (Vec::new(), false)
            }
            Wire::CastActor(..) => (Vec::new(), false),
            Wire::Local(LocalSignal::Tick) => state.tick(now),
            Wire::Local(LocalSignal::Written) => {
                state.written();
                (Vec::new(), false)
            }
            Wire::Local(_) => (Vec::new(), false),
        };
        for output in outputs {
            match output {
                Output::Reply(to, answer) => {
                    if let Some(port) = state.ports.remove(&to) {
                        state.answer(port, encode_answer(answer), changed);
                    }
                }
                Output::Effect(effect) => carry_out(&myself, &state.scope, effect),
                Output::Release(release) => carry_out_release(&state.scope, release),
                Output::Notice(notice) => log_notice(notice),
            }
        }
        if changed {
            state.commit();
        }
        Ok(())
    }
}

impl HeadState {
    /// Logs `request` when it changes the state and hands it to the core; returns the
    /// core's outputs and whether the state changed.
    fn request(&mut self, request: HeadRequest, to: Option<ReplyTo>, now: u64) -> (Vec<Output>, bool) {
        let changed = match ChangeRef::of(&request, to, now) {
            Some(change) => {
                self.record(&change);
                true
            }
            None => false,
        };
        let (kind, started) = (request.name(), Instant::now());
        let outputs = self.core.handle(request, to, now);
        observe_request(kind, started);
        (outputs, changed)
    }

    /// The liveness tick: forgets callers that gave up, lets the core declare silent nodes
    /// dead (a logged change) and publishes the cluster's figures.
    fn tick(&mut self, now: u64) -> (Vec<Output>, bool) {
        let closed: BTreeSet<ReplyTo> = self
            .ports
            .iter()
            .filter(|(_, port)| port.is_closed())
            .map(|(to, _)| *to)
            .collect();
        self.ports.retain(|to, _| !closed.contains(to));
        self.core.forget(|to| closed.contains(&to));
        let (outputs, logged) = self.core.tick_logged(now);
        if let Some(change) = &logged {
            self.record(&change.as_ref());
        }
        publish_metrics(self, now);
        (outputs, logged.is_some())
    }
}

/// Publishes the cluster's figures and the discovery targets, at most once a second.
/// Target labels are `regatta_node` and `regatta_role`: a target label named `node` would
/// clash with the `node` label of the series themselves (Prometheus renames clashing
/// scraped labels to `exported_node`).
fn publish_metrics(state: &mut HeadState, now: u64) {
    if state.published_ms.is_some_and(|last| now.saturating_sub(last) < 1_000) {
        return;
    }
    state.published_ms = Some(now);
    let status = state.core.status(now);
    crate::metrics::metrics().publish_cluster(&status, &state.core.scheduler().heartbeat_ages(now));
    let mut targets: Vec<SdTarget> = state
        .core
        .scheduler()
        .metrics_targets()
        .into_iter()
        .map(|(node, address)| SdTarget {
            targets: vec![address],
            labels: BTreeMap::from([
                ("regatta_node".to_string(), node),
                ("regatta_role".to_string(), "worker".to_string()),
            ]),
        })
        .collect();
    if let Some(head) = &state.head_target {
        targets.push(SdTarget {
            targets: vec![head.clone()],
            labels: BTreeMap::from([
                ("regatta_node".to_string(), HEAD_NODE.to_string()),
                ("regatta_role".to_string(), "head".to_string()),
            ]),
        });
    }
    if let Ok(mut shared) = state.targets.lock() {
        *shared = targets;
    }
}

/// Records how long the head's core took for one request.
fn observe_request(kind: &str, started: Instant) {
    crate::metrics::metrics()
        .head_request_seconds
        .with_label_values(&[kind])
        .observe(started.elapsed().as_secs_f64());
}
