//! `regatta bench scale`: one real head driven by simulated nodes (`regatta simulate-nodes`
//! processes, many node agents each, speaking the real protocol over real sessions and
//! hosting no-op actors). Prints how fast nodes join, actors are placed and started,
//! placement groups come and go, what the head's memory and CPU cost per node and per
//! actor, how long the head takes to notice nodes dying at once and restart their actors,
//! and how fast it answers status.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use regatta_runtime::{ActorOptions, Client, Resources, Strategy};

use super::measure::{histogram_quantile, http_get, quantile, report, rss_bytes};
use crate::kinds::Noop;
use crate::local::{LocalCluster, LocalOptions};
use regatta_proto::{Overview, View, ViewQuery};

/// Sizes of one scale run.
#[derive(Clone, Debug)]
pub struct ScaleBench {
    /// Simulated nodes.
    pub nodes: usize,
    /// Actors spawned (CPU=1 each, three restarts allowed).
    pub actors: usize,
    /// Placement groups created and held at once (one bundle each).
    pub groups: usize,
    /// Simulator processes (the nodes are shared out among them).
    pub processes: usize,
    /// Whether the head writes its state to disk (the default for `regatta head`).
    pub durable: bool,
}

impl ScaleBench {
    /// The test-suite size: 200 nodes, 10,000 actors.
    pub fn quick() -> Self {
        Self {
            nodes: 200,
            actors: 10_000,
            groups: 200,
            processes: 2,
            durable: true,
        }
    }
}

/// Spawns in flight at once from the driver.
const IN_FLIGHT: usize = 64;
/// What each simulated node declares.
const NODE_CPUS: usize = 256;
/// Heartbeat interval of the simulated nodes (a worker's default).
const HEARTBEAT_MS: u64 = 500;

/// The head's CPU time so far (user + system), in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command's closing parenthesis; utime and stime are the 12th and
    // 13th of them, in clock ticks (100 a second on Linux).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

async fn overview(client: &Client) -> anyhow::Result<Overview> {
    match client.cluster().view(ViewQuery::Overview).await? {
        View::Overview(overview) => Ok(overview),
        other => bail!("the head answered an overview with {other:?}"),
    }
}

