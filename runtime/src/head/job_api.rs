//! The head's job API over HTTP with JSON bodies, shaped like Ray's job REST API:
//!
//! | method and path | does |
//! | --- | --- |
//! | `POST /api/jobs` | submit: body [`JobSubmission`], replies `{"submission_id", "job_id"}` |
//! | `GET /api/jobs` | list every job (environment values shown as `<hidden>`, here and below) |
//! | `GET /api/jobs/{id}` | one job's [`crate::JobRecord`] |
//! | `GET /api/jobs/{id}/logs` | `{"logs": "..."}` |
//! | `GET /api/jobs/{id}/logs?offset=N` | the current log part from byte `N`: `{"logs", "offset", "ended"}` (up to 1 MiB; ask again from `offset`) |
//! | `GET /api/jobs/{id}/logs/tail` | the log as a stream that ends with the job; with `Upgrade: websocket`, as text frames closed with 1000 (Ray's clients) |
//! | `POST /api/jobs/{id}/stop` | `{"stopped": bool}` |
//! | `DELETE /api/jobs/{id}` | `{"deleted": true}` (finished jobs only) |
//! | `GET /api/version` | `{"version", "ray_version", "ray_commit", "session_name"}`: the Ray job API this speaks |
//! | `POST /api/join-tokens` | body `{"ttl_secs", "uses", "description"}` (each optional; default 24 h, unlimited): a new join token, `{"token", "id", "expires_unix", "uses", "ca_hash"}` (the issuing authority's hash) |
//! | `GET /api/join-tokens` | `{"ca_hash", "ca_hashes", "tokens": [{"id", "expires_unix", "uses_left", "description", "bootstrap"}]}` (never a secret; `ca_hashes`: every trusted authority's, during a rotation two) |
//! | `DELETE /api/join-tokens/{id}` | `{"revoked": bool}`: joins with it are refused from now on (the bootstrap token's too) |
//! | `DELETE /api/nodes/{name}` | `{"removed": true, "known": bool}`: the node is removed for good: declared dead at once (its actors restart elsewhere), its certificate and its name refused from then on |
//! | `GET /api/ca` | `{"cluster", "issuing", "retiring": null or {"hash", "until_unix"}}`: the cluster's id and its authorities' hashes |
//! | `POST /api/ca/rotate` | a new authority issues from now on, the current one retires (trusted until its certificates have expired): replies as `GET /api/ca` |
//! | `POST /api/ca/finish` | body `{"force": bool}` (optional): the retiring authority is trusted no more; refused (409) while certificates it issued may be in use, unless forced |
//! | `GET /api/cluster-ca?token_id=ID` | no login: `{"authorities": [{"ca", "proof"}]}`, the authorities the cluster trusts (DER, hex; the issuing one first), each with the join token `ID`'s proof of it, so a client holding the token trusts them before it sends the token |
//! | `GET /api/packages/gcs/{name}` | 200 when the package is stored, else 404 |
//! | `PUT /api/packages/gcs/{name}` | stores a `working_dir`/`py_modules` zip, checked against its name ([`super::job_packages`]) |
//!
//! Ray's job SDK and `ray job` CLI (2.x) work against it unchanged: the records are a
//! superset of Ray's `JobDetails` and the replies have Ray's fields.
//!
//! Every request carries `Authorization: Bearer <cluster token>` or the cookie of a session
//! opened with `POST /api/login` ([`super::login`]); without either: 401. A source (IPv4 /24,
//! IPv6 /64) that has spent its share of failed attempts gets 429 with `Retry-After`. Errors
//! are `{"error": "..."}` with a 4xx status that says what is wrong. The same port serves
//! the dashboard and its data endpoints ([`super::dashboard`]).

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio_rustls::rustls::ServerConfig;

use std::sync::Arc;

