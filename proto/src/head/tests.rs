use super::durable::REPLAYED;
use super::objects::UNKNOWN_OBJECT_WAIT_MS;
use super::*;
use crate::placement::Strategy;
use crate::protocol::{ActorSpec, DeathCause, GroupSpec, Loss, NodeInfo, Registration};
use crate::resources::Resources;
use crate::scheduler::Scheduler;

fn node(name: &str, resources: &str) -> HeadRequest {
    HeadRequest::Register(
        NodeInfo {
            name: name.into(),
            address: format!("{name}:1"),
            resources: Resources::parse_capacity(resources).unwrap(),
            kinds: vec!["echo".into()],
            pid: 1,
            metrics_address: None,
        },
        Vec::new(),
    )
}

fn spawn(resources: &str) -> HeadRequest {
    HeadRequest::Spawn(ActorSpec {
        kind: "echo".into(),
        args: Vec::new(),
        resources: Resources::parse_request(resources).unwrap(),
        name: None,
        max_restarts: 0,
        placement: None,
        job: None,
    })
}

fn spawn_with(resources: &str, max_restarts: u32) -> HeadRequest {
    match spawn(resources) {
        HeadRequest::Spawn(spec) => HeadRequest::Spawn(ActorSpec { max_restarts, ..spec }),
        other => other,
    }
}

/// Spawns and starts an actor; returns its id, the node it runs on and its attempt.
fn running(head: &mut HeadCore, request: HeadRequest, now: u64) -> (ActorId, String, u32) {
    let out = head.handle(request, Some(ReplyTo(0)), now);
    let id = spawned(&out);
    let start = starts(&out).pop().expect("placed at once");
    head.handle(
        HeadRequest::Started {
            actor: id,
            attempt: start.attempt,
            outcome: Ok(()),
        },
        None,
        now,
    );
    (id, start.node, start.attempt)
}

fn replies(out: &[Output]) -> Vec<(ReplyTo, Answer)> {
    out.iter()
        .filter_map(|o| match o {
            Output::Reply(to, answer) => Some((*to, answer.clone())),
            _ => None,
        })
        .collect()
}

fn starts(out: &[Output]) -> Vec<crate::protocol::StartActor> {
    out.iter()
        .filter_map(|o| match o {
            Output::Effect(Effect::Start(start)) => Some(start.clone()),
            _ => None,
        })
        .collect()
}

fn spawned(out: &[Output]) -> ActorId {
    match replies(out).as_slice() {
        [(_, Answer::Spawned(Ok(id)))] => *id,
        other => panic!("expected one spawned reply, got {other:?}"),
    }
}

#[test]
fn a_wait_for_an_actor_is_parked_until_it_is_alive() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), Some(ReplyTo(1)), 0);
    let out = head.handle(spawn("CPU=1"), Some(ReplyTo(2)), 0);
    let id = spawned(&out);
    let start = starts(&out).pop().expect("the actor is started at once");
    assert_eq!(start.node, "w1");
    assert!(replies(&head.handle(HeadRequest::WaitActor(id), Some(ReplyTo(3)), 1)).is_empty());
    assert_eq!(head.parked(), 1);
    let out = head.handle(
        HeadRequest::Started {
            actor: id,
            attempt: start.attempt,
            outcome: Ok(()),
        },
        None,
        2,
    );
    match replies(&out).as_slice() {
        [(ReplyTo(3), Answer::Actor(Ok(view)))] => assert_eq!(view.state, ActorState::Alive),
        other => panic!("expected the waiter's answer, got {other:?}"),
    }
    assert_eq!(head.parked(), 0);
}

#[test]
fn a_wait_for_an_unknown_actor_is_refused_at_once() {
    let mut head = HeadCore::new(3_000, 10_000);
    let out = head.handle(HeadRequest::WaitActor(ActorId(42)), Some(ReplyTo(7)), 0);
    assert!(matches!(
        replies(&out).as_slice(),
        [(ReplyTo(7), Answer::Actor(Err(Failure::Rejected(_))))]
    ));
}

/// The first source a pull answer names.
fn pulled_from(answers: &[(ReplyTo, Answer)], to: ReplyTo) -> Option<String> {
    answers.iter().find_map(|(t, a)| match a {
        Answer::Location(Ok(location)) if *t == to => Some(location.sources[0].0.clone()),
        _ => None,
    })
}

/// The put of a 1 GiB object held by node a (10.0.0.1), large enough to fan out.
fn gib_on_a(id: ObjectId, checksum: u32) -> HeadRequest {
    HeadRequest::ObjectPut {
        id,
        size: 1 << 30,
        checksum,
        node: "a".into(),
        address: "10.0.0.1:7000".into(),
        job: None,
    }
}

#[test]
fn a_held_back_pull_its_node_gave_up_takes_no_share() {
    let mut head = HeadCore::new(3_000, 10_000).with_object_fanout(1);
    let id = ObjectId::random();
    let put = gib_on_a(id, 9);
    head.handle(put, Some(ReplyTo(1)), 0);
    let pull = |node: &str, host: u8| HeadRequest::ObjectPull {
        id,
        node: node.into(),
        address: format!("10.0.0.{host}:7000"),
    };
    head.handle(pull("b", 2), Some(ReplyTo(2)), 0);
    assert!(replies(&head.handle(pull("c", 3), Some(ReplyTo(3)), 0)).is_empty());
    assert!(replies(&head.handle(pull("d", 4), Some(ReplyTo(4)), 0)).is_empty());
    // c's get gave up while held back: its pull is dropped, unanswered.
    let gave_up = HeadRequest::ObjectPullEnded { id, node: "c".into() };
    assert!(replies(&head.handle(gave_up, None, 1)).is_empty());
    assert_eq!(head.parked(), 1);
    // b's pull ends without a copy: a's share goes to d, not to c.
    let ended = HeadRequest::ObjectPullEnded { id, node: "b".into() };
    let answers = replies(&head.handle(ended, None, 2));
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(pulled_from(&answers, ReplyTo(4)).as_deref(), Some("a"), "{answers:?}");
    assert_eq!(head.parked(), 0);
    // A pull parked until its object's id arrives, given up: the put answers nobody.
    let later = ObjectId::random();
    let pull_later = HeadRequest::ObjectPull {
        id: later,
        node: "x".into(),
        address: "10.0.0.9:7000".into(),
    };
    assert!(replies(&head.handle(pull_later, Some(ReplyTo(7)), 3)).is_empty());
    assert_eq!(head.parked(), 1);
    head.handle(
        HeadRequest::ObjectPullEnded {
            id: later,
            node: "x".into(),
        },
        None,
        4,
    );
    assert_eq!(head.parked(), 0);
    let put_later = gib_on_a(later, 9);
    let answers = replies(&head.handle(put_later, Some(ReplyTo(8)), 5));
    assert!(pulled_from(&answers, ReplyTo(7)).is_none(), "{answers:?}");
}

