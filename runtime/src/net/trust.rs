//! How a process comes to hold the cluster's trust: a head loads (or makes) the cluster's
//! own certificate authority and answers joins; every other process trades its join token
//! for a certificate naming it ([`regatta_net::join`]) before it opens a session.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use regatta_net::{Authorities, AuthorityStore, CaHash, ClusterCa, JoinDesk, JoinToken, JoinTokens, Role, TlsIdentity};

use crate::error::{Error, Result};

/// Environment variable holding the cluster authority's hash a joiner pins
/// (`sha256:<64 hex digits>`, printed by the head).
pub const CA_HASH_ENV: &str = "REGATTA_CA_HASH";

/// What a process joins with: a join token and, when known, the authority's hash.
#[derive(Clone, Debug)]
pub struct JoinCredentials {
    /// The join token.
    pub token: JoinToken,
    /// The authority the head must hold (`None`: the head proves the token's secret only).
    pub pin: Option<CaHash>,
}

impl JoinCredentials {
    /// Reads `token` (a join token) and the pin `pin`, else [`CA_HASH_ENV`] when set.
    pub fn parse(token: &str, pin: Option<&str>) -> Result<Self> {
        let token = token.parse::<JoinToken>().map_err(|e| Error::Token(e.to_string()))?;
        let from_env = std::env::var(CA_HASH_ENV).ok().filter(|v| !v.trim().is_empty());
        let pin = match pin.map(str::to_string).or(from_env) {
            Some(text) => Some(
                text.parse::<CaHash>()
                    .map_err(|e| Error::Token(format!("{CA_HASH_ENV} / --ca-hash: {e}")))?,
            ),
            None => None,
        };
        Ok(Self { token, pin })
    }
}

/// Joins the cluster at `address` as `role`: one try (a client's connect).
pub(crate) async fn join_once(address: &str, credentials: &JoinCredentials, role: &Role) -> Result<TlsIdentity> {
    regatta_net::join(address, &credentials.token, credentials.pin, role)
        .await
        .map_err(|e| match e {
            regatta_net::Error::JoinUnreachable(reason) => Error::Connect {
                address: address.to_string(),
                reason,
            },
            regatta_net::Error::JoinRefused(reason) => Error::TokenRefused {
                address: address.to_string(),
                reason,
            },
            other => Error::Net(other),
        })
}

/// Joins the cluster at `address` as `role`, waiting for a head that is not up yet (a
/// worker started before its head); a refusal ends it at once.
pub(crate) async fn join_with_retry(address: &str, credentials: &JoinCredentials, role: &Role) -> Result<TlsIdentity> {
    let mut warned = false;
    let mut backoff = Duration::from_millis(50);
    loop {
        match join_once(address, credentials, role).await {
            Err(Error::Connect { reason, .. }) => {
                if !warned {
                    tracing::warn!(error = %reason, "head not reachable yet; retrying");
                    warned = true;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

/// Keeps `identity`'s certificate renewed at the head at `address` for as long as the
/// returned guard lives: each renewal when a third of the current one's life is left, or at
/// once when [`RenewalGuard::renew_now`] asks (the head's heartbeat answer does after a
/// rotation of the cluster's authority).
pub(crate) fn keep_renewed(address: String, identity: TlsIdentity) -> RenewalGuard {
    let now = Arc::new(tokio::sync::Notify::new());
    let asked = now.clone();
    let task = tokio::spawn(async move {
        loop {
            let left = identity
                .slot
                .expires()
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default();
            tokio::select! {
                () = tokio::time::sleep((left * 2 / 3).max(Duration::from_millis(500))) => {}
                () = asked.notified() => {}
            }
            let trusted = identity.trust.fingerprint();
            match regatta_net::renew(&address, &identity).await {
                Ok(expires) => {
                    let valid = expires.duration_since(std::time::SystemTime::now()).unwrap_or_default();
                    if identity.trust.fingerprint() == trusted {
                        tracing::info!(valid_s = valid.as_secs(), "renewed this process's certificate");
                    } else {
                        let hashes: Vec<String> = identity.trust.hashes().iter().map(ToString::to_string).collect();
                        tracing::warn!(valid_s = valid.as_secs(), authorities = %hashes.join(", "), "renewed this process's certificate under the cluster's rotated authorities");
                    }
                }
                Err(regatta_net::Error::JoinRefused(why)) => {
                    tracing::error!(%why, "the head refused to renew this process's certificate: it stops working when the current one expires");
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "could not renew this process's certificate yet; trying again"),
            }
        }
    });
    RenewalGuard { task, now }
}

/// Stops a process's renewals when dropped.
pub(crate) struct RenewalGuard {
    task: tokio::task::JoinHandle<()>,
    now: Arc<tokio::sync::Notify>,
}

impl RenewalGuard {
    /// Renews at once (or right after the renewal under way).
    pub(crate) fn renew_now(&self) {
        self.now.notify_one();
    }
}

impl Drop for RenewalGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The file in the CA folder that keeps the join tokens made with `regatta token create`.
const TOKENS_FILE: &str = "join-tokens";

/// A head's trust: its authority (saved in `ca_dir`, or made for this run alone), its own
/// identity, and the desk that answers joins with `bootstrap` accepted.
pub(crate) struct HeadTrust {
    pub(crate) identity: TlsIdentity,
    pub(crate) desk: Arc<JoinDesk>,
}

impl HeadTrust {
    /// `web_names` are the hosts browsers reach the head's HTTPS port by (its HTTPS
    /// certificate names them).
    pub(crate) fn open(
        ca_dir: Option<&Path>,
        bootstrap: &JoinToken,
        lifetime: Duration,
        web_names: &[String],
    ) -> Result<Self> {
        let (store, authorities) = match ca_dir {
            Some(dir) => {
                let (store, authorities) = AuthorityStore::open(dir)?;
                (Some(store), authorities)
            }
            None => (None, Authorities::first(ClusterCa::generate()?)),
        };
        if let Some(retiring) = authorities.retiring() {
            tracing::warn!(
                issuing = %authorities.issuing().hash(),
                retiring = %CaHash::of_certificate(&retiring.cert)?,
                "a rotation of the cluster's authority is under way: `regatta ca finish` once every process has renewed"
            );
        }
        let identity = TlsIdentity::for_head(&authorities, Default::default(), web_names)?;
        let file = ca_dir.map(|dir| dir.join(TOKENS_FILE));
        let mut tokens = match &file {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => JoinTokens::from_lines(&text)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => JoinTokens::default(),
                Err(e) => return Err(Error::io(format!("cannot read the join tokens {}", path.display()), e)),
            },
            None => JoinTokens::default(),
        };
        tokens.insert(bootstrap, None, None, "the head's bootstrap token (--token)");
        let mut desk = JoinDesk::new(authorities, identity.clone(), tokens, &bootstrap.id);
        desk.store = store;
        desk.file = file;
        desk.lifetime = lifetime;
        desk.web_names = web_names.to_vec();
        Ok(Self {
            identity,
            desk: Arc::new(desk),
        })
    }
}
