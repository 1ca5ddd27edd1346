//! The dashboard: the page the head serves at `/` (every script and style from the head
//! itself, no other origin) and the JSON endpoints it reads, which scripts may use too:
//!
//! | method and path | answers |
//! | --- | --- |
//! | `GET /api/cluster` | [`crate::Overview`] plus `jobs` (count by status) |
//! | `GET /api/nodes?offset=&limit=` | a [`crate::Page`] of [`crate::NodeRow`] |
//! | `GET /api/actors?kind=&state=&node=&job=&name=&offset=&limit=` | a page of [`crate::ActorRow`] |
//! | `GET /api/actors/{id}` | one [`crate::ActorRow`] |
//! | `GET /api/actors/{id}/logs` | `{"node", "lines": [{"at_ms", "text"}]}`: its recent lines, from its node's agent |
//! | `GET /api/groups?offset=&limit=` | a page of placement groups |
//! | `GET /api/runs` | every kept run's [`crate::RunSummary`] |
//! | `GET /api/runs/{name}` | one [`crate::RunDetail`] with its points |
//!
//! Pages hold at most [`crate::MAX_PAGE`] rows (100 unless `limit` says). Every endpoint
//! asks for the cluster token like the job API; the page keeps it in the browser session
//! (never in a URL). Requests that change state (`POST`, `DELETE`) from another site are
//! refused (see [`same_origin`]).

use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::api::{error, Api};
use crate::net::node;
use crate::net::wire;
use regatta_proto::LogLine;
use regatta_proto::{ActorFilter, PageRequest, View, ViewQuery};
use regatta_proto::{ActorId, AgentRequest, Failure, HeadRequest};

/// How long an endpoint waits for the head actor.
const VIEW_TIMEOUT: Duration = Duration::from_secs(10);

const INDEX_HTML: &str = include_str!("dashboard/index.html");
const DASHBOARD_JS: &str = include_str!("dashboard/dashboard.js");
const DASHBOARD_CSS: &str = include_str!("dashboard/dashboard.css");

/// What the browser may load and run: only what this head serves.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The page and its assets: no token needed (they hold no data).
pub(crate) fn pages() -> Router {
    let asset =
        |body: &'static str, kind: &'static str| get(move || async move { ([(header::CONTENT_TYPE, kind)], body) });
    Router::new()
        .route("/", asset(INDEX_HTML, "text/html; charset=utf-8"))
        .route("/dashboard.js", asset(DASHBOARD_JS, "text/javascript; charset=utf-8"))
        .route("/dashboard.css", asset(DASHBOARD_CSS, "text/css; charset=utf-8"))
}

/// The data endpoints (the caller adds authentication).
pub(crate) fn endpoints() -> Router<Api> {
    Router::new()
        .route("/api/cluster", get(overview))
        .route("/api/nodes", get(nodes))
        .route("/api/actors", get(actors))
        .route("/api/actors/{id}", get(actor))
        .route("/api/actors/{id}/logs", get(actor_logs))
        .route("/api/groups", get(groups))
        .route("/api/runs", get(runs))
        .route("/api/runs/{name}", get(run))
}

/// Headers on every answer: the content security policy, no MIME sniffing, no framing.
pub(crate) async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Refuses a request that changes state when the browser says it comes from another site
/// (`Sec-Fetch-Site`) or names another origin (`Origin` not this `Host`). Scripts and the
/// CLI send neither header and pass; the page's own requests are same-origin.
pub(crate) async fn same_origin(request: Request, next: Next) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(request).await;
    }
    let headers = request.headers();
    let text = |name| headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    if let Some(site) = text("sec-fetch-site") {
        if site != "same-origin" && site != "none" {
            return error(
                StatusCode::FORBIDDEN,
                format!(
                    "refused a {} from another site (Sec-Fetch-Site: {site})",
                    request.method()
                ),
            );
        }
    }
    if let Some(origin) = text(header::ORIGIN.as_str()) {
        let host = text(header::HOST.as_str()).unwrap_or("");
        let origin_host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or("");
        if origin_host.is_empty() || origin_host != host {
            return error(
                StatusCode::FORBIDDEN,
                format!("refused a {} from origin {origin} (this is {host})", request.method()),
            );
        }
    }
    next.run(request).await
}

