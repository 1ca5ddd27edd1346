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
    /// The dashboard's sessions and the failed sign-ins per source.
    pub(crate) login: Arc<std::sync::Mutex<Login>>,
    /// Whether the port serves HTTPS (session cookies are then `Secure`).
    pub(crate) https: bool,
}

/// The sign-in bookkeeping ([`super::login`]).
#[derive(Debug, Default)]
pub(crate) struct Login {
    pub(crate) sessions: super::login::Sessions,
    pub(crate) throttle: regatta_net::Throttle,
}

impl Api {
    /// The sign-in bookkeeping, locked.
    pub(crate) fn login(&self) -> std::sync::MutexGuard<'_, Login> {
        self.login.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An error answer: `{"error": message}` with `status`.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}
