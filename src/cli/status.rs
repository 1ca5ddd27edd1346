//! `regatta status`: the cluster's nodes, actors, groups and waiting requests.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use regatta_runtime::{format_fixed, resolve_token, ClusterStatus};

use super::common::TokenArgs;

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    /// The head's cluster address, HOST:PORT.
    #[arg(long, env = "REGATTA_ADDRESS", default_value = "127.0.0.1:6380")]
    address: String,
    /// Print JSON for scripts.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    token: TokenArgs,
}

pub(crate) async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let (token, _) = resolve_token(args.token.token.as_deref(), args.token.token_file.as_deref(), false)?;
    let client = regatta_runtime::Client::connect_with(&args.address, &token, false)
        .await
        .with_context(|| format!("cannot reach the head at {}", args.address))?;
    let status = client.status().await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render_status(&status));
    }
    Ok(ExitCode::SUCCESS)
}

/// Formats a status snapshot for people.
pub fn render_status(status: &ClusterStatus) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write;
    let mut out = String::new();
    let alive = status.nodes.iter().filter(|n| n.state == "alive").count();
    let _ = writeln!(out, "Nodes: {alive} alive, {} dead", status.nodes.len() - alive);
    for node in &status.nodes {
        let _ = writeln!(
            out,
            "  {:<12} {:<5} for {:>7.1}s  {}  actors {}",
            node.name, node.state, node.since_s, node.address, node.actors
        );
        if let Some(cause) = &node.cause {
            let _ = writeln!(out, "      cause: {cause}");
        }
        let usage: Vec<String> = node
            .total
            .iter()
            .map(|(name, total)| {
                let used = node.used.fixed(name);
                if name == "memory" {
                    let gib = |fixed: u64| fixed as f64 / regatta_runtime::UNIT as f64 / (1u64 << 30) as f64;
                    format!("{name} {:.1}/{:.1} GiB", gib(used), gib(total))
                } else {
                    format!("{name} {}/{}", format_fixed(used), format_fixed(total))
                }
            })
            .collect();
        let _ = writeln!(out, "      used/total: {}", usage.join(", "));
    }
    let _ = writeln!(out, "Placement groups: {}", status.groups.len());
    for group in &status.groups {
        let bundles: Vec<String> = group
            .bundles
            .iter()
            .map(|(r, node)| format!("{{{r}}}@{}", node.as_deref().unwrap_or("-")))
            .collect();
        let _ = writeln!(
            out,
            "  {} {:?} {}  {}",
            group.id,
            group.strategy,
            group.state,
            bundles.join(" ")
        );
    }
    let live: Vec<_> = status
        .actors
        .iter()
        .filter(|a| !matches!(a.view.state, regatta_runtime::ActorState::Dead { .. }))
        .collect();
    let _ = writeln!(
        out,
        "Actors: {} live, {} dead",
        live.len(),
        status.actors.len() - live.len()
    );
    let mut by_kind: BTreeMap<(&str, &str, &str), usize> = BTreeMap::new();
    for actor in &live {
        let node = actor.view.node.as_deref().unwrap_or("-");
        *by_kind
            .entry((&actor.view.kind, node, actor.view.state.label()))
            .or_insert(0) += 1;
    }
    for ((kind, node, state), count) in by_kind {
        let _ = writeln!(out, "  {kind:<12} on {node:<12} {state:<10} {count}");
    }
    let objects = &status.objects;
    let _ = writeln!(
        out,
        "Objects: {} ({:.1} MiB), {} spilled ({:.1} MiB), {} lost",
        objects.objects,
        objects.bytes as f64 / 1048576.0,
        objects.spilled_objects,
        objects.spilled_bytes as f64 / 1048576.0,
        objects.lost
    );
    let _ = writeln!(out, "Waiting for resources: {}", status.pending.len());
    for pending in &status.pending {
        let _ = writeln!(
            out,
            "  {}  wants {}  for {:.1}s",
            pending.what, pending.resources, pending.waiting_s
        );
    }
    out
}