#[test]
fn a_broadcast_pull_waits_for_a_copy_when_its_holder_serves_its_share() {
    let mut head = HeadCore::new(3_000, 10_000).with_object_fanout(1);
    let id = ObjectId::random();
    let put = gib_on_a(id, 9);
    head.handle(put, Some(ReplyTo(1)), 0);
    let pull = |node: &str, host: u8| HeadRequest::ObjectPull {
        id,
        node: node.into(),
        address: format!("10.0.0.{host}:7000"),
    };
    let out = head.handle(pull("b", 2), Some(ReplyTo(2)), 0);
    assert_eq!(pulled_from(&replies(&out), ReplyTo(2)).as_deref(), Some("a"));
    assert!(
        replies(&head.handle(pull("c", 3), Some(ReplyTo(3)), 0)).is_empty(),
        "a serves b"
    );
    assert!(replies(&head.handle(pull("d", 4), Some(ReplyTo(4)), 0)).is_empty());
    assert_eq!(head.parked(), 2);
    // A node on a's host maps a's memory: it does not wait.
    let out = head.handle(pull("e", 1), Some(ReplyTo(5)), 0);
    assert_eq!(pulled_from(&replies(&out), ReplyTo(5)).as_deref(), Some("a"));
    // b's copy arrives: b (which served none yet) serves c, and a (free again) d.
    let added = HeadRequest::ObjectAddSource {
        id,
        node: "b".into(),
        address: "10.0.0.2:7000".into(),
    };
    let answers = replies(&head.handle(added, None, 5));
    assert_eq!(pulled_from(&answers, ReplyTo(3)).as_deref(), Some("b"), "{answers:?}");
    assert_eq!(pulled_from(&answers, ReplyTo(4)).as_deref(), Some("a"), "{answers:?}");
    assert_eq!(head.parked(), 0);
    // Everyone busy: f waits, until c says its pull ended without a copy.
    assert!(replies(&head.handle(pull("f", 6), Some(ReplyTo(6)), 10)).is_empty());
    let ended = HeadRequest::ObjectPullEnded { id, node: "c".into() };
    let answers = replies(&head.handle(ended, None, 11));
    assert_eq!(pulled_from(&answers, ReplyTo(6)).as_deref(), Some("b"), "{answers:?}");
    // g waits behind d's pull (a) and f's (b) until d's lease lapses on a tick.
    assert!(replies(&head.handle(pull("g", 7), Some(ReplyTo(7)), 20)).is_empty());
    let lapse = 5 + crate::object::fanout::lease_ms(1 << 30);
    assert!(replies(&head.tick(lapse - 1)).is_empty());
    let answers = replies(&head.tick(lapse));
    assert_eq!(pulled_from(&answers, ReplyTo(7)).as_deref(), Some("a"), "{answers:?}");
    // h is held; when f's lease lapses, h (held first) gets b before j, asking then.
    assert!(replies(&head.handle(pull("h", 8), Some(ReplyTo(8)), 11 + 1)).is_empty());
    let answers = replies(&head.handle(pull("j", 10), Some(ReplyTo(10)), 11 + lapse));
    assert_eq!(pulled_from(&answers, ReplyTo(8)).as_deref(), Some("b"), "{answers:?}");
    assert!(pulled_from(&answers, ReplyTo(10)).is_none(), "{answers:?}");
    // A pull held back for an object freed meanwhile gets the missing-object answer.
    let answers = replies(&head.handle(HeadRequest::ObjectFree(id), Some(ReplyTo(9)), lapse + 20));
    assert!(
        answers
            .iter()
            .any(|(to, a)| *to == ReplyTo(10) && matches!(a, Answer::Location(Err(Failure::ObjectMissing { .. })))),
        "{answers:?}"
    );
    assert_eq!(head.parked(), 0);
    // A pull nobody waits for takes no share.
    let other = ObjectId::random();
    head.handle(gib_on_a(other, 1), None, 0);
    let pull_other = |node: &str, host: u8| HeadRequest::ObjectPull {
        id: other,
        node: node.into(),
        address: format!("10.0.0.{host}:7000"),
    };
    head.handle(pull_other("x", 30), None, 0);
    head.handle(pull_other("y", 31), Some(REPLAYED), 0);
    let out = head.handle(pull_other("z", 32), Some(ReplyTo(11)), 0);
    assert_eq!(pulled_from(&replies(&out), ReplyTo(11)).as_deref(), Some("a"));
}