use super::api::{error, Api};
use super::dashboard;
use super::login;
use crate::error::Result;
use crate::head::job_manager::JobManager;
use crate::jobs::log::read_from;
use crate::jobs::packages;
use crate::jobs::JobError;
use crate::net::headlink::HeadLink;
use regatta_proto::hex::encode as hex;
use regatta_proto::JobSubmission;

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// How much of an oversized submission is read and thrown away before the 413. A server
/// that answers without reading the body closes the connection on bytes the client is still
/// writing; the client then sees a broken pipe or a reset instead of the 413 that says why.
/// Past this much, the connection is closed anyway.
const DRAIN_BYTES: usize = 64 << 20;

enum BodyError {
    TooLarge,
    Read(String),
}

/// Reads `body` whole when it is at most `limit` bytes; otherwise reads on, discarding, up to
/// `drain` bytes so that the client gets to read the answer.
async fn read_capped(body: Body, limit: usize, drain: usize) -> std::result::Result<Bytes, BodyError> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Read(e.to_string()))?;
        seen = seen.saturating_add(chunk.len());
        if seen > drain {
            break;
        }
        if seen <= limit {
            kept.extend_from_slice(&chunk);
        }
    }
    if seen > limit {
        return Err(BodyError::TooLarge);
    }
    Ok(Bytes::from(kept))
}

impl IntoResponse for JobError {
    fn into_response(self) -> Response {
        match self {
            JobError::Invalid(m) => error(StatusCode::BAD_REQUEST, m),
            JobError::Unknown(m) => error(StatusCode::NOT_FOUND, m),
            JobError::TooLarge(m) => error(StatusCode::PAYLOAD_TOO_LARGE, m),
            JobError::Internal(m) => error(StatusCode::INTERNAL_SERVER_ERROR, m),
        }
    }
}

/// Serves the job API on `bind`; returns the bound address.
pub(crate) async fn serve(
    manager: JobManager,
    link: Arc<HeadLink>,
    token: String,
    bind: SocketAddr,
    tls: Option<Arc<ServerConfig>>,
    desk: Arc<regatta_net::JoinDesk>,
) -> Result<SocketAddr> {
    let api = Api {
        manager,
        link,
        token,
        desk: desk.clone(),
        login: Arc::default(),
        https: tls.is_some(),
    };
    let signin = Router::new()
        .route("/api/login", post(sign_in))
        .route("/api/logout", post(sign_out))
        .layer(DefaultBodyLimit::max(4096))
        .layer(middleware::from_fn(dashboard::same_origin))
        .with_state(api.clone());
    let protected = Router::new()
        .route("/api/jobs", post(submit).get(list))
        .route("/api/jobs/", post(submit).get(list))
        .route("/api/jobs/{id}", get(status).delete(delete))
        .route("/api/jobs/{id}/logs", get(logs))
        .route("/api/jobs/{id}/logs/tail", get(tail))
        .route("/api/jobs/{id}/stop", post(stop))
        .route("/api/version", get(version))
        .route("/api/join-tokens", post(create_join_token).get(list_join_tokens))
        .route("/api/join-tokens/{id}", axum::routing::delete(revoke_join_token))
        .route("/api/nodes/{name}", axum::routing::delete(remove_node))
        .route("/api/ca", get(authorities))
        .route("/api/ca/rotate", post(rotate_authority))
        .route("/api/ca/finish", post(finish_rotation))
        .route(
            "/api/packages/{protocol}/{name}",
            get(package_exists).put(package_upload),
        )
        .merge(dashboard::endpoints())
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such endpoint; see /api/jobs") })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(dashboard::same_origin))
        .layer(middleware::from_fn_with_state(api.clone(), authenticate))
        .with_state(api);
    let authority = Router::new().route(
        "/api/cluster-ca",
        get(
            move |query: std::result::Result<Query<AuthorityQuery>, QueryRejection>| {
                let desk = desk.clone();
                async move { cluster_authority(&desk, query) }
            },
        ),
    );
    let app = dashboard::pages()
        .merge(authority)
        .merge(signin)
        .merge(protected)
        .layer(middleware::map_response(dashboard::security_headers));
    let scheme = if tls.is_some() { "https" } else { "http" };
    let address = crate::net::http::serve(app, bind, "job API", tls).await?;
    tracing::info!(%address, scheme, "job API listening");
    Ok(address)
}

