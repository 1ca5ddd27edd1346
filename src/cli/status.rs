//! `regatta status`: the cluster's nodes, groups, actors and waiting requests, read from the
//! same paged views of the head that back the dashboard's JSON endpoints, so a
//! 100,000-actor cluster answers as quickly as a small one.

use std::fmt::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use regatta_runtime::{
    format_fixed, resolve_token, ActorFilter, ActorRow, Cluster, GroupStatus, NodeRow, Overview, Page, PageRequest,
    View, ViewQuery, UNIT,
};

use super::common::TokenArgs;

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    /// The head's cluster address, HOST:PORT.
    #[arg(long, env = "REGATTA_ADDRESS", default_value = "127.0.0.1:6380")]
    address: String,
    /// Print JSON for scripts: the whole cluster (every actor, streamed from the head a page
    /// at a time) without filters, or the page of actors that `--state`, `--kind`,
    /// `--node`, `--job`, `--name`, `--offset` and `--limit` select.
    #[arg(long)]
    json: bool,
    /// Actors per request while `--json` streams the whole cluster (tests use small pages).
    #[arg(long, default_value_t = 1_000, hide = true, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    json_page: u32,
    /// Only actors in this state: pending, starting, alive, restarting or dead.
    #[arg(long)]
    state: Option<String>,
    /// Only actors of this kind.
    #[arg(long)]
    kind: Option<String>,
    /// Only actors on this node.
    #[arg(long)]
    node: Option<String>,
    /// Only actors of this job.
    #[arg(long)]
    job: Option<String>,
    /// Only actors whose name contains this.
    #[arg(long)]
    name: Option<String>,
    /// Actors skipped before the ones listed.
    #[arg(long)]
    offset: Option<usize>,
    /// Actors listed (1 to 1000; default 20).
    #[arg(long)]
    limit: Option<usize>,
    #[command(flatten)]
    token: TokenArgs,
}

impl StatusArgs {
    fn filter(&self) -> ActorFilter {
        ActorFilter {
            kind: self.kind.clone(),
            state: self.state.clone(),
            node: self.node.clone(),
            job: self.job.clone(),
            name: self.name.clone(),
        }
    }

    /// Whether the caller asked for a particular page of actors.
    fn selects_actors(&self) -> bool {
        self.filter() != ActorFilter::default() || self.offset.is_some() || self.limit.is_some()
    }
}

