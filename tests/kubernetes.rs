#![allow(clippy::unwrap_used)]
//! The Kubernetes manifests in deploy/kubernetes/: validated against the Kubernetes API
//! schemas (`kubernetes-validate --strict`, from PyPI, which scripts/test.sh installs in the
//! test virtualenv), then checked for the wiring schemas cannot see: Service selectors
//! match pod templates, every port the head listens on is exposed with its protocol, the
//! Secrets the pods read exist with their keys, workers find the head's Service, GPU
//! requests agree with the worker's `--resources` and its accelerator tag with the node
//! label it is pinned to, and Prometheus discovers through the head. No cluster runs here:
//! the manifests are validated, not run.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn venv_bin(name: &str) -> PathBuf {
    let venv = std::env::var("REGATTA_TEST_VENV")
        .unwrap_or_else(|_| format!("{}/.cache/regatta/test-venv", std::env::var("HOME").unwrap()));
    let path = Path::new(&venv).join("bin").join(name);
    assert!(
        path.is_file(),
        "{} not found: run ./scripts/test.sh, which installs kubernetes-validate into the test virtualenv",
        path.display()
    );
    path
}

fn manifest_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

fn manifest_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "manifests in {}", dir.display());
    files
}

/// Every document of every file, as JSON (PyYAML from the same virtualenv parses them).
fn documents(files: &[PathBuf]) -> Vec<Value> {
    let output = Command::new(venv_bin("python"))
        .args([
            "-c",
            "import json, sys, yaml\nprint(json.dumps([d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d]))",
        ])
        .args(files)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice::<Value>(&output.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn kind_named<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn workloads(docs: &[Value]) -> Vec<&Value> {
    docs.iter()
        .filter(|d| matches!(d["kind"].as_str(), Some("Deployment" | "StatefulSet")))
        .collect()
}

fn name(doc: &Value) -> String {
    doc["metadata"]["name"].as_str().unwrap_or("?").to_string()
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// `--flag=value` or `--flag value`.
fn flag(args: &[String], flag: &str) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix(&format!("{flag}="))
            .map(str::to_string)
            .or_else(|| (a == flag).then(|| args.get(i + 1).cloned()).flatten())
    })
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| &labels[k] == v))
}

