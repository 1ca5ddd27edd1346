//! The runtime's own cases: a cluster's start and idle memory, actor calls and creation,
//! placement groups and actor pools (the object store's are in `objects.rs`).

use std::time::{Duration, Instant};

use anyhow::Context;

use super::measure::{
    http_get, loopback_tcp_round_trips, loopback_tcp_round_trips_tokio, loopback_unix_round_trips, quantile, report,
    rss_bytes,
};
use crate::kinds::{Caller, Fanout, Noop};
use crate::local::{LocalCluster, LocalOptions, WorkerSpec};
use regatta_runtime::{ActorHandle, ActorOptions, ActorPool, Client, Resources, Strategy, CALL_PATH_ENV};

fn workers() -> Vec<WorkerSpec> {
    vec![
        WorkerSpec::new("w1", "CPU=2,pin:w1=1"),
        WorkerSpec::new("w2", "CPU=2,pin:w2=1"),
    ]
}

pub(super) fn start_cluster() -> anyhow::Result<LocalCluster> {
    start_with(workers())
}

pub(super) fn start_with(specs: Vec<WorkerSpec>) -> anyhow::Result<LocalCluster> {
    start_with_head_args(specs, Vec::new())
}

pub(super) fn start_with_head_args(specs: Vec<WorkerSpec>, head_args: Vec<String>) -> anyhow::Result<LocalCluster> {
    let mut options = LocalOptions::new(specs)?;
    options.binary = std::env::current_exe().context("cannot find this executable")?;
    options.head_args = head_args;
    LocalCluster::start(options)
}

/// Time for a head and 2 workers to be ready, and their idle resident memory.
pub(super) async fn cluster_start(trials: usize) -> anyhow::Result<()> {
    println!("# cluster");
    let mut ready = Vec::new();
    let mut memory = Vec::new();
    for _ in 0..trials {
        let started = Instant::now();
        let mut cluster = start_cluster()?;
        let client = cluster.connect(Duration::from_secs(30)).await?;
        ready.push(started.elapsed().as_secs_f64());
        drop(client);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pids = cluster.pids();
        memory.push(pids.iter().map(|pid| rss_bytes(*pid)).sum::<u64>() as f64 / 1e6);
        cluster.shutdown();
    }
    report("head and 2 workers ready", "seconds", &ready);
    report("idle head and 2 workers resident", "megabytes", &memory);
    scrape_with_many_actors(trials).await
}

