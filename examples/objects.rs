//! The shared object store on a local cluster: the driver puts a value and a 32 MiB
//! buffer, an actor on one worker puts its own object, an actor on the other worker reads
//! it over QUIC, and every read is checked.
//!
//! ```text
//! cargo build --release && cargo run --release --example objects
//! ```
//!
//! Set `REGATTA_ADDRESS` (and `REGATTA_TOKEN`) to use a running cluster instead.

use std::process::ExitCode;
use std::time::Instant;

use regatta::kinds::{Store, StoreOp, StoreReply};
use regatta::local::{connect_or_start, WorkerSpec};
use regatta::{ActorOptions, Resources};

fn main() -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("objects example failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let workers = vec![
        WorkerSpec::new("w1", "CPU=2,pin:w1=1"),
        WorkerSpec::new("w2", "CPU=2,pin:w2=1"),
    ];
    let (_local, client) = connect_or_start(workers).await?;
    let cluster = client.cluster();

    // A typed value and a raw buffer, from the driver.
    let greeting = cluster.put(&("hello".to_string(), vec![1u32, 2, 3])).await?;
    let (text, numbers) = cluster.get(&greeting).await?;
    anyhow::ensure!(text == "hello" && numbers == [1, 2, 3], "the value came back different");
    let buffer = cluster.put_bytes(vec![7u8; 32 << 20]).await?;
    anyhow::ensure!(
        cluster.get_bytes(&buffer).await?.iter().all(|b| *b == 7),
        "the buffer changed"
    );
    println!(
        "driver put and read back object {} and 32 MiB object {}",
        greeting.id(),
        buffer.id()
    );

    // From one worker to the other: the reference travels in a message, the bytes over QUIC.
    let pin = |node: &str| Resources::parse_request(&format!("pin:{node}")).map(|r| ActorOptions::new().resources(r));
    let writer = client.spawn::<Store>((), pin("w1")?).await?;
    let reader = client.spawn::<Store>((), pin("w2")?).await?;
    let StoreReply::Put { reference, digest } = writer
        .call(StoreOp::Put {
            size: 64 << 20,
            seed: 42,
            keep: true,
        })
        .await?
    else {
        anyhow::bail!("the writer did not put");
    };
    let started = Instant::now();
    let StoreReply::Got { len, digest: read } = reader.call(StoreOp::Get(reference.clone())).await? else {
        anyhow::bail!("the reader did not get");
    };
    anyhow::ensure!(
        read == digest && len == 64 << 20,
        "object {} came back different",
        reference.id()
    );
    println!(
        "64 MiB object {} put on w1, read byte-exact on w2 in {:.2}s",
        reference.id(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