async fn ask(api: &Api, query: ViewQuery) -> Result<View, Response> {
    api.link
        .ask::<View>(&HeadRequest::View(query), VIEW_TIMEOUT)
        .await
        .map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, format!("the head did not answer: {e}")))
}

#[derive(Deserialize)]
struct PageQuery {
    offset: Option<usize>,
    limit: Option<usize>,
}

#[derive(Deserialize)]
struct ActorQuery {
    offset: Option<usize>,
    limit: Option<usize>,
    kind: Option<String>,
    state: Option<String>,
    node: Option<String>,
    job: Option<String>,
    name: Option<String>,
}

impl ActorQuery {
    /// The filter and the page the query asks for, checked.
    fn parts(self) -> regatta_proto::Result<(ActorFilter, PageRequest)> {
        let page = PageRequest::new(self.offset, self.limit)?;
        let filter = ActorFilter {
            kind: self.kind,
            state: self.state,
            node: self.node,
            job: self.job,
            name: self.name,
        }
        .checked()?;
        Ok((filter, page))
    }
}

fn bad_query(rejection: QueryRejection) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        format!("bad query string: {}", rejection.body_text()),
    )
}

/// The page a query asks for, or the error response (boxed: a response is large).
fn page_of(query: Result<Query<PageQuery>, QueryRejection>) -> Result<PageRequest, Box<Response>> {
    let Query(query) = query.map_err(|rejection| Box::new(bad_query(rejection)))?;
    PageRequest::new(query.offset, query.limit).map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, e.to_string())))
}

/// Answers `query`'s view as JSON, or `404` when it names nothing.
async fn answer(api: &Api, query: ViewQuery) -> Response {
    let view = match ask(api, query).await {
        Ok(view) => view,
        Err(response) => return response,
    };
    match view {
        View::Overview(overview) => Json(overview).into_response(),
        View::Nodes(page) => Json(page).into_response(),
        View::Actors(page) => Json(page).into_response(),
        View::Groups(page) => Json(page).into_response(),
        View::Runs(runs) => Json(json!({ "runs": runs })).into_response(),
        View::Actor(Some(row)) => Json(row).into_response(),
        View::Run(Some(run)) => Json(run).into_response(),
        View::Actor(None) => error(
            StatusCode::NOT_FOUND,
            "no such actor (dead actors are kept for a while only)",
        ),
        View::Run(None) => error(StatusCode::NOT_FOUND, "no such run"),
    }
}

async fn overview(State(api): State<Api>) -> Response {
    let overview = match ask(&api, ViewQuery::Overview).await {
        Ok(View::Overview(overview)) => overview,
        Ok(_) => return error(StatusCode::INTERNAL_SERVER_ERROR, "the head answered another view"),
        Err(response) => return response,
    };
    let mut jobs = std::collections::BTreeMap::<String, usize>::new();
    for job in api.manager.list() {
        let status = serde_json::to_value(job.status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        *jobs.entry(status).or_default() += 1;
    }
    let mut body = serde_json::to_value(overview).unwrap_or_default();
    body["jobs"] = json!(jobs);
    Json(body).into_response()
}

async fn nodes(State(api): State<Api>, query: Result<Query<PageQuery>, QueryRejection>) -> Response {
    match page_of(query) {
        Ok(page) => answer(&api, ViewQuery::Nodes(page)).await,
        Err(response) => *response,
    }
}

async fn groups(State(api): State<Api>, query: Result<Query<PageQuery>, QueryRejection>) -> Response {
    match page_of(query) {
        Ok(page) => answer(&api, ViewQuery::Groups(page)).await,
        Err(response) => *response,
    }
}

async fn actors(State(api): State<Api>, query: Result<Query<ActorQuery>, QueryRejection>) -> Response {
    let Query(query) = match query {
        Ok(query) => query,
        Err(rejection) => return bad_query(rejection),
    };
    match query.parts() {
        Ok((filter, page)) => answer(&api, ViewQuery::Actors(filter, page)).await,
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

async fn actor(State(api): State<Api>, Path(id): Path<String>) -> Response {
    match id.parse::<u64>() {
        Ok(id) => answer(&api, ViewQuery::Actor(ActorId(id))).await,
        Err(_) => error(StatusCode::BAD_REQUEST, format!("an actor id is a number, not {id:?}")),
    }
}

/// The actor's recent log lines, asked of the agent on the node it runs (or last ran) on.
async fn actor_logs(State(api): State<Api>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>().map(ActorId) else {
        return error(StatusCode::BAD_REQUEST, format!("an actor id is a number, not {id:?}"));
    };
    let row = match ask(&api, ViewQuery::Actor(id)).await {
        Ok(View::Actor(Some(row))) => row,
        Ok(_) => {
            return error(
                StatusCode::NOT_FOUND,
                "no such actor (dead actors are kept for a while only)",
            )
        }
        Err(response) => return response,
    };
    let Some(node) = row.node.or(row.last_node) else {
        return Json(json!({ "node": null, "lines": [] })).into_response();
    };
    let Some(agent) = node::first_member(api.link.scope(), &node::agent_group(&node)) else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("node {node} is not reachable: its log lines went with it"),
        );
    };
    let request = wire::encode(&AgentRequest::Logs(id));
    let lines = match wire::call_raw(&agent, request, VIEW_TIMEOUT).await {
        Ok(reply) => wire::decode::<Result<Vec<LogLine>, Failure>>(&reply, "actor log lines").and_then(|r| r),
        Err(wire::CallError::Unreachable(why) | wire::CallError::NotSent(why)) => Err(Failure::Rejected(why)),
        Err(wire::CallError::Timeout) => Err(Failure::Rejected(format!("no answer in {VIEW_TIMEOUT:?}"))),
    };
    match lines {
        Ok(lines) => Json(json!({ "node": node, "lines": lines })).into_response(),
        Err(failure) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("node {node}'s agent did not answer: {failure:?}"),
        ),
    }
}