/// Polls the overview until `done` holds, or fails naming what was seen last.
async fn wait_for(
    client: &Client,
    what: &str,
    timeout: Duration,
    done: impl Fn(&Overview) -> bool,
) -> anyhow::Result<Overview> {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = overview(client).await?;
        if done(&seen) {
            return Ok(seen);
        }
        if Instant::now() > deadline {
            bail!(
                "{what}: not within {timeout:?}; last seen {} nodes alive, {} dead, actors {:?}, {} waiting",
                seen.nodes_alive,
                seen.nodes_dead,
                seen.actors,
                seen.waiting
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The simulator processes, killed on every way out of the run (a failed phase included).
struct Simulators(Vec<std::process::Child>);

impl Drop for Simulators {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn alive(o: &Overview) -> usize {
    o.actors.get("alive").copied().unwrap_or(0)
}

/// Runs the benchmark; fails if any node or actor is missing at the end of a phase.
pub async fn scale(bench: &ScaleBench) -> anyhow::Result<()> {
    if bench.nodes == 0 || bench.processes == 0 {
        bail!("bench scale needs at least one node and one simulator process");
    }
    if bench.actors + bench.groups > bench.nodes * NODE_CPUS {
        bail!(
            "{} actors and {} groups do not fit {} nodes of CPU={NODE_CPUS}",
            bench.actors,
            bench.groups,
            bench.nodes
        );
    }
    let mut options = LocalOptions::new(Vec::new())?;
    if !bench.durable {
        options.head_args.push("--no-cluster-state".into());
    }
    let mut cluster = LocalCluster::start(options)?;
    let outcome = run(&mut cluster, bench).await;
    if outcome.is_err() {
        print_log_tails(&cluster.log_path("head"));
    }
    cluster.shutdown();
    outcome
}

/// Where the logs of a failed run are kept, and the end of each (the head's, the
/// restarted head's, each simulator's), so that a failure in CI says what the processes saw.
fn print_log_tails(head_log: &std::path::Path) {
    let Some(dir) = head_log.parent() else { return };
    eprintln!("cluster logs kept in {}", dir.display());
    let mut logs: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let text = String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        eprintln!("--- the last lines of {}:", log.display());
        for line in &lines[lines.len().saturating_sub(20)..] {
            eprintln!("{line}");
        }
    }
}

async fn run(cluster: &mut LocalCluster, bench: &ScaleBench) -> anyhow::Result<()> {
    let client = cluster.connect(Duration::from_secs(30)).await?;
    let head = *cluster.pids().first().context("the head is not running")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_empty = rss_bytes(head);
    let shares = node_shares(bench);
    let mut simulators = join_nodes(cluster, &client, bench, &shares).await?;
    let rss_nodes = head_cost_of_nodes(head, bench.nodes, rss_empty).await;
    let one = one_cpu_actor()?;
    let remaining = spawn_one_at_a_time(&client, &one, bench.actors).await?;
    spawn_the_rest(&client, &one, bench.actors, remaining).await?;
    placement_in_head(cluster, bench.actors)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_actors = rss_bytes(head);
    report(
        "scale head memory per actor",
        "bytes",
        &[rss_actors.saturating_sub(rss_nodes) as f64 / bench.actors as f64],
    );
    status_at_size(&client).await?;
    groups(&client, bench).await?;
    if bench.durable {
        head_restart(cluster, &client, bench).await?;
    }
    let doomed = shares[0];
    nodes_die_at_once(&client, &mut simulators, doomed, bench.actors).await?;
    drop(simulators);
    Ok(())
}

/// How many nodes each simulator process runs: the first holds the nodes that die later;
/// the rest share out the others.
fn node_shares(bench: &ScaleBench) -> Vec<usize> {
    let doomed = (bench.nodes / 10).clamp(1, 100);
    let mut shares = vec![doomed];
    let rest = bench.nodes - doomed;
    let others = bench.processes.saturating_sub(1).max(1);
    for p in 0..others {
        shares.push(rest / others + usize::from(p < rest % others));
    }
    shares
}

/// Starts the simulator processes and waits for every node to be alive; prints how fast
/// they joined.
async fn join_nodes(
    cluster: &LocalCluster,
    client: &Client,
    bench: &ScaleBench,
    shares: &[usize],
) -> anyhow::Result<Simulators> {
    let joined = Instant::now();
    let mut simulators = Simulators(Vec::new());
    let mut first = 0;
    for (p, count) in shares.iter().enumerate() {
        if *count == 0 {
            continue;
        }
        let (first_s, count_s, hb) = (first.to_string(), count.to_string(), HEARTBEAT_MS.to_string());
        let resources = format!("CPU={NODE_CPUS}");
        let args = [
            "simulate-nodes",
            "--address",
            &cluster.address,
            "--first",
            &first_s,
            "--count",
            &count_s,
            "--resources",
            &resources,
            "--heartbeat-interval-ms",
            &hb,
        ];
        simulators
            .0
            .push(cluster.run_extra(&args, &cluster.token, &format!("simulator-{p}.log"))?);
        first += count;
    }
    let nodes = bench.nodes;
    wait_for(client, "every simulated node alive", Duration::from_secs(300), |o| {
        o.nodes_alive == nodes
    })
    .await?;
    let join_secs = joined.elapsed().as_secs_f64();
    println!(
        "# {nodes} simulated nodes in {} processes joined in {join_secs:.2} s",
        shares.len()
    );
    println!("nodes alive {nodes}/{nodes}");
    report("scale nodes joined", "per second", &[nodes as f64 / join_secs]);
    Ok(simulators)
}

/// The head's memory per node and its CPU while idle with every node heartbeating; returns
/// its resident bytes with the nodes in.
async fn head_cost_of_nodes(head: u32, nodes: usize, rss_empty: u64) -> u64 {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_nodes = rss_bytes(head);
    report(
        "scale head memory per node",
        "bytes",
        &[rss_nodes.saturating_sub(rss_empty) as f64 / nodes as f64],
    );
    let cpu_before = cpu_seconds(head);
    let idle = Duration::from_secs(5);
    tokio::time::sleep(idle).await;
    let busy = (cpu_seconds(head) - cpu_before) / idle.as_secs_f64();
    report(
        &format!("scale heartbeats handled ({} ms interval)", HEARTBEAT_MS),
        "per second",
        &[nodes as f64 * 1000.0 / HEARTBEAT_MS as f64],
    );
    report(
        "scale head CPU while idle with every node heartbeating",
        "cores",
        &[busy],
    );
    rss_nodes
}

/// What every actor of the run asks for: one CPU, three restarts.
fn one_cpu_actor() -> anyhow::Result<ActorOptions> {
    Ok(ActorOptions::new()
        .resources(Resources::parse_request("CPU=1")?)
        .max_restarts(3))
}

/// Placement latency of one spawn at a time (the head's reply comes after placing), over
/// the first thousand actors; returns how many are left to spawn.
async fn spawn_one_at_a_time(client: &Client, one: &ActorOptions, actors: usize) -> anyhow::Result<usize> {
    let samples = actors.min(1_000);
    let mut micros = Vec::with_capacity(samples);
    for _ in 0..samples {
        let started = Instant::now();
        client.cluster().spawn::<Noop>((), one.clone()).await?;
        micros.push(started.elapsed().as_secs_f64() * 1e6);
    }
    for (name, q) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
        report(
            &format!("scale spawn round trip {name}, one at a time"),
            "microseconds",
            &[quantile(&mut micros, q)],
        );
    }
    Ok(actors - samples)
}

/// The `remaining` actors spawned [`IN_FLIGHT`] at a time: placed per second, then all
/// `actors` alive.
async fn spawn_the_rest(client: &Client, one: &ActorOptions, actors: usize, remaining: usize) -> anyhow::Result<()> {
    let placing = Instant::now();
    let results: Vec<_> = futures::stream::iter(0..remaining)
        .map(|_| {
            let cluster = client.cluster().clone();
            let options = one.clone();
            async move { cluster.spawn::<Noop>((), options).await }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let placed_secs = placing.elapsed().as_secs_f64();
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(ToString::to_string))
        .take(3)
        .collect();
    if !failed.is_empty() {
        bail!("spawns failed, for example: {failed:?}");
    }
    report(
        &format!("scale actors placed ({IN_FLIGHT} spawns in flight)"),
        "per second",
        &[remaining as f64 / placed_secs],
    );
    let seen = wait_for(client, "every actor alive", Duration::from_secs(600), |o| {
        alive(o) == actors
    })
    .await?;
    let alive_secs = placing.elapsed().as_secs_f64();
    println!("actors alive {}/{actors}", alive(&seen));
    report(
        "scale actors placed and started",
        "per second",
        &[remaining as f64 / alive_secs],
    );
    Ok(())
}

/// Status and the dashboard's data at this size, through the real session.
async fn status_at_size(client: &Client) -> anyhow::Result<()> {
    for (case, query) in [
        ("overview", ViewQuery::Overview),
        (
            "actors page",
            ViewQuery::Actors(Default::default(), regatta_proto::PageRequest { offset: 0, limit: 100 }),
        ),
    ] {
        let mut millis = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            client.cluster().view(query.clone()).await?;
            millis.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        report(&format!("scale status {case}"), "milliseconds", &millis);
    }
    let started = Instant::now();
    let status = client.cluster().status().await?;
    report(
        &format!("scale whole status ({} actors)", status.actors.len()),
        "milliseconds",
        &[started.elapsed().as_secs_f64() * 1000.0],
    );
    Ok(())
}

/// Nodes dying at once: the simulator process holding the `doomed` nodes is killed; how
/// long until the head declares them dead, and until their actors run again elsewhere.
async fn nodes_die_at_once(
    client: &Client,
    simulators: &mut Simulators,
    doomed: usize,
    actors: usize,
) -> anyhow::Result<()> {
    // The guard still holds it: killed and reaped here, and again (harmlessly) on drop.
    let doomed_process = &mut simulators.0[0];
    let killed = Instant::now();
    doomed_process.kill().context("cannot kill a simulator process")?;
    let _ = doomed_process.wait();
    wait_for(
        client,
        "the killed nodes declared dead",
        Duration::from_secs(120),
        |o| o.nodes_dead >= doomed,
    )
    .await?;
    let noticed = killed.elapsed().as_secs_f64();
    let seen = wait_for(client, "the lost actors running again", Duration::from_secs(300), |o| {
        alive(o) == actors && o.waiting == 0
    })
    .await?;
    let recovered = killed.elapsed().as_secs_f64();
    println!("actors alive after {doomed} nodes died {}/{actors}", alive(&seen));
    report(
        &format!("scale {doomed} nodes dead at once: noticed (heartbeat timeout 3 s)"),
        "seconds",
        &[noticed],
    );
    report(
        &format!("scale {doomed} nodes dead at once: their actors running again"),
        "seconds",
        &[recovered],
    );
    Ok(())
}

/// The head killed (SIGKILL) and started again on its state directory: how long until it
/// answers again, and until every node has registered again with all its actors, none
/// started again; how long it stopped to encode the snapshot of what it read back (the
/// same pause as a snapshot taken when the log fills).
async fn head_restart(cluster: &mut LocalCluster, client: &Client, bench: &ScaleBench) -> anyhow::Result<()> {
    let state = cluster.head_state_dir();
    let on_disk: u64 = ["cluster.state", "cluster.log"]
        .iter()
        .map(|f| std::fs::metadata(state.join(f)).map_or(0, |m| m.len()))
        .sum();
    cluster.kill_head()?;
    let killed = Instant::now();
    cluster.start_head_again()?;
    let deadline = killed + Duration::from_secs(300);
    let (nodes, actors) = (bench.nodes, bench.actors);
    let mut answering = None;
    let seen = loop {
        match overview(client).await {
            Ok(seen) => {
                answering.get_or_insert(killed.elapsed());
                if seen.nodes_alive == nodes && seen.nodes_rejoining == 0 && alive(&seen) == actors {
                    break seen;
                }
                if Instant::now() > deadline {
                    bail!("the restarted head: {seen:?}");
                }
            }
            Err(e) if Instant::now() > deadline => bail!("the restarted head did not answer: {e}"),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let rejoined = killed.elapsed();
    let restarts = seen.actors.get("restarting").copied().unwrap_or(0);
    println!(
        "# head restarted on {:.1} MB of state: {} nodes, {}/{actors} actors alive, {restarts} restarting",
        on_disk as f64 / 1e6,
        seen.nodes_alive,
        alive(&seen)
    );
    let answering = answering.unwrap_or(rejoined);
    report(
        &format!("scale head killed and started again with {actors} actors: answering"),
        "seconds",
        &[answering.as_secs_f64()],
    );
    report(
        &format!("scale head killed and started again with {actors} actors: every node back"),
        "seconds",
        &[rejoined.as_secs_f64()],
    );
    let host = cluster.metrics_address.trim_start_matches("http://").to_string();
    let text = http_get(&host, "/metrics")?;
    let encode = text
        .lines()
        .find_map(|l| l.strip_prefix("regatta_head_snapshot_seconds_sum{when=\"recovery\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .context("the restarted head's metrics have no recovery snapshot time")?;
    report(
        &format!("scale head snapshot of {actors} actors: loop stopped for"),
        "milliseconds",
        &[encode * 1000.0],
    );
    Ok(())
}

/// Placement groups: create and remove rates by bundle count, then `groups` held at once.
async fn groups(client: &Client, bench: &ScaleBench) -> anyhow::Result<()> {
    let one_cpu = Resources::parse_request("CPU=1")?;
    let mut rates = BTreeMap::new();
    for bundles in [1usize, 10, 40] {
        let rounds = 100.min(bench.groups.max(10));
        let started = Instant::now();
        for _ in 0..rounds {
            let group = client
                .cluster()
                .create_placement_group(vec![one_cpu.clone(); bundles], Strategy::Spread)
                .await?;
            group.ready(Duration::from_secs(60)).await?;
            group.remove().await?;
        }
        let rate = rounds as f64 / started.elapsed().as_secs_f64();
        rates.insert(bundles, rate);
        report(
            &format!("scale placement group of {bundles} bundles created, ready and removed"),
            "per second",
            &[rate],
        );
    }
    let held_started = Instant::now();
    let created: Vec<_> = futures::stream::iter(0..bench.groups)
        .map(|_| {
            let cluster = client.cluster().clone();
            let bundle = one_cpu.clone();
            async move {
                let group = cluster.create_placement_group(vec![bundle], Strategy::Pack).await?;
                group.ready(Duration::from_secs(120)).await?;
                Ok::<_, regatta_runtime::Error>(group)
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let held: Vec<_> = created.into_iter().collect::<Result<_, _>>()?;
    let secs = held_started.elapsed().as_secs_f64();
    let seen = overview(client).await?;
    let ready = seen.groups.get("created").copied().unwrap_or(0);
    if ready != bench.groups {
        bail!("{} of {} placement groups created", ready, bench.groups);
    }
    println!("groups held {ready}/{}", bench.groups);
    report(
        &format!(
            "scale {} placement groups created and ready ({IN_FLIGHT} in flight)",
            bench.groups
        ),
        "per second",
        &[bench.groups as f64 / secs],
    );
    for group in held {
        group.remove().await?;
    }
    Ok(())
}

/// The head's own time to handle a spawn (placing the actor included), from its
/// `regatta_head_request_seconds` histogram over every spawn so far: the bound of the
/// bucket holding each quantile, so a figure reads "at most".
fn placement_in_head(cluster: &LocalCluster, spawns: usize) -> anyhow::Result<()> {
    let host = cluster.metrics_address.trim_start_matches("http://");
    let text = http_get(host, "/metrics")?;
    let series = "regatta_head_request_seconds_bucket{request=\"spawn\"";
    for (name, q) in [("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999)] {
        let bound = histogram_quantile(&text, series, q)
            .with_context(|| format!("the head's metrics have no spawn timings:\n{text}"))?;
        report(
            &format!("scale placement in the head {name} of {spawns} spawns (bucket bound, at most)"),
            "microseconds",
            &[bound * 1e6],
        );
    }
    Ok(())
}
