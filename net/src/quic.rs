//! A QUIC endpoint with mutual TLS from the cluster token, tuned for bulk transfers: the
//! trainer's ring links between hosts use it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, VarInt};

use crate::error::{Error, Result};
use crate::identity::TlsIdentity;

fn transport() -> Arc<quinn::TransportConfig> {
    let mut config = quinn::TransportConfig::default();
    config.stream_receive_window(VarInt::from_u32(64 << 20));
    config.receive_window(VarInt::from_u32(256 << 20));
    config.send_window(256 << 20);
    config.max_concurrent_bidi_streams(VarInt::from_u32(1024));
    // A peer that stops answering (killed, cut off) fails its transfers within 10 s; the
    // keep-alives hold idle connections open meanwhile.
    config.keep_alive_interval(Some(Duration::from_secs(2)));
    config.max_idle_timeout(Some(VarInt::from_u32(10_000).into()));
    config.initial_mtu(1452);
    Arc::new(config)
}

/// A QUIC endpoint that accepts and opens connections only with holders of the cluster
/// token (mutual TLS), tuned for bulk transfers.
pub fn endpoint(bind: SocketAddr, identity: &TlsIdentity) -> Result<Endpoint> {
    let server_crypto = QuicServerConfig::try_from(identity.server.clone())
        .map_err(|e| Error::Transfer(format!("server TLS config: {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport());
    let client_crypto = QuicClientConfig::try_from(identity.client.clone())
        .map_err(|e| Error::Transfer(format!("client TLS config: {e}")))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport());
    let mut endpoint =
        Endpoint::server(server, bind).map_err(|e| Error::Transfer(format!("cannot bind UDP {bind}: {e}")))?;
    endpoint.set_default_client_config(client);
    Ok(endpoint)
}
