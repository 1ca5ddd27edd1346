//! Metrics end to end: a real Prometheus discovers every node through the head, scrapes
//! them while a workload runs, and every query of every provisioned Grafana dashboard
//! returns data.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use regatta::kinds::{Counter, CounterOp, Echo, Store, StoreOp, StoreReply};
use regatta::local::WorkerSpec;
use regatta::{ActorOptions, JobClient, JobSubmission, Resources, Strategy};
use serde_json::Value;
use support::{eventually, http_get, urlencode, TestCluster};

struct Prometheus {
    child: Child,
    address: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn prometheus_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("REGATTA_PROMETHEUS") {
        return path.into();
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        if dir.join("prometheus").is_file() {
            return dir.join("prometheus");
        }
    }
    panic!("prometheus not found: run ./scripts/test.sh (it installs Debian's prometheus package) or set REGATTA_PROMETHEUS");
}

fn start_prometheus(head_metrics: &str) -> Prometheus {
    let dir = support::temp_dir("prometheus");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: regatta\n    http_sd_configs:\n      - url: {head_metrics}/api/prometheus/sd\n        refresh_interval: 1s\n"
    );
    std::fs::write(dir.join("prometheus.yml"), config).expect("write config");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
    let child = Command::new(prometheus_binary())
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start prometheus");
    Prometheus {
        child,
        address: format!("http://127.0.0.1:{port}"),
    }
}

fn query(prometheus: &Prometheus, expr: &str) -> Option<Vec<Value>> {
    let (status, body) = http_get(&prometheus.address, &format!("/api/v1/query?query={}", urlencode(expr)));
    if status != 200 {
        return None;
    }
    let reply: Value = serde_json::from_str(&body).ok()?;
    reply["data"]["result"].as_array().cloned()
}

