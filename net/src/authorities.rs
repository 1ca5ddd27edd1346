//! The authorities a cluster trusts, and rotating to a new one with an overlap.
//!
//! A cluster starts with one authority. `regatta ca rotate` makes a new one and from then on
//! the head issues every certificate from it, while the old one stays trusted (it is
//! *retiring*): certificates it issued keep working until they expire, and the new
//! authority's certificate signed by the old one (a cross-certificate) goes with every
//! certificate the new one issues, so a process that has not heard of the new authority yet
//! still accepts its certificates. `regatta ca finish` drops the retiring authority once
//! every certificate it issued has expired (or at once, forced).
//!
//! The cluster's identity (its state files' key, its process-group scope) is its first
//! authority's hash, kept here as the cluster id: it does not change with a rotation.
//!
//! The decisions ([`Authorities::rotate`], [`Authorities::finish`]) are free of I/O;
//! [`AuthorityStore`] keeps them in the CA folder: `ca.key`/`ca.crt` (the first authority),
//! `ca-<8 hex>.key`/`.crt` (later ones), `<issuing>.cross.crt`, and the file `authorities`
//! naming which is which, replaced whole (the commit point of a rotation).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;

use crate::ca::{replace_private, CaHash, ClusterCa, FIRST_STEM};
use crate::error::{Error, Result};

/// The authority rotated out, still trusted until every certificate it issued has expired.
#[derive(Clone, Debug)]
pub struct Retiring {
    /// Its file stem in the CA folder.
    stem: String,
    /// Its self-signed certificate.
    pub cert: CertificateDer<'static>,
    /// The issuing authority's certificate signed by this one.
    pub cross: CertificateDer<'static>,
    /// When the last certificate it issued expires.
    pub until: SystemTime,
}

/// The authorities a head holds: the one that issues, and the one retiring, if any.
#[derive(Clone)]
pub struct Authorities {
    cluster: CaHash,
    issuing: Arc<ClusterCa>,
    retiring: Option<Retiring>,
}

impl std::fmt::Debug for Authorities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Authorities(cluster {}, issuing {}",
            self.cluster,
            self.issuing.hash()
        )?;
        match &self.retiring {
            Some(retiring) => write!(f, ", retiring {})", hash_of(&retiring.cert)),
            None => write!(f, ")"),
        }
    }
}

fn hash_of(cert: &CertificateDer<'_>) -> String {
    CaHash::of_certificate(cert).map_or_else(|_| "?".into(), |h| h.to_string())
}

impl Authorities {
    /// A cluster of one authority, `first`, whose hash is the cluster's id.
    pub fn first(first: ClusterCa) -> Self {
        Self {
            cluster: first.hash(),
            issuing: Arc::new(first),
            retiring: None,
        }
    }

    /// The cluster's id: its first authority's hash, the same across rotations.
    pub fn cluster(&self) -> CaHash {
        self.cluster
    }

    /// The authority that issues certificates now.
    pub fn issuing(&self) -> &ClusterCa {
        &self.issuing
    }

    /// The authority rotated out, while it is still trusted.
    pub fn retiring(&self) -> Option<&Retiring> {
        self.retiring.as_ref()
    }

    /// Every authority trusted now, the issuing one first.
    pub fn trusted(&self) -> Vec<CertificateDer<'static>> {
        let mut trusted = vec![self.issuing.certificate_der().clone()];
        trusted.extend(self.retiring.iter().map(|r| r.cert.clone()));
        trusted
    }

    /// The hashes of [`Self::trusted`], the issuing one first.
    pub fn hashes(&self) -> Vec<CaHash> {
        self.trusted()
            .iter()
            .filter_map(|cert| CaHash::of_certificate(cert).ok())
            .collect()
    }

    /// [`trust_fingerprint`] of [`Self::hashes`].
    pub fn fingerprint(&self) -> u64 {
        trust_fingerprint(&self.hashes())
    }

    /// What a certificate the issuing authority made is presented with: the
    /// cross-certificate while an authority is retiring, nothing otherwise.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.retiring.iter().map(|r| r.cross.clone()).collect()
    }

    /// The next authorities after a rotation at `now`: `next` issues, the issuing one
    /// retires until every certificate it issued (each valid at most `lifetime`) has
    /// expired. Refused while a rotation is under way.
    pub fn rotate(&self, next: ClusterCa, now: SystemTime, lifetime: Duration) -> Result<Self> {
        if let Some(retiring) = &self.retiring {
            return Err(Error::Rotation(format!(
                "a rotation is under way (the authority {} is retiring): finish it first with `regatta ca finish`",
                hash_of(&retiring.cert)
            )));
        }
        let cross = next.cross_signed_by(&self.issuing)?;
        Ok(Self {
            cluster: self.cluster,
            retiring: Some(Retiring {
                stem: self.issuing.stem().to_string(),
                cert: self.issuing.certificate_der().clone(),
                cross,
                until: now + lifetime,
            }),
            issuing: Arc::new(next),
        })
    }

    /// The authorities once the retiring one is dropped at `now`: refused before every
    /// certificate it issued has expired unless `force` (those then stop working at once).
    pub fn finish(&self, now: SystemTime, force: bool) -> Result<Self> {
        let Some(retiring) = &self.retiring else {
            return Err(Error::Rotation(
                "no rotation is under way: `regatta ca rotate` starts one".into(),
            ));
        };
        if let Ok(left) = retiring.until.duration_since(now) {
            if !force && !left.is_zero() {
                return Err(Error::Rotation(format!(
                    "certificates the retiring authority {} issued may be in use for {} s more (until every process has renewed under the new one); finish then, or now with --force, which refuses them at once",
                    hash_of(&retiring.cert),
                    left.as_secs().max(1)
                )));
            }
        }
        Ok(Self {
            cluster: self.cluster,
            issuing: self.issuing.clone(),
            retiring: None,
        })
    }
}