#[test]
fn a_wait_for_objects_is_answered_once_enough_are_readable_or_at_its_deadline() {
    let mut head = HeadCore::new(3_000, 10_000);
    let (a, b, never) = (ObjectId::random(), ObjectId::random(), ObjectId::random());
    let put = |id| HeadRequest::ObjectPut {
        id,
        size: 5,
        checksum: 9,
        node: "w1".into(),
        address: "w1:2".into(),
        job: None,
    };
    let wait = |ids: Vec<ObjectId>, wanted, timeout_ms| HeadRequest::ObjectsWait {
        ids,
        wanted,
        timeout_ms,
    };
    let ready = |out: &[Output], to: ReplyTo| -> Option<Vec<ObjectId>> {
        replies(out).into_iter().find_map(|(t, answer)| match answer {
            Answer::Ready(Ok(ids)) if t == to => Some(ids),
            _ => None,
        })
    };
    // Two of three wanted: parked until the second put, answered with those readable.
    assert!(head
        .handle(wait(vec![a, never, b], 2, 5_000), Some(ReplyTo(1)), 0)
        .is_empty());
    // A wait the directory already satisfies is answered at once (nothing wanted).
    let out = head.handle(wait(vec![never], 0, 5_000), Some(ReplyTo(2)), 0);
    assert_eq!(ready(&out, ReplyTo(2)), Some(vec![]));
    let out = head.handle(put(a), Some(ReplyTo(3)), 10);
    assert_eq!(ready(&out, ReplyTo(1)), None, "one of two is not enough");
    assert_eq!(head.parked(), 1);
    let out = head.handle(put(b), Some(ReplyTo(4)), 20);
    assert_eq!(ready(&out, ReplyTo(1)), Some(vec![a, b]), "in the order asked");
    assert_eq!(head.parked(), 0);
    // A wait that cannot be met is answered at its deadline with what is readable.
    assert!(head
        .handle(wait(vec![a, never], 2, 100), Some(ReplyTo(5)), 30)
        .is_empty());
    assert_eq!(ready(&head.tick(129), ReplyTo(5)), None);
    assert_eq!(ready(&head.tick(130), ReplyTo(5)), Some(vec![a]));
    // A caller that went away leaves nothing parked.
    assert!(head
        .handle(wait(vec![never], 1, 60_000), Some(ReplyTo(6)), 200)
        .is_empty());
    assert_eq!(head.parked(), 1);
    head.forget(|to| to == ReplyTo(6));
    assert_eq!(head.parked(), 0);
}

#[test]
fn a_lookup_of_an_unregistered_object_waits_for_its_put_or_runs_out() {
    let mut head = HeadCore::new(3_000, 10_000);
    let (early, never) = (ObjectId::random(), ObjectId::random());
    assert!(head
        .handle(HeadRequest::ObjectLocate(early), Some(ReplyTo(1)), 0)
        .is_empty());
    assert!(head
        .handle(HeadRequest::ObjectLocate(never), Some(ReplyTo(2)), 0)
        .is_empty());
    let put = HeadRequest::ObjectPut {
        id: early,
        size: 5,
        checksum: 9,
        node: "w1".into(),
        address: "w1:2".into(),
        job: None,
    };
    let out = head.handle(put, Some(ReplyTo(3)), 10);
    let answers = replies(&out);
    assert!(
        answers
            .iter()
            .any(|(to, a)| *to == ReplyTo(3) && matches!(a, Answer::Done(Ok(())))),
        "{answers:?}"
    );
    assert!(
        answers
            .iter()
            .any(|(to, a)| *to == ReplyTo(1) && matches!(a, Answer::Location(Ok(l)) if l.size == 5)),
        "{answers:?}"
    );
    assert!(replies(&head.tick(UNKNOWN_OBJECT_WAIT_MS - 1)).is_empty());
    let out = head.tick(UNKNOWN_OBJECT_WAIT_MS);
    assert!(matches!(
        replies(&out).as_slice(),
        [(
            ReplyTo(2),
            Answer::Location(Err(Failure::ObjectMissing { lost_with: None, .. }))
        )]
    ));
    assert_eq!(head.parked(), 0);
}

#[test]
fn a_copy_reported_after_its_object_was_freed_is_released_on_that_node() {
    let mut head = HeadCore::new(3_000, 10_000);
    let id = ObjectId::random();
    let put = HeadRequest::ObjectPut {
        id,
        size: 5,
        checksum: 9,
        node: "w1".into(),
        address: "w1:2".into(),
        job: None,
    };
    head.handle(put, Some(ReplyTo(1)), 0);
    let out = head.handle(HeadRequest::ObjectFree(id), Some(ReplyTo(2)), 1);
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Release(r) if r.id == id && r.nodes == ["w1"])),
        "{out:?}"
    );
    // w2's word that it cached a pulled copy arrives after the free.
    let late = HeadRequest::ObjectAddSource {
        id,
        node: "w2".into(),
        address: "w2:2".into(),
    };
    let out = head.handle(late, None, 2);
    assert!(
        matches!(out.as_slice(), [Output::Release(r)] if r.id == id && r.nodes == ["w2"]),
        "{out:?}"
    );
}

#[test]
fn forgotten_callers_leave_no_waiter_behind() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=1"), None, 0);
    head.handle(spawn("CPU=1"), Some(ReplyTo(1)), 0);
    let waiting = spawned(&head.handle(spawn("CPU=1"), Some(ReplyTo(2)), 0));
    head.handle(HeadRequest::WaitActor(waiting), Some(ReplyTo(3)), 0);
    head.handle(HeadRequest::ObjectLocate(ObjectId::random()), Some(ReplyTo(4)), 0);
    assert_eq!(head.parked(), 2);
    head.forget(|to| to == ReplyTo(4));
    assert_eq!(head.parked(), 1);
    head.forget(|_| true);
    assert_eq!(head.parked(), 0);
}

#[test]
fn a_group_wait_is_answered_once_its_bundles_can_be_placed() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), None, 0);
    let out = head.handle(spawn("CPU=2"), Some(ReplyTo(1)), 0);
    let hog = spawned(&out);
    let start = starts(&out).pop().expect("started");
    head.handle(
        HeadRequest::Started {
            actor: hog,
            attempt: start.attempt,
            outcome: Ok(()),
        },
        None,
        0,
    );
    let out = head.handle(
        HeadRequest::CreateGroup(GroupSpec {
            bundles: vec![Resources::parse_request("CPU=1").unwrap(); 2],
            strategy: Strategy::Pack,
            name: None,
        }),
        Some(ReplyTo(2)),
        1,
    );
    let id = match replies(&out).as_slice() {
        [(_, Answer::GroupCreated(Ok(id)))] => *id,
        other => panic!("{other:?}"),
    };
    assert!(replies(&head.handle(HeadRequest::WaitGroup(id), Some(ReplyTo(3)), 2)).is_empty());
    let out = head.handle(HeadRequest::Kill(hog), Some(ReplyTo(4)), 3);
    let answers = replies(&out);
    assert!(
        answers
            .iter()
            .any(|(to, a)| *to == ReplyTo(3) && matches!(a, Answer::GroupPlaced(Ok(nodes)) if nodes == &["w1", "w1"])),
        "{answers:?}"
    );
}

