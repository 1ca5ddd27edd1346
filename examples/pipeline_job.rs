//! The main job's pipeline driven through the client library as a submitted job: train the
//! built-in GPT with ZeRO-2 over 2 ranks, checkpoint, and score the shipped evaluation set
//! before and after training, on whatever cluster the job runs on.
//!
//! ```text
//! scripts/setup-libtorch.sh && cargo build --release --workspace --examples
//! regatta head &                     # and two workers: regatta worker --address 127.0.0.1:6380
//! regatta job submit -- "$PWD/target/release/examples/pipeline_job" --steps 200
//! ```
//!
//! The job's log shows the training progress, the checkpoints and the report.

use std::process::ExitCode;

use regatta::pipeline::{train_then_score, PipelineOptions};
use regatta::Client;

fn main() -> ExitCode {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipeline job failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let address = std::env::var(regatta::ADDRESS_ENV)
        .map_err(|_| anyhow::anyhow!("{} is not set: submit this program as a job", regatta::ADDRESS_ENV))?;
    let steps = match std::env::args().skip_while(|a| a != "--steps").nth(1) {
        Some(n) => n
            .parse()
            .map_err(|_| anyhow::anyhow!("--steps wants a number, not {n:?}"))?,
        None => 200,
    };
    let (token, _) = regatta::resolve_token(None, None, false)?;
    let client = Client::connect(&address, &token).await?;
    println!("pipeline job {:?} on {address}", client.job());
    let options = PipelineOptions {
        dir: std::env::temp_dir().join(format!("regatta-pipeline-job-{}", std::process::id())),
        steps,
        world_size: 2,
        actors: 2,
    };
    let report = train_then_score(client.cluster(), &options, |line| println!("{line}")).await?;
    println!(
        "loss {:.3} -> {:.3}; mean perplexity {:.2} before, {:.2} after, over {} rows; checkpoints in {}",
        report.loss.0,
        report.loss.1,
        report.perplexity.0,
        report.perplexity.1,
        report.rows,
        report.checkpoints.display()
    );
    Ok(())
}
