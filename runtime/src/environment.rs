//! The environment of the processes Regatta starts for users' code (job drivers through
//! their supervisor, trainer and scorer executors, Python actors): cleared first, then the
//! parent's variables that an allowlist names, then what Regatta hands the process itself.
//! A head or worker started with cloud credentials, its join token or anything else in its
//! environment passes on only what is needed to run code; an operator adds names with
//! `--pass-env` (or `REGATTA_PASS_ENV`), a job adds its own through its `runtime_env`.

use std::ffi::{OsStr, OsString};
use std::sync::OnceLock;

/// Variables every started process inherits when its parent has them: where programs,
/// libraries, Python and the trust store are, the user, the locale, the terminal, the
/// proxies, Hugging Face's and the BLAS libraries' settings.
pub const INHERITED: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "HOSTNAME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "TMPDIR",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_RUNTIME_DIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "RUST_LOG",
    "RUST_BACKTRACE",
];

/// Prefixes of inherited variables: the locale's parts, CUDA's, NCCL's, the NVIDIA
/// container runtime's, PyTorch's, the thread pools' and Regatta's own (less
/// [`WITHHELD`]).
pub const INHERITED_PREFIXES: &[&str] = &[
    "LC_",
    "CUDA_",
    "NCCL_",
    "NVIDIA_",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "REGATTA_",
];

/// Prefixes an executor of Regatta's own that reads and writes object storage (a trainer
/// rank's checkpoints and models on S3, a scorer's) inherits on top: the storage
/// credentials and settings `object_store` reads. Users' code (drivers, Python actors)
/// does not get them unless an operator passes them.
pub const STORAGE_PREFIXES: &[&str] = &["AWS_"];

/// Variables never inherited, even through a prefix or `--pass-env`: the parent's own
/// credentials. A process that needs one is handed its own by Regatta.
pub const WITHHELD: &[&str] = &["REGATTA_TOKEN"];

/// The variable naming the operator's extra names (`--pass-env` sets the same list).
pub const PASS_ENV: &str = "REGATTA_PASS_ENV";

/// The operator's extra names, set once at start ([`pass_also`]).
static PASSED: OnceLock<Vec<String>> = OnceLock::new();

/// Adds names (comma-separated; `PREFIX*` for every name that starts so) to what started
/// processes inherit. Called once, by `regatta head` and `regatta worker` with
/// `--pass-env`; later calls are ignored. Without a call, [`PASS_ENV`] is read.
pub fn pass_also(names: &str) {
    let _ = PASSED.set(parse_names(names));
}

/// The names of a `--pass-env` list.
pub fn parse_names(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_string)
        .collect()
}

fn passed() -> &'static [String] {
    PASSED.get_or_init(|| std::env::var(PASS_ENV).map(|v| parse_names(&v)).unwrap_or_default())
}

/// Whether a variable named `name` is inherited, given the operator's `extra` names.
pub fn inherits(name: &OsStr, extra: &[String]) -> bool {
    let Some(name) = name.to_str() else {
        return false;
    };
    if WITHHELD.contains(&name) {
        return false;
    }
    let listed = |pattern: &str| match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    };
    INHERITED.contains(&name)
        || INHERITED_PREFIXES.iter().any(|prefix| name.starts_with(prefix))
        || extra.iter().any(|pattern| listed(pattern))
}

/// The variables of `parent` a started process inherits, given the operator's `extra`.
pub fn inherited_from(
    parent: impl IntoIterator<Item = (OsString, OsString)>,
    extra: &[String],
) -> Vec<(OsString, OsString)> {
    parent.into_iter().filter(|(name, _)| inherits(name, extra)).collect()
}

/// Clears `command`'s environment and gives it what it inherits from this process's
/// (the allowlist plus the operator's `--pass-env`); the caller adds the process's own.
pub fn restrict(command: &mut tokio::process::Command) {
    command.env_clear().envs(inherited_from(std::env::vars_os(), passed()));
}

/// [`restrict`] for an executor of Regatta's own that uses object storage: the storage
/// variables ([`STORAGE_PREFIXES`]) too.
pub fn restrict_for_storage(command: &mut tokio::process::Command) {
    let mut extra = passed().to_vec();
    extra.extend(STORAGE_PREFIXES.iter().map(|prefix| format!("{prefix}*")));
    command.env_clear().envs(inherited_from(std::env::vars_os(), &extra));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(parent: &[(&str, &str)], extra: &[&str]) -> Vec<String> {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let parent = parent.iter().map(|(k, v)| (OsString::from(k), OsString::from(v)));
        inherited_from(parent, &extra)
            .into_iter()
            .map(|(k, _)| k.into_string().unwrap())
            .collect()
    }

    #[test]
    fn credentials_stay_behind_and_what_code_needs_goes_through() {
        let parent = [
            ("PATH", "/usr/bin"),
            ("HOME", "/root"),
            ("LC_ALL", "C"),
            ("CUDA_HOME", "/usr/local/cuda"),
            ("NCCL_DEBUG", "INFO"),
            ("REGATTA_LOG", "debug"),
            ("REGATTA_TOKEN", "abcdef.0123456789abcdef0123456789abcdef"),
            ("AWS_SECRET_ACCESS_KEY", "wJalr"),
            ("AWS_ACCESS_KEY_ID", "AKIA"),
            ("GITHUB_TOKEN", "ghp_x"),
            ("DATABASE_URL", "postgres://u:p@db"),
        ];
        assert_eq!(
            names(&parent, &[]),
            ["PATH", "HOME", "LC_ALL", "CUDA_HOME", "NCCL_DEBUG", "REGATTA_LOG"]
        );
    }

    #[test]
    fn the_operator_adds_names_and_prefixes_but_never_the_withheld() {
        let parent = [
            ("AWS_SECRET_ACCESS_KEY", "wJalr"),
            ("AWS_ACCESS_KEY_ID", "AKIA"),
            ("WANDB_API_KEY", "k"),
            ("WANDB_PROJECT", "p"),
            ("REGATTA_TOKEN", "t"),
        ];
        assert_eq!(
            names(&parent, &["WANDB_*", "AWS_ACCESS_KEY_ID", "REGATTA_TOKEN"]),
            ["AWS_ACCESS_KEY_ID", "WANDB_API_KEY", "WANDB_PROJECT"]
        );
        assert_eq!(parse_names(" A, B*,,C "), ["A", "B*", "C"]);
    }

    #[test]
    fn a_name_that_is_not_unicode_is_not_inherited() {
        use std::os::unix::ffi::OsStringExt;
        let odd = OsString::from_vec(vec![b'P', 0xff]);
        assert!(!inherits(&odd, &["P*".into()]));
    }

    #[tokio::test]
    async fn a_restricted_command_sees_the_allowlist_and_its_own_variables_only() {
        let mut command = tokio::process::Command::new("/usr/bin/env");
        restrict(&mut command);
        command.env("OWN", "1");
        let output = command.output().await.expect("env runs");
        let text = String::from_utf8(output.stdout).unwrap();
        let seen: Vec<&str> = text.lines().filter_map(|l| l.split_once('=').map(|(k, _)| k)).collect();
        assert!(seen.contains(&"OWN"), "{seen:?}");
        for name in &seen {
            assert!(
                *name == "OWN" || inherits(OsStr::new(name), passed()),
                "{name} was passed on"
            );
        }
        if std::env::var_os("PATH").is_some() {
            assert!(seen.contains(&"PATH"), "{seen:?}");
        }
    }
}