fn dashboard_queries(dir: &Path) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("dashboards dir").flatten() {
        let board: Value =
            serde_json::from_str(&std::fs::read_to_string(entry.path()).expect("read")).expect("dashboard JSON");
        let title = board["title"].as_str().unwrap_or_default().to_string();
        for panel in board["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"]
                    .as_str()
                    .expect("expr")
                    .replace("$__rate_interval", "30s")
                    .replace("$__interval", "5s");
                out.push((
                    title.clone(),
                    panel["title"].as_str().unwrap_or_default().to_string(),
                    expr,
                ));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_returns_data_from_a_real_prometheus() {
    let w1 =
        WorkerSpec::new("w1", "CPU=4,GPU=2,accelerator_type:H100=1,pin:w1=1").args(&["--object-store-bytes", "24MiB"]);
    let w2 = WorkerSpec::new("w2", "CPU=4,pin:w2=1");
    let cluster = TestCluster::start_specs(vec![w1, w2], &[]).await;
    let prometheus = start_prometheus(&cluster.local.metrics_address);

    // A workload that touches every family: actors of several kinds (one on a GPU),
    // calls, a placement group, objects moved and spilled, a finished job.
    let client = &cluster.client;
    let echo = client
        .spawn::<Echo>(
            "hi ".into(),
            ActorOptions::new().resources(Resources::parse_request("GPU=1,accelerator_type:H100").expect("req")),
        )
        .await
        .expect("gpu actor");
    let counter = client
        .spawn::<Counter>(0, ActorOptions::new().max_restarts(1))
        .await
        .expect("counter");
    let group = client
        .create_placement_group(
            vec![Resources::parse_request("CPU=1").expect("req"); 2],
            Strategy::StrictSpread,
        )
        .await
        .expect("group");
    group.ready(Duration::from_secs(10)).await.expect("group ready");
    let pin =
        |node: &str| ActorOptions::new().resources(Resources::parse_request(&format!("pin:{node}")).expect("req"));
    let a = client.spawn::<Store>((), pin("w1")).await.expect("store a");
    let b = client.spawn::<Store>((), pin("w2")).await.expect("store b");
    let jobs = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("job client");
    let job = jobs
        .submit(&JobSubmission {
            entrypoint: "echo metrics".into(),
            ..Default::default()
        })
        .await
        .expect("job");
    jobs.wait(&job, Duration::from_millis(50)).await.expect("job ends");
    // A short ZeRO run over both workers, for the trainer dashboard (with a checkpoint).
    let checkpoints = support::temp_dir("metrics-train");
    let mut train = regatta_trainer::TrainConfig::default();
    train.data.path = format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"));
    train.steps = 20;
    train.checkpoint.dir = checkpoints.to_string_lossy().into_owned();
    train.checkpoint.interval = 10;
    regatta_trainer::TrainerGroup::new(client.cluster().clone(), train)
        .expect("trainer config")
        .run(|_| {})
        .await
        .expect("training");
    // Score rows (one malformed) with that checkpoint, for the scorer dashboard.
    let rows = checkpoints.join("rows.jsonl");
    let mut text: String = (0..400)
        .map(|i| format!("{{\"id\": {i}, \"text\": \"row number {i} of the test\"}}\n"))
        .collect();
    text.push_str("{\"id\": \"bad\"}\n");
    std::fs::write(&rows, text).expect("rows");
    let scored = regatta_scorer::ScoreRun::new(
        client.cluster().clone(),
        regatta_scorer::ScoreConfig {
            input: rows.to_string_lossy().into_owned(),
            model: checkpoints.to_string_lossy().into_owned(),
            output: checkpoints.join("scores").to_string_lossy().into_owned(),
            actors: 2,
            batch_size: 16,
            ..Default::default()
        },
    )
    .expect("score config")
    .run(|_| {})
    .await
    .expect("scoring");
    assert_eq!((scored.rows, scored.errors), (400, 1));
    // Generate for some prompts with a Hugging Face fixture model, for the generation panels
    // (output tokens, batch occupancy, KV cache use, queue depth).
    let generated = regatta_scorer::ScoreRun::new(
        client.cluster().clone(),
        regatta_scorer::ScoreConfig {
            input: rows.to_string_lossy().into_owned(),
            model: format!("{}/torch/tests/fixtures/qwen2", env!("CARGO_MANIFEST_DIR")),
            output: checkpoints.join("generated").to_string_lossy().into_owned(),
            actors: 2,
            generate: true,
            max_new_tokens: 4,
            max_batch: 8,
            kv_cache_mb: Some(4),
            ..Default::default()
        },
    )
    .expect("generate config")
    .run(|_| {})
    .await
    .expect("generating");
    assert_eq!((generated.rows, generated.errors), (400, 1));
    assert!(generated.output_tokens >= 400, "{generated:?}");
    // Keep traffic flowing while Prometheus scrapes, so rates have something to show.
    for round in 0..12u64 {
        echo.call("x".into()).await.expect("echo");
        counter.call(CounterOp::Add(1)).await.expect("count");
        if let StoreReply::Put { reference, .. } = a
            .call(StoreOp::Put {
                size: 10 << 20,
                seed: round,
                keep: true,
            })
            .await
            .expect("put")
        {
            b.call(StoreOp::Get(reference)).await.expect("get");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let up = eventually(
        "Prometheus to discover and scrape head and both workers",
        Duration::from_secs(60),
        || async {
            let series = query(&prometheus, "up == 1")?;
            (series.len() == 3).then_some(series)
        },
    )
    .await;
    let nodes: Vec<&str> = up.iter().filter_map(|s| s["metric"]["regatta_node"].as_str()).collect();
    for node in ["head", "w1", "w2"] {
        assert!(nodes.contains(&node), "discovered {nodes:?}");
    }

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docker/grafana/dashboards");
    let queries = dashboard_queries(&dir);
    assert!(queries.len() >= 20, "dashboards hold {} queries", queries.len());
    for (board, panel, expr) in &queries {
        if panel.ends_with("(GPU only)") {
            // MFU is estimated only on GPUs; no GPU here.
            continue;
        }
        eventually(
            &format!("data for '{board}' / '{panel}': {expr}"),
            Duration::from_secs(30),
            || async { query(&prometheus, expr).filter(|series| !series.is_empty()).map(|_| ()) },
        )
        .await;
    }
    // The figures are real, not just present.
    let gpu_used = query(&prometheus, "regatta_node_resources_used{node=\"w1\",resource=\"GPU\"}").expect("query");
    assert_eq!(
        gpu_used.len(),
        1,
        "one series, labelled with the node itself: {gpu_used:?}"
    );
    assert_eq!(gpu_used[0]["value"][1].as_str(), Some("1"), "{gpu_used:?}");
    let clashes = query(&prometheus, "count({exported_node=~\".+\"})").expect("query");
    assert!(
        clashes.is_empty(),
        "no label clashes between targets and series: {clashes:?}"
    );
    let spills = query(&prometheus, "sum(regatta_object_spills_total)").expect("query");
    let spilled: f64 = spills[0]["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(spilled >= 1.0, "a 24 MiB store holding 120 MiB spilled: {spills:?}");
    let succeeded = query(&prometheus, "regatta_jobs{state=\"SUCCEEDED\"}").expect("query");
    assert_eq!(succeeded[0]["value"][1].as_str(), Some("1"));
}
