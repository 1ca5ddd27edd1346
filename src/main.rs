//! The `regatta` command: head, worker, status and the demo job.

fn main() -> std::process::ExitCode {
    regatta::cli::main_with(regatta::kinds::builtin())
}
