//! `regatta job ...`: the job API from the command line.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use futures::StreamExt;

use super::common::TokenArgs;
use regatta_runtime::{resolve_token, JobClient, JobRecord, JobStatus, JobSubmission, RuntimeEnv};

/// Exit status of `job submit` for a job that was stopped.
pub const STOPPED_EXIT: u8 = 3;

#[derive(Args, Debug, Clone)]
pub(crate) struct ApiArgs {
    /// The head's job API, https://HOST:8265 (http:// for a head started with --insecure).
    #[arg(long, env = "REGATTA_JOB_ADDRESS", default_value = regatta_runtime::DEFAULT_JOB_ADDRESS)]
    address: String,
    /// Trust the certificate authorities in this PEM file (for a head started with
    /// --tls-cert) instead of the cluster's own authority.
    #[arg(long, env = "REGATTA_CA_CERT")]
    ca_cert: Option<std::path::PathBuf>,
    #[command(flatten)]
    token: TokenArgs,
}

impl ApiArgs {
    pub(crate) fn client(&self) -> anyhow::Result<JobClient> {
        let (token, _) = resolve_token(self.token.token.as_deref(), self.token.token_file.as_deref(), false)?;
        let ca = match &self.ca_cert {
            Some(path) => {
                Some(std::fs::read(path).with_context(|| format!("cannot read --ca-cert {}", path.display()))?)
            }
            None => None,
        };
        Ok(JobClient::with_ca(&self.address, &token, ca.as_deref())?)
    }
}

/// Job commands.
#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// Submit a job: `regatta job submit -- CMD ARGS...`; follows its logs until it ends and
    /// exits with 0 if it succeeded, the driver's exit code if it failed, 3 if stopped.
    Submit(SubmitArgs),
    /// Print a job's status.
    Status(IdArgs),
    /// Print a job's logs.
    Logs(LogsArgs),
    /// Stop a job (its driver's process group, actors and objects).
    Stop(IdArgs),
    /// List jobs.
    List(ListArgs),
    /// Delete a finished job's record and logs.
    Delete(IdArgs),
}

/// `job submit` options.
#[derive(Args, Debug)]
pub struct SubmitArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// Return after submitting instead of following the logs.
    #[arg(long)]
    no_wait: bool,
    /// The job's id (default: generated).
    #[arg(long)]
    submission_id: Option<String>,
    /// Directory the driver starts in, on the head.
    #[arg(long)]
    working_dir: Option<String>,
    /// Environment variable for the driver, KEY=VALUE (repeatable).
    #[arg(long = "env", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Metadata label, KEY=VALUE (repeatable).
    #[arg(long = "metadata", value_parser = key_value)]
    metadata: Vec<(String, String)>,
    /// CPUs to reserve for the driver.
    #[arg(long)]
    entrypoint_num_cpus: Option<f64>,
    /// The driver's command line.
    #[arg(last = true, required = true)]
    entrypoint: Vec<String>,
}

/// A job id.
#[derive(Args, Debug)]
pub struct IdArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// The job's id.
    id: String,
}

/// `job logs` options.
#[derive(Args, Debug)]
pub struct LogsArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// The job's id.
    id: String,
    /// Keep printing until the job ends.
    #[arg(long, short)]
    follow: bool,
}

/// `job list` options.
#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// Only jobs in this state: pending, running, succeeded, failed or stopped.
    #[arg(long)]
    state: Option<String>,
    /// The newest this many jobs (0: all).
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// The newest `limit` jobs in `state` (any when `None`), and how many matched in all.
fn select_jobs(
    mut jobs: Vec<regatta_runtime::JobRecord>,
    state: Option<&str>,
    limit: usize,
) -> anyhow::Result<(Vec<regatta_runtime::JobRecord>, usize)> {
    const STATES: [&str; 5] = ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"];
    if let Some(state) = state {
        let wanted = state.to_ascii_uppercase();
        if !STATES.contains(&wanted.as_str()) {
            anyhow::bail!(
                "unknown job state '{state}'; use one of {}",
                STATES.map(|s| s.to_ascii_lowercase()).join(", ")
            );
        }
        jobs.retain(|job| job.status.to_string() == wanted);
    }
    jobs.sort_by_key(|job| std::cmp::Reverse((job.submitted_at, job.submission_id.clone())));
    let matched = jobs.len();
    if limit > 0 {
        jobs.truncate(limit);
    }
    Ok((jobs, matched))
}

