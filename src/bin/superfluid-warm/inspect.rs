//! `ask`, `stats` and `check`: the commands, besides `dump`, that read a file and change nothing.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use crate::emit;
use crate::exporter::render_stats;
use crate::format::{thousands, tier_name};
use crate::listen_status::{head_status, listen_status};
use crate::{CliError, UNHEALTHY};
use serde_json::json;
use superfluid_warm::{FileCheck, Hit, IndexFile, Medium, Namespace, ReadIndex, Reader, Snapshot};

pub(crate) fn ask(
    out: &mut impl Write,
    path: &Path,
    (model, tenant): (&str, Option<&str>),
    (prompts, attention_chunk): (&Path, Option<usize>),
    json: bool,
) -> Result<ExitCode, CliError> {
    let namespace = Namespace::of(model, tenant.map(str::as_bytes))?;
    let text = std::fs::read_to_string(prompts)
        .map_err(|e| CliError::Refused(format!("cannot read the prompts {}: {e}", prompts.display())))?;
    let reader = Reader::open(path)?;
    if let Some(tokens) = attention_chunk {
        reader.set_attention_chunk(tokens);
    }
    let mut nowhere = false;
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let tokens: Vec<u32> = serde_json::from_str(line).map_err(|e| {
            CliError::Refused(format!(
                "{} line {}: not a JSON array of token ids (0 to 2^32-1): {e}",
                prompts.display(),
                i + 1
            ))
        })?;
        let hits = reader.warm_nodes_prefix(&reader.prefix(&namespace, &tokens))?;
        nowhere |= hits.is_empty();
        let line = match json {
            true => json!({
                "line": i + 1, "tokens": tokens.len(),
                "warm_nodes": hits.iter().map(|h| json!({
                    "node": h.node, "tokens": h.tokens, "tier": tier_name(h.tier), "gpu_tokens": h.gpu_tokens,
                })).collect::<Vec<_>>(),
            })
            .to_string(),
            false if hits.is_empty() => format!("{}: {} tokens, warm nowhere", i + 1, tokens.len()),
            false => format!(
                "{}: {} tokens, warm on {}",
                i + 1,
                tokens.len(),
                hits.iter().map(hit_text).collect::<Vec<_>>().join(", ")
            ),
        };
        writeln!(out, "{line}").map_err(CliError::Output)?;
    }
    // A typo in the model name answers "warm nowhere" for every prompt: say so.
    if nowhere {
        let models = Snapshot::open(path)?.models()?;
        if !models.contains(model) {
            let known: Vec<&str> = models.iter().map(String::as_str).collect();
            eprintln!(
                "superfluid-warm: {} holds no block of model `{model}`; its models: {}",
                path.display(),
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A warm node as `ask` prints it: its tokens, and where they are when not all in GPU memory.
fn hit_text(h: &Hit) -> String {
    match h.tier {
        Medium::Gpu => format!("{} ({} tokens)", h.node, h.tokens),
        tier => format!(
            "{} ({} tokens, {} in GPU memory, the rest up to {})",
            h.node,
            h.tokens,
            h.gpu_tokens,
            tier_name(tier)
        ),
    }
}

/// `stats --prometheus`: the file's figures in Prometheus' text format.
pub(crate) fn stats_prometheus(out: &mut impl Write, path: &Path) -> Result<ExitCode, CliError> {
    let text = render_stats(&Snapshot::open(path)?.stats()?).map_err(CliError::Refused)?;
    write!(out, "{text}").map_err(CliError::Output)?;
    Ok(ExitCode::SUCCESS)
}

/// `check`: checks the file and reports what it found (after `check --repair`'s recovery).
pub(crate) fn check(out: &mut impl Write, path: &Path, json: bool) -> Result<ExitCode, CliError> {
    report_check(out, json, &IndexFile::new(path).check()?)
}

pub(crate) fn stats(out: &mut impl Write, path: &Path, json: bool) -> Result<ExitCode, CliError> {
    let snapshot = Snapshot::open(path).inspect_err(|_| {
        // A file its listener could not close (its disk failed): why it stopped, beside why
        // the file cannot be read.
        if let (_, _, Some(error)) = listen_status(path) {
            eprintln!("superfluid-warm: the listener of {} stopped on its own: {error}", path.display());
        }
    })?;
    let s = snapshot.stats()?;
    let side_file_missing = snapshot.side_file_missing();
    // The listener's live figures (connections, replays, lag), from its status file.
    let (listener_down, listening, listener_error, routes) = head_status(path);
    let live = |node: &str| listening.iter().find(|l| l.node == node).map(|l| json!(l));
    if json {
        let per_node: serde_json::Map<String, serde_json::Value> =
            s.per_node.iter().map(|(n, c)| (n.clone(), json!(c))).collect();
        let line = json!({
            "entries": s.entries, "legacy_entries": s.legacy_entries, "per_node": per_node,
            "clock_min": s.clock_range.map(|r| r.0), "clock_max": s.clock_range.map(|r| r.1),
            "clock_high_water": s.clock, "capacity": s.capacity, "file_bytes": s.file_bytes,
            "schema": s.schema, "hash_scheme": s.hash_scheme, "writer_pid": s.writer,
            "side_file_missing": side_file_missing,
            "others": s.others, "reclaimable": s.reclaimable, "forgotten_nodes": s.forgotten_nodes,
            "stream_position": s.stream_position, "node_cache_default": s.node_cache_default,
            "node_caches": s.node_caches.iter().map(|c| json!({
                "node": c.node, "held": c.held, "capacity": c.capacity, "floor": c.floor,
            })).collect::<Vec<_>>(),
            "engines": s.engines.iter().map(|e| json!({
                "node": e.node, "last_seq": e.last_seq, "last_ts": e.last_ts,
                "engine_blocks": e.engine_blocks, "blocks": e.blocks, "counts": e.counts,
                "engine_blocks_by_tier": {"GPU": e.by_tier[0], "CPU": e.by_tier[1], "STORAGE": e.by_tier[2]},
                "groups": e.groups.iter().map(|g| json!({
                    "index": g.index, "kind": g.kind.name(), "window": g.kind.window(),
                })).collect::<Vec<_>>(),
                "unplaced_blocks": e.unplaced_blocks, "group_changes": e.group_changes,
                "listener": live(&e.node),
            })).collect::<Vec<_>>(),
            "listener_running": listener_down.is_none() && !listening.is_empty(),
            "listener_down": listener_down,
            "listener_error": listener_error,
            "routes": routes,
        });
        return emit(out, &line.to_string());
    }
    let used = if s.capacity == 0 { 0.0 } else { 100.0 * s.entries as f64 / s.capacity as f64 };
    // 0.1.7's rule evicts an eighth of the capacity when a `ran` goes over it, after the `ran`:
    // one prompt longer than that leaves the index over capacity until the next.
    let over = if s.entries > s.capacity {
        " (over: 0.1.7's rule evicts an eighth of the capacity once per `ran`, so a `ran` longer than that overshoots until the next)"
    } else {
        ""
    };
    let mut text = format!(
        "entries        {} ({} from 0.1.7)\ncapacity       {} ({used:.1}% used){over}\n",
        thousands(s.entries),
        thousands(s.legacy_entries),
        thousands(s.capacity)
    );
    text += &match s.clock_range {
        Some((lo, hi)) => format!("clock          {lo} .. {hi} (high-water {})\n", s.clock),
        None => format!("clock          empty (high-water {})\n", s.clock),
    };
    text += &format!(
        "other nodes    {} (nodes a block names besides the last to run it)\nreclaimable    {} (blocks and other nodes naming one of {} forgotten node incarnations)\n",
        thousands(s.others),
        thousands(s.reclaimable),
        s.forgotten_nodes
    );
    text +=
        &format!("file           {} bytes\nschema         {} ({})\n", thousands(s.file_bytes), s.schema, s.hash_scheme);
    if s.stream_position > 0 {
        text += &format!("shared         applied a NATS stream up to sequence {}\n", s.stream_position);
    }
    text += &match (s.writer, side_file_missing) {
        (Some(pid), true) => format!(
            "writer         pid {pid}, running, but its side file {} was deleted: restart that head to recreate it\n",
            IndexFile::new(path).seal_path().display()
        ),
        (Some(pid), false) => format!("writer         pid {pid}\n"),
        (None, _) => "writer         none (closed cleanly)\n".into(),
    };
    if let Some(error) = &listener_error {
        text += &format!("listener       stopped on its own: {error}\n");
    }
    if let Some(blocks) = s.node_cache_default {
        text += &format!("node caches    {} blocks a node unless set per node\n", thousands(blocks));
    }
    text += "per node:";
    for (node, n) in &s.per_node {
        text += &format!("\n  {node:<20} {:>12}", thousands(*n));
    }
    let sized: Vec<_> = s.node_caches.iter().filter(|c| c.capacity.is_some()).collect();
    if !sized.is_empty() {
        text += "\nnode caches (blocks held / capacity):";
        for c in sized {
            let capacity = c.capacity.map_or_else(|| "none".to_string(), thousands);
            text += &format!("\n  {:<20} {} / {capacity}", c.node, thousands(c.held));
        }
    }
    if !s.engines.is_empty() {
        text += "\nengine streams (what each engine says it holds):";
        if let Some(why) = &listener_down {
            text += &format!("\n  (listener {why}: connections and lag as it last saw them)");
        } else if listening.is_empty() {
            text += "\n  (no listener status beside this file: connections and lag unknown)";
        }
        for e in &s.engines {
            let c = &e.counts;
            let seq = e.last_seq.map_or_else(|| "none".to_string(), |q| q.to_string());
            text += &format!(
                "\n  {:<20} last seq {seq}, {} engine blocks ({} on the GPU, {} only in CPU memory, {} only on storage; {} of 64 tokens); {} batches, {} stored, {} removed, {} clears, {} restarts, {} gaps ({} lost), {} duplicate batches, {} duplicate blocks, {} unknown parents, {} unknown removals, {} other medium, {} unkeyed, {} malformed",
                e.node,
                thousands(e.engine_blocks as u64),
                thousands(e.by_tier[0] as u64),
                thousands(e.by_tier[1] as u64),
                thousands(e.by_tier[2] as u64),
                thousands(e.blocks as u64),
                c.batches,
                c.stored,
                c.removed,
                c.clears,
                c.restarts,
                c.gaps,
                c.lost,
                c.duplicate_batches,
                c.duplicate_blocks,
                c.unknown_parents,
                c.unknown_removals,
                c.other_medium,
                c.unkeyed,
                c.malformed
            );
            if !e.groups.is_empty() {
                // A hybrid engine: its KV cache groups, `index:kind[:window]`.
                let groups: Vec<String> = e
                    .groups
                    .iter()
                    .map(|g| match g.kind.window() {
                        Some(w) => format!("{}:{}:{w}", g.index, g.kind.name()),
                        None => format!("{}:{}", g.index, g.kind.name()),
                    })
                    .collect();
                text += &format!(
                    "\n  {:<20} KV cache groups {}; {} blocks not placed, {} group changes",
                    "",
                    groups.join(" "),
                    e.unplaced_blocks,
                    e.group_changes
                );
            }
            if let Some(l) = listening.iter().find(|l| l.node == e.node) {
                let lag = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"));
                let connected = if l.connected { "connected" } else { "not connected" };
                text += &format!(
                    "\n  {:<20} {connected}; {} replays ({} short); lag {} p50, {} p99; {}",
                    "",
                    l.replays,
                    l.replays_short,
                    lag(l.lag_p50_ms),
                    lag(l.lag_p99_ms),
                    l.silent_for_s.map_or_else(
                        || "no batch yet".to_string(),
                        |t| format!("last batch {t:.1} s before its status")
                    ),
                );
            }
        }
    }
    if !routes.is_empty() {
        text += "\nrouted (serve), per engine: predicted warm tokens against the cached tokens it delivered";
        if let Some(why) = &listener_down {
            text += &format!("\n  (head {why}: as it last counted)");
        }
        for r in &routes {
            let share = |n: u64| if r.answered == 0 { 0.0 } else { n as f64 / r.answered as f64 };
            text += &format!(
                "\n  {:<20} {} requests ({} not rendered), {} failures, {} ejections; {} answers told cached tokens: predicted {} / delivered {} tokens a request, {} off by more than 64 ({} above)",
                r.engine,
                r.requests,
                r.unrendered,
                r.failures,
                r.ejections,
                r.answered,
                share(r.predicted_tokens).round(),
                share(r.delivered_tokens).round(),
                r.mispredicted,
                r.over_predicted
            );
        }
    }
    emit(out, &text)
}

/// Prints what `check` found, and exits 0 when healthy, [`UNHEALTHY`] otherwise.
fn report_check(out: &mut impl Write, json: bool, found: &FileCheck) -> Result<ExitCode, CliError> {
    let problems = found.problems();
    let healthy = problems.is_empty();
    let report = found.invariants.as_ref();
    if json {
        let line = json!({
            "healthy": healthy, "entries": report.map(|r| r.entries),
            "clock_entries": report.map(|r| r.clock_entries),
            "problems": problems,
            "invariant_problems": report.map(|r| &r.problems[..]),
            "integrity": found.integrity,
            "crashed_writer": found.crashed_writer.is_some(), "crashed_writer_pid": found.crashed_writer.flatten(),
            "side_file_missing": found.side_file_missing,
        });
        emit(out, &line.to_string())?;
    } else {
        let mut text = match report {
            Some(r) => format!(
                "{} entries, {} listed live in their generation\n",
                thousands(r.entries),
                thousands(r.clock_entries)
            ),
            None => "tables not walked: the file fails redb's page checksums\n".to_string(),
        };
        text += match found.integrity {
            Some(true) => "redb integrity: ok\n",
            Some(false) => "redb integrity: CORRUPTED\n",
            None => "redb integrity: not checked (a head has the file open)\n",
        };
        if found.crashed_writer.is_some() {
            text += "checked as recovered, on a copy: the file itself was not changed\n";
        }
        for p in &problems {
            text += &format!("problem: {p}\n");
        }
        text += if healthy { "verdict: healthy" } else { "verdict: PROBLEMS FOUND" };
        emit(out, &text)?;
    }
    Ok(if healthy { ExitCode::SUCCESS } else { ExitCode::from(UNHEALTHY) })
}