/// How long a `/metrics` scrape of the head takes with thousands of live actors.
async fn scrape_with_many_actors(trials: usize) -> anyhow::Result<()> {
    let mut cluster = start_cluster()?;
    let client = cluster.connect(Duration::from_secs(30)).await?;
    let actors = 2_000;
    let spawned =
        futures::future::try_join_all((0..actors).map(|_| client.spawn::<Noop>((), ActorOptions::new()))).await?;
    futures::future::try_join_all(spawned.iter().map(|a| a.call(Vec::new()))).await?;
    // The head refreshes its snapshot once a second.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let host = cluster.metrics_address.trim_start_matches("http://").to_string();
    let mut millis = Vec::new();
    for _ in 0..trials.max(3) {
        let started = Instant::now();
        let body = http_get(&host, "/metrics")?;
        millis.push(started.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(
            body.contains("regatta_actors{kind=\"noop\",state=\"alive\"} 2000"),
            "the scrape does not show the 2,000 actors"
        );
    }
    report(
        &format!("metrics scrape of the head with {actors} actors"),
        "milliseconds",
        &millis,
    );
    cluster.shutdown();
    Ok(())
}

/// Runs `round` `trials` times; each returns the operations it did; prints ops per second.
async fn rate<F, Fut>(case: &str, trials: usize, mut round: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<usize>>,
{
    let mut rates = Vec::with_capacity(trials);
    for _ in 0..trials {
        let started = Instant::now();
        let ops = round().await?;
        rates.push(ops as f64 / started.elapsed().as_secs_f64());
    }
    report(case, "per second", &rates);
    Ok(())
}

/// `calls` calls to `actor` one after another per trial; prints calls per second.
async fn one_at_a_time(case: &str, actor: &ActorHandle<Noop>, trials: usize, calls: usize) -> anyhow::Result<()> {
    rate(case, trials, || async {
        for _ in 0..calls {
            actor.call(Vec::new()).await?;
        }
        Ok(calls)
    })
    .await
}

/// Where one synchronous call's time goes: `calls` timed calls per trial, one at a time,
/// and each hop's median per trial in microseconds (the stamps are taken on this host's
/// one clock by both processes; see `CallTiming`).
async fn sync_call_hops(actor: &ActorHandle<Noop>, trials: usize, calls: usize, from: &str) -> anyhow::Result<()> {
    let names = regatta_runtime::CallTiming::default().hops().map(|(name, _)| name);
    let mut medians = vec![Vec::with_capacity(trials); names.len() + 1];
    for _ in 0..trials {
        let mut hops = vec![Vec::with_capacity(calls); names.len() + 1];
        for _ in 0..calls {
            let (_, timing) = actor.call_timed(Vec::new()).await?;
            let Some(timing) = timing else {
                println!("# sync calls{from} did not go over the call channel ({CALL_PATH_ENV}?): no hops to time");
                return Ok(());
            };
            for (i, (_, hop)) in timing.hops().iter().enumerate() {
                hops[i].push(hop.as_secs_f64() * 1e6);
            }
            hops[names.len()].push(timing.total().as_secs_f64() * 1e6);
        }
        for (median, mut values) in medians.iter_mut().zip(hops) {
            median.push(quantile(&mut values, 0.5));
        }
    }
    for (name, values) in names.iter().chain(["total"].iter()).zip(&medians) {
        report(
            &format!("1:1 actor call sync{from}, median {name}"),
            "microseconds",
            values,
        );
    }
    Ok(())
}

async fn noops(client: &Client, count: usize) -> anyhow::Result<Vec<ActorHandle<Noop>>> {
    let mut actors = Vec::with_capacity(count);
    for _ in 0..count {
        actors.push(client.spawn::<Noop>((), ActorOptions::new()).await?);
    }
    for actor in &actors {
        actor.wait_ready(Duration::from_secs(30)).await?;
    }
    Ok(actors)
}

pub(super) async fn actors(cluster: &LocalCluster, trials: usize, quick: bool) -> anyhow::Result<()> {
    let client = cluster.connect(Duration::from_secs(30)).await?;
    let scale = if quick { 20 } else { 1 };
    println!("# actors");
    let one = noops(&client, 1).await?.remove(0);
    let sync_calls = 5_000 / scale;
    loopback_floors(trials, sync_calls).await?;
    sync_calls_each_way(&client, &one, trials, sync_calls).await?;
    let batch = 10_000 / scale;
    calls_in_flight(&one, trials, batch).await?;
    let servers = noops(&client, 4).await?;
    calls_to_many(&client, &servers, trials, batch).await?;
    let creations = 1_000 / scale;
    rate("actor creation (create and call each)", trials, || async {
        let spawned =
            futures::future::try_join_all((0..creations).map(|_| client.spawn::<Noop>((), ActorOptions::new())))
                .await?;
        futures::future::try_join_all(spawned.iter().map(|a| a.call(Vec::new()))).await?;
        futures::future::try_join_all(spawned.iter().map(|a| a.kill())).await?;
        Ok(creations)
    })
    .await?;
    let groups = 1_000 / scale;
    rate("placement group create/removal", trials, || async {
        for _ in 0..groups {
            let group = client
                .create_placement_group(vec![Resources::parse_request("CPU=0.01")?; 2], Strategy::Pack)
                .await?;
            group.ready(Duration::from_secs(10)).await?;
            group.remove().await?;
        }
        Ok(groups)
    })
    .await?;
    let items = 20_000 / scale;
    let workers = noops(&client, 4).await?;
    rate("ActorPool map", trials, || {
        let workers = workers.clone();
        async move {
            let mut pool = ActorPool::new(workers);
            let results = pool.map((0..items).map(|_| Vec::new())).await;
            anyhow::ensure!(results.iter().all(Result::is_ok), "a pool item failed");
            Ok(items)
        }
    })
    .await?;
    Ok(())
}

/// The machine's floor for one request and reply between processes, in the same run:
/// `round_trips` over loopback TCP (threads, then tokio tasks) and a Unix socket.
async fn loopback_floors(trials: usize, round_trips: usize) -> anyhow::Result<()> {
    let mut floor = Vec::with_capacity(trials);
    let mut floor_tokio = Vec::with_capacity(trials);
    let mut floor_unix = Vec::with_capacity(trials);
    for _ in 0..trials {
        floor.push(loopback_tcp_round_trips(round_trips)?);
        floor_tokio.push(loopback_tcp_round_trips_tokio(round_trips).await?);
        floor_unix.push(loopback_unix_round_trips(round_trips)?);
    }
    report("loopback tcp round trips between threads", "per second", &floor);
    // Same-host calls ride a Unix socket: its floor is theirs.
    report(
        "loopback unix socket round trips between threads",
        "per second",
        &floor_unix,
    );
    report(
        "loopback tcp round trips between tokio tasks",
        "per second",
        &floor_tokio,
    );
    Ok(())
}

/// `calls` synchronous calls to `one`, and where their time goes: from a runtime worker,
/// from a thread of `block_on`'s own, and through the sessions instead of the call channel.
async fn sync_calls_each_way(
    client: &Client,
    one: &ActorHandle<Noop>,
    trials: usize,
    calls: usize,
) -> anyhow::Result<()> {
    one_at_a_time("1:1 actor calls sync", one, trials, calls).await?;
    sync_call_hops(one, trials, calls, "").await?;
    // The same calls from a future that `block_on` runs on a thread of its own, as a
    // `#[tokio::main]` body runs (the CLI runs its commands, this bench included, as tasks
    // on the runtime's workers): every reply then wakes that thread from another one.
    let runtime = tokio::runtime::Handle::current();
    let outside = one.clone();
    tokio::task::spawn_blocking(move || {
        runtime.block_on(async {
            one_at_a_time("1:1 actor calls sync from block_on", &outside, trials, calls).await?;
            sync_call_hops(&outside, trials, calls, " from block_on").await
        })
    })
    .await??;
    // The same calls through ractor_cluster's sessions, as before the call channel.
    let one_by_session = client
        .with_call_path(regatta_runtime::CallPath::Session)
        .handle::<Noop>(one.id());
    one_at_a_time(
        "1:1 actor calls sync through the sessions",
        &one_by_session,
        trials,
        calls,
    )
    .await
}

/// `batch` calls to `one` in flight together, from one task and from four.
async fn calls_in_flight(one: &ActorHandle<Noop>, trials: usize, batch: usize) -> anyhow::Result<()> {
    rate("1:1 actor calls async", trials, || async {
        futures::future::try_join_all((0..batch).map(|_| one.call(Vec::new()))).await?;
        Ok(batch)
    })
    .await?;
    // Ray's case calls an actor with max_concurrency=16 in batches of 1000 from one
    // client; here 4 client tasks each keep batches of 250 calls in flight to one actor.
    rate("1:1 actor calls concurrent", trials, || async {
        let rounds = batch / 1000;
        let tasks = (0..4).map(|_| {
            let one = one.clone();
            async move {
                for _ in 0..rounds.max(1) {
                    futures::future::try_join_all((0..250).map(|_| one.call(Vec::new()))).await?;
                }
                anyhow::Ok(rounds.max(1) * 250)
            }
        });
        Ok(futures::future::try_join_all(tasks).await?.iter().sum())
    })
    .await
}

/// `batch` calls spread over `servers`, from this client and from four caller actors
/// (without an argument and with one of 1 KiB).
async fn calls_to_many(
    client: &Client,
    servers: &[ActorHandle<Noop>],
    trials: usize,
    batch: usize,
) -> anyhow::Result<()> {
    rate("1:n actor calls async", trials, || async {
        let calls = servers
            .iter()
            .flat_map(|s| (0..batch / 4).map(move |_| s.call(Vec::new())));
        Ok(futures::future::try_join_all(calls).await?.len())
    })
    .await?;
    let mut callers = Vec::new();
    for _ in 0..4 {
        callers.push(client.spawn::<Caller>((), ActorOptions::new()).await?);
    }
    let targets: Vec<_> = servers.iter().map(|s| s.id()).collect();
    for (case, arg_bytes) in [
        ("n:n actor calls async", 0usize),
        ("n:n actor calls with arg async", 1024),
    ] {
        let per_target = (batch / 16) as u32;
        rate(case, trials, || async {
            let fanout = Fanout {
                targets: targets.clone(),
                calls_per_target: per_target,
                arg_bytes,
            };
            let done = futures::future::try_join_all(
                callers
                    .iter()
                    .map(|c| c.call_timeout(fanout.clone(), Duration::from_secs(120))),
            )
            .await?;
            Ok(done.iter().sum::<u64>() as usize)
        })
        .await?;
    }
    Ok(())
}
