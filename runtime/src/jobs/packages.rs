//! Packages uploaded through the job API, as Ray's job clients make them: a `working_dir`
//! or `py_modules` folder zipped by the client and sent with
//! `PUT /api/packages/gcs/_ray_pkg_<hash>.zip` after a `GET` of the same path found it
//! missing, then named in the submission's `runtime_env` as `gcs://_ray_pkg_<hash>.zip`.
//!
//! Names are content addresses and are checked against the bytes received:
//! - `_ray_pkg_<16 hex>.zip`: a folder. Ray's client hashes the folder, not the zip: starting
//!   from the eight bytes `b"00000000"`, every path (the folder itself as `.`, each
//!   subfolder, each file) XORs in the first 8 bytes of `SHA-1(path ‖ content)` (folders
//!   have no content). The zip holds the folder's files at its top level (`working_dir`) or
//!   under the folder's own name (`py_modules`), so both readings are tried.
//! - `_ray_pkg_<40 hex>.zip`: a zip file the user gave as is, named by the SHA-1 of its bytes.
//!
//! The store lives in the head's state directory: `packages/<name>` (the zip as received),
//! `packages/unpacked/<name>/` (its files, for drivers on the head). Nothing is written
//! outside it: entries that would land outside their folder, links and oversized
//! archives are refused at upload. A package is kept while a job that is not over names
//! it, and for [`UNUSED_GRACE`] after its last use, so that a client that found it present
//! can still submit the job that names it.

use std::collections::{BTreeSet, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use regatta_proto::hex::encode as hex;
use sha1::{Digest, Sha1};

use super::shim::StartError;
use super::JobError;

/// The largest package accepted (Ray's default limit).
pub(crate) const MAX_PACKAGE_BYTES: u64 = 500 << 20;

/// The most a package may hold once unpacked (zip bombs are refused before writing).
pub(crate) const MAX_UNPACKED_BYTES: u64 = 4 << 30;

/// How long a package no running job names is kept after its last use.
pub(crate) const UNUSED_GRACE: Duration = Duration::from_secs(600);

/// The protocol Ray's clients upload with.
pub(crate) const PROTOCOL: &str = "gcs";

const PREFIX: &str = "_ray_pkg_";

/// What a package's name promises about its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Address {
    /// A zipped folder: Ray's folder hash.
    Folder([u8; 8]),
    /// A zip file as the user gave it: the SHA-1 of its bytes.
    Archive([u8; 20]),
}

/// Parses `{protocol}/{name}` of a package path into what the name promises.
pub(crate) fn parse_name(protocol: &str, name: &str) -> Result<Address, JobError> {
    if protocol != PROTOCOL {
        return Err(JobError::Invalid(format!(
            "package protocol '{protocol}' is not supported: upload to /api/packages/{PROTOCOL}/<name>"
        )));
    }
    let refuse = || {
        JobError::Invalid(format!(
            "package name '{name}' is not one Regatta stores: expected {PREFIX}<16 hex digits>.zip (a folder zipped by Ray's client) \
             or {PREFIX}<40 hex digits>.zip (a zip file named by its SHA-1); .tar.gz archives and wheels are not supported"
        ))
    };
    let hex = name
        .strip_prefix(PREFIX)
        .and_then(|rest| rest.strip_suffix(".zip"))
        .ok_or_else(refuse)?;
    let bytes = regatta_proto::hex::decode(hex).ok_or_else(refuse)?;
    match bytes.len() {
        8 => Ok(Address::Folder(bytes.try_into().map_err(|_| refuse())?)),
        20 => Ok(Address::Archive(bytes.try_into().map_err(|_| refuse())?)),
        _ => Err(refuse()),
    }
}

/// Ray's folder hash, one path at a time (order does not matter).
pub(crate) struct FolderHash([u8; 8]);

impl FolderHash {
    pub(crate) fn new() -> Self {
        Self(*b"00000000")
    }

