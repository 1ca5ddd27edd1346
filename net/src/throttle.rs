//! Throttling failed attempts per source (an IPv4 /24 or an IPv6 /64): the job API's
//! sign-ins and wrong bearers, and the cluster port's joins. Free of I/O; the time is an
//! argument.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Failed attempts a source may make in a burst.
pub const FAILURE_BURST: u32 = 20;
/// How often a source earns back one failed attempt once its burst is spent.
pub const FAILURE_REFILL: Duration = Duration::from_secs(6);
/// Sources kept in the throttle at once (a source whose burst is whole again is forgotten
/// first).
const MAX_SOURCES: usize = 4096;

/// The failed attempts (sign-ins, joins) of each source (an IPv4 /24 or an IPv6 /64): a bucket of
/// [`FAILURE_BURST`] attempts that refills one every [`FAILURE_REFILL`]. A source whose
/// bucket is empty is refused before its credential is looked at, so a guesser learns
/// nothing from attempts past its share; a success empties nothing and forgets the source.
#[derive(Debug)]
pub struct Throttle {
    buckets: HashMap<IpAddr, Bucket>,
    burst: u32,
    refill: Duration,
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    /// Attempts left at `at`.
    left: f64,
    at: Instant,
}

impl Default for Throttle {
    fn default() -> Self {
        Self::new(FAILURE_BURST, FAILURE_REFILL)
    }
}

impl Throttle {
    /// A throttle allowing bursts of `burst` failures, refilled one per `refill`.
    pub fn new(burst: u32, refill: Duration) -> Self {
        Self {
            buckets: HashMap::new(),
            burst: burst.max(1),
            refill: refill.max(Duration::from_millis(1)),
        }
    }

    /// The attempts `source` has left at `now`.
    fn left(&self, source: IpAddr, now: Instant) -> f64 {
        self.buckets
            .get(&crate::source_of(source))
            .map_or(f64::from(self.burst), |b| {
                let earned = now.saturating_duration_since(b.at).as_secs_f64() / self.refill.as_secs_f64();
                (b.left + earned).min(f64::from(self.burst))
            })
    }

    /// Whether `source` may try a credential at `now`; if not, how long until it may.
    pub fn admit(&self, source: IpAddr, now: Instant) -> Result<(), Duration> {
        let left = self.left(source, now);
        if left >= 1.0 {
            return Ok(());
        }
        Err(self.refill.mul_f64(1.0 - left).max(Duration::from_secs(1)))
    }

    /// Counts a failed attempt by `source` at `now`.
    pub fn failed(&mut self, source: IpAddr, now: Instant) {
        let left = (self.left(source, now) - 1.0).max(0.0);
        if self.buckets.len() >= MAX_SOURCES {
            let (burst, refill) = (f64::from(self.burst), self.refill.as_secs_f64());
            self.buckets
                .retain(|_, b| b.left + now.saturating_duration_since(b.at).as_secs_f64() / refill < burst);
            if self.buckets.len() >= MAX_SOURCES {
                if let Some(oldest) = self.buckets.iter().min_by_key(|(_, b)| b.at).map(|(k, _)| *k) {
                    self.buckets.remove(&oldest);
                }
            }
        }
        self.buckets.insert(crate::source_of(source), Bucket { left, at: now });
    }

    /// Forgets `source`'s failures after it signed in.
    pub fn succeeded(&mut self, source: IpAddr) {
        self.buckets.remove(&crate::source_of(source));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_source_has_a_burst_of_failures_then_one_per_refill_and_its_neighbours_share_it() {
        let now = Instant::now();
        let mut throttle = Throttle::new(3, Duration::from_secs(10));
        let a = source("10.1.2.3");
        for _ in 0..3 {
            assert!(throttle.admit(a, now).is_ok());
            throttle.failed(a, now);
        }
        let wait = throttle.admit(a, now).unwrap_err();
        assert_eq!(wait, Duration::from_secs(10));
        // Another address in the same /24 is the same source; another /24 is not.
        assert!(throttle.admit(source("10.1.2.200"), now).is_err());
        assert!(throttle.admit(source("10.1.3.1"), now).is_ok());
        // IPv6: the /64 counts.
        let v6 = source("2001:db8::1");
        for _ in 0..3 {
            throttle.failed(v6, now);
        }
        assert!(throttle.admit(source("2001:db8::ffff"), now).is_err());
        assert!(throttle.admit(source("2001:db8:0:1::1"), now).is_ok());
        // Half a refill later: still shut, and told how long is left.
        let later = now + Duration::from_secs(5);
        assert_eq!(throttle.admit(a, later).unwrap_err(), Duration::from_secs(5));
        // One refill later: one more attempt, and then shut again.
        let later = now + Duration::from_secs(10);
        assert!(throttle.admit(a, later).is_ok());
        throttle.failed(a, later);
        assert!(throttle.admit(a, later).is_err());
        // A sign-in forgets the source.
        throttle.succeeded(a);
        assert!(throttle.admit(a, later).is_ok());
    }

    #[test]
    fn the_throttle_keeps_a_bounded_table_and_forgets_whole_buckets_first() {
        let now = Instant::now();
        let mut throttle = Throttle::new(2, Duration::from_secs(1));
        let shut = source("192.0.2.1");
        throttle.failed(shut, now);
        throttle.failed(shut, now);
        for i in 0..(MAX_SOURCES as u32 + 10) {
            let address = IpAddr::V4(std::net::Ipv4Addr::from((10 << 24) | (i << 8)));
            throttle.failed(address, now + Duration::from_secs(5));
        }
        assert!(throttle.buckets.len() <= MAX_SOURCES);
        // The shut source refilled long ago, so it was among the first forgotten — and
        // forgetting it gives it nothing it would not have had.
        assert!(throttle.admit(shut, now + Duration::from_secs(5)).is_ok());
    }
}
