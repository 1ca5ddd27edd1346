//! The README's main job (`regatta demo`, what `scripts/main-job.sh` runs) does its work
//! and stops every process it started.

use std::process::Command;

#[test]
fn the_main_job_runs_its_workload_and_stops_its_cluster() {
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["demo", "--actors", "20", "--calls", "3"])
        .output()
        .expect("run regatta demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for expected in [
        "spawned 20 counter actors",
        "60 actor calls",
        "every total checked",
        "STRICT_SPREAD",
        "with GPU indices [0]",
        "read byte-exact on w2",
        "Nodes: 2 alive, 0 dead",
        "cluster stopped",
    ] {
        assert!(text.contains(expected), "missing '{expected}' in:\n{text}");
    }
    let logs = text
        .lines()
        .find_map(|l| l.split("logs in ").nth(1))
        .map(|l| l.trim_end_matches(')').to_string())
        .expect("the log folder is printed");
    // The head's command line names the demo's log folder (its --state-dir lives there): no
    // process with it may outlive the demo.
    let still_running = std::fs::read_dir("/proc")
        .map(|entries| {
            entries.flatten().any(|e| {
                std::fs::read_to_string(e.path().join("cmdline"))
                    .map(|c| c.contains(&logs))
                    .unwrap_or(false)
            })
        })
        .unwrap_or(false);
    assert!(!still_running, "a process of the demo's cluster is still running");
}