/// Every wiring problem, in words.
fn wiring_problems(docs: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    let services = kind_named(docs, "Service");
    let secrets = kind_named(docs, "Secret");
    let templates: Vec<(&Value, &Value)> = workloads(docs)
        .into_iter()
        .map(|w| (w, &w["spec"]["template"]))
        .collect();
    // Selectors.
    for service in &services {
        let selector = &service["spec"]["selector"];
        if !templates
            .iter()
            .any(|(_, t)| labels_match(selector, &t["metadata"]["labels"]))
        {
            problems.push(format!(
                "Service {} selects {selector} but no pod template has those labels",
                name(service)
            ));
        }
        for port in service["spec"]["ports"].as_array().into_iter().flatten() {
            let target = &port["targetPort"];
            let serves = templates
                .iter()
                .filter(|(_, t)| labels_match(selector, &t["metadata"]["labels"]))
                .any(|(_, t)| {
                    t["spec"]["containers"].as_array().into_iter().flatten().any(|c| {
                        c["ports"].as_array().into_iter().flatten().any(|p| {
                            (p["containerPort"] == *target || p["name"] == *target)
                                && p["protocol"].as_str().unwrap_or("TCP") == port["protocol"].as_str().unwrap_or("TCP")
                        })
                    })
                });
            if !serves {
                problems.push(format!(
                    "Service {} port {} targets {target}, which its pods do not open",
                    name(service),
                    port["name"]
                ));
            }
        }
    }
    for (workload, template) in &templates {
        if !labels_match(
            &workload["spec"]["selector"]["matchLabels"],
            &template["metadata"]["labels"],
        ) {
            problems.push(format!(
                "{} {}: its selector does not match its own pod template",
                workload["kind"],
                name(workload)
            ));
        }
        if workload["kind"] == "StatefulSet" {
            let governing = workload["spec"]["serviceName"].as_str().unwrap_or_default();
            if !services.iter().any(|s| name(s) == governing) {
                problems.push(format!(
                    "StatefulSet {} names service {governing}, which is not defined",
                    name(workload)
                ));
            }
        }
        let claims: Vec<String> = workload["spec"]["volumeClaimTemplates"]
            .as_array()
            .into_iter()
            .flatten()
            .map(name)
            .collect();
        let volumes: Vec<String> = template["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| v["name"].as_str().unwrap_or_default().to_string())
            .collect();
        for container in template["spec"]["containers"].as_array().into_iter().flatten() {
            for mount in container["volumeMounts"].as_array().into_iter().flatten() {
                let mount_name = mount["name"].as_str().unwrap_or_default().to_string();
                if !claims.contains(&mount_name) && !volumes.contains(&mount_name) {
                    problems.push(format!(
                        "{}: mounts volume {mount_name}, which is not defined",
                        name(workload)
                    ));
                }
            }
            // Secrets.
            for env in container["env"].as_array().into_iter().flatten() {
                let reference = &env["valueFrom"]["secretKeyRef"];
                if reference.is_null() {
                    continue;
                }
                let (secret, key) = (
                    reference["name"].as_str().unwrap_or_default(),
                    reference["key"].as_str().unwrap_or_default(),
                );
                let found = secrets.iter().find(|s| name(s) == secret);
                match found {
                    None => problems.push(format!(
                        "{}: reads Secret {secret}, which is not defined",
                        name(workload)
                    )),
                    Some(s) if s["stringData"][key].is_null() && s["data"][key].is_null() => problems.push(format!(
                        "{}: reads key {key} of Secret {secret}, which it does not hold",
                        name(workload)
                    )),
                    Some(_) => {}
                }
            }
            let args = args(container);
            match args.first().map(String::as_str) {
                Some("head") => {
                    let head_service = services
                        .iter()
                        .find(|s| labels_match(&s["spec"]["selector"], &template["metadata"]["labels"]));
                    let Some(service) = head_service else {
                        problems.push("the head has no Service".into());
                        continue;
                    };
                    let exposed = |port: &str, protocol: &str| {
                        service["spec"]["ports"].as_array().into_iter().flatten().any(|p| {
                            p["port"].as_u64().map(|n| n.to_string()).as_deref() == Some(port)
                                && p["protocol"].as_str().unwrap_or("TCP") == protocol
                        })
                    };
                    for (flag_name, protocol) in [
                        ("--port", "TCP"),
                        ("--job-port", "TCP"),
                        ("--metrics-port", "TCP"),
                        ("--object-port", "TCP"),
                    ] {
                        match flag(&args, flag_name) {
                            Some(port) if exposed(&port, protocol) => {}
                            Some(port) => problems.push(format!(
                                "the head listens on {flag_name} {port}/{protocol}, which Service {} does not expose",
                                name(service)
                            )),
                            None => problems.push(format!(
                                "the head's args set no {flag_name} (a fixed port is needed behind a Service)"
                            )),
                        }
                    }
                    if flag(&args, "--advertise-host").as_deref() != Some(name(service).as_str()) {
                        problems.push(format!("the head must advertise its Service's name {}", name(service)));
                    }
                }
                Some("worker") => {
                    let address = flag(&args, "--address").unwrap_or_default();
                    let (host, port) = address.rsplit_once(':').unwrap_or((&address, ""));
                    let reaches_head = services.iter().any(|s| {
                        name(s) == host
                            && s["spec"]["ports"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .any(|p| p["port"].as_u64().map(|n| n.to_string()).as_deref() == Some(port))
                    });
                    if !reaches_head {
                        problems.push(format!("{}: --address {address} is no Service port", name(workload)));
                    }
                    let resources = flag(&args, "--resources").unwrap_or_default();
                    let declared = |key: &str| {
                        resources.split(',').find_map(|kv| {
                            kv.split_once('=')
                                .filter(|(k, _)| *k == key)
                                .map(|(_, v)| v.to_string())
                        })
                    };
                    let gpus_requested = container["resources"]["limits"]["nvidia.com/gpu"].as_u64().unwrap_or(0);
                    let gpus_declared: u64 = declared("GPU").and_then(|v| v.parse().ok()).unwrap_or(0);
                    if gpus_requested != gpus_declared {
                        problems.push(format!(
                            "{}: requests {gpus_requested} nvidia.com/gpu but declares GPU={gpus_declared}",
                            name(workload)
                        ));
                    }
                    let tags: Vec<&str> = resources
                        .split(',')
                        .filter_map(|kv| kv.split('=').next())
                        .filter(|k| k.starts_with("accelerator_type:"))
                        .collect();
                    let product = template["spec"]["nodeSelector"]["nvidia.com/gpu.product"].as_str();
                    match (product, tags.as_slice()) {
                        (None, []) => {}
                        (Some(label), [tag]) => {
                            let expected = regatta_runtime::accelerator_tag(&label.replace('-', " "));
                            if expected.as_deref() != Some(*tag) {
                                problems.push(format!(
                                    "{}: pinned to {label} but declares {tag}, not {expected:?}",
                                    name(workload)
                                ));
                            }
                        }
                        (label, tags) => problems.push(format!(
                            "{}: node label {label:?} and accelerator tags {tags:?} disagree",
                            name(workload)
                        )),
                    }
                    if gpus_requested > 0 && product.is_none() {
                        problems.push(format!("{}: requests GPUs without pinning a GPU model", name(workload)));
                    }
                    if !args.iter().any(|a| a.contains("$(POD_IP)"))
                        || !container["env"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|e| e["name"] == "POD_IP")
                    {
                        problems.push(format!("{}: workers must advertise their pod IP", name(workload)));
                    }
                }
                _ => {}
            }
        }
    }
    // Prometheus discovers through the head's metrics port.
    for map in kind_named(docs, "ConfigMap") {
        if let Some(config) = map["data"]["prometheus.yml"].as_str() {
            let ok = services.iter().any(|s| {
                s["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| config.contains(&format!("http://{}:{}/api/prometheus/sd", name(s), p["port"])))
            });
            if !ok {
                problems.push(format!(
                    "ConfigMap {}: Prometheus discovery does not point at a Service's /api/prometheus/sd",
                    name(map)
                ));
            }
        }
    }
    problems
}

#[test]
fn manifests_pass_the_api_schemas_and_their_wiring_holds() {
    let files = manifest_files(&manifest_dir());
    let output = Command::new(venv_bin("kubernetes-validate"))
        .args(["--strict", "--quiet"])
        .args(&files)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubernetes-validate refused the manifests:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let docs = documents(&files);
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for kind in ["StatefulSet", "Deployment", "Service", "Secret", "ConfigMap"] {
        assert!(kinds.contains(&kind), "{kind} in {kinds:?}");
    }
    let problems = wiring_problems(&docs);
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_wiring_check_catches_each_kind_of_mistake() {
    let docs = documents(&manifest_files(&manifest_dir()));
    let broken = |what: &str, change: &dyn Fn(&mut Vec<Value>)| {
        let mut copy = docs.clone();
        change(&mut copy);
        let problems = wiring_problems(&copy);
        assert!(problems.iter().any(|p| p.contains(what)), "{what}: {problems:#?}");
    };
    let find = |docs: &mut Vec<Value>, kind: &str, wanted: &str| -> usize {
        docs.iter()
            .position(|d| d["kind"] == kind && name(d) == wanted)
            .unwrap()
    };
    broken("selects", &|d| {
        let i = find(d, "Service", "regatta-head");
        d[i]["spec"]["selector"]["app.kubernetes.io/component"] = "heads".into();
    });
    broken("--object-port 6381/TCP", &|d| {
        let i = find(d, "Service", "regatta-head");
        d[i]["spec"]["ports"]
            .as_array_mut()
            .unwrap()
            .retain(|p| p["name"] != "objects");
    });
    broken("reads Secret", &|d| {
        d.retain(|doc| doc["kind"] != "Secret");
    });
    broken("declares GPU=1", &|d| {
        let i = find(d, "Deployment", "regatta-worker-gpu");
        d[i]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 2.into();
    });
    broken("declares accelerator_type:H100", &|d| {
        let i = find(d, "Deployment", "regatta-worker-gpu");
        d[i]["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] = "NVIDIA-A100-SXM4-80GB".into();
    });
    broken("is no Service port", &|d| {
        let i = find(d, "Deployment", "regatta-worker-cpu");
        let args = d[i]["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array_mut()
            .unwrap();
        for arg in args.iter_mut() {
            if arg.as_str().is_some_and(|a| a.starts_with("--address=")) {
                *arg = "--address=regatta-head:7000".into();
            }
        }
    });
    broken("Prometheus discovery", &|d| {
        let i = find(d, "ConfigMap", "regatta-prometheus");
        d[i]["data"]["prometheus.yml"] = "scrape_configs: []".into();
    });
}
