//! `regatta node ...`: nodes of a running cluster, through the head's job API.

use std::process::ExitCode;

use clap::{Args, Subcommand};

use super::job::ApiArgs;

/// Node commands.
#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// Remove a node for good: the head declares it dead at once (its actors restart
    /// elsewhere within their budgets) and refuses its certificate and its name from then
    /// on; the worker process ends when the head refuses it.
    Remove(RemoveArgs),
}

#[derive(Args, Debug)]
pub struct RemoveArgs {
    /// The node's name.
    name: String,
    #[command(flatten)]
    api: ApiArgs,
}

/// Runs a node command.
pub async fn run(command: NodeCommand) -> anyhow::Result<ExitCode> {
    match command {
        NodeCommand::Remove(args) => {
            let known = args.api.client()?.remove_node(&args.name).await?;
            if known {
                println!("removed {}", args.name);
            } else {
                println!(
                    "the head knows no node {}: its name is refused from now on all the same",
                    args.name
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
