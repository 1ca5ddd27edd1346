//! `regatta bench` runs every case and prints lines in `ray microbenchmark`'s format (a
//! smoke run with small counts; the figures themselves live in BENCHMARKS.md).

use std::process::Command;

/// The line of `text` that starts with `case`, and the figure right after it.
fn figure<'a>(text: &'a str, case: &str) -> (&'a str, f64) {
    let line = text
        .lines()
        .find(|l| l.starts_with(case))
        .unwrap_or_else(|| panic!("no line for '{case}' in:\n{text}"));
    let value = line[case.len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no figure in '{line}'"));
    (line, value)
}

#[test]
fn bench_prints_every_case_in_rays_line_format() {
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["bench", "all", "--quick", "--trials", "1"])
        .output()
        .expect("run regatta bench");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let cases = [
        "loopback tcp round trips between threads per second",
        "loopback tcp round trips between tokio tasks per second",
        "1:1 actor calls sync per second",
        "1:1 actor calls async per second",
        "1:1 actor calls concurrent per second",
        "1:n actor calls async per second",
        "n:n actor calls async per second",
        "n:n actor calls with arg async per second",
        "actor creation (create and call each) per second",
        "placement group create/removal per second",
        "ActorPool map per second",
        "single client put calls (Plasma Store) per second",
        "single client get calls (Plasma Store) per second",
        "single client put gigabytes per second",
        "cross-node get 100 MB (shared memory) gigabytes per second",
        "cross-node get 100 MB (network) gigabytes per second",
        "100 MB to 2 nodes at once (shared memory) seconds",
        "100 MB to 2 nodes at once (network) seconds",
        "head and 2 workers ready seconds",
        "idle head and 2 workers resident megabytes",
        "metrics scrape of the head with 2000 actors milliseconds",
        "train ZeRO-2 1 rank(s) tokens per second",
        "train ZeRO-2 3 rank(s) step seconds",
        "train ZeRO-2 2 rank(s) scaling efficiency percent",
        "score 1 actor(s) batch 32 rows per second",
        "score 2 actor(s) batch 256 tokens per second",
    ];
    for case in cases {
        let (line, value) = figure(&text, case);
        assert!(value > 0.0, "{line}");
        assert!(line.contains(" +- "), "{line}");
    }
}

#[test]
fn bench_data_prints_the_loaders_tokens_per_second_and_memory_locally_and_on_s3() {
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["bench", "data", "--quick"])
        .output()
        .expect("run regatta bench data");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for case in [
        "data local loader tokens per second per worker",
        "data s3 (moto) loader tokens per second per worker",
    ] {
        let (line, value) = figure(&text, case);
        assert!(value > 0.0, "{line}");
    }
    assert!(text.contains("data local loader resident MiB every 10s:"), "{text}");
}

/// The scale simulator itself cannot rot: 200 simulated nodes over real sessions, 10,000
/// actors, groups held, the head killed and started again, a tenth of the nodes killed at
/// once; every node is seen alive, every actor placed and started, every node back with
/// every actor after the head's restart, and every actor running again after the loss.
#[test]
fn bench_scale_quick_places_every_actor_on_simulated_nodes() {
    let out = Command::new(env!("CARGO_BIN_EXE_regatta"))
        .args(["bench", "scale", "--quick"])
        .output()
        .expect("run regatta bench scale");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "nodes alive 200/200",
        "actors alive 10000/10000",
        "groups held 200/200",
        "actors alive after 20 nodes died 10000/10000",
    ] {
        assert!(text.lines().any(|l| l == line), "no '{line}' in:\n{text}");
    }
    for case in [
        "scale nodes joined per second",
        "scale actors placed (64 spawns in flight) per second",
        "scale spawn round trip p99, one at a time microseconds",
        "scale head memory per actor bytes",
        "scale placement group of 40 bundles created, ready and removed per second",
        "scale 20 nodes dead at once: their actors running again seconds",
        "scale head killed and started again with 10000 actors: every node back seconds",
        "scale head snapshot of 10000 actors: loop stopped for milliseconds",
    ] {
        let (line, value) = figure(&text, case);
        assert!(value > 0.0, "{line}");
    }
}