    /// Adds a folder (`content` None) or a file; returns the bytes of content read.
    pub(crate) fn add(&mut self, path: &str, content: Option<&mut dyn Read>) -> io::Result<u64> {
        let mut hasher = Sha1::new();
        hasher.update(path.as_bytes());
        let mut read = 0;
        if let Some(content) = content {
            read = io::copy(content, &mut HashWriter(&mut hasher))?;
        }
        let digest = hasher.finalize();
        for (acc, byte) in self.0.iter_mut().zip(digest.iter()) {
            *acc ^= byte;
        }
        Ok(read)
    }

    pub(crate) fn finish(self) -> [u8; 8] {
        self.0
    }
}

struct HashWriter<'a>(&'a mut Sha1);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One entry of a checked archive.
struct Entry {
    index: usize,
    /// Relative path with `/` separators, no trailing slash.
    path: String,
    folder: bool,
}

/// Reads an archive's table and refuses what could write outside its folder: absolute or
/// `..` paths, links, and more than [`MAX_UNPACKED_BYTES`] once unpacked.
fn entries(archive: &mut zip::ZipArchive<File>) -> Result<Vec<Entry>, JobError> {
    let mut entries = Vec::with_capacity(archive.len());
    let mut total = 0u64;
    for index in 0..archive.len() {
        let file = archive
            .by_index(index)
            .map_err(|e| JobError::Invalid(format!("the package is not a readable zip: {e}")))?;
        let raw = file.name().to_string();
        let path = safe_path(&raw).ok_or_else(|| {
            JobError::Invalid(format!(
                "the package's entry '{raw}' would be written outside its folder"
            ))
        })?;
        if file.unix_mode().is_some_and(|mode| mode & 0o170000 == 0o120000) {
            return Err(JobError::Invalid(format!(
                "the package's entry '{raw}' is a symbolic link; packages hold files and folders only"
            )));
        }
        total = total.saturating_add(file.size());
        if total > MAX_UNPACKED_BYTES {
            return Err(JobError::TooLarge(format!(
                "the package unpacks to more than {MAX_UNPACKED_BYTES} bytes"
            )));
        }
        if path.is_empty() {
            continue;
        }
        entries.push(Entry {
            index,
            path,
            folder: file.is_dir(),
        });
    }
    Ok(entries)
}