async fn runs(State(api): State<Api>) -> Response {
    answer(&api, ViewQuery::Runs).await
}

async fn run(State(api): State<Api>, Path(name): Path<String>) -> Response {
    answer(&api, ViewQuery::Run(name)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `/api/actors` makes of a query string: a page and a filter, or the 400's reason.
    fn parse(query: &str) -> Result<(PageRequest, ActorFilter), String> {
        let uri: axum::http::Uri = format!("/api/actors?{query}").parse().map_err(|e| format!("{e}"))?;
        let Query(query) = Query::<ActorQuery>::try_from_uri(&uri).map_err(|e| e.body_text())?;
        let (filter, page) = query.parts().map_err(|e| e.to_string())?;
        Ok((page, filter))
    }

    #[test]
    fn a_query_string_is_a_page_and_a_filter_or_a_reason() {
        let (page, filter) = parse("offset=5&limit=20&state=alive&name=status-").unwrap();
        assert_eq!((page.offset, page.limit), (5, 20));
        assert_eq!(filter.state.as_deref(), Some("alive"));
        for bad in ["limit=0", "limit=5000", "offset=minus", "state=running"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    /// Bounded fuzzing of the dashboard's query parsing: any query string gives a page
    /// within the bounds and a filter, or a reason; never a panic.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(crate::fuzz_config(1024))]

            #[test]
            fn any_query_string_parses_within_bounds_or_is_refused(
                query in "([a-z_]{0,8}(=[a-zA-Z0-9%+._~-]{0,12})?&?){0,6}",
            ) {
                if let Ok((page, _)) = parse(&query) {
                    prop_assert!((1..=regatta_proto::MAX_PAGE).contains(&page.limit));
                }
            }

            #[test]
            fn any_bytes_as_a_query_string_are_refused_or_parsed(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
                let encoded: String = bytes.iter().map(|b| format!("%{b:02X}")).collect();
                for query in [format!("name={encoded}"), format!("{encoded}={encoded}"), format!("limit={encoded}")] {
                    if let Ok((page, _)) = parse(&query) {
                        prop_assert!((1..=regatta_proto::MAX_PAGE).contains(&page.limit));
                    }
                }
            }

            #[test]
            fn any_offset_and_limit_make_a_bounded_page_or_a_reason(offset in any::<Option<usize>>(), limit in any::<Option<usize>>()) {
                match PageRequest::new(offset, limit) {
                    Ok(page) => prop_assert!((1..=regatta_proto::MAX_PAGE).contains(&page.limit)),
                    Err(e) => prop_assert!(!e.to_string().is_empty()),
                }
            }
        }
    }
}
