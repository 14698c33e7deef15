//! The `superfluid-warm` command: inspect an index, import a 0.1.7 file, follow engines.
//!
//! The command line: the only code that knows clap and how output is formatted. This file holds
//! the options (`Cli`, `Command`), the dispatch, and how errors map to messages and exit codes;
//! each command, or family of commands, has a module of its own.
#![deny(unsafe_code)]

mod dump;
mod exporter;
mod format;
mod inspect;
mod listen;
mod listen_status;
mod malloc;
mod serve;
mod write;

use std::path::PathBuf;
use std::process::ExitCode;

use crate::dump::DumpArgs;
use crate::exporter::{LogFormat, init_logs};
use crate::listen::ListenArgs;
use clap::{Parser, Subcommand};
use superfluid_warm::Error;

/// What every command does with a file a crashed head left, said once.
const CRASH_RULE: &str = "A file left open by a head that crashed: `dump` and `stats` refuse it and `check` reports \
it, until it is recovered; the commands that write (`check --repair`, `compact`, `forget`, `import`, `listen`) \
recover it to its last commit and say so.";

#[derive(Parser)]
#[command(
    name = "superfluid-warm",
    version,
    about = "Which node last ran each prompt prefix: inspect, import, follow engines",
    after_help = CRASH_RULE
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines are written to stderr: `plain`, or `json` (one object a line). Which
    /// events: `RUST_LOG` (e.g. `superfluid_warm=debug`); without it, warnings and errors, and
    /// for `listen` also what an operator should hear of (connections, replays, restarts).
    #[arg(long, global = true, value_enum, default_value = "plain")]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Every entry, newest first; reads the file live while a head writes it.
    Dump(DumpArgs),
    /// Entries, per-node counts, clock range, capacity used, file size, schema.
    Stats {
        /// The index file.
        path: PathBuf,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
        /// In Prometheus' text format, under the names `listen --metrics` serves, for a
        /// textfile collector (write it to a temporary file and rename it into the
        /// collector's directory, so that it is never read half written).
        #[arg(long, conflicts_with = "json")]
        prometheus: bool,
    },
    /// Checks the invariants and, where no head has the file open, redb's integrity (on a copy).
    /// Exit code 0: healthy; 1: the file could not be checked (no index there, not an index,
    /// unreadable, or a head is creating it: retry); 2: a problem was found (each is listed), a file a crashed head left included.
    Check {
        /// The index file.
        path: PathBuf,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
        /// Recover a file left by a crashed head first (opens it as a head, which repairs it to
        /// its last commit).
        #[arg(long)]
        repair: bool,
    },
    /// Gives a closed index's free pages back to the filesystem (entries unchanged).
    Compact {
        /// The index file (no head may have it open).
        path: PathBuf,
    },
    /// Imports a superfluid 0.1.7 warm.json into an index (the JSON file is only read, and is
    /// checked whole before the index is touched).
    Import {
        /// The 0.1.7 file.
        old: PathBuf,
        /// The index file (created if absent; a failed import into a new file leaves none).
        path: PathBuf,
    },
    /// Forgets a node that restarted or left (its KV cache is gone): no answer names it for
    /// anything it ran before. Durable when it returns; the file must be closed (no head).
    Forget {
        /// The index file.
        path: PathBuf,
        /// The node's name.
        node: String,
    },
    /// Answers `warm_nodes` for each prompt of a file (one JSON array of token ids a line), from
    /// the index's last commit, whether or not a head has it open.
    Ask {
        /// The index file.
        path: PathBuf,
        /// The model the prompts are for.
        #[arg(long)]
        model: String,
        /// The tenant (cache salt) the prompts are for, if any.
        #[arg(long)]
        tenant: Option<String>,
        /// The prompts: one JSON array of token ids a line.
        #[arg(long)]
        prompts: PathBuf,
        /// One JSON object a line.
        #[arg(long)]
        json: bool,
        /// The served model's attention chunk in tokens, for engines with chunked local
        /// attention layers (as `listen --attention-chunk`).
        #[arg(long)]
        attention_chunk: Option<usize>,
    },
    /// Keeps the index of what each engine holds from its KV cache events (vLLM's or SGLang's,
    /// over ZMQ), as a head that only listens, until SIGTERM or Ctrl-C (then closes the file
    /// cleanly). A status line a node goes to stderr every --status-every seconds.
    ///
    /// Exit code 0: stopped by SIGTERM, SIGINT or --duration (also while starting), the file
    /// closed cleanly. 1: it could not start (the file could not be opened, an engine endpoint
    /// refused), or it could not go on and stopped at once, for a supervisor to restart it: the
    /// file's writes failed for good (a full disk: an I/O error latches until the file is
    /// reopened), the NATS link halted (its stream was deleted) or had no stream within
    /// --nats-wait, or the file was deleted or replaced under it. The reason is on stderr and in
    /// the status file `PATH.listen.json` (`stats` shows it), and the file is closed cleanly
    /// where it still can be. 2: an option was refused.
    Listen(ListenArgs),
    /// An OpenAI-compatible head in front of the engines: renders each request's prompt into
    /// the engine's tokens, routes it to the engine that holds the most of it for the least
    /// queued work, and proxies it (streams as they come). Counts the warm tokens it predicted
    /// against the `cached_tokens` each engine reports (`stats` shows them). Until SIGTERM or
    /// Ctrl-C, which finish the requests in flight (up to --drain) and close the index cleanly.
    Serve(Box<serve::ServeArgs>),
}