#[test]
fn a_node_dies_with_actors_and_a_pending_group_and_each_goes_where_it_should() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), None, 0);
    let (restartable, on, first) = running(&mut head, spawn_with("CPU=1", 1), 0);
    let (fragile, _, _) = running(&mut head, spawn_with("CPU=1", 0), 0);
    assert_eq!(on, "w1");
    // w1 is full: the group waits, and so do its caller and a wait on the fragile actor.
    let out = head.handle(
        HeadRequest::CreateGroup(GroupSpec {
            bundles: vec![Resources::parse_request("CPU=2").unwrap()],
            strategy: Strategy::Pack,
            name: None,
        }),
        Some(ReplyTo(1)),
        10,
    );
    let group = match replies(&out).as_slice() {
        [(_, Answer::GroupCreated(Ok(id)))] => *id,
        other => panic!("{other:?}"),
    };
    head.handle(HeadRequest::WaitGroup(group), Some(ReplyTo(2)), 10);
    head.handle(node("w2", "CPU=1"), None, 2_500);
    // w1 goes silent: the restartable actor moves to w2, the fragile one dies, the
    // group still cannot fit (w2 is too small) and keeps waiting.
    let out = head.tick(3_001);
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Notice(Notice::NodeDead { node, .. }) if node == "w1")));
    let moved = starts(&out);
    assert_eq!(moved.len(), 1, "{out:?}");
    assert_eq!(
        (moved[0].actor, moved[0].node.as_str(), moved[0].attempt),
        (restartable, "w2", first + 1)
    );
    let out = head.handle(HeadRequest::WaitActor(fragile), Some(ReplyTo(3)), 3_002);
    match replies(&out).as_slice() {
        [(ReplyTo(3), Answer::Actor(Ok(view)))] => {
            assert!(
                matches!(
                    &view.state,
                    ActorState::Dead {
                        cause: DeathCause::RestartsExhausted {
                            last: Loss::NodeDied { node, .. },
                            ..
                        }
                    } if node == "w1"
                ),
                "{view:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(replies(&out).iter().all(|(to, _)| *to != ReplyTo(2)));
    // Capacity arrives: the group is placed and its waiter answered.
    let out = head.handle(node("w3", "CPU=2"), None, 3_100);
    match replies(&out).as_slice() {
        [(ReplyTo(2), Answer::GroupPlaced(Ok(nodes)))] => assert_eq!(nodes, &["w3"]),
        other => panic!("{other:?}"),
    }
    assert_eq!(head.parked(), 0);
}

#[test]
fn an_actor_that_keeps_exiting_is_restarted_until_its_budget_runs_out() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=1"), None, 0);
    let (id, _, first) = running(&mut head, spawn_with("CPU=1", 1), 0);
    let exit = |attempt| HeadRequest::Exited {
        actor: id,
        attempt,
        cause: Loss::Exited(format!("crash {attempt}")),
    };
    let out = head.handle(exit(first), None, 5);
    let again = starts(&out);
    assert_eq!(again.len(), 1, "one restart is within the budget: {out:?}");
    assert_eq!(again[0].attempt, first + 1);
    head.handle(
        HeadRequest::Started {
            actor: id,
            attempt: first + 1,
            outcome: Ok(()),
        },
        None,
        6,
    );
    let out = head.handle(exit(first + 1), None, 7);
    assert!(starts(&out).is_empty(), "the budget is spent: {out:?}");
    let out = head.handle(HeadRequest::WaitActor(id), Some(ReplyTo(9)), 8);
    match replies(&out).as_slice() {
        [(ReplyTo(9), Answer::Actor(Ok(view)))] => {
            assert!(
                matches!(
                    &view.state,
                    ActorState::Dead {
                        cause: DeathCause::RestartsExhausted {
                            last: Loss::Exited(crash),
                            max_restarts: 1,
                        }
                    } if *crash == format!("crash {}", first + 1)
                ),
                "{view:?}"
            );
            assert_eq!(view.restarts, 1);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_undeliverable_start_loses_the_node_and_spends_no_restart() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=1"), None, 0);
    let out = head.handle(spawn_with("CPU=1", 0), Some(ReplyTo(1)), 1);
    let first = starts(&out);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].node, "w1");
    head.handle(node("w2", "CPU=1"), None, 2);
    let out = head.handle(
        HeadRequest::Undelivered {
            actor: first[0].actor,
            attempt: first[0].attempt,
            cause: "node w1's agent is not reachable".into(),
        },
        None,
        3,
    );
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Notice(Notice::NodeDead { node, cause, .. }) if node == "w1" && cause.contains("not reachable"))),
        "{out:?}"
    );
    let again = starts(&out);
    assert_eq!(again.len(), 1, "placed again though its budget is 0: {out:?}");
    assert_eq!((again[0].node.as_str(), again[0].attempt), ("w2", first[0].attempt + 1));
    // A stale report changes nothing.
    let out = head.handle(
        HeadRequest::Undelivered {
            actor: first[0].actor,
            attempt: first[0].attempt,
            cause: "late".into(),
        },
        None,
        4,
    );
    assert!(
        starts(&out).is_empty() && !out.iter().any(|o| matches!(o, Output::Notice(_))),
        "{out:?}"
    );
}

