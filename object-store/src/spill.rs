//! Spilling objects out of memory to an `object_store` backend: a local directory by
//! default (`file:///path` or a plain path), or `s3://bucket/prefix` configured from the
//! standard `AWS_*` environment variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ALLOW_HTTP=true` for a plain-HTTP server).
//!
//! A spilled copy is named by its full URL, so any node that can reach the backend (every
//! node for S3 or a shared directory) can restore it. The URL ends with the SHA-256 of the
//! bytes written (`#sha256=<hex>`), and the head's directory keeps the URL: a restore checks
//! the bytes it reads against that digest, so whoever can write to the backend (another
//! local user, a shared bucket's other tenants) cannot substitute an object, even one of
//! the same size and CRC-32.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use url::Url;

use crate::checksum::crc32;
use crate::error::{Error, Result};
use regatta_proto::ObjectId;

/// A spill location: a backend and a prefix inside it.
#[derive(Clone)]
pub struct SpillBackend {
    store: Arc<dyn ObjectStore>,
    base: Url,
    prefix: Path,
}

impl std::fmt::Debug for SpillBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SpillBackend({})", self.base)
    }
}

fn spill_err(url: &str, e: impl std::fmt::Display) -> Error {
    Error::Spill {
        url: url.to_string(),
        reason: e.to_string(),
    }
}

/// Parses `file:///dir`, `/dir` or `s3://bucket/prefix` into a URL.
pub fn parse_spill_url(text: &str) -> Result<Url> {
    if text.starts_with('/') {
        return Url::from_directory_path(text).map_err(|_| spill_err(text, "not an absolute directory path"));
    }
    let url = Url::parse(text).map_err(|e| spill_err(text, format!("not a URL or absolute path: {e}")))?;
    match url.scheme() {
        "file" | "s3" => Ok(url),
        other => Err(spill_err(
            text,
            format!("unsupported scheme '{other}'; use file:// or s3://"),
        )),
    }
}

/// Opens the backend behind a URL from [`parse_spill_url`] and the path inside it (local
/// directories are created).
pub fn open_store(url: &Url) -> Result<(Arc<dyn ObjectStore>, Path)> {
    match url.scheme() {
        "file" => {
            let path = url
                .to_file_path()
                .map_err(|_| spill_err(url.as_str(), "not a local path"))?;
            let dir = if url.as_str().ends_with('/') {
                path.clone()
            } else {
                path.parent().map(|p| p.to_path_buf()).unwrap_or(path.clone())
            };
            std::fs::create_dir_all(&dir)
                .map_err(|e| spill_err(url.as_str(), format!("cannot create {}: {e}", dir.display())))?;
            let store = LocalFileSystem::new();
            let object_path = Path::from(path.to_string_lossy().trim_start_matches('/'));
            Ok((Arc::new(store), object_path))
        }
        "s3" => {
            let store = AmazonS3Builder::from_env()
                .with_url(url.as_str())
                .build()
                .map_err(|e| spill_err(url.as_str(), e))?;
            let path = Path::from(url.path().trim_start_matches('/'));
            Ok((Arc::new(store), path))
        }
        other => Err(spill_err(url.as_str(), format!("unsupported scheme '{other}'"))),
    }
}

/// The default folder for a node's spills: `/tmp/regatta-<uid>/spill`, this user's own.
pub fn default_spill_dir() -> PathBuf {
    PathBuf::from(format!("/tmp/regatta-{}/spill", effective_uid()))
}

#[allow(unsafe_code)]
fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Creates `dir` (missing folders readable by this user only) and checks that nobody else
/// can change what is in it. Walking up from `dir`: the folder itself must be this user's
/// and writable by nobody else; each folder above must be this user's and writable by
/// nobody else too, until one root owns that others cannot write or that has the sticky
/// bit (`/tmp`: others cannot rename what this user made there).
pub fn make_private_dir(dir: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let shown = dir.display().to_string();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| spill_err(&shown, format!("cannot create it: {e}")))?;
    // Without a trailing slash, which would make the kernel follow a link at the end.
    let dir: PathBuf = dir.components().collect();
    let dir = dir.as_path();
    let me = effective_uid();
    let not_private = |path: &std::path::Path, problem: String| Error::NotPrivate {
        path: path.display().to_string(),
        problem,
    };
    let mut current = Some(dir);
    while let Some(path) = current {
        let is_spill_dir = path == dir;
        // The spill folder itself must not be a link; a link above it (`/home` to another
        // disk) stands for the folder it names, and who may replace the link is checked
        // at the folder above it, next.
        let meta = if is_spill_dir {
            std::fs::symlink_metadata(path)
        } else {
            std::fs::metadata(path)
        }
        .map_err(|e| spill_err(&shown, format!("cannot read {}: {e}", path.display())))?;
        let (owner, mode) = (meta.uid(), meta.mode());
        let others_write = mode & 0o022 != 0;
        if is_spill_dir && !meta.is_dir() {
            return Err(not_private(path, "it is not a folder (a link or a file)".into()));
        }
        if owner == 0 && !is_spill_dir && (!others_write || mode & 0o1000 != 0) {
            return Ok(());
        }
        if owner != me {
            return Err(not_private(
                path,
                format!("it belongs to uid {owner}, not to this user (uid {me})"),
            ));
        }
        if others_write {
            return Err(not_private(
                path,
                format!("its group or others may write it (mode {:o})", mode & 0o7777),
            ));
        }
        current = path.parent();
    }
    Ok(())
}

