//! Bookkeeping of the TLS handshakes (or connections) under way on one listener: at most a
//! fixed number at once, and at most a quarter of them from any one source, so that silent
//! connections from one host cannot shut every other node out. A source is an IPv4 /24 or
//! an IPv6 /64 (one host commonly holds a whole /64, one network a /24), so that a sender
//! cannot multiply its share by using its neighbouring addresses. Pure; the accept loops of the
//! cluster port and the job API (`regatta-runtime`), of the call channel and of the object
//! transfer hold a [`Slot`] for each handshake, from accept until it finishes, and the HTTP
//! endpoints one for each connection.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Handshakes under way at once on one listener. Each waiting one costs a task and a
/// socket, so the cap is high: holding it full takes a thousand silent connections
/// renewed every handshake deadline.
pub const MAX_HANDSHAKES: usize = 1024;

/// Handshakes under way at once from one source address.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = MAX_HANDSHAKES / 4;

/// Why a connection gets no handshake slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// Every slot is taken.
    Full,
    /// This source holds its share.
    SourceFull,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Full => write!(f, "every slot of the listener is taken"),
            Self::SourceFull => write!(
                f,
                "this address (or its IPv6 /64) holds its share of the listener's slots"
            ),
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

/// The slots of one listener; cheap to clone.
#[derive(Clone, Debug)]
pub struct HandshakeSlots {
    counts: Arc<Mutex<Counts>>,
    max_total: usize,
    max_per_source: usize,
}

/// One handshake's slot, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    counts: Arc<Mutex<Counts>>,
    source: IpAddr,
}

impl Default for HandshakeSlots {
    fn default() -> Self {
        Self::new()
    }
}

impl HandshakeSlots {
    /// Slots with the listener caps.
    pub fn new() -> Self {
        Self::with_limits(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE)
    }

    /// Slots with other caps: `max_total` at once, `max_per_source` from one source.
    pub fn with_limits(max_total: usize, max_per_source: usize) -> Self {
        Self {
            counts: Arc::default(),
            max_total,
            max_per_source,
        }
    }

    /// A slot for a handshake from `source`, or why there is none.
    pub fn take(&self, source: IpAddr) -> Result<Slot, Refusal> {
        let source = source_of(source);
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if counts.total >= self.max_total {
            return Err(Refusal::Full);
        }
        let from_source = counts.by_source.entry(source).or_insert(0);
        if *from_source >= self.max_per_source {
            return Err(Refusal::SourceFull);
        }
        *from_source += 1;
        counts.total += 1;
        Ok(Slot {
            counts: self.counts.clone(),
            source,
        })
    }
}

/// The source an address counts against: an IPv4 address (IPv4-mapped IPv6 included) as
/// its /24, an IPv6 address as its /64.
pub fn source_of(address: IpAddr) -> IpAddr {
    let v4 = |v4: std::net::Ipv4Addr| IpAddr::V4(std::net::Ipv4Addr::from(v4.to_bits() & !0xff));
    match address {
        IpAddr::V4(address) => v4(address),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(address) => v4(address),
            None => IpAddr::V6(std::net::Ipv6Addr::from(v6.to_bits() & !((1u128 << 64) - 1))),
        },
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.by_source.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.by_source.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An address of its own /24 for each `net`.
    fn ip(net: u8) -> IpAddr {
        IpAddr::from([10, 0, net, 1])
    }

    #[test]
    fn one_source_cannot_take_the_slots_of_the_others() {
        let slots = HandshakeSlots::with_limits(4, 2);
        let a1 = slots.take(ip(1)).expect("first from a");
        let _a2 = slots.take(ip(1)).expect("second from a");
        assert_eq!(slots.take(ip(1)).err(), Some(Refusal::SourceFull));
        let _b1 = slots.take(ip(2)).expect("b has its own share");
        let _c1 = slots.take(ip(3)).expect("c too");
        assert_eq!(slots.take(ip(4)).err(), Some(Refusal::Full));
        drop(a1);
        let _a3 = slots.take(ip(1)).expect("a slot given back is free again");
    }

    #[test]
    fn addresses_of_one_ipv6_64_or_ipv4_24_share_its_quota() {
        let slots = HandshakeSlots::with_limits(8, 2);
        let host = |last: u16| IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, last]);
        let _a = slots.take(host(1)).expect("first of the /64");
        let _b = slots.take(host(2)).expect("second of the /64");
        assert_eq!(
            slots.take(host(3)).err(),
            Some(Refusal::SourceFull),
            "a third address of that /64"
        );
        let _other = slots
            .take(IpAddr::from([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1]))
            .expect("another /64");
        let mapped: IpAddr = "::ffff:10.0.9.1".parse().expect("an IPv4-mapped address");
        let _m = slots.take(mapped).expect("first from 10.0.9.0/24");
        let _v4 = slots
            .take(IpAddr::from([10, 0, 9, 200]))
            .expect("second from 10.0.9.0/24");
        assert_eq!(
            slots.take(mapped).err(),
            Some(Refusal::SourceFull),
            "one /24, mapped or plain"
        );
        let _next = slots.take(ip(10)).expect("the next /24 has its own share");
    }

    #[test]
    fn slots_given_back_leave_no_trace() {
        let slots = HandshakeSlots::with_limits(2, 1);
        for round in 0..3u8 {
            let held: Vec<Slot> = [ip(round), ip(round + 10)]
                .into_iter()
                .map(|source| slots.take(source).expect("free"))
                .collect();
            drop(held);
        }
        let counts = slots.counts.lock().expect("lock");
        assert_eq!(counts.total, 0);
        assert!(counts.by_source.is_empty(), "{counts:?}");
    }
}