/// A short fingerprint of a set of trusted authorities, whatever their order (what a
/// worker's heartbeat carries, so the head can tell it trusts others): never 0.
pub fn trust_fingerprint(hashes: &[CaHash]) -> u64 {
    use sha2::{Digest, Sha256};
    let mut sorted: Vec<[u8; 32]> = hashes.iter().map(|h| h.0).collect();
    sorted.sort_unstable();
    let mut digest = Sha256::new();
    for hash in &sorted {
        digest.update(hash);
    }
    let bytes: [u8; 32] = digest.finalize().into();
    u64::from_be_bytes(bytes[..8].try_into().unwrap_or_default()).max(1)
}

/// The file naming the authorities' roles.
const ROLES_FILE: &str = "authorities";

/// Where a head keeps its authorities: its CA folder.
#[derive(Clone, Debug)]
pub struct AuthorityStore {
    dir: PathBuf,
}

impl AuthorityStore {
    /// The authorities kept in `dir` (a folder of an older Regatta holds the first one
    /// alone), or a first authority made and kept there.
    pub fn open(dir: &Path) -> Result<(Self, Authorities)> {
        let store = Self { dir: dir.to_path_buf() };
        let path = dir.join(ROLES_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok((store, Authorities::first(ClusterCa::load_or_create(dir)?)));
            }
            Err(e) => return Err(Error::Tls(format!("cannot read {}: {e}", path.display()))),
        };
        let roles = Roles::parse(&text).map_err(|why| Error::Tls(format!("{}: {why}", path.display())))?;
        let issuing = ClusterCa::load(dir, &roles.issuing)?;
        let retiring = match roles.retiring {
            Some((stem, until)) => {
                let read = |name: String| {
                    let path = dir.join(name);
                    std::fs::read(&path)
                        .map(CertificateDer::from)
                        .map_err(|e| Error::Tls(format!("cannot read {}: {e}", path.display())))
                };
                Some(Retiring {
                    cert: read(format!("{stem}.crt"))?,
                    cross: read(format!("{}.cross.crt", roles.issuing))?,
                    stem,
                    until,
                })
            }
            None => None,
        };
        Ok((
            store,
            Authorities {
                cluster: roles.cluster,
                issuing: Arc::new(issuing),
                retiring,
            },
        ))
    }

    /// Keeps `next` (the result of a rotation or a finish of `previous`): a new authority's
    /// key and certificate, its cross-certificate, then the roles file replaced whole. A
    /// retired authority's files are removed afterwards, and the key of one that just
    /// retired too (a retiring authority is only trusted, never issues again).
    pub fn save(&self, previous: &Authorities, next: &Authorities) -> Result<()> {
        let issuing = next.issuing.stem();
        if issuing != previous.issuing.stem() {
            next.issuing.save(&self.dir)?;
        }
        if let Some(retiring) = &next.retiring {
            replace_private(&self.dir.join(format!("{issuing}.cross.crt")), retiring.cross.as_ref())?;
        }
        let roles = Roles {
            cluster: next.cluster,
            issuing: issuing.to_string(),
            retiring: next.retiring.as_ref().map(|r| (r.stem.clone(), r.until)),
        };
        replace_private(&self.dir.join(ROLES_FILE), roles.to_text().as_bytes())?;
        // Past the commit point: what is left over only costs disk.
        let remove = |name: String| {
            let path = self.dir.join(name);
            if let Err(e) = std::fs::remove_file(&path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "could not remove a retired authority's file");
                }
            }
        };
        if let Some(retiring) = &next.retiring {
            remove(format!("{}.key", retiring.stem));
        }
        if let (Some(gone), None) = (&previous.retiring, &next.retiring) {
            remove(format!("{}.key", gone.stem));
            remove(format!("{}.crt", gone.stem));
            remove(format!("{issuing}.cross.crt"));
        }
        Ok(())
    }
}

