//! A real cluster (head and workers as separate processes on loopback) spawning, placing,
//! calling and restarting actors.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use regatta::kinds::{Counter, CounterOp, CounterReply, Echo, Placement};
use regatta::{ActorOptions, ActorState, Error, Resources, Strategy};
use support::{eventually, TestCluster};

fn req(text: &str) -> Resources {
    Resources::parse_request(text).expect("valid resource request")
}

async fn where_is(counter: &regatta::ActorHandle<Counter>) -> Placement {
    match counter.call(CounterOp::Where).await.expect("where call") {
        CounterReply::Placement(p) => p,
        other => panic!("expected a placement, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_actors_are_placed_by_resource_across_workers_and_each_answers() {
    let cluster = TestCluster::start(&[
        ("w1", "CPU=4"),
        ("w2", "CPU=4"),
        ("w3", "CPU=4,GPU=2,accelerator_type:H100=1"),
    ])
    .await;
    let mut handles = Vec::new();
    for i in 0..100 {
        // Every fourth actor needs the H100 tag, which only w3 has.
        let resources = if i % 4 == 0 {
            req("CPU=0.01,accelerator_type:H100")
        } else {
            req("CPU=0.01")
        };
        let handle = cluster
            .client
            .spawn::<Counter>(i, ActorOptions::new().resources(resources))
            .await
            .expect("spawn");
        handles.push((i, handle));
    }
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for (i, handle) in &handles {
        let total = handle.call(CounterOp::Add(1000)).await.expect("call");
        assert_eq!(total, CounterReply::Total(i + 1000));
        let placement = where_is(handle).await;
        if i % 4 == 0 {
            assert_eq!(placement.node, "w3", "tagged actor {i} must run on the H100 node");
        }
        *per_node.entry(placement.node).or_default() += 1;
    }
    assert_eq!(per_node.len(), 3, "actors spread over all workers: {per_node:?}");
    assert_eq!(per_node.values().sum::<usize>(), 100);
    let status = cluster.client.status().await.expect("status");
    let live = status
        .actors
        .iter()
        .filter(|a| a.view.state == ActorState::Alive)
        .count();
    assert_eq!(live, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_spread_puts_three_bundles_on_three_nodes_and_actors_follow_their_bundle() {
    let cluster = TestCluster::start(&[("w1", "CPU=2"), ("w2", "CPU=2"), ("w3", "CPU=2")]).await;
    let group = cluster
        .client
        .create_placement_group(vec![req("CPU=1"); 3], Strategy::StrictSpread)
        .await
        .expect("create group");
    let nodes = group.ready(Duration::from_secs(10)).await.expect("group ready");
    let distinct: BTreeSet<&String> = nodes.iter().collect();
    assert_eq!(distinct.len(), 3, "bundles on {nodes:?}");
    for (bundle, node) in nodes.iter().enumerate() {
        let actor = cluster
            .client
            .spawn::<Counter>(
                0,
                ActorOptions::new()
                    .resources(req("CPU=1"))
                    .in_group(&group, Some(bundle)),
            )
            .await
            .expect("spawn into bundle");
        assert_eq!(&where_is(&actor).await.node, node, "actor in bundle {bundle}");
    }
    // Four bundles over three nodes can never be strictly spread.
    let err = cluster
        .client
        .create_placement_group(vec![req("CPU=0.1"); 4], Strategy::StrictSpread)
        .await
        .err()
        .expect("four bundles on three nodes must be refused");
    assert!(err.to_string().contains("4 distinct nodes"), "{err}");
    group.remove().await.expect("remove group");
    let status = cluster.client.status().await.expect("status");
    assert!(status.groups.is_empty());
    assert!(
        status.nodes.iter().all(|n| n.used.fixed("CPU") == 0),
        "removal freed every CPU: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pack_keeps_bundles_on_one_node_when_they_fit() {
    let cluster = TestCluster::start(&[("w1", "CPU=4"), ("w2", "CPU=4")]).await;
    let group = cluster
        .client
        .create_placement_group(vec![req("CPU=1"); 3], Strategy::Pack)
        .await
        .expect("create group");
    let nodes = group.ready(Duration::from_secs(10)).await.expect("group ready");
    assert!(
        nodes.iter().all(|n| n == &nodes[0]),
        "PACK spread bundles over {nodes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infeasible_requests_and_unknown_kinds_fail_at_once_with_what_is_missing() {
    let cluster = TestCluster::start(&[("w1", "CPU=2,GPU=4"), ("w2", "CPU=2")]).await;
    let started = Instant::now();
    let err = cluster
        .client
        .spawn::<Echo>(
            String::new(),
            ActorOptions::new().resources(req("GPU=8,accelerator_type:H100")),
        )
        .await
        .err()
        .expect("GPU=8 is infeasible");
    let text = err.to_string();
    assert!(matches!(err, Error::Infeasible(_)), "{err:?}");
    assert!(text.contains("GPU=8 (largest: GPU=4 on node w1)"), "{text}");
    assert!(text.contains("no node has accelerator_type:H100"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "infeasible must not wait");

    struct Ghost;
    impl regatta::Actor for Ghost {
        const KIND: &'static str = "ghost";
        type Args = ();
        type Request = ();
        type Reply = ();
        async fn create(_: (), _: &regatta::ActorContext) -> Result<Self, regatta::ActorError> {
            Ok(Ghost)
        }
        async fn handle(&mut self, _: (), _: &regatta::ActorContext) -> Result<(), regatta::ActorError> {
            Ok(())
        }
    }
    let err = cluster
        .client
        .spawn::<Ghost>((), ActorOptions::new())
        .await
        .err()
        .expect("unknown kind");
    assert!(
        matches!(&err, Error::UnknownKind { kind, .. } if kind == "ghost"),
        "{err:?}"
    );
    assert!(err.to_string().contains("counter"), "lists the registered kinds: {err}");

    let err = cluster
        .client
        .spawn::<Echo>(String::new(), ActorOptions::new().resources(req("GPU=1.5")))
        .await
        .err()
        .expect("GPU=1.5 is not a valid shape");
    assert!(err.to_string().contains("whole number"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_request_waits_then_runs_when_resources_free_up() {
    let cluster = TestCluster::start(&[("w1", "CPU=2,GPU=1")]).await;
    let first = cluster
        .client
        .spawn::<Echo>("a".into(), ActorOptions::new().resources(req("GPU=1")))
        .await
        .expect("first GPU actor");
    assert_eq!(first.call("x".into()).await.expect("call").placement.gpu_ids, vec![0]);
    let second = cluster
        .client
        .spawn::<Echo>("b".into(), ActorOptions::new().resources(req("GPU=1")))
        .await
        .expect("a busy request is accepted, not refused");
    let waited = second.wait_ready(Duration::from_millis(500)).await;
    assert!(
        matches!(waited, Err(Error::Timeout { .. })),
        "must wait for the GPU: {waited:?}"
    );
    let status = cluster.client.status().await.expect("status");
    assert_eq!(status.pending.len(), 1, "{:?}", status.pending);
    assert!(status.pending[0].resources.contains("GPU=1"));
    first.kill().await.expect("kill first");
    let reply = second.call("y".into()).await.expect("second runs once the GPU is free");
    assert_eq!(reply.text, "by");
    assert_eq!(reply.placement.gpu_ids, vec![0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_actors_learn_their_indices_and_never_share_unless_fractional() {
    let cluster = TestCluster::start(&[("w1", "CPU=8,GPU=2")]).await;
    let mut whole = Vec::new();
    for _ in 0..2 {
        let h = cluster
            .client
            .spawn::<Echo>(String::new(), ActorOptions::new().resources(req("GPU=1")))
            .await
            .expect("spawn");
        whole.push(h.call(String::new()).await.expect("call").placement.gpu_ids);
    }
    whole.sort();
    assert_eq!(whole, vec![vec![0], vec![1]]);
    for h in cluster.client.status().await.expect("status").actors {
        cluster.client.kill(h.view.id).await.expect("kill");
    }
    let mut halves = BTreeMap::new();
    for _ in 0..4 {
        let h = cluster
            .client
            .spawn::<Echo>(String::new(), ActorOptions::new().resources(req("GPU=0.5")))
            .await
            .expect("spawn");
        let ids = h.call(String::new()).await.expect("call").placement.gpu_ids;
        *halves.entry(ids).or_insert(0) += 1;
    }
    assert_eq!(halves, BTreeMap::from([(vec![0], 2), (vec![1], 2)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_worker_has_its_actors_restarted_elsewhere_and_rejoins() {
    let mut cluster = TestCluster::start(&[("w1", "CPU=4"), ("w2", "CPU=4")]).await;
    // Least-loaded placement spreads the actors over both workers; those that landed on
    // w1 are the ones whose fate is checked.
    let mut restartable = Vec::new();
    let mut fragile = Vec::new();
    for i in 0..10 {
        let h = cluster
            .client
            .spawn::<Counter>(i, ActorOptions::new().resources(req("CPU=0.1")).max_restarts(1))
            .await
            .expect("spawn");
        restartable.push(h);
    }
    for i in 0..10 {
        let f = cluster
            .client
            .spawn::<Counter>(i, ActorOptions::new().resources(req("CPU=0.1")))
            .await
            .expect("spawn");
        fragile.push(f);
    }
    let mut on_w1 = Vec::new();
    for h in &restartable {
        h.call(CounterOp::Add(100)).await.expect("call");
        if where_is(h).await.node == "w1" {
            on_w1.push(h.clone());
        }
    }
    let mut fragile_on_w1 = Vec::new();
    for h in &fragile {
        if where_is(h).await.node == "w1" {
            fragile_on_w1.push(h.clone());
        }
    }
    assert!(!on_w1.is_empty() && !fragile_on_w1.is_empty(), "placement used w1");

    // A slow call in flight on w1 must fail, not hang, when w1 dies.
    let slow = on_w1[0].clone();
    let in_flight = tokio::spawn(async move {
        slow.call_timeout(CounterOp::Sleep(20_000), Duration::from_secs(25))
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let killed_at = Instant::now();
    cluster.local.kill_worker(0).expect("kill w1");
    let outcome = in_flight.await.expect("join");
    assert!(outcome.is_err(), "in-flight call must fail: {outcome:?}");
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "the failed call took {:?}",
        killed_at.elapsed()
    );

    cluster.wait_node_state("w1", "dead", Duration::from_secs(10)).await;
    for h in &on_w1 {
        let placement = eventually("restarted actor", Duration::from_secs(15), || async {
            match h.call_timeout(CounterOp::Where, Duration::from_secs(2)).await {
                Ok(CounterReply::Placement(p)) => Some(p),
                _ => None,
            }
        })
        .await;
        assert_eq!(placement.node, "w2");
        // The constructor ran again: the total is back to the start argument, not +100.
        match h.call(CounterOp::Get).await.expect("get") {
            CounterReply::Total(t) => assert!(t < 100, "state was rebuilt by the constructor, got {t}"),
            other => panic!("{other:?}"),
        }
    }
    for h in &fragile_on_w1 {
        let err = h
            .call(CounterOp::Get)
            .await
            .err()
            .expect("actor without restarts is dead");
        let text = err.to_string();
        assert!(matches!(err, Error::ActorDead { .. }), "{err:?}");
        assert!(
            text.contains("node w1 died") && text.contains("max_restarts=0"),
            "{text}"
        );
    }
    let status = cluster.client.status().await.expect("status");
    let w1 = status.nodes.iter().find(|n| n.name == "w1").expect("w1 listed");
    assert_eq!(w1.state, "dead");
    assert!(w1.used.is_empty(), "a dead node holds no resources");

    cluster.local.restart_worker(0).expect("restart w1");
    cluster.wait_node_state("w1", "alive", Duration::from_secs(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_made_just_after_a_node_died_fails_once_the_head_declares_it_dead() {
    let mut cluster = TestCluster::start(&[("w1", "CPU=2,pin:w1=1"), ("w2", "CPU=2")]).await;
    let options = ActorOptions::new()
        .resources(Resources::parse_request("pin:w1").expect("resources"))
        .max_restarts(0);
    let counter = cluster.client.spawn::<Counter>(0, options).await.expect("spawn");
    counter.call(CounterOp::Get).await.expect("alive");
    cluster.local.kill_worker(0).expect("kill w1");
    // This process drops w1's actors at once; the head declares w1 dead only after its
    // heartbeat timeout. A call made in between must not wait out its own long timeout.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let err = counter
        .call_timeout(CounterOp::Get, Duration::from_secs(60))
        .await
        .err()
        .expect("the actor is gone");
    assert!(
        matches!(err, Error::ActorDead { .. } | Error::CallFailed { .. }),
        "{err:?} after {:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actors_call_and_cast_each_other_across_nodes_and_are_found_by_name() {
    let cluster = TestCluster::start(&[("w1", "CPU=2"), ("w2", "CPU=2")]).await;
    let a = cluster
        .client
        .spawn::<Counter>(0, ActorOptions::new().resources(req("CPU=1")).name("alpha"))
        .await
        .expect("spawn a");
    let b = cluster
        .client
        .spawn::<Counter>(10, ActorOptions::new().resources(req("CPU=1")).name("beta"))
        .await
        .expect("spawn b");
    let (pa, pb) = (where_is(&a).await, where_is(&b).await);
    assert_ne!(pa.node, pb.node, "least-loaded placement puts them on different nodes");
    let reply = a
        .call(CounterOp::AddToPeer {
            peer: b.id(),
            amount: 5,
        })
        .await
        .expect("a calls b");
    assert_eq!(reply, CounterReply::Total(15));
    a.call(CounterOp::CastToPeer {
        peer: b.id(),
        amount: 1,
    })
    .await
    .expect("a casts to b");
    b.cast(CounterOp::Add(1)).await.expect("driver casts to b");
    eventually("casts applied", Duration::from_secs(5), || async {
        (b.call(CounterOp::Get).await.ok()? == CounterReply::Total(17)).then_some(())
    })
    .await;

    let found = cluster
        .client
        .named::<Counter>("beta")
        .await
        .expect("lookup")
        .expect("beta exists");
    assert_eq!(found.id(), b.id());
    assert!(cluster
        .client
        .named::<Counter>("gamma")
        .await
        .expect("lookup")
        .is_none());
    let dup = cluster
        .client
        .spawn::<Counter>(0, ActorOptions::new().name("beta"))
        .await
        .err()
        .expect("duplicate name");
    assert!(dup.to_string().contains("already exists"), "{dup}");
    assert!(
        cluster.client.named::<Echo>("beta").await.is_err(),
        "kind mismatch is an error"
    );

    b.kill().await.expect("kill");
    let err = b.call(CounterOp::Get).await.err().expect("killed actor");
    assert!(err.to_string().contains("killed by request"), "{err}");
    assert!(cluster.client.named::<Counter>("beta").await.expect("lookup").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_errors_keep_the_actor_and_panics_restart_it_within_budget() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let c = cluster
        .client
        .spawn::<Counter>(1, ActorOptions::new().max_restarts(1))
        .await
        .expect("spawn");
    c.call(CounterOp::Add(5)).await.expect("add");
    let err = c
        .call(CounterOp::Fail("nope".into()))
        .await
        .err()
        .expect("handler error");
    assert!(
        matches!(&err, Error::Remote { message, .. } if message == "nope"),
        "{err:?}"
    );
    assert_eq!(
        c.call(CounterOp::Get).await.expect("still alive"),
        CounterReply::Total(6)
    );

    assert!(c.call(CounterOp::Crash).await.is_err(), "the crashing call fails");
    let total = eventually("restart after panic", Duration::from_secs(10), || async {
        c.call_timeout(CounterOp::Get, Duration::from_secs(2)).await.ok()
    })
    .await;
    assert_eq!(total, CounterReply::Total(1), "constructor re-ran");
    assert!(c.call(CounterOp::Crash).await.is_err());
    let err = eventually("death after the budget", Duration::from_secs(10), || async {
        match c.call_timeout(CounterOp::Get, Duration::from_secs(2)).await {
            Err(e @ Error::ActorDead { .. }) => Some(e),
            _ => None,
        }
    })
    .await;
    assert!(
        err.to_string().contains("panicked") || err.to_string().contains("failed"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_constructor_args_and_failing_constructors_report_a_dead_actor() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let negative = cluster
        .client
        .spawn::<Counter>(-1, ActorOptions::new())
        .await
        .expect("accepted");
    let err = negative
        .wait_ready(Duration::from_secs(10))
        .await
        .err()
        .expect("constructor refuses -1");
    assert!(err.to_string().contains("cannot start below zero"), "{err}");

    // Same kind name, wrong argument type: the worker cannot decode the arguments.
    struct WrongArgs;
    impl regatta::Actor for WrongArgs {
        const KIND: &'static str = "counter";
        type Args = String;
        type Request = ();
        type Reply = ();
        async fn create(_: String, _: &regatta::ActorContext) -> Result<Self, regatta::ActorError> {
            Ok(WrongArgs)
        }
        async fn handle(&mut self, _: (), _: &regatta::ActorContext) -> Result<(), regatta::ActorError> {
            Ok(())
        }
    }
    let wrong = cluster
        .client
        .spawn::<WrongArgs>("x".into(), ActorOptions::new())
        .await
        .expect("accepted");
    let err = wrong
        .wait_ready(Duration::from_secs(10))
        .await
        .err()
        .expect("undecodable args");
    assert!(
        err.to_string().contains("could not decode constructor arguments"),
        "{err}"
    );
    let status = cluster.client.status().await.expect("status");
    assert_eq!(status.nodes[0].state, "alive", "the worker survived");
}

/// `node`'s `/metrics` page, found through the head's Prometheus discovery (which lists a
/// node from its next publication on).
async fn node_metrics(cluster: &TestCluster, node: &str) -> String {
    let target = eventually("the node's metrics target", Duration::from_secs(10), || async {
        let (code, body) = support::http_get(&cluster.local.metrics_address, "/api/prometheus/sd");
        assert_eq!(code, 200, "{body}");
        let groups: serde_json::Value = serde_json::from_str(&body).expect("discovery is JSON");
        let group = groups
            .as_array()
            .expect("a list of target groups")
            .iter()
            .find(|g| g["labels"]["regatta_node"] == node)?
            .clone();
        Some(group["targets"][0].as_str().expect("a target address").to_string())
    })
    .await;
    support::http_get(&format!("http://{target}"), "/metrics").1
}

/// Messages of `kind` (call or cast) that reached `node` on its call channel.
async fn channel_messages(cluster: &TestCluster, node: &str, kind: &str) -> u64 {
    let series = format!("regatta_call_channel_messages_total{{kind=\"{kind}\"}} ");
    node_metrics(cluster, node)
        .await
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .map_or(0, |value| value.trim().parse().expect("a counter value"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_casts_ride_the_call_channel_in_order_and_the_session_path_still_answers() {
    let cluster = TestCluster::start(&[("w1", "CPU=2"), ("w2", "CPU=2")]).await;
    let spawn = |start| {
        cluster
            .client
            .spawn::<Counter>(start, ActorOptions::new().resources(req("CPU=1")))
    };
    let (a, b) = (spawn(0).await.expect("spawn a"), spawn(0).await.expect("spawn b"));
    let (node_a, node_b) = (where_is(&a).await.node, where_is(&b).await.node);
    assert_ne!(node_a, node_b, "least-loaded placement puts them on different nodes");
    let (calls_a, casts_a, calls_b) = (
        channel_messages(&cluster, &node_a, "call").await,
        channel_messages(&cluster, &node_a, "cast").await,
        channel_messages(&cluster, &node_b, "call").await,
    );

    // A driver's casts and the call after them arrive in the order sent: no waiting.
    for _ in 0..100 {
        a.cast(CounterOp::Add(1)).await.expect("cast");
    }
    assert_eq!(a.call(CounterOp::Get).await.expect("get"), CounterReply::Total(100));
    // An actor calls another on the other node the same way.
    let reply = a
        .call(CounterOp::AddToPeer {
            peer: b.id(),
            amount: 5,
        })
        .await
        .expect("a calls b");
    assert_eq!(reply, CounterReply::Total(5));
    assert_eq!(channel_messages(&cluster, &node_a, "cast").await - casts_a, 100);
    assert_eq!(channel_messages(&cluster, &node_a, "call").await - calls_a, 2);
    assert_eq!(channel_messages(&cluster, &node_b, "call").await - calls_b, 1);

    // A client that sends by the sessions reaches the same actor, and not by the channel.
    let by_session = cluster.client.with_call_path(regatta::CallPath::Session);
    let a_by_session = by_session.handle::<Counter>(a.id());
    a_by_session.cast(CounterOp::Add(1)).await.expect("cast by session");
    assert_eq!(
        a_by_session.call(CounterOp::Add(1)).await.expect("call by session"),
        CounterReply::Total(102)
    );
    assert_eq!(channel_messages(&cluster, &node_a, "call").await - calls_a, 2);
    assert_eq!(channel_messages(&cluster, &node_a, "cast").await - casts_a, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_with_max_concurrency_runs_that_many_calls_beside_each_other() {
    use regatta::kinds::Rendezvous;
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let meeting = cluster
        .client
        .spawn::<Rendezvous>(4, ActorOptions::new())
        .await
        .expect("spawn");
    // Four calls can only all return true if the host runs them at once.
    let calls = (0..4).map(|_| meeting.call(30));
    let met = futures::future::join_all(calls).await;
    assert!(met.iter().all(|m| matches!(m, Ok(true))), "{met:?}");
    // A fifth call waits for a place, then meets no one within a second.
    assert!(!meeting.call(1).await.expect("call"), "a lone call meets no one");
}