impl SpillBackend {
    /// Opens a spill location; a local folder is created private to this user and refused
    /// when someone else could change it ([`make_private_dir`]).
    pub fn open(text: &str) -> Result<Self> {
        let mut base = parse_spill_url(text)?;
        if !base.path().ends_with('/') {
            base.set_path(&format!("{}/", base.path()));
        }
        if base.scheme() == "file" {
            let dir = base.to_file_path().map_err(|_| spill_err(text, "not a local path"))?;
            make_private_dir(&dir)?;
        }
        let (store, prefix) = open_store(&base)?;
        Ok(Self { store, base, prefix })
    }

    /// The location's URL.
    pub fn url(&self) -> &str {
        self.base.as_str()
    }

    /// Writes an object; returns the URL of the spilled copy, its digest included.
    pub async fn write(&self, id: ObjectId, bytes: Bytes) -> Result<String> {
        let name = id.to_string();
        let path = self.prefix.child(name.as_str());
        let location = format!("{}{name}", self.base);
        let digest = sha256_of(bytes.clone()).await;
        self.store
            .put(&path, PutPayload::from_bytes(bytes))
            .await
            .map_err(|e| spill_err(&location, e))?;
        Ok(format!(
            "{location}{DIGEST_MARK}{}",
            regatta_proto::hex::encode(&digest)
        ))
    }
}

/// What separates a spilled copy's location from its digest in its URL.
const DIGEST_MARK: &str = "#sha256=";

/// The SHA-256 of `bytes`, hashed off the async threads (a spilled object may be GiBs).
async fn sha256_of(bytes: Bytes) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let hash = move || -> [u8; 32] { Sha256::digest(&bytes).into() };
    match tokio::runtime::Handle::try_current() {
        Ok(_) => tokio::task::spawn_blocking(hash.clone())
            .await
            .unwrap_or_else(|_| hash()),
        Err(_) => hash(),
    }
}

/// A spilled copy's URL split into its location and the digest it ends with (none in a URL
/// written by a Regatta before the digest; such a copy is checked by its CRC-32 only).
fn split_digest(url: &str) -> Result<(&str, Option<[u8; 32]>)> {
    let Some((location, text)) = url.split_once(DIGEST_MARK) else {
        return Ok((url, None));
    };
    let digest = regatta_proto::hex::decode(text)
        .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
        .ok_or_else(|| spill_err(url, "its digest is not 64 hexadecimal digits"))?;
    Ok((location, Some(digest)))
}

/// Reads a spilled copy by URL and checks it against the directory's size and the digest
/// its URL carries (the CRC-32 for a copy without one).
pub async fn restore(url: &str, id: ObjectId, size: u64, checksum: u32) -> Result<Bytes> {
    let (location, digest) = split_digest(url)?;
    let parsed = parse_spill_url(location)?;
    let (store, path) = open_store(&parsed)?;
    let result = store.get(&path).await.map_err(|e| spill_err(location, e))?;
    let bytes = result.bytes().await.map_err(|e| spill_err(location, e))?;
    let corrupt = |what: String| Error::Corrupt {
        id,
        detail: format!("the spilled copy at {location} {what}"),
    };
    if bytes.len() as u64 != size {
        return Err(corrupt(format!("has {} bytes, not {size}", bytes.len())));
    }
    match digest {
        Some(digest) if sha256_of(bytes.clone()).await != digest => {
            Err(corrupt("is not what was spilled (its SHA-256 differs)".into()))
        }
        None if crc32(&bytes) != checksum => Err(corrupt("has a bad CRC-32".into())),
        _ => Ok(bytes),
    }
}