/// The address a request came from (the HTTP server records it on each request).
fn source_of(request: &Request) -> std::net::IpAddr {
    request
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
        .map_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), |c| c.0.ip())
}

/// The session cookie a request carries, if any.
fn session_cookie(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|text| login::cookie_value(text, login::SESSION_COOKIE))
}

/// Lets a request through with an open session's cookie or the admin token as its bearer.
/// A source past its share of failed attempts is refused (429) before its bearer is
/// looked at.
async fn authenticate(State(api): State<Api>, request: Request, next: Next) -> Response {
    let now = std::time::Instant::now();
    if let Some(cookie) = session_cookie(request.headers()) {
        if api.login().sessions.check(cookie, now) {
            return next.run(request).await;
        }
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(presented) = presented else {
        let why = if session_cookie(request.headers()).is_some() {
            "the session has ended: sign in again"
        } else {
            "missing 'Authorization: Bearer <cluster token>' header (or a signed-in session's cookie)"
        };
        return error(StatusCode::UNAUTHORIZED, why);
    };
    match check_token(&api, source_of(&request), presented, now) {
        Ok(()) => next.run(request).await,
        Err(refusal) => *refusal,
    }
}

/// Checks an admin token presented by `source` at `now`, counting a failure against the
/// source; the refusal is the answer to give.
fn check_token(
    api: &Api,
    source: std::net::IpAddr,
    presented: &str,
    now: std::time::Instant,
) -> std::result::Result<(), Box<Response>> {
    let mut login = api.login();
    if let Err(wait) = login.throttle.admit(source, now) {
        let secs = wait.as_secs().max(1);
        let mut refusal = error(
            StatusCode::TOO_MANY_REQUESTS,
            format!("too many failed sign-ins from this network: try again in {secs} s"),
        );
        if let Ok(value) = axum::http::HeaderValue::from_str(&secs.to_string()) {
            refusal.headers_mut().insert(header::RETRY_AFTER, value);
        }
        return Err(Box::new(refusal));
    }
    if tokens_match(presented.as_bytes(), api.token.as_bytes()) {
        login.throttle.succeeded(source);
        Ok(())
    } else {
        login.throttle.failed(source, now);
        tracing::warn!(%source, "refused a request with a wrong admin token");
        Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "the bearer token does not match the cluster token",
        )))
    }
}

/// `POST /api/login`'s body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SignIn {
    token: String,
}

/// Trades the admin token for a session cookie.
async fn sign_in(State(api): State<Api>, request: Request) -> Response {
    let source = source_of(&request);
    let body = match read_capped(request.into_body(), 4096, 4096).await {
        Ok(body) => body,
        Err(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "a sign-in is a JSON body {\"token\": \"...\"} of at most 4 KiB",
            )
        }
    };
    let wanted: SignIn = match serde_json::from_slice(&body) {
        Ok(wanted) => wanted,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("a sign-in is {{\"token\": \"...\"}}: {e}"),
            )
        }
    };
    let now = std::time::Instant::now();
    if let Err(refusal) = check_token(&api, source, wanted.token.trim(), now) {
        return *refusal;
    }
    let mut secret = [0u8; 32];
    if let Err(e) = getrandom::getrandom(&mut secret) {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("no random source for a session: {e}"),
        );
    }
    let cookie = api.login().sessions.open(secret, now);
    let expires_unix = std::time::SystemTime::now()
        .checked_add(login::SESSION_LIFETIME)
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs());
    tracing::info!(%source, "signed in to the dashboard");
    (
        [(
            header::SET_COOKIE,
            login::set_cookie(&cookie, login::SESSION_LIFETIME, api.https),
        )],
        Json(json!({ "expires_unix": expires_unix })),
    )
        .into_response()
}

