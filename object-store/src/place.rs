//! Files read and written through `object_store` by the trainer and the scorer (datasets,
//! checkpoints, outputs): a local directory (a plain absolute path or `file://`) or S3
//! (`s3://bucket/prefix`, configured from the `AWS_*` environment).

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};

/// Why a place could not be opened, read or written; each names the file or directory.
#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    /// The location is not a directory Regatta can open (an unknown scheme, a bad URL, a
    /// backend that cannot be configured).
    #[error(transparent)]
    Open(#[from] crate::Error),
    /// A location that should name a file ends in `/` (or is empty).
    #[error("{0} does not name a file")]
    NotAFile(String),
    /// The file does not exist.
    #[error("{0} does not exist")]
    Missing(String),
    /// Reading a file (or its size) failed.
    #[error("cannot read {url}: {source}")]
    Read {
        /// The file.
        url: String,
        /// The backend's error.
        source: object_store::Error,
    },
    /// Reading a byte range of a file failed.
    #[error("cannot read bytes {range:?} of {url}: {source}")]
    ReadRange {
        /// The file.
        url: String,
        /// The bytes asked for.
        range: Range<u64>,
        /// The backend's error.
        source: object_store::Error,
    },
    /// Listing a directory failed.
    #[error("cannot list {url}: {source}")]
    List {
        /// The directory.
        url: String,
        /// The backend's error.
        source: object_store::Error,
    },
    /// Writing a file failed.
    #[error("cannot write {url}: {source}")]
    Write {
        /// The file.
        url: String,
        /// The backend's error.
        source: object_store::Error,
    },
}

impl PlaceError {
    /// Whether the same request may succeed later (the backend failed: a network or disk
    /// hiccup), as opposed to a bad location or a missing file.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Read { source, .. }
            | Self::ReadRange { source, .. }
            | Self::List { source, .. }
            | Self::Write { source, .. } => !matches!(source, object_store::Error::NotFound { .. }),
            Self::Open(_) | Self::NotAFile(_) | Self::Missing(_) => false,
        }
    }
}

/// A directory-like place in a backend.
#[derive(Clone)]
pub struct Place {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    url: String,
}

fn display(url: &str, name: &str) -> String {
    format!("{}/{name}", url.trim_end_matches('/'))
}

