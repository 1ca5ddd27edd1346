//! The Unix-socket transport between ranks on one host: the listener in a directory only
//! this user can enter, the HMAC challenge each way that proves the ring's secret, and the
//! messages' bytes written and read straight from and into the caller's values.

use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use hmac::{Hmac, Mac};
use regatta_object_store::HostKey;
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{as_bytes_mut, check_count, HANDSHAKE_TIMEOUT};
use crate::collective::LinkError;

/// Length of each side's challenge and of an HMAC-SHA256 tag.
const NONCE_LEN: usize = 32;

/// A Unix listener in a directory only this user can enter; the directory goes with it.
pub(super) struct LocalListener {
    listener: tokio::net::UnixListener,
    pub(super) host: HostKey,
    dir: PathBuf,
    pub(super) path: PathBuf,
}

impl LocalListener {
    pub(super) fn bind() -> std::io::Result<Option<Self>> {
        let Some(host) = HostKey::this_process() else {
            return Ok(None);
        };
        let mut suffix = [0u8; 8];
        getrandom::getrandom(&mut suffix).map_err(|e| std::io::Error::other(e.to_string()))?;
        let dir = std::env::temp_dir().join(format!("regatta-ring-{}", crate::hex::encode(&suffix)));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let path = dir.join("ring.sock");
        let listener = match tokio::net::UnixListener::bind(&path) {
            Ok(listener) => listener,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(Some(Self {
            listener,
            host,
            dir,
            path,
        }))
    }

    /// The previous rank's connection on this socket, once it proved the ring's secret;
    /// a peer that fails the handshake is refused and the socket listens on.
    pub(super) async fn accept(&self, secret: &[u8]) -> Result<UnixStream, LinkError> {
        loop {
            let mut stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // QUIC may still bring the previous rank in.
                    tracing::warn!("ring: the Unix socket stopped accepting ({e}); waiting on QUIC");
                    return std::future::pending().await;
                }
            };
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, prove_as_listener(&mut stream, secret)).await {
                Ok(Ok(())) => return into_blocking(stream),
                Ok(Err(e)) => tracing::warn!("ring: refused a Unix-socket peer: {e}"),
                Err(_) => tracing::warn!("ring: a Unix-socket peer did not finish the handshake"),
            }
        }
    }
}

impl Drop for LocalListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Connects to the next rank's socket at `path` and proves the ring's secret to it.
pub(super) async fn connect(path: &std::path::Path, secret: &[u8]) -> Result<UnixStream, LinkError> {
    let mut stream = tokio::net::UnixStream::connect(path)
        .await
        .map_err(|e| LinkError(e.to_string()))?;
    tokio::time::timeout(HANDSHAKE_TIMEOUT, prove_as_connector(&mut stream, secret))
        .await
        .map_err(|_| LinkError("the next rank did not finish the handshake".into()))??;
    into_blocking(stream)
}

type HmacSha256 = Hmac<Sha256>;

fn tag(secret: &[u8], role: &[u8], nonce: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(b"regatta ring link v1 ");
    mac.update(role);
    mac.update(nonce);
    mac
}

fn nonce() -> Result<[u8; NONCE_LEN], LinkError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce).map_err(|e| LinkError(format!("no randomness: {e}")))?;
    Ok(nonce)
}

/// The listener's side: challenge, check the connector's answer, answer its challenge, wait
/// for its confirmation.
async fn prove_as_listener(stream: &mut tokio::net::UnixStream, secret: &[u8]) -> Result<(), LinkError> {
    let io = |e: std::io::Error| LinkError(e.to_string());
    let challenge = nonce()?;
    stream.write_all(&challenge).await.map_err(io)?;
    let mut answer = [0u8; 2 * NONCE_LEN];
    stream.read_exact(&mut answer).await.map_err(io)?;
    let (their_challenge, their_tag) = answer.split_at(NONCE_LEN);
    tag(secret, b"connect", &challenge)
        .verify_slice(their_tag)
        .map_err(|_| LinkError("the peer does not hold the ring's secret".into()))?;
    let ours = tag(secret, b"accept", their_challenge).finalize().into_bytes();
    stream.write_all(&ours).await.map_err(io)?;
    // The connector confirms it took the answer: only then is the stream the link (a
    // connector that gave up in between goes to QUIC, which is still being accepted).
    let mut confirmed = [0u8; 1];
    stream.read_exact(&mut confirmed).await.map_err(io)?;
    if confirmed != [1] {
        return Err(LinkError("the peer did not confirm the handshake".into()));
    }
    Ok(())
}

/// The connector's side: answer the listener's challenge with one of its own, check its
/// answer, confirm.
async fn prove_as_connector(stream: &mut tokio::net::UnixStream, secret: &[u8]) -> Result<(), LinkError> {
    let io = |e: std::io::Error| LinkError(e.to_string());
    let mut challenge = [0u8; NONCE_LEN];
    stream.read_exact(&mut challenge).await.map_err(io)?;
    let ours = nonce()?;
    let mut answer = [0u8; 2 * NONCE_LEN];
    answer[..NONCE_LEN].copy_from_slice(&ours);
    answer[NONCE_LEN..].copy_from_slice(&tag(secret, b"connect", &challenge).finalize().into_bytes());
    stream.write_all(&answer).await.map_err(io)?;
    let mut their_tag = [0u8; NONCE_LEN];
    stream.read_exact(&mut their_tag).await.map_err(io)?;
    tag(secret, b"accept", &ours)
        .verify_slice(&their_tag)
        .map_err(|_| LinkError("the next rank does not hold the ring's secret".into()))?;
    stream.write_all(&[1]).await.map_err(io)
}