/// Ends the request's session, if it has one, and clears the cookie.
async fn sign_out(State(api): State<Api>, request: Request) -> Response {
    let closed = session_cookie(request.headers()).is_some_and(|cookie| api.login().sessions.close(cookie));
    (
        [(header::SET_COOKIE, login::set_cookie("", Duration::ZERO, api.https))],
        Json(json!({ "signed_out": closed })),
    )
        .into_response()
}

/// Whether a presented token is the cluster's: their SHA-256 digests compared in time that
/// depends on neither, so a caller learns nothing of the token's bytes or its length.
fn tokens_match(given: &[u8], token: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let (given, token) = (Sha256::digest(given), Sha256::digest(token));
    given.iter().zip(token.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn submit(State(api): State<Api>, request: Request) -> Response {
    let body = match read_capped(request.into_body(), MAX_BODY_BYTES, DRAIN_BYTES).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the submission is larger than the limit of {MAX_BODY_BYTES} bytes: ship files in the working directory, not in the request"),
            )
        }
        Err(BodyError::Read(reason)) => {
            return error(StatusCode::BAD_REQUEST, format!("cannot read the request body: {reason}"))
        }
    };
    let submission: JobSubmission = match serde_json::from_slice(&body) {
        Ok(submission) => submission,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("malformed job submission: {e}")),
    };
    match api.manager.submit(submission) {
        Ok(id) => Json(json!({ "submission_id": id, "job_id": id })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The Ray job API version this head speaks: Ray's clients check `ray_version` (at least
/// 2.8 for every submission option) and read `version`.
pub const RAY_JOB_API_VERSION: &str = "2.60.0";

/// The default lifetime of a join token made through the API (kubeadm's).
const JOIN_TOKEN_TTL: Duration = Duration::from_secs(24 * 3600);

/// `POST /api/join-tokens`' body.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NewJoinToken {
    ttl_secs: Option<u64>,
    uses: Option<u32>,
    #[serde(default)]
    description: String,
}

async fn create_join_token(State(api): State<Api>, body: Bytes) -> Response {
    let wanted: NewJoinToken = match optional_json(&body, "a join token request") {
        Ok(wanted) => wanted,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    if wanted.ttl_secs == Some(0) || wanted.uses == Some(0) {
        return error(
            StatusCode::BAD_REQUEST,
            "ttl_secs and uses must be at least 1 (omit them for the defaults)",
        );
    }
    if wanted.description.len() > 200 {
        return error(StatusCode::BAD_REQUEST, "a description of at most 200 bytes");
    }
    let ttl = wanted.ttl_secs.map_or(JOIN_TOKEN_TTL, Duration::from_secs);
    let Some(expires) = std::time::SystemTime::now().checked_add(ttl) else {
        return error(StatusCode::BAD_REQUEST, "ttl_secs is too large");
    };
    let token = regatta_net::JoinToken::generate();
    let saved = {
        let mut tokens = api
            .desk
            .tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        tokens.insert(&token, Some(expires), wanted.uses, &wanted.description);
        let saved = api.desk.save(&tokens);
        if saved.is_err() {
            tokens.revoke(&token.id);
        }
        saved
    };
    if let Err(e) = saved {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot keep the new join token: {e}"),
        );
    }
    tracing::info!(id = %token.id, ttl_secs = ttl.as_secs(), uses = ?wanted.uses, "made a join token");
    Json(json!({
        "token": token.to_string(),
        "id": token.id,
        "expires_unix": unix(expires),
        "uses": wanted.uses,
        "ca_hash": api.desk.issuing_hash().to_string(),
    }))
    .into_response()
}

fn unix(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn list_join_tokens(State(api): State<Api>) -> Response {
    let tokens = api
        .desk
        .tokens
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let listed: Vec<_> = tokens
        .list()
        .map(|(id, entry)| {
            json!({
                "id": id,
                "expires_unix": entry.expires.map(unix),
                "uses_left": entry.uses_left,
                "description": entry.description,
                "bootstrap": id == api.desk.bootstrap,
            })
        })
        .collect();
    let hashes: Vec<String> = api
        .desk
        .authorities()
        .hashes()
        .iter()
        .map(ToString::to_string)
        .collect();
    Json(json!({"ca_hash": api.desk.issuing_hash().to_string(), "ca_hashes": hashes, "tokens": listed})).into_response()
}

async fn revoke_join_token(State(api): State<Api>, Path(id): Path<String>) -> Response {
    let mut tokens = api
        .desk
        .tokens
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let revoked = tokens.revoke(&id);
    if revoked {
        if let Err(e) = api.desk.save(&tokens) {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("revoked until the head restarts, but not kept: {e}"),
            );
        }
        tracing::info!(%id, "revoked a join token");
    }
    Json(json!({"revoked": revoked})).into_response()
}

async fn remove_node(State(api): State<Api>, Path(name): Path<String>) -> Response {
    if name.is_empty() || name.len() > 200 {
        return error(StatusCode::BAD_REQUEST, "a node name of 1-200 bytes");
    }
    // Refused at the handshake first, so that the node cannot open a session between the
    // head declaring it dead and the verifier knowing.
    api.desk
        .removed
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(name.clone());
    let request = regatta_proto::HeadRequest::RemoveNode(name.clone());
    match api.link.ask::<bool>(&request, Duration::from_secs(10)).await {
        Ok(known) => {
            tracing::warn!(node = %name, known, "removed a node from the cluster for good");
            Json(json!({"removed": true, "known": known})).into_response()
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the head did not record the removal ({e}); its certificate is refused until the head restarts: ask again"),
        ),
    }
}

/// `GET /api/cluster-ca`'s query.
#[derive(serde::Deserialize)]
struct AuthorityQuery {
    token_id: String,
}

/// The cluster authority and join token `token_id`'s proof of it (see the module's table).
fn cluster_authority(
    desk: &regatta_net::JoinDesk,
    query: std::result::Result<Query<AuthorityQuery>, QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return error(StatusCode::BAD_REQUEST, "give ?token_id=<the join token's id>");
    };
    let key = {
        let tokens = desk.tokens.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        tokens.usable(&query.token_id, std::time::SystemTime::now())
    };
    match key {
        Ok(key) => {
            let authorities: Vec<_> = desk
                .authorities()
                .trusted()
                .iter()
                .map(|ca| json!({"ca": hex(ca.as_ref()), "proof": hex(&key.authority_proof(ca.as_ref()))}))
                .collect();
            Json(json!({ "authorities": authorities })).into_response()
        }
        Err(refusal) => error(StatusCode::NOT_FOUND, refusal.to_string()),
    }
}

