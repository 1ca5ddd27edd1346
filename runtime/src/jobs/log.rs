//! A job's log on disk with a size cap: when the file reaches the cap it becomes
//! `<name>.1` (replacing the older one) and a new file starts. At most twice the cap is
//! kept; nothing is buffered in memory beyond one read.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// An append-only capped log file.
pub(crate) struct CappedLog {
    path: PathBuf,
    file: File,
    written: u64,
    cap_bytes: u64,
}

impl CappedLog {
    /// Creates (truncating) the log at `path`.
    pub(crate) fn create(path: &Path, cap_bytes: u64) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).write(true).truncate(true).open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            written: 0,
            cap_bytes: cap_bytes.max(1024),
        })
    }

    /// Appends bytes, rotating first when the cap would be passed.
    pub(crate) fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.written + bytes.len() as u64 > self.cap_bytes && self.written > 0 {
            self.rotate()?;
        }
        self.file.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        self.file.flush()?;
        std::fs::rename(&self.path, rotated(&self.path))?;
        self.file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&self.path)?;
        self.written = 0;
        Ok(())
    }
}

/// The rotated companion of a log file.
pub(crate) fn rotated(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// The whole kept log: the rotated part (if any) then the current part.
pub(crate) fn read_all(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut out = std::fs::read(rotated(path)).unwrap_or_default();
    match std::fs::read(path) {
        Ok(current) => out.extend_from_slice(&current),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !out.is_empty() => {}
        Err(e) => return Err(e),
    }
    Ok(out)
}

/// Up to 1 MiB of new bytes of the current log part after `offset` (starting over after
/// a rotation made the file shorter).
pub(crate) fn read_from(path: &std::path::Path, offset: u64) -> (Vec<u8>, u64) {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return (Vec::new(), offset);
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = if len < offset { 0 } else { offset };
    if file.seek(SeekFrom::Start(start)).is_err() {
        return (Vec::new(), offset);
    }
    let mut chunk = Vec::new();
    let read = file.take(1 << 20).read_to_end(&mut chunk).unwrap_or(0);
    (chunk, start + read as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_rotates_at_the_cap_and_keeps_at_most_two_parts() {
        let dir = std::env::temp_dir().join(format!("regatta-joblog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("job.log");
        let mut log = CappedLog::create(&path, 1024).unwrap();
        for i in 0..100u32 {
            log.append(format!("line {i:04} {}\n", "x".repeat(40)).as_bytes())
                .unwrap();
        }
        let kept = read_all(&path).unwrap();
        assert!(kept.len() <= 2048, "kept {} bytes", kept.len());
        let text = String::from_utf8(kept).unwrap();
        assert!(
            text.ends_with(&format!("line 0099 {}\n", "x".repeat(40))),
            "newest lines are kept"
        );
        assert!(!text.contains("line 0000"), "oldest lines are dropped");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
