//! Files read and written through `object_store` by the trainer and the scorer (datasets,
//! checkpoints, outputs): a local directory (a plain absolute path or `file://`) or S3
//! (`s3://bucket/prefix`, configured from the `AWS_*` environment).

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};

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
    pub fn dir(text: &str) -> Result<Self, String> {
        let text = &normalize(text);
        let dir = format!("{}/", text.trim_end_matches('/'));
        let url = crate::spill::parse_spill_url(&dir).map_err(|e| e.to_string())?;
        let (store, prefix) = crate::spill::open_store(&url).map_err(|e| e.to_string())?;
        Ok(Self {
            store,
            prefix,
            url: text.trim_end_matches('/').to_string(),
        })
    }

    /// Opens the directory holding a file and returns it with the file's name.
    pub fn file(text: &str) -> Result<(Self, String), String> {
        let text = &normalize(text);
        let (dir, name) = text
            .rsplit_once('/')
            .filter(|(_, name)| !name.is_empty())
            .ok_or_else(|| format!("{text} does not name a file"))?;
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
    pub async fn size(&self, name: &str) -> Result<u64, String> {
        let meta = self
            .store
            .head(&self.path(name))
            .await
            .map_err(|e| format!("cannot read {}: {e}", display(&self.url, name)))?;
        Ok(meta.size)
    }

    /// A file's bytes, or `None` when it does not exist.
    pub async fn get_opt(&self, name: &str) -> Result<Option<Bytes>, String> {
        match self.store.get(&self.path(name)).await {
            Ok(result) => result
                .bytes()
                .await
                .map(Some)
                .map_err(|e| format!("cannot read {}: {e}", display(&self.url, name))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", display(&self.url, name))),
        }
    }

    /// A file's bytes.
    pub async fn get(&self, name: &str) -> Result<Bytes, String> {
        self.get_opt(name)
            .await?
            .ok_or_else(|| format!("{} does not exist", display(&self.url, name)))
    }

    /// A byte range of a file.
    pub async fn get_range(&self, name: &str, range: Range<u64>) -> Result<Bytes, String> {
        self.store
            .get_range(&self.path(name), range.clone())
            .await
            .map_err(|e| format!("cannot read bytes {range:?} of {}: {e}", display(&self.url, name)))
    }

    /// Names of the files directly in this directory.
    pub async fn list(&self) -> Result<Vec<String>, String> {
        let listing = match self.store.list_with_delimiter(Some(&self.prefix)).await {
            Ok(listing) => listing,
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(format!("cannot list {}: {e}", self.url)),
        };
        Ok(listing
            .objects
            .into_iter()
            .filter_map(|meta| meta.location.filename().map(str::to_string))
            .collect())
    }

    /// Every file under this directory, at any depth: names relative to it (with `/`
    /// between folders) and sizes, sorted by name.
    pub async fn list_all(&self) -> Result<Vec<(String, u64)>, String> {
        use futures::TryStreamExt;
        let prefix = self.prefix.as_ref().to_string();
        let metas: Vec<object_store::ObjectMeta> = match self.store.list(Some(&self.prefix)).try_collect().await {
            Ok(metas) => metas,
            Err(object_store::Error::NotFound { .. }) => Vec::new(),
            Err(e) => return Err(format!("cannot list {}: {e}", self.url)),
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
    pub async fn put(&self, name: &str, bytes: Bytes) -> Result<(), String> {
        self.store
            .put(&self.path(name), PutPayload::from_bytes(bytes))
            .await
            .map(|_| ())
            .map_err(|e| format!("cannot write {}: {e}", display(&self.url, name)))
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
}
