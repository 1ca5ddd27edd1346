//! The trainer's CPU collective plumbing across real processes: rank actors placed one per
//! node find each other through the cluster and all-reduce over QUIC.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use regatta::kinds::{Counter, CounterOp, CounterReply};
use regatta::{ActorOptions, Resources, Strategy};
use regatta_trainer::RingGroup;
use support::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_on_three_nodes_form_a_ring_and_all_reduce_over_quic() {
    let cluster = TestCluster::start(&[("w1", "CPU=2"), ("w2", "CPU=2"), ("w3", "CPU=2")]).await;
    let per_rank = Resources::parse_request("CPU=1").expect("request");
    let ring = RingGroup::form(
        &cluster.client,
        3,
        per_rank,
        Strategy::StrictSpread,
        Duration::from_secs(30),
    )
    .await
    .expect("the ring forms");
    let status = cluster.client.status().await.expect("status");
    let nodes: BTreeSet<String> = ring
        .ranks()
        .iter()
        .filter_map(|r| {
            status
                .actors
                .iter()
                .find(|a| a.view.id == r.id())
                .and_then(|a| a.view.node.clone())
        })
        .collect();
    assert_eq!(nodes.len(), 3, "one rank per node: {nodes:?}");

    let len = 100_003; // not divisible by the world size
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|rank| (0..len).map(|i| (rank * 10 + i % 5) as f32).collect())
        .collect();
    for round in 0..3 {
        let outputs = ring
            .all_reduce(inputs.clone(), Duration::from_secs(60))
            .await
            .expect("all-reduce");
        assert_eq!(outputs.len(), 3);
        for output in &outputs {
            assert_eq!(output.len(), len);
            for (i, value) in output.iter().enumerate().step_by(9_973) {
                assert_eq!(*value, (30 + 3 * (i % 5)) as f32, "round {round}, element {i}");
            }
        }
    }
    ring.remove().await.expect("remove the ring");
    // The cluster is fine afterwards.
    let counter = cluster
        .client
        .spawn::<Counter>(1, ActorOptions::new())
        .await
        .expect("spawn");
    assert_eq!(
        counter.call(CounterOp::Get).await.expect("call"),
        CounterReply::Total(1)
    );
}
