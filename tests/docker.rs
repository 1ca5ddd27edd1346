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

/// Builds the CPU image from this build's binaries and libtorch, once per test process;
/// the guard keeps the compose tests of this file from running at the same time.
fn build_image() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    static BUILT: std::sync::Once = std::sync::Once::new();
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    BUILT.call_once(|| {
        let docker = Command::new("docker").arg("info").output();
        assert!(
            docker.is_ok_and(|o| o.status.success()),
            "Docker Engine is needed for this test (docker info failed)"
        );
        run(Command::new("bash").arg(root().join("docker/base/build-base.sh")));
        run(Command::new("bash")
            .arg(root().join("docker/stage-libtorch.sh"))
            .arg("cpu"));
        run(Command::new("docker")
            .current_dir(root())
            .args(["build", "-q", "-f", "docker/Dockerfile", "-t", IMAGE])
            .args([
                "--build-arg",
                "BASE_IMAGE=regatta-base:bookworm",
                "--build-arg",
                "BUILD_IMAGE=regatta-base:bookworm",
            ])
            .args(["--build-arg", "BINARIES=prebuilt", "--build-arg", "FLAVOUR=cpu"])
            .args(["--build-arg", "PROFILE=debug", "."]));
        let _ = Command::new("docker")
            .args(["image", "prune", "-f", "--filter", "label=regatta.stage=binaries"])
            .output();
    });
    guard
}

