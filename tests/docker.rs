//! The compose cluster on the real Docker engine: images built from a locally made base,
//! a head and two workers as containers, a job submitted from the host that spawns actors
//! on both workers and moves an object between them, then a worker container stopped and
//! its actors restarted on the other worker.

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use regatta::{ActorState, ClusterStatus, JobClient, JobStatus, JobSubmission};
use support::eventually;

const IMAGE: &str = "regatta:test";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port()
}

/// A compose project that is torn down (containers and volumes) when dropped.
struct Compose {
    project: String,
    env: Vec<(String, String)>,
}

impl Compose {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("docker-compose");
        command
            .current_dir(root())
            .args(["-f", "docker/compose.yaml", "-p", &self.project])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        command
    }

    fn container(&self, service: &str) -> String {
        let out = run(&mut self.command(&["ps", "-q", service]));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        let _ = self.command(&["down", "-v", "--timeout", "5"]).output();
    }
}

fn status(head_port: u16, token: &str) -> Option<ClusterStatus> {
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["status", "--json", "--address", &format!("127.0.0.1:{head_port}")])
        .env("REGATTA_TOKEN", token)
        .output()
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_cluster_runs_a_job_and_survives_a_stopped_worker() {
    let docker = Command::new("docker").arg("info").output();
    assert!(
        docker.is_ok_and(|o| o.status.success()),
        "Docker Engine is needed for this test (docker info failed)"
    );
    run(Command::new("bash").arg(root().join("docker/base/build-base.sh")));
    run(Command::new("docker")
        .current_dir(root())
        .args(["build", "-q", "-f", "docker/Dockerfile", "-t", IMAGE])
        .args([
            "--build-arg",
            "BASE_IMAGE=regatta-base:bookworm",
            "--build-arg",
            "BUILD_IMAGE=regatta-base:bookworm",
        ])
        .args(["--build-arg", "BINARIES=prebuilt"])
        .args(["--build-arg", "PROFILE=debug", "."]));

    let token = format!("docker-test-{}", std::process::id());
    let (head_port, job_port, metrics_port) = (free_port(), free_port(), free_port());
    let compose = Compose {
        project: format!("regattatest{}", std::process::id()),
        env: vec![
            ("REGATTA_IMAGE".into(), IMAGE.into()),
            ("REGATTA_TOKEN".into(), token.clone()),
            ("REGATTA_HEAD_PORT".into(), head_port.to_string()),
            ("REGATTA_JOB_PORT".into(), job_port.to_string()),
            ("REGATTA_METRICS_PORT".into(), metrics_port.to_string()),
            ("REGATTA_HEARTBEAT_TIMEOUT_MS".into(), "2000".into()),
        ],
    };
    run(&mut compose.command(&["up", "-d", "--no-build", "head", "worker", "worker-gpu"]));

    let ready = eventually("head and both workers to join", Duration::from_secs(90), || async {
        let status = status(head_port, &token)?;
        (status.nodes.iter().filter(|n| n.state == "alive").count() == 2).then_some(status)
    })
    .await;
    let gpu = ready
        .nodes
        .iter()
        .find(|n| n.name == "gpu-worker")
        .expect("the GPU worker joined");
    assert_eq!(gpu.total.units("GPU"), 2.0);
    assert_eq!(gpu.total.units("accelerator_type:H100"), 1.0);
    let cpu_worker = ready
        .nodes
        .iter()
        .find(|n| n.name != "gpu-worker")
        .expect("the CPU worker")
        .name
        .clone();

    let head = compose.container("head");
    let uid = run(Command::new("docker").args(["exec", &head, "id", "-u"]));
    assert_ne!(
        String::from_utf8_lossy(&uid.stdout).trim(),
        "0",
        "containers run as a non-root user"
    );
    eventually("the head's health check to pass", Duration::from_secs(60), || async {
        let out = Command::new("docker")
            .args(["inspect", "--format", "{{.State.Health.Status}}", &head])
            .output()
            .ok()?;
        (String::from_utf8_lossy(&out.stdout).trim() == "healthy").then_some(())
    })
    .await;

    let jobs = JobClient::new(&format!("http://127.0.0.1:{job_port}"), &token).expect("job client");
    let id = jobs
        .submit(&JobSubmission {
            entrypoint: "regatta-example-driver --hold 300".into(),
            ..Default::default()
        })
        .await
        .expect("submit from the host");
    let logs = eventually(
        "the driver to finish its work and hold",
        Duration::from_secs(60),
        || async {
            let logs = jobs.logs(&id).await.ok()?;
            assert!(!logs.contains("job driver failed"), "{logs}");
            logs.contains("holding").then_some(logs)
        },
    )
    .await;
    assert!(
        logs.contains("read back intact"),
        "an object moved between actors: {logs}"
    );

    let before = status(head_port, &token).expect("status");
    let job_actors: Vec<_> = before
        .actors
        .iter()
        .filter(|a| a.view.state == ActorState::Alive)
        .collect();
    let used: std::collections::BTreeSet<_> = job_actors.iter().filter_map(|a| a.view.node.clone()).collect();
    assert_eq!(used.len(), 2, "the job's actors run on both workers: {job_actors:?}");
    let victim = before
        .actors
        .iter()
        .find(|a| a.view.kind == "counter" && a.view.state == ActorState::Alive)
        .expect("a counter");
    let victim_node = victim.view.node.clone().expect("placed");
    let (service, survivor) = if victim_node == "gpu-worker" {
        ("worker-gpu", cpu_worker.clone())
    } else {
        ("worker", "gpu-worker".to_string())
    };
    run(&mut compose.command(&["stop", "--timeout", "2", service]));

    let after = eventually(
        "the head to report the node dead and restart its actors",
        Duration::from_secs(60),
        || async {
            let status = status(head_port, &token)?;
            let dead = status.nodes.iter().any(|n| n.name == victim_node && n.state == "dead");
            let moved = status.actors.iter().find(|a| a.view.id == victim.view.id)?;
            (dead && moved.view.state == ActorState::Alive && moved.view.node.as_deref() == Some(survivor.as_str()))
                .then_some(status)
        },
    )
    .await;
    let moved = after
        .actors
        .iter()
        .find(|a| a.view.id == victim.view.id)
        .expect("victim listed");
    assert!(moved.view.restarts >= 1, "{moved:?}");
    assert_eq!(jobs.status(&id).await.expect("status").status, JobStatus::Running);
    assert!(jobs.stop(&id).await.expect("stop"));
}