#[test]
fn a_silent_node_is_declared_dead_on_a_tick_and_named_in_a_notice() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), None, 0);
    assert!(head
        .tick(2_999)
        .iter()
        .all(|o| !matches!(o, Output::Notice(Notice::NodeDead { .. }))));
    let out = head.tick(3_001);
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Notice(Notice::NodeDead { node, .. }) if node == "w1")),
        "{out:?}"
    );
}

#[test]
fn views_count_page_and_filter_the_cluster() {
    use crate::view::{ActorFilter, PageRequest};
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2,GPU=1"), None, 0);
    head.handle(node("w2", "CPU=2"), None, 0);
    let (gpu, on, _) = running(&mut head, spawn("GPU=1"), 10);
    assert_eq!(on, "w1");
    for _ in 0..3 {
        running(&mut head, spawn("CPU=1"), 10);
    }
    // One more CPU actor than there is room for waits.
    head.handle(spawn("CPU=2"), Some(ReplyTo(9)), 20);
    let View::Overview(overview) = head.view(ViewQuery::Overview, 1_000) else {
        panic!("overview")
    };
    assert_eq!((overview.nodes_alive, overview.nodes_dead), (2, 0));
    assert_eq!(overview.actors["alive"], 4);
    assert_eq!(overview.actors["pending"], 1);
    assert_eq!(overview.waiting, 1);
    let cpu = overview.resources.iter().find(|r| r.name == "CPU").unwrap();
    assert_eq!((cpu.total, cpu.used), (4.0, 3.0));
    let View::Nodes(nodes) = head.view(ViewQuery::Nodes(PageRequest::default()), 1_000) else {
        panic!("nodes")
    };
    assert_eq!(nodes.total, 2);
    assert_eq!(nodes.items.iter().map(|n| n.actors).sum::<usize>(), 4);
    assert_eq!(nodes.items[0].heartbeat_age_s, Some(1.0));
    let page = |filter: ActorFilter, offset, limit| match head.view(
        ViewQuery::Actors(filter, PageRequest::new(Some(offset), Some(limit)).unwrap()),
        1_000,
    ) {
        View::Actors(page) => page,
        _ => panic!("actors"),
    };
    let all = page(ActorFilter::default(), 1, 2);
    assert_eq!((all.total, all.items.len()), (5, 2));
    let waiting = page(
        ActorFilter {
            state: Some("pending".into()),
            ..Default::default()
        },
        0,
        10,
    );
    assert_eq!(waiting.total, 1);
    assert_eq!(waiting.items[0].waiting_s, Some(0.98));
    let on_w1 = page(
        ActorFilter {
            node: Some("w1".into()),
            ..Default::default()
        },
        0,
        10,
    );
    assert!(on_w1.items.iter().any(|a| a.id == gpu && a.gpu_ids == vec![0]));
    let View::Actor(Some(row)) = head.view(ViewQuery::Actor(gpu), 1_000) else {
        panic!("actor")
    };
    assert_eq!((row.state.as_str(), row.node.as_deref()), ("alive", Some("w1")));
    assert!(matches!(
        head.view(ViewQuery::Actor(ActorId(999)), 0),
        View::Actor(None)
    ));
}

#[test]
fn run_reports_are_kept_and_bad_ones_refused() {
    use crate::runs::RunPoint;
    let mut head = HeadCore::new(3_000, 10_000);
    let report = |run: &str, step| {
        HeadRequest::RunReport(RunPoint {
            run: run.into(),
            kind: "train".into(),
            job: None,
            step,
            values: [("loss".to_string(), 1.0 / step as f64)].into(),
            finished: false,
        })
    };
    head.handle(report("r", 1), None, 0);
    head.handle(report("r", 2), None, 500);
    let out = head.handle(report("", 3), Some(ReplyTo(1)), 600);
    assert!(matches!(&replies(&out)[0].1, Answer::Done(Err(Failure::Rejected(_)))));
    let View::Run(Some(run)) = head.view(ViewQuery::Run("r".into()), 1_000) else {
        panic!("run")
    };
    assert_eq!(run.points.len(), 2);
    assert_eq!(run.summary.last["loss"], 0.5);
    assert!(matches!(head.view(ViewQuery::Runs, 0), View::Runs(runs) if runs.len() == 1));
}

/// Writes the head down and reads it back as a restarted head would (bincode, as the
/// runtime stores it).
fn restart(head: &HeadCore, now: u64) -> HeadCore {
    let bytes = bincode::serialize(&head.snapshot(now)).unwrap();
    let saved: Saved = bincode::deserialize(&bytes).unwrap();
    assert_eq!(saved.saved_at_ms(), now);
    let mut head = HeadCore::restore(saved, 3_000, 10_000);
    head.await_rejoin(now);
    head
}

fn register_running(name: &str, resources: &str, running: Vec<RunningActor>) -> HeadRequest {
    match node(name, resources) {
        HeadRequest::Register(info, _) => HeadRequest::Register(info, running),
        other => other,
    }
}

fn registration(out: &[Output]) -> Registration {
    match replies(out).as_slice() {
        [(_, Answer::Registered(Ok(r)))] => r.clone(),
        other => panic!("expected one registration, got {other:?}"),
    }
}

fn up(actor: ActorId, attempt: u32) -> RunningActor {
    RunningActor {
        actor,
        attempt,
        up: true,
    }
}