/// What can stop a command: the index's errors, a refusal of the command's own, or the output
/// going away.
#[derive(Debug)]
enum CliError {
    Index(Error),
    Output(std::io::Error),
    /// The command refuses what it was asked (exit 2, like a usage error): the message says why
    /// and what to ask instead.
    Refused(String),
    /// Nothing went wrong, but the command found nothing of what it was asked about (exit 1).
    NotFound(String),
    /// `listen` stopped on its own: it could not go on (exit 1; the message says why).
    Stopped(String),
}

impl From<Error> for CliError {
    fn from(e: Error) -> Self {
        CliError::Index(e)
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Index(Error::AlreadyOpen { path }) => write!(
                f,
                "{} is open in a running head; stop it first, or read it live with `dump`, `stats` or `check`",
                path.display()
            ),
            CliError::Index(Error::CrashedWriter { pid }) => write!(
                f,
                "the file was left open by a head{} that crashed; recover it to its last commit with \
                 `superfluid-warm check --repair FILE`",
                pid.map(|p| format!(" (process {p})")).unwrap_or_default()
            ),
            CliError::Index(e) if e.needs_reopen() => write!(
                f,
                "the disk failed while writing the index ({}); what was committed before is intact: free space \
                 or fix the disk, then run the command again",
                storage_cause(e)
            ),
            CliError::Index(e) => write!(f, "{e}"),
            CliError::Output(e) => write!(f, "writing the output: {e}"),
            CliError::Refused(why) | CliError::NotFound(why) | CliError::Stopped(why) => write!(f, "{why}"),
        }
    }
}

/// Writes a command's output, a line.
fn emit(out: &mut impl std::io::Write, text: &str) -> Result<ExitCode, CliError> {
    writeln!(out, "{text}").map_err(CliError::Output)?;
    Ok(ExitCode::SUCCESS)
}

/// What the storage said underneath a failed write, without the library's advice to its callers.
fn storage_cause(e: &Error) -> String {
    match e {
        Error::Storage { source, .. } => source.to_string(),
        Error::CommitFailed { source } => storage_cause(source),
        e => e.to_string(),
    }
}

/// Exit code of `check` when it finds a problem, and of a refused command.
const UNHEALTHY: u8 = 2;

fn main() -> ExitCode {
    malloc::configure();
    let cli = Cli::parse();
    // `listen` runs for days: what an operator should hear of (its own info events, and every
    // library's warnings); the other commands print their output and only warnings besides.
    let level = if matches!(cli.command, Command::Listen(_) | Command::Serve(_)) {
        "warn,superfluid_warm=info"
    } else {
        "warn"
    };
    init_logs(cli.log_format, level);
    match run(cli.command) {
        Ok(code) => code,
        // A reader that went away (`dump | head`) ends the command quietly, as it asked.
        Err(CliError::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("superfluid-warm: {e}");
            match e {
                // A file a crashed head left is a problem found (as `check` reports it).
                CliError::Refused(_) | CliError::Index(Error::CrashedWriter { .. }) => ExitCode::from(UNHEALTHY),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn run(command: Command) -> Result<ExitCode, CliError> {
    let out = &mut std::io::stdout().lock();
    match command {
        Command::Dump(args) => dump::dump(out, &args),
        Command::Stats { path, json, prometheus: false } => inspect::stats(out, &path, json),
        Command::Stats { path, prometheus: true, .. } => inspect::stats_prometheus(out, &path),
        Command::Check { path, json, repair } => {
            if repair {
                write::repair(&path)?;
            }
            inspect::check(out, &path, json)
        }
        Command::Compact { path } => write::compact(out, &path),
        Command::Import { old, path } => write::import(out, &old, &path),
        Command::Forget { path, node } => write::forget(out, &path, &node),
        Command::Listen(args) => listen::listen(out, &args),
        Command::Serve(args) => serve::serve(out, &args),
        Command::Ask { path, model, tenant, prompts, json, attention_chunk } => {
            inspect::ask(out, &path, (&model, tenant.as_deref()), (&prompts, attention_chunk), json)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use std::sync::Arc;

    use super::*;

    /// A full disk is told in the command line's words: what to do, not the library's advice to
    /// reopen a handle.
    #[test]
    fn a_full_disk_is_told_in_the_command_lines_words() {
        let full = std::io::Error::new(std::io::ErrorKind::StorageFull, "No space left on device");
        let storage = Error::Storage { context: "committing", source: Arc::new(redb::Error::Io(full)) };
        assert!(storage.needs_reopen(), "the error this is about");
        for e in [storage.clone(), Error::CommitFailed { source: Box::new(storage) }] {
            let said = CliError::Index(e).to_string();
            assert!(said.contains("No space left on device"), "{said}");
            assert!(said.contains("free space") && said.contains("run the command again"), "{said}");
            assert!(!said.contains("reopen") && !said.contains("handle"), "{said}");
        }
    }
}