/// The cluster's id and its authorities, as `GET /api/ca` shows them.
fn authorities_view(authorities: &regatta_net::Authorities) -> serde_json::Value {
    let retiring = authorities.retiring().map(|retiring| {
        json!({
            "hash": regatta_net::CaHash::of_certificate(&retiring.cert).map(|h| h.to_string()).unwrap_or_default(),
            "until_unix": unix(retiring.until),
        })
    });
    json!({
        "cluster": authorities.cluster().to_string(),
        "issuing": authorities.issuing().hash().to_string(),
        "retiring": retiring,
    })
}

async fn authorities(State(api): State<Api>) -> Response {
    Json(authorities_view(&api.desk.authorities())).into_response()
}

/// A rotation step's outcome as an answer: a refusal is a conflict (409) that says why.
/// After a step, the head's heartbeat answers ask every node that trusts other authorities
/// to renew at once.
async fn rotation_answer(api: &Api, outcome: regatta_net::Result<regatta_net::Authorities>, what: &str) -> Response {
    match outcome {
        Ok(authorities) => {
            tracing::warn!(step = what, authorities = ?authorities, "the cluster's authorities changed");
            let told = api
                .link
                .ask::<()>(
                    &regatta_proto::HeadRequest::Trust(authorities.fingerprint()),
                    Duration::from_secs(10),
                )
                .await;
            if let Err(e) = told {
                tracing::warn!(error = %e, "nodes were not asked to renew at once: they renew under the new authorities when their certificates are two-thirds through");
            }
            Json(authorities_view(&authorities)).into_response()
        }
        Err(regatta_net::Error::Rotation(why)) => error(StatusCode::CONFLICT, why),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot {what}: {e}")),
    }
}

