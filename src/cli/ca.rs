//! `regatta ca`: the cluster authorities' certificates, for browsers and other TLS clients
//! to trust the head's HTTPS port (the dashboard, the job API) without a warning; and
//! `regatta ca show|rotate|finish`, rotating the authority without a restart.

use std::process::ExitCode;

use clap::{Args, Subcommand};

use super::common::TokenArgs;

#[derive(Args, Debug)]
pub struct CaArgs {
    /// What to do: print the authorities (no step), show them, or rotate to a new one.
    #[command(subcommand)]
    step: Option<Step>,
    /// The head's job API, https://HOST:8265.
    #[arg(long, env = "REGATTA_JOB_ADDRESS", default_value = regatta_runtime::DEFAULT_JOB_ADDRESS, global = true)]
    address: String,
    #[command(flatten)]
    token: TokenArgs,
}

/// A step of rotating the cluster's authority (docs/TRUST.md, "Rotating the authority").
#[derive(Subcommand, Debug)]
enum Step {
    /// The cluster's id and its authorities' hashes.
    Show,
    /// Make a new authority: it issues every certificate from now on, while the current one
    /// stays trusted until the certificates it issued have expired.
    Rotate,
    /// Stop trusting the retiring authority (refused while its certificates may be in use).
    Finish {
        /// Finish now: processes still holding a certificate of the retiring authority are
        /// refused at once (they must join again).
        #[arg(long)]
        force: bool,
    },
}

/// Prints the authorities as PEM on stdout (the issuing one first), fetched from the job
/// API and believed only with the join token's proof of each (and the pinned hash, when
/// given, must be one of them).
pub async fn run(args: CaArgs) -> anyhow::Result<ExitCode> {
    let (token, _) =
        regatta_runtime::resolve_token(args.token.token.as_deref(), args.token.token_file.as_deref(), false)?;
    if let Some(step) = &args.step {
        return rotation(&args.address, &token, step).await;
    }
    let authorities = regatta_runtime::fetch_cluster_authority(&args.address, &token).await?;
    let hashes = authorities
        .iter()
        .map(regatta_net::CaHash::of_certificate)
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(pinned) = &args.token.ca_hash {
        let pinned: regatta_net::CaHash = pinned.parse()?;
        if !hashes.contains(&pinned) {
            let held: Vec<String> = hashes.iter().map(ToString::to_string).collect();
            anyhow::bail!(
                "the head's authorities are {}, not the pinned {pinned}",
                held.join(", ")
            );
        }
    }
    for authority in &authorities {
        print!("{}", regatta_net::certificate_pem(authority.as_ref()));
    }
    let held: Vec<String> = hashes.iter().map(ToString::to_string).collect();
    eprintln!(
        "cluster {} {}: import {} as trusted (a browser's or the system's) and open the dashboard by the head's \
         advertised host, localhost or 127.0.0.1 (its HTTPS certificate names them)",
        if hashes.len() == 1 {
            "authority"
        } else {
            "authorities (a rotation is under way)"
        },
        held.join(", "),
        if hashes.len() == 1 { "it" } else { "them" },
    );
    Ok(ExitCode::SUCCESS)
}

/// `regatta ca rotate` and `regatta ca finish`: one step of a rotation through the job API,
/// and where the cluster's authorities stand after it.
async fn rotation(address: &str, token: &str, step: &Step) -> anyhow::Result<ExitCode> {
    let client = regatta_runtime::JobClient::new(address, token)?;
    let view = match step {
        Step::Rotate => client.rotate_authority().await?,
        Step::Finish { force } => client.finish_rotation(*force).await?,
        Step::Show => client.authorities().await?,
    };
    println!("cluster   {}", view.cluster);
    println!("issuing   {}", view.issuing);
    match &view.retiring {
        Some((hash, until)) => {
            let left = until
                .duration_since(std::time::SystemTime::now())
                .map_or(0, |d| d.as_secs());
            println!("retiring  {hash} (its certificates may be in use for {left} s more)");
            println!(
                "every process moves to the issuing authority as it renews; `regatta ca finish` once the retiring one's certificates have expired"
            );
        }
        None => println!("retiring  -"),
    }
    Ok(ExitCode::SUCCESS)
}
