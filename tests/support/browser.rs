//! A headless Chromium driven over the W3C WebDriver protocol (Debian's `chromium` and
//! `chromium-driver`, installed by `scripts/test.sh`), for the dashboard's tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The W3C element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A browser session; quits the browser and its driver when dropped.
pub struct Browser {
    http: reqwest::Client,
    session: String,
    driver: Child,
    profile: PathBuf,
}

fn find_program(env: &str, names: &[&str]) -> PathBuf {
    if let Ok(path) = std::env::var(env) {
        return PathBuf::from(path);
    }
    for name in names {
        for dir in ["/usr/bin", "/usr/local/bin", "/usr/lib/chromium"] {
            let path = Path::new(dir).join(name);
            if path.is_file() {
                return path;
            }
        }
    }
    panic!(
        "{} not found (set {env}): install Debian's chromium and chromium-driver (scripts/test.sh does)",
        names.join(" or ")
    );
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session.
    pub async fn start() -> Browser {
        let driver_path = find_program("REGATTA_CHROMEDRIVER", &["chromedriver"]);
        let chromium = find_program("REGATTA_CHROMIUM", &["chromium", "chromium-browser"]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let driver = Command::new(&driver_path)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", driver_path.display()));
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = http.get(format!("{base}/status")).send().await;
            if let Ok(reply) = ready {
                let body: Value = reply.json().await.unwrap_or_default();
                if body["value"]["ready"] == true {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = std::env::temp_dir().join(format!("regatta-chromium-{}-{port}", std::process::id()));
        let capabilities = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--ignore-certificate-errors", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1366,900", "--no-first-run", "--disable-extensions",
                         format!("--user-data-dir={}", profile.display())]
            }
        }}});
        let reply: Value = http
            .post(format!("{base}/session"))
            .json(&capabilities)
            .send()
            .await
            .expect("new session")
            .json()
            .await
            .expect("new session reply");
        let id = reply["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("chromium did not start: {reply}"))
            .to_string();
        Browser {
            http,
            session: format!("{base}/session/{id}"),
            driver,
            profile,
        }
    }

    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut request = self.http.request(method, format!("{}{path}", self.session));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let reply: Value = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("webdriver {path}: {e}"))
            .json()
            .await
            .expect("webdriver reply");
        if let Some(error) = reply["value"]["error"].as_str() {
            panic!("webdriver {path}: {error}: {}", reply["value"]["message"]);
        }
        reply["value"].clone()
    }

    /// Opens `url`.
    pub async fn goto(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and returns its value.
    pub async fn run(&self, script: &str, args: Vec<Value>) -> Value {
        self.command(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
        .await
    }

    async fn element(&self, css: &str) -> String {
        let found = self
            .command(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_string()
    }

    /// Types `text` into the element `css` names.
    pub async fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Clicks the element `css` names.
    pub async fn click(&self, css: &str) {
        let id = self.element(css).await;
        self.command(reqwest::Method::POST, &format!("/element/{id}/click"), Some(json!({})))
            .await;
    }

    /// The text of the open `alert`/`confirm` dialog, if one is open.
    pub async fn dialog_text(&self) -> Option<String> {
        let reply: Value = self
            .http
            .get(format!("{}/alert/text", self.session))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        reply["value"].as_str().map(str::to_string)
    }

    /// Accepts the open dialog (OK on a `confirm`).
    pub async fn accept_dialog(&self) {
        self.command(reqwest::Method::POST, "/alert/accept", Some(json!({})))
            .await;
    }

    /// Waits until `script` (a function body) returns something truthy; returns it.
    pub async fn wait_for(&self, what: &str, timeout: Duration, script: &str) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let value = self.run(script, Vec::new()).await;
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return value;
            }
            if Instant::now() > deadline {
                let page = self.run("return document.body.innerText", Vec::new()).await;
                panic!(
                    "timed out waiting for {what}; the page shows:\n{}",
                    page.as_str().unwrap_or("")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Writes a PNG screenshot of the window to `path`.
    pub async fn screenshot(&self, path: &Path) {
        let data = self.command(reqwest::Method::GET, "/screenshot", None).await;
        let bytes = base64_decode(data.as_str().expect("screenshot data"));
        std::fs::write(path, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session closes Chromium; killing the driver afterwards leaves nothing.
        delete_session(&self.session);
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// `DELETE <session url>` over a plain socket (a drop cannot await).
fn delete_session(url: &str) {
    use std::io::{Read, Write};
    let Some(rest) = url.strip_prefix("http://") else {
        return;
    };
    let Some((host, path)) = rest.split_once('/') else {
        return;
    };
    let Ok(address) = host.parse::<std::net::SocketAddr>() else {
        return;
    };
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(2)) else {
        return;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let request = format!("DELETE /{path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_ok() {
        let _ = stream.read_to_end(&mut Vec::new());
    }
}

/// Standard base64 (the screenshot's encoding), without a crate for it.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut buffer, mut bits) = (0u32, 0);
    for c in text.bytes().filter_map(value) {
        buffer = (buffer << 6) | c;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buffer >> bits) as u8);
        }
    }
    out
}
