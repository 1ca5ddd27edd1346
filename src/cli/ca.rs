//! `regatta ca`: the cluster authority's certificate, for browsers and other TLS clients
//! to trust the head's HTTPS port (the dashboard, the job API) without a warning.

use std::process::ExitCode;

use clap::Args;

use super::common::TokenArgs;

#[derive(Args, Debug)]
pub struct CaArgs {
    /// The head's job API, https://HOST:8265.
    #[arg(long, env = "REGATTA_JOB_ADDRESS", default_value = regatta_runtime::DEFAULT_JOB_ADDRESS)]
    address: String,
    #[command(flatten)]
    token: TokenArgs,
}

/// Prints the authority as PEM on stdout, fetched from the job API and believed only with
/// the join token's proof of it (and the pinned hash, when given).
pub async fn run(args: CaArgs) -> anyhow::Result<ExitCode> {
    let (token, _) =
        regatta_runtime::resolve_token(args.token.token.as_deref(), args.token.token_file.as_deref(), false)?;
    let authority = regatta_runtime::fetch_cluster_authority(&args.address, &token).await?;
    let hash = regatta_net::CaHash::of_certificate(&authority)?;
    if let Some(pinned) = &args.token.ca_hash {
        let pinned: regatta_net::CaHash = pinned.parse()?;
        if pinned != hash {
            anyhow::bail!("the head's authority is {hash}, not the pinned {pinned}");
        }
    }
    print!("{}", regatta_net::certificate_pem(authority.as_ref()));
    eprintln!(
        "cluster authority {hash}: import it as a trusted authority (a browser's or the system's) and open the \
         dashboard by the head's advertised host, localhost or 127.0.0.1 (its HTTPS certificate names them)"
    );
    Ok(ExitCode::SUCCESS)
}
