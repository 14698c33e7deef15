//! The `superfluid-warm` command: inspect an index, import a 0.1.7 file, replay a workload.
#![forbid(unsafe_code)]

mod cli;
mod exporter;

fn main() -> std::process::ExitCode {
    cli::main()
}
