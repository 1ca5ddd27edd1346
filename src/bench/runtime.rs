//! The runtime's own cases: a cluster's start and idle memory, actor calls and creation,
//! placement groups, actor pools, and the object store within and across nodes.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;

use super::measure::{
    http_get, loopback_tcp_gbps, loopback_tcp_round_trips, loopback_tcp_round_trips_tokio, loopback_tls_gbps,
    loopback_unix_round_trips, memcpy_gbps, quantile, report, report_each, rss_bytes, shared_memory_gbps,
};
use crate::kinds::{Caller, Fanout, Noop, Store, StoreOp, StoreReply};
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

/// Nodes for the object cases: `s0` (holder) to `s<fanout>` with the same-host shared-memory
/// path, `n0` to `n<fanout>` with it off and each on its own loopback address
/// (`127.0.0.10` and up), as if on its own host: every byte goes through the network stack,
/// and a broadcast spreads as the head's tree.
pub(super) fn object_workers(fanout: usize) -> Vec<WorkerSpec> {
    let mut specs = Vec::new();
    for prefix in ["s", "n"] {
        for i in 0..=fanout {
            let name = format!("{prefix}{i}");
            let spec = WorkerSpec::new(&name, &format!("CPU=1,pin:{name}=1"));
            specs.push(if prefix == "n" {
                spec.env(regatta_runtime::NO_SHARED_MEMORY_ENV, "1")
                    .host(&format!("127.0.0.{}", 10 + i))
            } else {
                spec
            });
        }
    }
    specs
}

/// Broadcast fan-out of the object cases (targets besides the holder).
pub(super) fn object_fanout(quick: bool) -> usize {
    if quick {
        2
    } else {
        8
    }
}

pub(super) fn start_with(specs: Vec<WorkerSpec>) -> anyhow::Result<LocalCluster> {
    start_with_head_args(specs, Vec::new())
}

fn start_with_head_args(specs: Vec<WorkerSpec>, head_args: Vec<String>) -> anyhow::Result<LocalCluster> {
    let mut options = LocalOptions::new(specs)?;
    options.binary = std::env::current_exe().context("cannot find this executable")?;
    options.head_args = head_args;
    LocalCluster::start(options)
}

/// The cluster of the object cases: objects freed by a trial are released after 200 ms
/// rather than the default 10 s, so that the next trial can start once they are gone;
/// `per_source` is the head's `--object-fanout` (default: the head's own).
pub(super) fn start_objects(quick: bool, per_source: Option<usize>) -> anyhow::Result<LocalCluster> {
    let mut head_args = vec!["--object-grace-ms".to_string(), "200".to_string()];
    if let Some(per_source) = per_source {
        head_args.extend(["--object-fanout".to_string(), per_source.to_string()]);
    }
    start_with_head_args(object_workers(object_fanout(quick)), head_args)
}

