//! The two sockets the call channel runs over: TCP, and for a caller in the same kernel and
//! network namespace an abstract Unix socket (no file to clean up; gone with the process),
//! whose round trip costs the kernel well under half of loopback TCP's. TLS runs over both.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

pub(crate) use regatta_net::keep_alive;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixListener, UnixStream};

/// Where a node's call channel listens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CallAddress {
    /// `host:port` for any caller.
    pub(crate) tcp: String,
    /// The abstract Unix socket, for callers on the same host.
    pub(crate) local: Option<LocalAddress>,
}

/// An abstract Unix socket and the host it is reachable from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LocalAddress {
    /// [`this_host`] of the listening process.
    pub(crate) host: String,
    /// The socket's abstract name (without the leading NUL).
    pub(crate) name: String,
}

/// This process's kernel boot and network namespace: two processes with the same value
/// reach each other's abstract Unix sockets. `None` where `/proc` does not say.
pub(crate) fn this_host() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = std::fs::metadata("/proc/self/ns/net").ok()?.ino();
    Some(format!("{}/{net}", boot.trim()))
}

/// Binds a fresh abstract Unix socket; returns it and its name.
pub(crate) fn bind_local() -> io::Result<(UnixListener, String)> {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("regatta-calls-{}", crate::net::node::random_hex(12));
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&address)?;
    listener.set_nonblocking(true)?;
    Ok((UnixListener::from_std(listener)?, name))
}

/// Connects to the abstract Unix socket `name`.
pub(crate) fn connect_local(name: &str) -> io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    // A Unix connect completes at once or fails (no network in between).
    let stream = std::os::unix::net::UnixStream::connect_addr(&address)?;
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

/// Which socket a connection runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transport {
    Tcp,
    Unix,
}

/// A connected socket of either kind.
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    pub(crate) fn transport(&self) -> Transport {
        match self {
            Socket::Tcp(_) => Transport::Tcp,
            Socket::Unix(_) => Transport::Unix,
        }
    }
}

impl AsyncRead for Socket {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Socket::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Socket::Tcp(s) => s.is_write_vectored(),
            Socket::Unix(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
