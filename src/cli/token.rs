//! `regatta token ...`: join tokens, made offline or on a running head.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::Value;

use super::job::ApiArgs;

/// Join token commands.
#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Print a new random join token (`<id>.<secret>`), made here without a head: give it
    /// to a new head with --token (or REGATTA_TOKEN), and to its workers.
    Generate,
    /// Make a join token on the running head (through its job API) and print it with the
    /// authority's hash workers pin with --ca-hash.
    Create(CreateArgs),
    /// List the head's join tokens: ids, expiry, uses left (never a secret).
    List(ListArgs),
    /// Revoke a join token: joins with it are refused from now on. Nodes that joined with
    /// it keep their certificates.
    Revoke(RevokeArgs),
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// How long the token works, in seconds.
    #[arg(long, default_value_t = 24 * 3600)]
    ttl_secs: u64,
    /// How many joins it allows (default: unlimited until it expires).
    #[arg(long)]
    uses: Option<u32>,
    /// What it is for (listed with it).
    #[arg(long, default_value = "")]
    description: String,
    #[command(flatten)]
    api: ApiArgs,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    api: ApiArgs,
}

#[derive(Args, Debug)]
pub struct RevokeArgs {
    /// The token's id (the part before the dot).
    id: String,
    #[command(flatten)]
    api: ApiArgs,
}

/// Runs a token command.
pub async fn run(command: TokenCommand) -> anyhow::Result<ExitCode> {
    match command {
        TokenCommand::Generate => {
            println!("{}", regatta_runtime::JoinToken::generate());
        }
        TokenCommand::Create(args) => {
            if args.ttl_secs == 0 || args.uses == Some(0) {
                anyhow::bail!("--ttl-secs and --uses must be at least 1");
            }
            let reply = args
                .api
                .client()?
                .create_join_token(Some(Duration::from_secs(args.ttl_secs)), args.uses, &args.description)
                .await?;
            let field = |name: &str| reply.get(name).and_then(Value::as_str).unwrap_or_default().to_string();
            println!("{}", field("token"));
            eprintln!(
                "join with: regatta worker --address <head>:6380 --token {} --ca-hash {}",
                field("token"),
                field("ca_hash")
            );
        }
        TokenCommand::List(args) => {
            let reply = args.api.client()?.list_join_tokens().await?;
            println!(
                "cluster authority {}",
                reply.get("ca_hash").and_then(Value::as_str).unwrap_or("?")
            );
            // During a rotation the retiring authority is still trusted (and pinnable).
            for hash in reply
                .get("ca_hashes")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .skip(1)
            {
                println!("retiring authority {}", hash.as_str().unwrap_or("?"));
            }
            println!("{:<8} {:<22} {:<10} DESCRIPTION", "ID", "EXPIRES (UNIX)", "USES LEFT");
            for token in reply.get("tokens").and_then(Value::as_array).into_iter().flatten() {
                let text = |name: &str| match token.get(name) {
                    Some(Value::Null) | None => "-".to_string(),
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                };
                let bootstrap = token.get("bootstrap").and_then(Value::as_bool).unwrap_or(false);
                println!(
                    "{:<8} {:<22} {:<10} {}{}",
                    text("id"),
                    text("expires_unix"),
                    text("uses_left"),
                    text("description"),
                    if bootstrap { " [bootstrap]" } else { "" }
                );
            }
        }
        TokenCommand::Revoke(args) => {
            if args.api.client()?.revoke_join_token(&args.id).await? {
                println!("revoked {}", args.id);
            } else {
                eprintln!("the head has no join token {}", args.id);
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
