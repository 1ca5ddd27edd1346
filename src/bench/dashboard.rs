//! `regatta bench dashboard`: how long the head takes to answer each dashboard endpoint's
//! data at 10,000 and 100,000 actors, on a synthetic head state (1,000 nodes, every actor
//! placed and alive) built in this process through the head's real core. Each figure is one
//! request's whole path minus the socket: the core's view, the head link's encoding and
//! decoding, and the JSON the endpoint writes.

use std::time::Instant;

use regatta_proto::Effect;
use regatta_proto::{ActorFilter, PageRequest, View, ViewQuery};
use regatta_proto::{ActorId, HeadCore, Output, ReplyTo, Resources};
use regatta_proto::{ActorSpec, Failure, HeadRequest, NodeInfo};

use super::measure::{quantile, report};

/// A head with `nodes` nodes of 100 CPUs and `actors` alive actors of one CPU each, a
/// tenth of them named, spread over ten jobs; kinds alternate, and placement spreads actors
/// round the nodes, so even-numbered nodes hold the `echo` actors.
/// Also returns each actor's spawn-and-start time through the core, in microseconds.
fn synthetic(nodes: usize, actors: usize) -> anyhow::Result<(HeadCore, Vec<f64>)> {
    let mut head = HeadCore::new(3_000, 10_000);
    for n in 0..nodes {
        head.handle(
            HeadRequest::Register(
                NodeInfo {
                    name: format!("node-{n:04}"),
                    address: format!("10.0.{}.{}:6381", n / 250, n % 250),
                    resources: Resources::parse_capacity("CPU=100,memory=64000000000")?,
                    kinds: vec!["echo".into(), "counter".into()],
                    pid: 1,
                    metrics_address: None,
                },
                Vec::new(),
            ),
            None,
            0,
        );
    }
    let one_cpu = Resources::parse_request("CPU=1")?;
    let mut micros = Vec::with_capacity(actors);
    for a in 0..actors {
        let started = Instant::now();
        let out = head.handle(
            HeadRequest::Spawn(ActorSpec {
                kind: if a % 2 == 0 { "echo" } else { "counter" }.into(),
                args: Vec::new(),
                resources: one_cpu.clone(),
                name: (a % 10 == 0).then(|| format!("actor-{a}")),
                max_restarts: 3,
                placement: None,
                job: Some(format!("job-{}", a % 10)),
            }),
            Some(ReplyTo(a as u64)),
            0,
        );
        for output in out {
            if let Output::Effect(Effect::Start(start)) = output {
                head.handle(
                    HeadRequest::Started {
                        actor: start.actor,
                        attempt: start.attempt,
                        outcome: Ok(()),
                    },
                    None,
                    0,
                );
            }
        }
        micros.push(started.elapsed().as_secs_f64() * 1e6);
    }
    Ok((head, micros))
}

/// One request's path without the socket: view, head-link round trip, JSON.
fn answer(head: &HeadCore, query: &ViewQuery) -> anyhow::Result<usize> {
    let view = head.view(query.clone(), 1_000);
    let bytes = regatta_runtime::wire_encode(&Ok::<View, Failure>(view));
    let back: Result<View, Failure> =
        regatta_runtime::wire_decode(&bytes, "a view").map_err(|f| anyhow::anyhow!("{f:?}"))?;
    let json = serde_json::to_vec(&back.map_err(|f| anyhow::anyhow!("{f:?}"))?)?;
    Ok(json.len())
}

/// Prints each endpoint's latency in milliseconds at each size.
pub(super) fn dashboard(trials: usize, quick: bool) -> anyhow::Result<()> {
    let sizes: &[(usize, usize)] = if quick {
        &[(20, 1_000)]
    } else {
        &[(1_000, 10_000), (1_000, 100_000)]
    };
    for &(nodes, actors) in sizes {
        let head = build_head(nodes, actors)?;
        for (case, query) in endpoint_queries(actors) {
            let mut millis = Vec::new();
            let mut size = 0;
            for _ in 0..trials.max(5) {
                let started = Instant::now();
                size = answer(&head, &query)?;
                millis.push(started.elapsed().as_secs_f64() * 1000.0);
            }
            report(
                &format!("dashboard {case} at {actors} actors ({size} B JSON)"),
                "milliseconds",
                &millis,
            );
        }
        // For comparison: `regatta status`, which sends every actor in one answer.
        let started = Instant::now();
        let status = head.status(1_000);
        let bytes = regatta_runtime::wire_encode(&status);
        report(
            &format!("whole status at {actors} actors ({} B encoded)", bytes.len()),
            "milliseconds",
            &[started.elapsed().as_secs_f64() * 1000.0],
        );
    }
    Ok(())
}

/// The synthetic head of `nodes` and `actors`, and what building it cost: the core's
/// memory per actor and its spawn-and-start rate and latencies.
fn build_head(nodes: usize, actors: usize) -> anyhow::Result<HeadCore> {
    let built = Instant::now();
    let rss_before = super::measure::rss_bytes(std::process::id());
    let (head, mut micros) = synthetic(nodes, actors)?;
    let rss_after = super::measure::rss_bytes(std::process::id());
    let seconds = built.elapsed().as_secs_f64();
    println!("# synthetic head: {nodes} nodes, {actors} actors placed and started in {seconds:.1} s");
    report(
        &format!("core memory per actor at {nodes} nodes, {actors} actors (records, indexes)"),
        "bytes",
        &[rss_after.saturating_sub(rss_before) as f64 / actors as f64],
    );
    // The head's core alone (no sockets): what placement costs as the cluster fills.
    report(
        &format!("core spawn+start at {nodes} nodes, {actors} actors"),
        "actors/s",
        &[actors as f64 / seconds],
    );
    for (name, q) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
        report(
            &format!("core spawn+start {name} at {nodes} nodes, {actors} actors"),
            "microseconds",
            &[quantile(&mut micros, q)],
        );
    }
    Ok(head)
}

/// What each dashboard endpoint asks the head, by case name, on a head of `actors` actors.
fn endpoint_queries(actors: usize) -> Vec<(&'static str, ViewQuery)> {
    let page = |offset| PageRequest { offset, limit: 100 };
    let filter = |f: ActorFilter| ViewQuery::Actors(f, page(0));
    vec![
        ("overview", ViewQuery::Overview),
        ("nodes page", ViewQuery::Nodes(page(0))),
        ("actors first page", filter(ActorFilter::default())),
        (
            "actors last page",
            ViewQuery::Actors(ActorFilter::default(), page(actors - 100)),
        ),
        (
            "actors by state+kind+node",
            filter(ActorFilter {
                state: Some("alive".into()),
                kind: Some("echo".into()),
                node: Some("node-0008".into()),
                ..Default::default()
            }),
        ),
        (
            "actors by job and name",
            filter(ActorFilter {
                job: Some("job-0".into()),
                name: Some("actor-99".into()),
                ..Default::default()
            }),
        ),
        ("one actor", ViewQuery::Actor(ActorId(actors as u64 / 2))),
        ("runs", ViewQuery::Runs),
    ]
}
