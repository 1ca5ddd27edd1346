//! A small actor workload on a local cluster: a head and two workers as processes, a few
//! counters spread over them, calls between actors on different nodes, and a GPU-tagged
//! actor that learns its GPU index.
//!
//! Run it with one command:
//!
//! ```text
//! cargo run --example actors
//! ```
//!
//! The example binary is also its own head and worker: started as `actors head ...` or
//! `actors worker ...` it runs the regatta command line with the built-in kinds. This is
//! how a team ships its own actor kinds: one binary that drives and serves.
//!
//! Set `REGATTA_ADDRESS` (and `REGATTA_TOKEN`) to run the same workload on a running cluster.

use std::process::ExitCode;
use std::time::Duration;

use regatta::kinds::{Counter, CounterOp, Echo};
use regatta::local::{LocalCluster, LocalOptions, WorkerSpec};
use regatta::{ActorOptions, Client, Resources};

fn main() -> ExitCode {
    if regatta::cli::is_node_command() {
        return regatta::cli::main_with(regatta::kinds::builtin());
    }
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    // Keep the local cluster alive for the whole run; dropping it stops its processes.
    let (_local, client) = match std::env::var("REGATTA_ADDRESS") {
        Ok(address) => {
            let (token, _) = regatta::resolve_token(None, None, false)?;
            (None, Client::connect(&address, &token).await?)
        }
        Err(_) => {
            let workers = vec![
                WorkerSpec::new("w1", "CPU=2,GPU=1,accelerator_type:H100=1"),
                WorkerSpec::new("w2", "CPU=2"),
            ];
            let mut options = LocalOptions::new(workers)?;
            options.binary = std::env::current_exe()?;
            let local = LocalCluster::start(options)?;
            let client = local.connect(Duration::from_secs(30)).await?;
            (Some(local), client)
        }
    };

    let mut counters = Vec::new();
    for start in [0, 100, 200, 300] {
        let options = ActorOptions::new().resources(Resources::parse_request("CPU=0.5")?);
        counters.push(client.spawn::<Counter>(start, options).await?);
    }
    for counter in &counters {
        let reply = counter.call(CounterOp::Add(1)).await?;
        let place = counter.call(CounterOp::Where).await?;
        println!("counter {}: {reply:?} at {place:?}", counter.id());
    }
    let reply = counters[0]
        .call(CounterOp::AddToPeer {
            peer: counters[3].id(),
            amount: 10,
        })
        .await?;
    println!(
        "counter {} added 10 to counter {}: {reply:?}",
        counters[0].id(),
        counters[3].id()
    );

    let gpu = client
        .spawn::<Echo>(
            "hello from ".into(),
            ActorOptions::new().resources(Resources::parse_request("GPU=1,accelerator_type:H100")?),
        )
        .await?;
    let echo = gpu.call("the GPU actor".into()).await?;
    println!(
        "{} on {} with GPUs {:?}",
        echo.text, echo.placement.node, echo.placement.gpu_ids
    );
    Ok(())
}
