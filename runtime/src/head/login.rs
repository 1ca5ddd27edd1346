//! Signing in to the head's HTTP port: the admin token traded for an expiring session
//! cookie (the dashboard keeps no credential a script can read), and failed attempts
//! throttled per source ([`regatta_net::Throttle`]). The bookkeeping ([`Sessions`]) is free of I/O and
//! takes the time as an argument; the handlers in [`super::job_api`] are thin around it.
//!
//! | method and path | does |
//! | --- | --- |
//! | `POST /api/login` | body `{"token"}`: the admin token; `200 {"expires_unix"}` with `Set-Cookie: regatta_session=...; HttpOnly; SameSite=Strict; Path=/` (`Secure` over HTTPS) |
//! | `POST /api/logout` | ends the cookie's session: `{"signed_out": bool}` |

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "regatta_session";
/// How long a session lasts from its sign-in.
pub(crate) const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// Sessions kept at once; signing in past this ends the one closest to its end.
pub(crate) const MAX_SESSIONS: usize = 1024;

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
        let cookie = regatta_proto::hex::encode(&secret);
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
