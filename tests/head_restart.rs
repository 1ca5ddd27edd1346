//! The control plane survives its head: a head killed with SIGKILL and started again on
//! its state directory takes back every node, actor, placement group, object and running
//! job, while calls to actors, a ZeRO-2 training and the job's driver go on during the
//! outage; a state file it cannot use stops it with the reason.

mod support;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use regatta::kinds::{digest, pattern, Counter, CounterOp, CounterReply, Store, StoreOp, StoreReply};
use regatta::{ActorId, ActorOptions, ActorState, JobClient, JobStatus, JobSubmission, Resources, Strategy};
use regatta_trainer::{TrainConfig, TrainEvent, TrainerGroup, ZeroStage};
use support::{eventually, temp_dir, ticks, TestCluster};

fn req(text: &str) -> Resources {
    Resources::parse_request(text).expect("resources")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_killed_mid_training_and_mid_job_takes_back_100_actors_the_group_objects_job_and_training() {
    let mut cluster = TestCluster::start(&[("w1", "CPU=8"), ("w2", "CPU=8"), ("w3", "CPU=8")]).await;
    let client = &cluster.client;
    let dir = temp_dir("head-restart-training");

    // Objects of 1 KB and 64 MB held by a store actor on a worker. (A put registers
    // with the head without waiting; the spawns after it are acknowledged only once a
    // state that includes it is on disk.)
    let store = client
        .spawn::<Store>((), ActorOptions::new().resources(req("CPU=0.1")))
        .await
        .expect("store");
    let mut objects = Vec::new();
    for (size, seed) in [(1_024u64, 7u64), (64 << 20, 8)] {
        match store.call(StoreOp::Put { size, seed, keep: true }).await.expect("put") {
            StoreReply::Put { reference, digest } => objects.push((reference, size, digest)),
            other => panic!("{other:?}"),
        }
    }
    // One bundle per node, and a counter in each bundle.
    let group = client
        .create_placement_group(vec![req("CPU=1"); 3], Strategy::StrictSpread)
        .await
        .expect("group");
    let group_nodes = group.ready(Duration::from_secs(20)).await.expect("group placed");
    let mut counters = Vec::new();
    for bundle in 0..3 {
        let options = ActorOptions::new()
            .resources(req("CPU=0.1"))
            .in_group(&group, Some(bundle));
        counters.push(
            client
                .spawn::<Counter>(1_000 * bundle as i64, options)
                .await
                .expect("spawn in group"),
        );
    }
    // Free counters, some named, each with a restart budget it must not spend: with the
    // store, the group's counters and the 2 trainer ranks, 100 actors.
    let mut names = BTreeMap::new();
    for i in 0..94i64 {
        let mut options = ActorOptions::new().resources(req("CPU=0.1")).max_restarts(3);
        if i % 4 == 0 {
            let name = format!("counter-{i}");
            options = options.name(name.clone());
            names.insert(name, counters.len());
        }
        counters.push(client.spawn::<Counter>(i, options).await.expect("spawn"));
    }
    let mut totals = Vec::new();
    for counter in &counters {
        match counter.call(CounterOp::Add(1)).await.expect("call before") {
            CounterReply::Total(total) => totals.push(total),
            other => panic!("{other:?}"),
        }
    }
    // A job that counts one line every 50 ms until it is stopped.
    let jobs = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("job client");
    let job = jobs
        .submit(&JobSubmission {
            entrypoint: "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.05; done".into(),
            ..Default::default()
        })
        .await
        .expect("submit");
    let driver = eventually("the job's driver to run", Duration::from_secs(15), || async {
        let record = jobs.status(&job).await.ok()?;
        (record.status == JobStatus::Running).then_some(record.driver?)
    })
    .await;
    // A ZeRO-2 training on 2 ranks, long enough to step through the outage and the checks.
    let (steps_tx, mut steps) = tokio::sync::watch::channel(0u64);
    let training = {
        let handle = client.cluster().clone();
        let config = training_config(&dir);
        tokio::spawn(async move {
            let mut events = Vec::new();
            let summary = TrainerGroup::new(handle, config)
                .expect("config")
                .run(|event| {
                    if let TrainEvent::Step(step) = event {
                        steps_tx.send_replace(step.step);
                    }
                    events.push(event.clone());
                })
                .await;
            (summary, events)
        })
    };

    eventually("the training to step", Duration::from_secs(60), || async {
        (*steps.borrow() >= 3).then_some(())
    })
    .await;
    assert!(
        !training.is_finished(),
        "the training must still run when the head is killed"
    );

    let before = client.status().await.expect("status before");
    assert_eq!(before.actors.len(), 100, "{:?}", before.actors);
    let places: BTreeMap<ActorId, Option<String>> =
        before.actors.iter().map(|a| (a.view.id, a.view.node.clone())).collect();
    // What the head was asked for each actor: kind, name, resources and GPUs.
    let asked = |line: &regatta::ActorLine| {
        format!(
            "{} {:?} {:?} {:?}",
            line.view.kind, line.name, line.resources, line.gpu_ids
        )
    };
    let asked_before: BTreeMap<ActorId, String> = before.actors.iter().map(|a| (a.view.id, asked(a))).collect();

    cluster.local.kill_head().expect("kill the head");
    let step_at_kill = *steps.borrow_and_update();
    let killed_at = std::time::Instant::now();
    // Calls between the client and actors do not pass through the head.
    for (counter, total) in counters.iter().zip(totals.iter_mut()) {
        match counter
            .call(CounterOp::Add(1))
            .await
            .expect("a call while the head is down")
        {
            CounterReply::Total(now) => {
                assert_eq!(now, *total + 1);
                *total = now;
            }
            other => panic!("{other:?}"),
        }
    }
    // Requests that need the head wait for it within their timeout: a spawn and a named
    // lookup made during the outage complete once it is back. (Made half a second into the
    // outage: a spawn written into the session the kill is closing may have reached the
    // head, and is not sent twice.)
    tokio::time::sleep(Duration::from_millis(500).saturating_sub(killed_at.elapsed())).await;
    let (spawn_client, lookup_client) = (client.cluster().clone(), client.cluster().clone());
    let spawned_in_outage = tokio::spawn(async move {
        spawn_client
            .spawn::<Counter>(40, ActorOptions::new().resources(req("CPU=0.1")))
            .await
    });
    let (first_name, first_index) = names
        .iter()
        .next()
        .map(|(name, index)| (name.clone(), *index))
        .expect("named counters");
    let looked_up_in_outage = tokio::spawn(async move { lookup_client.named::<Counter>(&first_name).await });
    // An outage of at least 3 s: the training steps on and the job's log grows.
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(killed_at.elapsed())).await;
    assert!(
        !spawned_in_outage.is_finished() && !looked_up_in_outage.is_finished(),
        "a spawn and a lookup cannot complete without the head"
    );
    let step_at_restart = *steps.borrow();
    let ticks_in_outage = ticks(&std::fs::read_to_string(cluster.local.job_log(&job)).expect("the job's log file"));
    cluster.local.start_head_again().expect("start the head again");

    let restarted_log = rejoined(&cluster, 3).await;
    assert!(
        restarted_log.contains("took the cluster's state back"),
        "{restarted_log}"
    );
    assert_eq!(restarted_log.matches("stopped=0").count(), 3, "{restarted_log}");
    let client = &cluster.client;
    let in_outage = spawned_in_outage
        .await
        .expect("the spawn task")
        .expect("a spawn made while the head was down completes once it is back");
    assert_eq!(
        in_outage
            .call(CounterOp::Add(2))
            .await
            .expect("call the actor spawned in the outage"),
        CounterReply::Total(42)
    );
    let looked_up = looked_up_in_outage
        .await
        .expect("the lookup task")
        .expect("a lookup made while the head was down completes once it is back")
        .expect("the name resolves");
    assert_eq!(looked_up.id(), counters[first_index].id());
    let mut after = client.status().await.expect("status after");
    after.actors.retain(|line| line.view.id != in_outage.id());
    assert!(
        !training.is_finished() && *steps.borrow() < TRAINING_STEPS,
        "the training ended before the restarted head was checked: make it longer"
    );
    // Every actor is still there: same id, same node, alive, no restart spent.
    assert_eq!(after.actors.len(), before.actors.len(), "{after:?}");
    for line in &after.actors {
        let view = &line.view;
        assert_eq!(view.state, ActorState::Alive, "{view:?}");
        assert_eq!(view.restarts, 0, "actor {} was started again: {view:?}", view.id);
        assert_eq!(places.get(&view.id), Some(&view.node), "actor {} moved", view.id);
        assert_eq!(
            asked_before.get(&view.id),
            Some(&asked(line)),
            "actor {} changed",
            view.id
        );
    }
    // Each actor kept its state: the totals go on from where the outage left them.
    for (counter, total) in counters.iter().zip(&totals) {
        assert_eq!(
            counter.call(CounterOp::Get).await.expect("call after"),
            CounterReply::Total(*total)
        );
    }
    for (name, index) in &names {
        let found = client
            .named::<Counter>(name)
            .await
            .expect("named lookup")
            .expect("still named");
        assert_eq!(found.id(), counters[*index].id());
    }
    assert_eq!(group.ready(Duration::from_secs(10)).await.expect("group"), group_nodes);
    for (reference, size, expected) in &objects {
        let bytes = client.get_bytes(reference).await.expect("object after the restart");
        assert_eq!(bytes.len() as u64, *size);
        assert_eq!(digest(&bytes), *expected);
        assert_eq!(
            digest(&pattern(*size as usize, if *size == 1_024 { 7 } else { 8 })),
            *expected
        );
    }
    // The restarted head places new work, and no worker stopped an actor.
    let fresh = client
        .spawn::<Counter>(5, ActorOptions::new().resources(req("CPU=0.1")))
        .await
        .expect("spawn after the restart");
    assert_eq!(
        fresh.call(CounterOp::Add(1)).await.expect("call"),
        CounterReply::Total(6)
    );
    for worker in ["w1", "w2", "w3"] {
        let log = cluster.local.log(worker);
        assert!(!log.contains("stopped: the head did not want it"), "{worker}: {log}");
        assert!(!log.contains("stopping them"), "{worker}: {log}");
    }

    // The job ran on through the outage under the same driver, with no line lost, and
    // the restarted head stops it.
    let record = jobs.status(&job).await.expect("the job after the restart");
    assert_eq!(record.status, JobStatus::Running, "{record:?}");
    assert_eq!(record.driver, Some(driver), "the same driver process");
    let logged = ticks(&jobs.logs(&job).await.expect("logs")).len();
    assert!(
        logged >= ticks_in_outage.len() && ticks_in_outage.len() > 40,
        "{} then {logged}",
        ticks_in_outage.len()
    );
    assert!(jobs.stop(&job).await.expect("stop"), "the job was running");
    let record = jobs.wait(&job, Duration::from_millis(50)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Stopped, "{record:?}");

    // The training stepped through the outage and finished in its first attempt.
    assert!(
        step_at_restart > step_at_kill,
        "no step between {step_at_kill} and the restart"
    );
    let (summary, events) = training.await.expect("the training task");
    let summary = summary.expect("the training finishes");
    assert_eq!(summary.failures, 0, "{events:?}");
    assert_eq!(summary.losses.len() as u64, TRAINING_STEPS);
    assert!(summary.losses.values().all(|l| l.is_finite()), "{:?}", summary.losses);
    let attempts = events
        .iter()
        .filter(|e| matches!(e, TrainEvent::Started { .. }))
        .count();
    assert_eq!(attempts, 1, "no restart from a checkpoint: {events:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// 20 s of training on an idle 2-core machine (150 steps/s), 70 s beside a CPU hog: it
/// must still run when the restarted head is checked, 5 s after the kill.
const TRAINING_STEPS: u64 = 3_000;

fn training_config(dir: &std::path::Path) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.data.path = format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"));
    config.world_size = 2;
    config.zero_stage = ZeroStage::Two;
    config.steps = TRAINING_STEPS;
    config.micro_batch_size = 2;
    config.checkpoint.dir = dir.join("checkpoints").to_string_lossy().into_owned();
    config.checkpoint.interval = 500;
    config.stall_timeout_secs = 60;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_whose_registration_died_with_the_head_is_found_through_the_restarted_head() {
    let mut cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let store = cluster
        .client
        .spawn::<Store>((), ActorOptions::new().resources(req("CPU=0.1")))
        .await
        .expect("store");
    // The head is frozen, so the put's registration (sent, not awaited) waits unread in
    // its socket and dies with it: only the client's report after it joins again tells
    // the new head where the object is.
    let head = cluster.local.pids()[0].to_string();
    signal("STOP", &head);
    let reference = cluster
        .client
        .put_bytes(pattern(4_096, 9))
        .await
        .expect("the put is sent to the frozen head");
    cluster.local.kill_head().expect("kill the head");
    cluster.local.start_head_again().expect("start the head again");
    rejoined(&cluster, 1).await;
    match store
        .call(StoreOp::Get(reference))
        .await
        .expect("a worker gets the object")
    {
        StoreReply::Got { digest: got, .. } => assert_eq!(got, digest(&pattern(4_096, 9))),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_killed_while_its_worker_was_away_is_stopped_when_the_worker_registers_again() {
    // The head's word holds for what was asked: a kill the restored head took while the
    // node had not come back is carried out when the node registers with its actors.
    let mut options =
        regatta::local::LocalOptions::new(vec![regatta::local::WorkerSpec::new("w1", "CPU=4")]).expect("options");
    options.binary = std::path::PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
    // Long enough that the paused worker is not declared dead meanwhile.
    options.heartbeat_timeout_ms = 20_000;
    let local = regatta::local::LocalCluster::start(options).expect("start");
    let client = local.connect(Duration::from_secs(30)).await.expect("connect");
    let mut cluster = TestCluster { local, client };
    let keep = cluster
        .client
        .spawn::<Counter>(1, ActorOptions::new().resources(req("CPU=1")))
        .await
        .expect("spawn");
    let doomed = cluster
        .client
        .spawn::<Counter>(2, ActorOptions::new().resources(req("CPU=1")))
        .await
        .expect("spawn");
    // Both run on the worker before the head goes: a spawn answers once the actor is
    // placed, and on a loaded machine its start could still be on the way.
    for (counter, total) in [(&keep, 1), (&doomed, 2)] {
        assert_eq!(
            counter.call(CounterOp::Get).await.expect("started"),
            CounterReply::Total(total)
        );
    }
    let worker = cluster.local.worker_pid(0).expect("worker pid").to_string();
    cluster.local.kill_head().expect("kill");
    signal("STOP", &worker);
    cluster.local.start_head_again().expect("start again");
    // Taken by the restored head while the worker cannot hear of it.
    let killed = doomed.kill().await;
    signal("CONT", &worker);
    killed.expect("kill after the restart");
    // The node's own log of the actor says why it stopped (read through the head's API).
    let (base, id) = (cluster.local.job_address.clone(), doomed.id().0);
    let bearer = format!("Authorization: Bearer {}", cluster.local.token);
    let lines = support::eventually("the killed actor stopped on its node", Duration::from_secs(30), || {
        let (base, bearer) = (base.clone(), bearer.clone());
        async move {
            let text = get_with(&base, &format!("/api/actors/{id}/logs"), &bearer);
            text.contains("the head did not want it running").then_some(text)
        }
    })
    .await;
    assert!(lines.contains("alive"), "{lines}");
    let log = cluster.local.log("w1");
    assert!(log.contains("stopping them") && log.contains("stopped=1"), "{log}");
    let err = doomed
        .call(CounterOp::Get)
        .await
        .expect_err("a killed actor answers nothing");
    assert!(matches!(err, regatta::Error::ActorDead { .. }), "{err}");
    assert_eq!(
        keep.call(CounterOp::Add(1)).await.expect("kept"),
        CounterReply::Total(2)
    );
    let view = cluster
        .client
        .actor_view(keep.id(), Duration::from_secs(5))
        .await
        .expect("view");
    assert_eq!((view.state, view.restarts), (ActorState::Alive, 0));
}

/// A GET with one extra header; the body, or nothing when the head does not answer.
fn get_with(base: &str, path: &str, header: &str) -> String {
    let host = support::host_of(base);
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{header}\r\nConnection: close\r\n\r\n");
    support::exchange(base, request.as_bytes())
}

fn signal(name: &str, pid: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), pid])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{name} {pid}");
}

/// Waits until the restarted head logged every worker registering again; returns its log.
async fn rejoined(cluster: &TestCluster, workers: usize) -> String {
    let path = cluster.local.log_path("head").with_file_name("head-restarted.log");
    support::eventually(
        "every worker registered with the restarted head",
        Duration::from_secs(30),
        || {
            let path = path.clone();
            async move {
                let log = std::fs::read_to_string(&path).unwrap_or_default();
                (log.matches("node joined").count() >= workers).then_some(log)
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_under_its_name_is_taken_back_empty_and_its_objects_read_as_lost() {
    // The worker's word holds for what it runs and holds: a new process under the same
    // name runs nothing and holds nothing, so its actor restarts within its budget (on it)
    // and the object whose only copy it had is lost, naming it.
    let mut cluster = TestCluster::start(&[("w1", "CPU=4")]).await;
    let store = cluster
        .client
        .spawn::<Store>((), ActorOptions::new().resources(req("CPU=1")).max_restarts(1))
        .await
        .expect("store");
    let reference = match store
        .call(StoreOp::Put {
            size: 4_096,
            seed: 3,
            keep: true,
        })
        .await
        .expect("put")
    {
        StoreReply::Put { reference, .. } => reference,
        other => panic!("{other:?}"),
    };
    // The put's registration reaches the head by a cast: wait until the head has it, so
    // that the restart below does not cut it off.
    let (ready, _) = cluster
        .client
        .wait(std::slice::from_ref(&reference), 1, Duration::from_secs(10))
        .await
        .expect("wait");
    assert_eq!(ready.len(), 1, "the put never reached the head");
    cluster.local.restart_worker(0).expect("restart w1");
    let log = rejoined_worker(&cluster).await;
    assert!(log.contains("registered with the head"), "{log}");
    let err = support::eventually("the object reads as lost", Duration::from_secs(30), || {
        let (client, reference) = (&cluster.client, &reference);
        async move {
            client
                .get_bytes(reference)
                .await
                .err()
                .filter(|e| matches!(e, regatta::Error::ObjectLost { .. }))
        }
    })
    .await;
    assert!(err.to_string().contains("w1"), "{err}");
    let view = support::eventually("the store actor restarted", Duration::from_secs(30), || {
        let (client, id) = (&cluster.client, store.id());
        async move {
            let view = client.actor_view(id, Duration::from_secs(5)).await.ok()?;
            (view.state == ActorState::Alive && view.restarts == 1).then_some(view)
        }
    })
    .await;
    assert_eq!(view.node.as_deref(), Some("w1"));
}

/// Waits until the restarted worker (its log starts afresh) registered; returns its log.
async fn rejoined_worker(cluster: &TestCluster) -> String {
    support::eventually("the restarted worker registered", Duration::from_secs(30), || async {
        let log = cluster.local.log("w1");
        log.contains("registered with the head").then_some(log)
    })
    .await
}

#[test]
fn a_head_refuses_a_state_file_it_cannot_use_and_says_why() {
    let dir = support::temp_dir("bad-head-state");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("cluster.state"),
        b"REGATTA-HEAD-STATE\x01\x00\x00\x00truncated",
    )
    .expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args([
            "head",
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--no-job-api",
        ])
        .arg("--state-dir")
        .arg(&dir)
        .env("REGATTA_TOKEN", "statet.0123456789abcdef0123456789abcdef")
        .output()
        .expect("run the head");
    let text = String::from_utf8_lossy(&output.stderr).to_string() + &String::from_utf8_lossy(&output.stdout);
    assert!(
        !output.status.success(),
        "the head started on a broken state file: {text}"
    );
    assert!(
        text.contains("cluster.state") && text.contains("move it aside"),
        "{text}"
    );
    // The file is left as it was for the operator to look at.
    assert!(std::fs::read(dir.join("cluster.state"))
        .expect("kept")
        .ends_with(b"truncated"));
    let _ = std::fs::remove_dir_all(dir);
}

/// A tmpfs of a given size mounted on a folder for a test's life (lazily unmounted when
/// dropped): a disk that fills up for real.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: &std::path::Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).expect("mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "this test mounts a small tmpfs for the head's state: it needs root (CI has it)"
        );
        Self(dir.to_path_buf())
    }

    /// Writes a file until the disk has no room left; returns the file.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let path = self.0.join("filler");
        let mut file = std::fs::File::create(&path).expect("filler");
        let chunk = vec![0xa5u8; 64 << 10];
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(28), "{e} (not ENOSPC)");
                    break;
                }
            }
        }
        // The last partial blocks too.
        while file.write(&[0]).is_ok_and(|n| n == 1) {}
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_holds_the_heads_answers_and_loses_no_acknowledged_change_across_a_restart() {
    use regatta::local::{LocalCluster, LocalOptions, WorkerSpec};
    let dir = temp_dir("head-disk-full");
    // The head's state (authority, tokens, snapshot, change log, job records) on 16 MiB.
    let disk = SmallDisk::mount(&dir.join("head-state"), "16m");
    // Room for every counter the test spawns (up to 300, a tenth of a CPU each).
    let mut options = LocalOptions::new(vec![WorkerSpec::new("w1", "CPU=32")]).expect("options");
    options.binary = std::path::PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
    options.heartbeat_timeout_ms = support::HEARTBEAT_TIMEOUT_MS;
    options.log_dir = dir.clone();
    let local = LocalCluster::start(options).expect("start");
    let client = local.connect(Duration::from_secs(30)).await.expect("connect");
    let mut cluster = TestCluster { local, client };
    let spawn = |client: regatta::Cluster, name: String, start: i64| async move {
        let options = ActorOptions::new().resources(req("CPU=0.1")).name(name);
        client.spawn::<Counter>(start, options).await
    };
    spawn(cluster.client.cluster().clone(), "before-full".into(), 100)
        .await
        .expect("spawn");

    // The disk fills up. Spawns change the state: the first few may still fit in the
    // change log's last page, then one cannot be written, so its answer waits, and the
    // head says why.
    let filler = disk.fill();
    let mut during = Vec::new();
    let cannot_write = |cluster: &TestCluster| cluster.local.log("head").contains("cannot write the head's state");
    for i in 0..300 {
        let name = format!("during-full-{i}");
        during.push((
            name.clone(),
            i,
            tokio::spawn(spawn(cluster.client.cluster().clone(), name, i)),
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
        if cannot_write(&cluster) {
            break;
        }
    }
    assert!(
        cannot_write(&cluster),
        "the head never failed to write: {}",
        cluster.local.log("head")
    );
    // (What failed may be a change after the last spawn's, such as its actor's start.) A
    // spawn now: its change waits behind the failed write, and so does its answer.
    let name = "after-the-failure".to_string();
    let last = tokio::spawn(spawn(cluster.client.cluster().clone(), name.clone(), 1_000));
    tokio::time::sleep(Duration::from_secs(2)).await;
    if last.is_finished() {
        let answer = last.await.expect("task").map(|handle| handle.id());
        panic!("{name} was answered while its change could not be written: {answer:?}");
    }
    during.push((name, 1_000, last));

    // Room again: every answer comes, once its change is on disk.
    std::fs::remove_file(&filler).expect("free the disk");
    let mut acknowledged = vec![("before-full".to_string(), 100, None)];
    for (name, start, task) in during {
        let handle = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("the spawn is answered once the disk has room")
            .expect("task")
            .expect("spawn");
        acknowledged.push((name, start, Some(handle)));
    }

    // Killed at once: whatever was acknowledged is known to the next head.
    cluster.local.kill_head().expect("kill the head");
    cluster.local.start_head_again().expect("start the head again");
    rejoined(&cluster, 1).await;
    for (name, start, handle) in &acknowledged {
        let counter = cluster
            .client
            .named::<Counter>(name)
            .await
            .expect("ask the head")
            .unwrap_or_else(|| panic!("{name} was acknowledged and then lost"));

        assert_eq!(
            counter.call(CounterOp::Get).await.expect("call"),
            CounterReply::Total(*start)
        );
        if let Some(handle) = handle {
            assert_eq!(handle.id(), counter.id(), "{name} is the same actor");
        }
    }
    drop(cluster);
    drop(disk);
}
