//! Serving an axum router in the background: the one place that binds HTTP listeners.

use std::net::SocketAddr;

use axum::Router;

use crate::error::{Error, Result};

/// Binds `bind`, serves `app` on a background task, and returns the bound address;
/// `what` names the service in errors and logs.
pub(crate) async fn serve(app: Router, bind: SocketAddr, what: &'static str) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .map_err(|e| Error::io(format!("cannot listen for the {what} on {bind}"), e))?;
    let address = listener
        .local_addr()
        .map_err(|e| Error::io(format!("{what} address"), e))?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the {what} stopped");
        }
    });
    Ok(address)
}
