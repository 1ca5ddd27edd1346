//! What every handler on the head's HTTP port shares (the job API and the dashboard's
//! data): the state they read and the shape of an error answer.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::job_manager::JobManager;
use crate::net::headlink::HeadLink;

/// The state of the head's HTTP handlers.
#[derive(Clone)]
pub(crate) struct Api {
    pub(crate) manager: JobManager,
    pub(crate) link: Arc<HeadLink>,
    /// The cluster token a request's bearer must equal.
    pub(crate) token: String,
    /// The join tokens and the authority (for `/api/join-tokens`).
    pub(crate) desk: Arc<regatta_net::JoinDesk>,
}

/// An error answer: `{"error": message}` with `status`.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}
