//! Ray's own job clients against a Regatta head: `ray job submit` (Ray 2.60's CLI) with a
//! working directory, `py_modules` and environment variables, and `JobSubmissionClient`
//! listing, reading, tailing (websocket), stopping and deleting; the package upload's
//! refusals over raw HTTP. Ray is installed into the test virtualenv by scripts/test.sh.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use regatta::local::WorkerSpec;
use regatta::{JobClient, JobStatus, JobSubmission};
use support::TestCluster;

/// The test virtualenv's `bin/` (with Ray's CLI and Python).
fn venv_bin() -> PathBuf {
    let venv = std::env::var_os("REGATTA_TEST_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/regatta/test-venv")))
        .expect("HOME or REGATTA_TEST_VENV");
    let bin = venv.join("bin");
    assert!(
        bin.join("ray").is_file(),
        "Ray's CLI is not in {}: run scripts/test.sh, which installs ray[default]==2.60.0 there",
        bin.display()
    );
    bin
}

fn headers(token: &str) -> String {
    format!(r#"{{"Authorization": "Bearer {token}"}}"#)
}

/// `ray job <args>` against the cluster; returns the output (stdout and stderr together).
fn ray_job(cluster: &TestCluster, args: &[&str], cwd: &Path) -> (Output, String) {
    let address = cluster.local.job_address.clone();
    let header = headers(&cluster.local.token);
    let mut command = Command::new(venv_bin().join("ray"));
    command
        .arg("job")
        .arg(args[0])
        .args(["--address", &address, "--verify", "False", "--headers", &header])
        .args(&args[1..])
        .current_dir(cwd)
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env_remove("RAY_ADDRESS");
    let output = command.output().expect("run ray");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, text)
}

/// Runs a Python script with Ray's SDK (`script JOB_ADDRESS TOKEN extra...`) and returns
/// the JSON object its last line prints.
fn run_sdk(cluster: &TestCluster, script: &Path, extra: &[&Path], dir: &Path) -> serde_json::Value {
    let output = Command::new(venv_bin().join("python"))
        .arg(script)
        .arg(&cluster.local.job_address)
        .arg(&cluster.local.token)
        .args(extra)
        .current_dir(dir)
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .output()
        .expect("run python");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the SDK script failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"))
}

