//! The head's dashboard: its JSON endpoints against a real head and workers, and the real
//! page in headless Chromium (Debian's `chromium` and `chromium-driver`).
//!
//! Screenshots of every page go to `$REGATTA_SCREENSHOTS`, else
//! `target/dashboard-screenshots/` (named in the test's output).

mod support;

use std::path::PathBuf;
use std::time::Duration;

use regatta::kinds::Echo;
use regatta::{ActorOptions, JobClient, JobStatus, JobSubmission, Resources};
use serde_json::Value;
use support::browser::Browser;
use support::{eventually, TestCluster};

/// A raw HTTP/1.1 request with extra headers: (status, headers, body).
fn http(base: &str, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let host = support::host_of(base);
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let head =
        format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n");
    let text = support::exchange(base, head.as_bytes());
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let (headers, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (status, headers.to_ascii_lowercase(), body.to_string())
}

/// A raw HTTP/1.1 POST of a JSON `body` with extra headers: (status, headers, body).
fn post(base: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let host = support::host_of(base);
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let text = support::exchange(base, request.as_bytes());
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let (headers, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (status, headers.to_ascii_lowercase(), body.to_string())
}

fn json_of(body: &str) -> Value {
    // Bodies may come chunked: the JSON document is the part between the outer braces.
    let start = body.find(['{', '[']).unwrap_or(0);
    let end = body.rfind(['}', ']']).map_or(body.len(), |e| e + 1);
    serde_json::from_str(&body[start..end]).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn screenshots() -> PathBuf {
    let dir = std::env::var_os("REGATTA_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_BIN_EXE_regatta"))
                .parent()
                .and_then(|d| d.parent())
                .expect("target dir")
                .join("dashboard-screenshots")
        });
    std::fs::create_dir_all(&dir).expect("screenshot folder");
    eprintln!("dashboard screenshots in {}", dir.display());
    dir
}

fn submission(entrypoint: &str) -> JobSubmission {
    JobSubmission {
        entrypoint: entrypoint.to_string(),
        ..Default::default()
    }
}

