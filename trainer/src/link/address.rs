//! Where a rank's previous neighbour reaches it ([`RingAddress`]): its QUIC endpoint, its
//! TCP port and its Unix socket with the host that socket is valid on, in the text form
//! that travels through the driver.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use regatta_object_store::HostKey;

use crate::collective::LinkError;

/// Where a rank's previous neighbour reaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingAddress {
    /// The QUIC endpoint.
    pub quic: SocketAddr,
    /// The TCP port of sealed-frame links, when the rank offers one.
    pub tcp: Option<SocketAddr>,
    /// The Unix socket, for ranks on the same host.
    pub local: Option<LocalAddress>,
}

/// A rank's Unix socket and the host it is valid on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalAddress {
    /// The kernel and PID namespace the socket lives in.
    pub host: HostKey,
    /// The socket's path.
    pub path: PathBuf,
}

impl fmt::Display for RingAddress {
    /// `quic=<addr>;tcp=<addr>;host=<hex>;unix=<path>` (the path last: it may hold any
    /// character); `tcp` and `host`/`unix` only when offered.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quic={}", self.quic)?;
        if let Some(tcp) = self.tcp {
            write!(f, ";tcp={tcp}")?;
        }
        if let Some(local) = &self.local {
            write!(
                f,
                ";host={};unix={}",
                crate::hex::encode(&local.host.to_bytes()),
                local.path.display()
            )?;
        }
        Ok(())
    }
}

impl FromStr for RingAddress {
    type Err = LinkError;

    /// Reads the [`Display`](fmt::Display) form back; a bare socket address is a QUIC-only
    /// address.
    fn from_str(text: &str) -> Result<Self, LinkError> {
        let bad = |why: &str| LinkError(format!("bad ring address {text:?}: {why}"));
        let Some(rest) = text.strip_prefix("quic=") else {
            let quic = text.parse().map_err(|e| bad(&format!("{e}")))?;
            return Ok(Self {
                quic,
                tcp: None,
                local: None,
            });
        };
        let (network, local) = match rest.split_once(";host=") {
            None => (rest, None),
            Some((network, local)) => (network, Some(local)),
        };
        let (quic, tcp) = match network.split_once(";tcp=") {
            None => (network, None),
            Some((quic, tcp)) => (quic, Some(tcp.parse().map_err(|e| bad(&format!("{e}")))?)),
        };
        let quic = quic.parse().map_err(|e| bad(&format!("{e}")))?;
        let local = match local {
            None => None,
            Some(local) => {
                let (host, path) = local
                    .split_once(";unix=")
                    .ok_or_else(|| bad("a host without a socket path"))?;
                let host: [u8; HostKey::LEN] = crate::hex::decode(host)
                    .and_then(|bytes| bytes.try_into().ok())
                    .ok_or_else(|| bad("the host key is not 24 hex bytes"))?;
                if path.is_empty() {
                    return Err(bad("an empty socket path"));
                }
                Some(LocalAddress {
                    host: HostKey::from_bytes(&host),
                    path: PathBuf::from(path),
                })
            }
        };
        Ok(Self { quic, tcp, local })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_addresses_round_trip_and_bad_ones_are_refused() {
        let local = RingAddress {
            quic: "10.0.0.2:4711".parse().unwrap(),
            tcp: Some("10.0.0.2:4712".parse().unwrap()),
            local: Some(LocalAddress {
                host: HostKey::from_bytes(&[9; HostKey::LEN]),
                path: PathBuf::from("/tmp/a dir;with=odd chars/ring.sock"),
            }),
        };
        assert_eq!(local.to_string().parse::<RingAddress>().unwrap(), local);
        let quic = RingAddress {
            quic: "[::1]:9".parse().unwrap(),
            tcp: None,
            local: None,
        };
        assert_eq!(quic.to_string(), "quic=[::1]:9");
        assert_eq!(quic.to_string().parse::<RingAddress>().unwrap(), quic);
        // A bare socket address, as older ranks reported it.
        assert_eq!("[::1]:9".parse::<RingAddress>().unwrap(), quic);
        for bad in [
            "",
            "quic=nowhere",
            "quic=1.2.3.4:5;tcp=nowhere",
            "quic=1.2.3.4:5;host=zz;unix=/x",
            "quic=1.2.3.4:5;host=0909;unix=/x",
            "quic=1.2.3.4:5;host=090909090909090909090909090909090909090909090909",
            "quic=1.2.3.4:5;host=090909090909090909090909090909090909090909090909;unix=",
        ] {
            let err = bad.parse::<RingAddress>().unwrap_err();
            assert!(err.0.contains("bad ring address"), "{bad}: {err}");
        }
    }
}
