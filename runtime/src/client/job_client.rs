//! The Rust client of the head's job API: every call typed and async, with clear errors
//! for an unreachable head, a refused token and an unknown job.

use std::time::Duration;

use futures::{Stream, StreamExt};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::net::https::error_chain;
use regatta_proto::{JobRecord, JobSubmission};

/// No request body.
const NO_BODY: Option<&Value> = None;

/// Default job API address.
pub const DEFAULT_JOB_ADDRESS: &str = "https://127.0.0.1:8265";

/// A connection to a head's job API.
#[derive(Clone)]
pub struct JobClient {
    base: String,
    token: String,
    /// The HTTP client, made at the first request (over HTTPS it needs the cluster's
    /// authority, fetched and proven then).
    http: std::sync::Arc<tokio::sync::OnceCell<reqwest::Client>>,
    /// The operator's certificate authorities (`--ca-cert`), trusted instead of the cluster's.
    ca_pem: Option<Vec<u8>>,
}

impl JobClient {
    /// A client of the job API at `address` (`https://host:8265`; a bare `host:port` means
    /// HTTPS; `http://` for a head started with `--insecure`). Over HTTPS it trusts the
    /// cluster's authority, which signs the head's certificate by default, once the head
    /// has proven `token`'s secret for it.
    pub fn new(address: &str, token: &str) -> Result<Self> {
        Self::with_ca(address, token, None)
    }

    /// Like [`JobClient::new`], trusting the PEM certificates in `ca_pem` instead of the
    /// cluster's authority (for a head serving a certificate of its operator's own,
    /// `--tls-cert`), checked with the host name as usual.
    pub fn with_ca(address: &str, token: &str, ca_pem: Option<&[u8]>) -> Result<Self> {
        let base = if address.starts_with("http://") || address.starts_with("https://") {
            address.trim_end_matches('/').to_string()
        } else {
            format!("https://{}", address.trim_end_matches('/'))
        };
        if !base.starts_with("https://") {
            tracing::warn!(address = %base, "talking to the job API over plain HTTP: the cluster token crosses the network in cleartext (use https:// unless the head runs with --insecure)");
        }
        if let Some(pem) = ca_pem {
            // Read now, so a bad file is told before any request.
            crate::net::https::job_api_client_tls(None, Some(pem))?;
        }
        Ok(Self {
            base,
            token: token.to_string(),
            http: Default::default(),
            ca_pem: ca_pem.map(<[u8]>::to_vec),
        })
    }

