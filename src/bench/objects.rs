//! The object store's cases: this machine's limits for moving bytes, puts and gets from
//! one client, and objects got across nodes and broadcast to many, by the same-host
//! shared-memory path and over the network.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;

use super::measure::{loopback_tcp_gbps, loopback_tls_gbps, memcpy_gbps, report, report_each, shared_memory_gbps};
use super::runtime::start_with_head_args;
use crate::kinds::{Store, StoreOp, StoreReply};
use crate::local::{LocalCluster, WorkerSpec};
use regatta_runtime::{ActorHandle, ActorOptions, Client, Resources};

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
    physical_limits(trials, scale).await?;
    println!("# object store");
    small_puts_and_gets(&client, trials, scale).await?;
    large_puts(&client, trials, scale).await?;
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
        cross_node_gets(&client, &stores, sizes, path, trials).await?;
        let &(label, size) = sizes.last().context("no sizes")?;
        broadcasts(&client, &stores, label, size, path, trials).await?;
    }
    Ok(())
}

/// What this machine's memory, loopback TCP and TLS, and shared-memory segments move, to
/// read the object figures against.
async fn physical_limits(trials: usize, scale: usize) -> anyhow::Result<()> {
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
    Ok(())
}

/// Puts and then gets of small objects one at a time from this client.
async fn small_puts_and_gets(client: &Client, trials: usize, scale: usize) -> anyhow::Result<()> {
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
    Ok(())
}

/// Gigabytes per second of one large put from this client.
async fn large_puts(client: &Client, trials: usize, scale: usize) -> anyhow::Result<()> {
    let mut put_gb = Vec::new();
    for _ in 0..trials {
        let payload = vec![1u8; (1 << 30) / scale];
        let started = Instant::now();
        let reference = client.put_bytes(payload).await?;
        put_gb.push(((1u64 << 30) / scale as u64) as f64 / started.elapsed().as_secs_f64() / 1e9);
        client.free(&reference).await?;
    }
    report("single client put gigabytes", "per second", &put_gb);
    Ok(())
}

/// One object of each size put on `stores[0]` and got by `stores[1]` over `path`.
async fn cross_node_gets(
    client: &Client,
    stores: &[ActorHandle<Store>],
    sizes: &[(&str, u64)],
    path: &str,
    trials: usize,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// One object to every other node at once: by the same-host path every node maps the one
/// segment the holder made; over the network the copies spread as the head's tree (the
/// holder serves `--object-fanout` pulls at a time).
async fn broadcasts(
    client: &Client,
    stores: &[ActorHandle<Store>],
    label: &str,
    size: u64,
    path: &str,
    trials: usize,
) -> anyhow::Result<()> {
    let fanout = stores.len() - 1;
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
