//! Job records on the head's disk: one JSON file per job, written atomically (temporary
//! file, then rename), read back when the head restarts. No external database.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use regatta_proto::{validate_job_id as validate_id, JobRecord};

/// The folder of job records.
pub(crate) struct JobStore {
    dir: PathBuf,
}

impl JobStore {
    /// Opens (creating) `dir`.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("cannot create the job store {}", dir.display()), e))?;
        Ok(Self { dir: dir.to_path_buf() })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Writes a record (atomically).
    pub(crate) fn save(&self, record: &JobRecord) -> Result<()> {
        validate_id(&record.submission_id)?;
        let path = self.path(&record.submission_id);
        let tmp = self.dir.join(format!(".{}.json.tmp", record.submission_id));
        let text = serde_json::to_vec_pretty(record)
            .map_err(|e| Error::Rejected(format!("cannot encode a job record: {e}")))?;
        std::fs::write(&tmp, text).map_err(|e| Error::io(format!("cannot write {}", tmp.display()), e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(format!("cannot move {} into place", path.display()), e))
    }

    /// Removes a record.
    pub(crate) fn remove(&self, id: &str) -> Result<()> {
        match std::fs::remove_file(self.path(id)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("cannot delete the record of job {id}"), e)),
        }
    }

    /// Every readable record; unreadable files are reported and skipped, never fatal.
    pub(crate) fn load_all(&self) -> Vec<JobRecord> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json")
                || path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'))
            {
                continue;
            }
            let parsed = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|bytes| serde_json::from_slice::<JobRecord>(&bytes).map_err(|e| e.to_string()));
            match parsed {
                Ok(record) => records.push(record),
                Err(e) => tracing::warn!(file = %path.display(), error = %e, "skipping an unreadable job record"),
            }
        }
        records.sort_by_key(|r| r.submitted_at);
        records
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regatta_proto::JobSubmission;

    #[test]
    fn records_survive_a_reopen_and_corrupt_files_are_skipped() {
        let dir = std::env::temp_dir().join(format!("regatta-jobstore-{}", std::process::id()));
        let store = JobStore::open(&dir).unwrap();
        let sub = JobSubmission {
            entrypoint: "echo".into(),
            ..Default::default()
        };
        store.save(&JobRecord::new("a".into(), &sub, 1)).unwrap();
        store.save(&JobRecord::new("b".into(), &sub, 2)).unwrap();
        std::fs::write(dir.join("broken.json"), b"{not json").unwrap();
        let again = JobStore::open(&dir).unwrap();
        let ids: Vec<String> = again.load_all().into_iter().map(|r| r.submission_id).collect();
        assert_eq!(ids, vec!["a", "b"]);
        again.remove("a").unwrap();
        again.remove("a").unwrap();
        assert_eq!(again.load_all().len(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