fn into_blocking(stream: tokio::net::UnixStream) -> Result<UnixStream, LinkError> {
    let stream = stream.into_std().map_err(|e| LinkError(e.to_string()))?;
    stream.set_nonblocking(false).map_err(|e| LinkError(e.to_string()))?;
    Ok(stream)
}

/// Writes a message to a Unix-socket link: its value count, then the values' bytes.
pub(super) fn send(stream: &mut UnixStream, header: &[u8; 8], payload: &[u8]) -> Result<(), LinkError> {
    let failed = |e: std::io::Error| LinkError(format!("send to the next rank failed: {e}"));
    stream.write_all(header).map_err(failed)?;
    stream.write_all(payload).map_err(failed)
}

/// Reads a message of exactly `out.len()` values from a Unix-socket link straight into `out`.
pub(super) fn recv(stream: &mut UnixStream, out: &mut [f32]) -> Result<(), LinkError> {
    let mut header = [0u8; 8];
    let failed = |e: std::io::Error| LinkError(format!("receive from the previous rank failed: {e}"));
    stream.read_exact(&mut header).map_err(failed)?;
    check_count(header, out.len())?;
    stream.read_exact(as_bytes_mut(out)).map_err(failed)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    use super::*;
    use crate::link::tests::{local, runtime};
    use crate::link::{Incoming, RingLinkBuilder};

    #[test]
    fn a_unix_peer_without_the_secret_is_refused_by_the_listener() {
        let runtime = runtime();
        runtime.block_on(async {
            let member = RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", local()).unwrap();
            let address = member.address().unwrap();
            let path = address.local.unwrap().path;
            let strangers = async {
                let mut stranger = tokio::net::UnixStream::connect(&path).await.unwrap();
                let refused = prove_as_connector(&mut stranger, b"other-token").await;
                assert!(refused.is_err(), "a wrong secret must not pass the handshake");
                // Garbage gets no answer either, and the listener goes on listening.
                let mut garbage = tokio::net::UnixStream::connect(&path).await.unwrap();
                let mut challenge = [0u8; NONCE_LEN];
                garbage.read_exact(&mut challenge).await.unwrap();
                garbage.write_all(&[7u8; 2 * NONCE_LEN]).await.unwrap();
                let mut reply = Vec::new();
                let n = garbage.read_to_end(&mut reply).await.unwrap_or(0);
                assert_eq!(n, 0, "the listener answered a peer with a wrong tag");
                // A peer with the secret that leaves before confirming is not taken either.
                let mut quitter = tokio::net::UnixStream::connect(&path).await.unwrap();
                quitter.read_exact(&mut challenge).await.unwrap();
                let mut answer = [0u8; 2 * NONCE_LEN];
                answer[NONCE_LEN..]
                    .copy_from_slice(&tag(b"ring-token", b"connect", &challenge).finalize().into_bytes());
                quitter.write_all(&answer).await.unwrap();
                let mut their_tag = [0u8; NONCE_LEN];
                quitter.read_exact(&mut their_tag).await.unwrap();
                drop(quitter);
                // The member still accepts the real previous rank afterwards.
                let mut friend = tokio::net::UnixStream::connect(&path).await.unwrap();
                prove_as_connector(&mut friend, b"ring-token").await.unwrap();
                friend
            };
            let (accepted, friend) = tokio::time::timeout(Duration::from_secs(30), async {
                tokio::join!(member.accept_previous(), strangers)
            })
            .await
            .expect("the handshakes finish");
            let Ok(Incoming::Local(mut accepted)) = accepted else {
                panic!("the real previous rank was not accepted by its Unix socket");
            };
            // The stream taken is the friend's, not the quitter's.
            let mut friend = friend;
            friend.write_all(&[42]).await.unwrap();
            let mut byte = [0u8; 1];
            accepted.read_exact(&mut byte).unwrap();
            assert_eq!(byte, [42]);
        });
    }

    #[test]
    fn the_listeners_directory_is_private_and_removed_once_connected() {
        let runtime = runtime();
        let builders: Vec<RingLinkBuilder> = runtime.block_on(async {
            (0..2)
                .map(|_| RingLinkBuilder::bind("127.0.0.1:0".parse().unwrap(), "ring-token", local()).unwrap())
                .collect()
        });
        let paths: Vec<PathBuf> = builders
            .iter()
            .map(|b| b.address().unwrap().local.unwrap().path)
            .collect();
        for path in &paths {
            let mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        let addresses: Vec<String> = builders.iter().map(|b| b.address().unwrap().to_string()).collect();
        let links = runtime.block_on(async {
            let mut builders = builders.into_iter();
            let (a, b) = (builders.next().unwrap(), builders.next().unwrap());
            tokio::try_join!(a.connect(&addresses[1]), b.connect(&addresses[0])).unwrap()
        });
        for path in &paths {
            assert!(!path.parent().unwrap().exists(), "{} is left behind", path.display());
        }
        drop(links);
    }
}
