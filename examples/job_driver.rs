//! A driver meant to be submitted as a job: it connects through the client library with
//! the address and token the job manager puts in its environment, spawns actors on the
//! workers, moves an object between them, and prints what it saw.
//!
//! Submit it to a running cluster with one command:
//!
//! ```text
//! cargo build --release --examples
//! regatta job submit -- "$PWD/target/release/examples/job_driver"
//! ```
//!
//! `job_driver --hold SECONDS` keeps the job running afterwards (to try `regatta job stop`).

use std::process::ExitCode;
use std::time::Duration;

use regatta::kinds::{Counter, CounterOp, CounterReply, Store, StoreOp, StoreReply};
use regatta::{ActorOptions, Client};

fn main() -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("job driver failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let address = std::env::var(regatta::ADDRESS_ENV)
        .map_err(|_| anyhow::anyhow!("{} is not set: submit this program as a job", regatta::ADDRESS_ENV))?;
    let (token, _) = regatta::resolve_token(None, None, false)?;
    let client = Client::connect(&address, &token).await?;
    println!("driver of job {:?} connected to {address}", client.job());

    // Restartable, so a worker lost while the job runs costs nothing but a restart.
    let counters = [
        client.spawn::<Counter>(10, ActorOptions::new().max_restarts(3)).await?,
        client.spawn::<Counter>(20, ActorOptions::new().max_restarts(3)).await?,
    ];
    for counter in &counters {
        let total = counter.call(CounterOp::Add(1)).await?;
        let placement = counter.call(CounterOp::Where).await?;
        println!("counter {} -> {total:?} at {placement:?}", counter.id());
    }
    let reply = counters[0]
        .call(CounterOp::AddToPeer {
            peer: counters[1].id(),
            amount: 5,
        })
        .await?;
    anyhow::ensure!(
        reply == CounterReply::Total(26),
        "actor-to-actor call returned {reply:?}"
    );

    let (a, b) = (
        client.spawn::<Store>((), ActorOptions::new()).await?,
        client.spawn::<Store>((), ActorOptions::new()).await?,
    );
    let (reference, digest) = match a
        .call(StoreOp::Put {
            size: 1 << 20,
            seed: 1,
            keep: true,
        })
        .await?
    {
        StoreReply::Put { reference, digest } => (reference, digest),
        other => anyhow::bail!("unexpected reply {other:?}"),
    };
    match b.call(StoreOp::Get(reference.clone())).await? {
        StoreReply::Got { len, digest: got } if got == digest => {
            println!("object {} ({len} bytes) read back intact", reference.id())
        }
        other => anyhow::bail!("object read back wrong: {other:?}"),
    }
    let mine = client.put(&vec![1u32, 2, 3]).await?;
    println!("driver object {} -> {:?}", mine.id(), client.get(&mine).await?);
    println!(
        "actors: {}",
        counters
            .iter()
            .map(|c| c.id().to_string())
            .collect::<Vec<_>>()
            .join(",")
    );

    let mut args = std::env::args().skip(1);
    if let (Some(flag), Some(seconds)) = (args.next(), args.next()) {
        if flag == "--hold" {
            println!("holding for {seconds} s");
            tokio::time::sleep(Duration::from_secs(seconds.parse()?)).await;
        }
    }
    println!("job driver done");
    Ok(())
}