/// `.` and `..` removed from an absolute local path (object_store would take `..` as a
/// file name); URLs are returned as they are.
pub fn normalize(text: &str) -> String {
    if !text.starts_with('/') {
        return text.to_string();
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in text.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    format!("/{}", parts.join("/"))
}

/// A relative local path made absolute against `base`; absolute paths, URLs and empty
/// strings are returned as they are. Configs resolve their paths with this before they
/// travel to nodes whose working directory differs.
pub fn absolute(path: &str, base: &std::path::Path) -> String {
    if path.is_empty() || path.contains("://") || path.starts_with('/') {
        path.to_string()
    } else {
        base.join(path).to_string_lossy().into_owned()
    }
}

impl Place {
    /// Opens a directory: `/abs/dir`, `file:///abs/dir` or `s3://bucket/prefix`.
    pub fn dir(text: &str) -> Result<Self, PlaceError> {
        let text = &normalize(text);
        let dir = format!("{}/", text.trim_end_matches('/'));
        let url = crate::spill::parse_spill_url(&dir)?;
        let (store, prefix) = crate::spill::open_store(&url)?;
        Ok(Self {
            store,
            prefix,
            url: text.trim_end_matches('/').to_string(),
        })
    }

    /// Opens the directory holding a file and returns it with the file's name.
    pub fn file(text: &str) -> Result<(Self, String), PlaceError> {
        let text = &normalize(text);
        let (dir, name) = text
            .rsplit_once('/')
            .filter(|(_, name)| !name.is_empty())
            .ok_or_else(|| PlaceError::NotAFile(text.to_string()))?;
        let dir = if dir.is_empty() || dir.ends_with(':') {
            format!("{dir}/")
        } else {
            dir.to_string()
        };
        Ok((Self::dir(&dir)?, name.to_string()))
    }

    /// The directory's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A subdirectory.
    pub fn child(&self, name: &str) -> Self {
        Self {
            store: self.store.clone(),
            prefix: self.prefix.child(name),
            url: display(&self.url, name),
        }
    }

    /// A file's path; `/` in `name` separates folders (as [`Place::list_all`] gives them).
    fn path(&self, name: &str) -> Path {
        name.split('/')
            .filter(|part| !part.is_empty())
            .fold(self.prefix.clone(), |path, part| path.child(part))
    }

    /// The size of a file.
    pub async fn size(&self, name: &str) -> Result<u64, PlaceError> {
        let meta = self
            .store
            .head(&self.path(name))
            .await
            .map_err(|source| self.read_error(name, source))?;
        Ok(meta.size)
    }

    /// A file's bytes, or `None` when it does not exist.
    pub async fn get_opt(&self, name: &str) -> Result<Option<Bytes>, PlaceError> {
        match self.store.get(&self.path(name)).await {
            Ok(result) => result
                .bytes()
                .await
                .map(Some)
                .map_err(|source| self.read_error(name, source)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(source) => Err(self.read_error(name, source)),
        }
    }

    fn read_error(&self, name: &str, source: object_store::Error) -> PlaceError {
        PlaceError::Read {
            url: display(&self.url, name),
            source,
        }
    }

    /// A file's bytes.
    pub async fn get(&self, name: &str) -> Result<Bytes, PlaceError> {
        self.get_opt(name)
            .await?
            .ok_or_else(|| PlaceError::Missing(display(&self.url, name)))
    }

    /// A byte range of a file.
    pub async fn get_range(&self, name: &str, range: Range<u64>) -> Result<Bytes, PlaceError> {
        self.store
            .get_range(&self.path(name), range.clone())
            .await
            .map_err(|source| PlaceError::ReadRange {
                url: display(&self.url, name),
                range,
                source,
            })
    }

    fn list_error(&self, source: object_store::Error) -> PlaceError {
        PlaceError::List {
            url: self.url.clone(),
            source,
        }
    }

    /// Names of the files directly in this directory.
    pub async fn list(&self) -> Result<Vec<String>, PlaceError> {
        let listing = match self.store.list_with_delimiter(Some(&self.prefix)).await {
            Ok(listing) => listing,
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(source) => return Err(self.list_error(source)),
        };
        Ok(listing
            .objects
            .into_iter()
            .filter_map(|meta| meta.location.filename().map(str::to_string))
            .collect())
    }

    /// Every file under this directory, at any depth: names relative to it (with `/`
    /// between folders) and sizes, sorted by name.
    pub async fn list_all(&self) -> Result<Vec<(String, u64)>, PlaceError> {
        use futures::TryStreamExt;
        let prefix = self.prefix.as_ref().to_string();
        let metas: Vec<object_store::ObjectMeta> = match self.store.list(Some(&self.prefix)).try_collect().await {
            Ok(metas) => metas,
            Err(object_store::Error::NotFound { .. }) => Vec::new(),
            Err(source) => return Err(self.list_error(source)),
        };
        let mut files: Vec<(String, u64)> = metas
            .into_iter()
            .map(|meta| {
                let full = meta.location.as_ref();
                let name = full
                    .strip_prefix(prefix.as_str())
                    .unwrap_or(full)
                    .trim_start_matches('/')
                    .to_string();
                (name, meta.size)
            })
            .filter(|(name, _)| !name.is_empty())
            .collect();
        files.sort();
        Ok(files)
    }

    /// Writes a whole file (atomic on both backends: a reader sees the old or the new one).
    pub async fn put(&self, name: &str, bytes: Bytes) -> Result<(), PlaceError> {
        self.store
            .put(&self.path(name), PutPayload::from_bytes(bytes))
            .await
            .map(|_| ())
            .map_err(|source| PlaceError::Write {
                url: display(&self.url, name),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_paths_lose_dots_and_urls_stay() {
        assert_eq!(normalize("/a/b/../c/./d/"), "/a/c/d");
        assert_eq!(normalize("/.."), "/");
        assert_eq!(normalize("s3://bucket/x/../y"), "s3://bucket/x/../y");
    }

    #[test]
    fn failures_are_typed_name_the_location_and_only_backend_ones_are_transient() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let dir = std::env::temp_dir().join(format!("regatta-place-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let place = Place::dir(dir.to_str().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
        let missing = runtime.block_on(place.get("absent.json")).unwrap_err();
        assert!(
            matches!(&missing, PlaceError::Missing(url) if url.ends_with("/absent.json")),
            "{missing}"
        );
        assert!(!missing.is_transient());
        assert_eq!(runtime.block_on(place.get_opt("absent.json")).ok(), Some(None));
        let size = runtime.block_on(place.size("absent.json")).unwrap_err();
        assert!(
            matches!(size, PlaceError::Read { .. }) && !size.is_transient(),
            "{size}"
        );
        let not_a_file = Place::file("s3://bucket/dir/").err().map(|e| e.to_string());
        assert_eq!(not_a_file.as_deref(), Some("s3://bucket/dir/ does not name a file"));
        let scheme = Place::dir("ftp://host/x").err();
        assert!(matches!(scheme, Some(PlaceError::Open(_))), "{scheme:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