/// The entry's path made relative and plain, or None when it is absolute or climbs out.
fn safe_path(raw: &str) -> Option<String> {
    if raw.contains('\0') || raw.contains('\\') {
        return None;
    }
    let mut parts = Vec::new();
    for component in Path::new(raw).components() {
        match component {
            Component::Normal(part) => parts.push(part.to_str()?),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.join("/"))
}

/// Ray's folder hash of the archive's files, read with `strip` leading components removed
/// (entries outside that prefix make the reading impossible: None).
fn folder_hash(
    archive: &mut zip::ZipArchive<File>,
    entries: &[Entry],
    strip: usize,
) -> Result<Option<[u8; 8]>, JobError> {
    let mut folders = BTreeSet::from([".".to_string()]);
    let mut files = Vec::new();
    for entry in entries {
        let parts: Vec<&str> = entry.path.split('/').collect();
        if parts.len() < strip || (parts.len() == strip && !entry.folder) {
            return Ok(None);
        }
        let kept = &parts[strip..];
        for depth in 1..kept.len() {
            folders.insert(kept[..depth].join("/"));
        }
        if kept.is_empty() {
            continue;
        }
        if entry.folder {
            folders.insert(kept.join("/"));
        } else {
            files.push((kept.join("/"), entry.index));
        }
    }
    let read_error = |e: io::Error| JobError::Invalid(format!("the package's contents cannot be read: {e}"));
    let mut hash = FolderHash::new();
    for folder in &folders {
        hash.add(folder, None).map_err(read_error)?;
    }
    for (path, index) in files {
        let mut file = archive
            .by_index(index)
            .map_err(|e| JobError::Invalid(format!("the package is not a readable zip: {e}")))?;
        // An entry that inflates past the size its header declares (and was checked
        // against the unpacked limit by) is refused, not read on.
        let declared = file.size();
        let read = hash
            .add(&path, Some(&mut (&mut file).take(declared.saturating_add(1))))
            .map_err(read_error)?;
        if read > declared {
            return Err(JobError::Invalid(format!(
                "the package's entry '{path}' holds more bytes than the {declared} its header says"
            )));
        }
    }
    Ok(Some(hash.finish()))
}

/// The first path component every entry shares, when there is exactly one.
fn single_top(entries: &[Entry]) -> bool {
    let mut tops = entries.iter().map(|e| e.path.split('/').next().unwrap_or_default());
    match tops.next() {
        Some(first) => tops.all(|t| t == first),
        None => false,
    }
}

/// Checks a received archive against its name: readable, safe, and matching its address.
/// `sha1` is the SHA-1 of its bytes, computed while it was received.
pub(crate) fn verify(path: &Path, address: Address, sha1: [u8; 20]) -> Result<(), JobError> {
    let file = File::open(path).map_err(|e| JobError::Internal(format!("cannot read the upload back: {e}")))?;
    let mut archive =
        zip::ZipArchive::new(file).map_err(|e| JobError::Invalid(format!("the package is not a readable zip: {e}")))?;
    let entries = entries(&mut archive)?;
    match address {
        Address::Archive(expected) if expected == sha1 => Ok(()),
        Address::Archive(expected) => Err(JobError::Invalid(format!(
            "the package's SHA-1 is {} but its name says {}: the upload does not match its id",
            hex(&sha1),
            hex(&expected)
        ))),
        Address::Folder(expected) => {
            let as_is = folder_hash(&mut archive, &entries, 0)?;
            if as_is == Some(expected) {
                return Ok(());
            }
            // py_modules folders are zipped under their own name.
            let nested = if single_top(&entries) {
                folder_hash(&mut archive, &entries, 1)?
            } else {
                None
            };
            if nested == Some(expected) {
                return Ok(());
            }
            Err(JobError::Invalid(format!(
                "the package's folder hash is {} but its name says {}: the upload does not match its id",
                hex(&as_is.unwrap_or_default()),
                hex(&expected)
            )))
        }
    }
}

/// Unpacks a checked archive into `dest` (which must not exist yet), files with their
/// executable bit.
pub(crate) fn unpack(archive_path: &Path, dest: &Path) -> Result<(), JobError> {
    let io_error = |what: &str, e: io::Error| JobError::Internal(format!("cannot {what}: {e}"));
    let file = File::open(archive_path).map_err(|e| io_error(&format!("open {}", archive_path.display()), e))?;
    let mut archive =
        zip::ZipArchive::new(file).map_err(|e| JobError::Invalid(format!("the package is not a readable zip: {e}")))?;
    let entries = entries(&mut archive)?;
    std::fs::create_dir_all(dest).map_err(|e| io_error(&format!("create {}", dest.display()), e))?;
    for entry in &entries {
        let target = dest.join(&entry.path);
        if entry.folder {
            std::fs::create_dir_all(&target).map_err(|e| io_error(&format!("create {}", target.display()), e))?;
            continue;
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_error(&format!("create {}", parent.display()), e))?;
        }
        let mut source = archive
            .by_index(entry.index)
            .map_err(|e| JobError::Invalid(format!("the package is not a readable zip: {e}")))?;
        let executable = source.unix_mode().is_some_and(|mode| mode & 0o111 != 0);
        let declared = source.size();
        let mut out = File::create(&target).map_err(|e| io_error(&format!("create {}", target.display()), e))?;
        let written = io::copy(&mut (&mut source).take(declared), &mut out)
            .map_err(|e| io_error(&format!("write {}", target.display()), e))?;
        if written != declared {
            return Err(JobError::Invalid(format!(
                "the package's entry '{}' holds {written} bytes, not the {declared} its header says",
                entry.path
            )));
        }
        if executable {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| io_error(&format!("make {} executable", target.display()), e))?;
        }
    }
    Ok(())
}