pub(crate) async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let (token, _) = resolve_token(args.token.token.as_deref(), args.token.token_file.as_deref(), false)?;
    let client = regatta_runtime::Client::connect_with(&args.address, &token, false)
        .await
        .with_context(|| format!("cannot reach the head at {}", args.address))?;
    let filter = args.filter().checked()?;
    let page = PageRequest::new(args.offset, Some(args.limit.unwrap_or(20)))?;
    if args.json && !args.selects_actors() {
        // Buffered, and not the stdout lock: the command runs as a task that may move
        // between threads at each await.
        let mut out = std::io::BufWriter::new(std::io::stdout());
        stream_status(client.cluster(), args.json_page, &mut out).await?;
        std::io::Write::flush(&mut out)?;
    } else if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&actors(client.cluster(), filter, page).await?)?
        );
    } else {
        print!("{}", render(client.cluster(), filter, page).await?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the whole cluster's state as one JSON object (a `ClusterStatus`), asking the
/// head a page of actors at a time and writing each page as it comes: memory and message
/// sizes stay bounded however many actors the cluster holds.
pub async fn stream_status(cluster: &Cluster, page_size: u32, out: &mut impl std::io::Write) -> anyhow::Result<()> {
    let first = cluster.status_page(None, page_size).await?;
    write!(
        out,
        "{{\"nodes\":{},\"groups\":{},\"pending\":{},\"objects\":{},\"actors\":[",
        serde_json::to_string(&first.nodes)?,
        serde_json::to_string(&first.groups)?,
        serde_json::to_string(&first.pending)?,
        serde_json::to_string(&first.objects)?,
    )?;
    let mut page = first.actors;
    let mut written = 0usize;
    loop {
        for line in &page {
            if written > 0 {
                out.write_all(b",\n")?;
            }
            serde_json::to_writer(&mut *out, line)?;
            written += 1;
        }
        match page.last() {
            Some(last) if page.len() == page_size as usize => {
                let after = last.view.id;
                page = cluster.status_page(Some(after), page_size).await?.actors;
            }
            _ => break,
        }
    }
    writeln!(out, "]}}")?;
    out.flush()?;
    Ok(())
}

async fn actors(cluster: &Cluster, filter: ActorFilter, page: PageRequest) -> anyhow::Result<Page<ActorRow>> {
    match cluster.view(ViewQuery::Actors(filter, page)).await? {
        View::Actors(page) => Ok(page),
        other => anyhow::bail!("the head answered another view: {other:?}"),
    }
}

/// The cluster for people: counts, every node, placement groups, and one page of actors.
pub async fn render(cluster: &Cluster, filter: ActorFilter, page: PageRequest) -> anyhow::Result<String> {
    let View::Overview(overview) = cluster.view(ViewQuery::Overview).await? else {
        anyhow::bail!("the head answered another view");
    };
    let all = PageRequest::new(None, Some(regatta_runtime::MAX_PAGE))?;
    let View::Nodes(nodes) = cluster.view(ViewQuery::Nodes(all)).await? else {
        anyhow::bail!("the head answered another view");
    };
    let View::Groups(groups) = cluster.view(ViewQuery::Groups(all)).await? else {
        anyhow::bail!("the head answered another view");
    };
    let listed = actors(cluster, filter.clone(), page).await?;
    let mut out = String::new();
    render_nodes(&mut out, &overview, &nodes);
    render_groups(&mut out, &groups);
    render_actors(&mut out, &overview, &filter, &listed);
    let objects = &overview.objects;
    let _ = writeln!(
        out,
        "Objects: {} ({:.1} MiB), {} spilled ({:.1} MiB), {} lost",
        objects.objects,
        objects.bytes as f64 / 1048576.0,
        objects.spilled_objects,
        objects.spilled_bytes as f64 / 1048576.0,
        objects.lost
    );
    let _ = writeln!(
        out,
        "Waiting for resources: {} (regatta status --state pending lists the actors)",
        overview.waiting
    );
    Ok(out)
}

fn render_nodes(out: &mut String, overview: &Overview, nodes: &Page<NodeRow>) {
    let _ = writeln!(
        out,
        "Nodes: {} alive, {} dead",
        overview.nodes_alive, overview.nodes_dead
    );
    for node in &nodes.items {
        let heartbeat = node
            .heartbeat_age_s
            .map(|age| format!("  heartbeat {age:.1}s ago"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<12} {:<5} for {:>7.1}s  {}  actors {}{heartbeat}",
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
                    let gib = |fixed: u64| fixed as f64 / UNIT as f64 / (1u64 << 30) as f64;
                    format!("{name} {:.1}/{:.1} GiB", gib(used), gib(total))
                } else {
                    format!("{name} {}/{}", format_fixed(used), format_fixed(total))
                }
            })
            .collect();
        let _ = writeln!(out, "      used/total: {}", usage.join(", "));
    }
    if nodes.total > nodes.items.len() {
        let _ = writeln!(out, "  ... {} more nodes", nodes.total - nodes.items.len());
    }
}

fn render_groups(out: &mut String, groups: &Page<GroupStatus>) {
    let _ = writeln!(out, "Placement groups: {}", groups.total);
    for group in &groups.items {
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
}

fn render_actors(out: &mut String, overview: &Overview, filter: &ActorFilter, listed: &Page<ActorRow>) {
    let count = |state: &str| overview.actors.get(state).copied().unwrap_or(0);
    let _ = writeln!(
        out,
        "Actors: {} live ({} alive, {} pending, {} starting, {} restarting), {} dead",
        count("alive") + count("pending") + count("starting") + count("restarting"),
        count("alive"),
        count("pending"),
        count("starting"),
        count("restarting"),
        count("dead")
    );
    let selection = if *filter == ActorFilter::default() {
        String::new()
    } else {
        " matching the filter".to_string()
    };
    let shown = listed.items.len();
    let _ = writeln!(
        out,
        "  {}{selection}: {} of {}",
        if shown == 0 { "none listed" } else { "listed" },
        if shown == 0 {
            "0".to_string()
        } else {
            format!("{}-{}", listed.offset + 1, listed.offset + shown)
        },
        listed.total
    );
    for actor in &listed.items {
        let mut line = format!(
            "  {:>6} {:<12} {:<10} {:<10}",
            actor.id.0,
            actor.kind,
            actor.state,
            actor.node.as_deref().unwrap_or("-")
        );
        if let Some(name) = &actor.name {
            let _ = write!(line, " name {name}");
        }
        if let Some(job) = &actor.job {
            let _ = write!(line, " job {job}");
        }
        if actor.restarts > 0 {
            let _ = write!(line, " restarts {}", actor.restarts);
        }
        if let Some(waiting) = actor.waiting_s {
            let _ = write!(line, " waiting {waiting:.1}s for {{{}}}", actor.resources);
        }
        if let Some(cause) = &actor.cause {
            let _ = write!(line, " cause: {cause}");
        }
        let _ = writeln!(out, "{line}");
    }
    if listed.offset + shown < listed.total {
        let _ = writeln!(
            out,
            "  ... more with --offset {} (filters: --state --kind --node --job --name)",
            listed.offset + shown
        );
    }
}
