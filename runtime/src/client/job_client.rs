//! The Rust client of the head's job API: every call typed and async, with clear errors
//! for an unreachable head, a refused token and an unknown job.

use std::time::Duration;

use futures::{Stream, StreamExt};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};
use regatta_proto::{JobRecord, JobSubmission};

/// Default job API address.
pub const DEFAULT_JOB_ADDRESS: &str = "https://127.0.0.1:8265";

/// A connection to a head's job API.
#[derive(Clone)]
pub struct JobClient {
    base: String,
    token: String,
    http: reqwest::Client,
    /// Whether certificate authorities besides the token's are trusted.
    extra_ca: bool,
}

impl JobClient {
    /// A client of the job API at `address` (`https://host:8265`; a bare `host:port` means
    /// HTTPS; `http://` for a head started with `--insecure`). Over HTTPS it trusts the
    /// certificate authority derived from `token`, which signs the head's certificate by
    /// default.
    pub fn new(address: &str, token: &str) -> Result<Self> {
        Self::with_ca(address, token, None)
    }

    /// Like [`JobClient::new`], also trusting the PEM certificates in `ca_pem` (for a head
    /// serving a certificate of its operator's own, `--tls-cert`), checked with the host
    /// name as usual.
    pub fn with_ca(address: &str, token: &str, ca_pem: Option<&[u8]>) -> Result<Self> {
        let base = if address.starts_with("http://") || address.starts_with("https://") {
            address.trim_end_matches('/').to_string()
        } else {
            format!("https://{}", address.trim_end_matches('/'))
        };
        let mut builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(10));
        if base.starts_with("https://") {
            builder = builder.use_preconfigured_tls(crate::net::https::job_api_client_tls(token, ca_pem)?);
        } else {
            tracing::warn!(address = %base, "talking to the job API over plain HTTP: the cluster token crosses the network in cleartext (use https:// unless the head runs with --insecure)");
        }
        let http = builder.build().map_err(|e| Error::Connect {
            address: base.clone(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            base,
            token: token.to_string(),
            http,
            extra_ca: ca_pem.is_some(),
        })
    }

    async fn send(&self, method: Method, path: &str, body: Option<&JobSubmission>) -> Result<reqwest::Response> {
        let url = format!("{}{path}", self.base);
        let mut request = self.http.request(method, &url).bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.map_err(|e| {
            if refused_certificate(&e) {
                return if self.extra_ca {
                    Error::Connect {
                        address: self.base.clone(),
                        reason: format!(
                            "neither the cluster token's authority nor --ca-cert vouch for the job API's certificate ({})",
                            error_chain(&e)
                        ),
                    }
                } else {
                    Error::Token(format!(
                        "the job API at {} shows a certificate this cluster token's authority did not sign ({}): the tokens differ, or the head serves a certificate of its own (trust it with --ca-cert)",
                        self.base,
                        error_chain(&e)
                    ))
                };
            }
            Error::Connect {
            address: self.base.clone(),
            reason: format!(
                "the job API did not answer ({}); is the head running with its job API on this address{}?",
                error_chain(&e),
                if self.base.starts_with("https://") {
                    " (https: a head started with --insecure needs http://)"
                } else {
                    " (http: a head serves HTTPS unless started with --insecure)"
                }
            ),
            }
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
            .unwrap_or(text);
        Err(match status {
            StatusCode::UNAUTHORIZED => Error::Token(format!("the head refused the token: {message}")),
            StatusCode::NOT_FOUND => Error::JobUnknown(message),
            _ => Error::Rejected(format!("{status}: {message}")),
        })
    }

    async fn json<T: DeserializeOwned>(&self, method: Method, path: &str, body: Option<&JobSubmission>) -> Result<T> {
        let response = self.send(method, path, body).await?;
        response.json().await.map_err(|e| Error::Decode {
            what: format!("the reply to {path}"),
            reason: e.to_string(),
        })
    }

    /// Submits a job; returns its id.
    pub async fn submit(&self, submission: &JobSubmission) -> Result<String> {
        let reply: Value = self.json(Method::POST, "/api/jobs", Some(submission)).await?;
        reply
            .get("submission_id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| Error::Decode {
                what: "the submit reply".into(),
                reason: "no submission_id".into(),
            })
    }

    /// One job.
    pub async fn status(&self, id: &str) -> Result<JobRecord> {
        self.json(Method::GET, &format!("/api/jobs/{id}"), None).await
    }

    /// Every job.
    pub async fn list(&self) -> Result<Vec<JobRecord>> {
        self.json(Method::GET, "/api/jobs", None).await
    }

    /// The job's kept log.
    pub async fn logs(&self, id: &str) -> Result<String> {
        let reply: Value = self.json(Method::GET, &format!("/api/jobs/{id}/logs"), None).await?;
        Ok(reply
            .get("logs")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }

    /// The job's log as it is written; the stream ends when the job ends.
    pub async fn follow_logs(&self, id: &str) -> Result<impl Stream<Item = Result<bytes::Bytes>>> {
        let response = self
            .send(Method::GET, &format!("/api/jobs/{id}/logs/tail"), None)
            .await?;
        let base = self.base.clone();
        Ok(response.bytes_stream().map(move |chunk| {
            chunk.map_err(|e| Error::Connect {
                address: base.clone(),
                reason: format!("log stream broke: {e}"),
            })
        }))
    }

    /// Stops a job; false when it had already ended.
    pub async fn stop(&self, id: &str) -> Result<bool> {
        let reply: Value = self.json(Method::POST, &format!("/api/jobs/{id}/stop"), None).await?;
        Ok(reply.get("stopped").and_then(Value::as_bool).unwrap_or(false))
    }

    /// Deletes a finished job.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let _: Value = self.json(Method::DELETE, &format!("/api/jobs/{id}"), None).await?;
        Ok(())
    }

    /// Waits until the job ends; returns its final record.
    pub async fn wait(&self, id: &str, poll: Duration) -> Result<JobRecord> {
        loop {
            let record = self.status(id).await?;
            if record.status.is_terminal() {
                return Ok(record);
            }
            tokio::time::sleep(poll).await;
        }
    }
}

/// An error and its causes on one line (reqwest's own message omits the TLS reason).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Whether a request failed because this client did not trust the server's certificate.
fn refused_certificate(e: &(dyn std::error::Error + 'static)) -> bool {
    use tokio_rustls::rustls;
    if matches!(
        e.downcast_ref::<rustls::Error>(),
        Some(rustls::Error::InvalidCertificate(_))
    ) {
        return true;
    }
    // io::Error's `source` skips the error it wraps (here an io::Error around the rustls
    // error, inside another io::Error): look inside it.
    if let Some(inner) = e.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
        return refused_certificate(inner);
    }
    e.source().is_some_and(refused_certificate)
}