fn compose_for(tag: &str, token: &str, ports: (u16, u16, u16)) -> Compose {
    Compose {
        project: format!("regatta{tag}{}", std::process::id()),
        env: vec![
            ("REGATTA_IMAGE".into(), IMAGE.into()),
            ("REGATTA_TOKEN".into(), token.into()),
            ("REGATTA_HEAD_PORT".into(), ports.0.to_string()),
            ("REGATTA_JOB_PORT".into(), ports.1.to_string()),
            ("REGATTA_METRICS_PORT".into(), ports.2.to_string()),
            ("REGATTA_HEARTBEAT_TIMEOUT_MS".into(), "2000".into()),
        ],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_cluster_runs_a_job_and_survives_a_stopped_worker() {
    let _serial = build_image();
    let token = regatta::JoinToken::generate().to_string();
    let (head_port, job_port, metrics_port) = (free_port(), free_port(), free_port());
    let compose = compose_for("test", &token, (head_port, job_port, metrics_port));
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

    let jobs = JobClient::new(&format!("https://127.0.0.1:{job_port}"), &token).expect("job client");
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

/// Waits for a job to end; returns its final status and log.
async fn finished(jobs: &JobClient, id: &str, what: &str, timeout: Duration) -> (JobStatus, String) {
    let status = eventually(what, timeout, || async {
        let info = jobs.status(id).await.ok()?;
        info.status.is_terminal().then_some(info.status)
    })
    .await;
    (status, jobs.logs(id).await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_cluster_trains_a_llama_then_scores_its_checkpoint_and_a_stopped_worker_costs_a_restart() {
    let _serial = build_image();
    let token = regatta::JoinToken::generate().to_string();
    let (head_port, job_port) = (free_port(), free_port());
    let compose = compose_for("train", &token, (head_port, job_port, free_port()));
    run(&mut compose.command(&["up", "-d", "--no-build", "head", "worker", "worker-gpu"]));
    eventually("head and both workers to join", Duration::from_secs(90), || async {
        let status = status(head_port, &token)?;
        (status.nodes.iter().filter(|n| n.state == "alive").count() == 2).then_some(())
    })
    .await;

    // The shared /data volume: a Llama config (3.2 M parameters, so that steps take long
    // enough to stop a worker mid-run), the corpus, its tokenizer and rows to score.
    let staging = support::temp_dir("docker-data");
    let llama = std::fs::read_to_string(root().join("data/bench-llama.json")).unwrap();
    let llama: serde_json::Value = serde_json::from_str(&llama).unwrap();
    let mut inline = String::new();
    for (key, value) in llama.as_object().unwrap() {
        inline.push_str(&format!("{key} = {value}\n"));
    }
    std::fs::write(
        staging.join("train.toml"),
        format!(
            "world_size = 2\nzero_stage = 2\nsteps = 30\nmicro_batch_size = 4\nmax_failures = 2\nstall_timeout_secs = 60\n\
             [model]\ncontext = 128\n[model.config]\n{inline}\
             [data]\npath = \"/data/corpus.txt\"\ntokenizer = \"/data/tokenizer.json\"\n\
             [checkpoint]\ndir = \"/data/ckpt\"\ninterval = 5\n"
        ),
    )
    .unwrap();
    std::fs::copy(root().join("data/corpus.txt"), staging.join("corpus.txt")).unwrap();
    std::fs::copy(root().join("data/tokenizer.json"), staging.join("tokenizer.json")).unwrap();
    let rows: String = (0..50)
        .map(|i| {
            format!(
                "{}\n",
                serde_json::json!({"id": format!("r{i:02}"), "text": format!("def f{i}(x):\n    return x + {i}")})
            )
        })
        .collect();
    std::fs::write(staging.join("rows.jsonl"), rows).unwrap();
    let head = compose.container("head");
    // The image carries the executor and libtorch, but no build tools.
    let tools = Command::new("docker")
        .args([
            "exec",
            &head,
            "sh",
            "-c",
            "command -v gcc || command -v cc || command -v cargo || command -v pip3",
        ])
        .output()
        .unwrap();
    assert!(
        !tools.status.success(),
        "build tools in the image: {}",
        String::from_utf8_lossy(&tools.stdout)
    );
    run(Command::new("docker").args(["exec", &head, "regatta-torch-rank", "bench-adamw", "1000", "1"]));
    for file in ["train.toml", "corpus.txt", "tokenizer.json", "rows.jsonl"] {
        run(Command::new("docker").args([
            "cp",
            staging.join(file).to_str().unwrap(),
            &format!("{head}:/data/{file}"),
        ]));
    }

    let jobs = JobClient::new(&format!("https://127.0.0.1:{job_port}"), &token).expect("job client");
    let train = jobs
        .submit(&JobSubmission {
            entrypoint: "regatta train --config /data/train.toml --log-every 1".into(),
            ..Default::default()
        })
        .await
        .expect("submit the training job from the host");
    let log = eventually("the first checkpoint", Duration::from_secs(120), || async {
        let log = jobs.logs(&train).await.ok()?;
        let info = jobs.status(&train).await.ok()?;
        assert!(!info.status.is_terminal(), "the training job ended early: {log}");
        log.contains("checkpoint at step 5").then_some(log)
    })
    .await;
    assert!(log.contains("ZeRO-2 over 2 ranks"), "{log}");
    assert!(
        !log.contains("step 30/30"),
        "the run must still be going when a worker stops: {log}"
    );
    run(&mut compose.command(&["stop", "--timeout", "1", "worker-gpu"]));

    let (state, log) = finished(&jobs, &train, "the training job to end", Duration::from_secs(300)).await;
    assert_eq!(state, JobStatus::Succeeded, "{log}");
    assert!(log.contains("restarting from the last checkpoint"), "{log}");
    assert!(
        log.contains("trained 30 steps") && log.contains("1 restart(s)"),
        "{log}"
    );
    assert!(log.contains("checkpoint at step 30: /data/ckpt/step-00000030"), "{log}");

    let score = jobs
        .submit(&JobSubmission {
            entrypoint: "regatta score --model /data/ckpt --input /data/rows.jsonl --output /data/scores --actors 2"
                .into(),
            ..Default::default()
        })
        .await
        .expect("submit the scoring job");
    let (state, log) = finished(&jobs, &score, "the scoring job to end", Duration::from_secs(180)).await;
    assert_eq!(state, JobStatus::Succeeded, "{log}");
    let out = staging.join("scores");
    run(Command::new("docker").args(["cp", &format!("{head}:/data/scores"), out.to_str().unwrap()]));
    let mut scored = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&out).unwrap().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".parquet") {
            for row in regatta_scorer::from_parquet(std::fs::read(entry.path()).unwrap().into()).unwrap() {
                assert!(row.perplexity.is_finite() && row.tokens > 1, "{row:?}");
                assert!(scored.insert(row.id.clone(), row).is_none());
            }
        }
    }
    assert_eq!(scored.len(), 50, "every row scored once");
    let _ = std::fs::remove_dir_all(&staging);
}
