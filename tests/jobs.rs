//! The job API, client library and CLI against a real head and workers.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use regatta::{ActorState, DeathCause, Error, JobClient, JobStatus, JobSubmission};
use support::{eventually, ticks, TestCluster};

fn job_driver() -> PathBuf {
    example("job_driver")
}

fn example(name: &str) -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_regatta"));
    let path = bin.parent().expect("target dir").join("examples").join(name);
    assert!(
        path.is_file(),
        "build the examples first (cargo test builds them): {}",
        path.display()
    );
    path
}

fn jobs(cluster: &TestCluster) -> JobClient {
    JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("job client")
}

fn submission(entrypoint: &str) -> JobSubmission {
    JobSubmission {
        entrypoint: entrypoint.to_string(),
        ..Default::default()
    }
}

async fn two_workers() -> TestCluster {
    TestCluster::start(&[("w1", "CPU=4"), ("w2", "CPU=4")]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipeline_example_trains_and_scores_as_a_submitted_job() {
    let cluster = two_workers().await;
    let api = jobs(&cluster);
    let entrypoint = format!("{} --steps 80", example("pipeline_job").display());
    let id = api.submit(&submission(&entrypoint)).await.expect("submit");
    let record = api.wait(&id, Duration::from_millis(200)).await.expect("wait");
    let logs = api.logs(&id).await.expect("logs");
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}\n{logs}");
    for expected in [
        "ZeRO-2 over 2 ranks",
        "checkpoint at step 0: ",
        "checkpoint at step 80: ",
        "scoring with step-00000000: partitions 8/8",
        "mean perplexity",
    ] {
        assert!(logs.contains(expected), "missing {expected:?} in:\n{logs}");
    }
    // Its ranks and scorers belonged to the job and are gone with it.
    eventually("the job's actors are gone", Duration::from_secs(10), || async {
        let status = cluster.client.status().await.ok()?;
        status
            .actors
            .iter()
            .all(|a| !matches!(a.view.state, ActorState::Alive))
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_uses_actors_and_objects_and_its_actors_and_objects_go_when_it_ends() {
    let cluster = two_workers().await;
    let api = jobs(&cluster);
    let id = api
        .submit(&submission(&job_driver().to_string_lossy()))
        .await
        .expect("submit");
    let record = api.wait(&id, Duration::from_millis(100)).await.expect("wait");
    let logs = api.logs(&id).await.expect("logs");
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}\n{logs}");
    assert_eq!(record.driver_exit_code, Some(0));
    assert!(record.start_time.is_some() && record.end_time >= record.start_time);
    assert!(
        logs.contains("read back intact") && logs.contains("job driver done"),
        "{logs}"
    );
    assert!(
        logs.contains(&format!("driver of job Some(\"{id}\")")),
        "the driver knows its job: {logs}"
    );
    let status = cluster.client.status().await.expect("status");
    let job_actors: Vec<_> = status
        .actors
        .iter()
        .filter(|a| matches!(&a.view.state, ActorState::Dead { cause: DeathCause::JobEnded { job } } if *job == id))
        .collect();
    assert_eq!(
        job_actors.len(),
        4,
        "the job's 4 actors were cleaned up: {:?}",
        status.actors
    );
    eventually("the job's objects to be freed", Duration::from_secs(5), || async {
        (cluster.client.status().await.ok()?.objects.objects == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_driver_marks_the_job_failed_with_its_exit_code() {
    let cluster = two_workers().await;
    let api = jobs(&cluster);
    let id = api.submit(&submission("echo boom >&2; exit 7")).await.expect("submit");
    let record = api.wait(&id, Duration::from_millis(50)).await.expect("wait");
    assert_eq!((record.status, record.driver_exit_code), (JobStatus::Failed, Some(7)));
    assert!(record.message.contains("code 7"), "{}", record.message);
    assert!(api.logs(&id).await.expect("logs").contains("boom"));
}

fn group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // Fields after the command name: state, ppid, pgrp.
        let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
        let fields: Vec<&str> = after.split_whitespace().collect();
        fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_job_ends_its_process_group_and_its_actors() {
    let cluster = two_workers().await;
    let api = jobs(&cluster);
    let entrypoint = format!("sleep 300 & sleep 301 & {} --hold 300; wait", job_driver().display());
    let id = api.submit(&submission(&entrypoint)).await.expect("submit");
    // The log can show the driver's output a moment before the head has read the
    // supervisor's note of the driver's pid.
    let pid = eventually("the driver to hold", Duration::from_secs(30), || async {
        api.logs(&id).await.ok()?.contains("holding").then_some(())?;
        api.status(&id).await.ok()?.driver_pid
    })
    .await;
    assert!(group_alive(pid));
    assert!(api.stop(&id).await.expect("stop"), "a running job is stopped");
    let record = api.wait(&id, Duration::from_millis(50)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Stopped);
    eventually("the whole process group to exit", Duration::from_secs(10), || async {
        (!group_alive(pid)).then_some(())
    })
    .await;
    let status = cluster.client.status().await.expect("status");
    let live = status
        .actors
        .iter()
        .filter(|a| !matches!(a.view.state, ActorState::Dead { .. }))
        .count();
    assert_eq!(live, 0, "the stopped job's actors are gone: {:?}", status.actors);
    assert!(
        !api.stop(&id).await.expect("second stop"),
        "stopping a finished job is a no-op"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_job_whose_driver_left_a_background_process_ends_that_process() {
    let cluster = two_workers().await;
    let api = jobs(&cluster);
    let id = api
        .submit(&submission("sleep 300 & echo left behind"))
        .await
        .expect("submit");
    let pid = eventually("the driver to print", Duration::from_secs(15), || async {
        api.logs(&id).await.ok()?.contains("left behind").then_some(())?;
        api.status(&id).await.ok()?.driver_pid
    })
    .await;
    // The driver has exited; the sleep it left holds its output open, so the job runs on.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(api.status(&id).await.expect("status").status, JobStatus::Running);
    assert!(group_alive(pid), "the background sleep runs in the driver's group");
    assert!(api.stop(&id).await.expect("stop"), "a running job is stopped");
    let record = api.wait(&id, Duration::from_millis(50)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Stopped, "{record:?}");
    eventually("the background process to exit", Duration::from_secs(10), || async {
        (!group_alive(pid)).then_some(())
    })
    .await;
}

fn process_exists(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z'))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_jobs_outlive_a_head_killed_and_the_restarted_head_follows_and_stops_them() {
    let mut cluster = two_workers().await;
    let api = jobs(&cluster);
    let done = api.submit(&submission("echo first")).await.expect("submit");
    api.wait(&done, Duration::from_millis(50)).await.expect("wait");
    // Counts one line every 50 ms until stopped.
    let ticking = api
        .submit(&submission(
            "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.05; done",
        ))
        .await
        .expect("submit");
    // Ends by itself while the head is down.
    let brief = api
        .submit(&submission("sleep 2; echo ended while the head was away; exit 3"))
        .await
        .expect("submit");
    let driver = eventually("the ticking driver to run", Duration::from_secs(10), || async {
        let record = api.status(&ticking).await.ok()?;
        (record.status == JobStatus::Running && ticks(&api.logs(&ticking).await.ok()?).len() >= 3)
            .then_some(record.driver?)
    })
    .await;
    let ticks_before = ticks(&api.logs(&ticking).await.expect("logs")).len();

    cluster.local.kill_head().expect("kill the head");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(process_exists(driver.pid), "the driver must outlive the head");
    cluster.local.start_head_again().expect("start the head again");

    eventually(
        "the brief job's end, recorded by the restarted head",
        Duration::from_secs(15),
        || async { api.status(&brief).await.ok()?.status.is_terminal().then_some(()) },
    )
    .await;
    let record = api.status(&brief).await.expect("brief");
    assert_eq!(
        (record.status, record.driver_exit_code),
        (JobStatus::Failed, Some(3)),
        "{record:?}"
    );
    assert_eq!(api.logs(&brief).await.expect("logs"), "ended while the head was away\n");
    assert_eq!(api.status(&done).await.expect("done").status, JobStatus::Succeeded);
    assert_eq!(api.logs(&done).await.expect("logs kept"), "first\n");

    let record = api.status(&ticking).await.expect("ticking");
    assert_eq!(record.status, JobStatus::Running, "{record:?}");
    assert_eq!(record.driver.as_ref(), Some(&driver), "the same driver, not a new one");
    // 3 s of outage at 50 ms a line: the log kept every line written while the head was down.
    let ticks_after = eventually("the log to grow after the restart", Duration::from_secs(10), || async {
        let n = ticks(&api.logs(&ticking).await.ok()?).len();
        (n > ticks_before + 40).then_some(n)
    })
    .await;
    assert!(ticks_after > ticks_before + 40, "{ticks_before} -> {ticks_after}");

    assert!(api.stop(&ticking).await.expect("stop"), "a running job is stopped");
    let record = api.wait(&ticking, Duration::from_millis(50)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Stopped, "{record:?}");
    eventually("the driver to be gone", Duration::from_secs(10), || async {
        (!process_exists(driver.pid)).then_some(())
    })
    .await;
    ticks(&api.logs(&ticking).await.expect("logs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_token_get_401_and_bad_input_gets_a_4xx_that_says_why() {
    let cluster = two_workers().await;
    let base = cluster.local.job_address.clone();
    let token = cluster.local.token.clone();
    let body = br#"{"entrypoint": "true"}"#;
    assert_eq!(support::http(&base, "GET", "/api/jobs", None, b"").0, 401);
    assert_eq!(support::http(&base, "POST", "/api/jobs", Some("wrong"), body).0, 401);
    let wrong = JobClient::new(&base, "wrong").expect("client").list().await;
    assert!(matches!(wrong, Err(Error::Token(_))), "{wrong:?}");

    let cases: Vec<(&str, &str, Vec<u8>, u16, &str)> = vec![
        ("POST", "/api/jobs", b"{not json".to_vec(), 400, "malformed"),
        (
            "POST",
            "/api/jobs",
            br#"{"metadata": {}}"#.to_vec(),
            400,
            "missing field `entrypoint`",
        ),
        (
            "POST",
            "/api/jobs",
            br#"{"entrypoint": ""}"#.to_vec(),
            400,
            "entrypoint is empty",
        ),
        (
            "POST",
            "/api/jobs",
            br#"{"entrypoint": "true", "submission_id": "../../etc/passwd"}"#.to_vec(),
            400,
            "not allowed",
        ),
        (
            "POST",
            "/api/jobs",
            br#"{"entrypoint": "true", "runtime_env": {"working_dir": "/no/such/dir"}}"#.to_vec(),
            400,
            "not a directory",
        ),
        (
            "POST",
            "/api/jobs",
            br#"{"entrypoint": "true", "entrypoint_resources": {"GPU": 64}}"#.to_vec(),
            200,
            "submission_id",
        ),
        ("GET", "/api/jobs/nope", vec![], 404, "Job nope does not exist"),
        ("GET", "/api/jobs/nope/logs", vec![], 404, "does not exist"),
        ("POST", "/api/jobs/nope/stop", vec![], 404, "does not exist"),
        ("DELETE", "/api/jobs/nope", vec![], 404, "does not exist"),
        ("GET", "/api/nothing", vec![], 404, "no such endpoint"),
    ];
    for (method, path, body, expected, says) in cases {
        let (status, reply) = support::http(&base, method, path, Some(&token), &body);
        assert_eq!(status, expected, "{method} {path}: {reply}");
        assert!(reply.contains(says), "{method} {path} should say '{says}': {reply}");
    }
    // A body over the limit is refused with a 413 that arrives: the server reads what it
    // refuses, so the client is not cut off while writing. Raw, then through the client.
    let huge = serde_json::to_vec(&submission(&" ".repeat(2 << 20))).expect("json");
    let (status, reply) = support::http(&base, "POST", "/api/jobs", Some(&token), &huge);
    assert_eq!(status, 413, "{reply}");
    assert!(reply.contains("limit"), "{reply}");
    let oversized = jobs(&cluster).submit(&submission(&" ".repeat(2 << 20))).await;
    match oversized {
        Err(Error::Rejected(message)) => assert!(message.contains("413") && message.contains("limit"), "{message}"),
        other => panic!("a 2 MiB submission: {other:?}"),
    }
    let api = jobs(&cluster);
    let mut dup = submission("sleep 30");
    dup.submission_id = Some("same-id".into());
    api.submit(&dup).await.expect("first");
    let err = api.submit(&dup).await.err().expect("duplicate id");
    assert!(
        err.to_string().contains("400")
            && err
                .to_string()
                .contains("Job with submission_id same-id already exists. Please use a different submission_id."),
        "{err}"
    );
    let err = api
        .delete("same-id")
        .await
        .err()
        .expect("running job cannot be deleted");
    assert!(err.to_string().contains("stop it before deleting"), "{err}");
    api.stop("same-id").await.expect("stop");
    api.delete("same-id").await.expect("delete");
    assert!(matches!(api.status("same-id").await, Err(Error::JobUnknown(_))));
    // An infeasible driver reservation fails the job with the reason.
    let listed = api.list().await.expect("list");
    let gpu_job = listed
        .iter()
        .find(|r| r.entrypoint_resources.get("GPU") == Some(&64.0))
        .expect("GPU job listed");
    let record = api
        .wait(&gpu_job.submission_id, Duration::from_millis(50))
        .await
        .expect("wait");
    assert_eq!(record.status, JobStatus::Failed);
    assert!(record.message.contains("GPU"), "{}", record.message);
    let (status, _) = support::http(&base, "GET", "/api/jobs", Some(&token), b"");
    assert_eq!(status, 200, "the API still serves after all that");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_submits_follows_and_manages_jobs() {
    let cluster = two_workers().await;
    let regatta = env!("CARGO_BIN_EXE_regatta");
    let cli = |args: &[&str]| {
        Command::new(regatta)
            .args(args)
            .env("REGATTA_JOB_ADDRESS", &cluster.local.job_address)
            .env("REGATTA_TOKEN", &cluster.local.token)
            .output()
            .expect("run regatta")
    };
    let out = cli(&[
        "job",
        "submit",
        "--",
        "sh",
        "-c",
        "echo 'hello from the driver'; exit 4",
    ]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("hello from the driver"));

    let out = cli(&[
        "job",
        "submit",
        "--no-wait",
        "--submission-id",
        "cli-job",
        "--env",
        "WHO=cli",
        "--",
        "sh",
        "-c",
        "echo hi $WHO",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "cli-job");
    let follow = cli(&["job", "logs", "--follow", "cli-job"]);
    assert_eq!(String::from_utf8_lossy(&follow.stdout), "hi cli\n");
    let status = cli(&["job", "status", "cli-job"]);
    assert!(String::from_utf8_lossy(&status.stdout).contains("\"SUCCEEDED\""));
    let list = cli(&["job", "list"]);
    assert!(String::from_utf8_lossy(&list.stdout).contains("cli-job"));
    // Filtered by state, and paged to the newest.
    let failed = String::from_utf8_lossy(&cli(&["job", "list", "--state", "failed"]).stdout).to_string();
    assert!(failed.contains("FAILED") && !failed.contains("cli-job"), "{failed}");
    let newest = String::from_utf8_lossy(&cli(&["job", "list", "--limit", "1"]).stdout).to_string();
    assert!(newest.starts_with("# the newest 1 of 2 jobs"), "{newest}");
    assert_eq!(newest.lines().count(), 2, "{newest}");
    assert!(newest.contains("cli-job"), "{newest}");
    let bad = cli(&["job", "list", "--state", "done"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("unknown job state 'done'"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(cli(&["job", "delete", "cli-job"]).status.success());
    let gone = cli(&["job", "status", "cli-job"]);
    assert!(!gone.status.success());
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("unknown job"),
        "{}",
        String::from_utf8_lossy(&gone.stderr)
    );

    let unreachable = Command::new(regatta)
        .args(["job", "list", "--address", "http://127.0.0.1:1"])
        .env("REGATTA_TOKEN", "abcdef.0123456789abcdef0123456789abcdef")
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&unreachable.stderr).contains("did not answer"));
}
