//! Prometheus metrics: one registry per process, served on `/metrics` by every node, plus
//! the head's HTTP service-discovery endpoint listing every live node's target.
//!
//! Labels stay bounded: node names, actor kinds, resource names and states, never object
//! ids or per-call values. A scrape reads atomics and small snapshots that the head's
//! timer and the actor hosts keep up to date; it never waits on an actor's mailbox.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use serde::Serialize;

use crate::error::Result;
use crate::objects::ObjectStats;
use regatta_proto::ClusterStatus;
use regatta_proto::UNIT;

/// Every metric Regatta exports.
pub struct Metrics {
    registry: Registry,
    /// Serializes snapshot updates with scrapes, so a scrape never sees half an update.
    snapshot: Mutex<()>,
    // Per process (head and workers).
    pub(crate) actor_messages: IntCounterVec,
    pub(crate) handler_seconds: HistogramVec,
    pub(crate) mailbox_depth: IntGaugeVec,
    /// Calls and casts that arrived on this process's call channel (not the sessions).
    pub(crate) call_channel_messages: IntCounterVec,
    object_bytes: IntGaugeVec,
    object_count: IntGaugeVec,
    object_capacity: IntGaugeVec,
    object_spills: IntGaugeVec,
    object_spilled_bytes: IntGaugeVec,
    object_restores: IntGaugeVec,
    object_transfer: IntGaugeVec,
    object_receive_pool: IntGaugeVec,
    // Head only.
    nodes: IntGaugeVec,
    node_total: prometheus::GaugeVec,
    node_used: prometheus::GaugeVec,
    heartbeat_age: prometheus::GaugeVec,
    actors: IntGaugeVec,
    restarts: IntGaugeVec,
    groups: IntGaugeVec,
    pending: IntGauge,
    directory_objects: IntGaugeVec,
    directory_bytes: IntGaugeVec,
    pub(crate) jobs: IntGaugeVec,
    pub(crate) job_seconds: HistogramVec,
    /// How long the head's loop took per request, by kind (a spawn's includes placing it).
    pub(crate) head_request_seconds: HistogramVec,
    /// How long the head's loop stopped to encode a snapshot of its state.
    pub(crate) head_snapshot_seconds: HistogramVec,
}

/// Buckets for the head's per-request time: microseconds to a second.
const HEAD_REQUEST_BUCKETS: [f64; 14] = [
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1, 0.5, 1.0,
];

fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let metric = IntGaugeVec::new(Opts::new(name, help), labels).expect("metric names and labels are valid");
    registry
        .register(Box::new(metric.clone()))
        .expect("each metric registers once");
    metric
}

fn float_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::GaugeVec {
    let metric = prometheus::GaugeVec::new(Opts::new(name, help), labels).expect("metric names and labels are valid");
    registry
        .register(Box::new(metric.clone()))
        .expect("each metric registers once");
    metric
}