async fn rotate_authority(State(api): State<Api>) -> Response {
    let desk = api.desk.clone();
    let outcome = tokio::task::spawn_blocking(move || desk.rotate()).await;
    match outcome {
        Ok(outcome) => rotation_answer(&api, outcome, "rotate the authority").await,
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the rotation did not finish: {e}"),
        ),
    }
}

/// A body whose fields are all optional: the defaults when empty, else its JSON; a bad one
/// is told as `what: why` (for a 400).
fn optional_json<T: serde::de::DeserializeOwned + Default>(body: &Bytes, what: &str) -> std::result::Result<T, String> {
    if body.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| format!("{what}: {e}"))
}

/// `POST /api/ca/finish`'s body.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Finish {
    #[serde(default)]
    force: bool,
}

async fn finish_rotation(State(api): State<Api>, body: Bytes) -> Response {
    let wanted: Finish = match optional_json(&body, "a finish request") {
        Ok(wanted) => wanted,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let desk = api.desk.clone();
    let outcome = tokio::task::spawn_blocking(move || desk.finish(wanted.force)).await;
    match outcome {
        Ok(outcome) => rotation_answer(&api, outcome, "finish the rotation").await,
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the finish did not complete: {e}"),
        ),
    }
}

async fn version(State(api): State<Api>) -> Response {
    Json(json!({
        "version": "4",
        "ray_version": RAY_JOB_API_VERSION,
        "ray_commit": format!("regatta-{}", env!("CARGO_PKG_VERSION")),
        "session_name": api.manager.session_name(),
    }))
    .into_response()
}

async fn package_exists(State(api): State<Api>, Path((protocol, name)): Path<(String, String)>) -> Response {
    if let Err(e) = packages::parse_name(&protocol, &name) {
        return e.into_response();
    }
    if api.manager.packages().exists(&name) {
        Json(json!({ "exists": true })).into_response()
    } else {
        error(
            StatusCode::NOT_FOUND,
            format!("Package {protocol}://{name} does not exist"),
        )
    }
}

async fn package_upload(
    State(api): State<Api>,
    Path((protocol, name)): Path<(String, String)>,
    request: Request,
) -> Response {
    let address = match packages::parse_name(&protocol, &name) {
        Ok(address) => address,
        Err(e) => return e.into_response(),
    };
    let store = api.manager.packages().clone();
    let received = store.incoming();
    let sha1 = match receive(request.into_body(), &received, api.manager.max_package_bytes()).await {
        Ok(sha1) => sha1,
        Err(e) => {
            let _ = tokio::fs::remove_file(&received).await;
            return e.into_response();
        }
    };
    let stored = name.clone();
    match tokio::task::spawn_blocking(move || store.accept(&received, &stored, address, sha1)).await {
        Ok(Ok(())) => {
            tracing::info!(package = %name, "package stored");
            Json(json!({ "stored": format!("{protocol}://{name}") })).into_response()
        }
        Ok(Err(e)) => e.into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("checking the package failed: {e}"),
        ),
    }
}