fn key_value(text: &str) -> Result<(String, String), super::ArgError> {
    text.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| super::ArgError::NotKeyValue(text.to_string()))
}

/// Joins arguments into one shell command line, quoting where needed.
pub fn shell_join(args: &[String]) -> String {
    args.iter()
        .map(|arg| {
            let plain = !arg.is_empty()
                && arg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
            if plain {
                arg.clone()
            } else {
                format!("'{}'", arg.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The exit status `job submit` reports for a finished job.
pub fn exit_code(record: &JobRecord) -> u8 {
    match record.status {
        JobStatus::Succeeded => 0,
        JobStatus::Stopped => STOPPED_EXIT,
        _ => record
            .driver_exit_code
            .and_then(|c| u8::try_from(c).ok())
            .filter(|c| *c != 0)
            .unwrap_or(1),
    }
}

pub(crate) async fn run(command: JobCommand) -> anyhow::Result<ExitCode> {
    match command {
        JobCommand::Submit(args) => submit(args).await,
        JobCommand::Status(args) => {
            let record = args.api.client()?.status(&args.id).await?;
            println!("{}", serde_json::to_string_pretty(&record)?);
            Ok(ExitCode::SUCCESS)
        }
        JobCommand::Logs(args) => {
            let client = args.api.client()?;
            if args.follow {
                follow(&client, &args.id).await?;
            } else {
                print!("{}", client.logs(&args.id).await?);
            }
            Ok(ExitCode::SUCCESS)
        }
        JobCommand::Stop(args) => {
            let stopped = args.api.client()?.stop(&args.id).await?;
            println!(
                "{}",
                if stopped {
                    format!("job {} stopped", args.id)
                } else {
                    format!("job {} had already ended", args.id)
                }
            );
            Ok(ExitCode::SUCCESS)
        }
        JobCommand::List(args) => {
            let all = args.api.client()?.list().await?;
            let (jobs, matched) = select_jobs(all, args.state.as_deref(), args.limit)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&jobs)?);
            } else {
                if jobs.len() < matched {
                    println!("# the newest {} of {matched} jobs (--limit 0 for all)", jobs.len());
                }
                for job in jobs {
                    println!(
                        "{:<24} {:<10} {}",
                        job.submission_id,
                        job.status.to_string(),
                        job.entrypoint
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        JobCommand::Delete(args) => {
            args.api.client()?.delete(&args.id).await?;
            println!("job {} deleted", args.id);
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn submit(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let client = args.api.client()?;
    let submission = JobSubmission {
        entrypoint: shell_join(&args.entrypoint),
        submission_id: args.submission_id,
        runtime_env: RuntimeEnv {
            env_vars: args.env.into_iter().collect(),
            working_dir: args.working_dir,
            ..Default::default()
        },
        metadata: args.metadata.into_iter().collect::<BTreeMap<_, _>>(),
        entrypoint_num_cpus: args.entrypoint_num_cpus,
        ..Default::default()
    };
    let id = client.submit(&submission).await.context("job submission failed")?;
    if args.no_wait {
        println!("{id}");
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("job {id} submitted; following its logs (Ctrl-C stops following, not the job)");
    follow(&client, &id).await?;
    let record = client.wait(&id, Duration::from_millis(100)).await?;
    eprintln!("job {id} {}: {}", record.status, record.message);
    Ok(ExitCode::from(exit_code(&record)))
}

async fn follow(client: &JobClient, id: &str) -> anyhow::Result<()> {
    let mut stream = Box::pin(client.follow_logs(id).await?);
    let mut out = std::io::stdout();
    while let Some(chunk) = stream.next().await {
        out.write_all(&chunk?)?;
        out.flush()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_for_the_shell() {
        let args: Vec<String> = ["echo", "hello world", "it's", "a=b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(shell_join(&args), "echo 'hello world' 'it'\\''s' a=b");
    }

    #[test]
    fn exit_codes_reflect_the_job() {
        let mut record = JobRecord::new(
            "j".into(),
            &JobSubmission {
                entrypoint: "x".into(),
                ..Default::default()
            },
            0,
        );
        record.started(1, "127.0.0.1", 1);
        let mut failed = record.clone();
        failed.exited(Some(7), false, 2);
        assert_eq!(exit_code(&failed), 7);
        let mut ok = record.clone();
        ok.exited(Some(0), false, 2);
        assert_eq!(exit_code(&ok), 0);
        let mut stopped = record;
        stopped.exited(None, true, 2);
        assert_eq!(exit_code(&stopped), STOPPED_EXIT);
    }
}