/// Where a driver starts and its `PYTHONPATH`, as Ray sets them: the `working_dir`
/// package's folder (from `unpack`) is the working directory and comes first on the path,
/// each `py_modules` package's folder follows, then `inherited`. A `working_dir` that is a
/// path on the node is used as it is; without packages the path is left alone (`None`).
pub(crate) fn driver_dirs(
    env: &regatta_proto::RuntimeEnv,
    inherited: Option<std::ffi::OsString>,
    mut unpack: impl FnMut(&str) -> Result<PathBuf, StartError>,
) -> Result<(Option<PathBuf>, Option<std::ffi::OsString>), StartError> {
    let mut path = Vec::new();
    let working_dir = match env.working_dir_package() {
        Some(name) => {
            let dir = unpack(name)?;
            path.push(dir.clone());
            Some(dir)
        }
        None => env.working_dir_path().map(PathBuf::from),
    };
    for module in env.py_module_packages() {
        path.push(unpack(module)?);
    }
    if path.is_empty() {
        return Ok((working_dir, None));
    }
    path.extend(inherited.iter().flat_map(std::env::split_paths));
    let joined = std::env::join_paths(path)?;
    Ok((working_dir, Some(joined)))
}

/// The packages that can go: unused for longer than `grace` and named by no job that is
/// not over. `packages` holds each stored package with when it was last used.
pub(crate) fn unused(
    packages: &[(String, SystemTime)],
    referenced: &HashSet<String>,
    now: SystemTime,
    grace: Duration,
) -> Vec<String> {
    packages
        .iter()
        .filter(|(name, last)| !referenced.contains(name) && now.duration_since(*last).is_ok_and(|idle| idle > grace))
        .map(|(name, _)| name.clone())
        .collect()
}

/// The package store in the head's state directory.
#[derive(Clone, Debug)]
pub(crate) struct PackageStore {
    dir: PathBuf,
}

impl PackageStore {
    /// Opens (creates) `dir`, clearing uploads a previous head left half-received.
    pub(crate) fn open(dir: PathBuf) -> crate::error::Result<Self> {
        let incoming = dir.join(".incoming");
        let _ = std::fs::remove_dir_all(&incoming);
        for path in [&dir, &incoming, &dir.join("unpacked")] {
            std::fs::create_dir_all(path)
                .map_err(|e| crate::error::Error::io(format!("cannot create {}", path.display()), e))?;
        }
        Ok(Self { dir })
    }

    /// Where the package's zip is kept.
    pub(crate) fn archive_path(&self, name: &str) -> PathBuf {
        self.archive(name)
    }