/// Deletes a spilled copy; a copy already gone is fine.
pub async fn delete(url: &str) -> Result<()> {
    let (url, _) = split_digest(url)?;
    let parsed = parse_spill_url(url)?;
    let (store, path) = open_store(&parsed)?;
    match store.delete(&path).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(spill_err(url, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn spill_restore_and_delete_on_a_local_directory() {
        let dir = std::env::temp_dir().join(format!("regatta-spill-test-{}", std::process::id()));
        let backend = SpillBackend::open(dir.to_str().unwrap()).unwrap();
        let id = ObjectId(7);
        let bytes = Bytes::from((0..100_000u32).map(|i| i as u8).collect::<Vec<u8>>());
        let url = backend.write(id, bytes.clone()).await.unwrap();
        assert!(url.starts_with("file://"), "{url}");
        assert!(url.contains("#sha256="), "{url}");
        let back = restore(&url, id, bytes.len() as u64, crc32(&bytes)).await.unwrap();
        assert_eq!(back, bytes);
        let err = restore(&url, id, bytes.len() as u64 + 1, crc32(&bytes))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        // Someone who can write the folder swaps the copy for one of the same size, and
        // the directory's CRC-32 matches it (a CRC is easy to forge): the digest in the URL
        // still tells.
        let file = dir.join(id.to_string());
        let mut forged = bytes.to_vec();
        forged[5] ^= 0xff;
        std::fs::write(&file, &forged).unwrap();
        let err = restore(&url, id, forged.len() as u64, crc32(&forged))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Corrupt { detail, .. } if detail.contains("SHA-256")),
            "{err}"
        );
        // A copy spilled by a Regatta before the digest is still checked by its CRC-32.
        let (location, _) = url.split_once("#sha256=").unwrap();
        assert_eq!(
            restore(location, id, forged.len() as u64, crc32(&forged))
                .await
                .unwrap(),
            Bytes::from(forged.clone())
        );
        assert!(restore(location, id, forged.len() as u64, crc32(&bytes)).await.is_err());
        for bad in ["#sha256=zz", "#sha256=", &format!("#sha256={}", "é".repeat(32))] {
            let err = restore(&format!("{location}{bad}"), id, 1, 0).await.unwrap_err();
            assert!(err.to_string().contains("digest"), "{bad}: {err}");
        }
        delete(&url).await.unwrap();
        delete(&url).await.unwrap();
        assert!(restore(&url, id, 1, 0).await.is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_spill_folder_others_could_change_is_refused_and_a_new_one_is_private() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let root = std::env::temp_dir().join(format!("regatta-spill-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);

        // Made here: every new folder readable by this user only.
        let fresh = root.join("a/b/spill");
        SpillBackend::open(fresh.to_str().unwrap()).unwrap();
        for dir in [root.join("a"), root.join("a/b"), fresh.clone()] {
            assert_eq!(
                std::fs::metadata(&dir).unwrap().mode() & 0o777,
                0o700,
                "{}",
                dir.display()
            );
        }

        // A folder anyone may write (as a stranger who made it first would leave it).
        let open = root.join("open");
        std::fs::create_dir_all(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = SpillBackend::open(open.to_str().unwrap()).unwrap_err();
        assert!(
            matches!(&err, Error::NotPrivate { path, .. } if path.trim_end_matches('/').ends_with("open")),
            "{err}"
        );
        // Inside it, a folder of this user's own is refused too: the stranger could swap it.
        let err = SpillBackend::open(open.join("mine").to_str().unwrap()).unwrap_err();
        assert!(
            matches!(&err, Error::NotPrivate { path, .. } if path.trim_end_matches('/').ends_with("open")),
            "{err}"
        );

        // A link above the folder (its own mode is 777) stands for the folder it names.
        std::os::unix::fs::symlink(root.join("a"), root.join("linked")).unwrap();
        SpillBackend::open(root.join("linked/b/spill").to_str().unwrap()).unwrap();
        // The spill folder itself may not be a link.
        std::os::unix::fs::symlink(&fresh, root.join("spill-link")).unwrap();
        let err = SpillBackend::open(root.join("spill-link").to_str().unwrap()).unwrap_err();
        assert!(err.to_string().contains("not a folder"), "{err}");

        // A folder another user owns (only root can make one to test with).
        let theirs = root.join("theirs");
        std::fs::create_dir_all(&theirs).unwrap();
        if std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).is_ok() {
            let err = SpillBackend::open(theirs.to_str().unwrap()).unwrap_err();
            assert!(err.to_string().contains("belongs to uid 65534"), "{err}");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn bad_spill_urls_are_refused_with_the_reason() {
        assert!(parse_spill_url("relative/dir")
            .unwrap_err()
            .to_string()
            .contains("absolute path"));
        assert!(parse_spill_url("ftp://x/y")
            .unwrap_err()
            .to_string()
            .contains("unsupported scheme"));
        assert!(parse_spill_url("s3://bucket/prefix").is_ok());
    }
}
