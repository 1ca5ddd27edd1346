//! Serving an axum router in the background: the one place that binds HTTP listeners.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use tokio_rustls::rustls::ServerConfig;

use crate::error::{Error, Result};
use crate::net::https::TlsIncoming;

/// Binds `bind`, serves `app` on a background task (over TLS with `tls`, else plain
/// HTTP), and returns the bound address; `what` names the service in errors and logs.
pub(crate) async fn serve(
    app: Router,
    bind: SocketAddr,
    what: &'static str,
    tls: Option<Arc<ServerConfig>>,
) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .map_err(|e| Error::io(format!("cannot listen for the {what} on {bind}"), e))?;
    let address = listener
        .local_addr()
        .map_err(|e| Error::io(format!("{what} address"), e))?;
    match tls {
        None => {
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(error = %e, "the {what} stopped");
                }
            });
        }
        Some(config) => {
            let incoming = TlsIncoming::new(listener, config, what)?;
            tokio::spawn(async move {
                if let Err(e) = axum::serve(incoming, app).await {
                    tracing::error!(error = %e, "the {what} stopped");
                }
            });
        }
    }
    Ok(address)
}