    fn archive(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn unpacked(&self, name: &str) -> PathBuf {
        self.dir.join("unpacked").join(name)
    }

    /// Whether the package is stored (its name must have parsed).
    pub(crate) fn exists(&self, name: &str) -> bool {
        self.archive(name).is_file()
    }

    /// A fresh file to receive an upload into.
    pub(crate) fn incoming(&self) -> PathBuf {
        self.dir
            .join(".incoming")
            .join(format!("upload-{}", crate::net::node::random_hex(8)))
    }

    /// Checks a received file against `name` and stores it; the file is gone either way.
    pub(crate) fn accept(&self, received: &Path, name: &str, address: Address, sha1: [u8; 20]) -> Result<(), JobError> {
        let checked = verify(received, address, sha1);
        if checked.is_ok() {
            if let Err(e) = std::fs::rename(received, self.archive(name)) {
                let _ = std::fs::remove_file(received);
                return Err(JobError::Internal(format!("cannot store the package {name}: {e}")));
            }
            self.touch(name);
        } else {
            let _ = std::fs::remove_file(received);
        }
        checked
    }

    /// Marks the package used now (it is kept for [`UNUSED_GRACE`] after).
    pub(crate) fn touch(&self, name: &str) {
        if let Ok(file) = File::options().append(true).open(self.archive(name)) {
            let _ = file.set_modified(SystemTime::now());
        }
    }

    /// The package's files, unpacked once and shared by the jobs that name it.
    pub(crate) fn unpacked_dir(&self, name: &str) -> Result<PathBuf, JobError> {
        let dest = self.unpacked(name);
        if dest.is_dir() {
            return Ok(dest);
        }
        if !self.exists(name) {
            return Err(JobError::Invalid(format!(
                "package {PROTOCOL}://{name} was not uploaded (or was deleted): upload it with PUT /api/packages/{PROTOCOL}/{name}"
            )));
        }
        let staging = self
            .dir
            .join(".incoming")
            .join(format!("unpack-{}", crate::net::node::random_hex(8)));
        let unpacked = unpack(&self.archive(name), &staging);
        if let Err(e) = unpacked {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
        if std::fs::rename(&staging, &dest).is_err() {
            // Another job unpacked it first.
            let _ = std::fs::remove_dir_all(&staging);
        }
        if dest.is_dir() {
            Ok(dest)
        } else {
            Err(JobError::Internal(format!(
                "cannot unpack the package {name} into {}",
                dest.display()
            )))
        }
    }

    /// Deletes the packages no job that is not over names, once unused for [`UNUSED_GRACE`].
    pub(crate) fn sweep(&self, referenced: &HashSet<String>) {
        let Ok(listing) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let stored: Vec<(String, SystemTime)> = listing
            .flatten()
            .filter(|e| e.path().is_file())
            .filter_map(|e| Some((e.file_name().into_string().ok()?, e.metadata().ok()?.modified().ok()?)))
            .collect();
        for name in unused(&stored, referenced, SystemTime::now(), UNUSED_GRACE) {
            let _ = std::fs::remove_dir_all(self.unpacked(&name));
            let _ = std::fs::remove_file(self.archive(&name));
            tracing::info!(package = %name, "deleted a package no job uses");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_what_they_promise() {
        assert_eq!(
            parse_name("gcs", "_ray_pkg_0123456789abcdef.zip").unwrap(),
            Address::Folder([0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef])
        );
        assert!(matches!(
            parse_name("gcs", &format!("_ray_pkg_{}.zip", "a".repeat(40))),
            Ok(Address::Archive(_))
        ));
        for bad in [
            "_ray_pkg_0123.zip",
            "_ray_pkg_0123456789abcdef.tar.gz",
            "../_ray_pkg_0123456789abcdef.zip",
            "_ray_pkg_0123456789ABCDEF.zip",
            "torch-2.11.whl",
        ] {
            assert!(matches!(parse_name("gcs", bad), Err(JobError::Invalid(_))), "{bad}");
        }
        assert!(matches!(
            parse_name("s3", "_ray_pkg_0123456789abcdef.zip"),
            Err(JobError::Invalid(_))
        ));
    }

    #[test]
    fn paths_that_climb_out_are_refused() {
        assert_eq!(safe_path("a/./b.py").as_deref(), Some("a/b.py"));
        assert_eq!(safe_path("dir/").as_deref(), Some("dir"));
        for bad in ["../x", "a/../../x", "/etc/passwd", "a\\..\\x"] {
            assert_eq!(safe_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_folder_hash_is_ray_s() {
        // A folder holding `a.txt` ("hi"), `sub/b.py` ("x = 1\n") and the empty `sub/empty`:
        // Ray 2.60's `packaging.get_uri_for_directory` names it gcs://_ray_pkg_8f9871dc958aa736.zip.
        let mut hash = FolderHash::new();
        hash.add("sub/b.py", Some(&mut &b"x = 1\n"[..])).unwrap();
        hash.add("sub", None).unwrap();
        hash.add(".", None).unwrap();
        hash.add("sub/empty", None).unwrap();
        hash.add("a.txt", Some(&mut &b"hi"[..])).unwrap();
        assert_eq!(hex(&hash.finish()), "8f9871dc958aa736", "in any order");
    }

    #[test]
    fn unused_packages_wait_out_their_grace() {
        let now = SystemTime::now();
        let old = now - Duration::from_secs(3600);
        let stored = vec![
            ("kept-by-job".to_string(), old),
            ("recent".to_string(), now - Duration::from_secs(5)),
            ("stale".to_string(), old),
        ];
        let referenced = HashSet::from(["kept-by-job".to_string()]);
        assert_eq!(
            unused(&stored, &referenced, now, UNUSED_GRACE),
            vec!["stale".to_string()]
        );
    }
}
