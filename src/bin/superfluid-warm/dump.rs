//! `dump`: a file's entries, newest first, or the blocks each engine holds (`--engines`), written
//! out as they are read.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::CliError;
use crate::emit;
use crate::format::{hex, thousands};
use clap::Args;
use serde_json::json;
use superfluid_warm::{DumpEntry, Snapshot};

#[derive(Args)]
pub(crate) struct DumpArgs {
    /// The index file.
    path: PathBuf,
    /// One JSON object a line.
    #[arg(long)]
    json: bool,
    /// Only entries of this node.
    #[arg(long)]
    node: Option<String>,
    /// At most this many entries.
    #[arg(long)]
    limit: Option<usize>,
    /// Oldest first.
    #[arg(long)]
    oldest_first: bool,
    /// The blocks each engine holds, as its KV events said (engine hash, store clock, parent,
    /// copies in GPU memory, CPU memory and on storage), instead of the prefix table.
    #[arg(long, conflicts_with = "oldest_first")]
    engines: bool,
}

/// A node name as `dump` shows it.
fn shown_node(name: &str, forgotten: bool) -> String {
    if forgotten { format!("{name} (forgotten)") } else { name.to_string() }
}

pub(crate) fn dump(out: &mut impl Write, args: &DumpArgs) -> Result<ExitCode, CliError> {
    let DumpArgs { path, json, node, limit, oldest_first, engines } = args;
    let (json, oldest_first) = (*json, *oldest_first);
    let snapshot = Snapshot::open(path)?;
    if let Some(wanted) = node
        && !snapshot.nodes().any(|(n, _)| n == wanted)
    {
        let names: Vec<&str> = snapshot.nodes().map(|(n, _)| n).collect();
        return Err(CliError::NotFound(format!(
            "no node is named {wanted:?} in {}; its nodes: {}",
            path.display(),
            if names.is_empty() { "none".to_string() } else { names.join(", ") }
        )));
    }
    if *engines {
        return dump_engines(out, &snapshot, json, node.as_deref(), limit.unwrap_or(usize::MAX));
    }
    // Rows stream out as they are read; the table's node column is as wide as the widest name
    // the file holds.
    let node_w = snapshot.nodes().map(|(n, forgotten)| shown_node(n, forgotten).len()).max().unwrap_or(0).max(4);
    if !json {
        writeln!(out, "{:<32}  {:<node_w$}  {:>12}  {:>8}  model; other nodes", "hash", "node", "clock", "tokens")
            .map_err(CliError::Output)?;
    }
    let limit = limit.unwrap_or(usize::MAX);
    let mut rows = Rows::new(limit);
    if limit > 0 {
        snapshot.visit(!oldest_first, |e| {
            if node.as_ref().is_some_and(|n| *n != e.node) {
                return true;
            }
            rows.wrote(if json {
                writeln!(out, "{}", dump_json(&e))
            } else {
                writeln!(out, "{}", dump_row(&e, node_w))
            })
        })?;
    }
    let shown = rows.end()?;
    if json {
        return Ok(ExitCode::SUCCESS);
    }
    emit(out, &format!("{} {} shown", thousands(shown as u64), if shown == 1 { "entry" } else { "entries" }))
}

/// `dump --engines`: each engine block, node by node, as it is read.
fn dump_engines(
    out: &mut impl Write,
    snapshot: &Snapshot,
    json: bool,
    node: Option<&str>,
    limit: usize,
) -> Result<ExitCode, CliError> {
    if !json {
        writeln!(
            out,
            "{:<20}  {:<16}  {:>10}  {:<16}  {:>3}  {:>3}  {:>7}  {:>6}  {:<12}  model",
            "node", "engine hash", "stored at", "parent", "GPU", "CPU", "STORAGE", "tokens", "groups"
        )
        .map_err(CliError::Output)?;
    }
    let mut rows = Rows::new(limit);
    if limit > 0 {
        snapshot.visit_engine_blocks(|b| {
            if node.is_some_and(|n| n != b.node) {
                return true;
            }
            let written = if json {
                let line = json!({
                    "node": b.node, "engine_hash": format!("{:016x}", b.hash), "stored_at": b.stored_at,
                    "parent": b.parent.map(|p| format!("{p:016x}")),
                    "copies": {"GPU": b.copies[0], "CPU": b.copies[1], "STORAGE": b.copies[2]},
                    "tokens": b.tokens, "model": b.model,
                    "groups": b.groups.iter().map(|&(group, copies)| json!({"group": group, "copies": copies})).collect::<Vec<_>>(),
                });
                writeln!(out, "{line}")
            } else {
                let parent = b.parent.map_or_else(|| "-".to_string(), |p| format!("{p:016x}"));
                // Copies by group, `group:copies` (a hybrid engine's), else `-`.
                let groups = match b.groups.is_empty() {
                    true => "-".to_string(),
                    false => b.groups.iter().map(|(g, c)| format!("{g}:{c}")).collect::<Vec<_>>().join(","),
                };
                writeln!(
                    out,
                    "{:<20}  {:016x}  {:>10}  {parent:<16}  {:>3}  {:>3}  {:>7}  {:>6}  {groups:<12}  {}",
                    b.node,
                    b.hash,
                    b.stored_at,
                    b.copies[0],
                    b.copies[1],
                    b.copies[2],
                    b.tokens,
                    b.model.as_deref().unwrap_or("")
                )
            };
            rows.wrote(written)
        })?;
    }
    rows.end()?;
    Ok(ExitCode::SUCCESS)
}

/// The rows a dump writes as it reads them: up to a limit, stopping at the first failed write.
struct Rows {
    shown: usize,
    limit: usize,
    failed: Option<std::io::Error>,
}

impl Rows {
    fn new(limit: usize) -> Rows {
        Rows { shown: 0, limit, failed: None }
    }

    /// Counts a row written; whether to go on.
    fn wrote(&mut self, written: std::io::Result<()>) -> bool {
        match written {
            Ok(()) => {
                self.shown += 1;
                self.shown < self.limit
            }
            Err(err) => {
                self.failed = Some(err);
                false
            }
        }
    }

    /// The rows written, or the write that failed.
    fn end(self) -> Result<usize, CliError> {
        match self.failed {
            Some(err) => Err(CliError::Output(err)),
            None => Ok(self.shown),
        }
    }
}

fn dump_json(e: &DumpEntry) -> serde_json::Value {
    json!({
        "hash": hex(&e.key), "node": e.node, "clock": e.clock, "tokens": e.tokens,
        "model": e.model, "tenant": e.tenant, "legacy": e.tokens.is_none(), "forgotten": e.forgotten,
        "others": e.others.iter().map(|(n, c, f)| json!({"node": n, "clock": c, "forgotten": f})).collect::<Vec<_>>(),
    })
}

fn dump_row(e: &DumpEntry, node_w: usize) -> String {
    let tokens = e.tokens.map_or("0.1.7".to_string(), |t| t.to_string());
    let model = match (&e.model, e.tenant) {
        (Some(m), true) => format!("{m} (tenant)"),
        (Some(m), false) => m.clone(),
        (None, _) => "(0.1.7 import)".into(),
    };
    let others: Vec<String> = e.others.iter().map(|(n, c, f)| format!("{}@{c}", shown_node(n, *f))).collect();
    let others = if others.is_empty() { String::new() } else { format!("; {}", others.join(", ")) };
    let node = shown_node(&e.node, e.forgotten);
    format!("{:<32}  {node:<node_w$}  {:>12}  {:>8}  {model}{others}", hex(&e.key), e.clock, tokens)
}