/// Writes an upload to `path` while hashing it; refuses (after draining a little, so the
/// client reads why) one over `limit` bytes.
async fn receive(body: Body, path: &std::path::Path, limit: u64) -> std::result::Result<[u8; 20], JobError> {
    use futures::StreamExt;
    use sha1::Digest;
    use tokio::io::AsyncWriteExt;
    let mut file = tokio::fs::File::create(path)
        .await
        .map_err(|e| JobError::Internal(format!("cannot create {}: {e}", path.display())))?;
    let mut stream = body.into_data_stream();
    let mut hasher = sha1::Sha1::new();
    let mut seen = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| JobError::Invalid(format!("cannot read the upload: {e}")))?;
        seen = seen.saturating_add(chunk.len() as u64);
        if seen > limit {
            if seen > limit + DRAIN_BYTES as u64 {
                break;
            }
            continue;
        }
        hasher.update(&chunk);
        file.write_all(&chunk)
            .await
            .map_err(|e| JobError::Internal(format!("cannot write {}: {e}", path.display())))?;
    }
    if seen > limit {
        return Err(JobError::TooLarge(format!(
            "the package is larger than the limit of {limit} bytes"
        )));
    }
    file.flush()
        .await
        .map_err(|e| JobError::Internal(format!("cannot write {}: {e}", path.display())))?;
    Ok(hasher.finalize().into())
}

async fn list(State(api): State<Api>) -> Response {
    let records: Vec<_> = api
        .manager
        .list()
        .into_iter()
        .map(regatta_proto::JobRecord::without_env_values)
        .collect();
    Json(records).into_response()
}

