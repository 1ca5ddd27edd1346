//! What several commands share: the cluster token's options and running a command's work
//! on a given cluster or on a local one started for it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use regatta_runtime::Client;

use crate::local::{LocalCluster, LocalOptions, WorkerSpec};

#[derive(Args, Debug, Clone)]
pub(crate) struct TokenArgs {
    /// Cluster token (else REGATTA_TOKEN, --token-file, or ~/.regatta/token).
    #[arg(long, env = "REGATTA_TOKEN", hide_env_values = true, global = true)]
    pub(crate) token: Option<String>,
    /// File holding the cluster token.
    #[arg(long, global = true)]
    pub(crate) token_file: Option<PathBuf>,
    /// The cluster authority's hash (sha256:..., printed by the head): join only a head
    /// that holds it.
    #[arg(long, env = "REGATTA_CA_HASH", global = true)]
    pub(crate) ca_hash: Option<String>,
}

impl TokenArgs {
    /// The join credentials these options give.
    pub(crate) fn credentials(&self) -> anyhow::Result<regatta_runtime::JoinCredentials> {
        let (token, _) = regatta_runtime::resolve_token(self.token.as_deref(), self.token_file.as_deref(), false)?;
        Ok(regatta_runtime::JoinCredentials::parse(
            &token,
            self.ca_hash.as_deref(),
        )?)
    }
}

/// Runs `work` for a CLI command on the cluster at `address` (token from `token`), or on
/// a local cluster of `workers` started for it and stopped after. Ctrl-C cancels `work`
/// (whose drop guards clean up on the remote cluster, given a moment) or stops every
/// process of the local cluster; the exit code is then 130.
pub(crate) async fn on_cluster<F, Fut>(
    address: Option<&str>,
    token: &TokenArgs,
    workers: Vec<WorkerSpec>,
    work: F,
) -> anyhow::Result<std::process::ExitCode>
where
    F: FnOnce(regatta_runtime::Cluster) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<std::process::ExitCode>>,
{
    use std::process::ExitCode;
    if let Some(address) = address {
        let client = Client::connect_credentials(address, &token.credentials()?)
            .await
            .with_context(|| format!("cannot reach the cluster at {address}"))?;
        return tokio::select! {
            outcome = work(client.cluster().clone()) => outcome,
            () = crate::signal::shutdown_signal() => {
                println!("interrupted: stopping what this command started on the cluster");
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok(ExitCode::from(130))
            }
        };
    }
    let options = LocalOptions::new(workers)?;
    println!(
        "starting a local cluster: head + {} workers (logs in {})",
        options.workers.len(),
        options.log_dir.display()
    );
    let mut cluster = LocalCluster::start(options)?;
    let outcome = tokio::select! {
        outcome = async {
            let client = cluster.connect(Duration::from_secs(30)).await?;
            work(client.cluster().clone()).await
        } => outcome,
        () = crate::signal::shutdown_signal() => {
            println!("interrupted: stopping the cluster");
            Ok(ExitCode::from(130))
        }
    };
    cluster.shutdown();
    println!("cluster stopped");
    outcome
}
