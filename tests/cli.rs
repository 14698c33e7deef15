//! The binary on real files: live dump beside a writing process, crashed and corrupt files,
//! JSON output, and a replay that gives the same answer twice.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use superfluid_warm::ReadIndex;

use common::{bin, db_path, tempdir, torture_writer};

fn run(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Starts a writer process and waits until it has made `n` syncs durable.
fn writer(path: &Path, n: u64) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(torture_writer())
        .args(["--db", path.to_str().expect("utf-8 path"), "--capacity", "2048"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("writer starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let mut seen = 0;
    while seen < n {
        line.clear();
        assert!(lines.read_line(&mut line).expect("read") > 0, "writer ended early");
        seen += 1;
    }
    (child, lines)
}

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    text(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect()
}

#[test]
fn dump_reads_the_file_while_another_process_writes_it_then_reports_the_crash() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let (mut child, _lines) = writer(&path, 20);
    let mut counts = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until || counts.len() < 5 {
        let out = run(&["dump", p, "--json"]);
        assert!(out.status.success(), "dump while writing: {}", text(&out.stderr));
        let rows = json_lines(&out);
        assert!(!rows.is_empty());
        let clocks: Vec<u64> = rows.iter().map(|r| r["clock"].as_u64().expect("clock")).collect();
        assert!(clocks.windows(2).all(|w| w[0] >= w[1]), "newest first");
        assert!(rows.iter().all(|r| r["node"].as_str().is_some_and(|n| n.starts_with("node-"))));
        assert!(rows.iter().all(|r| r["model"] == "torture" && r["tokens"].as_u64().is_some_and(|t| t % 64 == 0)));
        counts.push(clocks[0]);
        let limited = run(&["dump", p, "--json", "--node", "node-1", "--limit", "3"]);
        let limited = json_lines(&limited);
        assert!(limited.len() <= 3 && limited.iter().all(|r| r["node"] == "node-1"));
    }
    assert!(counts.windows(2).any(|w| w[1] > w[0]), "the dumps followed the writer's commits: {counts:?}");
    let stats = run(&["stats", p, "--json"]);
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).expect("stats JSON");
    assert!(stats["entries"].as_u64().is_some_and(|e| e > 0 && e <= 2048), "{stats}");
    assert!(stats["writer_pid"].as_u64().is_some());

    child.kill().expect("SIGKILL the writer");
    child.wait().expect("reaped");
    let out = run(&["dump", p]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a crashed file is a problem found (as `check` exits), not an empty listing"
    );
    assert!(text(&out.stderr).contains("crashed"), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("panicked"));
    assert!(text(&out.stderr).contains("check --repair"), "says what to run: {}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("Builder"), "speaks the CLI's words: {}", text(&out.stderr));
    let check = run(&["check", p, "--json"]);
    let verdict: serde_json::Value = serde_json::from_slice(&check.stdout).expect("check JSON");
    assert_eq!(verdict["crashed_writer"], true, "{verdict}");
    assert_eq!(verdict["integrity"], true, "{verdict}");
    assert_eq!(check.status.code(), Some(2), "a crashed head's file needs recovery before it is read: {verdict}");
    assert_eq!(verdict["healthy"], false, "{verdict}");
    assert!(verdict["problems"][0].as_str().is_some_and(|p| p.contains("needs recovery")), "{verdict}");
    assert_eq!(
        verdict["invariant_problems"].as_array().map(Vec::len),
        Some(0),
        "a crash loses no consistency: the last commit is consistent: {verdict}"
    );
    let repaired = run(&["check", p, "--repair"]);
    assert!(repaired.status.success(), "{}{}", text(&repaired.stdout), text(&repaired.stderr));
    assert!(text(&repaired.stdout).contains("redb integrity: ok"));
    assert!(
        text(&repaired.stderr).contains("recovered"),
        "a writing command says it recovered: {}",
        text(&repaired.stderr)
    );
    let out = run(&["dump", p, "--limit", "5"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("5 entries shown"), "{}", text(&out.stdout));
}

#[test]
fn corrupt_and_foreign_files_get_a_clear_error_never_a_panic() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let (mut child, _lines) = writer(&path, 30);
    child.kill().expect("kill");
    child.wait().expect("reaped");
    assert!(run(&["check", p, "--repair"]).status.success());
    let healthy = run(&["check", p]);
    assert_eq!(healthy.status.code(), Some(0), "{}", text(&healthy.stdout));

    // Flip one byte inside the data pages (past redb's header region). The repair closed the file
    // cleanly, so it has a seal: each flipped copy gets that seal and the file's time too, so
    // only the seal's digest tells them apart.
    let mut bytes = std::fs::read(&path).expect("read");
    let seal = std::fs::read(superfluid_warm::IndexFile::new(&path).seal_path()).expect("the repaired file is sealed");
    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
    let len = bytes.len();
    let mut flipped_detected = 0;
    // Forty-eight places spread over the file: how much of it is live pages depends on how far the
    // writer got before the kill (often about a fifth), so a few fixed places can all land in free
    // pages (sixteen did in about one run in thirty).
    let places = 48;
    for (i, at) in (1..=places).map(|k| k * len / (places + 1)).enumerate() {
        let mut copy = bytes.clone();
        copy[at] ^= 0x10;
        let bad = dir.path().join(format!("bad-{i}.redb"));
        std::fs::write(&bad, &copy).expect("write");
        std::fs::File::options().write(true).open(&bad).and_then(|f| f.set_modified(modified)).expect("time");
        std::fs::write(superfluid_warm::IndexFile::new(&bad).seal_path(), &seal).expect("seal");
        let b = bad.to_str().expect("utf-8");
        let mut flagged = false;
        for args in [vec!["check", b], vec!["dump", b], vec!["stats", b, "--json"]] {
            let out = run(&args);
            assert_ne!(out.status.code(), Some(101), "{args:?} panicked: {}", text(&out.stderr));
            assert!(!text(&out.stderr).contains("panicked"), "{args:?}: {}", text(&out.stderr));
            if args[0] == "check" {
                flagged = out.status.code() == Some(2);
                flipped_detected += usize::from(flagged);
                if flagged {
                    let json = run(&["check", b, "--json"]);
                    let verdict: serde_json::Value = serde_json::from_slice(&json.stdout).expect("check JSON");
                    assert_eq!(verdict["healthy"], false, "{verdict}");
                    assert!(
                        verdict["problems"].as_array().is_some_and(|p| !p.is_empty()),
                        "each problem listed: {verdict}"
                    );
                }
            } else if flagged {
                assert!(!out.status.success(), "{args:?} showed a file check found corrupted");
            }
        }
    }
    println!("check flagged {flipped_detected} of {places} flipped files");
    // A byte in an unused page can flip harmlessly; most land in a tree page and must be caught.
    assert!(flipped_detected >= 1);

    let foreign = dir.path().join("foreign.redb");
    bytes.truncate(0);
    bytes.extend_from_slice(b"{\"prefixes\": []}");
    std::fs::write(&foreign, &bytes).expect("write");
    let out = run(&["dump", foreign.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("not an index"), "{}", text(&out.stderr));
    let missing = run(&["stats", dir.path().join("absent.redb").to_str().expect("utf-8")]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(!dir.path().join("absent.redb").exists(), "a read-only command never creates a file");
}

#[test]
fn import_from_the_command_line_then_dump_shows_the_old_entries() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let old = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json");
    let out = run(&["import", old, p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("imported "), "{}", text(&out.stdout));
    let again = run(&["import", old, p]);
    assert!(text(&again.stdout).contains("imported before"));
    let rows = json_lines(&run(&["dump", p, "--json"]));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(old).expect("fixture")).expect("json");
    assert_eq!(rows.len(), json["prefixes"].as_array().map_or(0, Vec::len));
    assert!(rows.iter().all(|r| r["legacy"] == true && r["tokens"].is_null()));
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").expect("write");
    let out = run(&["import", bad.to_str().expect("utf-8"), p]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot import"), "{}", text(&out.stderr));
    assert_eq!(json_lines(&run(&["dump", p, "--json"])).len(), rows.len(), "the file it had is kept whole");
    // Into a path that did not exist, a failed import leaves nothing behind.
    let fresh = dir.path().join("fresh.redb");
    let out = run(&["import", bad.to_str().expect("utf-8"), fresh.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!fresh.exists(), "no new file");
    assert!(!superfluid_warm::IndexFile::new(&fresh).seal_path().exists(), "no side file");
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("list").count(),
        3,
        "warm.redb, its seal and bad.json, nothing new"
    );
}

#[test]
fn replay_of_the_first_500_trace_requests_gives_the_same_warm_share_twice() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/mooncake-conversation.jsonl");
    let once = |_: u8| -> serde_json::Value {
        let out = run(&["replay", "--trace", trace, "--requests", "500", "--json", "--no-baseline"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("replay JSON")
    };
    let (a, b) = (once(1), once(2));
    assert_eq!(a["requests"], 500);
    assert!(a["warm_tokens"].as_u64().is_some_and(|w| w > 0), "{a}");
    assert_eq!(a["warm_tokens"], b["warm_tokens"]);
    assert_eq!(a["load"], b["load"]);
    if cfg!(target_os = "linux") {
        assert!(a["bytes_per_request"].as_f64().is_some_and(|b| b > 0.0), "{a}");
    }
    assert!(a["baseline_bytes_per_request"].is_null(), "no baseline, no 0.1.7 saves");
    assert!(a["paced_ratio"].is_null(), "no baseline, no ratio");
    assert!(a["back_to_back"]["ours_ms"].as_f64().is_some_and(|t| t > 0.0), "{a}");
    assert!(a["back_to_back"]["baseline_ms"].is_null(), "no baseline, no 0.1.7 pass");
    // With the 0.1.7 design beside it: paced, index time and the final sync against 0.1.7's
    // total; back to back, a fresh index alone, then 0.1.7 alone.
    let out = run(&["replay", "--trace", trace, "--requests", "200", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let both: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    let ms = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let want = (ms(&both["index"]["total_ms"]) + ms(&both["final_sync_ms"])) / ms(&both["baseline_0_1_7"]["total_ms"]);
    let got = ms(&both["paced_ratio"]);
    assert!(want > 0.0 && (got - want).abs() < 1e-6 * want, "paced_ratio {got}, by its definition {want}");
    let back = &both["back_to_back"];
    // The answers do not depend on commit timing: back to back, the same tokens routed warm and
    // the same entries left as paced.
    assert_eq!(back["warm_tokens"], both["warm_tokens"], "{back}");
    assert_eq!(back["entries"], both["entries"], "{back}");
    let ours = ms(&back["calls_ms"]) + ms(&back["final_sync_ms"]);
    assert!(ours > 0.0 && (ms(&back["ours_ms"]) - ours).abs() < 1e-6 * ours, "{back}");
    let want = ours / ms(&back["baseline_ms"]);
    assert!(want > 0.0 && (ms(&back["ratio"]) - want).abs() < 1e-6 * want, "{back}");
    for field in ["requests_per_s", "baseline_requests_per_s", "baseline_bytes_per_request"] {
        assert!(back[field].as_f64().is_some_and(|r| r > 0.0), "{field}: {back}");
    }
    if cfg!(target_os = "linux") {
        assert!(back["bytes_per_request"].as_f64().is_some_and(|b| b > 0.0), "{back}");
    }
    let out = run(&["replay", "--trace", trace, "--requests", "50", "--json", "--no-back-to-back"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let only: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    assert!(only.get("back_to_back").is_none(), "{only}");
    // Three head threads: every request routed once, the same prompt tokens, throughput beside
    // 0.1.7's behind one mutex.
    let out = run(&["replay", "--trace", trace, "--requests", "500", "--json", "--threads", "3"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let threaded: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    assert_eq!((threaded["requests"].as_u64(), threaded["threads"].as_u64()), (Some(500), Some(3)));
    assert!(threaded.get("back_to_back").is_none(), "threads replay once: {threaded}");
    assert_eq!(threaded["prompt_tokens"], a["prompt_tokens"]);
    let load: u64 = threaded["load"].as_array().map_or(0, |l| l.iter().filter_map(|v| v.as_u64()).sum());
    assert_eq!(Some(load), a["prompt_tokens"].as_u64(), "each request given to one node");
    assert!(threaded["warm_tokens"].as_u64().is_some_and(|w| w > 0), "{threaded}");
    for field in ["requests_per_s", "baseline_requests_per_s"] {
        assert!(threaded[field].as_f64().is_some_and(|r| r > 0.0), "{field}: {threaded}");
    }
    // Node caches, the index not told their size: with room for everything, all that was routed
    // warm is still cached; with little room, less is, and some requests went to a node that had
    // lost the prefix.
    let cached = |blocks: &str, more: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "replay",
            "--trace",
            trace,
            "--requests",
            "500",
            "--json",
            "--no-baseline",
            "--node-cache-blocks",
            blocks,
        ];
        args.extend_from_slice(more);
        let out = run(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("replay JSON")
    };
    let (roomy, tight) = (cached("1000000000", &["--no-index-cache"]), cached("256", &["--no-index-cache"]));
    assert_eq!(roomy["warm_share_cached"], roomy["warm_share"], "{roomy}");
    assert_eq!(roomy["warm_requests_not_cached"], 0);
    assert_eq!(tight["warm_share"], a["warm_share"], "the routing itself is unchanged");
    assert_eq!(tight["index_told_cache"], false);
    let (w, c) = (tight["warm_share"].as_f64().unwrap_or(0.0), tight["warm_share_cached"].as_f64().unwrap_or(1.0));
    assert!(c < w, "a cache of 256 blocks loses some of the warm prefixes: {tight}");
    assert!(tight["warm_requests_not_cached"].as_u64().is_some_and(|n| n > 0));
    assert!(a["warm_share_cached"].is_null(), "no caches, no figure");
    // Told the size, the index calls warm only what the chosen node still holds; its file
    // shows each node's cache, and passes `check`.
    let dir = tempdir();
    let told_db = db_path(&dir);
    let told = cached("256", &["--db", told_db.to_str().expect("utf-8")]);
    assert_eq!(told["index_told_cache"], true);
    assert_eq!(told["warm_share_cached"], told["warm_share"], "{told}");
    assert_eq!(told["warm_requests_not_cached"], 0, "{told}");
    assert!(told["warm_share"].as_f64().is_some_and(|s| s > 0.0), "{told}");
    let stats = run(&["stats", told_db.to_str().expect("utf-8"), "--json"]);
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).expect("stats JSON");
    assert_eq!(stats["node_cache_default"], 256);
    let caches = stats["node_caches"].as_array().cloned().unwrap_or_default();
    assert_eq!(caches.len(), 8, "{stats}");
    for cache in &caches {
        assert_eq!(cache["capacity"], 256, "{cache}");
        // A prompt longer than the cache leaves nothing of it (its first blocks went first).
        assert!(cache["held"].as_u64().is_some_and(|h| h <= 256), "{cache}");
        assert!(cache["floor"].as_u64().is_some_and(|f| f > 0), "every node's cache let blocks go: {cache}");
    }
    assert!(caches.iter().any(|c| c["held"].as_u64().is_some_and(|h| h > 0)), "{stats}");
    let shown = run(&["stats", told_db.to_str().expect("utf-8")]);
    assert!(text(&shown.stdout).contains("node caches (blocks held / capacity):"), "{}", text(&shown.stdout));
    assert!(run(&["check", told_db.to_str().expect("utf-8")]).status.success());
    let both = run(&["replay", "--requests", "10", "--threads", "2", "--node-cache-blocks", "64"]);
    assert_eq!(both.status.code(), Some(2), "node caches are simulated by one-thread replays only");
    assert!(text(&both.stderr).contains("--threads"), "{}", text(&both.stderr));
    let none = run(&["replay", "--requests", "10", "--nodes", "0"]);
    assert_eq!(none.status.code(), Some(2), "a usage error");
    assert!(text(&none.stderr).contains("--nodes"), "{}", text(&none.stderr));
    let default = run(&["replay", "--requests", "300"]);
    assert!(default.status.success(), "{}", text(&default.stderr));
    let mut needles =
        vec!["routed warm", "load per node", "index time/request", "ratio (ours/0.1.7)", "paced ", "back to back"];
    if cfg!(target_os = "linux") {
        needles.push("0.1.7 saving every");
    }
    for needle in needles {
        assert!(text(&default.stdout).contains(needle), "missing {needle:?}: {}", text(&default.stdout));
    }
}

/// `compact` shrinks a churned file and leaves its entries as they were; it refuses a file a
/// head has open, and a file that is not an index.
#[test]
fn compact_gives_space_back_and_keeps_every_entry() {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    {
        // Churned, and not compacted by its close.
        let warm = superfluid_warm::Warm::builder().capacity(4000).compact_on_close(false).open(&path).expect("open");
        for request in superfluid_warm::tools::trace::synthetic(600, 24, 7) {
            warm.ran("m", &request.tokens(), &format!("node-{}", request.timestamp % 5)).expect("ran");
        }
        warm.close().expect("close");
    }
    let dump = |p: &str| -> Vec<serde_json::Value> {
        let mut rows = json_lines(&run(&["dump", p, "--json"]));
        rows.sort_by_key(|r| r.to_string());
        rows
    };
    let before = dump(p);
    assert!(before.len() > 1000, "{} entries", before.len());
    let out = run(&["compact", p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    let sizes: Vec<u64> = said.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert_eq!(sizes.len(), 2, "{said}");
    assert!(sizes[1] < sizes[0], "the churned file shrank: {said}");
    assert_eq!(std::fs::metadata(&path).expect("file").len(), sizes[1]);
    assert!(dump(p) == before, "compaction changed the entries");
    assert!(run(&["check", p]).status.success());
    // Verified and closed cleanly by the compaction: sealed, so the next open is the fast one.
    let warm = superfluid_warm::Warm::open(&path).expect("open");
    assert_eq!(warm.stats().expect("stats").open_check, superfluid_warm::OpenCheck::Seal);
    warm.close().expect("close");

    let (mut child, _lines) = writer(&path, 3);
    let busy = run(&["compact", p]);
    assert!(!busy.status.success(), "a file a head has open is refused");
    assert!(text(&busy.stderr).contains("open"), "{}", text(&busy.stderr));
    child.kill().expect("kill");
    child.wait().expect("reaped");
    let text_file = dir.path().join("notes.redb");
    std::fs::write(&text_file, "not an index ".repeat(500)).expect("write");
    let foreign = run(&["compact", text_file.to_str().expect("utf-8")]);
    assert!(!foreign.status.success());
    assert_eq!(std::fs::read(&text_file).expect("read"), "not an index ".repeat(500).as_bytes(), "left as it is");
}

/// `forget` on a closed file: the node's prefixes are no longer answered, durably; a missing
/// file is an error and is not created.
#[test]
fn forget_drops_a_node_from_every_answer_and_never_creates_a_file() -> Result<(), superfluid_warm::Error> {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let prompt: Vec<u32> = (0..640).collect();
    {
        let warm = superfluid_warm::Warm::open(&path)?;
        warm.ran("m", &prompt[..320], "a")?;
        warm.ran("m", &prompt, "b")?;
        warm.close()?;
    }
    let out = run(&["forget", path.to_str().expect("utf-8 path"), "b"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("node b of"), "{}", String::from_utf8_lossy(&out.stdout));
    let warm = superfluid_warm::Warm::open(&path)?;
    let hit = warm.warmest("m", &prompt)?;
    assert_eq!(hit, Some(superfluid_warm::Hit::new("a", 320)), "b forgotten, a still warm");
    drop(warm);
    let missing = dir.path().join("missing.redb");
    let out = run(&["forget", missing.to_str().expect("utf-8 path"), "a"]);
    assert!(!out.status.success());
    assert!(!missing.exists(), "a typo must not create an index");
    Ok(())
}

/// `dump` lists every node of a block and marks a forgotten one; `stats` counts the other nodes
/// and what is reclaimable.
#[test]
fn dump_and_stats_show_every_node_of_a_block_and_what_forgetting_left() -> Result<(), superfluid_warm::Error> {
    let dir = common::tempdir();
    let path = common::db_path(&dir);
    let first: Vec<u32> = (0..320).collect();
    let mut moved = first.clone();
    moved.extend(5000..5128);
    {
        let warm = superfluid_warm::Warm::open(&path)?;
        warm.ran("m", &first, "a")?;
        warm.ran("m", &moved, "b")?;
        warm.forget_node("a")?;
        warm.close()?;
    }
    let p = path.to_str().expect("utf-8 path");
    let out = run(&["dump", p, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> =
        text(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a dump line")).collect();
    assert_eq!(rows.len(), 7, "7 blocks");
    let with_a: Vec<&serde_json::Value> =
        rows.iter().filter(|r| r["others"].as_array().is_some_and(|o| !o.is_empty())).collect();
    assert_eq!(with_a.len(), 5, "a ran the first 5 blocks before b");
    for r in &with_a {
        assert_eq!(r["node"], "b");
        assert_eq!(r["others"][0]["node"], "a");
        assert_eq!(r["others"][0]["forgotten"], true);
    }
    let out = run(&["dump", p]);
    assert!(text(&out.stdout).contains("a (forgotten)@"), "{}", text(&out.stdout));
    let out = run(&["stats", p, "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
    assert_eq!((stats["entries"].as_u64(), stats["others"].as_u64()), (Some(7), Some(5)));
    assert_eq!((stats["reclaimable"].as_u64(), stats["forgotten_nodes"].as_u64()), (Some(5), Some(1)));
    let out = run(&["check", p]);
    assert!(out.status.success(), "{}", text(&out.stdout));
    Ok(())
}

/// `replay --restart-every`: told of each restart, the index never routes warm to a node that
/// lost the prefix; not told, it does. `--no-forget` without restarts is a usage error.
#[test]
fn replay_with_restarts_counts_warm_tokens_sent_to_a_restarted_node() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/mooncake-conversation.jsonl");
    let once = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["replay", "--trace", trace, "--requests", "1500", "--json", "--no-baseline"];
        args.extend_from_slice(extra);
        let out = run(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("replay JSON")
    };
    let told = once(&["--restart-every", "100"]);
    let not_told = once(&["--restart-every", "100", "--no-forget"]);
    assert_eq!(told["restarts"], 14);
    assert_eq!(told["warm_tokens_to_restarted"], 0, "{told}");
    assert!(told.get("back_to_back").is_none(), "restarts are a paced replay's only: {told}");
    assert!(not_told["warm_tokens_to_restarted"].as_u64().is_some_and(|t| t > 0), "{not_told}");
    let one = once(&["--nodes-per-prefix", "1"]);
    assert!(one["restarts"].is_null() && one["warm_tokens_to_restarted"].is_null());
    let bad = run(&["replay", "--requests", "10", "--no-forget"]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
}

/// `replay --heads 3 --nats URL`: the heads sharing one view route more warm than three that
/// do not, every event reaches every head, and the lag is reported; `stats` and a live `dump`
/// read a sharing head's file as any other.
#[test]
fn replay_over_heads_sharing_through_nats_and_stats_of_a_sharing_heads_file() {
    let dir = tempdir();
    let server = common::nats::NatsServer::start(&dir.path().join("js"));
    let url = server.url();
    let out = run(&["replay", "--heads", "3", "--nats", &url, "--requests", "600", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r = &json_lines(&out)[0];
    let share = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert_eq!((r["heads"].as_u64(), r["events"].as_u64(), r["requests"].as_u64()), (Some(3), Some(600), Some(600)));
    assert!(share("warm_share") > share("warm_share_unshared") + 0.05, "{r}");
    assert!(share("lag_p50_ms") > 0.0 && share("lag_p50_ms") <= share("lag_p99_ms"), "{r}");
    assert_eq!(r["lag_samples"].as_u64(), Some(1200), "each event on the two other heads");
    let out = run(&["replay", "--heads", "2", "--nats", &url, "--requests", "300"]);
    assert!(text(&out.stdout).contains("with the heads sharing one view"), "{}", text(&out.stdout));
    assert!(!run(&["replay", "--heads", "2"]).status.success(), "--heads needs --nats");

    let path = dir.path().join("shared.redb");
    let mut builder = superfluid_warm::Warm::builder();
    builder.sync_window(Duration::from_millis(5));
    let head = superfluid_warm::SharedWarm::open(&builder, &path, superfluid_warm::Sharing::nats(&url, "cli", "a"))
        .expect("a sharing head");
    for i in 0..40u32 {
        let tokens: Vec<u32> = (0..64 * (2 + i % 5)).map(|t| t + 1_000 * i).collect();
        head.ran("m", &tokens, &format!("node-{}", i % 3)).expect("ran");
    }
    head.sync().expect("published");
    assert!(head.wait_applied(40, Duration::from_secs(30)));
    head.sync().expect("durable");
    let live = run(&["dump", path.to_str().expect("utf-8"), "--json"]);
    assert!(live.status.success(), "{}", text(&live.stderr));
    assert!(!json_lines(&live).is_empty(), "a live dump of a sharing head's file");
    head.close().expect("close");
    let stats = run(&["stats", path.to_str().expect("utf-8"), "--json"]);
    assert!(stats.status.success(), "{}", text(&stats.stderr));
    let s = &json_lines(&stats)[0];
    assert_eq!(s["stream_position"].as_u64(), Some(40), "{s}");
    assert!(text(&run(&["stats", path.to_str().expect("utf-8")]).stdout).contains("up to sequence 40"));
}

/// `replay --heads 3 --nats URL --engine-events`: heads sharing one view and heads alone, each
/// side over engines of its own that publish their KV events: each side claims about what its
/// engines held, every batch reaches every head once, and the lags and each side's resident
/// memory (its peak, the simulated engines' part, the rest per head) are reported.
#[test]
fn replay_over_heads_and_engines_sharing_through_nats() {
    let dir = tempdir();
    let server = common::nats::NatsServer::start(&dir.path().join("js"));
    let url = server.url();
    let args = ["replay", "--heads", "3", "--nats", &url, "--engine-events", "--engine-cache-blocks", "4096"];
    let out = run(&[&args[..], &["--requests", "300", "--json"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r = &json_lines(&out)[0];
    assert_eq!((r["heads"].as_u64(), r["requests"].as_u64()), (Some(3), Some(300)));
    for side in ["shared", "unshared"] {
        let s = &r[side];
        let share = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{k} in {s}"));
        assert!(share("claimed_share") > 0.0, "{side}: {s}");
        // A head may be a few batches behind its engines when it answers (more so on a busy
        // machine): what it claims then differs from what is held by what it has not applied.
        // Compared where it had applied every batch of the engine it chose, a claim another head
        // made may still outlive an eviction it has not applied yet: within a point.
        let settled = s["settled_requests"].as_u64().unwrap_or_else(|| panic!("settled_requests in {s}"));
        assert!(settled > 0, "{side}: no request found its head caught up: {s}");
        let (claimed, cached) = (share("settled_claimed_share"), share("settled_cached_share"));
        assert!((claimed - cached).abs() < 0.01, "{side}: claimed as held where caught up: {s}");
        assert!(claimed <= share("claimed_share") && cached <= share("cached_share"), "{side}: {s}");
        assert_eq!(s["batches_published"], s["batches_applied_per_head"], "{side}: every batch on every head once");
        assert!(share("engine_lag_p50_s") <= share("engine_lag_p99_s"), "{side}: {s}");
    }
    assert!(r["shared"]["stream_lag_p50_ms"].as_f64().is_some(), "{r}");
    assert!(r["unshared"]["stream_lag_p50_ms"].is_null(), "{r}");
    // Memory, where /proc tells it: a side's peak holds what came before the heads, its
    // engines, and its heads; each head within what a head following 8 engines may hold.
    if std::path::Path::new("/proc/self/status").exists() {
        let mib = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
        assert_eq!(mib(r, "head_cache_mib"), 32.0, "the replay's heads open with listen's page cache: {r}");
        let base = mib(r, "base_rss_mib");
        for side in ["shared", "unshared"] {
            let s = &r[side];
            let (peak, engines, per_head) = (mib(s, "peak_rss_mib"), mib(s, "engines_mib"), mib(s, "per_head_mib"));
            assert!(base > 0.0 && engines > 0.0 && per_head > 0.0, "{side}: {r}");
            assert!((peak - base - engines - 3.0 * per_head).abs() < 0.01, "{side}: the figures add up: {r}");
            assert!(per_head <= 256.0, "{side}: {per_head:.0} MiB a head: {r}");
        }
        assert_eq!(mib(r, "per_head_mib"), mib(&r["shared"], "per_head_mib").max(mib(&r["unshared"], "per_head_mib")));
    }
}

/// A closed index of a few hundred entries made by `replay --db`, and its bytes.
fn small_index(dir: &tempfile::TempDir, name: &str, capacity: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    let out = run(&[
        "replay",
        "--requests",
        "200",
        "--capacity",
        capacity,
        "--no-baseline",
        "--no-back-to-back",
        "--db",
        path.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    path
}

fn entries(path: &Path) -> u64 {
    let out = run(&["stats", path.to_str().expect("utf-8"), "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
    stats["entries"].as_u64().expect("entries")
}

/// `replay --db` on an existing file never changes its capacity (which evicts for good) unless
/// `--resize` says so; refused, it says what it would evict and leaves the file as it was.
#[test]
fn replay_refuses_to_change_an_existing_files_capacity_unless_asked() {
    let dir = tempdir();
    let path = small_index(&dir, "e.redb", "100000");
    let p = path.to_str().expect("utf-8");
    let before = entries(&path);
    assert!(before > 1000, "{before}");
    let bytes = std::fs::read(&path).expect("read");
    let out = run(&["replay", "--requests", "10", "--capacity", "10", "--no-baseline", "--db", p]);
    assert_eq!(out.status.code(), Some(2), "refused: {}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(said.contains("--resize") && said.contains("evicting at least"), "{said}");
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "the file is byte for byte as it was");
    let cache = run(&["replay", "--requests", "10", "--node-cache-blocks", "64", "--no-baseline", "--db", p]);
    assert_eq!(cache.status.code(), Some(2), "{}", text(&cache.stderr));
    // The same capacity, or none, is no change.
    let same =
        run(&["replay", "--requests", "10", "--capacity", "100000", "--no-baseline", "--no-back-to-back", "--db", p]);
    assert!(same.status.success(), "{}", text(&same.stderr));
    assert!(entries(&path) >= before);
    let asked = run(&[
        "replay",
        "--requests",
        "10",
        "--capacity",
        "500",
        "--resize",
        "--no-baseline",
        "--no-back-to-back",
        "--db",
        p,
    ]);
    assert!(asked.status.success(), "{}", text(&asked.stderr));
    assert!(entries(&path) <= 500 + 200, "resized when asked");
}

/// A side file that says a head wrote the index, beside no index or an empty one: the index was
/// lost, and nothing silently starts a new one there.
#[test]
fn a_lost_index_beside_its_seal_is_refused_never_replaced() {
    let dir = tempdir();
    let path = small_index(&dir, "lost.redb", "100000");
    let p = path.to_str().expect("utf-8");
    std::fs::File::create(&path).expect("truncate to 0 bytes");
    let out = run(&["replay", "--requests", "10", "--no-baseline", "--db", p]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("was lost"), "{}", text(&out.stderr));
    assert_eq!(std::fs::metadata(&path).expect("still there").len(), 0, "nothing created in its place");
    let repair = run(&["check", "--repair", p]);
    assert!(!repair.status.success() && text(&repair.stderr).contains("was lost"), "{}", text(&repair.stderr));
    std::fs::remove_file(&path).expect("remove");
    let out = run(&["import", concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json"), p]);
    assert!(text(&out.stderr).contains("was lost"), "{}", text(&out.stderr));
    assert!(!path.exists(), "a missing index stays missing");
    assert!(superfluid_warm::IndexFile::new(&path).seal_path().exists(), "its side file is kept");
    let lib = superfluid_warm::Warm::open(&path);
    assert!(matches!(lib, Err(superfluid_warm::Error::FileLost { .. })), "{lib:?}");
}

/// `check --repair` of a path with no file says so, and creates nothing.
#[test]
fn check_repair_of_a_missing_file_creates_nothing() {
    let dir = tempdir();
    let missing = dir.path().join("missing.redb");
    let out = run(&["check", "--repair", missing.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no index file here"), "{}", text(&out.stderr));
    assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 0, "nothing created");
}

/// A failed import removes only what it created: a symlink that was there stays, dangling or
/// looping; a bad file onto an index leaves it byte for byte; clocks that leave no room are
/// refused.
#[cfg(unix)]
#[test]
fn a_failed_import_removes_only_what_it_created() {
    let dir = tempdir();
    let good = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").expect("write");
    let b = bad.to_str().expect("utf-8");
    let dangling = dir.path().join("dangling.redb");
    std::os::unix::fs::symlink(dir.path().join("target.redb"), &dangling).expect("symlink");
    let out = run(&["import", b, dangling.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(std::fs::symlink_metadata(&dangling).is_ok(), "the dangling symlink is still there");
    assert!(!superfluid_warm::IndexFile::new(&dangling).seal_path().exists(), "and no side file beside it");
    // A chain of dangling links: the links stay, whatever the import.
    let chain = dir.path().join("chain.redb");
    std::os::unix::fs::symlink(&dangling, &chain).expect("symlink to a symlink");
    let out = run(&["import", b, chain.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        std::fs::symlink_metadata(&chain).is_ok() && std::fs::symlink_metadata(&dangling).is_ok(),
        "both links kept"
    );
    let looping = dir.path().join("loop.redb");
    std::os::unix::fs::symlink(&looping, &looping).expect("symlink loop");
    for old in [b, good] {
        let out = run(&["import", old, looping.to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        assert!(std::fs::symlink_metadata(&looping).is_ok(), "the looping symlink is still there");
    }
    // Through a dangling symlink a good import creates its target; a failing one leaves none.
    let out = run(&["import", good, dangling.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(dir.path().join("target.redb").is_file());

    let index = small_index(&dir, "kept.redb", "100000");
    let (bytes, seal) = (
        std::fs::read(&index).expect("read"),
        std::fs::read(superfluid_warm::IndexFile::new(&index).seal_path()).expect("seal"),
    );
    let wraps = dir.path().join("wraps.json");
    std::fs::write(&wraps, r#"{"prefixes":[[1,"n",18446744073709551615],[2,"n",3]]}"#).expect("write");
    for old in [b, wraps.to_str().expect("utf-8")] {
        let out = run(&["import", old, index.to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
        assert!(text(&out.stderr).contains("cannot import"), "{}", text(&out.stderr));
        assert_eq!(std::fs::read(&index).expect("read"), bytes, "the index is byte for byte as it was");
        assert_eq!(
            std::fs::read(superfluid_warm::IndexFile::new(&index).seal_path()).expect("seal"),
            seal,
            "and its seal"
        );
    }
    let err = superfluid_warm::LegacyJson::read(&wraps).expect_err("a clock with no room after it");
    assert!(err.to_string().contains("clock 18446744073709551615"), "{err}");
}

/// Commands that fail on a path that is not an index leave no side file, and name the user's
/// path; `compact` of a missing file speaks as the other commands do.
#[test]
fn failed_commands_leave_no_files_and_name_the_users_path() {
    let dir = tempdir();
    let notes = dir.path().join("text.redb");
    std::fs::write(&notes, "plain text, not an index").expect("write");
    let n = notes.to_str().expect("utf-8");
    let good = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0001-from-0.1.7-json/warm.json");
    for args in [vec!["compact", n], vec!["import", good, n], vec!["compact", dir.path().to_str().expect("utf-8")]] {
        let out = run(&args);
        assert!(!out.status.success(), "{args:?}");
        assert!(!text(&out.stderr).contains("panicked"), "{args:?}: {}", text(&out.stderr));
    }
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["text.redb".to_string()], "no side file left behind");
    let missing = run(&["compact", dir.path().join("missing.redb").to_str().expect("utf-8")]);
    assert!(text(&missing.stderr).contains("no index file here"), "{}", text(&missing.stderr));
    let nowhere = dir.path().join("no/such/dir/x.redb");
    let out = run(&["replay", "--requests", "5", "--no-baseline", "--db", nowhere.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("x.redb: its folder does not exist"), "{}", text(&out.stderr));
    if cfg!(unix) {
        let out = run(&["compact", "/dev/null"]);
        assert!(text(&out.stderr).contains("not a regular file"), "{}", text(&out.stderr));
    }
}

/// `forget` of a node the file does not name changes nothing, not even the schema; one that
/// upgrades says so.
#[test]
fn forget_of_an_unknown_node_never_upgrades_the_file() {
    let dir = tempdir();
    let path = dir.path().join("v2.redb");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0003-tree-chain/warm-v2.redb"), &path)
        .expect("copy the schema 2 fixture");
    let p = path.to_str().expect("utf-8");
    let bytes = std::fs::read(&path).expect("read");
    let out = run(&["forget", p, "node-x"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("not known"), "{}", text(&out.stdout));
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "unchanged, still schema 2");
    let out = run(&["forget", p, "node-1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("forgotten"), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("upgraded") && text(&out.stderr).contains("from schema 2"),
        "{}",
        text(&out.stderr)
    );
}

/// A file a crashed head left: the commands that write recover it and say so.
#[test]
fn writing_commands_recover_a_crashed_heads_file_and_say_so() {
    let dir = tempdir();
    for command in ["compact", "forget"] {
        let path = dir.path().join(format!("{command}.redb"));
        let p = path.to_str().expect("utf-8");
        let (mut child, _lines) = writer(&path, 5);
        child.kill().expect("kill");
        child.wait().expect("reaped");
        let out = if command == "forget" { run(&["forget", p, "node-1"]) } else { run(&["compact", p]) };
        assert!(out.status.success(), "{command}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("recovered"), "{command}: {}", text(&out.stderr));
        assert_eq!(run(&["check", p]).status.code(), Some(0), "{command} left it healthy");
    }
}

/// The side file of a running head deleted: readers still see a live head (not a crash), and
/// `check` says what went wrong.
#[test]
fn a_deleted_side_file_of_a_running_head_is_detected() -> Result<(), superfluid_warm::Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let p = path.to_str().expect("utf-8");
    let warm = superfluid_warm::Warm::builder().sync_window(Duration::ZERO).open(&path)?;
    warm.ran("m", &(0..640).collect::<Vec<u32>>(), "a")?;
    std::fs::remove_file(superfluid_warm::IndexFile::new(&path).seal_path()).expect("delete the side file");
    let stats = run(&["stats", p, "--json"]);
    assert!(stats.status.success(), "a live head, not a crash: {}", text(&stats.stderr));
    let s: serde_json::Value = serde_json::from_slice(&stats.stdout).expect("stats JSON");
    assert_eq!(s["side_file_missing"], true, "{s}");
    assert_eq!(s["entries"], 10);
    assert!(run(&["dump", p]).status.success());
    let check = run(&["check", p]);
    assert_eq!(check.status.code(), Some(2), "{}", text(&check.stdout));
    assert!(text(&check.stdout).contains("side file"), "{}", text(&check.stdout));
    warm.close()?;
    assert_eq!(run(&["check", p]).status.code(), Some(0), "closed cleanly: sealed again");
    Ok(())
}

/// Every replay option is checked up front: out of range is a usage error (exit 2) naming the
/// option; a request too long for memory is refused by its line.
#[test]
fn replay_options_and_trace_lines_are_checked_up_front() {
    for (option, value) in [
        ("--threads", "100000"),
        ("--min-share", "2"),
        ("--min-share", "NaN"),
        ("--vocab", "0"),
        ("--window", "0"),
        ("--capacity", "0"),
        ("--nodes", "0"),
        ("--requests", "0"),
        ("--nodes-per-prefix", "1000"),
    ] {
        let out = run(&["replay", "--requests", "5", option, value]);
        assert_eq!(out.status.code(), Some(2), "{option} {value}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(option), "{option}: {}", text(&out.stderr));
    }
    let dir = tempdir();
    let trace = dir.path().join("huge.jsonl");
    let ok = r#"{"timestamp":0,"input_length":600,"output_length":1,"hash_ids":[1,2]}"#;
    let huge = format!(
        r#"{{"timestamp":1,"input_length":4294967295,"output_length":1,"hash_ids":[{}]}}"#,
        "7,".repeat(9) + "7"
    );
    std::fs::write(&trace, format!("{ok}\n{huge}\n")).expect("write");
    let started = Instant::now();
    let out = run(&["replay", "--trace", trace.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("trace line 2") && text(&out.stderr).contains("4294967295"),
        "{}",
        text(&out.stderr)
    );
    assert!(started.elapsed() < Duration::from_secs(60), "refused, not allocated");
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").expect("write");
    let out = run(&["replay", "--trace", empty.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("no request"), "{}", text(&out.stderr));
    let help = run(&["check", "--help"]);
    assert!(text(&help.stdout).contains("1: the file could not be checked"), "{}", text(&help.stdout));
}

/// `dump` as a pipeline's first command: a reader that stops early ends it quietly; `--limit 0`
/// shows nothing; the table streams, with its columns in line; an unknown node is an error with
/// the file's nodes named.
#[test]
fn dump_behaves_in_a_pipeline_and_its_table_lines_up() -> Result<(), superfluid_warm::Error> {
    let dir = tempdir();
    let path = small_index(&dir, "many.redb", "100000");
    let p = path.to_str().expect("utf-8");
    for args in [vec!["dump", p], vec!["dump", p, "--json"], vec!["stats", p]] {
        let mut child =
            Command::new(bin()).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("runs");
        let mut first = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut first).expect("a line");
        // The reader goes away (`| head -1`).
        let out = child.wait_with_output().expect("ends");
        assert!(!first.is_empty());
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out.stderr));
        assert!(out.stderr.is_empty(), "{args:?} quiet: {}", text(&out.stderr));
    }
    let none = run(&["dump", p, "--limit", "0"]);
    assert!(text(&none.stdout).ends_with("0 entries shown\n"), "{}", text(&none.stdout));
    assert_eq!(text(&none.stdout).lines().count(), 2, "the header and the count: {}", text(&none.stdout));
    let one = run(&["dump", p, "--limit", "1"]);
    assert!(text(&one.stdout).ends_with("1 entry shown\n"), "{}", text(&one.stdout));
    let unknown = run(&["dump", p, "--node", "nobody"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(text(&unknown.stderr).contains("node-0"), "names the file's nodes: {}", text(&unknown.stderr));
    // A forgotten node's mark fits its column.
    let forgotten = dir.path().join("forgotten.redb");
    {
        let warm = superfluid_warm::Warm::open(&forgotten)?;
        warm.ran("m", &(0..320).collect::<Vec<u32>>(), "node-3")?;
        warm.forget_node("node-3")?;
        warm.ran("m", &(1000..1320).collect::<Vec<u32>>(), "b")?;
        warm.close()?;
    }
    let table = run(&["dump", forgotten.to_str().expect("utf-8")]);
    let table = text(&table.stdout);
    let lines: Vec<&str> = table.lines().collect();
    let clock_end = |l: &str| l.find("clock").map(|i| i + 5);
    let header_end = clock_end(lines[0]).expect("a clock column");
    for row in &lines[1..lines.len() - 1] {
        let digits_end = row[..header_end].trim_end().len();
        assert_eq!(digits_end, header_end, "columns in line:\n{}", lines.join("\n"));
    }
    Ok(())
}

/// The replay's report reads as a report: a one-line summary, what was replayed (as many
/// requests as asked, of the built-in workload too), numbers with separators, 0.1.7 explained.
#[test]
fn the_replay_report_says_what_it_found_in_plain_words() {
    let out = run(&["replay", "--requests", "2000", "--no-back-to-back"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report = text(&out.stdout);
    let first = report.lines().next().unwrap_or_default();
    assert!(first.contains("of prompt tokens routed to a node that already held them warm"), "{report}");
    assert!(report.contains("Replayed 2,000 requests"), "{report}");
    assert!(!report.contains("3000") && !report.contains("3,000"), "{report}");
    assert!(report.contains("0.1.7 = superfluid 0.1.7's design"), "{report}");
    assert!(report.contains("--json"), "{report}");
    let big = report.split_whitespace().filter(|w| w.chars().all(|c| c.is_ascii_digit()) && w.len() > 4).count();
    assert_eq!(big, 0, "big numbers have separators: {report}");
    // A capacity smaller than one prompt: 0.1.7's rule lets the `ran` overshoot, and `stats` says why.
    let dir = tempdir();
    let small = dir.path().join("small.redb");
    {
        let warm = superfluid_warm::Warm::builder().capacity(100).open(&small).expect("open");
        warm.ran("m", &(0..50 * 64).collect::<Vec<u32>>(), "a").expect("ran");
        // The eviction this `ran` brings takes the first one's 50 blocks; its own 200 stay.
        warm.ran("m", &(100_000..100_000 + 200 * 64).collect::<Vec<u32>>(), "b").expect("ran");
        warm.close().expect("close");
    }
    let stats = text(&run(&["stats", small.to_str().expect("utf-8")]).stdout);
    assert!(stats.contains("% used) (over: 0.1.7's rule"), "{stats}");
    let more = run(&["replay", "--requests", "4000", "--json", "--no-baseline", "--no-back-to-back"]);
    let r: serde_json::Value = serde_json::from_slice(&more.stdout).expect("JSON");
    assert_eq!(r["requests"], 4000, "the built-in workload makes as many requests as asked");
}

/// `replay --engine-events`: engines publish vLLM's events over loopback ZMQ, the index claims
/// what they hold (never warm on what only a restarted engine's old process held, once the
/// restart is seen), and the same events are applied again back to back.
#[test]
fn replay_over_engines_that_publish_their_kv_events() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/mooncake-conversation.jsonl");
    let args = ["replay", "--trace", trace, "--requests", "600", "--json", "--engine-events", "--engine-cache-blocks"];
    let out = run(&[&args[..], &["4096", "--restart-every", "100"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    assert_eq!(r["requests"], 600);
    assert_eq!(r["restarts"], 5);
    assert!(f("claimed_share") > 0.01 && f("cached_share") > 0.01, "{r}");
    assert!((f("claimed_share") - f("cached_share")).abs() < 0.01, "claims follow the engines: {r}");
    assert_eq!(r["warm_to_restarted_seen"], 0, "{r}");
    assert!(f("block_events") > 1000.0 && f("ingest_events_per_s") > 0.0, "{r}");
    let bad = run(&["replay", "--engine-events", "--threads", "2"]);
    assert!(!bad.status.success(), "--engine-events and --threads do not go together");
}

/// `ask` answers `warm_nodes` from a file's last commit, the same as the head that wrote it: on
/// a closed file, and on one a head has open (its committed changes), engine streams included.
#[test]
fn ask_answers_from_the_last_commit_of_a_closed_or_live_file() -> Result<(), superfluid_warm::Error> {
    use superfluid_warm::tools::engine_sim::SimEngine;
    use superfluid_warm::{ReadIndex, Warm};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ask.redb");
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|c| (0..64 * (3 + c)).map(|t| c * 100_000 + t).collect()).collect();
    let file = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = prompts.iter().map(|p| serde_json::to_string(p).expect("json")).collect();
    std::fs::write(&file, lines.join("\n") + "\n[1, 2, 3]\n").expect("prompts");
    let warm = Warm::open(&path)?;
    for (i, p) in prompts.iter().enumerate().take(4) {
        warm.ran("m", p, &format!("node-{}", i % 2))?;
    }
    // gpu-0's engine holds the last two prompts.
    let mut engine = SimEngine::new(16, 1 << 16, "m", None)?;
    for p in &prompts[4..] {
        warm.engine_batch("gpu-0", &engine.run(p))?;
    }
    warm.sync()?;
    let want: Vec<Vec<superfluid_warm::Hit>> =
        prompts.iter().map(|p| warm.warm_nodes("m", p)).collect::<Result<_, _>>()?;
    assert_eq!(want[5].first().map(|h| h.node.as_str()), Some("gpu-0"), "{want:?}");
    let ask = |what: &str| -> Vec<serde_json::Value> {
        let out = run(&[
            "ask",
            path.to_str().expect("utf-8"),
            "--model",
            "m",
            "--prompts",
            file.to_str().expect("utf-8"),
            "--json",
        ]);
        assert!(out.status.success(), "{what}: {}", text(&out.stderr));
        json_lines(&out)
    };
    let check = |lines: &[serde_json::Value], what: &str| {
        assert_eq!(lines.len(), 7, "{what}");
        for (line, want) in lines.iter().zip(&want) {
            let got: Vec<(String, u64)> = line["warm_nodes"]
                .as_array()
                .expect("warm nodes")
                .iter()
                .map(|h| (h["node"].as_str().unwrap_or_default().to_string(), h["tokens"].as_u64().unwrap_or(0)))
                .collect();
            let want: Vec<(String, u64)> = want.iter().map(|h| (h.node.clone(), h.tokens as u64)).collect();
            assert_eq!(got, want, "{what}: line {}", line["line"]);
        }
        assert_eq!(lines[6]["warm_nodes"], serde_json::json!([]), "a prompt under two blocks");
    };
    check(&ask("live"), "live");
    // gpu-1's engine alone holds a prompt of model `e`: a model is known by its engine blocks too.
    let mut other = SimEngine::new(16, 1 << 16, "e", None)?;
    warm.engine_batch("gpu-1", &other.run(&prompts[0]))?;
    warm.close()?;
    check(&ask("closed"), "closed");
    // A prompt warm nowhere of a model the file holds is not a typo; one of a model it never
    // held is told so, naming the models it has.
    let asked = |model: &str| {
        let p = path.to_str().expect("utf-8");
        let out = run(&["ask", p, "--model", model, "--prompts", file.to_str().expect("utf-8")]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stderr)
    };
    assert_eq!(asked("m"), "", "a known model");
    assert_eq!(asked("e"), "", "a model only an engine holds");
    let typo = asked("mm");
    assert!(typo.contains("holds no block of model `mm`") && typo.contains("its models: e, m"), "{typo}");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "[1, -2]\n").expect("bad prompts");
    let out = run(&["ask", path.to_str().expect("utf-8"), "--model", "m", "--prompts", bad.to_str().expect("utf-8")]);
    assert!(!out.status.success() && text(&out.stderr).contains("line 1"), "{}", text(&out.stderr));
    Ok(())
}

/// Readers (`stats`, `check`, `ask`) racing a `listen` that creates a new file: while the head
/// has not finished making it, they say it is being created and to retry, never that it is not
/// an index (which told operators to start another file); `check` does not call it a problem.
#[test]
fn readers_racing_a_new_file_are_told_it_is_being_created() {
    let dir = tempdir();
    let path = dir.path().join("new.redb");
    let p = path.to_str().expect("utf-8").to_string();
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts, "[1, 2, 3]\n").expect("prompts");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    let (mut being_created, mut read) = (0, 0);
    for round in 0..12 {
        for f in [path.clone(), dir.path().join("new.redb.seal"), dir.path().join("new.redb.listen.json")] {
            let _ = std::fs::remove_file(f);
        }
        let mut listen = common::Reaped(
            Command::new(bin())
                .args(["listen", &p, "--engine", &format!("gpu-0=tcp://127.0.0.1:{port}"), "--model", "m"])
                .args(["--status-every", "0"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn listen"),
        );
        let status = dir.path().join("new.redb.listen.json");
        let started = Instant::now();
        let mut rounds = 0;
        // Until the head has made the file and listens (and a few reads after).
        while rounds < 3 || !status.exists() {
            assert!(started.elapsed() < Duration::from_secs(60), "listen did not start");
            let reads = [
                ("stats", vec!["stats", &p, "--json"]),
                ("check", vec!["check", &p]),
                ("ask", vec!["ask", &p, "--model", "m", "--prompts", prompts.to_str().expect("utf-8")]),
            ];
            for (what, args) in &reads {
                let out = run(args);
                let err = text(&out.stderr);
                assert!(
                    !err.contains("not an index this build can open") && !err.contains("start a new index"),
                    "round {round}: {what} racing a new file: {err}"
                );
                if err.contains("being created") {
                    being_created += 1;
                    assert!(err.contains("retry"), "{what}: says to retry: {err}");
                    assert_eq!(out.status.code(), Some(1), "{what}: not a problem found: {err}");
                } else if out.status.success() {
                    read += 1;
                }
            }
            if status.exists() {
                rounds += 1;
            }
        }
        let term = Command::new("kill").arg("-TERM").arg(listen.0.id().to_string()).status().expect("kill");
        assert!(term.success());
        assert!(listen.0.wait().expect("listen ends").success());
    }
    println!("{being_created} reads found the file being created, {read} read it");
    assert!(read > 0, "the readers read the file once made");
}