#[test]
fn a_restored_head_takes_back_the_actors_its_nodes_report_and_restarts_only_the_missing() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), Some(ReplyTo(1)), 0);
    head.handle(node("w2", "CPU=2"), Some(ReplyTo(1)), 0);
    let mut named = match spawn_with("CPU=1", 2) {
        HeadRequest::Spawn(spec) => spec,
        _ => unreachable!(),
    };
    named.name = Some("svc".into());
    let (kept, kept_node, kept_attempt) = running(&mut head, HeadRequest::Spawn(named), 10);
    let (lost, lost_node, lost_attempt) = running(&mut head, spawn_with("CPU=1", 1), 10);
    let (killed, killed_node, killed_attempt) = running(&mut head, spawn("CPU=1"), 10);
    head.handle(HeadRequest::Kill(killed), None, 11);
    let before = head.status(20);

    let mut head = restart(&head, 1_000);
    // Same actors, ids, names and budgets; nothing placed or stopped on restoring.
    let after = head.status(1_000);
    assert_eq!(format!("{:?}", after.actors), format!("{:?}", before.actors));
    assert_eq!(head.scheduler().named("svc").map(|v| v.id), Some(kept));
    // Its nodes must register again (a heartbeat of the old incarnation is refused).
    let beat = head.handle(
        HeadRequest::Heartbeat {
            node: "w1".into(),
            incarnation: 1,
            removed_known: 0,
            trust: 0,
        },
        Some(ReplyTo(2)),
        1_001,
    );
    assert!(matches!(
        replies(&beat).as_slice(),
        [(
            _,
            Answer::Heartbeat(crate::Beat {
                known: false,
                removed: None,
                renew: false,
            })
        )]
    ));
    // Nothing is placed while a node is still to register.
    let out = head.handle(spawn("CPU=1"), Some(ReplyTo(3)), 1_002);
    let waiting = spawned(&out);
    assert!(starts(&out).is_empty(), "placed before the nodes came back: {out:?}");

    // Each node reports what it runs: the kept actor at its attempt, the killed one
    // (its stop was lost with the head), and not the one that went away.
    let mut all_starts = Vec::new();
    let mut stopped = Vec::new();
    for (i, name) in ["w1", "w2"].into_iter().enumerate() {
        let mut report = Vec::new();
        if name == kept_node {
            report.push(up(kept, kept_attempt));
        }
        if name == killed_node {
            report.push(up(killed, killed_attempt));
        }
        let out = head.handle(
            register_running(name, "CPU=2", report),
            Some(ReplyTo(10 + i as u64)),
            1_010,
        );
        stopped.extend(registration(&out).stop);
        all_starts.extend(starts(&out));
    }
    let _ = (lost_node, lost_attempt);
    assert!(stopped.contains(&killed), "the killed actor is stopped: {stopped:?}");
    assert!(!stopped.contains(&kept));
    let kept_view = head.scheduler().actor_view(kept).unwrap();
    assert_eq!((kept_view.state, kept_view.restarts), (ActorState::Alive, 0));
    // The actor its node no longer ran restarts within its budget; the waiting spawn
    // is placed now that every node is back.
    let lost_view = head.scheduler().actor_view(lost).unwrap();
    assert_eq!(lost_view.restarts, 1, "{lost_view:?}");
    let placed: Vec<ActorId> = all_starts.iter().map(|s| s.actor).collect();
    assert!(placed.contains(&lost) && placed.contains(&waiting), "{placed:?}");
    assert!(!placed.contains(&kept));
    assert!(matches!(
        head.scheduler().actor_view(killed).unwrap().state,
        ActorState::Dead { .. }
    ));
}

#[test]
fn a_node_that_does_not_come_back_after_a_head_restart_is_declared_dead_and_placing_resumes() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), Some(ReplyTo(1)), 0);
    head.handle(node("w2", "CPU=2"), Some(ReplyTo(1)), 0);
    let mut head = restart(&head, 100);
    let states = |head: &HeadCore| -> Vec<String> { head.status(0).nodes.into_iter().map(|n| n.state).collect() };
    assert_eq!(states(&head), ["rejoining", "rejoining"]);
    let out = head.handle(register_running("w1", "CPU=2", Vec::new()), Some(ReplyTo(2)), 200);
    assert!(registration(&out).stop.is_empty());
    assert_eq!(states(&head), ["alive", "rejoining"]);
    let out = head.handle(spawn("CPU=1"), Some(ReplyTo(3)), 300);
    let id = spawned(&out);
    assert!(starts(&out).is_empty(), "w2 has not come back yet");
    assert!(head
        .tick(3_000)
        .iter()
        .all(|o| !matches!(o, Output::Notice(Notice::NodeDead { .. }))));
    let out = head.tick(3_200);
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Notice(Notice::NodeDead { node, .. }) if node == "w2")));
    let placed = starts(&out);
    assert_eq!(
        placed.iter().map(|s| (s.actor, s.node.as_str())).collect::<Vec<_>>(),
        vec![(id, "w1")]
    );
}

#[test]
fn a_worker_that_restarted_under_its_name_reports_nothing_and_a_stale_one_is_told_to_stop_everything() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), Some(ReplyTo(1)), 0);
    let (id, _, attempt) = running(&mut head, spawn_with("CPU=1", 1), 0);
    // A new process of w1: the actor is lost and placed again on it.
    let out = head.handle(register_running("w1", "CPU=2", Vec::new()), Some(ReplyTo(2)), 10);
    assert!(registration(&out).stop.is_empty());
    let again = starts(&out);
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].actor, again[0].attempt), (id, attempt + 1));
    // A node the head declared dead comes back reporting the old attempt: stopped.
    head.tick(5_000);
    let out = head.handle(
        register_running("w1", "CPU=2", vec![up(id, attempt + 1)]),
        Some(ReplyTo(3)),
        5_001,
    );
    assert_eq!(registration(&out).stop, vec![id]);
}

#[test]
fn objects_survive_a_head_restart_except_those_only_the_old_head_held() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=2"), Some(ReplyTo(1)), 0);
    let put = |id: ObjectId, node: &str| HeadRequest::ObjectPut {
        id,
        size: 1_024,
        checksum: 7,
        node: node.into(),
        address: format!("{node}:2"),
        job: None,
    };
    let (kept, with_head) = (ObjectId::random(), ObjectId::random());
    head.handle(put(kept, "w1"), None, 5);
    head.handle(put(with_head, "head"), None, 5);
    let mut head = restart(&head, 50);
    assert_eq!(head.objects_lost_with("head", 51), 1);
    let located = |head: &mut HeadCore, id| head.handle(HeadRequest::ObjectLocate(id), Some(ReplyTo(9)), 60);
    assert!(matches!(
        replies(&located(&mut head, kept)).as_slice(),
        [(_, Answer::Location(Ok(l)))] if l.size == 1_024
    ));
    assert!(matches!(
        replies(&located(&mut head, with_head)).as_slice(),
        [(_, Answer::Location(Err(Failure::ObjectMissing { lost_with: Some(n), .. })))] if n == "head"
    ));
}