impl Metrics {
    fn new() -> Self {
        let registry = Registry::new();
        let r = &registry;
        let actor_messages = IntCounterVec::new(
            Opts::new("regatta_actor_messages_total", "Messages handled, by actor kind"),
            &["kind"],
        )
        .expect("valid metric");
        r.register(Box::new(actor_messages.clone())).expect("registers once");
        let handler_seconds = HistogramVec::new(
            HistogramOpts::new("regatta_actor_handler_seconds", "Time an actor's handler took, by kind").buckets(vec![
                0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
            ]),
            &["kind"],
        )
        .expect("valid metric");
        r.register(Box::new(handler_seconds.clone())).expect("registers once");
        let call_channel_messages = IntCounterVec::new(
            Opts::new(
                "regatta_call_channel_messages_total",
                "Actor calls and casts that arrived on this process's call channel, by kind (call, cast)",
            ),
            &["kind"],
        )
        .expect("valid metric");
        r.register(Box::new(call_channel_messages.clone()))
            .expect("registers once");
        let job_seconds = HistogramVec::new(
            HistogramOpts::new(
                "regatta_job_duration_seconds",
                "How long finished jobs ran, by final state",
            )
            .buckets(vec![1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0]),
            &["state"],
        )
        .expect("valid metric");
        r.register(Box::new(job_seconds.clone())).expect("registers once");
        let pending = IntGauge::new(
            "regatta_pending_requests",
            "Actors and placement groups waiting for resources",
        )
        .expect("valid metric");
        r.register(Box::new(pending.clone())).expect("registers once");
        let head_request_seconds = HistogramVec::new(
            HistogramOpts::new(
                "regatta_head_request_seconds",
                "Time the head took to handle a request, by kind (`HeadRequest::name`; spawn includes placing the actor)",
            )
            .buckets(HEAD_REQUEST_BUCKETS.to_vec()),
            &["request"],
        )
        .expect("valid metric");
        r.register(Box::new(head_request_seconds.clone()))
            .expect("registers once");
        let head_snapshot_seconds = HistogramVec::new(
            HistogramOpts::new(
                "regatta_head_snapshot_seconds",
                "Time the head's loop stopped to encode a snapshot of the cluster's state (when: recovery, or the log passed its size)",
            )
            .buckets(vec![1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &["when"],
        )
        .expect("valid metric");
        r.register(Box::new(head_snapshot_seconds.clone()))
            .expect("registers once");
        Self {
            head_request_seconds,
            head_snapshot_seconds,
            snapshot: Mutex::new(()),
            actor_messages,
            handler_seconds,
            call_channel_messages,
            mailbox_depth: gauge_vec(
                r,
                "regatta_actor_mailbox_depth",
                "Messages waiting in actor mailboxes, by kind",
                &["kind"],
            ),
            object_bytes: gauge_vec(
                r,
                "regatta_object_store_bytes",
                "Bytes of objects in memory on this node",
                &["node"],
            ),
            object_count: gauge_vec(
                r,
                "regatta_object_store_objects",
                "Objects in memory on this node",
                &["node"],
            ),
            object_capacity: gauge_vec(
                r,
                "regatta_object_store_capacity_bytes",
                "Object store capacity of this node",
                &["node"],
            ),
            object_spills: gauge_vec(
                r,
                "regatta_object_spills_total",
                "Objects spilled by this node",
                &["node"],
            ),
            object_spilled_bytes: gauge_vec(
                r,
                "regatta_object_spilled_bytes_total",
                "Bytes spilled by this node",
                &["node"],
            ),
            object_restores: gauge_vec(
                r,
                "regatta_object_restores_total",
                "Objects restored from spilled copies by this node",
                &["node"],
            ),
            object_transfer: gauge_vec(
                r,
                "regatta_object_transfer_bytes_total",
                "Bytes moved between nodes (direction in or out; in_shared_memory: the part of in mapped from a same-host peer)",
                &["node", "direction"],
            ),
            object_receive_pool: gauge_vec(
                r,
                "regatta_object_receive_pool_bytes",
                "Bytes of dropped received objects' buffers this process keeps for the next get (outside the store's capacity)",
                &["node"],
            ),
            nodes: gauge_vec(r, "regatta_nodes", "Nodes by state", &["state"]),
            node_total: float_vec(
                r,
                "regatta_node_resources_total",
                "Resources of each node, by name",
                &["node", "resource"],
            ),
            node_used: float_vec(
                r,
                "regatta_node_resources_used",
                "Resources in use on each node, by name",
                &["node", "resource"],
            ),
            heartbeat_age: float_vec(
                r,
                "regatta_node_heartbeat_age_seconds",
                "Seconds since each node's last heartbeat",
                &["node"],
            ),
            actors: gauge_vec(r, "regatta_actors", "Actors by kind and state", &["kind", "state"]),
            restarts: gauge_vec(
                r,
                "regatta_actor_restarts_total",
                "Actor restarts so far, by kind",
                &["kind"],
            ),
            groups: gauge_vec(r, "regatta_placement_groups", "Placement groups by state", &["state"]),
            pending,
            directory_objects: gauge_vec(
                r,
                "regatta_objects",
                "Objects in the cluster directory, by state",
                &["state"],
            ),
            directory_bytes: gauge_vec(
                r,
                "regatta_object_directory_bytes",
                "Bytes of objects in the directory, by state",
                &["state"],
            ),
            jobs: gauge_vec(r, "regatta_jobs", "Jobs by state", &["state"]),
            job_seconds,
            registry,
        }
    }

    /// The process's registry, for metrics that other crates define (the trainer's).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Text exposition of every metric.
    pub fn render(&self) -> String {
        let _snapshot = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        let families = self.registry.gather();
        // Encoding plain metric families into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&families, &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Records one handled message.
    pub(crate) fn handled(&self, kind: &str, seconds: f64) {
        self.actor_messages.with_label_values(&[kind]).inc();
        self.handler_seconds.with_label_values(&[kind]).observe(seconds);
    }

    /// Publishes a process's object store figures.
    pub(crate) fn publish_objects(&self, node: &str, stats: &ObjectStats) {
        let set = |gauge: &IntGaugeVec, value: u64| gauge.with_label_values(&[node]).set(value as i64);
        set(&self.object_bytes, stats.bytes_in_memory);
        set(&self.object_count, stats.objects_in_memory);
        set(&self.object_capacity, stats.capacity_bytes);
        set(&self.object_spills, stats.spills);
        set(&self.object_spilled_bytes, stats.spilled_bytes);
        set(&self.object_restores, stats.restores);
        set(&self.object_receive_pool, stats.receive_pool_bytes);
        self.object_transfer
            .with_label_values(&[node, "in"])
            .set(stats.transfer_in_bytes as i64);
        self.object_transfer
            .with_label_values(&[node, "in_shared_memory"])
            .set(stats.shared_in_bytes as i64);
        self.object_transfer
            .with_label_values(&[node, "out"])
            .set(stats.transfer_out_bytes as i64);
    }

    /// Publishes the head's view of the cluster (called from the head's timer).
    pub(crate) fn publish_cluster(&self, status: &ClusterStatus, heartbeat_ages: &BTreeMap<String, f64>) {
        let _snapshot = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        for metric in [
            &self.nodes,
            &self.actors,
            &self.restarts,
            &self.groups,
            &self.directory_objects,
            &self.directory_bytes,
        ] {
            metric.reset();
        }
        for metric in [&self.node_total, &self.node_used, &self.heartbeat_age] {
            metric.reset();
        }
        for state in ["alive", "dead"] {
            self.nodes.with_label_values(&[state]).set(0);
        }
        for node in &status.nodes {
            self.nodes.with_label_values(&[node.state.as_str()]).inc();
            if node.state != "alive" {
                continue;
            }
            for (name, total) in node.total.iter() {
                self.node_total
                    .with_label_values(&[&node.name, name])
                    .set(total as f64 / UNIT as f64);
                self.node_used
                    .with_label_values(&[&node.name, name])
                    .set(node.used.fixed(name) as f64 / UNIT as f64);
            }
            if let Some(age) = heartbeat_ages.get(&node.name) {
                self.heartbeat_age.with_label_values(&[&node.name]).set(*age);
            }
        }
        for actor in &status.actors {
            let kind = actor.view.kind.as_str();
            self.actors.with_label_values(&[kind, actor.view.state.label()]).inc();
            self.restarts
                .with_label_values(&[kind])
                .add(i64::from(actor.view.restarts));
        }
        for state in ["pending", "created", "rescheduling"] {
            self.groups.with_label_values(&[state]).set(0);
        }
        for group in &status.groups {
            self.groups.with_label_values(&[group.state.as_str()]).inc();
        }
        self.pending.set(status.pending.len() as i64);
        let objects = &status.objects;
        self.directory_objects
            .with_label_values(&["stored"])
            .set(objects.objects as i64);
        self.directory_objects
            .with_label_values(&["spilled"])
            .set(objects.spilled_objects as i64);
        self.directory_objects
            .with_label_values(&["lost"])
            .set(objects.lost as i64);
        self.directory_bytes
            .with_label_values(&["stored"])
            .set(objects.bytes as i64);
        self.directory_bytes
            .with_label_values(&["spilled"])
            .set(objects.spilled_bytes as i64);
    }
}

/// This process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// One Prometheus HTTP service-discovery group.
#[derive(Clone, Debug, Serialize)]
pub struct SdTarget {
    /// `host:port` of a node's `/metrics`.
    pub targets: Vec<String>,
    /// Labels Prometheus attaches to the target.
    pub labels: BTreeMap<String, String>,
}

/// Where the head finds the current discovery targets.
pub(crate) type TargetSource = Arc<dyn Fn() -> Vec<SdTarget> + Send + Sync>;

#[derive(Clone)]
struct MetricsState {
    refresh: Option<Arc<dyn Fn() + Send + Sync>>,
    targets: Option<TargetSource>,
}

/// Serves `/metrics` (and on the head `/api/prometheus/sd`) on `bind`; `refresh` runs
/// before each scrape to publish cheap per-process figures.
pub(crate) async fn serve(
    bind: SocketAddr,
    refresh: Option<Arc<dyn Fn() + Send + Sync>>,
    targets: Option<TargetSource>,
) -> Result<SocketAddr> {
    let state = MetricsState { refresh, targets };
    let app = Router::new()
        .route("/metrics", get(scrape))
        .route("/api/prometheus/sd", get(discovery))
        .with_state(state);
    crate::net::http::serve(app, bind, "metrics endpoint", None).await
}

async fn scrape(State(state): State<MetricsState>) -> Response {
    if let Some(refresh) = &state.refresh {
        refresh();
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        metrics().render(),
    )
        .into_response()
}

async fn discovery(State(state): State<MetricsState>) -> Response {
    let targets = state.targets.as_ref().map(|source| source()).unwrap_or_default();
    Json(targets).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use regatta_proto::Resources;
    use regatta_proto::{ActorLine, ActorView, NodeStatus};

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn handled_messages_move_the_counter_and_histogram() {
        let m = Metrics::new();
        m.handled("echo", 0.002);
        m.handled("echo", 0.002);
        let out = {
            let mut buf = Vec::new();
            TextEncoder::new().encode(&m.registry.gather(), &mut buf).unwrap();
            String::from_utf8(buf).unwrap()
        };
        assert_eq!(value(&out, "regatta_actor_messages_total{kind=\"echo\"}"), Some(2.0));
        assert_eq!(
            value(&out, "regatta_actor_handler_seconds_count{kind=\"echo\"}"),
            Some(2.0)
        );
    }

    #[test]
    fn cluster_snapshot_sets_nodes_resources_actors_and_objects() {
        use regatta_proto::ActorState;
        let m = Metrics::new();
        let mut used = Resources::new();
        used.set("CPU", 1.5);
        let status = ClusterStatus {
            nodes: vec![NodeStatus {
                name: "w1".into(),
                address: "a".into(),
                state: "alive".into(),
                since_s: 1.0,
                cause: None,
                total: Resources::parse_capacity("CPU=4,accelerator_type:H100=1").unwrap(),
                used,
                kinds: vec![],
                actors: 1,
            }],
            actors: vec![ActorLine {
                view: ActorView {
                    id: crate::ActorId(1),
                    kind: "echo".into(),
                    state: ActorState::Alive,
                    node: None,
                    address: None,
                    restarts: 2,
                },
                name: None,
                resources: Resources::new(),
                gpu_ids: vec![],
            }],
            ..Default::default()
        };
        m.publish_cluster(&status, &BTreeMap::from([("w1".to_string(), 0.25)]));
        m.publish_objects(
            "w1",
            &ObjectStats {
                bytes_in_memory: 10,
                spills: 3,
                receive_pool_bytes: 1 << 30,
                ..Default::default()
            },
        );
        let out = m.render();
        assert_eq!(
            value(&out, "regatta_node_resources_used{node=\"w1\",resource=\"CPU\"}"),
            Some(1.5)
        );
        assert_eq!(
            value(
                &out,
                "regatta_node_resources_total{node=\"w1\",resource=\"accelerator_type:H100\"}"
            ),
            Some(1.0)
        );
        assert_eq!(value(&out, "regatta_actors{kind=\"echo\",state=\"alive\"}"), Some(1.0));
        assert_eq!(value(&out, "regatta_actor_restarts_total{kind=\"echo\"}"), Some(2.0));
        assert_eq!(value(&out, "regatta_nodes{state=\"alive\"}"), Some(1.0));
        assert_eq!(
            value(&out, "regatta_node_heartbeat_age_seconds{node=\"w1\"}"),
            Some(0.25)
        );
        assert_eq!(value(&out, "regatta_object_spills_total{node=\"w1\"}"), Some(3.0));
        assert_eq!(
            value(&out, "regatta_object_receive_pool_bytes{node=\"w1\"}"),
            Some((1u64 << 30) as f64)
        );
    }
}