/// The roles file's contents.
#[derive(Debug, PartialEq)]
struct Roles {
    cluster: CaHash,
    issuing: String,
    retiring: Option<(String, SystemTime)>,
}

impl Roles {
    fn to_text(&self) -> String {
        let mut text = format!("cluster {}\nissuing {}\n", self.cluster, self.issuing);
        if let Some((stem, until)) = &self.retiring {
            let secs = until.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            text.push_str(&format!("retiring {stem} {secs}\n"));
        }
        text
    }

    fn parse(text: &str) -> std::result::Result<Self, String> {
        let (mut cluster, mut issuing, mut retiring) = (None, None, None);
        let stem = |s: &str| -> std::result::Result<String, String> {
            let ok = s == FIRST_STEM
                || s.strip_prefix("ca-")
                    .is_some_and(|hex| hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
            if ok {
                Ok(s.to_string())
            } else {
                Err(format!("{s:?} is not an authority's name (ca or ca-<8 hex digits>)"))
            }
        };
        for (number, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad = |why: String| format!("line {}: {why}", number + 1);
            let words: Vec<&str> = line.split_whitespace().collect();
            match words[..] {
                ["cluster", hash] => cluster = Some(hash.parse::<CaHash>().map_err(|e| bad(e.to_string()))?),
                ["issuing", name] => issuing = Some(stem(name).map_err(bad)?),
                ["retiring", name, secs] => {
                    // Checked: a time past what SystemTime holds would panic an addition.
                    let until = secs
                        .parse::<u64>()
                        .ok()
                        .and_then(|secs| SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs)))
                        .ok_or_else(|| bad(format!("{secs:?} is not a time")))?;
                    retiring = Some((stem(name).map_err(bad)?, until));
                }
                _ => return Err(bad(format!("{line:?} is not cluster, issuing or retiring"))),
            }
        }
        Ok(Self {
            cluster: cluster.ok_or("no cluster line")?,
            issuing: issuing.ok_or("no issuing line")?,
            retiring,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::{node_key, raw_public_key, Role, CERT_LIFETIME};

    /// Whether `leaf` (with `chain`) verifies as a client certificate against `roots`.
    fn accepted(
        roots: &[CertificateDer<'static>],
        leaf: &CertificateDer<'static>,
        chain: &[CertificateDer<'static>],
    ) -> bool {
        let mut store = rustls::RootCertStore::empty();
        for root in roots {
            store.add(root.clone()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider)
            .build()
            .unwrap();
        verifier
            .verify_client_cert(leaf, chain, rustls::pki_types::UnixTime::now())
            .is_ok()
    }

    #[test]
    fn a_rotation_keeps_old_and_new_certificates_working_until_it_is_finished() {
        let start = SystemTime::now();
        let one = Authorities::first(ClusterCa::generate().unwrap());
        let key = node_key().unwrap();
        let issue = |a: &Authorities| {
            a.issuing()
                .issue(&Role::Node("w1".into()), &raw_public_key(&key), CERT_LIFETIME)
                .unwrap()
        };
        let old_leaf = issue(&one);
        let two = one
            .rotate(ClusterCa::generate_next().unwrap(), start, CERT_LIFETIME)
            .unwrap();
        assert_eq!(two.cluster(), one.cluster(), "the cluster's id stays");
        assert_ne!(two.issuing().hash(), one.issuing().hash());
        assert_eq!(two.hashes(), vec![two.issuing().hash(), one.issuing().hash()]);
        assert_ne!(two.fingerprint(), one.fingerprint());
        let mut reversed = two.hashes();
        reversed.reverse();
        assert_eq!(trust_fingerprint(&reversed), two.fingerprint(), "order does not matter");
        let new_leaf = issue(&two);
        // A process that knows only the old authority accepts the new one's certificates
        // through the cross-certificate, and not without it.
        assert!(accepted(&one.trusted(), &new_leaf, &two.chain()));
        assert!(!accepted(&one.trusted(), &new_leaf, &[]));
        // During the overlap both are trusted.
        assert!(accepted(&two.trusted(), &old_leaf, &[]));
        assert!(accepted(&two.trusted(), &new_leaf, &two.chain()));
        // A second rotation waits for the first to finish; finishing waits for the old
        // certificates to expire unless forced.
        let refused = two.rotate(ClusterCa::generate_next().unwrap(), start, CERT_LIFETIME);
        assert!(matches!(refused, Err(Error::Rotation(_))));
        let early = two.finish(start + Duration::from_secs(60), false).unwrap_err();
        assert!(early.to_string().contains("--force"), "{early}");
        let three = two.finish(start + CERT_LIFETIME, false).unwrap();
        assert_eq!(two.finish(start, true).unwrap().hashes(), three.hashes());
        assert_eq!(three.hashes(), vec![two.issuing().hash()]);
        assert!(three.chain().is_empty());
        assert!(
            !accepted(&three.trusted(), &old_leaf, &[]),
            "the old authority is no longer trusted"
        );
        assert!(accepted(&three.trusted(), &new_leaf, &two.chain()));
        assert!(accepted(&three.trusted(), &new_leaf, &[]));
        assert!(matches!(three.finish(start, true), Err(Error::Rotation(_))));
        assert_eq!(three.cluster(), one.cluster());
    }

    #[test]
    fn the_store_keeps_each_step_and_drops_the_retired_keys() {
        let dir = std::env::temp_dir().join(format!("regatta-authorities-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (store, one) = AuthorityStore::open(&dir).unwrap();
        assert_eq!(
            AuthorityStore::open(&dir).unwrap().1.hashes(),
            one.hashes(),
            "an older folder's layout"
        );
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let two = one
            .rotate(ClusterCa::generate_next().unwrap(), now, CERT_LIFETIME)
            .unwrap();
        store.save(&one, &two).unwrap();
        let (_, back) = AuthorityStore::open(&dir).unwrap();
        assert_eq!(back.hashes(), two.hashes());
        assert_eq!(back.cluster(), one.cluster());
        assert_eq!(back.chain(), two.chain());
        assert_eq!(back.retiring().unwrap().until, now + CERT_LIFETIME);
        assert!(!dir.join("ca.key").exists(), "a retiring authority's key is removed");
        let three = back.finish(now + CERT_LIFETIME, false).unwrap();
        store.save(&back, &three).unwrap();
        let (_, back) = AuthorityStore::open(&dir).unwrap();
        assert_eq!(back.hashes(), vec![two.issuing().hash()]);
        assert_eq!(back.cluster(), one.cluster());
        assert!(back.retiring().is_none());
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let stem = two.issuing().stem();
        assert_eq!(
            left,
            vec!["authorities".to_string(), format!("{stem}.crt"), format!("{stem}.key")]
        );
        // A damaged roles file is named, not guessed around.
        std::fs::write(dir.join(ROLES_FILE), "cluster sha256:00\nissuing ca\n").unwrap();
        let err = AuthorityStore::open(&dir).unwrap_err().to_string();
        assert!(err.contains("authorities") && err.contains("line 1"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn roles_read_back_and_bad_ones_say_why() {
        let roles = Roles {
            cluster: ClusterCa::generate().unwrap().hash(),
            issuing: "ca-0a1b2c3d".into(),
            retiring: Some(("ca".into(), SystemTime::UNIX_EPOCH + Duration::from_secs(42))),
        };
        assert_eq!(Roles::parse(&roles.to_text()).unwrap(), roles);
        // The last: a time past what SystemTime holds (an addition that would panic).
        let huge = format!(
            "cluster {}\nissuing ca\nretiring ca-0a1b2c3d {}\n",
            roles.cluster,
            u64::MAX
        );
        for bad in [
            "",
            "issuing ca\n",
            "cluster x\nissuing ca\n",
            "cluster sha256:0\nissuing ../x\n",
            "what\n",
            &huge,
        ] {
            assert!(Roles::parse(bad).is_err(), "{bad:?}");
        }
    }

    /// Bounded fuzzing: any roles file, from any text or from its own words shuffled, is
    /// read or refused without a panic, and what is read writes back the same.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn words() -> impl Strategy<Value = String> {
            let word = prop_oneof![
                Just("cluster".to_string()),
                Just("issuing".to_string()),
                Just("retiring".to_string()),
                Just("ca".to_string()),
                Just("ca-0a1b2c3d".to_string()),
                Just(format!("sha256:{}", "ab".repeat(32))),
                Just("\n".to_string()),
                "[0-9]{1,20}",
                any::<String>(),
            ];
            proptest::collection::vec(word, 0..12).prop_map(|w| w.join(" "))
        }

        proptest! {
            #![proptest_config(crate::fuzz_config(256))]

            #[test]
            fn any_roles_text_is_read_or_refused_without_a_panic(text in prop_oneof![any::<String>(), words()]) {
                if let Ok(roles) = Roles::parse(&text) {
                    prop_assert_eq!(Roles::parse(&roles.to_text()).unwrap(), roles);
                }
            }
        }
    }
}
