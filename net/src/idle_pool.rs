//! Connections kept open between fetches, per peer: at most a few each, and every use of
//! the pool drops those idle past a limit, so a peer that left (a node scaled away, a
//! restarted worker on a new port) does not keep its descriptors in a process that goes
//! on fetching from others. (A process that stops fetching keeps what it has until it
//! fetches again; the holders' keep-alives still notice dead peers.) Plain bookkeeping:
//! the caller passes the time.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long a connection may sit unused before it is closed.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_secs(60);

/// Idle connections by peer, newest last.
pub(crate) struct IdlePool<T> {
    per_peer: usize,
    limit: Duration,
    peers: HashMap<SocketAddr, Vec<(Instant, T)>>,
}

impl<T> IdlePool<T> {
    /// A pool keeping at most `per_peer` connections per peer, each at most `limit` idle.
    pub(crate) fn new(per_peer: usize, limit: Duration) -> Self {
        Self {
            per_peer,
            limit,
            peers: HashMap::new(),
        }
    }

    /// The most recently used connection to `peer` that has not been idle too long.
    pub(crate) fn take(&mut self, peer: SocketAddr, now: Instant) -> Option<T> {
        self.expire(now);
        let streams = self.peers.get_mut(&peer)?;
        let (_, stream) = streams.pop()?;
        if streams.is_empty() {
            self.peers.remove(&peer);
        }
        Some(stream)
    }

    /// Keeps `stream` for the next fetch from `peer`, unless the peer already has its
    /// share (then it is dropped, which closes it).
    pub(crate) fn put(&mut self, peer: SocketAddr, stream: T, now: Instant) {
        self.expire(now);
        let streams = self.peers.entry(peer).or_default();
        if streams.len() < self.per_peer {
            streams.push((now, stream));
        }
    }

    /// Connections kept, over all peers.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.peers.values().map(Vec::len).sum()
    }

    /// Drops every connection idle for longer than the limit, and peers left with none.
    fn expire(&mut self, now: Instant) {
        let limit = self.limit;
        self.peers.retain(|_, streams| {
            streams.retain(|(since, _)| now.saturating_duration_since(*since) <= limit);
            !streams.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn the_newest_connection_is_reused_and_a_peer_keeps_at_most_its_share() {
        let now = Instant::now();
        let mut pool = IdlePool::new(2, IDLE_LIMIT);
        for stream in 1..=3 {
            pool.put(peer(1), stream, now);
        }
        assert_eq!(pool.len(), 2, "the third is closed");
        assert_eq!(pool.take(peer(1), now), Some(2));
        assert_eq!(pool.take(peer(1), now), Some(1));
        assert_eq!(pool.take(peer(1), now), None);
        assert_eq!(pool.take(peer(2), now), None);
    }

    #[test]
    fn connections_idle_past_the_limit_are_closed_and_a_peer_that_left_is_forgotten() {
        let start = Instant::now();
        let mut pool = IdlePool::new(8, Duration::from_secs(60));
        pool.put(peer(1), "gone", start);
        pool.put(peer(2), "old", start);
        pool.put(peer(2), "recent", start + Duration::from_secs(50));
        let later = start + Duration::from_secs(61);
        // Any use of the pool drops what expired, for every peer.
        pool.put(peer(3), "new", later);
        assert_eq!(pool.len(), 2, "only the recent and the new are kept");
        assert_eq!(pool.take(peer(1), later), None, "the peer that left is forgotten");
        assert_eq!(pool.take(peer(2), later), Some("recent"));
        assert_eq!(pool.take(peer(2), later), None);
        assert_eq!(pool.take(peer(3), later), Some("new"));
        assert_eq!(pool.len(), 0);
        assert!(pool.peers.is_empty(), "no empty entries stay behind");
    }
}