/// A head's decisions, for comparing two heads: the scheduler's form (ordered maps
/// only, so equal states encode equally) without the heartbeat times, which are not
/// logged, then the status and every object's location, one line each.
fn fingerprint(head: &HeadCore, objects: &[ObjectId], now: u64) -> Vec<String> {
    let mut scheduler: Scheduler = bincode::deserialize(&bincode::serialize(head.scheduler()).unwrap()).unwrap();
    scheduler.forget_heartbeats();
    let status = head.status(now);
    let mut lines = vec![format!("{:?}", bincode::serialize(&scheduler).unwrap())];
    lines.extend(status.nodes.iter().map(|n| format!("{n:?}")));
    lines.extend(status.actors.iter().map(|a| format!("{a:?}")));
    lines.extend(status.groups.iter().map(|g| format!("{g:?}")));
    lines.push(format!("{:?}", status.objects));
    lines.extend(
        objects
            .iter()
            .map(|id| format!("{id:?} {:?}", head.directory.locate(*id))),
    );
    lines
}

fn assert_same(left: &[String], right: &[String], what: &str) {
    for (l, r) in left.iter().zip(right) {
        assert!(
            l == r,
            "{what}:\n{}\n{}",
            &l[..l.len().min(600)],
            &r[..r.len().min(600)]
        );
    }
    assert_eq!(left.len(), right.len(), "{what}");
}

/// A change written in its borrowed form and read back.
fn read_back(change: &ChangeRef<'_>) -> Change {
    bincode::deserialize(&bincode::serialize(change).unwrap()).unwrap()
}

/// Random histories of requests and ticks, logged as the runtime logs them: a head
/// restored from a snapshot taken part-way and replaying the changes logged after it
/// decides exactly as the head that ran them.
#[test]
fn a_snapshot_and_the_changes_after_it_replay_to_the_same_head() {
    for seed in 1..=16u64 {
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut head = HeadCore::new(300, 200);
        let mut log: Vec<Change> = Vec::new();
        let mut snapshot: Option<(Vec<u8>, usize)> = None;
        let mut objects: Vec<ObjectId> = Vec::new();
        let mut groups: Vec<GroupId> = Vec::new();
        let mut starts_seen: Vec<crate::protocol::StartActor> = Vec::new();
        let mut beating: Vec<(String, u64)> = Vec::new();
        let mut future: Option<ObjectId> = None;
        for step in 0..400u64 {
            let now = step * 7;
            let request = match next(15) {
                0 => {
                    let name = format!("w{}", next(4));
                    register_running(&name, "CPU=4,GPU=1", Vec::new())
                }
                1..=3 => {
                    let mut spec = match spawn_with(["CPU=1", "GPU=1", "CPU=0.5"][next(3) as usize], next(3) as u32) {
                        HeadRequest::Spawn(spec) => spec,
                        _ => unreachable!(),
                    };
                    if next(5) == 0 {
                        spec.name = Some(format!("n{}", next(4)));
                    }
                    if next(4) == 0 && !groups.is_empty() {
                        spec.placement = Some(crate::protocol::BundleRef {
                            group: groups[next(groups.len() as u64) as usize],
                            bundle: None,
                        });
                        spec.resources = crate::resources::Resources::parse_request("CPU=0.5").unwrap();
                    }
                    HeadRequest::Spawn(spec)
                }
                4 | 5 if !starts_seen.is_empty() => {
                    let start = starts_seen.remove(next(starts_seen.len() as u64) as usize);
                    let outcome = if next(6) == 0 {
                        Err(StartFailure::new("boom"))
                    } else {
                        Ok(())
                    };
                    HeadRequest::Started {
                        actor: start.actor,
                        attempt: start.attempt,
                        outcome,
                    }
                }
                6 => HeadRequest::Exited {
                    actor: ActorId(1 + next(20)),
                    attempt: 1 + next(2) as u32,
                    cause: Loss::Exited("panicked".into()),
                },
                7 => HeadRequest::Kill(ActorId(1 + next(20))),
                8 => HeadRequest::CreateGroup(crate::protocol::GroupSpec {
                    bundles: vec![crate::resources::Resources::parse_request("CPU=1").unwrap(); 1 + next(2) as usize],
                    strategy: Strategy::Spread,
                    name: None,
                }),
                9 if !groups.is_empty() => {
                    HeadRequest::RemoveGroup(groups.swap_remove(next(groups.len() as u64) as usize))
                }
                13 => {
                    // A reference that overtakes its object's registration.
                    let id = *future.get_or_insert_with(ObjectId::random);
                    HeadRequest::ObjectAddRef {
                        id,
                        holder: "client-2".into(),
                    }
                }
                10 => {
                    let id = future.take().unwrap_or_else(ObjectId::random);
                    objects.push(id);
                    HeadRequest::ObjectPut {
                        id,
                        size: 10,
                        checksum: 1,
                        node: format!("w{}", next(4)),
                        address: "a:1".into(),
                        job: None,
                    }
                }
                11 if !objects.is_empty() => HeadRequest::ObjectDropRef {
                    id: objects[next(objects.len() as u64) as usize],
                    holder: format!("w{}", next(4)),
                },
                12 if !objects.is_empty() => HeadRequest::ObjectAddRef {
                    id: objects[next(objects.len() as u64) as usize],
                    holder: "client-1".into(),
                },
                _ => HeadRequest::Status,
            };
            let to = (next(3) != 0).then_some(ReplyTo(step));
            // Logged as the runtime logs it: the borrowed form, read back as a Change.
            log.extend(ChangeRef::of(&request, to, now).map(|c| read_back(&c)));
            let out = head.handle(request, to, now);
            for (_, answer) in replies(&out) {
                match answer {
                    Answer::GroupCreated(Ok(id)) => groups.push(id),
                    Answer::Registered(Ok(r)) => {
                        assert!(r.stop.is_empty());
                    }
                    _ => {}
                }
            }
            starts_seen.extend(starts(&out));
            // Some nodes keep beating, the others go silent and are declared dead.
            for (name, incarnation) in &beating {
                head.handle(
                    HeadRequest::Heartbeat {
                        node: name.clone(),
                        incarnation: *incarnation,
                        removed_known: 0,
                        trust: 0,
                    },
                    None,
                    now,
                );
            }
            if let Some(n) = head.scheduler().status(now).nodes.iter().find(|n| n.state == "alive") {
                if next(3) == 0 && !beating.iter().any(|(b, _)| *b == n.name) {
                    if let Some(inc) = head.scheduler().incarnation_of(&n.name) {
                        beating.push((n.name.clone(), inc));
                    }
                }
            }
            if next(4) == 0 {
                let (out, change) = head.tick_logged(now + 3);
                starts_seen.extend(starts(&out));
                log.extend(change.map(|c| read_back(&c.as_ref())));
            }
            if snapshot.is_none() && step == 150 + seed * 5 {
                snapshot = Some((bincode::serialize(&head.snapshot(now)).unwrap(), log.len()));
            }
        }
        let now = 400 * 7;
        let (bytes, from) = snapshot.expect("a snapshot was taken");
        let mut replayed = HeadCore::restore(bincode::deserialize(&bytes).unwrap(), 300, 200);
        for change in log[from..].iter().cloned() {
            replayed.replay(change);
        }
        let live = fingerprint(&head, &objects, now);
        assert_same(
            &fingerprint(&replayed, &objects, now),
            &live,
            &format!("seed {seed}: replayed after the snapshot"),
        );
        // Replaying from the very start gives the same head too.
        let mut from_scratch = HeadCore::new(300, 200);
        for change in log.iter().cloned() {
            from_scratch.replay(change);
        }
        assert_same(
            &fingerprint(&from_scratch, &objects, now),
            &live,
            &format!("seed {seed}: replayed from the start"),
        );
    }
}