const ENDPOINTS: [&str; 13] = [
    "/api/cluster",
    "/api/nodes",
    "/api/actors",
    "/api/actors/1",
    "/api/actors/1/logs",
    "/api/groups",
    "/api/runs",
    "/api/runs/some-run",
    "/api/jobs",
    "/api/jobs/some-job",
    "/api/jobs/some-job/logs",
    "/api/jobs/some-job/logs?offset=0",
    "/api/jobs/some-job/logs/tail",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_killed_while_it_starts_is_stopped_once_up_and_its_log_says_so() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let base = cluster.local.job_address.clone();
    let bearer = format!("Bearer {}", cluster.local.token);
    let auth = [("Authorization", bearer.as_str())];
    let slow = cluster
        .client
        .spawn::<regatta::kinds::SlowStart>(1_500, ActorOptions::new())
        .await
        .expect("spawn");
    // The start reached the node with the spawn; the kill arrives while the constructor runs.
    slow.kill().await.expect("kill");
    let id = slow.id().0;
    let lines = eventually("the actor stopped once up", Duration::from_secs(20), || {
        let (base, auth) = (base.clone(), auth);
        async move {
            let (status, _, logs) = http(&base, "GET", &format!("/api/actors/{id}/logs"), &auth);
            let text = json_of(&logs)["lines"].to_string();
            (status == 200 && text.contains("as soon as it started")).then_some(text)
        }
    })
    .await;
    assert!(lines.contains("starting slow-start"), "{lines}");
    let err = slow.call(()).await.expect_err("a killed actor answers nothing");
    assert!(matches!(err, regatta::Error::ActorDead { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_needs_the_token_and_a_stop_from_another_site_is_refused() {
    let cluster = TestCluster::start(&[("w1", "CPU=2")]).await;
    let base = cluster.local.job_address.clone();
    let token = cluster.local.token.clone();
    let bearer = format!("Bearer {token}");
    for path in ENDPOINTS {
        for headers in [vec![], vec![("Authorization", "Bearer not-the-token")]] {
            let (status, _, body) = http(&base, "GET", path, &headers);
            assert_eq!(status, 401, "GET {path} with {headers:?}: {body}");
        }
    }
    let (status, _, _) = http(&base, "POST", "/api/jobs/some-job/stop", &[]);
    assert_eq!(status, 401);

    // With the token: the data, and clear refusals of bad queries.
    let auth = [("Authorization", bearer.as_str())];
    let (status, _, body) = http(&base, "GET", "/api/cluster", &auth);
    assert_eq!(status, 200, "{body}");
    let overview = json_of(&body);
    assert_eq!(overview["nodes_alive"], 1, "{overview}");
    assert_eq!(overview["actors"]["alive"], 0, "{overview}");
    let (status, _, body) = http(&base, "GET", "/api/nodes?limit=10", &auth);
    assert_eq!(
        (status, json_of(&body)["items"][0]["name"].clone()),
        (200, Value::from("w1"))
    );
    for (path, expected) in [
        ("/api/actors?state=running", 400),
        ("/api/actors?limit=0", 400),
        ("/api/actors?limit=5000", 400),
        ("/api/actors?offset=minus", 400),
        ("/api/actors/abc", 400),
        ("/api/actors/999999", 404),
        ("/api/runs/none-such", 404),
    ] {
        let (status, _, body) = http(&base, "GET", path, &auth);
        assert_eq!(status, expected, "{path}: {body}");
        assert!(
            json_of(&body)["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{path}: {body}"
        );
    }

    // A stop from another site is refused and the job keeps running; from the page's own
    // origin (and from scripts, which send no Origin) it stops.
    let jobs = JobClient::new(&base, &token).unwrap();
    let id = jobs.submit(&submission("sleep 60")).await.unwrap();
    eventually("the job running", Duration::from_secs(20), || async {
        (jobs.status(&id).await.ok()?.status == JobStatus::Running).then_some(())
    })
    .await;
    let stop = format!("/api/jobs/{id}/stop");
    for refused in [
        vec![("Origin", "http://evil.example")],
        vec![("Origin", "null")],
        vec![("Sec-Fetch-Site", "cross-site")],
    ] {
        let mut headers = auth.to_vec();
        headers.extend(refused.iter().copied());
        let (status, _, body) = http(&base, "POST", &stop, &headers);
        assert_eq!(status, 403, "{refused:?}: {body}");
    }
    assert_eq!(jobs.status(&id).await.unwrap().status, JobStatus::Running);
    let own = base.clone();
    let mut headers = auth.to_vec();
    headers.push(("Origin", own.as_str()));
    headers.push(("Sec-Fetch-Site", "same-origin"));
    let (status, _, body) = http(&base, "POST", &stop, &headers);
    assert_eq!(
        (status, json_of(&body)["stopped"].clone()),
        (200, Value::Bool(true)),
        "{body}"
    );

    // An actor's log lines come from its node, and stay readable after it is killed.
    let echo = cluster
        .client
        .spawn::<Echo>("hello-".to_string(), ActorOptions::new())
        .await
        .expect("spawn");
    echo.wait_ready(Duration::from_secs(20)).await.expect("echo up");
    echo.kill().await.expect("kill");
    let id = echo.id().0;
    let (row, lines) = eventually("the killed actor's row and log", Duration::from_secs(20), || {
        let (base, auth) = (base.clone(), auth);
        async move {
            let (_, _, row) = http(&base, "GET", &format!("/api/actors/{id}"), &auth);
            let (status, _, logs) = http(&base, "GET", &format!("/api/actors/{id}/logs"), &auth);
            let (row, logs) = (json_of(&row), json_of(&logs));
            let text = logs["lines"].to_string();
            (status == 200 && row["state"] == "dead" && text.contains("stopped by the head")).then_some((row, text))
        }
    })
    .await;
    assert_eq!(row["last_node"], "w1", "{row}");
    assert!(row["cause"].as_str().is_some_and(|c| !c.is_empty()), "{row}");
    assert!(
        lines.contains("starting echo on w1") && lines.contains(r#"echo ready, prefix \"hello-\""#),
        "{lines}"
    );

    // `regatta status` reads the same views: filtered and paged.
    for (i, name) in ["alpha", "beta", "gamma"].iter().enumerate() {
        cluster
            .client
            .spawn::<Echo>(format!("{i}"), ActorOptions::new().name(format!("status-{name}")))
            .await
            .expect("spawn");
    }
    let status = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_regatta"))
            .arg("status")
            .args(args)
            .args(["--address", &cluster.local.address])
            .env("REGATTA_TOKEN", &token)
            .output()
            .expect("regatta status");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, text) = status(&["--name", "status-", "--state", "alive", "--limit", "2"]);
    assert!(ok, "{text}");
    assert!(text.contains("listed matching the filter: 1-2 of 3"), "{text}");
    assert!(
        text.contains("name status-alpha") && !text.contains("name status-gamma"),
        "{text}"
    );
    assert!(text.contains("more with --offset 2"), "{text}");
    let (ok, text) = status(&["--json", "--name", "status-", "--offset", "2"]);
    assert!(ok, "{text}");
    let page = json_of(&text);
    assert_eq!(
        (page["total"].clone(), page["items"][0]["name"].clone()),
        (Value::from(3), Value::from("status-gamma")),
        "{page}"
    );
    // The whole cluster as JSON, streamed two actors per request: every actor once, in order.
    let (ok, text) = status(&["--json", "--json-page", "2"]);
    assert!(ok, "{text}");
    let whole: regatta_runtime::ClusterStatus = serde_json::from_str(&text).expect("status --json is a ClusterStatus");
    let ids: Vec<u64> = whole.actors.iter().map(|line| line.view.id.0).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(ids, sorted, "actors out of order or repeated across pages");
    for name in ["status-alpha", "status-beta", "status-gamma"] {
        assert!(
            whole.actors.iter().any(|line| line.name.as_deref() == Some(name)),
            "{name} missing from {text}"
        );
    }
    assert!(whole.actors.len() >= 3 && !whole.nodes.is_empty(), "{text}");
    let (ok, text) = status(&["--state", "running"]);
    assert!(
        !ok && text.contains("state must be one of pending, starting, alive, restarting, dead"),
        "{text}"
    );

    // The page itself needs no token, and loads nothing from another origin.
    let (status, headers, page) = http(&base, "GET", "/", &[]);
    assert_eq!(status, 200);
    assert!(
        headers.contains("content-security-policy: default-src 'none'; script-src 'self'"),
        "{headers}"
    );
    assert!(page.contains("<script src=\"/dashboard.js\""), "{page}");
    for (path, text) in [
        ("/", page),
        ("/dashboard.js", http(&base, "GET", "/dashboard.js", &[]).2),
    ] {
        for reference in text
            .split(['"', '\'', '`', '(', ')', ' '])
            .filter(|w| w.contains("://"))
        {
            assert!(
                reference == "http://www.w3.org/2000/svg",
                "{path} refers to another origin: {reference}"
            );
        }
    }

    // Signing in trades the admin token for a session cookie scripts cannot read: the
    // cookie opens the endpoints, signing out ends it, a sign-in from another site is
    // refused, and a source that keeps failing is throttled, even once it presents the
    // right token, while a session already open goes on.
    let (status, _, body) = post(&base, "/api/login", r#"{"token":"not-the-token"}"#, &[]);
    assert_eq!(status, 401, "{body}");
    let (status, _, body) = post(&base, "/api/login", "{}", &[]);
    assert_eq!(status, 400, "{body}");
    let sign_in = format!(r#"{{"token":"{token}"}}"#);
    let (status, _, body) = post(&base, "/api/login", &sign_in, &[("Origin", "https://evil.example")]);
    assert_eq!(status, 403, "{body}");
    let session = |headers: &str| -> String {
        let set = headers
            .lines()
            .find_map(|l| l.strip_prefix("set-cookie:"))
            .unwrap_or_else(|| panic!("no cookie set: {headers}"));
        for attribute in ["httponly", "samesite=strict", "secure", "path=/", "max-age=28800"] {
            assert!(set.contains(attribute), "{set} lacks {attribute}");
        }
        set.trim().split(';').next().unwrap().to_string()
    };
    let (status, headers, body) = post(&base, "/api/login", &sign_in, &[]);
    assert_eq!(status, 200, "{body}");
    let first = session(&headers);
    assert!(!first.contains(&token), "the cookie is not the token");
    let (status, _, body) = http(&base, "GET", "/api/cluster", &[("Cookie", first.as_str())]);
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = post(&base, "/api/logout", "", &[("Cookie", first.as_str())]);
    assert_eq!(
        (status, json_of(&body)["signed_out"].clone()),
        (200, Value::Bool(true)),
        "{body}"
    );
    let (status, _, body) = http(&base, "GET", "/api/cluster", &[("Cookie", first.as_str())]);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("session has ended"), "{body}");
    let (_, headers, _) = post(&base, "/api/login", &sign_in, &[]);
    let second = session(&headers);
    let wrong = [("Authorization", "Bearer not-the-token")];
    let mut statuses = Vec::new();
    for _ in 0..40 {
        let (status, headers, _) = http(&base, "GET", "/api/cluster", &wrong);
        statuses.push(status);
        if status == 429 {
            assert!(headers.contains("retry-after:"), "{headers}");
            break;
        }
    }
    assert_eq!(statuses.last(), Some(&429), "never throttled: {statuses:?}");
    assert!(statuses.len() > 3, "throttled too soon: {statuses:?}");
    let (status, _, body) = http(&base, "GET", "/api/cluster", &auth);
    assert_eq!(status, 429, "the right token is not looked at while throttled: {body}");
    let (status, _, body) = post(&base, "/api/login", &sign_in, &[]);
    assert_eq!(status, 429, "{body}");
    let (status, _, body) = http(&base, "GET", "/api/cluster", &[("Cookie", second.as_str())]);
    assert_eq!(status, 200, "an open session goes on: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_chromium_shows_nodes_actors_jobs_and_a_training_run() {
    let cluster = TestCluster::start(&[("w1", "CPU=2,GPU=2"), ("w2", "CPU=2")]).await;
    let base = cluster.local.job_address.clone();
    let token = cluster.local.token.clone();
    let shots = screenshots();
    let browser = Browser::start().await;

    // Sign in: a wrong token is refused on the page, the right one opens the overview.
    browser.goto(&base).await;
    browser
        .wait_for(
            "the sign-in form",
            Duration::from_secs(20),
            "return !document.querySelector('#login').hidden",
        )
        .await;
    browser.screenshot(&shots.join("01-sign-in.png")).await;
    browser.type_into("#login-token", "not-the-token").await;
    browser.click("#login-submit").await;
    browser
        .wait_for(
            "the refusal",
            Duration::from_secs(10),
            "return document.querySelector('#login-error').textContent.includes('refused')",
        )
        .await;
    browser.type_into("#login-token", &token).await;
    browser.click("#login-submit").await;
    browser
        .wait_for(
            "two nodes alive on the overview",
            Duration::from_secs(20),
            "const o = document.querySelector('#overview'); return o && o.innerText.includes('2 alive') \
             && getComputedStyle(document.querySelector('#login')).display === 'none'",
        )
        .await;
    let in_url = browser.run("return location.href", vec![]).await;
    assert!(
        !in_url.as_str().unwrap_or("").contains(&token),
        "the token is never in a URL: {in_url}"
    );
    browser.screenshot(&shots.join("02-overview.png")).await;

    // Nodes.
    browser.goto(&format!("{base}/#/nodes")).await;
    browser
        .wait_for(
            "both workers listed",
            Duration::from_secs(20),
            "return document.querySelectorAll('#nodes-table tr[data-node]').length === 2",
        )
        .await;
    browser.screenshot(&shots.join("03-nodes.png")).await;

    // A spawned actor appears, with its GPU, and its page opens.
    let echo = cluster
        .client
        .spawn::<Echo>(
            "<script>window.pwned = 3</script>".to_string(),
            ActorOptions::new()
                .name("dashboard-echo")
                .resources(Resources::parse_request("GPU=1").unwrap()),
        )
        .await
        .expect("spawn");
    browser.goto(&format!("{base}/#/actors?name=dashboard-echo")).await;
    let id = browser
        .wait_for(
            "the spawned actor alive in the list",
            Duration::from_secs(20),
            "const row = document.querySelector('#actors-table tr[data-actor]');\
             return row && row.innerText.includes('alive') && row.innerText.includes('w1') ? row.dataset.actor : null",
        )
        .await;
    assert_eq!(id.as_str().unwrap(), echo.id().0.to_string());
    browser.screenshot(&shots.join("04-actors.png")).await;
    browser.click("#actors-table tr[data-actor] a").await;
    browser
        .wait_for(
            "the actor's page",
            Duration::from_secs(20),
            "const a = document.querySelector('#actor'); return a && a.innerText.includes('dashboard-echo') \
             && a.innerText.includes('GPU indices') && document.querySelector('#actor-state').textContent === 'alive'",
        )
        .await;
    // Its log lines from its node: what the agent saw, and what the actor wrote (as text).
    browser
        .wait_for(
            "the actor's log lines",
            Duration::from_secs(20),
            "const log = document.querySelector('#actor-log').textContent;\
             return log.includes('starting echo on w1') && log.includes('alive')\
               && log.includes('echo ready, prefix \\\"<script>window.pwned = 3</script>\\\"')",
        )
        .await;
    let rendered = browser
        .run(
            "return [window.pwned === undefined, document.querySelectorAll('#actor-log *').length]",
            vec![],
        )
        .await;
    assert_eq!(
        rendered,
        serde_json::json!([true, 0]),
        "the actor log's markup must not run"
    );
    browser.screenshot(&shots.join("05-actor.png")).await;

    // A job that prints markup shows it as text.
    let jobs = JobClient::new(&base, &token).unwrap();
    let marked = jobs
        .submit(&submission(
            "echo '<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\"><b>bold</b>'",
        ))
        .await
        .unwrap();
    browser.goto(&format!("{base}/#/job/{marked}")).await;
    browser
        .wait_for(
            "the markup shown as text",
            Duration::from_secs(30),
            "return document.querySelector('#job-log').textContent.includes('<script>window.pwned = 1</script>')",
        )
        .await;
    let verdict = browser
        .run(
            "return [window.pwned === undefined, document.querySelectorAll('#job-log *').length]",
            vec![],
        )
        .await;
    assert_eq!(
        verdict,
        serde_json::json!([true, 0]),
        "the log's markup must not run or render"
    );
    browser.screenshot(&shots.join("06-job-markup.png")).await;

    // A training job: its log lines arrive while it runs, its run's loss chart gains points,
    // and the Stop button (after its confirmation) stops it.
    let corpus = format!("{}/data/corpus.txt", env!("CARGO_MANIFEST_DIR"));
    let train = jobs
        .submit(&submission(&format!(
            "{} train --steps 1000000 --world-size 2 --data {corpus}",
            env!("CARGO_BIN_EXE_regatta")
        )))
        .await
        .unwrap();
    browser.goto(&format!("{base}/#/runs")).await;
    let run = browser
        .wait_for(
            "the training run listed",
            Duration::from_secs(120),
            &format!(
                "const row = [...document.querySelectorAll('#runs-table tr[data-run]')]\
                   .find(r => r.innerText.includes('{train}'));\
                 return row ? row.dataset.run : null"
            ),
        )
        .await;
    let run = run.as_str().unwrap().to_string();
    browser.screenshot(&shots.join("07-runs.png")).await;
    browser.goto(&format!("{base}/#/run/{run}")).await;
    let points = |at_least: u64| {
        format!(
            "const c = document.querySelector('.chart[data-series=loss]');\
             return c && Number(c.dataset.points) >= {at_least} && c.querySelector('polyline') ? Number(c.dataset.points) : 0"
        )
    };
    let first = browser
        .wait_for("a loss chart", Duration::from_secs(60), &points(2))
        .await
        .as_u64()
        .unwrap();
    browser
        .wait_for(
            "the loss chart gaining points",
            Duration::from_secs(60),
            &points(first + 3),
        )
        .await;
    browser.screenshot(&shots.join("08-run-charts.png")).await;

    browser.goto(&format!("{base}/#/job/{train}")).await;
    let lines = "return (document.querySelector('#job-log').textContent.match(/\\n/g) || []).length";
    let before = browser
        .wait_for("the training log", Duration::from_secs(30), lines)
        .await
        .as_u64()
        .unwrap();
    browser
        .wait_for(
            "new log lines arriving",
            Duration::from_secs(60),
            &format!("return ({}) > {before}", lines.trim_start_matches("return ")),
        )
        .await;
    browser
        .wait_for(
            "the Stop button",
            Duration::from_secs(10),
            "return !document.querySelector('#job-stop').hidden",
        )
        .await;
    browser.click("#job-stop").await;
    let question = eventually("the confirmation", Duration::from_secs(10), || browser.dialog_text()).await;
    assert!(question.contains("Stop job"), "{question}");
    browser.accept_dialog().await;
    browser
        .wait_for(
            "the job stopped",
            Duration::from_secs(60),
            "return document.querySelector('#job-status').textContent === 'STOPPED'",
        )
        .await;
    browser.screenshot(&shots.join("09-job-stopped.png")).await;
    assert_eq!(jobs.status(&train).await.unwrap().status, JobStatus::Stopped);

    // Nothing the page loaded came from another origin.
    let foreign = browser
        .run(
            "return performance.getEntriesByType('resource').map(e => e.name)\
               .filter(n => !n.startsWith(location.origin))",
            vec![],
        )
        .await;
    assert_eq!(foreign, serde_json::json!([]), "resources from another origin");
}