/// Waits until none of `stores`' nodes holds an object any more (a freed trial object is
/// released by the head after its grace period): each trial then starts where a workload
/// that frees what it has used stands, and memory the last trial gave back can serve the
/// next one (as a Ray object store's arena does).
async fn released(stores: &[&ActorHandle<Store>]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    for store in stores {
        loop {
            let StoreReply::Stats(stats) = store.call(StoreOp::Stats).await? else {
                bail!("a store answered stats with something else");
            };
            if stats.objects_in_memory == 0 {
                break;
            }
            if Instant::now() > deadline {
                bail!("freed objects still held 30 s later: {stats:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
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
    // The machine's floor for one request and reply between processes, in the same run.
    let mut floor = Vec::with_capacity(trials);
    let mut floor_tokio = Vec::with_capacity(trials);
    let mut floor_unix = Vec::with_capacity(trials);
    for _ in 0..trials {
        floor.push(loopback_tcp_round_trips(sync_calls)?);
        floor_tokio.push(loopback_tcp_round_trips_tokio(sync_calls).await?);
        floor_unix.push(loopback_unix_round_trips(sync_calls)?);
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
    one_at_a_time("1:1 actor calls sync", &one, trials, sync_calls).await?;
    sync_call_hops(&one, trials, sync_calls, "").await?;
    // The same calls from a future that `block_on` runs on a thread of its own, as a
    // `#[tokio::main]` body runs (the CLI runs its commands, this bench included, as tasks
    // on the runtime's workers): every reply then wakes that thread from another one.
    let runtime = tokio::runtime::Handle::current();
    let outside = one.clone();
    tokio::task::spawn_blocking(move || {
        runtime.block_on(async {
            one_at_a_time("1:1 actor calls sync from block_on", &outside, trials, sync_calls).await?;
            sync_call_hops(&outside, trials, sync_calls, " from block_on").await
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
        sync_calls,
    )
    .await?;
    let batch = 10_000 / scale;
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
    .await?;
    let servers = noops(&client, 4).await?;
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

async fn store_on(client: &Client, node: &str) -> anyhow::Result<ActorHandle<Store>> {
    let actor = client
        .spawn::<Store>(
            (),
            ActorOptions::new().resources(Resources::parse_request(&format!("pin:{node}"))?),
        )
        .await?;
    actor.wait_ready(Duration::from_secs(30)).await?;
    Ok(actor)
}

pub(super) async fn objects(cluster: &LocalCluster, trials: usize, quick: bool) -> anyhow::Result<()> {
    let client = cluster.connect(Duration::from_secs(30)).await?;
    let scale = if quick { 20 } else { 1 };
    println!("# physical limits measured in this run");
    report(
        "memcpy gigabytes",
        "per second",
        &(0..trials).map(|_| memcpy_gbps((1 << 30) / scale)).collect::<Vec<_>>(),
    );
    let mut tcp = Vec::new();
    for _ in 0..trials {
        tcp.push(loopback_tcp_gbps((2 << 30) / scale)?);
    }
    report("loopback tcp gigabytes", "per second", &tcp);
    let mut tls = Vec::new();
    for _ in 0..trials {
        tls.push(loopback_tls_gbps((1 << 30) / scale).await?);
    }
    report("loopback tls gigabytes", "per second", &tls);
    report(
        "shared memory segment made and mapped gigabytes",
        "per second",
        &(0..trials)
            .map(|_| shared_memory_gbps((1 << 30) / scale))
            .collect::<Vec<_>>(),
    );

    println!("# object store");
    let small = Bytes::from_static(&[7u8; 100]);
    let mut puts = Vec::new();
    let mut gets = Vec::new();
    for _ in 0..trials {
        let count = 2_000 / scale;
        let started = Instant::now();
        let mut refs = Vec::with_capacity(count);
        for _ in 0..count {
            refs.push(client.put_bytes(small.clone()).await?);
        }
        puts.push(count as f64 / started.elapsed().as_secs_f64());
        let started = Instant::now();
        for reference in &refs {
            client.get_bytes(reference).await?;
        }
        gets.push(count as f64 / started.elapsed().as_secs_f64());
        for reference in &refs {
            client.free(reference).await?;
        }
    }
    report("single client put calls (Plasma Store)", "per second", &puts);
    report("single client get calls (Plasma Store)", "per second", &gets);

    let mut put_gb = Vec::new();
    for _ in 0..trials {
        let payload = vec![1u8; (1 << 30) / scale];
        let started = Instant::now();
        let reference = client.put_bytes(payload).await?;
        put_gb.push(((1u64 << 30) / scale as u64) as f64 / started.elapsed().as_secs_f64() / 1e9);
        client.free(&reference).await?;
    }
    report("single client put gigabytes", "per second", &put_gb);

    let fanout = object_fanout(quick);
    let sizes: &[(&str, u64)] = if quick {
        &[("100 MB", 100_000_000)]
    } else {
        &[("100 MB", 100_000_000), ("1 GB", 1_000_000_000)]
    };
    for (prefix, path) in [("s", "shared memory"), ("n", "network")] {
        let mut stores = Vec::new();
        for i in 0..=fanout {
            stores.push(store_on(&client, &format!("{prefix}{i}")).await?);
        }
        for &(label, size) in sizes {
            let mut rates = Vec::new();
            for seed in 0..trials as u64 {
                let reference = put_on(&stores[0], size, seed).await?;
                let (len, nanos) = fetch_on(&stores[1], &reference).await?;
                rates.push(len as f64 / nanos as f64);
                client.free(&reference).await?;
                released(&[&stores[0], &stores[1]]).await?;
            }
            report(
                &format!("cross-node get {label} ({path}) gigabytes"),
                "per second",
                &rates,
            );
            report_each(&rates);
        }
        // One object to every other node at once: by the same-host path every node maps
        // the one segment the holder made; over the network the copies spread as the
        // head's tree (the holder serves `--object-fanout` pulls at a time).
        let (label, size) = *sizes.last().context("no sizes")?;
        let mut seconds = Vec::new();
        let mut holder_sent = Vec::new();
        for seed in 0..trials as u64 {
            let reference = put_on(&stores[0], size, seed).await?;
            let sent_before = store_stats(&stores[0]).await?.transfer_out_bytes;
            let started = Instant::now();
            let pulls = stores[1..].iter().map(|store| fetch_on(store, &reference));
            futures::future::try_join_all(pulls).await?;
            seconds.push(started.elapsed().as_secs_f64());
            let sent = store_stats(&stores[0]).await?.transfer_out_bytes - sent_before;
            holder_sent.push(sent as f64 / 1e9);
            client.free(&reference).await?;
            released(&stores.iter().collect::<Vec<_>>()).await?;
        }
        report(
            &format!("{label} to {fanout} nodes at once ({path})"),
            "seconds",
            &seconds,
        );
        report_each(&seconds);
        if path == "network" {
            report(
                &format!("{label} to {fanout} nodes at once ({path}), sent by the holder gigabytes"),
                "per broadcast",
                &holder_sent,
            );
        }
    }
    Ok(())
}

async fn store_stats(store: &ActorHandle<Store>) -> anyhow::Result<regatta_runtime::ObjectStats> {
    match store.call(StoreOp::Stats).await? {
        StoreReply::Stats(stats) => Ok(stats),
        other => bail!("unexpected reply {other:?}"),
    }
}

async fn put_on(store: &ActorHandle<Store>, size: u64, seed: u64) -> anyhow::Result<regatta_runtime::ObjectRef<Bytes>> {
    // The holder keeps a reference until the trial frees the object (a free releases it
    // whoever holds it): nothing depends on the grace period between the put's answer and
    // the reader's adoption.
    let op = StoreOp::Put { size, seed, keep: true };
    match store.call_timeout(op, Duration::from_secs(300)).await? {
        StoreReply::Put { reference, .. } => Ok(reference),
        other => bail!("unexpected reply {other:?}"),
    }
}

/// Has `store` get the object; the length and nanoseconds its get took.
async fn fetch_on(
    store: &ActorHandle<Store>,
    reference: &regatta_runtime::ObjectRef<Bytes>,
) -> anyhow::Result<(u64, u64)> {
    match store
        .call_timeout(StoreOp::Fetch(reference.clone()), Duration::from_secs(300))
        .await?
    {
        StoreReply::Fetched { len, nanos } => Ok((len, nanos)),
        other => bail!("unexpected reply {other:?}"),
    }
}