async fn status(State(api): State<Api>, Path(id): Path<String>) -> Response {
    match api.manager.get(&id) {
        Ok(record) => Json(record.without_env_values()).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(serde::Deserialize)]
struct LogQuery {
    offset: Option<u64>,
}

async fn logs(
    State(api): State<Api>,
    Path(id): Path<String>,
    query: std::result::Result<Query<LogQuery>, QueryRejection>,
) -> Response {
    let offset = match query {
        Ok(Query(query)) => query.offset,
        Err(rejection) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("bad query string: {}", rejection.body_text()),
            )
        }
    };
    if let Some(offset) = offset {
        let record = match api.manager.get(&id) {
            Ok(record) => record,
            Err(e) => return e.into_response(),
        };
        let (mut chunk, mut next) = read_from(&api.manager.log_path(&id), offset);
        // A chunk cut inside a character keeps that character for the next read.
        let whole = utf8_prefix_len(&chunk);
        next -= (chunk.len() - whole) as u64;
        chunk.truncate(whole);
        return Json(json!({
            "logs": String::from_utf8_lossy(&chunk),
            "offset": next,
            "ended": record.status.is_terminal(),
        }))
        .into_response();
    }
    match api.manager.logs(&id) {
        Ok(bytes) => Json(json!({ "logs": String::from_utf8_lossy(&bytes) })).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn stop(State(api): State<Api>, Path(id): Path<String>) -> Response {
    match api.manager.stop(&id).await {
        Ok(stopped) => Json(json!({ "stopped": stopped })).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn delete(State(api): State<Api>, Path(id): Path<String>) -> Response {
    match api.manager.delete(&id) {
        Ok(()) => Json(json!({ "deleted": true })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Streams the log as it grows; the stream ends once the job has ended and everything
/// written has been sent. A websocket upgrade (Ray's `tail_job_logs`) gets the same bytes
/// as text frames, then a normal close (1000).
async fn tail(
    State(api): State<Api>,
    Path(id): Path<String>,
    upgrade: std::result::Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    if let Err(e) = api.manager.get(&id) {
        return e.into_response();
    }
    if let Ok(upgrade) = upgrade {
        let manager = api.manager.clone();
        return upgrade.on_upgrade(move |socket| tail_websocket(socket, manager, id));
    }
    let path = api.manager.log_path(&id);
    let changes = api.manager.subscribe();
    let state = (api.manager.clone(), id, path, 0u64, changes, false);
    let stream = futures::stream::unfold(state, |(manager, id, path, offset, mut changes, done)| async move {
        if done {
            return None;
        }
        loop {
            let ended = manager.get(&id).map(|r| r.status.is_terminal()).unwrap_or(true);
            let (chunk, next) = read_from(&path, offset);
            if !chunk.is_empty() {
                return Some((
                    Ok::<Bytes, std::io::Error>(Bytes::from(chunk)),
                    (manager, id, path, next, changes, false),
                ));
            }
            if ended {
                return None;
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), changes.changed()).await;
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "cannot build the log stream"))
}

/// Sends the log as text frames until the job has ended and all of it was sent.
async fn tail_websocket(mut socket: WebSocket, manager: JobManager, id: String) {
    let path = manager.log_path(&id);
    let mut changes = manager.subscribe();
    let mut offset = 0u64;
    loop {
        let ended = manager.get(&id).map(|r| r.status.is_terminal()).unwrap_or(true);
        let (mut chunk, mut next) = read_from(&path, offset);
        let whole = utf8_prefix_len(&chunk);
        // A character cut at the end waits for its other bytes, unless nothing more comes.
        if whole > 0 || ended {
            if !ended {
                next -= (chunk.len() - whole) as u64;
                chunk.truncate(whole);
            }
            if !chunk.is_empty() {
                let text = String::from_utf8_lossy(&chunk).into_owned();
                if socket.send(Message::Text(text.into())).await.is_err() {
                    return;
                }
                offset = next;
                continue;
            }
        }
        if ended {
            break;
        }
        let _ = tokio::time::timeout(Duration::from_millis(500), changes.changed()).await;
    }
    let close = CloseFrame {
        code: 1000,
        reason: "the job ended".into(),
    };
    let _ = socket.send(Message::Close(Some(close))).await;
}

/// The length of `bytes` without a character cut at its end (invalid bytes elsewhere stay
/// and show as replacement characters).
fn utf8_prefix_len(bytes: &[u8]) -> usize {
    match std::str::from_utf8(bytes) {
        Ok(_) => bytes.len(),
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => bytes.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_very_token_matches() {
        let token = b"0123456789abcdef0123456789abcdef01234567";
        assert!(tokens_match(token, token));
        assert!(!tokens_match(&token[..39], token), "a prefix");
        assert!(!tokens_match(b"", token));
        let mut other = *token;
        other[39] ^= 1;
        assert!(!tokens_match(&other, token), "one bit off");
    }

    fn chunked(sizes: &[usize]) -> Body {
        let chunks: Vec<std::result::Result<Bytes, std::io::Error>> =
            sizes.iter().map(|&n| Ok(Bytes::from(vec![b'x'; n]))).collect();
        Body::from_stream(futures::stream::iter(chunks))
    }

    #[tokio::test]
    async fn a_body_within_the_limit_is_read_whole() {
        let body = read_capped(chunked(&[3, 4, 3]), 10, 100)
            .await
            .ok()
            .expect("within the limit");
        assert_eq!(body.len(), 10);
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_drained_then_refused() {
        assert!(matches!(
            read_capped(chunked(&[6, 5]), 10, 100).await,
            Err(BodyError::TooLarge)
        ));
        assert!(matches!(
            read_capped(chunked(&[60, 60, 60]), 10, 100).await,
            Err(BodyError::TooLarge)
        ));
    }

    #[tokio::test]
    async fn a_failing_body_says_why() {
        let chunks: Vec<std::result::Result<Bytes, std::io::Error>> =
            vec![Ok(Bytes::from_static(b"ab")), Err(std::io::Error::other("cut short"))];
        match read_capped(Body::from_stream(futures::stream::iter(chunks)), 10, 100).await {
            Err(BodyError::Read(reason)) => assert!(reason.contains("cut short"), "{reason}"),
            _ => panic!("a failing body must be a read error"),
        }
    }
}