fn write(path: &Path, text: &str) {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).expect("mkdir");
    }
    std::fs::write(path, text).expect("write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ray_job_submit_runs_a_working_dir_with_modules_and_env_and_fails_as_ray_does() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let dir = support::temp_dir("ray-submit");
    let project = dir.join("project");
    write(
        &project.join("script.py"),
        "import os\nimport helper\nimport extramod\n\
         print(f\"greeting={os.environ['GREETING']}\")\n\
         print(f\"helper={helper.VALUE} extramod={extramod.VALUE}\")\n\
         print(f\"cwd-has-script={os.path.exists('script.py')}\")\n",
    );
    write(&project.join("helper.py"), "VALUE = 'wd-42'\n");
    write(&project.join("data/notes.txt"), "kept\n");
    std::fs::create_dir_all(project.join("data/empty")).expect("mkdir");
    // Excluded by Ray's client (its default excludes): not uploaded, not hashed.
    write(&project.join(".git/HEAD"), "ref: refs/heads/main\n");
    write(&dir.join("modules/extramod/__init__.py"), "VALUE = 'mod-7'\n");
    let env = format!(
        r#"{{"env_vars": {{"GREETING": "hello"}}, "py_modules": ["{}"]}}"#,
        dir.join("modules/extramod").display()
    );
    let submit = |extra: &[&str]| {
        let mut args = vec!["submit", "--working-dir", ".", "--runtime-env-json", &env];
        args.extend_from_slice(extra);
        ray_job(&cluster, &args, &project)
    };
    let (output, text) = submit(&["--", "python3", "script.py"]);
    assert!(output.status.success(), "ray job submit failed:\n{text}");
    for expected in ["greeting=hello", "helper=wd-42 extramod=mod-7", "cwd-has-script=True"] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    let packages = cluster.local.head_state_dir().join("packages");
    let stored = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("package store")
            .flatten()
            .filter(|e| e.path().is_file())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        names
    };
    let first = stored(&packages);
    assert_eq!(first.len(), 2, "the working dir and the module, each once: {first:?}");
    let stamp = |name: &str| std::fs::metadata(packages.join(name)).and_then(|m| m.modified()).ok();
    let before: Vec<_> = first
        .iter()
        .map(|n| std::fs::read(packages.join(n)).expect("read"))
        .collect();

    // A failing entrypoint makes `ray job submit` fail, with the driver's output shown.
    let (output, text) = submit(&["--", "python3", "-c", "import sys; print('about to fail'); sys.exit(3)"]);
    assert!(!output.status.success(), "a failing job must fail the CLI:\n{text}");
    assert!(text.contains("about to fail"), "{text}");
    assert!(
        text.contains("failed") && text.contains("driver exited with code 3"),
        "{text}"
    );
    // The same folders were not uploaded again: Ray's client found them, and the store
    // holds the same names and bytes.
    assert_eq!(text.matches("already exists, skipping upload").count(), 2, "{text}");
    assert_eq!(stored(&packages), first);
    let after: Vec<_> = first
        .iter()
        .map(|n| std::fs::read(packages.join(n)).expect("read"))
        .collect();
    assert_eq!(before, after);
    assert!(stamp(&first[0]).is_some());

    // What Regatta does not do is refused by name, before anything runs.
    let (output, text) = ray_job(
        &cluster,
        &[
            "submit",
            "--runtime-env-json",
            r#"{"pip": ["requests"]}"#,
            "--",
            "echo",
            "never-runs",
        ],
        &project,
    );
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("runtime_env.pip is not supported"), "{text}");
    assert!(!text.contains("never-runs\n"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ray_s_job_submission_client_lists_reads_tails_stops_and_deletes() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let dir = support::temp_dir("ray-sdk");
    let script = dir.join("sdk.py");
    write(
        &script,
        r#"
import asyncio, json, sys, time
from ray.job_submission import JobSubmissionClient, JobStatus

client = JobSubmissionClient(sys.argv[1], headers={"Authorization": f"Bearer {sys.argv[2]}"}, verify=False)
out = {}
job = client.submit_job(
    entrypoint="for i in 0 1 2 3 4; do echo line $i; sleep 0.3; done",
    metadata={"team": "ml"},
    runtime_env={"env_vars": {"A": "1"}},
)

async def tail():
    chunks = []
    async for chunk in client.tail_job_logs(job):
        chunks.append(chunk)
    return "".join(chunks)

out["tail"] = asyncio.run(tail())
out["status"] = client.get_job_status(job).value
info = client.get_job_info(job)
out["info"] = {
    "type": info.type.value, "entrypoint": info.entrypoint, "metadata": info.metadata,
    "pid": info.driver_info.pid, "start": info.start_time, "end": info.end_time,
    "exit": info.driver_exit_code, "env": info.runtime_env,
}
out["logs"] = client.get_job_logs(job)
long = client.submit_job(entrypoint="sleep 60", submission_id="long-one")
deadline = time.time() + 30
while client.get_job_status(long) != JobStatus.RUNNING and time.time() < deadline:
    time.sleep(0.1)
out["listed"] = sorted(j.submission_id for j in client.list_jobs())
try:
    client.submit_job(entrypoint="true", submission_id="long-one")
except RuntimeError as e:
    out["duplicate"] = str(e)
out["stopped"] = client.stop_job(long)
while not client.get_job_status(long).is_terminal() and time.time() < deadline:
    time.sleep(0.1)
out["stopped_status"] = client.get_job_status(long).value
out["deleted"] = client.delete_job(job)
try:
    client.get_job_info(job)
except RuntimeError as e:
    out["after_delete"] = str(e)
print(json.dumps(out))
"#,
    );
    let out = run_sdk(&cluster, &script, &[], &dir);
    let lines = "line 0\nline 1\nline 2\nline 3\nline 4\n";
    assert_eq!(
        out["tail"], lines,
        "the websocket tail streams the whole log, then closes"
    );
    assert_eq!(out["logs"], lines);
    assert_eq!(out["status"], "SUCCEEDED");
    let info = &out["info"];
    assert_eq!(info["type"], "SUBMISSION");
    assert_eq!(info["metadata"]["team"], "ml");
    assert_eq!(info["exit"], 0);
    // The variable's name, not its value: values are often credentials.
    assert_eq!(info["env"]["env_vars"]["A"], "<hidden>");
    assert!(info["pid"].as_str().is_some_and(|p| p.parse::<u32>().is_ok()), "{info}");
    let (start, end) = (info["start"].as_u64().unwrap_or(0), info["end"].as_u64().unwrap_or(0));
    assert!(
        start > 1_600_000_000_000 && end >= start + 1_000,
        "ms since the epoch: {info}"
    );
    assert_eq!(out["listed"].as_array().map(Vec::len), Some(2), "{out}");
    let duplicate = out["duplicate"].as_str().unwrap_or_default();
    assert!(
        duplicate.contains("400") && duplicate.contains("Job with submission_id long-one already exists"),
        "{duplicate}"
    );
    assert_eq!(out["stopped"], true);
    assert_eq!(out["stopped_status"], "STOPPED");
    assert_eq!(out["deleted"], true);
    let after = out["after_delete"].as_str().unwrap_or_default();
    assert!(after.contains("404") && after.contains("does not exist"), "{after}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A zip of `(name, content)` entries, stored.
fn zip_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
    use std::io::Write;
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, content) in entries {
        writer.start_file(*name, options).expect("zip entry");
        writer.write_all(content).expect("zip write");
    }
    writer.finish().expect("zip").into_inner()
}

fn sha1_name(bytes: &[u8]) -> String {
    use sha1::Digest;
    let digest = sha1::Sha1::digest(bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("_ray_pkg_{hex}.zip")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn package_uploads_refuse_bad_tokens_sizes_paths_and_ids() {
    let specs = vec![WorkerSpec::new("w1", "CPU=2")];
    let cluster = TestCluster::start_specs(specs, &["--job-package-bytes", "1MiB"]).await;
    let base = cluster.local.job_address.clone();
    let token = cluster.local.token.clone();
    let packages = cluster.local.head_state_dir().join("packages");

    let good = zip_of(&[("main.py", b"print('ok')\n"), ("pkg/mod.py", b"X = 1\n")]);
    let good_name = sha1_name(&good);
    let path = format!("/api/packages/gcs/{good_name}");
    for route in ["/api/version", "/api/jobs/", path.as_str()] {
        for presented in [None, Some("wrong-token")] {
            let (status, reply) = support::http(&base, "GET", route, presented, b"");
            assert_eq!(status, 401, "{route} with {presented:?}: {reply}");
        }
    }
    let (status, reply) = support::http(&base, "PUT", &path, Some("wrong-token"), &good);
    assert_eq!(status, 401, "{reply}");
    let (status, reply) = support::http(&base, "GET", "/api/version", Some(&token), b"");
    assert_eq!(status, 200, "{reply}");
    assert!(
        reply.contains(r#""ray_version":"2.60.0""#) && reply.contains(r#""version":"4""#),
        "{reply}"
    );

    // Absent, stored, present.
    assert_eq!(support::http(&base, "GET", &path, Some(&token), b"").0, 404);
    let (status, reply) = support::http(&base, "PUT", &path, Some(&token), &good);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(support::http(&base, "GET", &path, Some(&token), b"").0, 200);

    let refused: Vec<(&str, Vec<u8>, Option<String>, u16, &str)> = vec![
        // Over the head's --job-package-bytes.
        ("oversized", vec![7u8; 2 << 20], None, 413, "larger than the limit"),
        // An entry that climbs out of its folder.
        (
            "escaping",
            zip_of(&[("../../escaped.txt", b"x")]),
            None,
            400,
            "outside its folder",
        ),
        // Bytes that are not what the name says.
        (
            "mismatched",
            zip_of(&[("a.py", b"1")]),
            Some(format!("_ray_pkg_{}.zip", "ab".repeat(20))),
            400,
            "does not match",
        ),
        // A folder hash that does not match.
        (
            "folder-mismatch",
            zip_of(&[("a.py", b"1")]),
            Some("_ray_pkg_0123456789abcdef.zip".into()),
            400,
            "folder hash",
        ),
        // Not a zip at all.
        (
            "malformed",
            b"this is not a zip".to_vec(),
            None,
            400,
            "not a readable zip",
        ),
        // A name that is no content address.
        (
            "badname",
            good.clone(),
            Some("evil.sh".into()),
            400,
            "not one Regatta stores",
        ),
    ];
    for (what, body, name, expected, says) in refused {
        let name = name.unwrap_or_else(|| sha1_name(&body));
        let (status, reply) = support::http(&base, "PUT", &format!("/api/packages/gcs/{name}"), Some(&token), &body);
        assert_eq!(status, expected, "{what}: {reply}");
        assert!(reply.contains(says), "{what} should say {says:?}: {reply}");
        assert!(!packages.join(&name).exists(), "{what} was stored");
    }
    assert!(!packages.join("escaped.txt").exists() && !cluster.local.head_state_dir().join("escaped.txt").exists());
    let (status, reply) = support::http(&base, "POST", "/api/jobs/", Some(&token), b"{not json");
    assert_eq!(status, 400, "{reply}");
    // Nothing half-received is left behind.
    let incoming: Vec<_> = std::fs::read_dir(packages.join(".incoming"))
        .expect("incoming")
        .flatten()
        .collect();
    assert!(incoming.is_empty(), "{incoming:?}");

    // A job naming a package that was never uploaded is refused; the stored one runs.
    let api = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("client");
    let mut missing = JobSubmission {
        entrypoint: "python3 main.py".into(),
        ..Default::default()
    };
    missing.runtime_env.working_dir = Some("gcs://_ray_pkg_00000000000000000000000000000000000000aa.zip".into());
    let error = api.submit(&missing).await.err().expect("a missing package is refused");
    assert!(error.to_string().contains("was not uploaded"), "{error}");
    let mut present = missing.clone();
    present.runtime_env.working_dir = Some(format!("gcs://{good_name}"));
    present.entrypoint = "python3 main.py && python3 -c 'import pkg.mod as m; print(m.X)'".into();
    let id = api.submit(&present).await.expect("submit");
    let record = api.wait(&id, Duration::from_millis(100)).await.expect("wait");
    let logs = api.logs(&id).await.expect("logs");
    assert_eq!(record.status, JobStatus::Succeeded, "{record:?}\n{logs}");
    assert_eq!(logs, "ok\n1\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entrypoint_resources_place_the_driver_on_the_worker_that_has_them() {
    let mut cluster = TestCluster::start(&[("cpu-only", "CPU=2"), ("gpu-box", "CPU=2,GPU=1")]).await;
    let dir = support::temp_dir("ray-placed");
    write(&dir.join("project/report.py"), "import os, time\nprint('gpus', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\ntime.sleep(float(os.environ.get('HOLD', '0')))\nprint('done', flush=True)\n");
    let script = dir.join("sdk.py");
    write(
        &script,
        r#"
import json, sys, time
from ray.job_submission import JobSubmissionClient, JobStatus

client = JobSubmissionClient(sys.argv[1], headers={"Authorization": f"Bearer {sys.argv[2]}"}, verify=False)
first = client.submit_job(entrypoint="python3 report.py", runtime_env={"working_dir": sys.argv[3], "env_vars": {"HOLD": "3"}},
                          entrypoint_num_gpus=1)
second = client.submit_job(entrypoint="python3 report.py", runtime_env={"working_dir": sys.argv[3]}, entrypoint_num_gpus=1)
seen = {"second_while_first_ran": set()}
deadline = time.time() + 90
while time.time() < deadline:
    # The second's status counts only when the first ran both before and after it was read:
    # a first that ends between the two reads lets the second start, rightly.
    a, b, a_after = client.get_job_status(first), client.get_job_status(second), client.get_job_status(first)
    if a == JobStatus.RUNNING and a_after == JobStatus.RUNNING:
        seen["second_while_first_ran"].add(b.value)
    if a.is_terminal() and b.is_terminal():
        break
    time.sleep(0.1)
out = {"second_while_first_ran": sorted(seen["second_while_first_ran"])}
for key, job in (("first", first), ("second", second)):
    info = client.get_job_info(job)
    out[key] = {"status": info.status.value, "node": info.driver_node_id, "start": info.start_time, "end": info.end_time,
                "logs": client.get_job_logs(job), "message": info.message}
print(json.dumps(out))
"#,
    );
    let out = run_sdk(&cluster, &script, &[&dir.join("project")], &dir);
    for key in ["first", "second"] {
        let job = &out[key];
        assert_eq!(job["status"], "SUCCEEDED", "{out}");
        assert_eq!(job["node"], "gpu-box", "the driver runs where the GPU is: {out}");
        assert_eq!(job["logs"], "gpus 0\ndone\n", "{out}");
    }
    // One GPU: the second driver waited while the first held it.
    assert_eq!(out["second_while_first_ran"], serde_json::json!(["PENDING"]), "{out}");
    assert!(out["second"]["start"].as_u64() >= out["first"]["end"].as_u64(), "{out}");

    // The driver's node dies: the job fails with that cause, and the driver goes too.
    let api = JobClient::new(&cluster.local.job_address, &cluster.local.token).expect("client");
    let id = api
        .submit(&JobSubmission {
            entrypoint: "echo started; sleep 60".into(),
            entrypoint_num_gpus: Some(1.0),
            ..Default::default()
        })
        .await
        .expect("submit");
    let pid = support::eventually("the driver to run", Duration::from_secs(30), || async {
        let record = api.status(&id).await.ok()?;
        (record.status == JobStatus::Running).then_some(record.driver_pid?)
    })
    .await;
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    cluster.local.kill_worker(1).expect("kill the GPU worker");
    let record = api.wait(&id, Duration::from_millis(100)).await.expect("wait");
    assert_eq!(record.status, JobStatus::Failed, "{record:?}");
    assert!(
        record.message.contains("gpu-box"),
        "the cause names the node: {}",
        record.message
    );
    assert_eq!(record.error_type.as_deref(), Some("JOB_SUPERVISOR_ACTOR_DIED"));
    support::eventually("the orphaned driver to be stopped", Duration::from_secs(15), || async {
        (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ray_s_cli_checks_a_head_s_own_certificate_with_its_ca_file() {
    let dir = support::temp_dir("ray-ca");
    let (cert, key, ca) = support::own_certificate(&dir);
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let cluster = TestCluster::start_specs(
        vec![WorkerSpec::new("w1", "CPU=1")],
        &["--tls-cert", &cert, "--tls-key", &key],
    )
    .await;
    let list = |verify: &str| {
        let output = Command::new(venv_bin().join("ray"))
            .args([
                "job",
                "list",
                "--address",
                &cluster.local.job_address,
                "--verify",
                verify,
            ])
            .args(["--headers", &headers(&cluster.local.token)])
            .env("RAY_USAGE_STATS_ENABLED", "0")
            .output()
            .expect("run ray");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    };
    let (ok, text) = list(&ca.display().to_string());
    assert!(ok, "with the CA file, Ray's client trusts the head:\n{text}");
    let (ok, text) = list("True");
    assert!(
        !ok && text.contains("CERTIFICATE_VERIFY_FAILED"),
        "without it, it must not:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