    /// The HTTP client, made at the first request.
    async fn http(&self) -> Result<&reqwest::Client> {
        self.http
            .get_or_try_init(|| async {
                let mut builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(10));
                if self.base.starts_with("https://") {
                    let tls = match &self.ca_pem {
                        Some(pem) => crate::net::https::job_api_client_tls(None, Some(pem))?,
                        None => {
                            let ca = crate::net::https::fetch_cluster_authority(&self.base, &self.token).await?;
                            crate::net::https::job_api_client_tls(Some(ca), None)?
                        }
                    };
                    builder = builder.use_preconfigured_tls(tls);
                }
                builder.build().map_err(|e| Error::Connect {
                    address: self.base.clone(),
                    reason: e.to_string(),
                })
            })
            .await
    }

    async fn send<B: serde::Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<reqwest::Response> {
        let url = format!("{}{path}", self.base);
        let mut request = self.http().await?.request(method, &url).bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.map_err(|e| {
            if refused_certificate(&e) {
                return if self.ca_pem.is_some() {
                    Error::Connect {
                        address: self.base.clone(),
                        reason: format!(
                            "--ca-cert does not vouch for the job API's certificate ({})",
                            error_chain(&e)
                        ),
                    }
                } else {
                    Error::Token(format!(
                        "the job API at {} shows a certificate the cluster's authority did not sign for the head ({}): the head serves a certificate of its own (trust it with --ca-cert)",
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

    async fn json<T: DeserializeOwned, B: serde::Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T> {
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
        self.json(Method::GET, &format!("/api/jobs/{id}"), NO_BODY).await
    }

    /// Every job.
    pub async fn list(&self) -> Result<Vec<JobRecord>> {
        self.json(Method::GET, "/api/jobs", NO_BODY).await
    }

    /// The job's kept log.
    pub async fn logs(&self, id: &str) -> Result<String> {
        let reply: Value = self.json(Method::GET, &format!("/api/jobs/{id}/logs"), NO_BODY).await?;
        Ok(reply
            .get("logs")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }

    /// The job's log as it is written; the stream ends when the job ends.
    pub async fn follow_logs(&self, id: &str) -> Result<impl Stream<Item = Result<bytes::Bytes>>> {
        let response = self
            .send(Method::GET, &format!("/api/jobs/{id}/logs/tail"), NO_BODY)
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
        let reply: Value = self
            .json(Method::POST, &format!("/api/jobs/{id}/stop"), NO_BODY)
            .await?;
        Ok(reply.get("stopped").and_then(Value::as_bool).unwrap_or(false))
    }

    /// Deletes a finished job.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let _: Value = self.json(Method::DELETE, &format!("/api/jobs/{id}"), NO_BODY).await?;
        Ok(())
    }

    /// Makes a join token on the head (`ttl`: default 24 h; `uses`: default unlimited):
    /// `{"token", "id", "expires_unix", "uses", "ca_hash"}`.
    pub async fn create_join_token(
        &self,
        ttl: Option<Duration>,
        uses: Option<u32>,
        description: &str,
    ) -> Result<Value> {
        let body = serde_json::json!({
            "ttl_secs": ttl.map(|t| t.as_secs().max(1)),
            "uses": uses,
            "description": description,
        });
        self.json(Method::POST, "/api/join-tokens", Some(&body)).await
    }

    /// The head's join tokens (never their secrets) and its authority's hash.
    pub async fn list_join_tokens(&self) -> Result<Value> {
        self.json(Method::GET, "/api/join-tokens", NO_BODY).await
    }

    /// Revokes join token `id`; false when the head had none of that id.
    pub async fn revoke_join_token(&self, id: &str) -> Result<bool> {
        let reply: Value = self
            .json(Method::DELETE, &format!("/api/join-tokens/{id}"), NO_BODY)
            .await?;
        Ok(reply.get("revoked").and_then(Value::as_bool).unwrap_or(false))
    }

    /// Removes node `name` from the cluster for good; whether the head knew it.
    pub async fn remove_node(&self, name: &str) -> Result<bool> {
        let reply: Value = self
            .json(Method::DELETE, &format!("/api/nodes/{name}"), NO_BODY)
            .await?;
        Ok(reply.get("known").and_then(Value::as_bool).unwrap_or(false))
    }

    /// The cluster's id and its authorities (`GET /api/ca`).
    pub async fn authorities(&self) -> Result<AuthorityView> {
        AuthorityView::from_reply(self.json(Method::GET, "/api/ca", NO_BODY).await?)
    }

    /// Starts a rotation of the cluster's authority (`POST /api/ca/rotate`).
    pub async fn rotate_authority(&self) -> Result<AuthorityView> {
        AuthorityView::from_reply(self.json(Method::POST, "/api/ca/rotate", NO_BODY).await?)
    }

    /// Finishes a rotation (`POST /api/ca/finish`): refused while the retiring authority's
    /// certificates may be in use, unless `force`.
    pub async fn finish_rotation(&self, force: bool) -> Result<AuthorityView> {
        let body = serde_json::json!({ "force": force });
        AuthorityView::from_reply(self.json(Method::POST, "/api/ca/finish", Some(&body)).await?)
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

/// Where a cluster's authorities stand (`GET /api/ca`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthorityView {
    /// The cluster's id (its first authority's hash).
    pub cluster: regatta_net::CaHash,
    /// The authority that issues certificates.
    pub issuing: regatta_net::CaHash,
    /// The authority retiring, and when the last certificate it issued expires.
    pub retiring: Option<(regatta_net::CaHash, std::time::SystemTime)>,
}

impl AuthorityView {
    fn from_reply(reply: Value) -> Result<Self> {
        let bad = |why: &str| Error::Decode {
            what: "the head's authorities".into(),
            reason: why.to_string(),
        };
        let hash = |value: Option<&Value>, name: &str| {
            value
                .and_then(Value::as_str)
                .ok_or_else(|| bad(&format!("no {name}")))?
                .parse::<regatta_net::CaHash>()
                .map_err(|e| bad(&e.to_string()))
        };
        let retiring = match reply.get("retiring") {
            None | Some(Value::Null) => None,
            Some(retiring) => {
                let until = retiring
                    .get("until_unix")
                    .and_then(Value::as_u64)
                    .and_then(|secs| std::time::UNIX_EPOCH.checked_add(Duration::from_secs(secs)))
                    .ok_or_else(|| bad("no until_unix, or not a time"))?;
                Some((hash(retiring.get("hash"), "retiring hash")?, until))
            }
        };
        Ok(Self {
            cluster: hash(reply.get("cluster"), "cluster")?,
            issuing: hash(reply.get("issuing"), "issuing")?,
            retiring,
        })
    }
}
