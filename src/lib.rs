//! Regatta: the cluster runtime ML teams pick over Ray.
//!
//! This facade crate re-exports the runtime ([`regatta_runtime`]) and adds what the
//! `regatta` binary is made of: the built-in actor kinds ([`kinds`]), a local cluster of
//! head and worker processes ([`local::LocalCluster`]) and the command line ([`cli`]).
//!
//! A team with its own actor kinds builds its own worker binary in three lines:
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     let registry = regatta::kinds::builtin(); // .register::<MyActor>()
//!     regatta::cli::main_with(registry)
//! }
//! ```

pub mod bench;
pub mod cli;
pub mod finetune;
pub mod kinds;
pub mod local;
pub mod pipeline;
mod signal;

pub use cli::{demo, score as score_cli, train as train_cli};

pub use regatta_runtime::*;
