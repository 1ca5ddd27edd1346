//! Signing in to the head's HTTP port: the admin token traded for an expiring session
//! cookie (the dashboard keeps no credential a script can read), and failed attempts
//! throttled per source. The bookkeeping ([`Sessions`], [`Throttle`]) is free of I/O and
//! takes the time as an argument; the handlers in [`super::job_api`] are thin around it.
//!
//! | method and path | does |
//! | --- | --- |
//! | `POST /api/login` | body `{"token"}`: the admin token; `200 {"expires_unix"}` with `Set-Cookie: regatta_session=...; HttpOnly; SameSite=Strict; Path=/` (`Secure` over HTTPS) |
//! | `POST /api/logout` | ends the cookie's session: `{"signed_out": bool}` |

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "regatta_session";
/// How long a session lasts from its sign-in.
pub(crate) const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// Sessions kept at once; signing in past this ends the one closest to its end.
pub(crate) const MAX_SESSIONS: usize = 1024;

/// Failed attempts a source may make in a burst.
pub(crate) const FAILURE_BURST: u32 = 20;
/// How often a source earns back one failed attempt once its burst is spent.
pub(crate) const FAILURE_REFILL: Duration = Duration::from_secs(6);
/// Sources kept in the throttle at once (a source whose burst is whole again is forgotten
/// first).
const MAX_SOURCES: usize = 4096;

/// The open sessions, kept as the SHA-256 of their secrets (a copy of the table gives no
/// cookie) with when each ends.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    ends: HashMap<[u8; 32], Instant>,
}

impl Sessions {
    /// Opens a session at `now` with the 256-bit `secret` (drawn by the caller); returns
    /// the cookie's value. Past [`MAX_SESSIONS`] the session closest to its end is closed.
    pub(crate) fn open(&mut self, secret: [u8; 32], now: Instant) -> String {
        self.ends.retain(|_, end| *end > now);
        if self.ends.len() >= MAX_SESSIONS {
            if let Some(soonest) = self.ends.iter().min_by_key(|(_, end)| **end).map(|(k, _)| *k) {
                self.ends.remove(&soonest);
            }
        }
        let cookie = hex(&secret);
        self.ends.insert(digest(&cookie), now + SESSION_LIFETIME);
        cookie
    }

    /// Whether `cookie` names a session that is open at `now`.
    pub(crate) fn check(&self, cookie: &str, now: Instant) -> bool {
        self.ends.get(&digest(cookie)).is_some_and(|end| *end > now)
    }

    /// Closes `cookie`'s session; whether one was open.
    pub(crate) fn close(&mut self, cookie: &str) -> bool {
        self.ends.remove(&digest(cookie)).is_some()
    }
}

fn digest(cookie: &str) -> [u8; 32] {
    Sha256::digest(cookie.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The failed sign-ins of each source (an IPv4 /24 or an IPv6 /64): a bucket of
/// [`FAILURE_BURST`] attempts that refills one every [`FAILURE_REFILL`]. A source whose
/// bucket is empty is refused before its credential is looked at, so a guesser learns
/// nothing from attempts past its share; a success empties nothing and forgets the source.
#[derive(Debug)]
pub(crate) struct Throttle {
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
    pub(crate) fn new(burst: u32, refill: Duration) -> Self {
        Self {
            buckets: HashMap::new(),
            burst: burst.max(1),
            refill: refill.max(Duration::from_millis(1)),
        }
    }

    /// The attempts `source` has left at `now`.
    fn left(&self, source: IpAddr, now: Instant) -> f64 {
        self.buckets
            .get(&regatta_net::source_of(source))
            .map_or(f64::from(self.burst), |b| {
                let earned = now.saturating_duration_since(b.at).as_secs_f64() / self.refill.as_secs_f64();
                (b.left + earned).min(f64::from(self.burst))
            })
    }

    /// Whether `source` may try a credential at `now`; if not, how long until it may.
    pub(crate) fn admit(&self, source: IpAddr, now: Instant) -> Result<(), Duration> {
        let left = self.left(source, now);
        if left >= 1.0 {
            return Ok(());
        }
        Err(self.refill.mul_f64(1.0 - left).max(Duration::from_secs(1)))
    }

    /// Counts a failed attempt by `source` at `now`.
    pub(crate) fn failed(&mut self, source: IpAddr, now: Instant) {
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
        self.buckets
            .insert(regatta_net::source_of(source), Bucket { left, at: now });
    }

    /// Forgets `source`'s failures after it signed in.
    pub(crate) fn succeeded(&mut self, source: IpAddr) {
        self.buckets.remove(&regatta_net::source_of(source));
    }
}

/// The value of `cookie` in a `Cookie` header's text, if it is there.
pub(crate) fn cookie_value<'a>(header: &'a str, cookie: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        (name == cookie).then(|| value.trim_matches('"'))
    })
}

/// The `Set-Cookie` value that gives the browser `value` for `max_age` (zero ends it):
/// never readable by scripts, never sent by another site's requests, `Secure` when the
/// head serves HTTPS.
pub(crate) fn set_cookie(value: &str, max_age: Duration, secure: bool) -> String {
    format!(
        "{SESSION_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{}",
        max_age.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_session_opens_checks_ends_and_closes() {
        let now = Instant::now();
        let mut sessions = Sessions::default();
        let cookie = sessions.open([7; 32], now);
        assert_eq!(cookie.len(), 64);
        assert!(sessions.check(&cookie, now + Duration::from_secs(60)));
        assert!(!sessions.check("0".repeat(64).as_str(), now));
        assert!(!sessions.check(&cookie, now + SESSION_LIFETIME), "ended");
        assert!(sessions.close(&cookie));
        assert!(!sessions.check(&cookie, now));
        assert!(!sessions.close(&cookie));
    }

    #[test]
    fn past_the_cap_the_session_closest_to_its_end_is_closed() {
        let start = Instant::now();
        let mut sessions = Sessions::default();
        let first = sessions.open([0; 32], start);
        let mut last = String::new();
        for i in 1..=MAX_SESSIONS {
            let mut secret = [0u8; 32];
            secret[..8].copy_from_slice(&(i as u64).to_le_bytes());
            last = sessions.open(secret, start + Duration::from_millis(i as u64));
        }
        assert_eq!(sessions.ends.len(), MAX_SESSIONS);
        assert!(!sessions.check(&first, start), "the oldest went");
        assert!(sessions.check(&last, start + Duration::from_secs(1)));
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

    #[test]
    fn cookies_are_read_from_the_header_and_set_with_the_safe_attributes() {
        assert_eq!(
            cookie_value("a=1; regatta_session=abc; b=2", SESSION_COOKIE),
            Some("abc")
        );
        assert_eq!(cookie_value("regatta_sessionx=abc", SESSION_COOKIE), None);
        assert_eq!(cookie_value("", SESSION_COOKIE), None);
        let set = set_cookie("abc", SESSION_LIFETIME, true);
        for part in [
            "regatta_session=abc",
            "HttpOnly",
            "SameSite=Strict",
            "Path=/",
            "Secure",
            "Max-Age=28800",
        ] {
            assert!(set.contains(part), "{set} lacks {part}");
        }
        assert!(!set_cookie("", Duration::ZERO, false).contains("Secure"));
    }
}
