//! Where a process finds its join token (`<id>.<secret>`, [`regatta_net::JoinToken`]),
//! which it trades at the head for a certificate of the cluster's authority.
//!
//! Resolution order: an explicit value (flag), `REGATTA_TOKEN`, an explicit file, then the
//! default file `~/.regatta/token`, which a head creates (mode 0600) when nothing else is
//! given so that workers and clients on the same machine need no flags.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Environment variable holding the token.
pub const TOKEN_ENV: &str = "REGATTA_TOKEN";

/// The default token file.
pub fn default_token_file() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".regatta").join("token")
}

/// Where a token came from, for log lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenSource {
    /// `--token`.
    Flag,
    /// `REGATTA_TOKEN`.
    Env,
    /// A token file.
    File(PathBuf),
    /// Newly generated into the default file.
    Generated(PathBuf),
}

/// Finds the token; `create` lets a head generate one into the default file.
pub fn resolve_token(flag: Option<&str>, file: Option<&Path>, create: bool) -> Result<(String, TokenSource)> {
    if let Some(token) = flag.filter(|t| !t.trim().is_empty()) {
        return Ok((token.trim().to_string(), TokenSource::Flag));
    }
    if let Ok(token) = std::env::var(TOKEN_ENV) {
        if !token.trim().is_empty() {
            return Ok((token.trim().to_string(), TokenSource::Env));
        }
    }
    if let Some(path) = file {
        return read_token(path).map(|t| (t, TokenSource::File(path.to_path_buf())));
    }
    let default = default_token_file();
    if default.exists() {
        return read_token(&default).map(|t| (t, TokenSource::File(default)));
    }
    if !create {
        return Err(Error::Token(format!(
            "no cluster token: give --token, set {TOKEN_ENV}, pass --token-file, or run the head on this machine first (it writes {})",
            default.display()
        )));
    }
    let token = regatta_net::JoinToken::generate().to_string();
    write_token(&default, &token)?;
    Ok((token, TokenSource::Generated(default)))
}

fn read_token(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("cannot read the token file {}", path.display()), e))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(Error::Token(format!(
            "no cluster token: the token file {} is empty",
            path.display()
        )));
    }
    Ok(token.to_string())
}

/// Writes a new token file readable by its user only from the first byte (made with mode
/// 600, never widened and narrowed after), in a folder made with mode 700; an existing
/// file is not overwritten.
fn write_token(path: &Path, token: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io(format!("cannot create {}", path.display()), e))?;
    file.write_all(format!("{token}\n").as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_wins_and_files_are_trimmed() {
        assert_eq!(resolve_token(Some(" abc "), None, false).unwrap().0, "abc");
        let dir = std::env::temp_dir().join(format!("regatta-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t");
        std::fs::write(&file, "s3cret\n").unwrap();
        if std::env::var(TOKEN_ENV).is_err() {
            assert_eq!(resolve_token(None, Some(&file), false).unwrap().0, "s3cret");
            std::fs::write(&file, "\n").unwrap();
            assert!(resolve_token(None, Some(&file), false)
                .unwrap_err()
                .to_string()
                .contains("empty"));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_new_token_file_is_private_from_its_first_byte_and_never_overwritten() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("regatta-token-write-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = dir.join("home/.regatta/token");
        write_token(&file, "abc").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "abc\n");
        assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(file.parent().unwrap()).unwrap().mode() & 0o777, 0o700);
        let again = write_token(&file, "other").unwrap_err();
        assert!(
            matches!(&again, Error::Io { cause, .. } if cause.kind() == std::io::ErrorKind::AlreadyExists),
            "{again}"
        );
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "abc\n",
            "the first token is kept"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