#[test]
fn a_removed_node_is_dead_at_once_its_actors_move_and_its_name_is_refused_for_good() {
    let mut head = HeadCore::new(3_000, 10_000);
    head.handle(node("w1", "CPU=1"), Some(ReplyTo(0)), 0);
    head.handle(node("w2", "CPU=1"), Some(ReplyTo(0)), 0);
    let (id, on, _) = running(&mut head, spawn_with("CPU=1", 1), 1);
    let other = if on == "w1" { "w2" } else { "w1" };
    let out = head.handle(HeadRequest::RemoveNode(on.clone()), Some(ReplyTo(1)), 5);
    assert!(
        matches!(replies(&out).as_slice(), [(_, Answer::Removed(true))]),
        "{out:?}"
    );
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Notice(Notice::NodeDead { node, cause, .. }) if *node == on && cause.contains("removed"))),
        "{out:?}"
    );
    // Its actor restarts on the other node at once (its budget allows one restart).
    let moved = starts(&out);
    assert_eq!(
        moved.iter().map(|s| (s.actor, s.node.as_str())).collect::<Vec<_>>(),
        [(id, other)]
    );
    // Its heartbeats are not known, and its name cannot register again.
    let beat = head.handle(
        HeadRequest::Heartbeat {
            node: on.clone(),
            incarnation: 1,
            removed_known: 0,
            trust: 0,
        },
        Some(ReplyTo(2)),
        6,
    );
    // The answer names the removed node to whoever knows fewer removals, and nothing to
    // one that knows them all.
    assert!(
        matches!(replies(&beat).as_slice(), [(_, Answer::Heartbeat(crate::Beat { known: false, removed: Some(names), .. }))] if names == &[on.clone()]),
        "{beat:?}"
    );
    let up_to_date = head.handle(
        HeadRequest::Heartbeat {
            node: on.clone(),
            incarnation: 1,
            removed_known: 1,
            trust: 0,
        },
        Some(ReplyTo(9)),
        6,
    );
    assert!(matches!(
        replies(&up_to_date).as_slice(),
        [(_, Answer::Heartbeat(crate::Beat { removed: None, .. }))]
    ));
    let again = head.handle(node(&on, "CPU=1"), Some(ReplyTo(3)), 7);
    assert!(
        matches!(replies(&again).as_slice(), [(_, Answer::Registered(Err(Failure::Rejected(why))))] if why.contains("removed")),
        "{again:?}"
    );
    // A node trusting other authorities than the head (a rotation) is asked to renew,
    // once the head has been told its own; a node trusting the same ones is not.
    let beat_with = |head: &mut HeadCore, trust: u64| {
        let out = head.handle(
            HeadRequest::Heartbeat {
                node: "w1".into(),
                incarnation: 1,
                removed_known: 1,
                trust,
            },
            Some(ReplyTo(10)),
            6,
        );
        match replies(&out).as_slice() {
            [(_, Answer::Heartbeat(beat))] => beat.renew,
            other => panic!("{other:?}"),
        }
    };
    assert!(!beat_with(&mut head, 7), "not told its own yet");
    head.handle(HeadRequest::Trust(7), Some(ReplyTo(11)), 6);
    assert!(!beat_with(&mut head, 7));
    head.handle(HeadRequest::Trust(8), Some(ReplyTo(12)), 6);
    assert!(beat_with(&mut head, 7), "the head moved on");
    // An unknown name is refused ahead of time, and said to be unknown.
    let out = head.handle(HeadRequest::RemoveNode("w9".into()), Some(ReplyTo(4)), 8);
    assert!(matches!(replies(&out).as_slice(), [(_, Answer::Removed(false))]));
    // Kept across a restart of the head.
    let restored = restart(&head, 20);
    let removed: Vec<&str> = restored.scheduler().removed_nodes().collect();
    assert_eq!(removed, {
        let mut want = vec![on.as_str(), "w9"];
        want.sort();
        want
    });
}
